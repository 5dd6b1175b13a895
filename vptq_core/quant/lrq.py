"""LRQ: scalar quantization with a learned low-rank weight scaling (docs/methods.md#lrq, arXiv 2407.11534).

Per linear layer (weight ``W`` [out, in], b bits, asymmetric, per output channel or per (channel, group))::

    D     = L @ U + r + c           # L [out, rank] = 0, U [rank, in] Kaiming-uniform, r [out, 1] = c [1, in] = 0
    W_int = clamp(round(W / (s1 * exp(D))) + z, 0, 2**b - 1)
    W_hat = s1 * (W_int - z)        # s1, z [out, n_groups] broadcast over each group's columns

``s1`` and ``z`` start from round-to-nearest (``rtn.rtn_quantize``, optional clipping search) and ``z`` stays
fixed, so training starts exactly at RTN. ``log s1``, ``L``, ``U``, ``r`` and ``c`` are learned by Adam (cosine
schedule to 0; ``train.train_holdout``) to make the block's output match the full-precision block's output
(MSE), with straight-through rounding; the training is kept unless it made that MSE worse. ``full_scale=True``
learns a full [out, in] matrix instead of ``L @ U`` (FlexRound). After training ``D`` is folded into the integer
codes: a ``ScalarLayerState`` with codes, ``s1`` and ``z`` reproduces the trained weight exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .act_quant import ACTIVATION_HOOK, calibrate_static_scales, quantize_activations
from .config import PRESET_BUDGET, SCALAR_PRESET_OFF, LRQConfig
from .cost import FORWARD_S, LRQ_STEP, lrq_seconds
from .distill_hook import DISTILL_HOOK, settings_needs
from .hessian import proxy_loss
from .methods import BlockContext, Cancelled, Method, QuantResult, register
from .rtn import describe_scalar, effective_group_size, rtn_quantize, scalar_config_bits
from .states import ScalarLayerState
from .train import TrainResult, minibatches, no_worse, train_holdout

MAX_CURVE_POINTS = 100
EVAL_BATCH = 8


def auto_rank(out_features: int, in_features: int) -> int:
    """Rank of ``L @ U`` when ``LRQConfig.rank == 0``.

    The paper uses rank 1024 for LLaMA 7B/13B/30B layers (smaller dimension 4096..6656) and 2048 when both
    dimensions are >= 8192 (70B). For smaller layers the rank keeps the 7B ratio, a quarter of the smaller
    dimension, so ``L @ U`` keeps about as many parameters per weight as in the paper (SmolLM2-135M: 144 for
    576-wide layers, 48 for the 192-wide k/v projections)::

        min(out, in) >= 8192 -> 2048;  otherwise min(1024, max(1, min(out, in) // 4))
    """
    for name, value in (("out_features", out_features), ("in_features", in_features)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    smaller = min(out_features, in_features)
    if smaller >= 8192:
        return 2048
    return min(1024, max(1, smaller // 4))


def _expand_groups(t: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[out, n_groups] -> broadcastable against [out, in] (the same values ``ScalarLayerState`` gathers)."""
    return t if t.shape[1] == 1 else t.repeat_interleave(group_size, dim=1)[:, :in_features]


def _sum_groups(full: torch.Tensor, n_groups: int, group_size: int) -> torch.Tensor:
    """[out, in] -> [out, n_groups]: sum over each group's columns (the adjoint of ``_expand_groups``)."""
    if n_groups == 1:
        return full.sum(dim=1, keepdim=True)
    pad = n_groups * group_size - full.shape[1]
    return F.pad(full, (0, pad)).view(full.shape[0], n_groups, group_size).sum(dim=-1)


def _quantize_parts(
    weight: torch.Tensor, step: torch.Tensor, base: torch.Tensor, row_bias: torch.Tensor, col_bias: torch.Tensor,
    zeros: torch.Tensor, maxq: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(v * not_clipped, W_int - z), both [out, in], for v = W / (step * exp(base + r + c)).

    weight, base [out, in]; step, zeros broadcastable against [out, in]; row_bias [out, 1]; col_bias [1, in].
    """
    v = base + row_bias
    v.add_(col_bias).exp_().mul_(step)
    torch.div(weight, v, out=v)
    rounded = torch.round(v).add_(zeros)
    codes_minus_zero = torch.clamp(rounded, 0, maxq)
    v.mul_(codes_minus_zero == rounded)  # straight-through only where the code was not clipped
    return v, codes_minus_zero.sub_(zeros)


class _FakeQuantWeight(torch.autograd.Function):
    """W_hat = s1 * (clamp(round(W / (s1 * exp(D + r + c))) + z, 0, maxq) - z) with straight-through rounding.

    Hand-written backward: with v = W / (s1 * exp(D + r + c)) and m = 1 where the code was not clipped,
    dW_hat/dD = -m * s1 * v and dW_hat/ds1 = (q - z) - m * v. Besides saving memory this avoids autograd's
    clamp backward, which is very slow on CPU.
    """

    @staticmethod
    def forward(ctx, weight, scales, base, row_bias, col_bias, zeros, maxq: int, group_size: int):
        step = _expand_groups(scales, group_size, weight.shape[1])
        masked_v, codes_minus_zero = _quantize_parts(weight, step, base, row_bias, col_bias, zeros, maxq)
        ctx.save_for_backward(masked_v, codes_minus_zero, step)
        ctx.group_shape = (scales.shape[1], group_size)
        return codes_minus_zero * step

    @staticmethod
    def backward(ctx, grad):
        masked_v, codes_minus_zero, step = ctx.saved_tensors
        grad_base = (grad * step).mul_(masked_v).neg_()
        grad_step = (codes_minus_zero - masked_v).mul_(grad)
        grad_scales = _sum_groups(grad_step, *ctx.group_shape)
        grad_row = grad_base.sum(dim=1, keepdim=True)
        grad_col = grad_base.sum(dim=0, keepdim=True)
        return None, grad_scales, grad_base, grad_row, grad_col, None, None, None


class LRQWeightQuantizer(nn.Module):
    """Learnable fake quantizer for one weight ``W`` [out, in] (float32); ``forward()`` returns ``W_hat``.

    ``scales``/``zeros`` [out, n_groups] are the RTN grid (``rtn_quantize``); ``rank`` > 0 learns ``L @ U``,
    ``full_scale`` learns a full [out, in] matrix instead. At initialisation ``forward()`` equals the RTN
    dequantized weight bitwise.
    """

    def __init__(
        self, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
        rank: int, full_scale: bool = False, generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        n_groups = math.ceil(in_features / group_size)
        if tuple(scales.shape) != (out_features, n_groups) or tuple(zeros.shape) != (out_features, n_groups):
            raise ValueError(
                f"scales/zeros must have shape ({out_features}, {n_groups}), got {tuple(scales.shape)}"
                f" and {tuple(zeros.shape)}"
            )
        if not full_scale and rank < 1:
            raise ValueError(f"rank must be >= 1 unless full_scale is set, got {rank}")
        device = weight.device
        self.bits = bits
        self.group_size = group_size
        self.rank = 0 if full_scale else rank
        self.register_buffer("weight", weight.detach().float().clone())
        self.register_buffer("scale_init", scales.detach().float().clone())
        self.register_buffer("zeros", zeros.detach().float().clone())
        self.register_buffer("zeros_expanded", _expand_groups(self.zeros, group_size, in_features).contiguous())
        # s1 = scale_init * exp(log_scale_delta): learning log s1 up to a constant, and exp(0) == 1 exactly,
        # so the initial grid is the RTN grid bit for bit.
        self.log_scale_delta = nn.Parameter(torch.zeros(out_features, n_groups, device=device))
        self.row_bias = nn.Parameter(torch.zeros(out_features, 1, device=device))
        self.col_bias = nn.Parameter(torch.zeros(1, in_features, device=device))
        if full_scale:
            self.full = nn.Parameter(torch.zeros(out_features, in_features, device=device))
            self.left = self.right = None
        else:
            self.full = None
            self.left = nn.Parameter(torch.zeros(out_features, rank, device=device))
            right = torch.empty(rank, in_features)
            nn.init.kaiming_uniform_(right, a=math.sqrt(5), generator=generator)
            self.right = nn.Parameter(right.to(device))

    def step_scales(self) -> torch.Tensor:
        """s1 [out, n_groups]."""
        return self.scale_init * torch.exp(self.log_scale_delta)

    def forward(self) -> torch.Tensor:
        """W_hat [out, in] float32, differentiable (straight-through rounding)."""
        base = self.full if self.full is not None else self.left @ self.right
        return _FakeQuantWeight.apply(
            self.weight, self.step_scales(), base, self.row_bias, self.col_bias, self.zeros_expanded,
            2**self.bits - 1, self.group_size,
        )

    @torch.no_grad()
    def to_state(self, bias: torch.Tensor | None = None, **fields) -> ScalarLayerState:
        """Fold ``D`` into integer codes: ``ScalarLayerState.dequantize()`` equals ``forward()`` exactly."""
        scales = self.step_scales()
        step = _expand_groups(scales, self.group_size, self.weight.shape[1])
        base = self.full if self.full is not None else self.left @ self.right
        _, codes_minus_zero = _quantize_parts(
            self.weight, step, base, self.row_bias, self.col_bias, self.zeros_expanded, 2**self.bits - 1)
        codes = codes_minus_zero + self.zeros_expanded  # integers (z is an integer), exact in float32
        out_features, in_features = self.weight.shape
        return ScalarLayerState(
            in_features=in_features, out_features=out_features, bits=self.bits, group_size=self.group_size,
            codes=codes.to(torch.uint8), scales=scales.clone(), zeros=self.zeros.clone(),
            bias=None if bias is None else bias.detach().clone(), method="lrq", **fields,
        )


class _FakeQuantLinear(nn.Module):
    """Stands in for an ``nn.Linear`` during training: (activation fake-quant) -> F.linear(x, W_hat, bias)."""

    def __init__(
        self, quantizer: LRQWeightQuantizer, bias: torch.Tensor | None, act_bits: int, act_granularity: str,
        act_scale: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.quantizer = quantizer
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.act_bits = act_bits
        self.act_granularity = act_granularity
        self.act_scale = act_scale
        self.frozen_weight: torch.Tensor | None = None  # set while evaluating, to skip recomputing W_hat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_bits < 16:
            x = quantize_activations(x, self.act_bits, self.act_granularity, self.act_scale)
        weight = self.frozen_weight if self.frozen_weight is not None else self.quantizer()
        return F.linear(x, weight, self.bias)


@dataclass
class LRQBlockResult:
    """Outcome of ``lrq_quantize_block``.

    ``states``: one folded ``ScalarLayerState`` per linear name. ``loss_before``: block-output MSE over all
    calibration samples at the RTN start; ``loss_after``: the same for the returned states (never above
    ``loss_before``: when training made it worse the RTN start is returned and ``kept_rtn`` is set).
    ``losses``: training curve (mean minibatch loss over consecutive chunks of steps, at most
    ``MAX_CURVE_POINTS`` points). ``outputs``: the quantized block's outputs [n, seq, hidden] for the next
    block (dtype of ``inputs``), only with ``return_outputs=True``.
    """

    states: dict[str, ScalarLayerState]
    loss_before: float
    loss_after: float
    seconds: float
    losses: list[float] = field(default_factory=list)
    iters_done: int = 0
    ranks: dict[str, int] = field(default_factory=dict)
    kept_rtn: bool = False
    outputs: torch.Tensor | None = None


def _block_linears(block: nn.Module) -> list[str]:
    return [name for name, module in block.named_modules() if isinstance(module, nn.Linear)]


def _check_arguments(
    block: nn.Module, linear_names: list[str], inputs: torch.Tensor, targets: torch.Tensor, config: LRQConfig,
    act_scales: dict[str, torch.Tensor] | None,
) -> None:
    if not isinstance(block, nn.Module):
        raise TypeError(f"block must be a torch.nn.Module, got {type(block).__name__}")
    if not isinstance(config, LRQConfig):
        raise TypeError(f"config must be an LRQConfig, got {type(config).__name__}")
    if isinstance(linear_names, str) or not linear_names:
        raise ValueError(f"linear_names must be a non-empty list of names, got {linear_names!r}")
    available = _block_linears(block)
    for name in linear_names:
        if name not in available:
            raise ValueError(f"linear name {name!r} is not an nn.Linear of the block; the block's linears: {available}")
    if len(set(linear_names)) != len(linear_names):
        raise ValueError(f"linear_names must not repeat a name, got {linear_names}")
    for arg, t in (("inputs", inputs), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3 or t.shape[0] < 1:
            raise ValueError(f"{arg} must have shape [samples, seq, hidden] with samples >= 1, got {tuple(t.shape)}")
    if inputs.shape != targets.shape:
        raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must have the same shape")
    if act_scales is not None:
        if config.act_bits >= 16 or config.act_granularity != "tensor":
            raise ValueError(
                "act_scales only apply to static per-tensor activation quantization (act_bits < 16 and "
                f"act_granularity 'tensor'), got act_bits={config.act_bits}, act_granularity={config.act_granularity!r}"
            )
        missing = [name for name in linear_names if name not in act_scales]
        if missing:
            raise ValueError(f"act_scales lacks a scale for {missing}")
        for name in linear_names:
            scale = act_scales[name]
            if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not float(scale) > 0:
                raise ValueError(f"act_scales[{name!r}] must be a positive one-element tensor, got {scale!r}")


def _batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield torch.arange(start, min(n, start + batch_size))


def _run(forward, block, inputs, idx, device) -> torch.Tensor:
    x = inputs[idx].to(device=device, dtype=torch.float32)
    out = forward(block, x)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"forward(block, x) must return hidden states of shape {tuple(x.shape)}, got {shape}")
    return out.float()


@torch.no_grad()
def _mean_loss(
    forward, block, wrappers, inputs, targets, batch_size, device, keep_outputs: bool
) -> tuple[float, torch.Tensor | None]:
    """Block-output MSE over all samples (each wrapper's W_hat computed once) -> (loss, outputs | None)."""
    for wrapper in wrappers:
        wrapper.frozen_weight = wrapper.quantizer()
    outputs = torch.empty_like(inputs) if keep_outputs else None
    try:
        total = 0.0
        for idx in _batches(inputs.shape[0], batch_size):
            out = _run(forward, block, inputs, idx, device)
            total += float(F.mse_loss(out, targets[idx].to(device=device, dtype=torch.float32), reduction="sum"))
            if outputs is not None:
                outputs[idx] = out.to(device=outputs.device, dtype=outputs.dtype)
    finally:
        for wrapper in wrappers:
            wrapper.frozen_weight = None
    return total / targets.numel(), outputs


def lrq_quantize_block(
    block: nn.Module,
    linear_names: list[str],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    config: LRQConfig,
    act_scales: dict[str, torch.Tensor] | None = None,
    should_stop: Callable[[], bool] | None = None,
    *,
    return_outputs: bool = False,
) -> LRQBlockResult:
    """Quantize the ``linear_names`` of ``block`` with LRQ by block-output reconstruction.

    inputs [n, seq, hidden]: the block's inputs (from the already quantized previous blocks);
    targets [n, seq, hidden]: the full-precision block's outputs; ``forward(block, x)`` maps [b, seq, hidden]
    to [b, seq, hidden]. Training runs in float32 on a private copy of the block (the block itself is not
    modified), ``config.batch_size`` samples per step, for ``config.iters`` steps or until ``should_stop()``.
    With ``config.act_bits < 16`` the inputs of the quantized linears are fake-quantized (per token, or per
    tensor with ``act_scales`` [name] -> scalar; when not given they are calibrated as the absmax of each
    linear's input over ``inputs`` with the full-precision weights). ``return_outputs`` keeps the quantized
    block's outputs (the next block's inputs) from the final evaluation pass, saving the caller that pass.
    """
    start_time = time.perf_counter()
    _check_arguments(block, linear_names, inputs, targets, config, act_scales)
    device = next(iter(block.parameters()), inputs).device
    batch_size = min(config.batch_size, inputs.shape[0])
    eval_batch = max(batch_size, EVAL_BATCH)  # no-grad passes run faster per sample in batches
    generator = torch.Generator().manual_seed(config.seed)

    with torch.inference_mode(False), torch.enable_grad():
        work = copy.deepcopy(block).float().eval().requires_grad_(False)
        static = None
        if config.act_bits < 16 and config.act_granularity == "tensor":
            if act_scales is None:
                act_scales = calibrate_static_scales(forward, work, linear_names, inputs, config.act_bits, eval_batch,
                                                     clip=config.act_clip)
            static = {name: act_scales[name].detach().float().reshape(()).cpu() for name in linear_names}
        wrappers = _wrap_linears(work, linear_names, config, static, device, generator)

        wrapper_list = list(wrappers.values())
        outputs_at: list[torch.Tensor | None] = []  # the block's outputs at each check

        def check() -> float:
            loss, outputs = _mean_loss(forward, work, wrapper_list, inputs, targets, eval_batch, device,
                                       return_outputs)
            outputs_at.append(outputs)
            return loss

        trained = _train(forward, work, wrapper_list, inputs, targets, config, batch_size, device, generator,
                         check, should_stop)
        curve, iters_done = trained.curve, trained.result.steps
        loss_before, loss_after = trained.result.before, trained.result.best
        outputs = outputs_at[trained.result.best_index]
        kept_rtn = iters_done > 0 and trained.result.best_index == 0  # training made it worse (e.g. too high lr)

        states = {}
        for name, wrapper in wrappers.items():
            states[name] = wrapper.quantizer.to_state(
                bias=block.get_submodule(name).bias, act_bits=config.act_bits, act_granularity=config.act_granularity,
                act_scale=None if static is None else static[name].clone(),
                extra={"rank": wrapper.quantizer.rank, "full_scale": config.full_scale, "iters": iters_done},
            )
    return LRQBlockResult(
        states=states, loss_before=loss_before, loss_after=loss_after, seconds=time.perf_counter() - start_time,
        losses=curve, iters_done=iters_done, ranks={name: w.quantizer.rank for name, w in wrappers.items()},
        kept_rtn=kept_rtn, outputs=outputs,
    )


def _wrap_linears(
    work: nn.Module, linear_names: list[str], config: LRQConfig, static: dict[str, torch.Tensor] | None,
    device: torch.device, generator: torch.Generator,
) -> dict[str, _FakeQuantLinear]:
    """Replace each named linear of the (private, float32) ``work`` block by a fake-quant wrapper at RTN."""
    wrappers = {}
    for name in linear_names:
        linear = work.get_submodule(name)
        out_features, in_features = linear.weight.shape
        group_size = effective_group_size(config.group_size, in_features)
        rtn = rtn_quantize(linear.weight.detach(), config.bits, group_size, clip_search=config.clip_search)
        rank = 0 if config.full_scale else min(config.rank or auto_rank(out_features, in_features),
                                                out_features, in_features)
        quantizer = LRQWeightQuantizer(
            linear.weight.detach(), rtn.scales.to(device), rtn.zeros.to(device), config.bits, group_size, rank,
            full_scale=config.full_scale, generator=generator,
        )
        act_scale = None if static is None else static[name].to(device)
        wrappers[name] = _FakeQuantLinear(quantizer, linear.bias, config.act_bits, config.act_granularity, act_scale)
        parent_name, _, child = name.rpartition(".")
        setattr(work.get_submodule(parent_name) if parent_name else work, child, wrappers[name])
    return wrappers


class _Trained(NamedTuple):
    result: TrainResult
    curve: list[float]  # mean minibatch loss over consecutive chunks of steps, at most MAX_CURVE_POINTS points


def _train(forward, work, wrappers, inputs, targets, config: LRQConfig, batch_size: int, device,
           generator: torch.Generator, check: Callable[[], float], should_stop) -> _Trained:
    """Adam with a cosine schedule to 0 over ``config.iters`` steps, on all calibration samples: ``check`` (the
    block-output MSE over all of them) runs before and after, and the trained parameters are kept unless they
    made it worse."""
    params = [p for wrapper in wrappers for p in wrapper.quantizer.parameters()]
    iters, n = config.iters, inputs.shape[0]
    batches = minibatches(n, batch_size, generator=generator)  # every sample once per epoch
    chunk = max(1, math.ceil(iters / MAX_CURVE_POINTS))
    curve: list[float] = []
    running = [0.0, 0]  # loss sum, steps in the current chunk

    def step_loss() -> torch.Tensor:
        idx = next(batches)
        out = _run(forward, work, inputs, idx, device)
        return F.mse_loss(out, targets[idx].to(device=device, dtype=torch.float32))

    def step_done(_step: int, loss: float) -> None:
        running[0], running[1] = running[0] + loss, running[1] + 1
        if running[1] == chunk:
            curve.append(running[0] / running[1])
            running[0], running[1] = 0.0, 0

    result = train_holdout([{"params": params, "lr": config.lr}], step_loss, check, iters,
                           eval_every=max(iters, 1), better=no_worse, should_stop=should_stop, on_step=step_done)
    if running[1]:
        curve.append(running[0] / running[1])
    return _Trained(result, curve)


def _quantize_block(ctx: BlockContext) -> None:
    """The pipeline's block step: train the whole block, then publish each linear's folded state."""
    # The run's torch threads: a training step is a whole block on a 512-token window, big enough to share. On the
    # reference machine (2 cores, idle) 2 threads train a SmolLM2 block in 0.55x the seconds of one
    # (bench/lrq_threads.py); on a machine busy with other jobs one thread can be faster, which --threads sets.
    with torch.enable_grad():
        res = lrq_quantize_block(ctx.block, list(ctx.linears), ctx.inputs, ctx.targets, ctx.forward, ctx.config,
                                 should_stop=ctx.should_stop)
    if ctx.should_stop():
        raise Cancelled
    per_layer = res.seconds / max(len(ctx.linears), 1)
    extra = {"block_loss_before": res.loss_before, "block_loss_after": res.loss_after}
    for name, linear in ctx.linears.items():
        W = linear.weight.data.float()
        W_hat = res.states[name].dequantize().float()
        loss, rel = proxy_loss(W, W_hat, ctx.hessians[name])
        rel_w = float(torch.linalg.norm(W_hat - W) / torch.linalg.norm(W).clamp(min=1e-12))
        ctx.publish(name, QuantResult(res.states[name], W_hat, loss, rel, rel_w), per_layer, extra=dict(extra))


# The block training's pace before a run (``block_pace``): the median of PACE_STEPS steps after PACE_WARMUP.
PACE_STEPS, PACE_WARMUP = 5, 2


def _pace(probe, config: LRQConfig) -> tuple[float, float]:
    """(seconds, price on the reference machine) of one training step of ``probe``'s block (``Method.pace``): the
    steps are timed between the polls ``train_holdout`` makes before each, as the run trains."""
    polls: list[float] = []

    def poll() -> bool:
        polls.append(time.perf_counter())
        return False

    steps = dataclasses.replace(config, iters=PACE_WARMUP + PACE_STEPS + 1)
    with torch.enable_grad():
        lrq_quantize_block(probe.block, list(probe.linears), probe.inputs, probe.targets, probe.forward, steps,
                           should_stop=poll)
    gaps = sorted(b - a for a, b in zip(polls[PACE_WARMUP:], polls[PACE_WARMUP + 1:]))
    weights = sum(linear.weight.numel() for linear in probe.linears.values())
    tokens = min(config.batch_size, probe.inputs.shape[0]) * probe.inputs.shape[1]
    return gaps[len(gaps) // 2], FORWARD_S * weights * LRQ_STEP * tokens


# LRQ's weight-only presets keep one scale per output channel from 3 bits up: its learned scaling is what makes
# per-channel grids work where RTN's fail (docs/methods.md#lrq).
# Named by total bits per weight, an upper bound: per-channel grids add 32 bits per output row.
# Every preset names the activation quantizer and the training steps, so picking one never keeps another's.
_WEIGHT_ONLY = {"act_bits": 16, "act_granularity": "token", "iters": 32, "lr": 1e-2, **SCALAR_PRESET_OFF}
# W4A8 (4-bit weights, 8-bit activations): groups of 128 weights per scale, activations per token with a zero
# point, each block fitted to the original's own block outputs (LRQ's default) in 64 training steps at lr 5e-3,
# then end-to-end distillation at 2e-3 (bench/lrq_steps.py: held-out block error; presets_cli_dev_spr.txt i64l5d2
# against w4a8s50b); the recipe and its measurements: docs/methods.md#lrq. "w4a8" ends within the time budget
# (distillation runs the steps that fit): half of the calibration written by the model itself, which its time
# affords since the block training uses every thread (dev split, seeds 0 and 1: KL summed over both texts -6% / -10%
# against the calibration all text, pydocs' -16% / -15%; bench/results/presets_cli_dev_spr.txt w4a8s50b, w4a8s50s1
# against w4a8t32, w4a8t32s1b).
# "w4a8-best" is the same recipe for a GPU or more CPU time: more distillation steps on more windows, no time budget
# (dev split, seed 0: best64_s0 against w4a8best, the preset when it trained 32 steps at 1e-2 and distilled at 5e-3).
_W4A8 = {"bits": 4, "group_size": 128, "act_bits": 8, "act_granularity": "token_asym", "iters": 64, "lr": 5e-3,
         "distill_lr": 2e-3, "calib_sampled_share": 0.5}
PRESETS = {"2.5 bits": {"bits": 2, "group_size": 64, **_WEIGHT_ONLY},
           "3.5 bits": {"bits": 3, "group_size": 0, **_WEIGHT_ONLY},
           "4.5 bits": {"bits": 4, "group_size": 0, **_WEIGHT_ONLY},
           "w4a8": {**_W4A8, "distill_iters": 48, "distill_data": "calibration", "distill_samples": 32,
                    "distill_eval_every": 8, **PRESET_BUDGET},
           "w4a8-best": {**_W4A8, "distill_iters": 128, "distill_data": "mixed", "distill_samples": 64,
                         "distill_eval_every": 32, "time_budget": 0.0, "time_budget_scale": "fixed"}}

METHOD = register(Method(
    name="lrq", label="LRQ", config_class=LRQConfig, bits=scalar_config_bits, describe=describe_scalar,
    presets=PRESETS, description="scalar grids with a learned low-rank weight scaling, trained per block",
    quantize_block=_quantize_block, block_phase="lrq_train", after_block=(ACTIVATION_HOOK,),
    after_model=(DISTILL_HOOK,), cost=lrq_seconds, pace=_pace, block_steps="iters",
    config_needs=lambda config: settings_needs(config, target_chain=config.target_chain),
))
