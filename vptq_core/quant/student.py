"""The student side of end-to-end distillation: the quantized model run to its final hidden states, then the LM
head and the bucket KL to the teacher in chunks of tokens, so memory holds one chunk's full-vocabulary logits at a
time; and activation checkpointing of the decoder blocks, so it holds one block's activations
(docs/methods.md#end-to-end-distillation).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .blocks import decoder_blocks
from .teacher import bucket_kl

HEAD_CHUNK = 1024  # tokens per LM-head chunk: one chunk's full-vocabulary logits live at a time
# Bytes of saved activations per token and per output element of the block linears when the blocks are not
# checkpointed: measured with bench/distill_step.py (peak memory with and without checkpointing), with a margin.
ACT_BYTES = 20
ACT_MEMORY_SHARE = 0.25  # of the device's free memory the saved activations may take


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


def use_checkpointing(setting: bool | str, linear_outputs: int, tokens: int, device: torch.device) -> bool:
    """``distill_checkpointing`` resolved: true / false as given; "auto" = checkpoint unless one step's saved
    activations (``ACT_BYTES`` x ``linear_outputs`` (sum of out_features of the quantized linears) x ``tokens``
    per step) fit ``ACT_MEMORY_SHARE`` of the device's free memory."""
    if setting != "auto":
        return bool(setting)
    free = free_memory(torch.device(device))
    return free is None or ACT_BYTES * linear_outputs * tokens > ACT_MEMORY_SHARE * free


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, enabled: bool):
    """Every decoder block's forward under activation checkpointing (instance attributes, removed after)."""
    blocks = list(decoder_blocks(model)) if enabled else []
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

        def chunk(h_c, lp, ix, rs):
            return bucket_kl(self.head(h_c), lp, ix, rs, self.cap)

        for i in range(0, h.shape[0], HEAD_CHUNK):
            part = (h[i : i + HEAD_CHUNK], t_logp[i : i + HEAD_CHUNK], t_index[i : i + HEAD_CHUNK],
                    t_rest[i : i + HEAD_CHUNK])
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
