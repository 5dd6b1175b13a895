"""VPTQ for one linear layer (METHODS.md section 1).

Vectors run along the output dimension inside one input column: column ``j`` of ``W`` [out, in] is cut
into ``out / v`` vectors of ``v`` consecutive output channels. Codebooks come from Hessian-weighted
k-means (every vector of column ``j`` weighs ``H_jj``); then the columns are swept in order, each one
replaced by its nearest centroids and its error spread onto the remaining columns with the inverse
Hessian's Cholesky factor (GPTQ-style, lazy block updates).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import VPTQConfig
from .hessian import inverse_hessian_cholesky, prepare_hessian, proxy_loss, single_thread_torch
from .kmeans import CodebookSearch, weighted_kmeans
from .states import VQLayerState


@dataclass
class QuantResult:
    """What quantizing one linear produced: its state, the dequantized weight and its errors."""

    state: object  # VQLayerState | ScalarLayerState
    weight: torch.Tensor  # Ŵ [out, in] float32, original column order
    proxy_loss: float  # tr(ΔW H ΔWᵀ)
    rel_proxy_loss: float  # tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)
    rel_weight_error: float  # ||ΔW||_F / ||W||_F
    timings: dict = field(default_factory=dict)  # seconds per phase: kmeans, inverse_hessian, sweep


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
    """Quantize W [out, in] column by column (stored order) with error feedback; fills segment indices.

    Returns (Q [out, in], residual vectors per segment when ``collect_residuals``).
    """
    W = W.clone()
    out, cols = W.shape
    Q = torch.zeros_like(W)
    seg_of = torch.empty(cols, dtype=torch.long)
    for s, seg in enumerate(segments):
        seg_of[seg.start : seg.end] = s
        rows = math.ceil(out / seg.vector_len)
        seg.indices = torch.zeros(rows, seg.end - seg.start, dtype=torch.long)
        seg.res_indices = torch.zeros_like(seg.indices) if seg.res_centroids is not None else None
    searches = [CodebookSearch(seg.centroids) for seg in segments]
    res_searches = [None if seg.res_centroids is None else CodebookSearch(seg.res_centroids) for seg in segments]
    residuals: dict[int, list[torch.Tensor]] = {s: [] for s in range(len(segments))}
    seg_list = seg_of.tolist()
    with single_thread_torch():
        _sweep_blocks(W, Q, U, segments, seg_list, searches, res_searches, residuals, block_size, second_order,
                      collect_residuals)
    return Q, residuals


def _sweep_blocks(W, Q, U, segments, seg_list, searches, res_searches, residuals, block_size, second_order,
                  collect_residuals):
    out, cols = W.shape
    for b0 in range(0, cols, block_size):
        b1 = min(b0 + block_size, cols)
        W1 = W[:, b0:b1]  # a view: updates below write through to W
        Err = torch.zeros(out, b1 - b0)
        for i in range(b1 - b0):
            j = b0 + i
            s = seg_list[j]
            seg = segments[s]
            w = W1[:, i]
            q, idx, ridx = _assign(seg, w, searches[s], res_searches[s])
            Q[:, j] = q
            seg.indices[:, j - seg.start] = idx
            if ridx is not None:
                seg.res_indices[:, j - seg.start] = ridx
            if collect_residuals:
                residuals[s].append(seg.vectors(w - q))
            if second_order:
                e = (w - q) / U[j, j]
                W1[:, i + 1 :].addr_(e, U[j, j + 1 : b1], alpha=-1.0)
                Err[:, i] = e
        if second_order and b1 < cols:
            W[:, b1:].addmm_(Err, U[b0:b1, b1:], alpha=-1.0)


def _lap(timings: dict, phase: str, since: float) -> float:
    now = time.perf_counter()
    timings[phase] += now - since
    return now


def _fit_sample(config: VPTQConfig, k: int) -> int:
    """Vectors k-means fits on: at most ``kmeans_sample``, and at most 64 per centroid (more barely moves
    the centroids, and the fit's cost grows with it)."""
    return min(config.kmeans_sample, 64 * k)


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

    diag = torch.diag(Hd)
    outlier_size = outlier_columns(in_features, config.outlier_percent, config.group_num)
    by_importance = torch.argsort(diag, descending=True, stable=True)
    if config.enable_perm:
        perm = by_importance
    elif outlier_size:
        # Outlier columns must come first in stored order; the rest keep their natural order.
        outliers = by_importance[:outlier_size]
        rest_mask = torch.ones(in_features, dtype=torch.bool)
        rest_mask[outliers] = False
        perm = torch.cat([outliers, torch.arange(in_features)[rest_mask]])
    else:
        perm = None
    if perm is not None:
        Wd = Wd[:, perm]
        Hd = Hd[perm][:, perm]
        diag = diag[perm]

    group_size = (in_features - outlier_size) // config.group_num
    segments: list[_Segment] = []
    if outlier_size:
        segments.append(_Segment(0, outlier_size, config.outlier_vector_len))
    for g in range(config.group_num):
        start = outlier_size + g * group_size
        segments.append(_Segment(start, start + group_size, config.vector_len))
    n_outlier_segments = 1 if outlier_size else 0

    # Hessian-weighted k-means codebook per segment, fitted on the (normalised, permuted) weight.
    timings = {"kmeans": 0.0, "inverse_hessian": 0.0, "sweep": 0.0}
    clock = time.perf_counter()
    for s, seg in enumerate(segments):
        k = config.outlier_centroids if s < n_outlier_segments else config.num_centroids
        vectors = _column_vectors(Wd[:, seg.start : seg.end], seg.vector_len)
        rows = vectors.shape[0] // (seg.end - seg.start)
        weights = diag[seg.start : seg.end].repeat_interleave(rows)
        seg.centroids = weighted_kmeans(
            vectors, weights, k, config.kmeans_iters, seed=config.seed + s, sample=_fit_sample(config, k)
        ).centroids

    clock = _lap(timings, "kmeans", clock)
    U = inverse_hessian_cholesky(Hd, hessian_cache)
    clock = _lap(timings, "inverse_hessian", clock)
    Q, residuals = _sweep(
        Wd, U, segments, config.block_size, config.second_order, collect_residuals=config.num_res_centroids > 0
    )
    clock = _lap(timings, "sweep", clock)
    if config.num_res_centroids > 0:
        # Residual codebook: k-means on what the first sweep left, then sweep again from the original W.
        for s, seg in enumerate(segments[n_outlier_segments:], start=n_outlier_segments):
            vectors = torch.cat(residuals[s])
            rows = vectors.shape[0] // (seg.end - seg.start)
            weights = diag[seg.start : seg.end].repeat_interleave(rows)
            seg.res_centroids = weighted_kmeans(
                vectors, weights, config.num_res_centroids, config.kmeans_iters, seed=config.seed + 1000 + s,
                sample=_fit_sample(config, config.num_res_centroids),
            ).centroids
        clock = _lap(timings, "kmeans", clock)
        Q, _ = _sweep(Wd, U, segments, config.block_size, config.second_order)
        clock = _lap(timings, "sweep", clock)

    W_hat = torch.empty_like(Q)
    if perm is not None:
        W_hat[:, perm] = Q
    else:
        W_hat = Q
    if config.enable_norm:
        W_hat = W_hat * weight_scale + weight_bias

    main = segments[n_outlier_segments:]
    state = VQLayerState(
        in_features=in_features, out_features=out_features, vector_len=config.vector_len,
        num_centroids=config.num_centroids, group_num=config.group_num, group_size=group_size,
        centroids=torch.stack([seg.centroids.reshape(-1) for seg in main]),
        indices=torch.stack([seg.indices for seg in main]),
        num_res_centroids=config.num_res_centroids if config.num_res_centroids > 0 else -1,
        res_centroids=(torch.stack([seg.res_centroids.reshape(-1) for seg in main])
                       if config.num_res_centroids else None),
        res_indices=torch.stack([seg.res_indices for seg in main]) if config.num_res_centroids else None,
        outlier_vector_len=config.outlier_vector_len if outlier_size else -1,
        num_outlier_centroids=config.outlier_centroids if outlier_size else -1,
        outlier_size=outlier_size,
        outlier_centroids=segments[0].centroids.reshape(1, -1) if outlier_size else None,
        outlier_indices=segments[0].indices.unsqueeze(0) if outlier_size else None,
        perm=perm, weight_scale=weight_scale, weight_bias=weight_bias,
        bias=None if bias is None else bias.detach().clone(),
    )
    loss, rel = proxy_loss(W_orig, W_hat, H.float())
    rel_w = float(torch.linalg.norm(W_hat - W_orig) / torch.linalg.norm(W_orig).clamp(min=1e-12))
    return QuantResult(state=state, weight=W_hat, proxy_loss=loss, rel_proxy_loss=rel, rel_weight_error=rel_w,
                       timings=timings)


def dequantize_state(state: VQLayerState) -> torch.Tensor:
    """Ŵ [out, in] float32 from an unpacked ``VQLayerState`` (pure torch, for the pipeline and tests)."""
    out = state.out_features

    def expand(centroids: torch.Tensor, indices: torch.Tensor, v: int) -> torch.Tensor:
        # centroids [k*v], indices [rows, cols] -> [rows*v, cols] -> first `out` rows
        vecs = centroids.view(-1, v)[indices]  # [rows, cols, v]
        return vecs.permute(0, 2, 1).reshape(-1, indices.shape[1])[:out]

    parts = []
    if state.outlier_size:
        parts.append(expand(state.outlier_centroids[0].float(), state.outlier_indices[0], state.outlier_vector_len))
    for g in range(state.group_num):
        block = expand(state.centroids[g].float(), state.indices[g], state.vector_len)
        if state.res_centroids is not None:
            block = block + expand(state.res_centroids[g].float(), state.res_indices[g], state.vector_len)
        parts.append(block)
    Wp = torch.cat(parts, dim=1)
    W = torch.empty_like(Wp)
    if state.perm is not None:
        W[:, state.perm.long()] = Wp
    else:
        W = Wp
    if state.weight_scale is not None:
        W = W * state.weight_scale.float() + state.weight_bias.float()
    return W
