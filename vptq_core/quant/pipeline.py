"""Block-by-block quantization of a causal LM: the one driver the CLI, the app's job runner and tests share.

For each transformer block: (A) run the original block on the inputs coming from the already quantized
blocks, accumulating one Hessian per distinct linear input (q/k/v share one, gate/up share one) and keeping
the block's outputs as targets; quantize every linear; (B) run the quantized block to get the next block's
inputs and the block's relative output error. Only the current block's working set lives beside the model.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from . import methods
from .bits import BitsInfo
from .blocks import block_linears, blocks_prefix, check_linear_shapes, decoder_blocks
from .device import return_freed_memory
from .distill import sampled_calibration
from .finetune import layerwise_count
from .hessian import HessianAccumulator, SharedInputs
from .methods import BlockContext, Cancelled, Method, ModelContext, QuantResult
from .source import BlockWeights
from .timing import Timings

OnLayer = Callable[["LayerReport"], None]
OnStep = Callable[[str, int, int, float], None]  # (phase, step, steps, loss) of an after-model hook
ShouldStop = Callable[[], bool]


@dataclass
class LayerReport:
    """Metrics for one quantized linear, published through ``on_layer`` as soon as it is quantized.

    ``rel_output_error`` (``||Y_q - Y||² / ||Y||²`` of the whole block on calibration data) is known only
    once every linear of the block is quantized: it is filled in on the same object when the block ends.
    """

    block: int
    name: str  # full module name, e.g. "model.layers.3.mlp.down_proj"
    module: str  # name inside the block, e.g. "mlp.down_proj"
    out_features: int
    in_features: int
    method: str
    rel_proxy_loss: float
    rel_weight_error: float
    index_bits: float
    total_bits: float
    seconds: float
    rel_output_error: float | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class QuantizeResult:
    method: str
    config: dict
    states: dict  # full module name -> VQLayerState | ScalarLayerState
    reports: list[LayerReport]
    bits: BitsInfo
    seconds: float
    cancelled: bool = False
    blocks_done: int = 0
    # wall seconds per phase: capture_inputs, hessians_targets (original block forwards with Hessian hooks),
    # the method's phases (VPTQ: kmeans, inverse_hessian, sweep; scalar: quantize; lrq: lrq_train), its
    # after-block hooks (finetune, act_calibration), block_outputs (quantized block forwards)
    timings: Timings = field(default_factory=Timings)
    # after-model hook phase -> its metrics (distillation); "calibration": why no window was self-written
    model_metrics: dict = field(default_factory=dict)

    def timed(self, phase: str):
        """``with result.timed(phase): ...`` adds the wall time to ``timings[phase]``."""
        return self.timings.timed(phase)

    def summary(self) -> dict:
        return {
            "method": self.method, "config": self.config, "layers": len(self.reports),
            "blocks_done": self.blocks_done, "cancelled": self.cancelled, "seconds": round(self.seconds, 2),
            "timings": {k: round(v, 2) for k, v in self.timings.items()},
            "index_bits_per_weight": self.bits.index_bits_per_weight if self.bits.weights else None,
            "total_bits_per_weight": self.bits.total_bits_per_weight if self.bits.weights else None,
            **({"model_metrics": self.model_metrics} if self.model_metrics else {}),
        }


# ----------------------------------------------------------------------------------------------------------
# Running blocks one by one


class _StopForward(Exception):
    pass


_DROPPED_KWARGS = ("hidden_states", "past_key_values", "past_key_value", "use_cache", "cache_position")


class BlockKwargs(dict):
    """The extra arguments (attention mask, rotary embeddings, position ids, ...) each decoder block is
    called with, captured per block: models with several layer types (gemma3: sliding-window and full
    attention layers, each with its own mask and rotary embeddings) pass different ones to different blocks.

    ``of(block)`` / ``at(index)`` give one block's arguments (a plain dict). Blocks of the same type share
    the very same tensors, so nothing is held twice. As a dict it is block 0's arguments, for callers that
    predate per-block capture; ``run_block`` resolves the block's own.
    """

    def __init__(self, per_block: list[dict], blocks) -> None:
        super().__init__(per_block[0])
        self.per_block = per_block
        self._index = {id(block): i for i, block in enumerate(blocks)}

    @property
    def uniform(self) -> bool:
        """Every block takes the same arguments (the same objects)."""
        first = self.per_block[0]
        return all(kw.keys() == first.keys() and all(kw[k] is first[k] for k in kw) for kw in self.per_block)

    def at(self, index: int) -> dict:
        return self.per_block[index]

    def of(self, block: nn.Module) -> dict:
        """The arguments of ``block`` (one of the captured model's blocks; any block when all take the same)."""
        index = self._index.get(id(block))
        if index is not None:
            return self.per_block[index]
        if self.uniform:
            return self.per_block[0]
        raise ValueError(
            f"{type(block).__name__} is not one of the blocks these arguments were captured for, and the "
            "model's blocks take different arguments (e.g. sliding-window and full-attention layers); "
            "use kwargs.at(block_index)"
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> BlockKwargs:
        """Moved to ``device`` (floating tensors cast to ``dtype``); a tensor shared by blocks is moved once."""
        memo: dict[int, object] = {}

        def move(v):
            if id(v) in memo:
                return memo[id(v)]
            if isinstance(v, torch.Tensor):
                moved = v.to(device, dtype) if v.is_floating_point() else v.to(device)
            elif isinstance(v, tuple):
                moved = tuple(move(x) for x in v)
            else:
                return v
            memo[id(v)] = moved
            return moved

        moved = BlockKwargs([{k: move(v) for k, v in kw.items()} for kw in self.per_block], [])
        moved._index = dict(self._index)
        return moved


def _passthrough(*args, **kwargs):
    return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, input_ids: torch.Tensor, stub_blocks: bool = False, embeds_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, BlockKwargs]:
    """Hidden states entering block 0 for every row of ``input_ids`` [n, seq] -> ([n, seq, hidden], kwargs).

    ``kwargs`` (a ``BlockKwargs``) are the extra arguments the model passes to each of its blocks (rotary
    embeddings, mask, ...), captured per block during one forward of the first row, stopped before the LM
    head; the other rows stop at block 0. Blocks are then called with ``use_cache=False`` and no cache
    object (a cache would silently stack keys across calibration batches).

    ``stub_blocks``: the blocks pass their input through during the capture instead of running (their
    weights may be on the meta device: a streamed model); the arguments do not depend on block outputs.
    ``embeds_dtype``: feed the model ``inputs_embeds`` (its own embedding of the ids) cast to this dtype, so
    masks and rotary embeddings come in that dtype whatever the weights' (bf16 weights, fp32 work); needs
    ``stub_blocks`` unless the blocks run in that dtype.
    """
    blocks = decoder_blocks(model)
    captured: list[torch.Tensor] = []
    per_block: list[dict | None] = [None] * len(blocks)

    def make_hook(index: int):
        def hook(_module, args, kwargs):
            if index == 0:
                hidden = args[0] if args else kwargs["hidden_states"]
                captured.append(hidden.detach())
            if per_block[index] is None:
                per_block[index] = {k: v for k, v in kwargs.items() if k not in _DROPPED_KWARGS}
            if index == len(blocks) - 1 or per_block[-1] is not None:
                raise _StopForward

        return hook

    handles = [block.register_forward_pre_hook(make_hook(i), with_kwargs=True) for i, block in enumerate(blocks)]
    embed = model.get_input_embeddings() if embeds_dtype is not None else None
    device = (embed.weight if embed is not None else next(model.parameters())).device
    if stub_blocks:
        for block in blocks:
            block.forward = _passthrough  # an instance attribute: removed again below
    try:
        for row in input_ids:
            ids = row.unsqueeze(0).to(device)
            try:
                if embed is not None:
                    model(inputs_embeds=embed(ids).to(embeds_dtype), use_cache=False)
                else:
                    model(ids, use_cache=False)
            except _StopForward:
                pass
            if len(handles) > 1 and per_block[-1] is not None:  # every block's arguments are known
                for handle in handles[1:]:
                    handle.remove()
                handles = handles[:1]
    finally:
        for handle in handles:
            handle.remove()
        if stub_blocks:
            for block in blocks:
                block.__dict__.pop("forward", None)
    missing = [i for i, kw in enumerate(per_block) if kw is None]
    if missing:
        raise ValueError(f"{type(model).__name__}'s forward never called decoder blocks {missing[:8]}; "
                         "cannot capture their inputs")
    return torch.cat(captured, dim=0), BlockKwargs(per_block, blocks)


def run_block(block: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """One block on [b, seq, hidden] -> [b, seq, hidden], no cache. ``kwargs``: the block's own arguments,
    or the ``BlockKwargs`` of its model (the block's are looked up)."""
    if isinstance(kwargs, BlockKwargs):
        kwargs = kwargs.of(block)
    out = block(hidden, use_cache=False, **kwargs)
    return out[0] if isinstance(out, tuple) else out


HESSIAN_SKIP_TOKENS = 0  # positions left out of Hessians (the first is an attention sink)
BATCH = 8  # calibration windows per block call: batching ran block forwards ~2.5x faster than one by one


def _run_batched(block: nn.Module, inps: torch.Tensor, kwargs: dict) -> torch.Tensor:
    outs = torch.empty_like(inps)
    for i in range(0, inps.shape[0], BATCH):
        outs[i : i + BATCH] = run_block(block, inps[i : i + BATCH], kwargs)
    return outs


def _kwargs_to(kwargs: dict, device: torch.device, dtype: torch.dtype) -> dict:
    if isinstance(kwargs, BlockKwargs):
        return kwargs.to(device, dtype)

    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device, dtype) if v.is_floating_point() else v.to(device)
        if isinstance(v, tuple):
            return tuple(move(x) for x in v)
        return v

    return {k: move(v) for k, v in kwargs.items()}


# ----------------------------------------------------------------------------------------------------------
# The driver


def quantize_linears(ctx: BlockContext) -> None:
    """The default block step: each linear on its own with the method's ``quantize_linear``.

    With ``quant.distributed`` active (several ranks, e.g. under torchrun) the block's linears are split
    across the ranks, balanced by weight count; each rank quantizes its share, then every rank receives every
    result and publishes all of them in block order, so all ranks hold the same states and quantized block.
    Stopping or failing on any rank stops every rank at the same point (no rank is left waiting). Timings
    then hold this rank's own work plus ``exchange`` (waiting for the others and the transfer).
    """
    from . import distributed  # here, not at the top: this function is the pipeline's only use of it

    cache: dict = {}  # shared by the block's linears (inverse-Hessian factors of shared inputs)
    if not distributed.active():
        for name, linear in ctx.linears.items():
            if ctx.should_stop():
                raise Cancelled
            t0 = time.perf_counter()
            res = ctx.method.quantize_linear(linear.weight.data, ctx.hessians[name], ctx.config.for_layer(
                ctx.full_name(name)), linear.bias, cache)
            ctx.result.timings.merge(res.timings or {"quantize": time.perf_counter() - t0})
            ctx.publish(name, res, time.perf_counter() - t0)
        return

    owner = distributed.assign({n: m.weight.numel() for n, m in ctx.linears.items()}, distributed.world_size())
    me = distributed.rank()
    done: dict[str, tuple[QuantResult, float]] = {}
    status, error = distributed.OK, None
    try:
        for name, linear in ctx.linears.items():
            if owner[name] != me:
                continue
            if ctx.should_stop():
                status = distributed.STOPPED
                break
            t0 = time.perf_counter()
            res = ctx.method.quantize_linear(linear.weight.data, ctx.hessians[name], ctx.config.for_layer(
                ctx.full_name(name)), linear.bias, cache)
            seconds = time.perf_counter() - t0
            ctx.result.timings.merge(res.timings or {"quantize": seconds})
            done[name] = (res, seconds)
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


@dataclass
class BlockDone:
    """What ``on_block`` receives when block ``index`` is finished: its layer states and reports (full module
    names), the calibration activations entering the next block (``outputs``, float32), the run so far
    (``result``: timings, bits, seconds until now in ``seconds``) and the CPU random state after the block."""

    index: int
    states: dict
    reports: list[LayerReport]
    outputs: torch.Tensor
    result: QuantizeResult
    seconds: float
    rng_state: torch.Tensor
    fp_outputs: torch.Tensor | None = None  # target_chain "fp": the original model's activations there


@dataclass
class ResumePoint:
    """Where an interrupted run stopped: ``blocks_done`` finished blocks, the activations entering block
    ``blocks_done`` (float32 [n, seq, hidden]), the finished blocks' reports, and the run's timings, bits and
    seconds so far. ``quantize_model(..., resume=point)`` continues from there; the states of the finished
    blocks are not needed (they were handed to ``on_block`` by the interrupted run)."""

    blocks_done: int
    inputs: torch.Tensor
    reports: list[LayerReport] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    seconds: float = 0.0
    bits: BitsInfo = field(default_factory=lambda: BitsInfo(0, 0, 0))
    rng_state: torch.Tensor | None = None
    fp_inputs: torch.Tensor | None = None  # target_chain "fp": the original model's activations entering the block


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    calib_ids: torch.Tensor,
    method: str | Method,
    config,
    on_layer: OnLayer | None = None,
    should_stop: ShouldStop | None = None,
    device: str | torch.device | None = None,
    inplace: bool = False,
    skip: Callable[[str], bool] | None = None,
    *,
    weights: BlockWeights | None = None,
    capture_dtype: torch.dtype | None = None,
    on_block: Callable[[BlockDone], None] | None = None,
    resume: ResumePoint | None = None,
    keep_states: bool = True,
    reference: nn.Module | None = None,
    on_step: OnStep | None = None,
) -> tuple[nn.Module, QuantizeResult]:
    """Quantize every linear of every decoder block of ``model``.

    Args:
        model: a Hugging Face causal LM (llama / qwen2 / mistral families: blocks at ``model.layers``).
        calib_ids: calibration token ids [n, seq] (see ``data.calibration_windows``).
        method: a registered method name ("vptq", "gptq", "rtn", "lrq", ...) or a ``Method``; config: an
            instance of its config class.
        on_layer: called with a ``LayerReport`` as each linear finishes.
        should_stop: polled between linears; when it returns True the run stops cleanly and the result
            has ``cancelled=True`` with the layers done so far.
        device: where blocks are processed ("cuda" when available by default); the model stays put.
        inplace: quantize ``model`` itself instead of a copy.
        skip: optional predicate on full module names to leave some linears unquantized.

    Keyword-only, for long runs and models larger than memory (``api.quantize_to_dir`` uses them):
        weights: the model's blocks live on the meta device (``models.open_streaming``) and ``weights``
            materialises each block (fp32, on ``device``) when it is reached and releases it afterwards, so
            one block is resident at a time. Implies ``inplace``; the returned model's blocks stay on meta
            (the quantized layers are in ``result.states``).
        capture_dtype: the dtype of the hidden states, masks and rotary embeddings captured for block 0
            (fed as ``inputs_embeds``; the blocks are stubbed during the capture). Default: the model's own,
            through its forward on the ids, as before.
        on_block: called with a ``BlockDone`` after each block (e.g. to persist it for a resume).
        resume: a ``ResumePoint``: skip the finished blocks and start from its activations; its reports are
            replayed through ``on_layer`` first. The returned model's finished blocks are left untouched.
        keep_states: False drops each block's states from ``result.states`` once ``on_block`` has them
            (bounded memory when the caller persists them).
        reference: the original model, for the method's after-model hooks (end-to-end distillation); by
            default ``model`` itself when it is not quantized in place. Those hooks run after the last block
            on the whole model (not with ``weights``, a resume or ``keep_states=False``), on ``device`` in
            float32, and report their steps through ``on_step(phase, step, steps, loss)``; stopping during
            them keeps their best check so far and marks the result cancelled. The windows distillation holds
            out to check its steps are held out of the block-by-block stage as well (``layerwise_count``).

    Returns (fake-quantized model whose linears hold the dequantized weights, ``QuantizeResult`` with the
    per-layer states to pack and save). Only the blocks' linears are quantized; embeddings, norms and the
    LM head stay as they are.
    """
    method = methods.get(method)
    method.check_config(config)
    config = config.for_model(total_linear_shapes(model))  # e.g. a total-bits budget -> its per-layer cap
    if calib_ids.dim() != 2 or calib_ids.shape[0] < 1:
        raise ValueError(f"calib_ids must be [samples, seqlen], got shape {tuple(calib_ids.shape)}")
    check_linear_shapes(model, lambda out_f, in_f: method.bits(config, out_f, in_f),
                        f"method {method.name!r} ({method.describe(config.to_dict())})", skip)
    on_layer = on_layer or (lambda _r: None)
    should_stop = should_stop or (lambda: False)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_hooks = [hook for hook in method.after_model if hook.applies(config)]
    if model_hooks:
        if reference is None and not inplace and weights is None:
            reference = model
        why = ("streamed weights" if weights is not None else "a resume" if resume is not None and resume.blocks_done
               else "keep_states=False" if not keep_states else "no reference model" if reference is None else None)
        if why:
            raise ValueError(f"{', '.join(h.phase for h in model_hooks)} runs on the whole quantized model against "
                             f"the original; not possible with {why}")
    if getattr(config, "calib_sampled_share", 0) and weights is not None:
        raise ValueError("calib_sampled_share: the original model writes those calibration windows itself, which "
                         "needs the whole model in memory; not possible with streamed weights")
    if not inplace and weights is None:
        model = copy.deepcopy(model)
    model.eval()
    start_time = time.perf_counter()
    result = QuantizeResult(method.name, config.to_dict(), {}, [], BitsInfo(0, 0, 0), 0.0)

    # a resume starts from saved activations: the windows matter again only to a whole-model hook
    resumed = resume is not None and resume.blocks_done > 0
    known_teacher = None
    if getattr(config, "calib_sampled_share", 0) and (model_hooks or not resumed):
        # With distillation to follow (on the calibration windows) the original model's top-k on the windows it
        # writes is kept from the sampling's own logits, so distillation's teacher pass skips them. The model
        # about to be quantized writes them, not the reference: the reference stays untouched (not paged in)
        # until distillation, which kept the "2.5 bits" run's peak at 3.08 GB against 3.89 GB.
        topk = config.distill_topk if model_hooks and config.distill_data != "sampled" else 0
        written: dict = {}
        with result.timed("sample_calibration"):
            sampled = sampled_calibration(model, calib_ids, config, should_stop, topk=topk, info=written)
        if written:  # too slow for the time budget here: the calibration stayed text
            result.model_metrics["calibration"] = written
        if sampled is None:
            result.cancelled = True
            result.seconds = time.perf_counter() - start_time
            return model, result
        if topk:
            sampled, known_teacher = sampled
        calib_ids = sampled  # distillation after the blocks trains and checks on these same windows
    plan_hooks = [hook for hook in method.before_blocks if hook.applies(config)]
    if plan_hooks and not resumed:
        if weights is not None:
            raise ValueError(f"{', '.join(h.phase for h in plan_hooks)} runs on the whole original model; not possible "
                             "with streamed weights")
        for hook in plan_hooks:
            with result.timed(hook.phase):
                try:
                    config, metrics = hook.run(model, calib_ids[: layerwise_count(calib_ids.shape[0], config)],
                                               config, dev, should_stop)
                except Cancelled:
                    result.cancelled = True
                    result.seconds = time.perf_counter() - start_time
                    return model, result
            result.model_metrics[hook.phase] = metrics
        result.config = config.to_dict()
    blocks = decoder_blocks(model)
    prefix = blocks_prefix(model)
    model_dtype = next(model.parameters()).dtype
    with result.timed("capture_inputs"):
        stub = weights is not None or capture_dtype is not None
        # distillation's held-out windows are held out of the block-by-block stage too (``layerwise_count``)
        stage_ids = calib_ids[: layerwise_count(calib_ids.shape[0], config)]
        inps, kwargs = capture_block_inputs(model, stage_ids, stub_blocks=stub, embeds_dtype=capture_dtype)
        inps = inps.to(dev, torch.float32)
        kwargs = _kwargs_to(kwargs, dev, torch.float32)
    first = 0
    earlier_seconds = 0.0
    # target_chain "fp": after-block hooks fit the original model's own block outputs (a second activation
    # stream through the original blocks, run before each block is quantized)
    fp_chain = getattr(config, "target_chain", "quantized") == "fp"
    if fp_chain and resume is not None and resume.blocks_done and resume.fp_inputs is None:
        raise ValueError("target_chain 'fp' cannot resume this run: it has no saved activations of the original "
                         "model at its resume point")
    fp_inps = inps.clone() if fp_chain else None
    if resume is not None:
        first, inps, earlier_seconds = _apply_resume(resume, result, inps, len(blocks), on_layer)
        if fp_chain and resume.blocks_done:
            fp_inps = resume.fp_inputs.to(inps.device, torch.float32)
    try:
        for b, block in enumerate(blocks):
            if b < first:
                continue
            if should_stop():
                raise Cancelled
            if weights is not None:
                with result.timed("load_weights"):
                    weights.load_block(block, f"{prefix}.{b}", dev, torch.float32)
            orig_device = next(block.parameters()).device
            block.to(dev, torch.float32)
            linears = {n: m for n, m in block_linears(block).items() if not (skip and skip(f"{prefix}.{b}.{n}"))}
            block_kwargs = kwargs.at(b)  # this block's own mask / rotary embeddings (they differ per layer type)
            with result.timed("hessians_targets"):
                hessians, targets = _pass_a(block, linears, inps, block_kwargs)
                if fp_chain:
                    fp_inps = _run_batched(block, fp_inps, block_kwargs)  # the original model's block outputs
            ctx = BlockContext(
                index=b, prefix=prefix, block=block, linears=linears, hessians=hessians, inputs=inps,
                targets=fp_inps if fp_chain else targets,
                forward=lambda blk, x, kw=block_kwargs: run_block(blk, x, kw), config=config,
                method=method, result=result, should_stop=should_stop, publish=None,
            )
            ctx.publish = _publisher(ctx, on_layer)
            if method.quantize_block is not None:
                with result.timed(method.block_phase):
                    method.quantize_block(ctx)
            else:
                quantize_linears(ctx)
            for hook in method.after_block:
                if not hook.applies(config):
                    continue
                with result.timed(hook.phase):
                    metrics = hook.run(ctx)
                for rep in ctx.reports:
                    rep.extra.update(metrics or {})
            hessians.clear()  # ctx.hessians is this dict: free the Hessians before the pass-B activations
            with result.timed("block_outputs"):
                outs = _run_batched(block, inps, block_kwargs)
            err = float(((outs - targets) ** 2).sum() / (targets**2).sum().clamp(min=1e-20))
            ctx.targets = targets = None
            for rep in ctx.reports:
                rep.rel_output_error = err
                result.bits = result.bits + result.states[rep.name].storage_bits()
            if weights is not None:
                weights.release_block(block)
            else:
                block.to(orig_device, model_dtype)
            inps = outs
            result.blocks_done = b + 1
            if on_block is not None:
                block_states = {rep.name: result.states[rep.name] for rep in ctx.reports}
                on_block(BlockDone(b, block_states, list(ctx.reports), outs, result,
                                   earlier_seconds + time.perf_counter() - start_time, torch.get_rng_state(),
                                   fp_inps))
            if not keep_states:
                for rep in ctx.reports:
                    result.states.pop(rep.name, None)
            del ctx
            if weights is not None:
                return_freed_memory()  # streamed: keep the resident set at about one block
    except Cancelled:
        result.cancelled = True
    if model_hooks and not result.cancelled:
        budget = getattr(config, "time_budget", 0.0)
        deadline = start_time - earlier_seconds + budget if budget > 0 else None
        _run_model_hooks(model_hooks, model, reference, calib_ids, config, result, should_stop, on_step, dev,
                         known_teacher, deadline)
    result.seconds = earlier_seconds + time.perf_counter() - start_time
    return model, result


