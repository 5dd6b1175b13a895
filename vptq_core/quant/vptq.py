"""VPTQ for one linear layer (METHODS.md section 1).

Vectors run along the output dimension inside one input column: column ``j`` of ``W`` [out, in] is cut
into ``out / v`` vectors of ``v`` consecutive output channels. Codebooks come from Hessian-weighted
k-means (every vector of column ``j`` weighs ``H_jj``); then the columns are swept in order, each one
replaced by its nearest centroids and its error spread onto the remaining columns with the inverse
Hessian's Cholesky factor (GPTQ-style, lazy block updates).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .bits import BitsInfo, vq_bits
from .config import DISTILL_LR, PRESET_OFF, VPTQConfig
from .distill import DISTILL_HOOK, distill_label
from .finetune import finetune_block_centroids
from .hessian import inverse_hessian_cholesky, prepare_hessian, proxy_loss
from .kmeans import CodebookSearch, weighted_kmeans
from .methods import BlockHook, Method, PlanHook, QuantResult, register
from .refit import CodebookUse, refit_codebooks
from .states import VQLayerState
from .sweep import error_feedback_sweep
from .timing import Timings


@dataclass
class _Segment:
    """Contiguous stored columns [start, end) sharing one codebook (and maybe a residual codebook)."""

    start: int
    end: int
    vector_len: int
    centroids: torch.Tensor | None = None  # [k, v]
    res_centroids: torch.Tensor | None = None  # [k_res, v]
    indices: torch.Tensor | None = None  # [rows, end - start]
    res_indices: torch.Tensor | None = None

    def vectors(self, column: torch.Tensor) -> torch.Tensor:
        """[out] -> [rows, v], zero-padding the last vector."""
        pad = (-column.shape[0]) % self.vector_len
        return F.pad(column, (0, pad)).view(-1, self.vector_len)


def outlier_columns(in_features: int, percent: float, group_num: int) -> int:
    """How many input columns the outlier codebook serves, so the rest splits evenly into groups."""
    size = math.ceil(in_features * percent / 100.0) if percent > 0 else 0
    while (in_features - size) % group_num:
        size += 1
    if size >= in_features:
        raise ValueError(f"outlier_percent {percent} leaves no columns for the main codebook")
    return size


def _column_vectors(W: torch.Tensor, v: int) -> torch.Tensor:
    """W [out, n] -> [n * rows, v]: each column cut into vectors of v output channels."""
    pad = (-W.shape[0]) % v
    return F.pad(W, (0, 0, 0, pad)).T.reshape(-1, v)


def _assign(seg: _Segment, w: torch.Tensor, search: CodebookSearch, res_search: CodebookSearch | None):
    """Quantize one column w [out] with the segment's codebook(s) -> (q [out], idx [rows], ridx | None)."""
    vec = seg.vectors(w)
    idx = search(vec)
    q = seg.centroids[idx]
    ridx = None
    if seg.res_centroids is not None and res_search is not None:
        ridx = res_search(vec - q)
        q = q + seg.res_centroids[ridx]
    return q.reshape(-1)[: w.shape[0]], idx, ridx


