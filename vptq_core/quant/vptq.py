"""VPTQ for one linear layer (docs/methods.md#vptq).

Vectors run along the output dimension inside one input column: column ``j`` of ``W`` [out, in] is cut
into ``out / v`` vectors of ``v`` consecutive output channels. Codebooks come from Hessian-weighted
k-means (every vector of column ``j`` weighs ``H_jj``); then the columns are swept in order, each one
replaced by its nearest centroids and its error spread onto the remaining columns with the inverse
Hessian's Cholesky factor (GPTQ-style, lazy block updates).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .allocate import budget_for_model
from .codebook_grid import snap
from .config import DISTILL_LR, PRESET_BUDGET, PRESET_OFF, VPTQConfig
from .distill_hook import DISTILL_HOOK, settings_needs
from .hessian import inverse_hessian_cholesky, prepare_hessian, proxy_loss
from .kmeans import CodebookSearch, weighted_kmeans
from .methods import BlockHook, Method, PlanHook, QuantResult, RunNeeds, register
from .refit import CodebookUse, refit_codebooks
from .states import VQLayerState
from .sweep import error_feedback_sweep
from .timing import Timings
from .vptq_cost import allocation_seconds, vptq_layer_phases, vptq_seconds
from .vptq_layers import (  # noqa: F401 - shape_bits / layer_config are imported from here by callers
    config_bits,
    fit_sample,
    layer_config,
    outlier_columns,
    shape_bits,
)


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
    """Column order and codebook segments from the Hessian diagonal ``diag`` [in] (docs/methods.md#vptq)."""
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


def _stored(centroids: torch.Tensor, vector_len: int, config: VPTQConfig) -> torch.Tensor:
    """A fitted codebook [k, v] as the checkpoint will store it: on its 8-bit grid with ``codebook_bits`` 8, so
    the sweep assigns against the stored centroids."""
    return snap(centroids.reshape(1, -1), vector_len).reshape(centroids.shape) if config.codebook_bits == 8 \
        else centroids


def fit_codebooks(W: torch.Tensor, diag: torch.Tensor, layout: ColumnLayout, config: VPTQConfig) -> None:
    """Hessian-weighted k-means codebook per segment, on the (normalised, permuted) weight W [out, in]."""
    for s, seg in enumerate(layout.segments):
        k = config.outlier_centroids if layout.outlier_size and s == 0 else config.num_centroids
        vectors = _column_vectors(W[:, seg.start : seg.end], seg.vector_len)
        seg.centroids = weighted_kmeans(
            vectors, _segment_weights(diag, seg, vectors), k, config.kmeans_iters, seed=config.seed + s,
            sample=fit_sample(config, k),
        ).centroids
        seg.centroids = _stored(seg.centroids, seg.vector_len, config)


def fit_residual_codebooks(residuals: dict[int, list[torch.Tensor]], diag: torch.Tensor, layout: ColumnLayout,
                           config: VPTQConfig) -> None:
    """Residual codebook per main segment: weighted k-means on what the first sweep left."""
    first = 1 if layout.outlier_size else 0
    for s, seg in enumerate(layout.segments[first:], start=first):
        vectors = torch.cat(residuals[s])
        seg.res_centroids = weighted_kmeans(
            vectors, _segment_weights(diag, seg, vectors), config.num_res_centroids, config.kmeans_iters,
            seed=config.seed + 1000 + s, sample=fit_sample(config, config.num_res_centroids),
        ).centroids
        seg.res_centroids = _stored(seg.res_centroids, seg.vector_len, config)


def compact_indices(indices: torch.Tensor, codes: int) -> torch.Tensor:
    """``indices`` of a codebook of ``codes`` rows as the state keeps them: int16 holding uint16 patterns (as the
    public format stores outlier indices; ``as_index`` reads them back) when the codes fit 16 bits, a quarter of
    int64's memory (a 0.5B model's states held 0.7 GB of int64 indices through the run); else as they are."""
    return indices.to(torch.int16) if codes <= 1 << 16 else indices


def build_state(layout: ColumnLayout, config: VPTQConfig, out_features: int, in_features: int,
                weight_scale: torch.Tensor | None, weight_bias: torch.Tensor | None,
                bias: torch.Tensor | None) -> VQLayerState:
    """The ``VQLayerState`` of a swept layout (indices unpacked)."""
    main = layout.main_segments
    residual = config.num_res_centroids > 0
    outliers = layout.segments[0] if layout.outlier_size else None
    state = VQLayerState(
        in_features=in_features, out_features=out_features, vector_len=config.vector_len,
        num_centroids=config.num_centroids, group_num=config.group_num, group_size=layout.group_size,
        centroids=torch.stack([seg.centroids.reshape(-1) for seg in main]),
        indices=compact_indices(torch.stack([seg.indices for seg in main]), config.num_centroids),
        num_res_centroids=config.num_res_centroids if residual else -1,
        res_centroids=torch.stack([seg.res_centroids.reshape(-1) for seg in main]) if residual else None,
        res_indices=compact_indices(torch.stack([seg.res_indices for seg in main]), config.num_res_centroids)
        if residual else None,
        outlier_vector_len=config.outlier_vector_len if outliers else -1,
        num_outlier_centroids=config.outlier_centroids if outliers else -1,
        outlier_size=layout.outlier_size,
        outlier_centroids=outliers.centroids.reshape(1, -1) if outliers else None,
        outlier_indices=outliers.indices.unsqueeze(0) if outliers else None,
        perm=layout.perm, weight_scale=weight_scale, weight_bias=weight_bias,
        bias=None if bias is None else bias.detach().clone(), codebook_bits=config.codebook_bits,
    )
    return state


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
    if config.refit_iters > 0:
        state.snap_codebooks()  # 8-bit codebooks: the refit moved them off the grid k-means put them on
    W_hat = state.dequantize()
    loss, rel = proxy_loss(W_orig, W_hat, H.float())
    rel_w = float(torch.linalg.norm(W_hat - W_orig) / torch.linalg.norm(W_orig).clamp(min=1e-12))
    return QuantResult(state=state, weight=W_hat, proxy_loss=loss, rel_proxy_loss=rel, rel_weight_error=rel_w,
                       timings=dict(timings))


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
    from .distill import distill_label  # the training module, loaded when a label is asked for

    return text + distill_label(settings)


def _finetune_hook(ctx) -> dict | None:
    from .finetune import finetune_block_centroids  # the training is loaded when a block is fine-tuned

    return finetune_block_centroids(ctx.block, ctx.states, ctx.inputs, ctx.targets, ctx.forward, ctx.config,
                                    should_stop=ctx.should_stop)


def _plans(config: VPTQConfig) -> bool:
    return config.allocation == "sensitivity" and not config.layer_plan


def _plan_hook(model, calib_ids, config, device, should_stop, progress=None):
    from .sensitivity import plan_config  # the measurement is loaded when a plan is made

    return plan_config(model, calib_ids, config, device, config_bits, should_stop, progress)


def _needs(config: VPTQConfig) -> RunNeeds:
    return settings_needs(config, target_chain=config.target_chain)


# Presets are named by total bits per weight (codebooks, outliers, permutation included) and hold on any model. Why
# each value: docs/usage.md#presets.
# "2.5 bits" and "3.5 bits" spend a budget for the whole model where the loss feels the error (allocation
# "sensitivity"), have the original write three quarters of the calibration windows itself and end with
# end-to-end distillation on them, as many steps as fit the time budget; "4.5 bits" caps every layer.
# The "-best" presets are the same recipes for a GPU or an hour of CPU: no time budget, so every planned step
# runs whatever the machine.
# At 3.5 bits the distillation step that suits 2.5 bits overshoots: half of it scored best on held-out text.
DISTILL_LR_3BIT = 1.25e-3
# distill_samples is named so that picking the preset resets every distillation field of the form
_PRESET_DISTILL = {"distill_data": "calibration", "distill_samples": 16, "distill_eval_every": 8, **PRESET_BUDGET}
_PRESET_NO_REFIT = {"refit_iters": 0}  # every VPTQ preset leaves the codebook refit off: it did not help them
# 20 k-means iterations, not the default 5: on the dev split the "2.5 bits" recipe's KL fell 4.0% on wiki and 2.6%
# on pydocs (3 seeds), the "3.5 bits" one's 5.6% and 6.1% (2 seeds), every seed lower on both texts, for about 22 s
# more of the block stage on the bundled model (bench/results/presets_cli_dev_spr.txt). Every preset names its
# iterations, so picking one resets the form's.
_PRESET_KMEANS = {"kmeans_iters": 20}
_DEFAULT_KMEANS = {"kmeans_iters": VPTQConfig().kmeans_iters}
# 8-bit codebooks (codebook_grid.py): the plan spends the bits they save on index bits and larger codebooks. On the
# dev split the "2.5 bits" recipe's KL fell 4.7% / 6.5% on wiki and 7.1% / 7.0% on pydocs (seeds 0 and 1; every
# seed lower on both texts; bench/results/presets_cli_dev_spr.txt). The "3.5 bits" recipe keeps 16-bit ones: with 8-bit
# ones its plan bought larger codebooks for little more index bits, and its dev KL was mixed (wiki +3.7% / +1.9%,
# pydocs -3.5% / +0.2%) for 4x the k-means time.
_CODEBOOK_8 = {"codebook_bits": 8}
_CODEBOOK_16 = {"codebook_bits": 16}
PRESETS = {
    "2.5 bits": {"vector_len": 6, "num_centroids": 4096, "num_res_centroids": 0, "bits_budget": 2.5,
                 "layer_bits_cap": 0.0, "allocation": "sensitivity", "distill_iters": 80, "distill_lr": DISTILL_LR,
                 "calib_sampled_share": 0.75, **_PRESET_DISTILL, **_PRESET_NO_REFIT, **_PRESET_KMEANS, **_CODEBOOK_8},
    "3.5 bits": {"vector_len": 4, "num_centroids": 4096, "num_res_centroids": 0, "layer_bits_cap": 0.0,
                 "bits_budget": 3.5, "allocation": "sensitivity", "distill_iters": 48, "distill_lr": DISTILL_LR_3BIT,
                 "calib_sampled_share": 0.75, **_PRESET_DISTILL, **_PRESET_NO_REFIT, **_PRESET_KMEANS, **_CODEBOOK_16},
    "4.5 bits": {"vector_len": 4, "num_centroids": 256, "num_res_centroids": 256, "layer_bits_cap": 4.5,
                 "bits_budget": 0.0, "allocation": "cap", "distill_lr": DISTILL_LR, **PRESET_OFF, **_PRESET_NO_REFIT,
                 **_DEFAULT_KMEANS, **_CODEBOOK_16},
}
_NO_BUDGET = {"time_budget": 0.0, "time_budget_scale": "fixed"}
PRESETS["2.5-best"] = {**PRESETS["2.5 bits"], "distill_iters": 128, "distill_eval_every": 16, **_NO_BUDGET}
PRESETS["3.5-best"] = {**PRESETS["3.5 bits"], **_NO_BUDGET}

# The layers' pace before a run (``block_pace``): block 0's linears in order until PACE_SECONDS of them are timed.
PACE_SECONDS = 1.5


def _pace(probe, config: VPTQConfig) -> tuple[float, float]:
    """(seconds, price on the reference machine) of quantizing ``probe``'s block's linears in order, until
    ``PACE_SECONDS`` are timed, with the config's own settings, not a bit plan's (``Method.pace``;
    ``vptq_cost.vptq_layer_phases``), once the native kernels the search uses are loaded, as the block stage's
    first search loads them. Over the layers of whole runs on a 2-vCPU AVX2 machine the price's error was the same
    for every planned layout (0.62-0.76x for v3-v6 k1024-k4096), so any layer tells the pace of all."""
    from vptq_core.kernels import native

    if native.expected():
        native.status()
    measured = priced = 0.0
    cache: dict = {}
    for name, linear in probe.linears.items():
        start = time.perf_counter()
        vptq_quantize(linear.weight.data, probe.hessians[name], config, linear.bias, hessian_cache=cache)
        measured += time.perf_counter() - start
        priced += vptq_layer_phases(*linear.weight.shape, config)["whole"]
        if measured >= PACE_SECONDS:
            break
    return measured, priced


METHOD = register(Method(
    name="vptq", label="VPTQ", config_class=VPTQConfig, bits=config_bits, describe=describe, presets=PRESETS,
    description="vector quantization: Hessian-weighted k-means codebooks with second-order error feedback",
    quantize_linear=lambda W, H, config, bias, cache: vptq_quantize(W, H, config, bias, hessian_cache=cache),
    before_blocks=(PlanHook("allocation", _plans, _plan_hook, cost=allocation_seconds,
                            bits_bound=lambda config: config.bits_budget),),
    after_block=(BlockHook("finetune", lambda config: config.finetune_iters > 0, _finetune_hook),),
    after_model=(DISTILL_HOOK,),
    config_needs=_needs, resolve=budget_for_model, cost=vptq_seconds, pace=_pace,
))
