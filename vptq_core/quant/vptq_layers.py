"""Which settings a VPTQ layer of a given shape gets, and how many bits it takes: known from the config and the
shape alone, before any work (the bits shown before a run, the budget's cap, the per-layer plan, the time
estimate and the quantizer itself all use these).
"""

from __future__ import annotations

import dataclasses
import math

from .bits import BitsInfo, vq_bits
from .config import VPTQConfig


def outlier_columns(in_features: int, percent: float, group_num: int) -> int:
    """How many input columns the outlier codebook serves, so the rest splits evenly into groups."""
    size = math.ceil(in_features * percent / 100.0) if percent > 0 else 0
    while (in_features - size) % group_num:
        size += 1
    if size >= in_features:
        raise ValueError(f"outlier_percent {percent} leaves no columns for the main codebook")
    return size


def fit_sample(config: VPTQConfig, k: int) -> int:
    """Vectors k-means fits on: at most ``kmeans_sample``, and at most 64 per centroid (more barely moves
    the centroids, and the fit's cost grows with it)."""
    return min(config.kmeans_sample, 64 * k)


def config_bits(config: VPTQConfig, out_features: int, in_features: int) -> BitsInfo:
    """Bits a layer of this shape will take under ``config`` (what the app shows before a run)."""
    return shape_bits(layer_config(config, out_features, in_features), out_features, in_features)


def layer_config(config: VPTQConfig, out_features: int, in_features: int) -> VPTQConfig:
    """The settings a layer of this shape is quantized with: ``config`` itself, or with ``layer_bits_cap``
    set and the layer's total bits above it, the same index bits per weight at the longest shorter vector
    length that fits (k = 2^round(bits * v), residual likewise; v6 k4096 -> v5 k1024 -> v4 k256 -> ...).
    ValueError when not even vector length 1 fits."""
    cap = config.layer_bits_cap
    if not cap or shape_bits(config, out_features, in_features).total_bits_per_weight <= cap:
        return config
    bits = config.index_bits / config.vector_len
    res_bits = config.res_bits / config.vector_len
    tried = []
    for v in range(config.vector_len - 1, 0, -1):
        k = 2 ** min(16, max(1, round(bits * v)))
        k_res = 2 ** min(16, max(1, round(res_bits * v))) if config.num_res_centroids else 0
        candidate = dataclasses.replace(config, vector_len=v, num_centroids=k, num_res_centroids=min(k_res, k))
        total = shape_bits(candidate, out_features, in_features).total_bits_per_weight
        if total <= cap:
            return candidate
        tried.append(f"v{v} k{k}: {total:.3f}")
    raise ValueError(f"layer_bits_cap {cap}: no vector length fits a {out_features}x{in_features} layer "
                     f"({'; '.join(tried[-2:])} total bits per weight)")


def shape_bits(config: VPTQConfig, out_features: int, in_features: int) -> BitsInfo:
    """Bits of a layer of this shape under exactly these settings (no cap applied)."""
    outliers = outlier_columns(in_features, config.outlier_percent, config.group_num)
    return vq_bits(
        out_features, in_features, config.vector_len, config.num_centroids, config.num_res_centroids, outliers,
        config.outlier_vector_len, config.outlier_centroids, config.group_num, config.enable_norm,
        config.enable_perm or outliers > 0, config.codebook_bits,
    )
