"""LRQ's block training under the W4A8 grid: the block-output error its steps and learning rate reach, on the
calibration windows and on held-out text of two domains.

Protocol: SmolLM2-135M-Instruct (``--model``) in float32; for each block of ``--blocks``, its inputs pushed through
the original blocks before it; ``lrq_quantize_block`` as the pipeline runs it (the W4A8 presets' grid: 4-bit groups
of 128, 8-bit per-token activations with a zero point; one window per step, Adam with a cosine schedule) on
``--samples`` wiki calibration windows of ``--seqlen`` tokens, for each ``STEPS:LR`` cell of ``--grid``. Then the
trained layers (``ScaleLinear``: the packed weights and the activation quantizer, as distillation and the checkpoint
run them) replace the block's linears, and the table gives the block-output error relative to what the block adds
to its input X, ||Y_q - Y||^2 / ||Y - X||^2 (relative to ||Y||^2 the residual stream would hide it), on the
calibration windows and on ``--held`` windows of the dev split of wiki (the calibration's domain) and of pydocs
(another). Same seed in every cell; deterministic for a thread count (``--threads``).

    python bench/lrq_steps.py [--blocks 5 15] [--grid 32:0.01 32:0.005 64:0.01 64:0.005]
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

from vptq_core.data import calibration_windows, eval_windows  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.blocks import block_linears  # noqa: E402
from vptq_core.quant.config import LRQConfig  # noqa: E402
from vptq_core.quant.forward import run_batched, run_block  # noqa: E402
from vptq_core.quant.lrq import PRESETS, lrq_quantize_block  # noqa: E402
from vptq_core.quant.trainable import trainable_linear  # noqa: E402

GRID_KEYS = ("bits", "group_size", "act_bits", "act_granularity")
GRID = ["32:0.01", "32:0.005", "64:0.01", "64:0.005"]


def grid_cell(text: str) -> tuple[int, float]:
    """``STEPS:LR`` -> (steps, lr)."""
    steps, _, lr = text.partition(":")
    try:
        cell = int(steps), float(lr)
    except ValueError:
        cell = None
    if cell is None or cell[0] < 1 or not cell[1] > 0:
        raise argparse.ArgumentTypeError(f"grid cell must be STEPS:LR, STEPS >= 1 and LR > 0; got {text!r}")
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a built-in model (tiny-random-llama for a quick check of the script)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[5, 15])
    parser.add_argument("--samples", type=int, default=32, help="calibration windows (the presets' 32)")
    parser.add_argument("--held", type=int, default=8, help="held-out windows of each text's dev split")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--grid", type=grid_cell, nargs="+", default=[grid_cell(c) for c in GRID],
                        help="STEPS:LR cells (default: " + " ".join(GRID) + ")")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=torch.float32)
    parts = {"calib": calibration_windows(tok, "wiki", args.samples, args.seqlen)}
    for text in ("wiki", "pydocs"):
        parts[f"{text} dev"] = eval_windows(tok, text, args.seqlen, args.held, split="dev")
    bounds, start = {}, 0
    for name, ids in parts.items():
        bounds[name] = slice(start, start + ids.shape[0])
        start += ids.shape[0]
    grid = {key: PRESETS["w4a8"][key] for key in GRID_KEYS}
    n = args.samples

    print(f"protocol: {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} thread(s); {args.model}, {n} wiki "
          f"calibration windows x {args.seqlen} tokens, {args.held} dev windows of wiki and of pydocs; LRQ grid "
          f"{grid}; block-output error of the trained block (packed weights, activation quantizer) / ||Y - X||^2")
    print("| block | steps | lr | calib error | wiki dev error | pydocs dev error | seconds |")
    print("|---|---|---|---|---|---|---|")
    for index in args.blocks:
        block, inps, targets, kwargs = block_io(model, torch.cat(list(parts.values())), index)
        names = list(block_linears(block))

        def rel_error(blk, rows: slice) -> float:
            with torch.no_grad():
                out = run_batched(blk, inps[rows], kwargs)
            return float(((out - targets[rows]) ** 2).sum() / ((targets[rows] - inps[rows]) ** 2).sum())

        for steps, lr in args.grid:
            config = LRQConfig(iters=steps, lr=lr, **grid)
            t0 = time.perf_counter()
            with torch.enable_grad():
                res = lrq_quantize_block(block, names, inps[:n], targets[:n], lambda blk, x: run_block(blk, x, kwargs),
                                         config)
            seconds = time.perf_counter() - t0
            work = copy.deepcopy(block)
            for name in names:
                parent, _, child = name.rpartition(".")
                layer = trainable_linear(res.states[name], block.get_submodule(name).bias).requires_grad_(False)
                setattr(work.get_submodule(parent) if parent else work, child, layer)
            errors = " | ".join(f"{rel_error(work, bounds[part]):.4g}" for part in parts)
            print(f"| {index} | {steps} | {lr:g} | {errors} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
