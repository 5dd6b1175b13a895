"""Fake quantization of input activations: integers per token (dynamic) or per tensor (static).

Used by LRQ during block reconstruction (docs/methods.md#lrq: W8A8 with per-tensor static activations, W4A8
with per-token activations) and by the quantized linear modules at run time. Granularities:

- "token": symmetric, one dynamic scale per token; the grid for ``bits`` b is
  ``-(2**(b-1) - 1) .. 2**(b-1) - 1`` (e.g. -127..127 for 8 bits)::

      q(x) = clamp(round(x / scale), -qmax, qmax) * scale,   scale = absmax(x_token) / qmax

- "token_asym": asymmetric, a dynamic scale and zero point per token over ``0 .. 2**b - 1`` (as in the LRQ
  reference code): the grid spans [min, max] of the token instead of [-absmax, absmax], so skewed inputs (the
  down projection's, after SiLU) get up to twice the levels::

      q(x) = (clamp(round(x / scale) + zero, 0, 2**b - 1) - zero) * scale,
      scale = (max - min) / (2**b - 1),  zero = round(-min / scale)

- "tensor": symmetric, one static scale from calibration.

Rounding uses a straight-through estimator so the functions can sit inside a training graph: the gradient
with respect to ``x`` is 1 inside the grid range and 0 where the value was clipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from .config import ACT_GRANULARITIES
from .methods import BlockContext, BlockHook

GRANULARITIES = ACT_GRANULARITIES
_EPS = 1e-8


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < 2:
        raise ValueError(f"bits must be an integer >= 2 (>= 16 means no quantization), got {bits!r}")


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


class _FakeQuant(torch.autograd.Function):
    """clamp(round(x / step), -qmax, qmax) * step in float32, cast back to x's dtype; straight-through gradient.

    Hand-written so the backward is one multiply by the not-clipped mask: autograd's clamp backward is very
    slow on CPU. ``clip`` False skips the mask when nothing can be clipped (per-token absmax scales).
    """

    @staticmethod
    def forward(ctx, x, step, qmax: int, clip: bool, zero=None):
        levels = torch.round(x.float() / step)
        if zero is not None:  # asymmetric: levels + zero in 0 .. qmax
            levels = levels.add_(zero)
        clamped = torch.clamp(levels, -qmax if zero is None else 0, qmax)
        ctx.save_for_backward(clamped == levels if clip else None)
        return (clamped if zero is None else clamped.sub_(zero)).mul_(step).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return (grad if inside is None else grad * inside), None, None, None, None


def asym_token_grid(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, zero) of the per-token asymmetric grid, float32 [..., 1] each (``x`` detached, any float dtype)."""
    xf = x.detach().float()
    lo = xf.amin(dim=-1, keepdim=True).clamp(max=0.0)  # the grid always holds 0 exactly (zero padding stays 0)
    hi = xf.amax(dim=-1, keepdim=True).clamp(min=0.0)
    step = ((hi - lo) / (2**bits - 1)).clamp(min=_EPS)
    return step, torch.round(-lo / step)


def quantize_activations(
    x: torch.Tensor, bits: int, granularity: str, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Fake-quantize ``x`` [..., features] to signed ``bits``-bit integers; same shape and dtype as ``x``.

    ``granularity`` "token": one dynamic scale per row of the last dimension, ``absmax(x[..., :]) / qmax``
    (``scale`` must be None). "tensor": the static scalar ``scale`` from ``calibrate_act_scale`` (required);
    values beyond ``qmax * scale`` are clipped. ``bits >= 16`` returns ``x`` unchanged. The arithmetic runs
    in float32 whatever the dtype of ``x``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_bits(bits)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if bits >= 16:
        return x
    if granularity != "tensor" and scale is not None:
        raise ValueError(f"scale must be None for granularity {granularity!r} (the scale is computed per token)")
    if granularity == "tensor":
        if scale is None:
            raise ValueError("granularity 'tensor' needs a static scale (from calibrate_act_scale), got None")
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
            raise ValueError(f"scale must be a tensor with one element, got {scale!r}")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (features last)")
    if granularity == "token_asym":
        step, zero = asym_token_grid(x, bits)
        # round(-min / step) can move the grid by half a step, so the extreme value may clip by one level.
        return _FakeQuant.apply(x, step, 2**bits - 1, True, zero)
    qmax = _qmax(bits)
    if granularity == "token":
        # The dynamic scale is treated as a constant: gradients flow through the rounding only.
        step = (x.detach().abs().amax(dim=-1, keepdim=True).float() / qmax).clamp(min=_EPS)
    else:
        # The positivity check would force a device sync on accelerators, so it only runs for CPU scales.
        if scale.device.type == "cpu" and not bool(scale.detach().reshape(()) > 0):
            raise ValueError(f"scale must be positive, got {float(scale)}")
        step = scale.detach().to(device=x.device, dtype=torch.float32).reshape(())
    # A per-token absmax step maps every value into [-qmax, qmax]: nothing is clipped, the gradient is 1.
    return _FakeQuant.apply(x, step, qmax, granularity == "tensor")


def calibrate_act_scale(samples: Iterable[torch.Tensor], bits: int, percentile: float = 1.0) -> torch.Tensor:
    """Static per-tensor scale (0-dim float32) from calibration activations.

    Each sample (any shape) contributes the ``percentile`` quantile of its absolute values (1.0 = absmax);
    the scale is the largest of these divided by ``qmax = 2**(bits-1) - 1``, so with ``percentile=1.0`` no
    calibration value is clipped. Taking the maximum over samples lets callers stream samples (or batches,
    for ``percentile=1.0``) without holding them all.
    """
    _check_bits(bits)
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0.0 < percentile <= 1.0:
        raise ValueError(f"percentile must be a number in (0, 1] (1.0 = absmax), got {percentile!r}")
    qmax = _qmax(min(bits, 16))
    best: torch.Tensor | None = None
    count = 0
    for sample in samples:
        if not isinstance(sample, torch.Tensor):
            raise TypeError(f"samples must yield torch.Tensor, got {type(sample).__name__}")
        if sample.numel() == 0:
            continue
        flat = sample.detach().reshape(-1).float().abs()
        if percentile >= 1.0:
            value = flat.max()
        else:
            k = max(1, min(flat.numel(), round(percentile * flat.numel())))
            value = flat.kthvalue(k).values
        best = value if best is None else torch.maximum(best, value.to(best.device))
        count += 1
    if count == 0:
        raise ValueError("samples must contain at least one non-empty tensor")
    return (best / qmax).clamp(min=_EPS).cpu()


# Clip ratios of the absmax tried by the "mse" search (a static scale is clip * absmax / qmax).
CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.07, 0.05, 0.03, 0.02, 0.01)
MSE_TOKENS = 4096  # calibration tokens per linear the "mse" search scores (evenly spaced)


