"""What every kernel backend takes: a layer's integer shape (``VQSpec`` / ``ScalarSpec``) and its tensors
(``VQWeights`` / ``ScalarWeights``), so one argument list serves every backend and is flattened only at the
``torch.library`` custom-op boundary.

Vocabulary (public VPTQ layout, see ``vptq_core/quant/states.py``):
  v = vector_len, k = num_centroids, G = group_num, R = rows = ceil(out / v);
  the main indices cover ``group_num * group_size`` stored columns, preceded by ``outlier_size``
  outlier columns that have their own codebook (vector length vo, k_o centroids).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch


class VQWeights(NamedTuple):
    """The tensors of one packed VPTQ linear (public VPTQ names and layout)."""

    indices: torch.Tensor  # int32 [G, R, packed_words]: per vector row, LSB-first (res << b) | idx streams
    centroids: torch.Tensor  # [G, k*v]
    res_centroids: torch.Tensor | None = None  # [G, k_res*v]
    outlier_indices: torch.Tensor | None = None  # int16 [1, Ro, outlier_size] (uint16 patterns)
    outlier_centroids: torch.Tensor | None = None  # [1, k_o*vo]
    perm: torch.Tensor | None = None  # [in]: stored column i holds original column perm[i]
    weight_scale: torch.Tensor | None = None  # [in] (norm: W = W' * scale + bias per input column)
    weight_bias: torch.Tensor | None = None  # [in]
    bias: torch.Tensor | None = None  # [out]

    def float_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors autograd may track (codebooks, norm, bias)."""
        return (self.centroids, self.res_centroids, self.outlier_centroids, self.weight_scale, self.weight_bias,
                self.bias)


class ScalarWeights(NamedTuple):
    """The tensors of one scalar-code linear (RTN / GPTQ / LRQ)."""

    codes: torch.Tensor  # int32 [out, ceil(in*bits/32)]: per row, an LSB-first stream of bits-wide codes
    scales: torch.Tensor  # [out, groups]
    zeros: torch.Tensor  # [out, groups] (float or integer zero points)
    bias: torch.Tensor | None = None  # [out]

    def float_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.scales, self.zeros if self.zeros.is_floating_point() else None, self.bias)


@dataclass(frozen=True)
class ScalarSpec:
    """Integer shape of a scalar-code layer: ``W[o, j] = scales[o, j // group_size] * (code - zero)``."""

    in_features: int
    out_features: int
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        for name, lo, hi in (("in_features", 1, None), ("out_features", 1, None), ("bits", 1, 8),
                             ("group_size", 1, None)):
            _check_int(name, getattr(self, name), lo, hi, owner="ScalarSpec")

    @property
    def groups(self) -> int:
        return math.ceil(self.in_features / self.group_size)

    @property
    def packed_words(self) -> int:
        return math.ceil(self.in_features * self.bits / 32)

    def as_list(self) -> list[int]:
        return [self.in_features, self.out_features, self.bits, self.group_size]

    @classmethod
    def from_list(cls, values: list[int] | tuple[int, ...]) -> ScalarSpec:
        if len(values) != 4:
            raise ValueError(f"ScalarSpec.from_list needs 4 ints, got {len(values)}")
        return cls(*[int(v) for v in values])


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _check_int(name: str, value: object, lo: int, hi: int | None = None, owner: str = "VQSpec") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{owner}.{name} must be {allowed}, got {value}")


def _check_centroids(name: str, value: object) -> None:
    _check_int(name, value, 2, 65536)
    if not _is_pow2(value):  # type: ignore[arg-type]
        raise ValueError(f"VQSpec.{name} must be a power of two in 2..65536, got {value}")


