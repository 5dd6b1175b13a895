"""Which calibration windows each stage sees (``quant/calib_windows.py``), for built-in configs and for a new
method's config that carries no distillation settings."""

import dataclasses
from types import SimpleNamespace

from vptq_core.quant.calib_windows import (
    distill_settings,
    holdout_count,
    layerwise_count,
    sampled_count,
    with_heldout,
    written_rows,
)
from vptq_core.quant.config import DistillSettings, ScalarConfig


def test_holdout_count():
    assert [holdout_count(n, 0.125) for n in (1, 2, 8, 16, 32)] == [0, 1, 1, 2, 4]
    assert holdout_count(16, 0.0) == 0


def test_a_config_without_distillation_settings_counts_as_no_distillation_on_text():
    plain = SimpleNamespace(bits=3, seed=5)
    settings = distill_settings(plain)
    assert isinstance(settings, DistillSettings) and settings.seed == 5
    assert (settings.distill_iters, settings.calib_sampled_share, settings.time_budget) == (0, 0.0, 0.0)
    assert layerwise_count(36, plain) == 36 and with_heldout(32, plain) == 32
    assert sampled_count(32, plain) == 0 and written_rows(36, plain).numel() == 0
    # the fields such a config has are read
    partial = SimpleNamespace(distill_iters=4, distill_holdout=0.25, calib_sampled_share=0.5)
    assert layerwise_count(8, partial) == 6 and sampled_count(6, partial) == 3
    assert written_rows(8, partial).tolist() == [3, 4, 5]


def test_a_built_in_config_is_its_own_distillation_settings():
    config = ScalarConfig(bits=3, group_size=16, distill_iters=2, distill_holdout=0.125, calib_sampled_share=0.25)
    assert distill_settings(config) is config
    assert with_heldout(32, config) == 36 and layerwise_count(36, config) == 32
    assert written_rows(36, config).tolist() == list(range(24, 32))
    assert with_heldout(32, dataclasses.replace(config, distill_iters=0)) == 32
