"""A whole model's forward and backward over a few windows with its weights away from the work device (the original
on the CPU, the work device a GPU, as in a run's plan stage): one decoder block at a time is on the work device, as
in the block stage, and activations travel between the two.

For every window the loss is that of one forward of the whole model, and the backward reaches every block linear's
outputs; the numbers are those of one forward and backward of the model where it lies (the same operations on the
same values: a block's forward is run again, with gradients, when the backward reaches it).

1. forward   block by block, every window through block ``b`` before block ``b + 1`` comes to the device; the
             blocks' inputs are kept where the blocks live (float32);
2. loss      the model's own forward after its last block (final norm, head, any logit soft-capping: the blocks
             stubbed, the first one returning the last block's output) with the modules outside the blocks on the
             work device, then ``loss_of(logits, ids, start)`` and its backward to the last block's output, a few
             positions at a time (the full-vocabulary logits of a whole window, and their copies, are large);
3. backward  block by block from the last, each run again on its kept inputs with gradients and its output's
             gradient sent back through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .blocks import blocks_prefix, decoder_blocks
from .forward import capture_block_inputs, kwargs_to, run_block
from .methods import Cancelled

LOSS_CHUNK_BYTES = 64 << 20  # float32 logits of one part of a window's loss (a large vocabulary: fewer positions)


@contextlib.contextmanager
def on_device(module: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> Iterator[None]:
    """``module`` on ``device`` (cast to ``dtype`` when given) inside the block, back where and as it was after (its
    floating tensors in the dtype of its first parameter, as the block stage puts blocks back)."""
    first = next(module.parameters())
    home, home_dtype = first.device, first.dtype
    module.to(device, dtype or home_dtype)
    try:
        yield
    finally:
        module.to(home, home_dtype)


@contextlib.contextmanager
def outside_blocks_on(model: nn.Module, device: torch.device) -> Iterator[None]:
    """The modules of ``model`` outside its decoder blocks (embedding, final norm, head, rotary tables) on
    ``device`` in their own dtypes inside the block; the blocks stay where they are."""
    parent_name, _, attr = blocks_prefix(model).rpartition(".")
    parent = model.get_submodule(parent_name)
    blocks = getattr(parent, attr)

    def move(to: torch.device) -> None:
        setattr(parent, attr, nn.ModuleList())  # out of the model while it moves
        try:
            ties = _tied_parameters(model)
            model.to(to)
            for module, key, first, first_key in ties:  # a move that makes new parameters makes one per module
                setattr(module, key, getattr(first, first_key))
        finally:
            setattr(parent, attr, blocks)

    home = model.get_input_embeddings().weight.device
    move(device)
    try:
        yield
    finally:
        move(home)


def _tied_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, first module, its name) for every parameter held by a module after the first that holds it
    (a head tied to the embedding)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                if id(param) in first:
                    ties.append((module, key, *first[id(param)]))
                else:
                    first[id(param)] = (module, key)
    return ties


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits for ``hidden`` [1, seq, hidden] leaving its last block: its own forward with the blocks
    stubbed (the first returns ``hidden``, the others pass it on), so final norm, head and soft-capping are its own."""
    blocks = decoder_blocks(model)
    outer = next(model.get_output_embeddings().parameters())
    given = hidden.to(outer.dtype)
    blocks[0].forward = lambda *args, **kwargs: given  # instance attributes: removed again below
    for block in blocks[1:]:
        block.forward = lambda *args, **kwargs: args[0] if args else kwargs["hidden_states"]
    try:
        return model(inputs_embeds=given, use_cache=False).logits
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)


def backward_by_block(model: nn.Module, windows: torch.Tensor, device: torch.device,
                      loss_of: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], *,
                      measuring: Callable[[bool], None], block_done: Callable[[int], None],
                      should_stop: Callable[[], bool]) -> None:
    """For each window of ``windows`` [n, seq]: the loss and its backward, with at most one decoder block of
    ``model`` on ``device`` at a time. The loss comes in parts, a few predicting positions at a time
    (``LOSS_CHUNK_BYTES`` of float32 logits): ``loss_of(logits [t, vocab] float32 of positions start..start+t-1,
    ids [1, seq] on the work device, start)`` is that part's share of the window's loss.

    ``measuring(True)`` before the forward pass (each linear sees each window's input once), ``measuring(False)``
    before the backward pass (the blocks run again); ``block_done(b)`` once every window went through block ``b``,
    while it is on the device. ``Cancelled`` when ``should_stop()`` between blocks."""
    blocks = decoder_blocks(model)
    home = next(blocks[0].parameters()).device
    inputs, kwargs = capture_block_inputs(model, windows, stub_blocks=True)
    kwargs = kwargs_to(kwargs, device, torch.float32)
    kept = [inputs.to(torch.float32)]  # what enters each block, where the blocks live
    measuring(True)
    for b, block in enumerate(blocks):
        if should_stop():
            raise Cancelled
        out = torch.empty_like(kept[-1])
        with on_device(block, device, torch.float32):
            for w in range(out.shape[0]):
                out[w : w + 1] = run_block(block, kept[-1][w : w + 1].to(device), kwargs.at(b)).to(home)
            block_done(b)
        kept.append(out)
    grads = []
    step = max(1, LOSS_CHUNK_BYTES // (4 * model.get_output_embeddings().out_features))
    with outside_blocks_on(model, device):
        for w in range(windows.shape[0]):
            hidden, ids = kept[-1][w : w + 1].to(device), windows[w : w + 1].to(device)
            grad = torch.zeros_like(hidden)
            for start in range(0, hidden.shape[1] - 1, step):  # the predicting positions, a few at a time
                part = hidden[:, start : min(start + step, hidden.shape[1] - 1)].detach().requires_grad_(True)
                with torch.enable_grad():
                    loss_of(head_logits(model, part)[0].float(), ids, start).backward()
                grad[:, start : start + part.shape[1]] = part.grad
            grads.append(grad)
    kept.pop()
    measuring(False)
    for b in reversed(range(len(blocks))):
        if should_stop():
            raise Cancelled
        with on_device(blocks[b], device, torch.float32):
            for w in range(windows.shape[0]):
                hidden = kept[b][w : w + 1].to(device).requires_grad_(True)
                with torch.enable_grad():
                    run_block(blocks[b], hidden, kwargs.at(b)).backward(grads[w])
                grads[w] = hidden.grad
        kept.pop()
