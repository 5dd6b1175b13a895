"""CPU kernel speed: dense bf16 F.linear vs VPTQ reference (dequantize + matmul) vs the fused CPU kernel.

Usage: python bench/kernels.py [--threads N] [--quick]

Random but valid layers (uniform indices, Gaussian codebooks, bf16), x in bf16. Each cell is the median
wall time of repeated calls after warm-up; ratios are against dense bf16 in the same run. A second table
measures the tokens-per-call crossover between the fused kernel and dequantize + matmul, which sets
``kernels.ops.CPU_FUSED_MAX_TOKENS``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import VQSpec, available_backends, vq_dequantize, vq_linear  # noqa: E402
from kernels.synthetic import random_vq_layer  # noqa: E402

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 4096), (11008, 4096)]  # (out, in)
CONFIGS = {"2-bit v6 k4096": (6, 4096, -1), "3-bit v4 k4096": (4, 4096, -1)}
EXTRA_CONFIGS = {"v8 k256+res256": (8, 256, 256), "v4 k256+res256": (4, 256, 256)}
LAYER_KEYS = ("indices", "centroids", "res_centroids", "outlier_indices", "outlier_centroids", "perm",
              "weight_scale", "weight_bias")


def time_call(fn: Callable[[], object], budget_s: float, max_reps: int, warmup: int = 3) -> tuple[float, int]:
    """(median seconds per call, repetitions) after ``warmup`` calls, repeating until the budget is spent."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def speed_table(shapes: list[tuple[int, int]], configs: dict, tokens_list: list[int], budget: float) -> None:
    header = (f"| {'out x in':>11} | {'config':<15} | {'tokens':>6} | {'dense bf16 us':>13} | {'reference us':>12} | "
              f"{'fused cpu us':>12} | {'ref/dense':>9} | {'fused/dense':>11} | {'reps d/r/f':>10} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for out_f, in_f in shapes:
        for name, (v, k, kr) in configs.items():
            spec = VQSpec(in_f, out_f, v, k, num_res_centroids=kr)
            layer = random_vq_layer(spec, seed=0, dtype=torch.bfloat16, perm=True)
            dense = vq_dequantize(spec, **{key: layer[key] for key in LAYER_KEYS}).contiguous()
            big = out_f * in_f >= 16_000_000
            for tokens in tokens_list:
                x = torch.randn(tokens, in_f, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
                reps = 10 if big else 200
                d, nd = time_call(lambda: F.linear(x, dense), budget, reps)
                r, nr = time_call(lambda: vq_linear(x, spec, **layer, backend="reference"), budget, 5 if big else 50,
                                  warmup=1)
                f, nf = time_call(lambda: vq_linear(x, spec, **layer, backend="cpu"), budget, reps,
                                  warmup=1 if big and tokens > 1 else 3)
                print(f"| {out_f:>5}x{in_f:<5} | {name:<15} | {tokens:>6} | {fmt_us(d):>13} | {fmt_us(r):>12} | "
                      f"{fmt_us(f):>12} | {r / d:>9.2f} | {f / d:>11.2f} | {nd:>3}/{nr:>2}/{nf:>3} |", flush=True)
            del dense


def crossover_table(budget: float) -> None:
    out_f, in_f = 1536, 576
    print(f"\nCrossover (out x in = {out_f}x{in_f}, 2-bit v6 k4096, bf16): fused per-token GEMV vs dequantize + matmul")
    print(f"| {'tokens':>6} | {'fused cpu us':>12} | {'dequant+matmul us':>17} | {'fused/dequant':>13} |")
    print(f"|{'-' * 8}|{'-' * 14}|{'-' * 19}|{'-' * 15}|")
    spec = VQSpec(in_f, out_f, 6, 4096)
    layer = random_vq_layer(spec, seed=1, dtype=torch.bfloat16, perm=True)
    for tokens in (1, 2, 4, 8, 16, 32):
        x = torch.randn(tokens, in_f).to(torch.bfloat16)
        f, _ = time_call(lambda: vq_linear(x, spec, **layer, backend="cpu"), budget, 100)
        r, _ = time_call(lambda: vq_linear(x, spec, **layer, backend="reference"), budget, 50)
        print(f"| {tokens:>6} | {fmt_us(f):>12} | {fmt_us(r):>17} | {f / r:>13.2f} |", flush=True)


def decode_table(budget: float) -> None:
    """One SmolLM2-135M token's linears (30 blocks x q,k,v,o,gate,up,down) called back to back."""
    per_block = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    blocks = 30
    print(f"\nDecode simulation: {blocks} blocks x {len(per_block)} SmolLM2 linears per token, 1 token, bf16 "
          "(weights shared across blocks: a lower bound on memory traffic)")
    print(f"| {'weights':<15} | {'ms / token':>10} | {'linears tok/s':>13} | {'vs dense bf16':>13} |")
    print(f"|{'-' * 17}|{'-' * 12}|{'-' * 15}|{'-' * 15}|")
    dense_layers = [torch.randn(o, i).to(torch.bfloat16) for o, i in per_block]
    xs = {i: torch.randn(1, i).to(torch.bfloat16) for _, i in per_block}

    def run_dense() -> None:
        for _ in range(blocks):
            for w in dense_layers:
                F.linear(xs[w.shape[1]], w)

    base, _ = time_call(run_dense, budget * 4, 30)
    print(f"| {'dense bf16':<15} | {base * 1e3:>10.2f} | {1 / base:>13.1f} | {1.0:>13.2f} |", flush=True)
    for name, (v, k, kr) in dict(CONFIGS, **EXTRA_CONFIGS).items():
        layers = []
        for o, i in per_block:
            spec = VQSpec(i, o, v, k, num_res_centroids=kr)
            layers.append((spec, random_vq_layer(spec, seed=o + i, dtype=torch.bfloat16, perm=True)))

        def run_vq(layers: list = layers) -> None:
            for _ in range(blocks):
                for spec, layer in layers:
                    vq_linear(xs[spec.in_features], spec, **layer)

        with torch.no_grad():
            t, _ = time_call(run_vq, budget * 4, 30)
        print(f"| {name:<15} | {t * 1e3:>10.2f} | {1 / t:>13.1f} | {t / base:>13.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="torch (and fused kernel) threads; 0 = torch default")
    parser.add_argument("--quick", action="store_true", help="SmolLM2 shapes only, 1 token")
    parser.add_argument("--budget", type=float, default=0.25, help="seconds of timed calls per cell (min 3 calls)")
    parser.add_argument("--extra", action="store_true", help="also the residual configs (v8/v4 k256 + res256)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    usable, reason = available_backends()["cpu"]
    if not usable:
        raise SystemExit(reason)
    from kernels import cpu

    t0 = time.perf_counter()
    cpu.warm_up()
    compile_s = time.perf_counter() - t0
    shapes = SHAPES[:4] if args.quick else SHAPES
    tokens = [1] if args.quick else [1, 128]
    configs = dict(CONFIGS, **EXTRA_CONFIGS) if args.extra else CONFIGS
    print("Protocol: CPU, torch", torch.__version__, f"threads={torch.get_num_threads()}",
          f"(fused kernel threads={cpu.num_threads()})", "| x, codebooks and dense weight in bf16, fp32 accumulation",
          f"| warm-up 3 calls (1 for big multi-token cells), then median of repeated calls within {args.budget}s",
          "(>= 3 calls) | perm on, no residual/outliers unless stated",
          f"| numba kernels ready in {compile_s:.1f}s (compile or on-disk cache)")
    speed_table(shapes, configs, tokens, args.budget)
    decode_table(args.budget)
    if not args.quick:
        crossover_table(args.budget)


if __name__ == "__main__":
    main()