def _sweep(
    W: torch.Tensor, U: torch.Tensor, segments: list[_Segment], block_size: int, second_order: bool,
    collect_residuals: bool = False,
) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
    """Quantize W [out, in] (stored order) with the segments' codebooks and error feedback; fills the segments'
    indices. Returns (Q [out, in], the residual vectors per segment when ``collect_residuals``)."""
    W = W.clone()
    out = W.shape[0]
    Q = torch.zeros_like(W)
    segment_of: list[int] = []
    for s, seg in enumerate(segments):
        segment_of += [s] * (seg.end - seg.start)
        seg.indices = torch.zeros(math.ceil(out / seg.vector_len), seg.end - seg.start, dtype=torch.long,
                                  device=W.device)
        seg.res_indices = torch.zeros_like(seg.indices) if seg.res_centroids is not None else None
    searches = [CodebookSearch(seg.centroids) for seg in segments]
    res_searches = [None if seg.res_centroids is None else CodebookSearch(seg.res_centroids) for seg in segments]
    residuals: dict[int, list[torch.Tensor]] = {s: [] for s in range(len(segments))}

    def quantize_column(j: int, w: torch.Tensor) -> torch.Tensor:
        s = segment_of[j]
        seg = segments[s]
        q, idx, ridx = _assign(seg, w, searches[s], res_searches[s])
        Q[:, j] = q
        seg.indices[:, j - seg.start] = idx
        if ridx is not None:
            seg.res_indices[:, j - seg.start] = ridx
        if collect_residuals:
            residuals[s].append(seg.vectors(w - q))
        return q

    error_feedback_sweep(W, U, quantize_column, block_size, second_order)
    return Q, residuals


def _fit_sample(config: VPTQConfig, k: int) -> int:
    """Vectors k-means fits on: at most ``kmeans_sample``, and at most 64 per centroid (more barely moves
    the centroids, and the fit's cost grows with it)."""
    return min(config.kmeans_sample, 64 * k)


@dataclass
class ColumnLayout:
    """Stored column order of a layer: ``perm[i]`` is the original column stored at ``i`` (None = natural
    order); the first ``outlier_size`` stored columns are the outliers; ``segments`` cover the stored columns
    (the outlier segment first, then one per group)."""

    perm: torch.Tensor | None
    outlier_size: int
    group_size: int
    segments: list[_Segment]

    @property
    def main_segments(self) -> list[_Segment]:
        return self.segments[1:] if self.outlier_size else self.segments


def column_layout(diag: torch.Tensor, config: VPTQConfig) -> ColumnLayout:
    """Column order and codebook segments from the Hessian diagonal ``diag`` [in] (METHODS.md 1.5-1.7)."""
    in_features = diag.shape[0]
    outlier_size = outlier_columns(in_features, config.outlier_percent, config.group_num)
    by_importance = torch.argsort(diag, descending=True, stable=True)
    if config.enable_perm:
        perm = by_importance
    elif outlier_size:
        # Outlier columns must come first in stored order; the rest keep their natural order.
        outliers = by_importance[:outlier_size]
        rest = torch.ones(in_features, dtype=torch.bool, device=diag.device)
        rest[outliers] = False
        perm = torch.cat([outliers, torch.arange(in_features, device=diag.device)[rest]])
    else:
        perm = None
    group_size = (in_features - outlier_size) // config.group_num
    segments = [_Segment(0, outlier_size, config.outlier_vector_len)] if outlier_size else []
    for g in range(config.group_num):
        start = outlier_size + g * group_size
        segments.append(_Segment(start, start + group_size, config.vector_len))
    return ColumnLayout(perm, outlier_size, group_size, segments)


def _segment_weights(diag: torch.Tensor, seg: _Segment, vectors: torch.Tensor) -> torch.Tensor:
    """Every vector of stored column j weighs H_jj (the diagonal part of the objective)."""
    rows = vectors.shape[0] // (seg.end - seg.start)
    return diag[seg.start : seg.end].repeat_interleave(rows)


def fit_codebooks(W: torch.Tensor, diag: torch.Tensor, layout: ColumnLayout, config: VPTQConfig) -> None:
    """Hessian-weighted k-means codebook per segment, on the (normalised, permuted) weight W [out, in]."""
    for s, seg in enumerate(layout.segments):
        k = config.outlier_centroids if layout.outlier_size and s == 0 else config.num_centroids
        vectors = _column_vectors(W[:, seg.start : seg.end], seg.vector_len)
        seg.centroids = weighted_kmeans(
            vectors, _segment_weights(diag, seg, vectors), k, config.kmeans_iters, seed=config.seed + s,
            sample=_fit_sample(config, k),
        ).centroids


