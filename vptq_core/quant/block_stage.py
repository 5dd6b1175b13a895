"""The blocks stage of a run: every decoder block in turn, on the inputs coming from the already quantized blocks.

For each block: (A) run the original block, accumulating one Hessian per distinct linear input and keeping the
block's outputs as targets; the method quantizes every linear (one at a time with ``quantize_linear``, or the
whole block with ``quantize_block``) and its after-block hooks run; (B) run the quantized block to get the next
block's inputs and the block's relative output error. Only the current block's working set lives beside the model.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from . import distributed
from .blocks import block_linears, blocks_prefix, decoder_blocks
from .calib_windows import layerwise_count
from .device import drop_unheld, return_freed_memory
from .distributed_once import once
from .forward import (
    BlockKwargs,
    block_dtype,
    capture_block_inputs,
    hessians_and_targets,
    kwargs_to,
    run_batched,
    run_block,
)
from .methods import BlockContext, Cancelled, QuantResult
from .results import BlockDone, LayerReport, OnLayer, QuantizeResult, ResumePoint
from .run import Run
from .trainable import dense_tensors


def quantize_blocks(run: Run) -> None:
    """Quantize every block not finished yet (``run.resume``), in order; a stop marks the result cancelled."""
    blocks = decoder_blocks(run.model)
    inps, kwargs = capture_inputs(run)
    fp_inps = _start_fp_chain(run, inps)
    first = 0
    if run.resume is not None:
        first, inps, run.earlier_seconds = apply_resume(run.resume, run.result, inps, len(blocks), run.on_layer)
        if run.keep_states:
            run.result.dense.update(run.resume.dense)
        if fp_inps is not None and run.resume.blocks_done:
            fp_inps = run.resume.fp_inputs.to(inps.device, torch.float32)
    prefix, model_dtype = blocks_prefix(run.model), next(run.model.parameters()).dtype
    try:
        for b in range(first, len(blocks)):
            if distributed.any_rank(run.should_stop()):  # with several ranks: all stop before the same block
                raise Cancelled
            inps, fp_inps = quantize_block(run, b, blocks[b], prefix, inps, fp_inps, kwargs.at(b), model_dtype)
            # what the block freed (its float32 weights, Hessians, activations) back to the system: a streamed run
            # stays at about one block, a whole model's blocks do not pile up in glibc's heap
            return_freed_memory()
    except Cancelled:
        run.result.cancelled = True


def capture_inputs(run: Run) -> tuple[torch.Tensor, BlockKwargs]:
    """The activations entering block 0 (float32 on the work device) and every block's extra arguments."""
    with run.result.timed("capture_inputs"):
        stub = run.weights is not None or run.capture_dtype is not None
        # distillation's held-out windows are held out of the block-by-block stage too (``layerwise_count``)
        stage_ids = run.calib_ids[: layerwise_count(run.calib_ids.shape[0], run.config)]
        inps, kwargs = capture_block_inputs(run.model, stage_ids, stub_blocks=stub, embeds_dtype=run.capture_dtype)
        return inps.to(run.device, torch.float32), kwargs_to(kwargs, run.device, torch.float32)


def _start_fp_chain(run: Run, inps: torch.Tensor) -> torch.Tensor | None:
    """With target_chain "fp": the original model's own activations, a second stream through the original
    blocks that after-block steps fit instead of the original block on the quantized chain's inputs."""
    if not run.needs.fp_chain:
        return None
    if run.resume is not None and run.resume.blocks_done and run.resume.fp_inputs is None:
        raise ValueError("target_chain 'fp' cannot resume this run: it has no saved activations of the original "
                         "model at its resume point")
    return inps.clone()


