"""What one VPTQ layer costs to quantize on this machine, phase by phase, against the cost model the app's time
estimate uses (``vptq_core.studio.estimate.vptq_layer_seconds``).

Usage: python bench/quant_cost.py [--threads 2] [--quick] [--grid D:K ...] [--results FILE.jsonl]
       python bench/quant_cost.py --replay FILE.jsonl   (the table of saved measurements against today's model)

Protocol: the weights of one block of the bundled SmolLM2-135M (``--block``, default 10: q/k 576x576 and
192x576, gate 1536x576, down 576x1536) and their real Hessians, from the original model's inputs to them over 8
calibration windows of 512 wiki tokens (the k-d tree's query cost depends on how far the swept vectors fall from
the codebook, so on both). For every (shape, vector length, centroids) of the grid, ``vptq_quantize`` runs once
to warm up and then twice, the faster run kept; it reports its k-means, inverse-Hessian and sweep seconds and the call's
whole time. The table puts each beside the model's prediction (ratio measured / predicted); the last line is
the geometric mean and the worst ratio of whole layers. The model predicts the machine alone and unhurried
(``estimate._VPTQ_SCALE``): on a machine running slower than that, the geometric mean says by how much.
Torch threads as in a run (``--threads``; the sweep runs on one thread whatever the setting, k-means and its
k-d tree queries on all).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vptq_core.data import calibration_windows  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.config import VPTQConfig  # noqa: E402
from vptq_core.quant.vptq import vptq_quantize  # noqa: E402
from vptq_core.studio.estimate import vptq_layer_phases  # noqa: E402

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj")
GRID = [(d, k) for d in (2, 3, 4, 5, 6, 8) for k in (256, 1024, 4096, 16384)] + [(10, 4096), (12, 4096), (16, 65536)]
SETTINGS = ("vector_len", "num_centroids", "num_res_centroids", "outlier_percent")  # a row's layer settings
QUICK = [(4, 256), (6, 4096), (5, 1024), (3, 512)]
EXTRA = [  # the presets' own layers: outliers on, residual codebooks
    {"vector_len": 6, "num_centroids": 4096, "outlier_percent": 0.5},
    {"vector_len": 4, "num_centroids": 4096, "outlier_percent": 0.5},
    {"vector_len": 4, "num_centroids": 256, "num_res_centroids": 256, "outlier_percent": 0.5},
    {"vector_len": 8, "num_centroids": 256, "num_res_centroids": 256, "outlier_percent": 0.0},
]


def grid_pair(text: str) -> tuple[int, int]:
    """``D:K`` -> (vector length, centroids)."""
    try:
        d, k = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"grid pair must be D:K (two integers), got {text!r}") from None
    return d, k


def block_hessians(model, tokenizer, block, names) -> dict[str, torch.Tensor]:
    """X^T X / tokens of each named linear's inputs in ``block`` over 8 calibration windows."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name):
        def record(_module, inputs, _output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        return record

    handles = [block.get_submodule(name).register_forward_hook(hook(name)) for name in names]
    with torch.inference_mode():
        for window in calibration_windows(tokenizer, "wiki", 8, 512):
            model(window.unsqueeze(0))
    for handle in handles:
        handle.remove()
    return {name: sums[name] / counts[name] for name in names}


def timed(W, H, config):
    best = None
    for _ in range(2):
        start = time.perf_counter()
        result = vptq_quantize(W, H, config)
        total = time.perf_counter() - start
        if best is None or total < best[0]:
            best = (total, result.timings)
    return best


def print_table(rows: list[dict]) -> None:
    print("| layer | settings | k-means s | pred | sweep s | pred | whole s | pred | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for row in rows:
        ratios.append(print_row(row))
    gmean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    worst = max(ratios, key=lambda r: abs(math.log(r)))
    print(f"\nwhole layer measured / predicted: geometric mean {gmean:.2f}, worst {worst:.2f} over {len(ratios)}")


def print_row(row: dict) -> float:
    settings = {key: row[key] for key in SETTINGS if key in row}
    config = VPTQConfig(**{"num_res_centroids": 0, **settings})
    pred = vptq_layer_phases(row["out"], row["in"], config, threads=row["threads"])
    ratio = row["whole"] / pred["whole"]
    label = " ".join(f"{k}={v}" for k, v in settings.items())
    print(f"| {row['module']} {row['out']}x{row['in']} | {label} | {row['kmeans']:.3f} | {pred['kmeans']:.3f} | "
          f"{row['sweep']:.3f} | {pred['sweep']:.3f} | {row['whole']:.3f} | {pred['whole']:.3f} | {ratio:.2f} |",
          flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4 (vector length, centroids) pairs, 2 shapes")
    parser.add_argument("--results", help="append one JSON row per measurement to this file")
    parser.add_argument("--replay", help="print the table of a --results file instead of measuring")
    parser.add_argument("--grid", type=grid_pair, nargs="+", help="(vector length, centroids) pairs D:K to measure "
                        "instead of the built-in grid (and without the presets' layers)")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a built-in model (tiny-random-llama for a quick check of the script)")
    parser.add_argument("--block", type=int, default=10, help="the block whose layers are quantized")
    args = parser.parse_args()
    if args.replay:
        with open(args.replay, encoding="utf-8") as f:
            print_table([json.loads(line) for line in f if line.strip()])
        return
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    block = model.model.layers[args.block]
    modules = MODULES[::2] if args.quick else MODULES
    weights = {name: block.get_submodule(name).weight.detach().float() for name in modules}
    hessians = block_hessians(model, tokenizer, block, modules)
    pairs = args.grid or (QUICK if args.quick else GRID)
    configs = [{"vector_len": d, "num_centroids": k, "outlier_percent": 0.0} for d, k in pairs]
    configs += [] if args.quick or args.grid else EXTRA
    print(f"# VPTQ layer cost: {args.threads} torch threads, best of 2 after a warm-up; measured / predicted")
    rows = []
    out = open(args.results, "a", encoding="utf-8") if args.results else None
    for settings in configs:
        config = VPTQConfig(**{"num_res_centroids": 0, **settings})
        for name in modules:
            W, H = weights[name], hessians[name]
            vptq_quantize(W, H, config)  # warm-up (numba compilation, allocator)
            total, timings = timed(W, H, config)
            row = {"module": name, "out": W.shape[0], "in": W.shape[1], **settings, "threads": args.threads,
                   "whole": total, **timings}
            rows.append(row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
    print_table(rows)


if __name__ == "__main__":
    main()