def fit_residual_codebooks(residuals: dict[int, list[torch.Tensor]], diag: torch.Tensor, layout: ColumnLayout,
                           config: VPTQConfig) -> None:
    """Residual codebook per main segment: weighted k-means on what the first sweep left."""
    first = 1 if layout.outlier_size else 0
    for s, seg in enumerate(layout.segments[first:], start=first):
        vectors = torch.cat(residuals[s])
        seg.res_centroids = weighted_kmeans(
            vectors, _segment_weights(diag, seg, vectors), config.num_res_centroids, config.kmeans_iters,
            seed=config.seed + 1000 + s, sample=_fit_sample(config, config.num_res_centroids),
        ).centroids


def build_state(layout: ColumnLayout, config: VPTQConfig, out_features: int, in_features: int,
                weight_scale: torch.Tensor | None, weight_bias: torch.Tensor | None,
                bias: torch.Tensor | None) -> VQLayerState:
    """The ``VQLayerState`` of a swept layout (indices unpacked)."""
    main = layout.main_segments
    residual = config.num_res_centroids > 0
    outliers = layout.segments[0] if layout.outlier_size else None
    return VQLayerState(
        in_features=in_features, out_features=out_features, vector_len=config.vector_len,
        num_centroids=config.num_centroids, group_num=config.group_num, group_size=layout.group_size,
        centroids=torch.stack([seg.centroids.reshape(-1) for seg in main]),
        indices=torch.stack([seg.indices for seg in main]),
        num_res_centroids=config.num_res_centroids if residual else -1,
        res_centroids=torch.stack([seg.res_centroids.reshape(-1) for seg in main]) if residual else None,
        res_indices=torch.stack([seg.res_indices for seg in main]) if residual else None,
        outlier_vector_len=config.outlier_vector_len if outliers else -1,
        num_outlier_centroids=config.outlier_centroids if outliers else -1,
        outlier_size=layout.outlier_size,
        outlier_centroids=outliers.centroids.reshape(1, -1) if outliers else None,
        outlier_indices=outliers.indices.unsqueeze(0) if outliers else None,
        perm=layout.perm, weight_scale=weight_scale, weight_bias=weight_bias,
        bias=None if bias is None else bias.detach().clone(),
    )


