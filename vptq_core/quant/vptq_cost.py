"""What VPTQ's own work costs before a run, in seconds on the reference machine (quant/cost.py): each layer's
k-means, sweep and the rest (``vptq_layer_phases``, with the layer's own settings), and the bit plan by
sensitivity measured before the first block (``allocation_seconds``).

Fitted on layers quantized alone with their real Hessians (bench/quant_cost.py: SmolLM2 shapes x many settings,
d 2-16, k 256-65536; docs/results.md). A nearest-centroid query through the k-d tree costs
exp(a + b d + c log2 k + e d log2 k) microseconds on one thread (``KD_QUERY``; ``KD_QUERY_2T`` with k-means' two
workers), the native SIMD search k (``NATIVE_DIM`` + d) ``NATIVE_S``, brute force ``BRUTE_S`` per centroid
coordinate; a sweep column a fixed ``SEARCH_CALL_S`` per codebook search on top, the error feedback
``FEEDBACK_S`` per weight; a k-means iteration ``KMEANS_ITER_S`` on top of its queries; the rest of a layer
(Hessian preparation, inverse Cholesky, dequantization, proxy loss) ``LAYER_S`` + ``LAYER_WEIGHT_S`` per weight
+ ``LAYER_HESSIAN_S`` per in_features³.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from .config import VPTQConfig
from .cost import KD_STEP_S, RunSize
from .device import nearest_backend
from .kmeans import cpu_auto_backend
from .vptq_layers import fit_sample, layer_config, outlier_columns

# The fit was made while the machine ran slower than during the runs the other constants come from: this brings
# the layer estimates to the machine alone and unhurried, as the other constants are.
VPTQ_SCALE = 0.78
NATIVE_S = 0.036e-9
NATIVE_DIM = 1.1
KD_QUERY = (-2.124, 0.0111, -0.0192, 0.0457)
KD_QUERY_2T = (-2.046, 0.0233, 0.0140, 0.0327)
BRUTE_S = 0.06e-9
SEARCH_CALL_S = 63e-6
FEEDBACK_S = 0.17e-6
KMEANS_ITER_S = 3.7e-3
LAYER_S = 5e-3
LAYER_WEIGHT_S = 23e-9
LAYER_HESSIAN_S = 31e-12
# The bit plan's measurement per measured window: the labels drawn from a forward pass, then a forward and backward
# pass (no weight gradients) accumulating every linear's Hessian, about two distillation steps (bench/run_stages.py:
# priced as one step, the measurement ran 1.4 to 2.2 times over the block stage's ratio to its estimate).
SENS_WINDOW_S = 2 * KD_STEP_S


def search_backend(d: int, k: int) -> str:
    """The search ``kmeans.CodebookSearch`` will pick for a CPU float32 codebook of k d-vectors, without building
    or waiting for the native kernels."""
    from vptq_core.kernels import native

    choice = nearest_backend()
    return cpu_auto_backend(d, k, native.expected) if choice == "auto" else choice


def query_seconds(d: int, k: int, threads: int = 1) -> float:
    """Seconds of one nearest-centroid query of a d-vector among k centroids (``kmeans.CodebookSearch``)."""
    backend = search_backend(d, k)
    if backend == "native":
        return NATIVE_S * k * (NATIVE_DIM + d) / max(1, threads)
    if backend != "kdtree":
        return BRUTE_S * d * k
    a, b, c, e = KD_QUERY_2T if threads > 1 else KD_QUERY
    bits = math.log2(k)
    return 1e-6 * math.exp(a + b * d + c * bits + e * d * bits)


def kmeans_seconds(n: int, d: int, k: int, config: VPTQConfig, threads: int) -> float:
    """Seconds of ``weighted_kmeans`` on n d-vectors: (iters + 1) searches of the fitted sample (none when
    n <= k: every vector is its own centroid)."""
    if n <= k:
        return 0.0
    fit = min(n, fit_sample(config, k))
    return (config.kmeans_iters + 1) * (fit * query_seconds(d, k, threads) + KMEANS_ITER_S)


def vptq_layer_phases(out_features: int, in_features: int, config: VPTQConfig, threads: int = 2) -> dict[str, float]:
    """Seconds the phases of ``vptq_quantize`` take for one [out, in] layer under ``config`` (its per-layer
    settings, ``vptq_layers.layer_config``): k-means per codebook segment (outliers, groups, residual), the sweep
    (one search call per column and codebook; with a residual codebook a first sweep, then one with both), and the
    rest (Hessian preparation, inverse Cholesky, dequantization and proxy loss). Keys kmeans, sweep, other,
    whole."""
    lc = layer_config(config, out_features, in_features)
    outliers = outlier_columns(in_features, lc.outlier_percent, lc.group_num)
    segments = [(outliers, lc.outlier_vector_len, lc.outlier_centroids, 0)] if outliers else []
    group = (in_features - outliers) // lc.group_num
    segments += [(group, lc.vector_len, lc.num_centroids, lc.num_res_centroids)] * lc.group_num
    kmeans = sweep = 0.0
    for columns, d, k, k_res in segments:
        rows = math.ceil(out_features / d)
        kmeans += kmeans_seconds(rows * columns, d, k, lc, threads)
        call = SEARCH_CALL_S + rows * query_seconds(d, k)
        if k_res:
            kmeans += kmeans_seconds(rows * columns, d, k_res, lc, threads)
            call = 2 * call + SEARCH_CALL_S + rows * query_seconds(d, k_res)
        sweep += columns * call
    sweep += FEEDBACK_S * out_features * in_features * (2 if lc.num_res_centroids else 1)
    other = LAYER_S + LAYER_WEIGHT_S * out_features * in_features + LAYER_HESSIAN_S * in_features ** 3
    phases = {"kmeans": kmeans, "sweep": sweep, "other": other}
    phases = {name: VPTQ_SCALE * seconds for name, seconds in phases.items()}
    return {**phases, "whole": sum(phases.values())}


# A bit plan by sensitivity gives many layers smaller codebooks than the capped v{vector_len} k{num_centroids} that
# ``vptq_seconds`` prices (fewer vectors fitted, cheaper searches). The plan is not known before the run, so a
# planned run is priced at PLANNED_SHARE of the capped layout's price for its codebook width: the price of the
# layers as planned over that of the same layers capped, in 15 SmolLM2-135M runs' reports (8-bit codebooks at 2.5
# bits: 0.518-0.534 over 7 runs; 16-bit at 3.5 bits: 0.551-0.561 over 8; bench/results/presets_cli_amd.txt). A pure
# ratio of prices, the same on every machine: what the device makes of the work is its measured pace
# (``_pace``, ``block_pace``). It replaced a share of the k-means alone fitted to whole runs' seconds at the speed
# probe's pace (0.86 of it with 8-bit codebooks), which held the two apart on one machine only.
PLANNED_SHARE = {16: 0.56, 8: 0.53}


def vptq_seconds(size: RunSize, config: VPTQConfig) -> float:
    """VPTQ's block work (``Method.cost``): every block linear's phases, each distinct shape priced once, times
    ``size.block_scale`` (the measured pace of that work, ``vptq._pace``); a per-layer plan still to be made at
    ``PLANNED_SHARE`` of the capped layout's price for its codebook width."""
    planned = config.allocation == "sensitivity" and not config.layer_plan
    share = PLANNED_SHARE[config.codebook_bits] if planned else 1.0
    total = sum(count * vptq_layer_phases(*shape, config)["whole"]
                for shape, count in collections.Counter(size.linear_shapes).items())
    return share * total * size.block_scale


