"""Uniform integer grids: per-channel / per-group scale and zero point, round-to-nearest (RTN).

Shared by RTN, GPTQ and LRQ (whose training starts exactly at RTN).
"""

from __future__ import annotations

import torch

from .states import ScalarLayerState


def effective_group_size(group_size: int, in_features: int) -> int:
    """``0`` (or anything >= in_features) means one group spanning the whole row."""
    return in_features if group_size <= 0 or group_size >= in_features else group_size


def grid_params(
    W: torch.Tensor, bits: int, sym: bool = False, clip_search: bool = False, grid_steps: int = 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of ``W`` [rows, cols] -> (scale [rows, 1], zero [rows, 1]).

    ``clip_search`` shrinks the [min, max] range (factors 1.0 .. 0.5) per row to minimise the squared
    rounding error, as in the LRQ/OmniQuant initialisations.
    """
    W = W.float()
    maxq = 2**bits - 1
    wmin = W.min(dim=1, keepdim=True).values.clamp(max=0)
    wmax = W.max(dim=1, keepdim=True).values.clamp(min=0)
    if sym:
        amax = torch.maximum(wmin.abs(), wmax)
        wmin, wmax = -amax, amax

    def params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (hi - lo).clamp(min=1e-8) / maxq
        zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-lo / scale)
        return scale, zero

    scale, zero = params(wmin, wmax)
    if not clip_search:
        return scale, zero
    best = _sq_err(W, scale, zero, maxq)
    for step in range(1, grid_steps):
        factor = 1.0 - 0.5 * step / grid_steps
        cand_scale, cand_zero = params(wmin * factor, wmax * factor)
        err = _sq_err(W, cand_scale, cand_zero, maxq)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, cand_scale, scale)
        zero = torch.where(better, cand_zero, zero)
    return scale, zero


def _sq_err(W: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    q = torch.clamp(torch.round(W / scale) + zero, 0, maxq)
    return ((scale * (q - zero) - W) ** 2).sum(dim=1, keepdim=True)


def quantize_codes(W: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes of ``W`` on the grid (broadcasting scale/zero) -> int tensor like W."""
    return torch.clamp(torch.round(W / scale) + zero, 0, 2**bits - 1)


def rtn_quantize(
    W: torch.Tensor, bits: int, group_size: int = 0, sym: bool = False, clip_search: bool = False,
    bias: torch.Tensor | None = None,
) -> ScalarLayerState:
    """Round-to-nearest of ``W`` [out, in] with per-(row, group) grids."""
    out_features, in_features = W.shape
    gs = effective_group_size(group_size, in_features)
    W = W.float()
    scales, zeros, codes = [], [], []
    for start in range(0, in_features, gs):
        block = W[:, start : start + gs]
        scale, zero = grid_params(block, bits, sym=sym, clip_search=clip_search)
        codes.append(quantize_codes(block, scale, zero, bits))
        scales.append(scale)
        zeros.append(zero)
    return ScalarLayerState(
        in_features=in_features, out_features=out_features, bits=bits, group_size=gs,
        codes=torch.cat(codes, dim=1).to(torch.uint8), scales=torch.cat(scales, dim=1),
        zeros=torch.cat(zeros, dim=1), bias=None if bias is None else bias.detach().clone(), method="rtn",
    )