def vptq_quantize(
    W: torch.Tensor, H: torch.Tensor, config: VPTQConfig, bias: torch.Tensor | None = None,
    hessian_cache: dict | None = None,
) -> QuantResult:
    """Quantize ``W`` [out, in] against Hessian ``H`` [in, in] -> ``QuantResult`` with a ``VQLayerState``.

    ``hessian_cache``: optional dict shared by layers with the same input (see ``inverse_hessian_cholesky``).
    """
    out_features, in_features = W.shape
    if H.shape != (in_features, in_features):
        raise ValueError(f"H must be [{in_features}, {in_features}], got {tuple(H.shape)}")
    config = layer_config(config, out_features, in_features)
    timings = Timings(kmeans=0.0, inverse_hessian=0.0, sweep=0.0)
    W_orig = W.detach().float()
    Wd, Hd = prepare_hessian(W_orig, H.detach(), config.damp_percent)

    # Optional per-input-column normalisation W = W'·scale + bias; the objective becomes tr(ΔW' S H S ΔW'ᵀ).
    weight_scale = weight_bias = None
    if config.enable_norm:
        wmax, wmin = Wd.max(dim=0).values, Wd.min(dim=0).values
        weight_bias = (wmax + wmin) / 2
        weight_scale = ((wmax - wmin) / 2).clamp(min=1e-8)
        Wd = (Wd - weight_bias) / weight_scale
        Hd = Hd * weight_scale.unsqueeze(0) * weight_scale.unsqueeze(1)

    layout = column_layout(torch.diag(Hd), config)
    if layout.perm is not None:
        Wd, Hd = Wd[:, layout.perm], Hd[layout.perm][:, layout.perm]
    diag = torch.diag(Hd)

    with timings.timed("kmeans"):
        fit_codebooks(Wd, diag, layout, config)
    with timings.timed("inverse_hessian"):
        U = inverse_hessian_cholesky(Hd, hessian_cache)
    residual = config.num_res_centroids > 0
    with timings.timed("sweep"):
        Q, residuals = _sweep(Wd, U, layout.segments, config.block_size, config.second_order,
                              collect_residuals=residual)
    if residual:
        # Residual codebooks fitted on what the first sweep left, then the sweep again from the original W.
        with timings.timed("kmeans"):
            fit_residual_codebooks(residuals, diag, layout, config)
        with timings.timed("sweep"):
            Q, _ = _sweep(Wd, U, layout.segments, config.block_size, config.second_order)

    if config.refit_iters > 0:
        uses = [CodebookUse(seg.centroids, seg.indices, seg.start) for seg in layout.segments]
        uses += [CodebookUse(seg.res_centroids, seg.res_indices, seg.start) for seg in layout.segments
                 if seg.res_centroids is not None]
        with timings.timed("refit"):
            refit_codebooks(Wd, Hd, uses, config.refit_iters)
    state = build_state(layout, config, out_features, in_features, weight_scale, weight_bias, bias)
    W_hat = state.dequantize()
    loss, rel = proxy_loss(W_orig, W_hat, H.float())
    rel_w = float(torch.linalg.norm(W_hat - W_orig) / torch.linalg.norm(W_orig).clamp(min=1e-12))
    return QuantResult(state=state, weight=W_hat, proxy_loss=loss, rel_proxy_loss=rel, rel_weight_error=rel_w,
                       timings=dict(timings))


def config_bits(config: VPTQConfig, out_features: int, in_features: int) -> BitsInfo:
    """Bits a layer of this shape will take under ``config`` (what the app shows before a run)."""
    return _shape_bits(layer_config(config, out_features, in_features), out_features, in_features)


def layer_config(config: VPTQConfig, out_features: int, in_features: int) -> VPTQConfig:
    """The settings a layer of this shape is quantized with: ``config`` itself, or with ``layer_bits_cap``
    set and the layer's total bits above it, the same index bits per weight at the longest shorter vector
    length that fits (k = 2^round(bits * v), residual likewise; v6 k4096 -> v5 k1024 -> v4 k256 -> ...).
    ValueError when not even vector length 1 fits."""
    cap = config.layer_bits_cap
    if not cap or _shape_bits(config, out_features, in_features).total_bits_per_weight <= cap:
        return config
    bits = config.index_bits / config.vector_len
    res_bits = config.res_bits / config.vector_len
    tried = []
    for v in range(config.vector_len - 1, 0, -1):
        k = 2 ** min(16, max(1, round(bits * v)))
        k_res = 2 ** min(16, max(1, round(res_bits * v))) if config.num_res_centroids else 0
        candidate = dataclasses.replace(config, vector_len=v, num_centroids=k, num_res_centroids=min(k_res, k))
        total = _shape_bits(candidate, out_features, in_features).total_bits_per_weight
        if total <= cap:
            return candidate
        tried.append(f"v{v} k{k}: {total:.3f}")
    raise ValueError(f"layer_bits_cap {cap}: no vector length fits a {out_features}x{in_features} layer "
                     f"({'; '.join(tried[-2:])} total bits per weight)")


def _shape_bits(config: VPTQConfig, out_features: int, in_features: int) -> BitsInfo:
    outliers = outlier_columns(in_features, config.outlier_percent, config.group_num)
    return vq_bits(
        out_features, in_features, config.vector_len, config.num_centroids, config.num_res_centroids, outliers,
        config.outlier_vector_len, config.outlier_centroids, config.group_num, config.enable_norm,
        config.enable_perm or outliers > 0,
    )


