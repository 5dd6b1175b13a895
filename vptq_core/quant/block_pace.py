"""The method's own block work, timed on the model's first block before the run: its pace on this device against
its price (``Method.cost``), so that a time budget's plan prices the block stage by what the device does with that
work rather than by how fast it multiplies matrices (``run_plan.measure_speed``).

The speed probe tells little about that work. On a 2-vCPU AVX2 machine whose probe read 0.55-0.70x the reference,
LRQ's training steps ran at about 0.3x their price (the plan forecast 33-42 distillation steps and the run had
time for 2-6), and VPTQ's layers at about 0.72x the price of the layouts the bit plan chose, for every layout
alike (bench/results/presets_cli_amd.txt, docs/methods.md#time-budget).

``measure_block_speed`` builds block 0 as the run will quantize it: float32 on the run's device, its weights read
from disk when the model is streamed, its inputs and kwargs captured from token ids of a private generator (the
probe's pace does not depend on the text), its Hessians and outputs from the original block. A private copy: the
model's own block is left as it was. The method's ``pace(probe, config)`` then runs some of its work on it and
returns (seconds measured, seconds its price gives on the reference machine). The run's random streams are left as
they were.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .blocks import block_linears, blocks_prefix, decoder_blocks
from .cost import RunSize
from .forward import capture_block_inputs, hessians_and_targets, kwargs_to, run_block
from .methods import Method
from .source import BlockWeights

# What the probe's block is fed: PROBE_WINDOWS windows of the run's length.
PROBE_WINDOWS = 2
SPEED_RANGE = (0.05, 100.0)


class ProbeBlock(NamedTuple):
    """Block 0 as the run's block stage has it: the block (a private float32 copy on the device), its linears by
    name, their Hessians, the block's inputs [n, seq, hidden] and the original block's outputs on them, and
    ``forward(block, x)``."""

    block: nn.Module
    linears: dict[str, nn.Linear]
    hessians: dict[str, torch.Tensor]
    inputs: torch.Tensor
    targets: torch.Tensor
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]


def measure_block_speed(model: nn.Module, method: Method, size: RunSize, config, device: torch.device | str = "cpu",
                        weights: BlockWeights | None = None, windows: int = PROBE_WINDOWS) -> float | None:
    """How many times faster than its price ``method``'s own block work runs on ``device`` now for a run of
    ``size`` / ``config`` (see the module's docstring), within ``SPEED_RANGE``; None when the method has no
    ``pace``. ``weights``: where a streamed model's blocks are read from (None: the model holds them)."""
    if method.pace is None:
        return None
    device = torch.device(device)
    cpu_rng, np_rng = torch.get_rng_state(), np.random.get_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    try:
        probe = build_probe(model, size.seqlen, device, weights, windows)
        measured, priced = method.pace(probe, method.for_model(config, size.linear_shapes))
    finally:
        torch.set_rng_state(cpu_rng)
        np.random.set_state(np_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    lo, hi = SPEED_RANGE
    return min(max(priced / max(measured, 1e-9), lo), hi)


def build_probe(model: nn.Module, seqlen: int, device: torch.device, weights: BlockWeights | None = None,
                windows: int = PROBE_WINDOWS) -> ProbeBlock:
    """Block 0 of ``model`` as the block stage has it (``ProbeBlock``), fed ``windows`` windows of ``seqlen``
    token ids drawn from a private generator."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or model.get_input_embeddings().num_embeddings)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (max(int(windows), 1), max(int(seqlen), 2)), generator=gen)
    inps, kwargs = capture_block_inputs(model, ids, stub_blocks=True, embeds_dtype=torch.float32)
    inps = inps.to(device, torch.float32)
    block = copy.deepcopy(decoder_blocks(model)[0])
    if weights is not None and any(t.is_meta for t in block.parameters()):
        weights.load_block(block, f"{blocks_prefix(model)}.0", device, torch.float32)
    block = block.to(device, torch.float32).eval()
    block_kwargs = kwargs_to(kwargs.at(0), device, torch.float32)
    linears = block_linears(block)
    with torch.no_grad():
        hessians, targets = hessians_and_targets(block, linears, inps, block_kwargs)
    return ProbeBlock(block, linears, hessians, inps, targets,
                      lambda blk, x, kw=block_kwargs: run_block(blk, x, kw))
