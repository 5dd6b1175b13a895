"""Codebooks stored in 8 bits (``codebook_bits`` 8; docs/methods.md#8-bit-codebooks).

A codebook table [rows, k*v] (one row per group, k centroids of v values) is stored as int8 entries and one
float32 scale per row and vector dimension: ``centroid[r, c, t] = codes[r, c*v + t] * scale[r, t]``, the scale
``max_c |centroid[r, c, t]| / 127``. The grid's step is finer than the bf16 rounding a 16-bit codebook gets at
its largest entries, and the codebook costs half the bits, which a small model's bit plan spends on index bits.

The quantizer puts its codebooks on the grid as soon as it makes them (``snap``), so the sweep assigns indices
against the centroids that are stored; the checkpoint writes ``to_grid`` of them and reads ``from_grid`` back.
"""

from __future__ import annotations

import torch

LEVELS = 127  # int8 codes in [-127, 127]: symmetric, so the grid holds 0


def _check(table: torch.Tensor, vector_len: int) -> None:
    if table.dim() != 2 or vector_len < 1 or table.shape[1] % vector_len:
        raise ValueError(f"a codebook table must be [rows, k * vector_len] with vector_len {vector_len}, "
                         f"got shape {tuple(table.shape)}")


def to_grid(table: torch.Tensor, vector_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """table [rows, k*v] (any float dtype) -> (codes int8 [rows, k*v], scale float32 [rows, v])."""
    _check(table, vector_len)
    rows = table.shape[0]
    values = table.detach().float().reshape(rows, -1, vector_len)
    amax = values.abs().amax(dim=1)  # [rows, v]
    scale = torch.where(amax > 0, amax / LEVELS, torch.ones_like(amax))
    codes = torch.round(values / scale[:, None, :]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes.reshape(rows, -1), scale


def from_grid(codes: torch.Tensor, scale: torch.Tensor, vector_len: int) -> torch.Tensor:
    """(codes int8 [rows, k*v], scale [rows, v]) -> the float32 table [rows, k*v]."""
    _check(codes, vector_len)
    rows = codes.shape[0]
    if codes.dtype != torch.int8:
        raise ValueError(f"codebook codes must be int8, got {codes.dtype}")
    if tuple(scale.shape) != (rows, vector_len):
        raise ValueError(f"codebook scale must be [{rows}, {vector_len}], got shape {tuple(scale.shape)}")
    values = codes.reshape(rows, -1, vector_len).float() * scale.float()[:, None, :]
    return values.reshape(rows, -1)


def snap(table: torch.Tensor, vector_len: int) -> torch.Tensor:
    """``table`` on its 8-bit grid, in its own dtype and device (the centroids an 8-bit checkpoint stores)."""
    return from_grid(*to_grid(table, vector_len), vector_len).to(table.dtype)
