"""Bits to a total-bits budget: the loosest per-layer cap (``VPTQConfig.layer_bits_cap``) whose model total,
codebooks, outliers and permutations included, stays within a budget.

A per-layer cap steps a layer whose codebooks are expensive next to its weights (a small k/v projection
with a v6 k4096 codebook) down to a shorter vector length at the same index bits, so the budget's bits go
to the large layers, where a long vector's codebook is cheap. The cap equal to the budget always meets it
(no layer exceeds it); a looser cap can too, when small layers leave room under the budget for large ones
just above it. ``cap_for_budget`` tries every cap at which some layer's choice changes and keeps the one
that spends most of the budget. Everything is computed from the
layer shapes alone, so the bits shown before a run are exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .bits import BitsInfo
from .config import VPTQConfig
from .vptq_layers import config_bits, shape_bits


def model_bits(config: VPTQConfig, shapes: Iterable[tuple[int, int]]) -> BitsInfo:
    """Bits of every layer shape (out, in) under ``config`` (its cap applied)."""
    total = BitsInfo(0, 0, 0)
    for out_features, in_features in shapes:
        total = total + config_bits(config, out_features, in_features)
    return total


def candidate_caps(config: VPTQConfig, shapes: Iterable[tuple[int, int]]) -> list[float]:
    """Every cap at which some layer's settings change: the total bits per weight of each vector length of
    the ladder (``vptq.layer_config``) for each distinct shape, ascending."""
    caps = set()
    base = dataclasses.replace(config, layer_bits_cap=0.0)
    bits, res_bits = base.index_bits / base.vector_len, base.res_bits / base.vector_len
    for out_features, in_features in set(shapes):
        for v in range(base.vector_len, 0, -1):
            k = 2 ** min(16, max(1, round(bits * v)))
            k_res = 2 ** min(16, max(1, round(res_bits * v))) if base.num_res_centroids else 0
            step = dataclasses.replace(base, vector_len=v, num_centroids=k, num_res_centroids=min(k_res, k))
            caps.add(shape_bits(step, out_features, in_features).total_bits_per_weight)
    return sorted(caps)


def cap_for_budget(config: VPTQConfig, shapes: Iterable[tuple[int, int]], budget: float) -> tuple[float, BitsInfo]:
    """(cap, bits): the ``layer_bits_cap`` for ``config`` whose model total bits per weight over ``shapes`` is
    the largest that is <= ``budget`` (the loosest such cap on ties), and the model's bits with it.

    ValueError (naming the budget and the least the ladder reaches) when no cap meets the budget."""
    shapes = list(shapes)
    if not shapes:
        raise ValueError("no layer shapes to allocate bits to")
    best: tuple[float, float, BitsInfo] | None = None  # (total, cap, bits)
    lowest = None
    for cap in candidate_caps(config, shapes):
        try:
            bits = model_bits(dataclasses.replace(config, layer_bits_cap=cap), shapes)
        except ValueError:  # some layer has no vector length under this cap
            continue
        total = bits.total_bits_per_weight
        lowest = total if lowest is None else min(lowest, total)
        if total <= budget and (best is None or total >= best[0]):
            best = (total, cap, bits)
    if best is None:
        reach = f"the least it reaches is {lowest:.3f}" if lowest is not None else "no cap fits every layer"
        res = f", num_res_centroids {config.num_res_centroids}" if config.num_res_centroids else ""
        raise ValueError(f"bits_budget {budget} cannot be met on this model with vector_len {config.vector_len}, "
                         f"num_centroids {config.num_centroids}{res}: {reach}")
    return best[1], best[2]


def resolve_budget(config: VPTQConfig, shapes: Iterable[tuple[int, int]]) -> VPTQConfig:
    """``config`` with its ``bits_budget`` turned into the ``layer_bits_cap`` that ``cap_for_budget`` finds for
    these shapes (the budget is kept, so resolving again gives the same config). ValueError when the budget
    cannot be met, or when ``layer_bits_cap`` is set to something else as well."""
    budget = config.bits_budget
    cap, _ = cap_for_budget(dataclasses.replace(config, layer_bits_cap=0.0, bits_budget=0.0, allocation="cap"),
                            shapes, budget)
    if config.layer_bits_cap and config.layer_bits_cap != cap:
        raise ValueError(f"bits_budget {budget:g} and layer_bits_cap {config.layer_bits_cap:g} are both set: set "
                         f"one of them (for this model the budget means layer_bits_cap {cap:.6g})")
    return dataclasses.replace(config, layer_bits_cap=cap)


def budget_for_model(config: VPTQConfig, shapes: Iterable[tuple[int, int]]) -> VPTQConfig:
    """The config a VPTQ run on a model with these layer shapes uses (``Method.for_model``): with
    ``bits_budget``, ``resolve_budget``'s cap; the config itself without a budget, or with allocation
    "sensitivity" when no cap meets the budget (the per-layer plan's ladder reaches lower, and says so itself
    when it cannot either). ValueError when the budget cannot be met or a different cap is set too."""
    if not config.bits_budget:
        return config
    try:
        return resolve_budget(config, shapes)
    except ValueError:
        if config.allocation != "sensitivity":
            raise
        return config
