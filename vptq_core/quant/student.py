"""The student side of end-to-end distillation: the quantized model run to its final hidden states, then the LM
head and the bucket KL to the teacher in chunks of tokens, so memory holds one chunk's full-vocabulary logits at a
time; activation checkpointing of the decoder blocks beyond what an activation budget holds; and the model's
large frozen tensors (input embedding, LM head, the fake-quant weights the trainable layers replace) left in the
dtype they are stored in, computed in float32 where the step is float32
(docs/methods.md#end-to-end-distillation).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from .blocks import decoder_blocks
from .teacher import bucket_kl
from .trainable import swapped_in

HEAD_CHUNK = 1024  # tokens per LM-head chunk at most: one chunk's full-vocabulary logits live at a time ...
HEAD_CHUNK_BYTES = 64 << 20  # ... and one chunk's float32 logits take at most this (large vocabularies: fewer tokens)
HEAD_ROWS = 8192  # vocabulary rows of a stored-dtype head brought to float32 at a time
# Bytes of saved activations per token and per output element of the block linears when the blocks are not
# checkpointed: measured with bench/distill_step.py (peak memory with and without checkpointing), with a margin.
ACT_BYTES = 20
ACT_MEMORY_SHARE = 0.25  # of the device's free memory the saved activations may take ...
ACT_MEMORY_BYTES = 256 << 20  # ... and at most this: the blocks beyond it are checkpointed (bench/stage_memory.py)


def free_memory(device: torch.device) -> int | None:
    """Free bytes of ``device`` (host RAM available for the CPU), None when unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            import psutil

            return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - unknown means: be careful
        return None
    return None


def kept_blocks(setting: bool | str, linear_outputs: int, tokens: int, device: torch.device, blocks: int) -> int:
    """How many of ``blocks`` decoder blocks keep their saved activations (the others are checkpointed):
    ``distill_checkpointing`` true: none; false: all; "auto": as many as fit the activation budget, the least of
    ``ACT_MEMORY_BYTES`` and ``ACT_MEMORY_SHARE`` of the device's free memory, one step's saved activations being
    ``ACT_BYTES`` x ``linear_outputs`` (sum of out_features of the quantized linears) x ``tokens`` per step,
    shared evenly by the blocks."""
    if setting != "auto":
        return 0 if setting else blocks
    free = free_memory(torch.device(device))
    if free is None or blocks < 1:
        return 0
    budget = min(ACT_MEMORY_BYTES, ACT_MEMORY_SHARE * free)
    per_block = ACT_BYTES * linear_outputs * tokens / blocks
    return min(blocks, int(budget // per_block)) if per_block > 0 else blocks


def use_checkpointing(setting: bool | str, linear_outputs: int, tokens: int, device: torch.device,
                      blocks: int = 1) -> bool:
    """``distill_checkpointing`` resolved: whether any of the ``blocks`` decoder blocks is checkpointed
    (``kept_blocks``)."""
    return kept_blocks(setting, linear_outputs, tokens, device, blocks) < blocks


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, enabled: bool | int):
    """The decoder blocks' forwards under activation checkpointing (instance attributes, removed after): every
    block (``enabled`` true), none (false), or all but the last ``enabled`` blocks (an int: the blocks that keep
    their activations; the last ones, whose backward comes first)."""
    every = list(decoder_blocks(model))
    if isinstance(enabled, bool):
        blocks = every if enabled else []
    else:
        blocks = every[: max(0, len(every) - enabled)]
    for block in blocks:
        cls_forward = type(block).forward

        def forward(*args, _block=block, _fwd=cls_forward, **kwargs):
            if not torch.is_grad_enabled():
                return _fwd(_block, *args, **kwargs)
            return checkpoint(functools.partial(_fwd, _block, **kwargs), *args, use_reentrant=False)

        block.forward = forward
    try:
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)


