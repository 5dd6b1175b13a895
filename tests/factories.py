"""Random but valid layer states for tests: built from ``kernels.synthetic``'s packed layers, unpacked."""

from __future__ import annotations

import socket

import torch

from vptq_core.kernels import VQSpec, unpack_codes, unpack_indices
from vptq_core.kernels.reference import as_index
from vptq_core.kernels.synthetic import random_scalar_layer, random_vq_layer
from vptq_core.quant.states import ScalarLayerState, VQLayerState


def random_vq_state(
    in_features: int, out_features: int, vector_len: int = 4, num_centroids: int = 16, num_res_centroids: int = -1,
    group_num: int = 1, outlier_size: int = 0, outlier_vector_len: int = 2, num_outlier_centroids: int = 8,
    norm: bool = False, perm: bool = False, bias: bool = False, seed: int = 0,
) -> VQLayerState:
    """A valid random ``VQLayerState`` (float32 tensors, int64 indices)."""
    spec = VQSpec(
        in_features=in_features, out_features=out_features, vector_len=vector_len, num_centroids=num_centroids,
        num_res_centroids=num_res_centroids if num_res_centroids > 0 else -1,
        outlier_vector_len=outlier_vector_len if outlier_size else -1,
        num_outlier_centroids=num_outlier_centroids if outlier_size else -1, group_num=group_num,
        outlier_size=outlier_size,
    )
    w = random_vq_layer(spec, seed=seed, perm=perm, norm=norm, bias=bias, perm_dtype=torch.int64)
    idx, ridx = unpack_indices(w.indices, spec.index_bits, spec.group_size, spec.res_bits)
    return VQLayerState(
        in_features=in_features, out_features=out_features, vector_len=vector_len, num_centroids=num_centroids,
        group_num=group_num, group_size=spec.group_size, centroids=w.centroids, indices=idx,
        num_res_centroids=spec.num_res_centroids, res_centroids=w.res_centroids, res_indices=ridx,
        outlier_vector_len=spec.outlier_vector_len, num_outlier_centroids=spec.num_outlier_centroids,
        outlier_size=outlier_size, outlier_centroids=w.outlier_centroids,
        outlier_indices=None if w.outlier_indices is None else as_index(w.outlier_indices),
        perm=w.perm, weight_scale=w.weight_scale, weight_bias=w.weight_bias, bias=w.bias,
    )


def random_scalar_state(
    in_features: int, out_features: int, bits: int = 4, group_size: int = 32, bias: bool = False,
    act_bits: int = 16, act_granularity: str = "token", method: str = "rtn", seed: int = 0,
) -> ScalarLayerState:
    """A valid random ``ScalarLayerState`` (float32 scales, integer-valued zero points)."""
    spec, w = random_scalar_layer(out_features, in_features, bits, group_size, seed=seed, bias=bias)
    static = act_bits < 16 and act_granularity == "tensor"
    return ScalarLayerState(
        in_features=in_features, out_features=out_features, bits=bits, group_size=group_size,
        codes=unpack_codes(w.codes, bits, in_features).to(torch.uint8), scales=w.scales, zeros=w.zeros,
        bias=w.bias, method=method, act_bits=act_bits, act_granularity=act_granularity,
        act_scale=torch.tensor(0.02) if static else None,
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test's server or process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
