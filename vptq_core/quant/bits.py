"""Bits per weight, counted two ways: index (or code) bits alone, and total bits including codebooks,
outlier codebooks and indices, normalisation scales/biases, permutations and scalar grids.

Every stored float (centroid, scale, zero point) counts 16 bits, a centroid of an 8-bit codebook 8 bits and its
float32 scales 32 bits (``codebook_grid``); a permutation entry counts 16 bits. Before a
run, a layer's bits come from its method (``Method.bits``, ``vptq_core.quant.methods``); after it, from its
state (``storage_bits()`` of ``VQLayerState`` / ``ScalarLayerState``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLOAT_BITS = 16
OUTLIER_INDEX_BITS = 16
SCALE_BITS = 32  # an 8-bit codebook's scale per dimension, stored in float32


@dataclass(frozen=True)
class BitsInfo:
    weights: int  # number of weights served
    index_bits: int  # total index/code bits
    total_bits: int  # index bits + every overhead

    @property
    def index_bits_per_weight(self) -> float:
        return self.index_bits / self.weights

    @property
    def total_bits_per_weight(self) -> float:
        return self.total_bits / self.weights

    def __add__(self, other: BitsInfo) -> BitsInfo:
        return BitsInfo(self.weights + other.weights, self.index_bits + other.index_bits,
                        self.total_bits + other.total_bits)


def vq_bits(
    out_features: int, in_features: int, vector_len: int, num_centroids: int, num_res_centroids: int = 0,
    outlier_size: int = 0, outlier_vector_len: int = 0, outlier_centroids: int = 0, group_num: int = 1,
    norm: bool = False, perm: bool = False, codebook_bits: int = 16,
) -> BitsInfo:
    """Exact storage of one VPTQ layer (indices counted unpadded, as bit streams); ``codebook_bits`` 8: every
    codebook as int8 entries plus one float32 scale per row (group) and vector dimension."""
    b = int(math.log2(num_centroids))
    br = int(math.log2(num_res_centroids)) if num_res_centroids > 0 else 0
    group_size = (in_features - outlier_size) // group_num
    rows = math.ceil(out_features / vector_len)
    index = group_num * rows * group_size * (b + br)
    if codebook_bits not in (8, 16):
        raise ValueError(f"codebook_bits must be 16 or 8, got {codebook_bits!r}")
    scale = SCALE_BITS if codebook_bits == 8 else 0  # per row and dimension of each table
    tables = 2 if num_res_centroids > 0 else 1
    codebooks = group_num * vector_len * ((num_centroids + max(num_res_centroids, 0)) * codebook_bits + tables * scale)
    if outlier_size:
        # The public format stores outlier indices unpacked, as int16: count what is stored.
        index += math.ceil(out_features / outlier_vector_len) * outlier_size * OUTLIER_INDEX_BITS
        codebooks += outlier_vector_len * (outlier_centroids * codebook_bits + scale)
    extra = (2 * in_features * FLOAT_BITS if norm else 0) + (in_features * 16 if perm else 0)
    return BitsInfo(out_features * in_features, index, index + codebooks + extra)


def scalar_bits(out_features: int, in_features: int, bits: int, group_size: int) -> BitsInfo:
    """Codes plus one scale and one zero point per (row, group)."""
    gs = in_features if group_size <= 0 or group_size >= in_features else group_size
    groups = math.ceil(in_features / gs)
    index = out_features * in_features * bits
    return BitsInfo(out_features * in_features, index, index + 2 * out_features * groups * FLOAT_BITS)
