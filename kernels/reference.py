"""Torch reference: dequantize the packed layer to a dense ``W`` and call ``F.linear``. Ground truth in tests.

The math follows ``vptq_core/quant/states.py`` (and the public VPTQ ``ops.dequant``)::

    main[r*v + t, g*group_size + c] = centroids[g, idx[g, r, c]*v + t] (+ res_centroids[g, ridx[g, r, c]*v + t])
    outl[r*vo + t, c]               = outlier_centroids[0, oidx[0, r, c]*vo + t]
    Wp = cat([outl[:out], main[:out]], dim=1)       # [out, in], stored (permuted) column order
    W  = Wp[:, argsort(perm)]                       # perm[i] = original column held by stored column i
    W  = W * weight_scale + weight_bias             # per input column (norm)

Everything here is differentiable in the float tensors (centroids, scale, bias), so fine-tuning can use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .packing import unpack_codes, unpack_indices
from .spec import ScalarSpec, ScalarWeights, VQSpec, VQWeights


def as_index(t: torch.Tensor) -> torch.Tensor:
    """int16 tensors hold uint16 patterns (public format); return int64 values."""
    if t.dtype == torch.int16:
        return t.to(torch.int64) & 0xFFFF
    return t.to(torch.int64)


def vq_expand(
    spec: VQSpec,
    indices: torch.Tensor,
    res_indices: torch.Tensor | None,
    centroids: torch.Tensor,
    res_centroids: torch.Tensor | None = None,
    outlier_indices: torch.Tensor | None = None,
    outlier_centroids: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one VQ dequantizer: dense weight [out, in] (dtype of ``centroids``) from *unpacked* indices.

    indices, res_indices int [G, R, group_size]; centroids [G, k*v]; res_centroids [G, k_res*v];
    outlier_indices int [1, Ro, outlier_size] (int16 holds uint16 patterns); outlier_centroids [1, k_o*vo];
    perm [in]; weight_scale / weight_bias [in]. Differentiable in the float tensors.
    """
    G, v, out = spec.group_num, spec.vector_len, spec.out_features
    group = torch.arange(G, device=indices.device).view(G, 1, 1)
    codebook = centroids.reshape(G, spec.num_centroids, v)
    vectors = codebook[group, as_index(indices)]  # [G, R, gs, v]
    if spec.has_residual:
        assert res_centroids is not None and res_indices is not None
        vectors = vectors + res_centroids.reshape(G, spec.num_res_centroids, v)[group, as_index(res_indices)]
    # [G, R, gs, v] -> [R, v, G, gs] -> [R*v, G*gs]
    weight = vectors.permute(1, 3, 0, 2).reshape(spec.rows * v, G * spec.group_size)[:out]
    if spec.has_outliers:
        assert outlier_indices is not None and outlier_centroids is not None
        vo = spec.outlier_vector_len
        outlier_codebook = outlier_centroids.reshape(spec.num_outlier_centroids, vo)
        outlier_vectors = outlier_codebook[as_index(outlier_indices[0])]  # [Ro, os, vo]
        outlier_weight = outlier_vectors.permute(0, 2, 1).reshape(spec.outlier_rows * vo, spec.outlier_size)
        weight = torch.cat([outlier_weight[:out], weight], dim=1)
    if perm is not None:
        weight = weight[:, torch.argsort(as_index(perm))]
    if weight_scale is not None:
        weight = weight * weight_scale
    if weight_bias is not None:
        weight = weight + weight_bias
    return weight


def vq_dequantize(spec: VQSpec, weights: VQWeights) -> torch.Tensor:
    """Dense weight [out, in] in the dtype of ``weights.centroids`` (``weights.bias`` is not part of it)."""
    idx, ridx = unpack_indices(weights.indices, spec.index_bits, spec.group_size, spec.res_bits)  # [G, R, gs]
    return vq_expand(spec, idx, ridx, weights.centroids, weights.res_centroids, weights.outlier_indices,
                     weights.outlier_centroids, weights.perm, weights.weight_scale, weights.weight_bias)


def vq_linear(x: torch.Tensor, spec: VQSpec, weights: VQWeights) -> torch.Tensor:
    """x [..., in] -> y [..., out] in x.dtype: dequantize, then ``F.linear``."""
    weight = vq_dequantize(spec, weights)
    bias = weights.bias
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def scalar_expand(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The one scalar dequantizer: W [out, in] = scales * (codes - zeros) per (row, group of ``group_size``
    columns), dtype of ``scales``. codes int [out, in] (unpacked); scales, zeros [out, ceil(in/group_size)]."""
    group = torch.arange(codes.shape[1], device=codes.device) // group_size
    return scales[:, group] * (codes.to(scales.dtype) - zeros[:, group].to(scales.dtype))


def scalar_dequantize(spec: ScalarSpec, weights: ScalarWeights) -> torch.Tensor:
    """W [out, in] in the dtype of ``weights.scales`` from the packed codes."""
    codes = unpack_codes(weights.codes, spec.bits, spec.in_features)
    return scalar_expand(codes, weights.scales, weights.zeros, spec.group_size)


def scalar_linear(x: torch.Tensor, spec: ScalarSpec, weights: ScalarWeights) -> torch.Tensor:
    """x [..., in] -> y [..., out] in x.dtype: dequantize, then ``F.linear``."""
    weight = scalar_dequantize(spec, weights)
    bias = weights.bias
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
