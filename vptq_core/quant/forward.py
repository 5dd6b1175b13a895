"""Running decoder blocks one by one on calibration activations, outside the model's own forward.

``capture_block_inputs`` stops the model's forward at block 0 and keeps what enters it (and the extra
arguments every block is called with); ``run_block`` / ``run_batched`` run one block on [n, seq, hidden];
``hessians_and_targets`` runs the original block once, accumulating one Hessian per distinct linear input
(q/k/v share one, gate/up share one) and keeping the block's outputs as the targets.

The block stage's forwards run in ``block_dtype``: bfloat16 autocast on a CPU that multiplies bf16 (the
matmuls and the Hessian products in bf16, the residual stream and the Hessian sums in float32), else float32
(docs/methods.md#block-stage-precision).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from .blocks import decoder_blocks
from .device import compute_dtype
from .hessian import HessianAccumulator, SharedInputs

BLOCK_DTYPE_ENV = "VPTQ_BLOCK_DTYPE"  # "auto" (default), "bfloat16" or "float32": the block stage's forwards


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
BATCH = 8  # calibration windows per block call: a batched forward is much faster than one window at a time


def block_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype the block stage runs blocks in on ``device``: ``$VPTQ_BLOCK_DTYPE`` ("float32" when unset;
    "auto": bf16 on a CPU that multiplies it in hardware, else float32; or "bfloat16"). float32 is the default so
    that a run gives the same checkpoint on every machine and on a device as on the CPU, to float rounding; bf16
    is the faster choice a user makes knowingly (docs/methods.md#block-stage-precision)."""
    value = (os.environ.get(BLOCK_DTYPE_ENV) or "float32").strip().lower()
    if value == "auto" and torch.device(device).type != "cpu":
        return torch.float32
    try:
        return compute_dtype(value, device)
    except ValueError:
        raise ValueError(f"${BLOCK_DTYPE_ENV} must be auto, bfloat16 or float32, got {value!r}") from None


def autocast_to(dtype: torch.dtype, device: torch.device | str):
    """A context running the forwards inside in ``dtype``: bf16 autocast (matmuls and attention in bf16, what
    the block adds to its float32 input stays float32), or nothing for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def run_batched(block: nn.Module, inps: torch.Tensor, kwargs: dict,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``block`` on every window of ``inps`` [n, seq, hidden], ``BATCH`` windows per call; ``dtype``: float32,
    or bfloat16 for bf16 autocast (``autocast_to``). The outputs come in ``inps``' dtype."""
    outs = torch.empty_like(inps)
    with autocast_to(dtype, inps.device):  # one context: autocast casts each weight to bf16 once, not per batch
        for i in range(0, inps.shape[0], BATCH):
            outs[i : i + BATCH] = run_block(block, inps[i : i + BATCH], kwargs)
    return outs


def kwargs_to(kwargs: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Block arguments moved to ``device`` (floating tensors cast to ``dtype``)."""
    if isinstance(kwargs, BlockKwargs):
        return kwargs.to(device, dtype)

    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device, dtype) if v.is_floating_point() else v.to(device)
        if isinstance(v, tuple):
            return tuple(move(x) for x in v)
        return v

    return {k: move(v) for k, v in kwargs.items()}


def hessians_and_targets(block: nn.Module, linears: dict, inps: torch.Tensor, kwargs: dict,
                         dtype: torch.dtype = torch.float32):
    """Run the original block once: Hessians per distinct linear input, and the outputs (targets). ``dtype``:
    float32, or bfloat16 for the forward under bf16 autocast and the Hessian products in bf16 (float32 sums)."""
    accumulators: dict[str, HessianAccumulator] = {}
    groups = SharedInputs()  # linears fed the very same tensor share one Hessian (the block's inputs held)

    def make_hook(name: str):
        def hook(_m, args, _out):
            x = args[0]
            if groups.owner_of(name, x) == name:
                if name not in accumulators:
                    accumulators[name] = HessianAccumulator(x.shape[-1], device=x.device, dtype=dtype)
                accumulators[name].add_batch(x[:, HESSIAN_SKIP_TOKENS:])

        return hook

    handles = [m.register_forward_hook(make_hook(n)) for n, m in linears.items()]
    try:
        targets = run_batched(block, inps, kwargs, dtype)
    finally:
        for h in handles:
            h.remove()
        groups.release()
    shared = {n: acc.hessian for n, acc in accumulators.items()}  # one tensor per distinct input
    hessians = {n: shared[groups.owner[n]] for n in linears}
    return hessians, targets