@torch.no_grad()
def calibrate_static_scales(
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor], block: nn.Module, names: list[str],
    inputs: torch.Tensor, bits: int, batch_size: int = 8, clip: str = "absmax",
) -> dict[str, torch.Tensor]:
    """Static per-tensor scales of the inputs of ``block``'s linears ``names`` while ``forward(block, x)`` runs
    over ``inputs`` [n, seq, hidden] in batches (on the block's device, float32).

    ``clip`` "absmax": absmax / qmax, nothing is clipped. "mse": among ``CLIP_RATIOS`` of the absmax, the one
    whose fake-quantized inputs give the smallest output error ``||(q(x) - x) Wᵀ||²`` of that linear on
    ``MSE_TOKENS`` calibration tokens: with a few massive activations (attention sinks, orders of magnitude over
    the rest) the absmax step wipes out every other channel, and clipping the rare outliers costs less.
    """
    if clip not in ("absmax", "mse"):
        raise ValueError(f"clip must be 'absmax' or 'mse', got {clip!r}")
    found: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    samples: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    device = next(iter(block.parameters()), inputs).device
    tokens = inputs.shape[0] * inputs.shape[1]
    stride = max(1, tokens // MSE_TOKENS)

    def hook(name):
        def record(_module, args):
            x = args[0]
            found[name].append(calibrate_act_scale([x], bits))
            if clip == "mse":
                flat = x.detach().reshape(-1, x.shape[-1]).float()
                samples[name].append(flat[::stride])
        return record

    handles = [block.get_submodule(name).register_forward_pre_hook(hook(name)) for name in names]
    try:
        for start in range(0, inputs.shape[0], batch_size):
            forward(block, inputs[start : start + batch_size].to(device=device, dtype=torch.float32))
    finally:
        for handle in handles:
            handle.remove()
    scales = {name: torch.stack(values).max() for name, values in found.items()}
    if clip == "mse":
        for name in names:
            weight = block.get_submodule(name).weight.detach().float()
            scales[name] = _mse_scale(torch.cat(samples[name])[:MSE_TOKENS], weight, scales[name], bits)
    return scales


def _mse_scale(x: torch.Tensor, weight: torch.Tensor, absmax_scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The clipped static scale with the smallest output error ||(q(x) - x) Wᵀ||² (x [t, in], W [out, in])."""
    qmax = _qmax(bits)
    best, best_err = absmax_scale, None
    for ratio in CLIP_RATIOS:
        step = (absmax_scale * ratio).clamp(min=_EPS).to(x.device)
        error = (torch.clamp(torch.round(x / step), -qmax, qmax) * step - x) @ weight.T
        err = float(error.pow(2).sum())
        if best_err is None or err < best_err:
            best, best_err = (absmax_scale * ratio).clamp(min=_EPS), err
    return best.cpu()


def install_activation_quant(linears: dict[str, nn.Module], states: dict) -> None:
    """Fake-quantize the inputs of quantized linears (W4A8 / W8A8) from now on, as the packed modules will."""
    for name, linear in linears.items():
        st = states[name]

        def pre_hook(_m, args, st=st):
            return (quantize_activations(args[0], st.act_bits, st.act_granularity, st.act_scale),) + args[1:]

        linear.register_forward_pre_hook(pre_hook)


def _activation_hook(ctx: BlockContext) -> dict | None:
    """After a scalar method quantized a block's weights: record the activation settings in the states,
    calibrate static per-tensor scales the method did not set itself (on the weight-quantized block), and
    fake-quantize the linears' inputs for the following blocks."""
    config = ctx.config
    missing = [name for name, st in ctx.states.items()
               if config.act_granularity == "tensor" and getattr(st, "act_scale", None) is None]
    scales = (calibrate_static_scales(ctx.forward, ctx.block, missing, ctx.inputs, config.act_bits,
                                      clip=config.act_clip) if missing else {})
    for name, st in ctx.states.items():
        st.act_bits, st.act_granularity = config.act_bits, config.act_granularity
        if name in scales:
            st.act_scale = scales[name].reshape(()).cpu()
    install_activation_quant(ctx.linears, ctx.states)
    return None


ACTIVATION_HOOK = BlockHook("act_calibration", lambda config: config.act_bits < 16, _activation_hook)