def _run_model_hooks(hooks, model: nn.Module, reference: nn.Module, calib_ids: torch.Tensor, config,
                     result: QuantizeResult, should_stop: ShouldStop, on_step: OnStep | None,
                     dev: torch.device, teacher: dict | None = None, deadline: float | None = None) -> None:
    """The after-model hooks on the whole fake-quantized model (float32 on ``dev``, put back after)."""
    orig_device, orig_dtype = next(model.parameters()).device, next(model.parameters()).dtype
    model.to(dev, torch.float32)
    try:
        for hook in hooks:
            ctx = ModelContext(model=model, reference=reference, calib_ids=calib_ids, states=result.states,
                               config=config, result=result, should_stop=should_stop,
                               on_step=on_step or (lambda _phase, _step, _steps, _loss: None), teacher=teacher,
                               deadline=deadline)
            with result.timed(hook.phase):
                metrics = hook.run(ctx) or {}
            result.model_metrics[hook.phase] = metrics
            if metrics.get("cancelled"):
                result.cancelled = True
                break
    finally:
        model.to(orig_device, orig_dtype)


def _apply_resume(resume: ResumePoint, result: QuantizeResult, inps: torch.Tensor, num_blocks: int,
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


def _publisher(ctx: BlockContext, on_layer: OnLayer) -> Callable[..., LayerReport]:
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


def _pass_a(block: nn.Module, linears: dict, inps: torch.Tensor, kwargs: dict):
    """Run the original block: Hessians per distinct linear input, and the outputs (targets)."""
    accumulators: dict[str, HessianAccumulator] = {}
    groups = SharedInputs()  # linears fed the very same tensor share one Hessian (the block's inputs held)

    def make_hook(name: str):
        def hook(_m, args, _out):
            x = args[0]
            if groups.owner_of(name, x) == name:
                if name not in accumulators:
                    accumulators[name] = HessianAccumulator(x.shape[-1], device=x.device)
                accumulators[name].add_batch(x[:, HESSIAN_SKIP_TOKENS:])

        return hook

    handles = [m.register_forward_hook(make_hook(n)) for n, m in linears.items()]
    try:
        targets = _run_batched(block, inps, kwargs)
    finally:
        for h in handles:
            h.remove()
        groups.release()
    shared = {n: acc.hessian for n, acc in accumulators.items()}  # one tensor per distinct input
    hessians = {n: shared[groups.owner[n]] for n in linears}
    return hessians, targets


def total_linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every block linear: what the app uses to show bits and size before a run."""
    shapes = []
    for block in decoder_blocks(model):
        shapes.extend((m.out_features, m.in_features) for m in block_linears(block).values())
    return shapes


# Public names for benchmarks and tools.
block_hessians = _pass_a
run_block_batched = _run_batched