def quantize_block(run: Run, b: int, block: nn.Module, prefix: str, inps: torch.Tensor,
                   fp_inps: torch.Tensor | None, block_kwargs: dict,
                   model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize block ``b`` (``{prefix}.{b}``) on ``inps`` -> (the next block's inputs, the fp chain's)."""
    result, name = run.result, f"{prefix}.{b}"
    if run.weights is not None:
        with result.timed("load_weights"):
            run.weights.load_block(block, name, run.device, torch.float32)
    orig_device = next(block.parameters()).device
    # a whole model's block: the storages it had, whose pages go once the float32 copies replace them (drop_unheld)
    before = [t.untyped_storage() for t in block.parameters() if t.device.type == "cpu"] if run.weights is None else []
    block.to(run.device, torch.float32)
    drop_unheld(before)
    linears = {n: m for n, m in block_linears(block).items() if not (run.skip and run.skip(f"{name}.{n}"))}
    dtype = block_dtype(run.device)  # float32, or bf16 forwards and Hessian products when asked
    with result.timed("hessians_targets"):
        hessians, targets = hessians_and_targets(block, linears, inps, block_kwargs, dtype)
        if fp_inps is not None:
            fp_inps = run_batched(block, fp_inps, block_kwargs, dtype)  # the original model's block outputs
    ctx = BlockContext(
        index=b, prefix=prefix, block=block, linears=linears, hessians=hessians, inputs=inps,
        targets=fp_inps if fp_inps is not None else targets,
        forward=lambda blk, x, kw=block_kwargs: run_block(blk, x, kw), config=run.config,
        method=run.method, result=result, should_stop=run.should_stop, publish=None,
    )
    ctx.publish = publisher(ctx, run.on_layer)
    _quantize_and_hook(ctx)
    hessians.clear()  # ctx.hessians is this dict: free the Hessians before the pass-B activations
    with result.timed("block_outputs"):
        outs = run_batched(block, inps, block_kwargs, dtype)
    err = float(((outs - targets) ** 2).sum() / (targets**2).sum().clamp(min=1e-20))
    ctx.targets = targets = None
    for rep in ctx.reports:
        rep.rel_output_error = err
        result.bits = result.bits + result.states[rep.name].storage_bits()
    # the norms and biases as the block's training left them (float32): a streamed block is freed below and a
    # whole model's block goes back to its dtype, so the checkpoint takes them from here
    dense = dense_tensors(block, name, packed=[rep.module for rep in ctx.reports])
    if run.keep_states:  # else, like the states, they live on only in what ``on_block`` does with them
        result.dense.update(dense)
    if run.weights is not None:
        run.weights.release_block(block)
    else:
        block.to(orig_device, model_dtype)
    result.blocks_done = b + 1
    if run.on_block is not None:
        block_states = {rep.name: result.states[rep.name] for rep in ctx.reports}
        run.on_block(BlockDone(b, block_states, list(ctx.reports), outs, result, run.seconds(),
                               torch.get_rng_state(), fp_inps, dense))
    if not run.keep_states:
        for rep in ctx.reports:
            result.states.pop(rep.name, None)
    return outs, fp_inps


def _quantize_and_hook(ctx: BlockContext) -> None:
    """The method's block step, then its after-block hooks (their metrics go into the block's reports).

    With several ranks a block trained whole and every after-block hook run on rank 0 alone; the others take
    its block tensors, layer states and metrics (``distributed_once.once``), so no rank drifts from another."""
    method, config, result = ctx.method, ctx.config, ctx.result
    device = next(ctx.block.parameters()).device
    if method.quantize_block is not None:
        with result.timed(method.block_phase):
            _block_step_once(ctx, device)
    else:
        quantize_linears(ctx)
    for hook in method.after_block:
        if not hook.applies(config):
            continue
        with result.timed(hook.phase):
            metrics, _ = once(hook.phase, lambda hook=hook: (hook.run(ctx), ctx.states), ctx.should_stop, device,
                              modules=(ctx.block,), apply=lambda value: _take_states(ctx, value[1]))
        for rep in ctx.reports:
            rep.extra.update(metrics or {})


def _block_step_once(ctx: BlockContext, device: torch.device) -> None:
    """The method's ``quantize_block`` (it publishes each linear): on rank 0 with several ranks, whose
    publications the others replay."""
    publish, published = ctx.publish, []

    def recording(name: str, res: QuantResult, seconds: float, extra: dict | None = None) -> LayerReport:
        published.append((name, res, seconds, extra))
        return publish(name, res, seconds, extra)

    def compute() -> list:
        ctx.publish = recording
        try:
            ctx.method.quantize_block(ctx)
        finally:
            ctx.publish = publish
        return published

    def replay(items: list) -> None:
        for name, res, seconds, extra in items:
            publish(name, res, seconds, extra)

    once(ctx.method.block_phase, compute, ctx.should_stop, device, modules=(ctx.block,), apply=replay)


def _take_states(ctx: BlockContext, states: dict) -> None:
    """Rank 0's layer states of the block (after a hook changed them) in place of this rank's."""
    for name, state in states.items():
        ctx.states[name] = ctx.result.states[ctx.full_name(name)] = state


def quantize_linears(ctx: BlockContext) -> None:
    """The default block step: each linear on its own with the method's ``quantize_linear``.

    With ``quant.distributed`` active (several ranks, e.g. under torchrun) the block's linears are split
    across the ranks, balanced by weight count; each rank quantizes its share, then every rank receives every
    result and publishes all of them in block order, so all ranks hold the same states and quantized block.
    Stopping or failing on any rank stops every rank at the same point (no rank is left waiting). Timings
    then hold this rank's own work plus ``exchange`` (waiting for the others and the transfer).
    """
    cache: dict = {}  # shared by the block's linears (inverse-Hessian factors of shared inputs)
    if not distributed.active():
        for name in ctx.linears:
            if ctx.should_stop():
                raise Cancelled
            res, seconds = _quantize_linear(ctx, name, cache)
            ctx.publish(name, res, seconds)
        return

    owner = distributed.assign({n: m.weight.numel() for n, m in ctx.linears.items()}, distributed.world_size())
    me = distributed.rank()
    done: dict[str, tuple[QuantResult, float]] = {}
    status, error = distributed.OK, None
    try:
        for name in ctx.linears:
            if owner[name] != me:
                continue
            if ctx.should_stop():
                status = distributed.STOPPED
                break
            done[name] = _quantize_linear(ctx, name, cache)
    except Exception as exc:  # noqa: BLE001 - re-raised below, once the other ranks know
        status, error = distributed.FAILED, exc
    status = distributed.agree(status)
    if error is not None:
        raise error
    if status == distributed.FAILED:
        raise RuntimeError(f"another rank failed while quantizing block {ctx.index}; its output says why")
    if status == distributed.STOPPED:
        raise Cancelled
    with ctx.result.timed("exchange"):
        results = distributed.exchange(done, next(iter(ctx.linears.values())).weight.device)
    for name in ctx.linears:
        res, seconds = results[name]
        ctx.publish(name, res, seconds)


def _quantize_linear(ctx: BlockContext, name: str, cache: dict) -> tuple[QuantResult, float]:
    """One linear of the block with the method's ``quantize_linear`` and its layer's settings -> (result,
    seconds); its phases go into the run's timings."""
    linear = ctx.linears[name]
    t0 = time.perf_counter()
    res = ctx.method.quantize_linear(linear.weight.data, ctx.hessians[name], ctx.config.for_layer(ctx.full_name(name)),
                                     linear.bias, cache)
    seconds = time.perf_counter() - t0
    ctx.result.timings.merge(res.timings or {"quantize": seconds})
    return res, seconds