def describe(settings) -> str:
    """Short label of VPTQ settings, e.g. ``v6 k4096 +res256 out0.5%``."""
    text = f"v{settings.get('vector_len')} k{settings.get('num_centroids')}"
    if settings.get("num_res_centroids"):
        text += f" +res{settings['num_res_centroids']}"
    if settings.get("outlier_percent"):
        text += f" out{settings['outlier_percent']}%"
    if (settings.get("group_num") or 1) > 1:
        text += f" g{settings['group_num']}"
    if settings.get("enable_norm"):
        text += " norm"
    if settings.get("bits_budget"):
        text += f" budget{settings['bits_budget']:g}"
    elif settings.get("layer_bits_cap"):
        text += f" cap{settings['layer_bits_cap']:g}"
    if settings.get("finetune_iters"):
        text += f" ft{settings['finetune_iters']}"
    return text + distill_label(settings)


def _finetune_hook(ctx) -> dict | None:
    return finetune_block_centroids(ctx.block, ctx.states, ctx.inputs, ctx.targets, ctx.forward, ctx.config,
                                    should_stop=ctx.should_stop)


def _plan_hook(model, calib_ids, config, device, should_stop):
    from .sensitivity import plan_config  # imports this module

    return plan_config(model, calib_ids, config, device, config_bits, should_stop)


# Presets are named by TOTAL bits per weight (codebooks, outliers, permutation included) and hold on any model. "2.5
# bits" and "3.5 bits" are budgets for the whole model, spent where the loss feels the error (``allocation``
# "sensitivity", quant/sensitivity.py: each layer its own vector length and codebook size, measured before the first
# block). SmolLM2, CLI, 16 windows, Zen 4 machine with AVX-512 BF16: "2.5 bits" (2.4999 total) wiki / pydocs 1.94x /
# 1.92x against 2.42x / 2.26x with the cap allocation below, 6:27 wall; "3.5 bits" (3.4998 total) 1.236x / 1.225x
# against 1.366x / 1.330x with the per-layer cap of 3.5 (3.31 total) it had; a 3.6 budget 1.213x / 1.192x (README,
# "Bits where the loss feels them"). Since: "2.5 bits" takes 80 steps (1.891x / 1.889x in 8:21) and "3.5 bits" half the
# distillation step (DISTILL_LR_3BIT: 1.233x / 1.213x in 6:37; a 3.6 budget 1.219x / 1.188x; README, "The step size at
# 3.5 bits"); 80 steps at 3.5 bits gave nothing (1.247x / 1.235x), nor did the codebook refit after distillation.
# "3.5 bits" with seed 1: 1.235x / 1.202x. Outlier codebooks of 64 entries instead of 256 cost 9% there, 512 gain
# nothing, unsorted columns cost 3% (README, "What else was tried at 3.5 bits").
# Before that, "2.5 bits" was a budget for the whole model (``bits_budget``: the loosest per-layer cap whose model
# total stays within it, found for each model before its run; SmolLM2-135M: cap 3.014, 2.496 total bits, k/v and
# q/o at v5 k1024, gate/up/down at v6 k4096). On the Zen 3 machine, CLI, same 10 minutes: wiki / pydocs 2.43x /
# 2.63x bf16 against 2.69x / 2.90x with the per-layer cap of 2.5 it had before (2.37 total bits; README, "Spending
# the whole budget").
# "3.5 bits" and "4.5 bits" cap every layer (3.31 and 4.11 total on SmolLM2): "3.5 bits" at its budget's cap (3.44
# total) was mixed, wiki 1.398x against 1.368x, pydocs 1.339x against 1.362x; where a layer's codebook is expensive it
# gets a shorter vector at the same index bits. With the faster distillation step of the same round, "2.5 bits" ran 36
# steps instead of 18: 2.33x / 2.47x. In "2.5 bits" and "3.5 bits" a share of the calibration windows is written by
# the original model itself (``calib_sampled_share``) and the run ends with end-to-end distillation on those
# calibration windows, as many steps as fit 10 minutes on 2 cores for SmolLM2 (AMD machine, CLI, wiki / pydocs x bf16
# perplexity; README, "Calibrating on text the model writes itself"): with 3/4 self-written windows "2.5 bits" went
# from 2.57x / 2.62x with 32 steps to 2.46x / 2.48x with 48 (64, checked every 16: 2.43x / 2.51x), "3.5 bits" from
# 1.40x / 1.41x with 16 steps (half self-written) to 1.37x / 1.33x with 48.
# Where writing those windows would take more than 20% of the time budget (distill.SAMPLING_BUDGET_SHARE; Gemma-3-270M
# on the AVX2 machine) they stay text: 1.70x / 1.93x there against 6.26x / 4.17x with them.
# (distill_samples is named so that picking the preset resets every distillation field of the form)
# The run's pipeline must end within this many seconds (loading and writing the checkpoint take ~10-20 s more): on a
# slower machine distillation runs fewer steps instead of running late (an AVX2-only Zen 3 took 1076 s for the
# "2.5 bits" recipe without it).
PRESET_TIME_BUDGET = 570.0
# At 3.5 bits the step that suits 2.5 bits overshoots: from one cached "3.5 bits" quantization (SmolLM2, 48 steps,
# bench/distill_variants.py --row preset-3.5, 16 windows per text) lr 5e-3 never improved the held-out check (step 0
# kept: 1.33x / 1.28x), 2.5e-3 gave 1.236x / 1.226x, 1.25e-3 1.234x / 1.212x (KL 0.268 / 0.225 against 0.279 /
# 0.239) and 6.25e-4 1.247x / 1.218x.
DISTILL_LR_3BIT = 1.25e-3
_PRESET_DISTILL = {"distill_data": "calibration", "distill_samples": 16, "distill_eval_every": 8,
                   "time_budget": PRESET_TIME_BUDGET}
