"""Uniform integer grids: per-channel / per-group scale and zero point, round-to-nearest (RTN).

The grids, the bits accounting, presets and settings label are shared by RTN, GPTQ and LRQ (whose training
starts exactly at RTN).
"""

from __future__ import annotations

import torch

from .act_quant import ACTIVATION_HOOK
from .bits import BitsInfo, scalar_bits
from .config import SCALAR_PRESET_OFF, ScalarConfig
from .cost import rounding_seconds
from .distill_hook import DISTILL_HOOK, settings_needs
from .hessian import proxy_loss
from .methods import Method, QuantResult, register
from .states import ScalarLayerState


def effective_group_size(group_size: int, in_features: int) -> int:
    """``0`` (or anything >= in_features) means one group spanning the whole row."""
    return in_features if group_size <= 0 or group_size >= in_features else group_size


def grid_params(
    W: torch.Tensor, bits: int, sym: bool = False, clip_search: bool = False, grid_steps: int = 20,
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of ``W`` [rows, cols] -> (scale [rows, 1], zero [rows, 1]).

    ``scale_dtype``: each scale is rounded up to a value exact in that dtype before its zero point (and the
    codes) follow from it, so a module holding its scales in that dtype reproduces the grid the codes were
    chosen on (rounding an 8-bit grid's fp32 scale to bf16 afterwards moves its top codes by up to half a step).

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
        if scale_dtype is not None:
            exact = scale.to(scale_dtype)
            up = torch.nextafter(exact, torch.full_like(exact, float("inf")))
            scale = torch.where(exact.float() < scale, up, exact).float()
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
    bias: torch.Tensor | None = None, scale_dtype: torch.dtype | None = None,
) -> ScalarLayerState:
    """Round-to-nearest of ``W`` [out, in] with per-(row, group) grids (``scale_dtype``: see ``grid_params``)."""
    out_features, in_features = W.shape
    gs = effective_group_size(group_size, in_features)
    W = W.float()
    scales, zeros, codes = [], [], []
    for start in range(0, in_features, gs):
        block = W[:, start : start + gs]
        scale, zero = grid_params(block, bits, sym=sym, clip_search=clip_search, scale_dtype=scale_dtype)
        codes.append(quantize_codes(block, scale, zero, bits))
        scales.append(scale)
        zeros.append(zero)
    return ScalarLayerState(
        in_features=in_features, out_features=out_features, bits=bits, group_size=gs,
        codes=torch.cat(codes, dim=1).to(torch.uint8), scales=torch.cat(scales, dim=1),
        zeros=torch.cat(zeros, dim=1), bias=None if bias is None else bias.detach().clone(), method="rtn",
    )


def scalar_result(state: ScalarLayerState, W: torch.Tensor, H: torch.Tensor) -> QuantResult:
    """The ``QuantResult`` of a scalar state for the original weight ``W`` and its Hessian ``H``."""
    W_hat = state.dequantize().float()
    loss, rel = proxy_loss(W, W_hat, H.float())
    rel_w = float(torch.linalg.norm(W_hat - W) / torch.linalg.norm(W).clamp(min=1e-12))
    return QuantResult(state=state, weight=W_hat, proxy_loss=loss, rel_proxy_loss=rel, rel_weight_error=rel_w)


def rtn_layer(
    W: torch.Tensor, H: torch.Tensor, config: ScalarConfig, bias: torch.Tensor | None = None,
    hessian_cache: dict | None = None,
) -> QuantResult:
    """Round-to-nearest (H is only used to report the proxy loss)."""
    W = W.detach().float()
    state = rtn_quantize(W, config.bits, config.group_size, sym=config.sym, clip_search=config.clip_search, bias=bias)
    return scalar_result(state, W, H)


def scalar_config_bits(config, out_features: int, in_features: int) -> BitsInfo:
    """Bits of one layer under any scalar config (codes + a scale and a zero point per group)."""
    return scalar_bits(out_features, in_features, config.bits, config.group_size)


def describe_scalar(settings) -> str:
    """Short label of scalar settings, e.g. ``3b g64`` or ``4b per-channel rankauto A8``."""
    group = settings.get("group_size")
    text = f"{settings.get('bits')}b " + (f"g{group}" if group else "per-channel")
    if "rank" in settings and settings["rank"] is not None:
        text += f" rank{settings['rank'] or 'auto'}"
    if (settings.get("act_bits") or 16) < 16:
        kind = {"token": "", "token_asym": " asym"}.get(settings.get("act_granularity"), " static")
        text += f" A{settings['act_bits']}{kind}"
    from .distill import distill_label  # the training module, loaded when a label is asked for

    return text + distill_label(settings)


# Named by total bits per weight: group 64 adds a 16-bit scale and zero point per 64 weights (0.5 bits). Every
# preset names its distillation steps and self-written calibration share (here none), so picking it never keeps
# another method's.
SCALAR_PRESETS = {"2.5 bits": {"bits": 2, "group_size": 64, **SCALAR_PRESET_OFF},
                  "3.5 bits": {"bits": 3, "group_size": 64, **SCALAR_PRESET_OFF},
                  "4.5 bits": {"bits": 4, "group_size": 64, **SCALAR_PRESET_OFF}}

METHOD = register(Method(
    name="rtn", label="RTN", config_class=ScalarConfig, bits=scalar_config_bits, describe=describe_scalar,
    presets=SCALAR_PRESETS, description="round-to-nearest on per-channel or per-group grids (the baseline)",
    quantize_linear=lambda W, H, config, bias, cache: rtn_layer(W, H, config, bias),
    after_block=(ACTIVATION_HOOK,), after_model=(DISTILL_HOOK,), config_needs=settings_needs, cost=rounding_seconds,
))