def apply_resume(resume: ResumePoint, result: QuantizeResult, inps: torch.Tensor, num_blocks: int,
                 on_layer: OnLayer) -> tuple[int, torch.Tensor, float]:
    """Start ``result`` where ``resume`` left off -> (first block to run, its inputs, earlier seconds)."""
    if not 0 <= resume.blocks_done <= num_blocks:
        raise ValueError(f"resume point has {resume.blocks_done} finished blocks; the model has {num_blocks}")
    if tuple(resume.inputs.shape) != tuple(inps.shape):
        raise ValueError(f"resume point's activations have shape {tuple(resume.inputs.shape)}, this run's "
                         f"calibration gives {tuple(inps.shape)}")
    result.reports.extend(resume.reports)
    result.timings.merge(resume.timings)
    result.bits = resume.bits
    result.blocks_done = resume.blocks_done
    if resume.rng_state is not None:
        torch.set_rng_state(resume.rng_state)
    for report in resume.reports:
        on_layer(report)
    return resume.blocks_done, resume.inputs.to(inps.device, torch.float32), resume.seconds


def publisher(ctx: BlockContext, on_layer: OnLayer) -> Callable[..., LayerReport]:
    """``publish(name, res, seconds, extra=None)``: keep a linear's quantized weight and state, report it.

    It holds ``ctx`` weakly: ``ctx.publish`` is this function, and a strong reference would make a cycle that keeps
    the block's activations and weights alive after the block until Python's cycle collector runs."""
    ctx_ref = weakref.ref(ctx)

    def publish(name: str, res: QuantResult, seconds: float, extra: dict | None = None) -> LayerReport:
        ctx = ctx_ref()
        linear = ctx.linears[name]
        linear.weight.data.copy_(res.weight.to(linear.weight.dtype))
        full = ctx.full_name(name)
        ctx.states[name] = ctx.result.states[full] = res.state
        info = res.state.storage_bits()
        report = LayerReport(
            block=ctx.index, name=full, module=name, out_features=linear.out_features,
            in_features=linear.in_features, method=ctx.method.name, rel_proxy_loss=res.rel_proxy_loss,
            rel_weight_error=res.rel_weight_error, index_bits=info.index_bits_per_weight,
            total_bits=info.total_bits_per_weight, seconds=seconds, extra=extra or {},
        )
        ctx.reports.append(report)
        ctx.result.reports.append(report)
        on_layer(report)
        return report

    return publish
