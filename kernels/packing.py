"""Bit packing of VPTQ index streams and scalar integer codes into int32 words.

Layout (public VPTQ ``pack_index``): along the last dimension, entry ``i`` is the ``T``-bit value
``e_i = (res_i << index_bits) | idx_i`` (``T = index_bits + res_bits``) and occupies stream bits
``[i*T, (i+1)*T)``. The stream is cut into little-endian 32-bit words, bit 0 of word 0 first (LSB-first);
an entry may straddle two words and the unused tail bits of the last word are 0. Every row (all leading
dimensions) is its own stream. Words are stored as int32 holding the unsigned 32-bit pattern.

Scalar codes use the same stream layout with ``T = bits``.

Both directions are vectorised torch on int64 (one scatter/gather per word half, no loop over entries).
"""

from __future__ import annotations

import math

import torch

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32)


def packed_width(num_elements: int, bits: int) -> int:
    """Number of int32 words holding ``num_elements`` entries of ``bits`` bits."""
    return math.ceil(num_elements * bits / 32)


def _check_bits(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {value}")


def _as_values(name: str, values: torch.Tensor, bits: int) -> torch.Tensor:
    """Check an integer tensor holds values in [0, 2**bits) and return it as int64."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got dtype {values.dtype}")
    if values.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    values = values.to(torch.int64)
    if values.numel():
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= (1 << bits):
            raise ValueError(f"{name} values must be in [0, {1 << bits}) for {bits} bits, got range [{lo}, {hi}]")
    return values


def _pack_stream(entries: torch.Tensor, width: int) -> torch.Tensor:
    """entries int64 [..., n] (each < 2**width) -> int32 [..., ceil(n*width/32)]."""
    *lead, n = entries.shape
    words = packed_width(n, width)
    flat = entries.reshape(-1, n)
    bit = torch.arange(n, device=entries.device, dtype=torch.int64) * width
    word, shift = bit // 32, bit % 32
    low = (flat << shift) & 0xFFFFFFFF  # the part inside word `word`
    high = flat >> (32 - shift)  # the part spilling into word `word + 1` (0 when it fits)
    acc = torch.zeros(flat.shape[0], words + 1, dtype=torch.int64, device=entries.device)
    # Entries never overlap, so adding the pieces equals OR-ing them.
    acc.scatter_add_(1, word.expand_as(flat), low)
    acc.scatter_add_(1, (word + 1).expand_as(flat), high)
    acc = acc[:, :words]
    acc = torch.where(acc >= 2**31, acc - 2**32, acc)  # unsigned pattern -> int32
    return acc.to(torch.int32).reshape(*lead, words)


def _unpack_stream(packed: torch.Tensor, width: int, num_elements: int) -> torch.Tensor:
    """int32 [..., W] -> int64 [..., num_elements] of ``width``-bit entries."""
    *lead, words = packed.shape
    flat = packed.reshape(-1, words).to(torch.int64) & 0xFFFFFFFF
    flat = torch.cat([flat, flat.new_zeros(flat.shape[0], 1)], dim=1)
    bit = torch.arange(num_elements, device=packed.device, dtype=torch.int64) * width
    word, shift = bit // 32, bit % 32
    low = flat.index_select(1, word) >> shift
    high = flat.index_select(1, word + 1) << (32 - shift)
    entries = (low | high) & ((1 << width) - 1)
    return entries.reshape(*lead, num_elements)


def _check_packed(packed: torch.Tensor, num_elements: int, width: int) -> None:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.int32:
        raise TypeError(f"packed must be int32, got dtype {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed must have at least one dimension, got a scalar")
    if isinstance(num_elements, bool) or not isinstance(num_elements, int) or num_elements < 0:
        raise ValueError(f"num_elements must be a non-negative int, got {num_elements!r}")
    expected = packed_width(num_elements, width)
    if packed.shape[-1] != expected:
        raise ValueError(
            f"packed last dimension ({packed.shape[-1]}) must be ceil({num_elements}*{width}/32) = {expected}"
        )


def pack_indices(
    indices: torch.Tensor, index_bits: int, res_indices: torch.Tensor | None = None, res_bits: int = 0
) -> torch.Tensor:
    """Pack VPTQ indices (and residual indices) into the public int32 bit-stream layout.

    indices int [..., n] in [0, 2**index_bits); res_indices int [..., n] in [0, 2**res_bits) or None
    -> int32 [..., ceil(n * (index_bits + res_bits) / 32)]. index_bits in 1..16, res_bits in 0..16
    (must be > 0 exactly when res_indices is given).
    """
    _check_bits("index_bits", index_bits, 1, 16)
    _check_bits("res_bits", res_bits, 0, 16)
    entries = _as_values("indices", indices, index_bits)
    if res_indices is None:
        if res_bits != 0:
            raise ValueError(f"res_bits is {res_bits} but res_indices is None; pass both or neither")
    else:
        if res_bits == 0:
            raise ValueError("res_indices given but res_bits is 0; res_bits must be in 1..16")
        if tuple(res_indices.shape) != tuple(indices.shape):
            raise ValueError(
                f"res_indices shape {tuple(res_indices.shape)} must equal indices shape {tuple(indices.shape)}"
            )
        entries = entries | (_as_values("res_indices", res_indices, res_bits) << index_bits)
    return _pack_stream(entries, index_bits + res_bits)


def unpack_indices(
    packed: torch.Tensor, index_bits: int, num_elements: int, res_bits: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of ``pack_indices``: int32 [..., W] -> (indices int64 [..., n], res_indices int64 [..., n] | None)."""
    _check_bits("index_bits", index_bits, 1, 16)
    _check_bits("res_bits", res_bits, 0, 16)
    width = index_bits + res_bits
    _check_packed(packed, num_elements, width)
    entries = _unpack_stream(packed, width, num_elements)
    indices = entries & ((1 << index_bits) - 1)
    res_indices = (entries >> index_bits) if res_bits else None
    return indices, res_indices


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack scalar integer codes: int [rows, n] in [0, 2**bits) -> int32 [rows, ceil(n*bits/32)]; bits in 1..8."""
    _check_bits("bits", bits, 1, 8)
    values = _as_values("codes", codes, bits)
    if values.dim() != 2:
        raise ValueError(f"codes must be 2-D [rows, n], got shape {tuple(codes.shape)}")
    return _pack_stream(values, bits)


def unpack_codes(packed: torch.Tensor, bits: int, num_elements: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: int32 [rows, W] -> int64 [rows, num_elements]."""
    _check_bits("bits", bits, 1, 8)
    _check_packed(packed, num_elements, bits)
    if packed.dim() != 2:
        raise ValueError(f"packed must be 2-D [rows, W], got shape {tuple(packed.shape)}")
    return _unpack_stream(packed, bits, num_elements)