_PRESET_NO_REFIT = {"refit_iters": 0}  # every VPTQ preset leaves the codebook refit off (README, "The step size ...")
PRESETS = {
    "2.5 bits": {"vector_len": 6, "num_centroids": 4096, "num_res_centroids": 0, "bits_budget": 2.5,
                 "layer_bits_cap": 0.0, "allocation": "sensitivity", "distill_iters": 80, "distill_lr": DISTILL_LR,
                 "calib_sampled_share": 0.75, **_PRESET_DISTILL, **_PRESET_NO_REFIT},
    "3.5 bits": {"vector_len": 4, "num_centroids": 4096, "num_res_centroids": 0, "layer_bits_cap": 0.0,
                 "bits_budget": 3.5, "allocation": "sensitivity", "distill_iters": 48, "distill_lr": DISTILL_LR_3BIT,
                 "calib_sampled_share": 0.75, **_PRESET_DISTILL, **_PRESET_NO_REFIT},
    "4.5 bits": {"vector_len": 4, "num_centroids": 256, "num_res_centroids": 256, "layer_bits_cap": 4.5,
                 "bits_budget": 0.0, "allocation": "cap", "distill_lr": DISTILL_LR, **PRESET_OFF, **_PRESET_NO_REFIT},
}

METHOD = register(Method(
    name="vptq", label="VPTQ", config_class=VPTQConfig, bits=config_bits, describe=describe, presets=PRESETS,
    description="vector quantization: Hessian-weighted k-means codebooks with second-order error feedback",
    quantize_linear=lambda W, H, config, bias, cache: vptq_quantize(W, H, config, bias, hessian_cache=cache),
    before_blocks=(PlanHook("allocation", lambda config: config.allocation == "sensitivity" and not config.layer_plan,
                            _plan_hook),),
    after_block=(BlockHook("finetune", lambda config: config.finetune_iters > 0, _finetune_hook),),
    after_model=(DISTILL_HOOK,),
))
