"""Native C++ kernels (kernels/native.py) vs dense bf16, the torch reference and the numba kernels on CPU.

Usage: python bench/kernels_native.py [--threads N] [--quick] [--tokens 1,8,128] [--rounds R] [--isa avx2]

Random but valid layers (uniform indices, Gaussian codebooks, bf16 tensors, perm on), x in bf16. Per cell the
candidates (dense bf16 ``F.linear`` on the dequantized weight, ``kernels.reference``, numba ``kernels.cpu`` and
native) run round-robin: after 2 warm-up calls each, every round times a batch of calls of each candidate in turn
(so load from other processes hits them alike) and a cell reports the median of the rounds' per-call times.
Ratios are native / dense bf16 of the same cell (< 1 = native faster). numba runs fused up to 8 tokens and
dequantize + matmul (``fused=False``) above; its scalar-code kernel is a GEMV only, so it runs as one at every
token count.
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

from kernels import VQSpec, native, reference  # noqa: E402
from kernels.synthetic import random_scalar_layer, random_vq_layer  # noqa: E402

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 4096), (11008, 4096)]  # (out, in)
SMOL = SHAPES[:4]
CONFIGS = ("2-bit v6 k4096", "3-bit v4 k4096", "v8 k256+res256", "scalar 4-bit g128")


def vq_spec(config: str, out_f: int, in_f: int) -> VQSpec:
    if config == "2-bit v6 k4096":  # the default config: + 0.5% outlier columns (v4 k256)
        osz = max(1, round(in_f * 0.005))
        return VQSpec(in_f, out_f, 6, 4096, outlier_vector_len=4, num_outlier_centroids=256, outlier_size=osz)
    if config == "3-bit v4 k4096":
        return VQSpec(in_f, out_f, 4, 4096)
    if config == "v8 k256+res256":
        return VQSpec(in_f, out_f, 8, 256, num_res_centroids=256)
    raise ValueError(config)


def rounds_time(fns: list[Callable[[], object] | None], reps: list[int], rounds: int) -> list[float]:
    """Median seconds per call of each function (None -> nan), run round-robin."""
    for fn in fns:
        if fn is not None:
            fn()
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            if fn is None:
                continue
            t0 = time.perf_counter()
            for _ in range(reps[i]):
                fn()
            times[i].append((time.perf_counter() - t0) / reps[i])
    return [statistics.median(t) if t else float("nan") for t in times]


def fmt_us(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1e6:,.1f}"


def build(config: str, out_f: int, in_f: int):  # noqa: ANN201
    """(dense bf16 weight, reference fn(x), numba fn(x, tokens), native layer)."""
    from kernels import cpu

    if config.startswith("scalar"):
        spec, weights = random_scalar_layer(out_f, in_f, 4, 128, seed=0, dtype=torch.bfloat16)
        dense = reference.scalar_dequantize(spec, weights).contiguous()
        layer = native.prepare_scalar(weights.codes, weights.scales, weights.zeros, weights.bias, spec.bits,
                                      spec.group_size, spec.in_features)
        return (dense, lambda x: reference.scalar_linear(x, spec, weights),
                lambda x, n: cpu.scalar_linear(x, spec, weights), layer)
    spec = vq_spec(config, out_f, in_f)
    weights = random_vq_layer(spec, seed=0, dtype=torch.bfloat16, perm=True)
    dense = reference.vq_dequantize(spec, weights).contiguous()
    layer = native.prepare_vq(spec, *weights)
    return (dense, lambda x: reference.vq_linear(x, spec, weights),
            lambda x, n: cpu.vq_linear(x, spec, weights, fused=n <= 8), layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (native and numba follow); default 1")
    parser.add_argument("--quick", action="store_true", help="SmolLM2 shapes only")
    parser.add_argument("--tokens", default="1,8,128", help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per cell (median reported)")
    parser.add_argument("--isa", default="auto", help="native kernels: auto, avx512, avx2 or scalar")
    parser.add_argument("--configs", default="", help="comma-separated subset of: " + "; ".join(CONFIGS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    usable, reason = native.status()
    if not usable:
        raise SystemExit(reason)
    native.set_isa(args.isa)
    t0 = time.perf_counter()
    from kernels import cpu

    cpu.warm_up()
    numba_s = time.perf_counter() - t0
    tokens_list = [int(t) for t in args.tokens.split(",")]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()] or list(CONFIGS)
    shapes = SMOL if args.quick else SHAPES
    print(f"Protocol: CPU ({native.isa()} kernels, prefill via {native.set_prefill()}), torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}, "
          "x / weights / codebooks bf16 (fp32 accumulation in native and numba), perm on | per cell: 2 warm-up "
          f"calls each, then {args.rounds} rounds alternating dense -> reference -> numba -> native, each round a "
          "batch of calls per candidate; median of the rounds' per-call times | numba fused <= 8 tokens, "
          f"dequant+matmul above (scalar: GEMV always); numba ready in {numba_s:.1f}s\n")
    cols = ["out x in", "config", "tokens", "dense bf16 us", "reference us", "numba us", "native us",
            "native/dense", "numba/dense"]
    widths = [11, 18, 6, 13, 13, 11, 11, 12, 11]
    print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", flush=True)
    for out_f, in_f in shapes:
        for config in configs:
            dense, ref_fn, numba_fn, layer = build(config, out_f, in_f)
            run = native.scalar_linear if config.startswith("scalar") else native.vq_linear
            for n in tokens_list:
                x = torch.randn(n, in_f, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
                work = out_f * in_f * max(1.0, n / 8)
                fast_reps = max(1, int(2e7 / work))
                big = out_f * in_f >= 16_000_000
                ref_reps = 1 if big else max(1, fast_reps // 20)
                d, r, q, m = rounds_time(
                    [lambda: F.linear(x, dense), lambda: ref_fn(x), lambda: numba_fn(x, n), lambda: run(x, layer)],
                    [fast_reps, ref_reps, max(1, fast_reps // 2), fast_reps],
                    args.rounds if not big else max(3, args.rounds // 2),
                )
                cells = [f"{out_f}x{in_f}", config, str(n), fmt_us(d), fmt_us(r), fmt_us(q), fmt_us(m),
                         f"{m / d:.2f}", f"{q / d:.2f}"]
                print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) + " |", flush=True)


if __name__ == "__main__":
    main()
