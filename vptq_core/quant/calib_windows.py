"""Which calibration windows each stage of a run sees: the windows end-to-end distillation holds out to check
its steps (held out of the block-by-block stage too), and the windows of that stage the original model writes
itself (docs/methods.md#self-written-calibration, #end-to-end-distillation).

Every count reads a config's distillation settings through ``distill_settings``, so a new method's config that
does not carry them (not a ``DistillSettings``) counts as "no distillation, text calibration".
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .config import DistillSettings

_DISTILL_FIELDS = tuple(f.name for f in dataclasses.fields(DistillSettings))


def distill_settings(config) -> DistillSettings:
    """``config``'s distillation settings: ``config`` itself when it is a ``DistillSettings`` (every built-in
    method's config), else a ``DistillSettings`` with the fields ``config`` has and the defaults for the others
    (0 distillation steps, no self-written calibration, no time budget)."""
    if isinstance(config, DistillSettings):
        return config
    return DistillSettings(**{name: getattr(config, name) for name in _DISTILL_FIELDS if hasattr(config, name)})


def holdout_count(n: int, fraction: float) -> int:
    """Windows held out of ``n``: round(n * fraction), at least 1 when fraction > 0 and n >= 2, and never all."""
    if fraction <= 0 or n < 2:
        return 0
    return min(n - 1, max(1, round(n * fraction)))


def layerwise_count(n: int, config) -> int:
    """Calibration windows of ``n`` the block-by-block stage sees: all of them, except the ones end-to-end
    distillation (``distill_iters`` > 0) checks on. Those are held out of every stage, so the check that picks
    the kept step scores text no stage has fitted: block-wise training fits its own windows closely, and a check
    on them would keep the undistilled model."""
    settings = distill_settings(config)
    if settings.distill_iters <= 0:
        return n
    return n - holdout_count(n, settings.distill_holdout)


def with_heldout(samples: int, config) -> int:
    """How many calibration windows to draw so that ``samples`` of them reach the block-by-block stage: the
    smallest n with ``layerwise_count(n, config) >= samples`` (36 for 32 samples and the default held-out
    fraction 0.125; ``samples`` itself without distillation). ``data.calibration_windows`` draws its windows
    from one seed stream, so the first ``samples`` of n are the ``samples`` windows a run without distillation uses:
    the held-out windows come on top of the calibration instead of out of it."""
    n = max(int(samples), 1)
    while layerwise_count(n, config) < samples:
        n += 1
    return n


def sampled_count(windows: int, config) -> int:
    """How many of the ``windows`` the block-by-block stage sees are written by the original model:
    round(``calib_sampled_share`` x windows), at least 1 when the share is > 0."""
    share = distill_settings(config).calib_sampled_share
    if share <= 0 or windows < 1:
        return 0
    return min(windows, max(1, math.floor(share * windows + 0.5)))


def written_rows(n: int, config) -> torch.Tensor:
    """The rows of ``n`` calibration windows (held-out check windows included) that ``sampled_calibration``
    has the original model write: the last ``sampled_count`` of the ``layerwise_count`` the blocks see."""
    stage = layerwise_count(n, config)
    return torch.arange(stage - sampled_count(stage, config), stage)
