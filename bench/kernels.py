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
    return "-" if seconds != seconds else f"{seconds * 1e6:,.0f}"


def speed_table(shapes: list[tuple[int, int]], configs: dict, tokens_list: list[int], budget: float) -> None:
    from kernels import cpu

    cols = ["out x in", "config", "tokens", "dense bf16 us", "reference us", "cpu fused us", "cpu dq+mm us",
            "ref/dense", "fused/dense", "dq+mm/dense"]
    widths = [11, 15, 6, 13, 12, 12, 12, 9, 11, 11]
    print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for out_f, in_f in shapes:
        for name, (v, k, kr) in configs.items():
            spec = VQSpec(in_f, out_f, v, k, num_res_centroids=kr)
            layer = random_vq_layer(spec, seed=0, dtype=torch.bfloat16, perm=True)
            dense = vq_dequantize(spec, layer).contiguous()
            big = out_f * in_f >= 16_000_000
            for tokens in tokens_list:
                x = torch.randn(tokens, in_f, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
                reps = 10 if big else 200
                d = time_call(lambda: F.linear(x, dense), budget, reps)[0]
                r = time_call(lambda: vq_linear(x, spec, layer, backend="reference"), budget, 3 if big else 50,
                              warmup=1)[0]
                f = float("nan")
                if tokens == 1 or not big:  # 128 GEMVs of a big layer would take seconds per call
                    f = time_call(lambda: cpu.vq_linear(x, spec, layer, fused=True), budget, reps, warmup=2)[0]
                q = time_call(lambda: cpu.vq_linear(x, spec, layer, fused=False), budget, 5 if big else reps,
                              warmup=1 if big else 2)[0]
                cells = [f"{out_f}x{in_f}", name, str(tokens), fmt_us(d), fmt_us(r), fmt_us(f), fmt_us(q),
                         f"{r / d:.2f}", f"{f / d:.2f}", f"{q / d:.2f}"]
                print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) + " |", flush=True)


def crossover_table(budget: float) -> None:
    from kernels import cpu

    out_f, in_f = 1536, 576
    print(f"\nCrossover (out x in = {out_f}x{in_f}, 2-bit v6 k4096, bf16): cpu fused GEMV vs cpu dequantize + "
          "matmul")
    print(f"| {'tokens':>6} | {'fused us':>9} | {'dq+mm us':>9} | {'fused/dq+mm':>11} |")
    print(f"|{'-' * 8}|{'-' * 11}|{'-' * 11}|{'-' * 13}|")
    spec = VQSpec(in_f, out_f, 6, 4096)
    layer = random_vq_layer(spec, seed=1, dtype=torch.bfloat16, perm=True)
    for tokens in (1, 2, 4, 8, 16, 32):
        x = torch.randn(tokens, in_f).to(torch.bfloat16)
        f = time_call(lambda: cpu.vq_linear(x, spec, layer, fused=True), budget, 100)[0]
        q = time_call(lambda: cpu.vq_linear(x, spec, layer, fused=False), budget, 100)[0]
        print(f"| {tokens:>6} | {fmt_us(f):>9} | {fmt_us(q):>9} | {f / q:>11.2f} |", flush=True)


def decode_table(budget: float) -> None:
    """One SmolLM2-135M token's linears (30 blocks x q,k,v,o,gate,up,down, distinct weights) back to back."""
    per_block = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    blocks = 30
    print(f"\nDecode simulation: {blocks} blocks x {len(per_block)} SmolLM2 linears (distinct weights), 1 token, "
          "bf16, public vq_linear (auto backend) vs F.linear")
    print(f"| {'weights':<15} | {'ms / token':>10} | {'linears-only tok/s':>18} | {'vs dense bf16':>13} |")
    print(f"|{'-' * 17}|{'-' * 12}|{'-' * 20}|{'-' * 15}|")
    gen = torch.Generator().manual_seed(0)
    dense_layers = [torch.randn(o, i, generator=gen).to(torch.bfloat16) for _ in range(blocks) for o, i in per_block]
    xs = {i: torch.randn(1, i, generator=gen).to(torch.bfloat16) for _, i in per_block}

    def run_dense(dense_layers: list = dense_layers) -> None:
        for w in dense_layers:
            F.linear(xs[w.shape[1]], w)

    base = time_call(run_dense, budget * 4, 30)[0]
    print(f"| {'dense bf16':<15} | {base * 1e3:>10.2f} | {1 / base:>18.1f} | {1.0:>13.2f} |", flush=True)
    dense_layers.clear()
    for name, (v, k, kr) in dict(CONFIGS, **EXTRA_CONFIGS).items():
        layers = []
        for b in range(blocks):
            for o, i in per_block:
                spec = VQSpec(i, o, v, k, num_res_centroids=kr)
                layers.append((spec, random_vq_layer(spec, seed=b * 10 + o + i, dtype=torch.bfloat16, perm=True)))

        def run_vq(layers: list = layers) -> None:
            for spec, layer in layers:
                vq_linear(xs[spec.in_features], spec, layer)

        with torch.no_grad():
            t = time_call(run_vq, budget * 4, 30)[0]
        print(f"| {name:<15} | {t * 1e3:>10.2f} | {1 / t:>18.1f} | {t / base:>13.2f} |", flush=True)


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
