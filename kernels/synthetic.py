"""Random but valid packed layers for tests and benchmarks (seeded, no global RNG)."""

from __future__ import annotations

import torch

from .packing import pack_codes, pack_indices
from .spec import ScalarSpec, ScalarWeights, VQSpec, VQWeights


def random_vq_layer(
    spec: VQSpec,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    perm: bool = False,
    norm: bool = False,
    bias: bool = False,
    perm_dtype: torch.dtype = torch.int16,
    device: torch.device | str = "cpu",
) -> VQWeights:
    """The tensors of a random layer matching ``spec``.

    Indices are uniform; centroids ~ N(0, 1) / sqrt(in) so outputs stay O(1); perm is a random
    permutation stored as ``perm_dtype`` (int16 holds uint16 patterns, as in the public format).
    """
    gen = torch.Generator().manual_seed(seed)
    G, R, gs, v = spec.group_num, spec.rows, spec.group_size, spec.vector_len
    scale = spec.in_features**-0.5
    idx = torch.randint(0, spec.num_centroids, (G, R, gs), generator=gen)
    res_idx = torch.randint(0, spec.num_res_centroids, (G, R, gs), generator=gen) if spec.has_residual else None
    layer: dict[str, torch.Tensor | None] = {
        "indices": pack_indices(idx, spec.index_bits, res_idx, spec.res_bits),
        "centroids": torch.randn(G, spec.num_centroids * v, generator=gen) * scale,
        "res_centroids": None,
        "outlier_indices": None,
        "outlier_centroids": None,
        "perm": None,
        "weight_scale": None,
        "weight_bias": None,
        "bias": None,
    }
    if spec.has_residual:
        layer["res_centroids"] = torch.randn(G, spec.num_res_centroids * v, generator=gen) * scale * 0.25
    if spec.has_outliers:
        oidx = torch.randint(0, spec.num_outlier_centroids, (1, spec.outlier_rows, spec.outlier_size), generator=gen)
        layer["outlier_indices"] = oidx.to(torch.int32).to(torch.int16)  # uint16 patterns in int16 storage
        layer["outlier_centroids"] = (
            torch.randn(1, spec.num_outlier_centroids * spec.outlier_vector_len, generator=gen) * scale * 4
        )
    if perm:
        layer["perm"] = torch.randperm(spec.in_features, generator=gen).to(torch.int32).to(perm_dtype)
    if norm:
        layer["weight_scale"] = torch.rand(spec.in_features, generator=gen) + 0.5
        layer["weight_bias"] = torch.randn(spec.in_features, generator=gen) * scale * 0.1
    if bias:
        layer["bias"] = torch.randn(spec.out_features, generator=gen)
    def place(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return (t.to(dtype) if t.is_floating_point() else t).to(device)

    return VQWeights(**{name: place(t) for name, t in layer.items()})


def random_scalar_layer(
    out_features: int, in_features: int, bits: int, group_size: int, *, seed: int = 0,
    dtype: torch.dtype = torch.float32, bias: bool = False, device: torch.device | str = "cpu",
) -> tuple[ScalarSpec, ScalarWeights]:
    """(spec, tensors) of a random scalar-quantized layer."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-in_features // group_size)
    codes = torch.randint(0, 2**bits, (out_features, in_features), generator=gen)
    scales = (torch.rand(out_features, groups, generator=gen) + 0.5) * in_features**-0.5 / 2**bits
    zeros = torch.randint(0, 2**bits, (out_features, groups), generator=gen).to(torch.float32)
    return ScalarSpec(in_features, out_features, bits, group_size), ScalarWeights(
        codes=pack_codes(codes, bits).to(device),
        scales=scales.to(dtype).to(device),
        zeros=zeros.to(dtype).to(device),
        bias=torch.randn(out_features, generator=gen).to(dtype).to(device) if bias else None,
    )