@dataclass(frozen=True)
class VQSpec:
    """Validated integer description of a VPTQ linear layer (all fields ints).

    ``num_res_centroids=-1`` disables the residual codebook; ``outlier_size=0`` disables outliers
    (then ``outlier_vector_len``/``num_outlier_centroids`` must stay -1). ``group_size=0`` means
    ``(in_features - outlier_size) / group_num``.
    """

    in_features: int
    out_features: int
    vector_len: int
    num_centroids: int
    num_res_centroids: int = -1
    outlier_vector_len: int = -1
    num_outlier_centroids: int = -1
    group_num: int = 1
    group_size: int = 0
    outlier_size: int = 0

    def __post_init__(self) -> None:
        _check_int("in_features", self.in_features, 1)
        _check_int("out_features", self.out_features, 1)
        _check_int("vector_len", self.vector_len, 1, 64)
        _check_centroids("num_centroids", self.num_centroids)
        _check_int("num_res_centroids", self.num_res_centroids, -1)
        if self.num_res_centroids != -1:
            _check_centroids("num_res_centroids", self.num_res_centroids)
        _check_int("group_num", self.group_num, 1)
        _check_int("outlier_size", self.outlier_size, 0, self.in_features - 1)
        _check_int("outlier_vector_len", self.outlier_vector_len, -1)
        _check_int("num_outlier_centroids", self.num_outlier_centroids, -1)
        if self.outlier_size > 0:
            # The public reader only enables outliers for vector length > 1.
            _check_int("outlier_vector_len", self.outlier_vector_len, 2, 64)
            _check_centroids("num_outlier_centroids", self.num_outlier_centroids)
            if self.num_outlier_centroids > 65536:
                raise ValueError("VQSpec.num_outlier_centroids must be <= 65536 (uint16 outlier indices)")
        elif self.outlier_vector_len != -1 or self.num_outlier_centroids != -1:
            raise ValueError(
                "VQSpec.outlier_vector_len and num_outlier_centroids must be -1 when outlier_size == 0, got "
                f"{self.outlier_vector_len} and {self.num_outlier_centroids}"
            )
        _check_int("group_size", self.group_size, 0)
        main_cols = self.in_features - self.outlier_size
        if self.group_size == 0:
            if main_cols % self.group_num:
                raise ValueError(
                    f"in_features - outlier_size ({main_cols}) must be divisible by group_num ({self.group_num}) "
                    "when group_size is 0"
                )
            object.__setattr__(self, "group_size", main_cols // self.group_num)
        if self.outlier_size + self.group_num * self.group_size != self.in_features:
            raise ValueError(
                f"outlier_size ({self.outlier_size}) + group_num*group_size ({self.group_num}*{self.group_size}) "
                f"must equal in_features ({self.in_features})"
            )
        if self.index_bits + self.res_bits > 32:
            raise ValueError(f"index_bits + res_bits must be <= 32, got {self.index_bits} + {self.res_bits}")

    @property
    def index_bits(self) -> int:
        return self.num_centroids.bit_length() - 1

    @property
    def res_bits(self) -> int:
        return self.num_res_centroids.bit_length() - 1 if self.num_res_centroids > 0 else 0

    @property
    def entry_bits(self) -> int:
        """Bits of one packed entry ``(res << index_bits) | index``."""
        return self.index_bits + self.res_bits

    @property
    def has_residual(self) -> bool:
        return self.num_res_centroids > 0

    @property
    def has_outliers(self) -> bool:
        return self.outlier_size > 0

    @property
    def rows(self) -> int:
        """Vector rows R = ceil(out / v)."""
        return math.ceil(self.out_features / self.vector_len)

    @property
    def outlier_rows(self) -> int:
        """Outlier vector rows ceil(out / vo) (0 without outliers)."""
        return math.ceil(self.out_features / self.outlier_vector_len) if self.has_outliers else 0

    @property
    def packed_words(self) -> int:
        """int32 words per packed index row: ceil(group_size * (index_bits + res_bits) / 32)."""
        return math.ceil(self.group_size * self.entry_bits / 32)

    def as_list(self) -> list[int]:
        """Field values in declaration order (the integer argument of the registered ops)."""
        return [
            self.in_features, self.out_features, self.vector_len, self.num_centroids, self.num_res_centroids,
            self.outlier_vector_len, self.num_outlier_centroids, self.group_num, self.group_size,
            self.outlier_size,
        ]

    @classmethod
    def from_list(cls, values: list[int] | tuple[int, ...]) -> VQSpec:
        if len(values) != 10:
            raise ValueError(f"VQSpec.from_list needs 10 ints, got {len(values)}")
        return cls(*[int(v) for v in values])

    @classmethod
    def from_state(cls, state) -> VQSpec:
        """The spec of anything with a ``VQLayerState``'s integer fields (``vptq_core.quant.states``)."""
        has_outliers = state.outlier_size > 0
        return cls(
            in_features=int(state.in_features),
            out_features=int(state.out_features),
            vector_len=int(state.vector_len),
            num_centroids=int(state.num_centroids),
            num_res_centroids=int(state.num_res_centroids) if state.num_res_centroids > 0 else -1,
            outlier_vector_len=int(state.outlier_vector_len) if has_outliers else -1,
            num_outlier_centroids=int(state.num_outlier_centroids) if has_outliers else -1,
            group_num=int(state.group_num),
            group_size=int(state.group_size),
            outlier_size=int(state.outlier_size),
        )

    def layer_config(self, *, bias: bool = False, enable_norm: bool = False, enable_perm: bool = False) -> dict:
        """The per-layer entry of ``quantization_config["config_for_layers"]`` (public VPTQ schema)."""
        return {
            "bias": bool(bias),
            "enable_norm": bool(enable_norm),
            "enable_perm": bool(enable_perm),
            "group_num": self.group_num,
            "group_size": self.group_size,
            "in_features": self.in_features,
            "indices_as_float": False,
            "is_indice_packed": True,
            "num_centroids": [self.num_outlier_centroids, self.num_centroids],
            "num_res_centroids": [-1, self.num_res_centroids],
            "out_features": self.out_features,
            "outlier_size": self.outlier_size,
            "vector_lens": [self.outlier_vector_len, self.vector_len],
        }
