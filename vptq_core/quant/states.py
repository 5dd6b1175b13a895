"""In-memory forms of a quantized linear layer: the contract between quantizers, checkpoints and kernels.

``VQLayerState`` follows the public VPTQ layout (docs: "The packed checkpoint format") with the indices
kept *unpacked* (int64); ``kernels.packing`` turns them into the packed int32 bit streams that checkpoints
and the fused kernels use.

Dequantization of a ``VQLayerState`` (see ``kernels.reference.vq_dequantize``)::

    main[r*v + t, g*group_size + c] = centroids[g, idx[g, r, c]*v + t] (+ res_centroids[g, ridx[g, r, c]*v + t])
    outl[r*vo + t, c]               = outlier_centroids[0, oidx[0, r, c]*vo + t]
    Wp = cat([outl[:out], main[:out]], dim=1)       # [out, in], columns in stored (permuted) order
    W  = Wp[:, argsort(perm)]                       # back to the original column order (perm[i] = source column)
    W  = W * weight_scale + weight_bias             # per input column, when norm is enabled

``ScalarLayerState`` holds integer codes for the scalar methods (RTN, GPTQ, LRQ)::

    W[o, j] = scales[o, j // group_size] * (codes[o, j] - zeros[o, j // group_size])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vptq_core.kernels import VQSpec
from vptq_core.kernels.reference import scalar_expand, vq_expand

from .bits import BitsInfo, scalar_bits, vq_bits
from .codebook_grid import snap


@dataclass
class VQLayerState:
    """One VPTQ-quantized linear layer, indices unpacked.

    Shapes (G = group_num, R = ceil(out/v), Ro = ceil(out/vo)):
      centroids [G, k*v]; indices [G, R, group_size] int64, or int16 holding uint16 patterns (``as_index``);
      res_centroids [G, k_res*v] | None; res_indices [G, R, group_size] | None;
      outlier_centroids [1, k_o*vo] | None; outlier_indices [1, Ro, outlier_size] | None;
      perm [in] int64 | None; weight_scale, weight_bias [in] | None; bias [out] | None.
    codebook_bits 8: the codebooks are stored as int8 and a scale per dimension (``codebook_grid``); the
    float tensors here then hold the grid's values (``snap_codebooks``).
    """

    in_features: int
    out_features: int
    vector_len: int
    num_centroids: int
    group_num: int
    group_size: int
    centroids: torch.Tensor
    indices: torch.Tensor
    num_res_centroids: int = -1
    res_centroids: torch.Tensor | None = None
    res_indices: torch.Tensor | None = None
    outlier_vector_len: int = -1
    num_outlier_centroids: int = -1
    outlier_size: int = 0
    outlier_centroids: torch.Tensor | None = None
    outlier_indices: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None
    weight_bias: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    codebook_bits: int = 16

    def __post_init__(self) -> None:
        if self.codebook_bits not in (8, 16):
            raise ValueError(f"codebook_bits must be 16 or 8, got {self.codebook_bits!r}")
        rows = math.ceil(self.out_features / self.vector_len)
        expected = (self.group_num, rows, self.group_size)
        if tuple(self.indices.shape) != expected:
            raise ValueError(f"indices shape {tuple(self.indices.shape)} != expected {expected}")
        if self.outlier_size + self.group_num * self.group_size != self.in_features:
            raise ValueError(
                f"outlier_size ({self.outlier_size}) + group_num*group_size "
                f"({self.group_num}*{self.group_size}) must equal in_features ({self.in_features})"
            )
        if tuple(self.centroids.shape) != (self.group_num, self.num_centroids * self.vector_len):
            raise ValueError(f"centroids shape {tuple(self.centroids.shape)} does not match config")
        if (self.res_centroids is None) != (self.num_res_centroids <= 0):
            raise ValueError("res_centroids must be given exactly when num_res_centroids > 0")
        if (self.outlier_centroids is None) != (self.outlier_size <= 0):
            raise ValueError("outlier_centroids must be given exactly when outlier_size > 0")

    @property
    def index_bits(self) -> int:
        return int(math.log2(self.num_centroids))

    @property
    def res_index_bits(self) -> int:
        return int(math.log2(self.num_res_centroids)) if self.num_res_centroids > 0 else 0

    @property
    def enable_norm(self) -> bool:
        return self.weight_scale is not None

    @property
    def enable_perm(self) -> bool:
        return self.perm is not None

    @property
    def spec(self) -> VQSpec:
        return VQSpec.from_state(self)

    def layer_config(self) -> dict:
        """The per-layer entry of ``quantization_config["config_for_layers"]`` (public VPTQ schema; with 8-bit
        codebooks, its ``codebook_bits`` key besides)."""
        config = self.spec.layer_config(bias=self.bias is not None, enable_norm=self.enable_norm,
                                        enable_perm=self.enable_perm)
        return {**config, "codebook_bits": 8} if self.codebook_bits == 8 else config

    def codebook_tables(self) -> dict[str, tuple[torch.Tensor, int]]:
        """Name -> (codebook table, its vector length) of every codebook this layer has."""
        tables = {"centroids": (self.centroids, self.vector_len)}
        if self.res_centroids is not None:
            tables["res_centroids"] = (self.res_centroids, self.vector_len)
        if self.outlier_centroids is not None:
            tables["outlier_centroids"] = (self.outlier_centroids, self.outlier_vector_len)
        return tables

    def snap_codebooks(self) -> None:
        """With 8-bit codebooks, put every codebook on its grid (in place: after training moved them); else
        nothing."""
        if self.codebook_bits == 8:
            for name, (table, v) in self.codebook_tables().items():
                setattr(self, name, snap(table, v))

    def dequantize(self) -> torch.Tensor:
        """Ŵ [out, in] in the dtype of ``centroids`` (``kernels.reference.vq_expand``; differentiable in the
        float tensors, which fine-tuning relies on)."""
        return vq_expand(self.spec, self.indices, self.res_indices, self.centroids, self.res_centroids,
                         self.outlier_indices, self.outlier_centroids, self.perm, self.weight_scale,
                         self.weight_bias)

    def storage_bits(self) -> BitsInfo:
        """Exact storage of this layer."""
        return vq_bits(
            self.out_features, self.in_features, self.vector_len, self.num_centroids,
            max(self.num_res_centroids, 0), self.outlier_size, self.outlier_vector_len,
            self.num_outlier_centroids, self.group_num, self.enable_norm, self.enable_perm, self.codebook_bits,
        )


@dataclass
class ScalarLayerState:
    """One scalar-quantized linear layer (RTN / GPTQ / LRQ).

    codes [out, in] int (0 .. 2**bits-1); scales, zeros [out, n_groups] float
    (n_groups = ceil(in / group_size); group_size == in_features means one group per output channel);
    bias [out] | None. ``act_bits``/``act_granularity``/``act_scale`` describe optional input activation
    quantization (per-token dynamic or per-tensor static), applied by the module at run time.
    """

    in_features: int
    out_features: int
    bits: int
    group_size: int
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bias: torch.Tensor | None = None
    method: str = "rtn"
    act_bits: int = 16
    act_granularity: str = "token"
    act_scale: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {self.bits}")
        n_groups = math.ceil(self.in_features / self.group_size)
        if tuple(self.codes.shape) != (self.out_features, self.in_features):
            raise ValueError(f"codes shape {tuple(self.codes.shape)} != ({self.out_features}, {self.in_features})")
        for name in ("scales", "zeros"):
            shape = tuple(getattr(self, name).shape)
            if shape != (self.out_features, n_groups):
                raise ValueError(f"{name} shape {shape} != ({self.out_features}, {n_groups})")

    def dequantize(self) -> torch.Tensor:
        """W [out, in] in the dtype of ``scales`` (``kernels.reference.scalar_expand``)."""
        return scalar_expand(self.codes, self.scales, self.zeros, self.group_size)

    def storage_bits(self) -> BitsInfo:
        """Codes plus one scale and one zero point per (row, group)."""
        return scalar_bits(self.out_features, self.in_features, self.bits, self.group_size)
