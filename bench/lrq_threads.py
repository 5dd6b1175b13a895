"""LRQ's block training with one torch thread and with more: seconds per block and the loss it reaches.

Protocol: SmolLM2-135M-Instruct (``--model``) in float32, ``--samples`` wiki calibration windows of ``--seqlen``
tokens pushed through the original blocks before ``--block``; on that block, ``lrq_quantize_block`` as the
pipeline runs it (the W4A8 preset's grid: 4-bit groups of 128, 8-bit per-token activations with a zero point;
``--iters`` steps of one window, the block-output check over every window before and after training) for each
thread count of ``--threads``. Every (iters, threads) cell runs once to warm up, then ``--rounds`` rounds alternate
the thread counts; the table keeps the fastest round of each cell and gives its ratio to the first thread count at
the same steps. Same seed, so the threads change only the order of float sums.

    python bench/lrq_threads.py [--block 5] [--samples 32] [--iters 16 32] [--threads 1 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gguf_export import cpu_name  # noqa: E402
from lrq_overfit import block_io  # noqa: E402

from vptq_core.data import calibration_windows  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.blocks import block_linears  # noqa: E402
from vptq_core.quant.config import LRQConfig  # noqa: E402
from vptq_core.quant.forward import run_block  # noqa: E402
from vptq_core.quant.lrq import PRESETS, lrq_quantize_block  # noqa: E402

GRID_KEYS = ("bits", "group_size", "act_bits", "act_granularity")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a built-in model (tiny-random-llama for a quick check of the script)")
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--samples", type=int, default=32, help="calibration windows (the presets' 32)")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--iters", type=int, nargs="+", default=[16, 32], help="training steps per block")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts to compare")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up")
    args = parser.parse_args()

    torch.set_num_threads(max(args.threads))
    model, tok = load_model(args.model, dtype=torch.float32)
    calib = calibration_windows(tok, "wiki", args.samples, args.seqlen)
    block, inps, targets, kwargs = block_io(model, calib, args.block)
    names = list(block_linears(block))
    grid = {key: PRESETS["w4a8"][key] for key in GRID_KEYS}

    def run(iters: int, threads: int) -> tuple[float, float, float]:
        torch.set_num_threads(threads)
        config = LRQConfig(iters=iters, **grid)
        t0 = time.perf_counter()
        with torch.enable_grad():
            res = lrq_quantize_block(copy.deepcopy(block), names, inps, targets,
                                     lambda blk, x: run_block(blk, x, kwargs), config)
        return time.perf_counter() - t0, res.loss_before, res.loss_after

    best: dict[tuple[int, int], tuple[float, float, float]] = {}
    for iters in args.iters:
        for threads in args.threads:
            run(iters, threads)  # warm-up
        for _ in range(args.rounds):
            for threads in args.threads:
                seconds, before, after = run(iters, threads)
                old = best.get((iters, threads))
                best[(iters, threads)] = (min(seconds, old[0]) if old else seconds, before, after)

    print(f"protocol: {cpu_name()}, {os.cpu_count()} CPUs; {args.model} block {args.block}, {args.samples} windows x "
          f"{args.seqlen} tokens, LRQ grid {grid}; fastest of {args.rounds} alternated rounds after a warm-up")
    print("| steps | threads | seconds per block | × first thread count | block MSE before | after |")
    print("|---|---|---|---|---|---|")
    for iters in args.iters:
        base = best[(iters, args.threads[0])][0]
        for threads in args.threads:
            seconds, before, after = best[(iters, threads)]
            print(f"| {iters} | {threads} | {seconds:.2f} | {seconds / base:.2f} | {before:.5f} | {after:.5f} |")


if __name__ == "__main__":
    main()