def allocation_seconds(size: RunSize, config: VPTQConfig) -> float:
    """Rough seconds of measuring a per-layer plan (``sensitivity.plan_config``) before the first block: the
    measured windows' forward and backward passes (``size.plan_windows``, else ``config.sensitivity_windows``, at
    most the calibration's), every linear's inverse Hessian, and k-means over the ladder for each distinct layer
    shape; 0 unless ``config.allocation`` is "sensitivity" and the config has no plan yet."""
    if config.allocation != "sensitivity" or config.layer_plan:
        return 0.0
    from .sensitivity import DISTORTION_ITERS, ladder

    windows = size.plan_windows or config.sensitivity_windows
    if size.samples > 0:
        windows = min(windows, int(size.samples))
    seconds = windows * SENS_WINDOW_S * size.pass_params * max(int(size.seqlen) - 1, 1)
    # each linear's damped inverse Hessian in the sweep's order, for its error feedback weight (as the block stage)
    seconds += sum(LAYER_S + LAYER_HESSIAN_S * in_features ** 3 for _, in_features in size.linear_shapes)
    fit = dataclasses.replace(config, kmeans_iters=DISTORTION_ITERS)
    for out_features, in_features in set(size.linear_shapes):
        for v, k in ladder(config):
            n = math.ceil(out_features / v) * in_features
            seconds += kmeans_seconds(n, v, k, fit, 2) + n * query_seconds(v, k, 2)
    return VPTQ_SCALE * seconds
