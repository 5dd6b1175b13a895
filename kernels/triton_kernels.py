"""Triton kernels: fused lookup GEMV for decode and a dequantize kernel for prefill (then one matmul).

Both work in the stored (permuted) column order; the permutation and the norm are moved onto x
(``xp = (x * weight_scale)[:, perm]``, ``y += x @ weight_bias``), so the kernels only decode the packed
index stream and gather centroids. Outlier columns (a small block of unpacked uint16 indices) are
dequantized with torch and added with one small matmul.

On CPU tensors these run only under ``TRITON_INTERPRET=1`` (set before ``triton`` is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .spec import ScalarSpec, ScalarWeights, VQSpec, VQWeights


@triton.jit
def _decode(words_ptr, row_off, cols, col_mask, T: tl.constexpr, W):
    """Entries (int64) of the packed stream starting at ``words_ptr + row_off`` for columns ``cols``."""
    bit = cols.to(tl.int64) * T
    w = bit // 32
    s = bit % 32
    lo = tl.load(words_ptr + row_off + w, mask=col_mask, other=0).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(words_ptr + row_off + w + 1, mask=col_mask & (w + 1 < W), other=0).to(tl.int64) & 0xFFFFFFFF
    return ((lo >> s) | (hi << (32 - s))) & ((1 << T) - 1)


@triton.jit
def _vq_gemv_kernel(
    xp_ptr, words_ptr, cb_ptr, rcb_ptr, y_ptr,
    n_in, out_features, R, W, gs, osz, SPLIT, chunk,
    V: tl.constexpr, VP: tl.constexpr, IB: tl.constexpr, RB: tl.constexpr,
    K: tl.constexpr, KR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """y[n, r*V + t] += sum_c (cb[g, idx*V + t] (+ rcb[g, ridx*V + t])) * xp[n, osz + g*gs + c].

    Program (row block, group g * SPLIT + split, token n) covers columns [split*chunk, (split+1)*chunk) of
    group g and adds its partial sums atomically (split-K keeps the GPU busy at batch 1).
    """
    pid_r = tl.program_id(0)
    g = tl.program_id(1) // SPLIT
    split = tl.program_id(1) % SPLIT
    n = tl.program_id(2)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    t = tl.arange(0, VP)
    t_mask = t < V
    acc = tl.zeros((BLOCK_R, VP), dtype=tl.float32)
    c_end = tl.minimum(gs, (split + 1) * chunk)
    for c0 in range(split * chunk, c_end, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = cols < c_end
        m2 = row_mask[:, None] & col_mask[None, :]
        entry = _decode(words_ptr, (g * R + rows[:, None]).to(tl.int64) * W, cols[None, :], m2, IB + RB, W)
        idx = entry & ((1 << IB) - 1)
        m3 = m2[:, :, None] & t_mask[None, None, :]
        vals = tl.load(cb_ptr + g * (K * V) + idx[:, :, None] * V + t[None, None, :], mask=m3, other=0.0)
        vals = vals.to(tl.float32)
        if RB > 0:
            ridx = entry >> IB
            rv = tl.load(rcb_ptr + g * (KR * V) + ridx[:, :, None] * V + t[None, None, :], mask=m3, other=0.0)
            vals += rv.to(tl.float32)
        xv = tl.load(xp_ptr + n * n_in + osz + g * gs + cols, mask=col_mask, other=0.0)
        acc += tl.sum(vals * xv[None, :, None], axis=1)
    o = rows[:, None] * V + t[None, :]
    tl.atomic_add(y_ptr + n * out_features + o, acc, mask=row_mask[:, None] & t_mask[None, :] & (o < out_features))


@triton.jit
def _vq_dequant_kernel(
    words_ptr, cb_ptr, rcb_ptr, w_ptr,
    out_features, R, W, gs, G,
    V: tl.constexpr, VP: tl.constexpr, IB: tl.constexpr, RB: tl.constexpr,
    K: tl.constexpr, KR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Wp_main[r*V + t, g*gs + c] (stored column order, [out, G*gs])."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    g = tl.program_id(2)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.arange(0, VP)
    m2 = (rows < R)[:, None] & (cols < gs)[None, :]
    entry = _decode(words_ptr, (g * R + rows[:, None]).to(tl.int64) * W, cols[None, :], m2, IB + RB, W)
    idx = entry & ((1 << IB) - 1)
    m3 = m2[:, :, None] & (t < V)[None, None, :]
    vals = tl.load(cb_ptr + g * (K * V) + idx[:, :, None] * V + t[None, None, :], mask=m3, other=0.0).to(tl.float32)
    if RB > 0:
        ridx = entry >> IB
        vals += tl.load(rcb_ptr + g * (KR * V) + ridx[:, :, None] * V + t[None, None, :], mask=m3,
                        other=0.0).to(tl.float32)
    o = rows[:, None, None] * V + t[None, None, :]
    ptrs = w_ptr + o.to(tl.int64) * (G * gs) + g * gs + cols[None, :, None]
    tl.store(ptrs, vals.to(w_ptr.dtype.element_ty), mask=m3 & (o < out_features))


@triton.jit
def _scalar_gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, zs_ptr, y_ptr, n_in, out_features, W, G, group_size,
    BITS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """y[n, o] = sum_j scales[o, j//gsz] * codes[o, j] * x[n, j] - sum_g (scales*zeros)[o, g] * sum_{j in g} x[n, j]."""
    pid = tl.program_id(0)
    n = tl.program_id(1)
    rows = pid * BLOCK_O + tl.arange(0, BLOCK_O)
    row_mask = rows < out_features
    acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for c0 in range(0, n_in, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = cols < n_in
        m2 = row_mask[:, None] & col_mask[None, :]
        q = _decode(codes_ptr, rows[:, None].to(tl.int64) * W, cols[None, :], m2, BITS, W).to(tl.float32)
        grp = cols // group_size
        s = tl.load(scales_ptr + rows[:, None] * G + grp[None, :], mask=m2, other=0.0)
        zs = tl.load(zs_ptr + rows[:, None] * G + grp[None, :], mask=m2, other=0.0)
        xv = tl.load(x_ptr + n * n_in + cols, mask=col_mask, other=0.0)
        acc += tl.sum((s * q - zs) * xv[None, :], axis=1)
    tl.store(y_ptr + n * out_features + rows, acc, mask=row_mask)


@triton.jit
def _scalar_dequant_kernel(
    codes_ptr, scales_ptr, zeros_ptr, w_ptr, n_in, out_features, W, G, group_size,
    BITS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m2 = (rows < out_features)[:, None] & (cols < n_in)[None, :]
    q = _decode(codes_ptr, rows[:, None].to(tl.int64) * W, cols[None, :], m2, BITS, W).to(tl.float32)
    grp = cols // group_size
    s = tl.load(scales_ptr + rows[:, None] * G + grp[None, :], mask=m2, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + rows[:, None] * G + grp[None, :], mask=m2, other=0.0).to(tl.float32)
    tl.store(w_ptr + rows[:, None].to(tl.int64) * n_in + cols[None, :], (s * (q - z)).to(w_ptr.dtype.element_ty),
             mask=m2)


# ----------------------------------------------------------------------------------------------- host
_BLOCK_R = 16
_BLOCK_C = 64


def _split_k(programs: int, columns: int, device: torch.device) -> tuple[int, int]:
    """(splits, columns per split) so that about 4 programs per SM run (2 splits when interpreted, to test it)."""
    max_split = triton.cdiv(columns, _BLOCK_C)
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
        split = max(1, min(max_split, triton.cdiv(target, programs)))
    else:
        split = min(2, max_split)
    chunk = triton.cdiv(triton.cdiv(columns, split), _BLOCK_C) * _BLOCK_C
    return triton.cdiv(columns, chunk), chunk


def _x_stored_order(x2: torch.Tensor, perm: torch.Tensor | None, weight_scale: torch.Tensor | None) -> torch.Tensor:
    """xp [N, in] fp32 = (x * weight_scale)[:, perm]."""
    xp = x2.float()
    if weight_scale is not None:
        xp = xp * weight_scale.float()
    if perm is not None:
        xp = xp[:, reference.as_index(perm)]
    return xp.contiguous()


def _outlier_weight(spec: VQSpec, outlier_indices: torch.Tensor, outlier_centroids: torch.Tensor) -> torch.Tensor:
    """Outlier block of Wp [out, outlier_size] (stored order), fp32."""
    vo = spec.outlier_vector_len
    vectors = outlier_centroids.float().view(-1, vo)[reference.as_index(outlier_indices[0])]  # [Ro, os, vo]
    return vectors.permute(0, 2, 1).reshape(spec.outlier_rows * vo, spec.outlier_size)[: spec.out_features]


def _dummy(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like


def vq_dequantize_stored(spec: VQSpec, indices: torch.Tensor, centroids: torch.Tensor,
                         res_centroids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Main block of Wp [out, G*group_size] in stored column order, decoded by the Triton dequant kernel."""
    G, R, W = indices.shape
    v = spec.vector_len
    out = torch.empty(spec.out_features, G * spec.group_size, dtype=dtype, device=indices.device)
    grid = (triton.cdiv(R, _BLOCK_R), triton.cdiv(spec.group_size, _BLOCK_C), G)
    _vq_dequant_kernel[grid](
        indices.contiguous(), centroids.contiguous(), _dummy(res_centroids, centroids).contiguous(), out,
        spec.out_features, R, W, spec.group_size, G,
        V=v, VP=triton.next_power_of_2(v), IB=spec.index_bits, RB=spec.res_bits, K=spec.num_centroids,
        KR=max(spec.num_res_centroids, 1), BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C,
    )
    return out


def vq_linear(x: torch.Tensor, spec: VQSpec, weights: VQWeights, fused: bool = True) -> torch.Tensor:
    """x [..., in] -> y [..., out] (x.dtype). ``fused``: lookup GEMV (decode), else dequantize + matmul (prefill)."""
    indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale, weight_bias, bias = (
        weights)
    x2 = x.reshape(-1, spec.in_features)
    n = x2.shape[0]
    xp = _x_stored_order(x2, perm, weight_scale)  # [N, in] fp32
    if fused:
        y = torch.zeros(n, spec.out_features, dtype=torch.float32, device=x.device)
        v = spec.vector_len
        if n:
            row_blocks = triton.cdiv(spec.rows, _BLOCK_R)
            split, chunk = _split_k(row_blocks * spec.group_num * n, spec.group_size, x.device)
            grid = (row_blocks, spec.group_num * split, n)
            _vq_gemv_kernel[grid](
                xp, indices.contiguous(), centroids.contiguous(), _dummy(res_centroids, centroids).contiguous(), y,
                spec.in_features, spec.out_features, spec.rows, spec.packed_words, spec.group_size,
                spec.outlier_size, split, chunk,
                V=v, VP=triton.next_power_of_2(v), IB=spec.index_bits, RB=spec.res_bits, K=spec.num_centroids,
                KR=max(spec.num_res_centroids, 1), BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C,
            )
    else:
        compute = x.dtype if x.device.type == "cuda" else torch.float32
        weight = vq_dequantize_stored(spec, indices, centroids, res_centroids, compute)
        y = (xp[:, spec.outlier_size:].to(compute) @ weight.T).float()
    if spec.has_outliers:
        y = y + xp[:, : spec.outlier_size] @ _outlier_weight(spec, outlier_indices, outlier_centroids).T
    if weight_bias is not None:
        y = y + (x2.float() @ weight_bias.float())[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], spec.out_features)


def vq_dequantize(spec: VQSpec, weights: VQWeights) -> torch.Tensor:
    """Dense W [out, in] (dtype of centroids), same result as ``kernels.reference.vq_dequantize``."""
    indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale, weight_bias, _ = (
        weights)
    weight = vq_dequantize_stored(spec, indices, centroids, res_centroids, centroids.dtype)
    if spec.has_outliers:
        outl = _outlier_weight(spec, outlier_indices, outlier_centroids).to(centroids.dtype)
        weight = torch.cat([outl, weight], dim=1)
    if perm is not None:
        weight = weight[:, torch.argsort(reference.as_index(perm))]
    if weight_scale is not None:
        weight = weight * weight_scale
    if weight_bias is not None:
        weight = weight + weight_bias
    return weight


def scalar_linear(x: torch.Tensor, spec: ScalarSpec, weights: ScalarWeights, fused: bool = True) -> torch.Tensor:
    """x [..., in] -> y [..., out] (x.dtype) for packed scalar codes (fused GEMV, or dequantize + matmul)."""
    codes_packed, scales, zeros, bias = weights
    bits, group_size, in_features = spec.bits, spec.group_size, spec.in_features
    out_features, W = codes_packed.shape
    G = scales.shape[1]
    x2 = x.reshape(-1, in_features)
    n = x2.shape[0]
    if fused:
        xf = x2.float().contiguous()
        s = scales.float().contiguous()
        zs = (s * zeros.float()).contiguous()
        y = torch.empty(n, out_features, dtype=torch.float32, device=x.device)
        if n:
            grid = (triton.cdiv(out_features, 32), n)
            _scalar_gemv_kernel[grid](xf, codes_packed.contiguous(), s, zs, y, in_features, out_features, W, G,
                                      group_size, BITS=bits, BLOCK_O=32, BLOCK_C=64)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], out_features)
    weight = scalar_dequantize(spec, weights)
    compute = x.dtype if x.device.type == "cuda" else torch.float32
    y = x2.to(compute) @ weight.to(compute).T
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def scalar_dequantize(spec: ScalarSpec, weights: ScalarWeights) -> torch.Tensor:
    """W [out, in] (dtype of scales) = scales * (codes - zeros), decoded by a Triton kernel."""
    codes_packed, scales, zeros, _ = weights
    bits, group_size, in_features = spec.bits, spec.group_size, spec.in_features
    out_features, W = codes_packed.shape
    weight = torch.empty(out_features, in_features, dtype=scales.dtype, device=codes_packed.device)
    grid = (triton.cdiv(out_features, 32), triton.cdiv(in_features, 64))
    _scalar_dequant_kernel[grid](codes_packed.contiguous(), scales.contiguous(), zeros.contiguous(), weight,
                                 in_features, out_features, W, scales.shape[1], group_size,
                                 BITS=bits, BLOCK_O=32, BLOCK_C=64)
    return weight