def head_chunk(vocab: int) -> int:
    """Tokens per LM-head chunk for a vocabulary of ``vocab``: ``HEAD_CHUNK``, fewer when one chunk's float32
    logits would pass ``HEAD_CHUNK_BYTES``."""
    return max(1, min(HEAD_CHUNK, HEAD_CHUNK_BYTES // (4 * vocab)))


class _StoredHead(torch.autograd.Function):
    """x [t, in] float32 @ W [V, in]ᵀ (W frozen, in a narrower dtype) in float32, ``HEAD_ROWS`` rows of W brought
    to float32 at a time, forward and backward: the numbers of a float32 head without a float32 copy of it."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for i in range(0, weight.shape[0], HEAD_ROWS):
            rows = weight[i : i + HEAD_ROWS].float()
            out[..., i : i + HEAD_ROWS] = F.linear(x, rows, None if bias is None else bias[i : i + HEAD_ROWS].float())
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        dx = None
        for i in range(0, weight.shape[0], HEAD_ROWS):
            part = grad[..., i : i + HEAD_ROWS] @ weight[i : i + HEAD_ROWS].float()
            dx = part if dx is None else dx.add_(part)
        return dx, None, None


class StoredHead(nn.Module):
    """An LM head left in its stored dtype (e.g. bf16) that computes as a float32 one (frozen: no gradient reaches
    its weight): under autocast as the head itself, otherwise in float32 a slice of rows at a time
    (``_StoredHead``). The weight is the head's own ``Parameter`` (tied to the input embedding when the model ties
    them)."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.inner = head
        self.in_features, self.out_features = head.in_features, head.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.inner.weight, self.inner.bias
        if torch.is_autocast_enabled(x.device.type) or x.dtype != torch.float32:
            return self.inner(x)
        return _StoredHead.apply(x, w, b)


class StoredEmbedding(nn.Module):
    """An input embedding left in its stored dtype that gives what it would give in float32: the module itself
    run on a float32 table of just the rows looked up (so any scaling it applies is computed in float32)."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.inner = embedding
        self.weight = embedding.weight  # the model's own (``get_input_embeddings().weight`` callers)
        # run on a table of a few rows, whose padding row need not exist (no gradient reaches the table)
        lookup = copy.copy(embedding)
        lookup.padding_idx = None
        object.__setattr__(self, "_lookup", lookup)  # not a submodule: the same tensors as ``inner``

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows, inverse = torch.unique(ids, return_inverse=True)
        state = {name: t.detach().float() if t.is_floating_point() else t
                 for name, t in itertools.chain(self.inner.named_parameters(), self.inner.named_buffers())
                 if name != "weight"}
        state["weight"] = self.inner.weight.detach()[rows].float()
        return functional_call(self._lookup, state, (inverse,))


def _frozen_names(model: nn.Module, quantized: Iterable[str]) -> dict[str, str]:
    """Module name -> what it is, of the large modules distillation does not train: the input embedding, the LM
    head and the quantized linears (replaced by their trainable forms while it trains)."""
    by_module = {id(m): name for name, m in model.named_modules()}
    names = {name: "linear" for name in quantized}
    names[by_module[id(model.get_input_embeddings())]] = "embedding"
    head = model.get_output_embeddings()
    if head is not None:
        names[by_module[id(head)]] = "head"
    return names


def to_training_dtype(model: nn.Module, device: torch.device, quantized: Iterable[str]) -> None:
    """``model`` on ``device`` for distillation: every floating tensor in float32 except the large frozen ones
    (``_frozen_names``: input embedding, LM head, the quantized linears' fake-quant weights), which keep their
    stored dtype; ``stored_dtype_modules`` computes those as float32 while training runs."""
    model.to(device)
    frozen = _frozen_names(model, quantized)
    for name, module in model.named_modules():
        if name in frozen:
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float32 and not _held_by(p, model, frozen):
                p.data = p.data.float()
        for key, b in module.named_buffers(recurse=False):
            if b.is_floating_point() and b.dtype != torch.float32:
                module._buffers[key] = b.float()


def share_outer_weights(reference: nn.Module, model: nn.Module) -> int:
    """``reference``'s input embedding and LM head weights replaced by ``model``'s own (the same ``Parameter``s, a
    tied pair staying tied); returns the bytes ``reference`` no longer holds.

    For an original loaded from the same weights as ``model``: no stage before distillation changes those two,
    and distillation trains neither, so the teacher pass reads the same values from a single copy (a large
    vocabulary's head is a large share of a small model). Only a weight of the same shape, dtype and device is
    shared: a model that moves to another device moves its own."""
    saved = 0
    for kind in ("input", "output"):
        ours, theirs = (getattr(m, f"get_{kind}_embeddings")() for m in (model, reference))
        if ours is None or theirs is None or theirs.weight is ours.weight:
            continue
        old = theirs.weight
        new = ours.weight
        if (old.shape, old.dtype, old.device) != (new.shape, new.dtype, new.device):
            continue
        for module in reference.modules():  # every holder of the old weight (a head tied to the embedding)
            for key, param in module._parameters.items():
                if param is old:
                    module._parameters[key] = new
        saved += old.numel() * old.element_size()
    return saved


def _held_by(p: torch.Tensor, model: nn.Module, frozen: dict[str, str]) -> bool:
    """``p`` is also a parameter of one of the ``frozen`` modules (a head tied to the input embedding)."""
    return any(p is q for name in frozen for q in model.get_submodule(name).parameters(recurse=False))


@contextlib.contextmanager
def stored_dtype_modules(model: nn.Module):
    """The input embedding and the LM head, when not float32, replaced by ``StoredEmbedding`` / ``StoredHead``
    inside the block (the originals put back after), so a model left in its stored dtype runs as a float32 one."""
    frozen = _frozen_names(model, ())
    wrap = {"embedding": StoredEmbedding, "head": StoredHead}
    names = [name for name, kind in frozen.items()
             if model.get_submodule(name).weight.dtype != torch.float32]
    with swapped_in(model, names, lambda name, module: wrap[frozen[name]](module)):
        yield


class Student:
    """Runs the quantized model to its final hidden states and the LM head + KL in chunks of tokens."""

    def __init__(self, model: nn.Module, checkpointing: bool) -> None:
        self.model = model
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head); cannot distill it")
        self.cap = getattr(model.config, "final_logit_softcapping", None)
        self.checkpointing = checkpointing

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.base(input_ids=ids, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        return torch.tanh(logits.float() / self.cap) * self.cap if self.cap else logits

    def kl_sum(self, ids: torch.Tensor, teacher: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """Sum of the bucket KL over every predicted token of ``ids`` [b, seq] (teacher rows ``rows``)."""
        h = self.hidden(ids)[:, :-1].reshape(-1, self.head.in_features)
        t_logp = teacher["logp"][rows].reshape(h.shape[0], -1)
        t_index = teacher["index"][rows].reshape(h.shape[0], -1)
        t_rest = teacher["rest"][rows].reshape(-1)
        total = h.new_zeros((), dtype=torch.float32)
        size = head_chunk(self.head.out_features)

        def chunk(h_c, lp, ix, rs):
            return bucket_kl(self.head(h_c), lp, ix, rs, self.cap)

        for i in range(0, h.shape[0], size):
            part = (h[i : i + size], t_logp[i : i + size], t_index[i : i + size], t_rest[i : i + size])
            if self.checkpointing and torch.is_grad_enabled():
                total = total + checkpoint(chunk, *part, use_reentrant=False)
            else:
                total = total + chunk(*part)
        return total


def check_head(student: Student, model: nn.Module, ids: torch.Tensor) -> None:
    """The student's hidden-state + head path must give the model's own logits (soft-capping, scaling...)."""
    with torch.no_grad():
        ids = ids[:1, : min(ids.shape[1], 16)]
        ours = student.logits(student.hidden(ids)).float()
        theirs = model(input_ids=ids, use_cache=False).logits.float()
    if not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3 * max(1.0, float(theirs.abs().max()))):
        raise ValueError(f"{type(model).__name__}: its logits are not lm_head(base_model(ids)) (max difference "
                         f"{float((ours - theirs).abs().max()):.3g}); distillation does not support this model")
