"""LRQ low-rank vs full per-weight scale (FlexRound-style) on one real block: fit vs held-out error by steps.

Protocol: SmolLM2-135M-Instruct block ``--block`` (inputs from the original blocks before it), 3-bit
per-channel weights, trained with ``lrq_quantize_block`` on ``--calib`` wiki calibration windows (even
articles) of ``--seqlen`` (512) tokens; error = relative block-output error ||Y_q - Y||² / ||Y||² on those windows
("calib") and on ``--held`` windows of the held-out wiki split (odd articles). One torch thread.

    python bench/lrq_overfit.py [--block 5] [--calib 4] [--held 8] [--grid 32:auto 128:full ...]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.data import calibration_windows, eval_windows  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.blocks import block_linears, decoder_blocks  # noqa: E402
from vptq_core.quant.config import LRQConfig  # noqa: E402
from vptq_core.quant.forward import capture_block_inputs, run_batched, run_block  # noqa: E402
from vptq_core.quant.lrq import auto_rank, lrq_quantize_block  # noqa: E402

GRID = [(32, "auto"), (32, "full"), (128, 16), (128, 48), (128, "auto"), (128, "full"), (384, "auto"),
        (384, "full")]


def grid_cell(text: str) -> tuple[int, int | str]:
    """``STEPS:RANK`` (RANK an integer, ``auto`` or ``full``) -> (steps, rank)."""
    steps, _, rank = text.partition(":")
    try:
        return int(steps), rank if rank in ("auto", "full") else int(rank)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"grid cell must be STEPS:RANK, RANK an integer, auto or full; got {text!r}") from None


def block_io(model, ids: torch.Tensor, index: int):
    """Block ``index`` of ``model``, its inputs on the windows ``ids`` (pushed through the original blocks before it),
    its outputs on them and the blocks' extra arguments: (block, inputs, targets, kwargs)."""
    with torch.no_grad():
        inps, kwargs = capture_block_inputs(model, ids)
        blocks = decoder_blocks(model)
        for b in range(index):
            inps = run_batched(blocks[b], inps, kwargs)
        return blocks[index], inps, run_batched(blocks[index], inps, kwargs), kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--calib", type=int, default=4)
    parser.add_argument("--held", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per window")
    parser.add_argument("--grid", type=grid_cell, nargs="+", default=GRID, help="STEPS:RANK cells (default: "
                        + " ".join(f"{s}:{r}" for s, r in GRID) + ")")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a built-in model (tiny-random-llama for a quick check of the script)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model, dtype=torch.float32)
    calib = calibration_windows(tok, "wiki", args.calib, args.seqlen)
    held = eval_windows(tok, "wiki", args.seqlen, args.held)
    n = args.calib
    block, inps, targets, kwargs = block_io(model, torch.cat([calib, held]), args.block)
    names = list(block_linears(block))

    def rel_error(blk, rows: slice) -> float:
        with torch.no_grad():
            out = run_batched(blk, inps[rows], kwargs)
        return float(((out - targets[rows]) ** 2).sum() / (targets[rows] ** 2).sum())

    width = model.config.hidden_size
    auto = auto_rank(width, width)
    print(f"block {args.block}, W3 per-channel, {n} calibration / {args.held} held-out windows x {args.seqlen} tokens; "
          f"relative block-output error (auto rank = {auto} for {width}-wide layers)")
    print("| steps | scale | calib error | held-out error | seconds |")
    print("|---|---|---|---|---|")
    for steps, rank in args.grid:
        work = copy.deepcopy(block)
        config = LRQConfig(bits=3, iters=steps, full_scale=rank == "full", rank=rank if isinstance(rank, int) else 0)
        t0 = time.perf_counter()
        with torch.enable_grad():
            res = lrq_quantize_block(work, names, inps[:n], targets[:n], lambda blk, x: run_block(blk, x, kwargs),
                                     config)
        for name in names:
            work.get_submodule(name).weight.data.copy_(res.states[name].dequantize().float())
        label = "full (FlexRound-style)" if rank == "full" else f"low-rank, rank {auto if rank == 'auto' else rank}"
        print(f"| {steps} | {label} | {rel_error(work, slice(0, n)):.5f} | {rel_error(work, slice(n, None)):.5f} | "
              f"{time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
