"""CPU kernel speed: dense bf16 ``F.linear`` vs the torch reference, the numba kernels and the native C++ kernels
(kernels/native.py), and what a quantized module spends in Python per call.

Usage: python bench/kernels.py [--threads N] [--quick] [--tokens 1,8,128] [--rounds R] [--isa avx2] [--no-overhead]

Random but valid layers (uniform indices, Gaussian codebooks, bf16 tensors, perm on), x in bf16. Per cell the
candidates (dense bf16 ``F.linear`` on the dequantized weight, ``kernels.reference``, numba ``kernels.cpu`` and
native) run round-robin: after 2 warm-up calls each, every round times a batch of calls of each candidate in turn
(so load from other processes hits them alike) and a cell reports the median of the rounds' per-call times.
Ratios are native / dense bf16 of the same cell (< 1 = native faster). numba runs fused up to 8 tokens and
dequantize + matmul (``fused=False``) above; its scalar-code kernel is a GEMV only, so it runs as one at every
token count.

The second table (per-call overhead, 1 token, x [1, 1, in] as in decode) times the same layer through each
layer of Python above the C++ call: the native layer object itself, the bound ``kernels.LayerKernel``, the
``VQLinear`` / ``ScalarQLinear`` module under ``torch.inference_mode`` (what a model's forward runs), and the
checked public ``kernels.vq_linear`` / ``scalar_linear``; dense bf16 ``nn.Linear`` for comparison. Same round-robin
protocol.
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

from vptq_core.kernels import VQSpec, native, reference  # noqa: E402
from vptq_core.kernels.synthetic import random_scalar_layer, random_vq_layer  # noqa: E402

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
    from vptq_core.kernels import cpu

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
    parser.add_argument("--no-overhead", action="store_true", help="skip the per-call overhead table")
    parser.add_argument("--shapes", default="", help="comma-separated OUTxIN subset of the shapes, e.g. 4096x4096")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    usable, reason = native.status()
    if not usable:
        raise SystemExit(reason)
    native.set_isa(args.isa)
    t0 = time.perf_counter()
    from vptq_core.kernels import cpu

    cpu.warm_up()
    numba_s = time.perf_counter() - t0
    tokens_list = [int(t) for t in args.tokens.split(",")]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()] or list(CONFIGS)
    shapes = SMOL if args.quick else SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(d) for d in item.lower().split("x")) for item in args.shapes.split(",")]
        except ValueError:
            parser.error(f"--shapes must be OUTxIN[,OUTxIN...], got {args.shapes!r}")
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
    if not args.no_overhead:
        overhead_table(SMOL, args.rounds)


def overhead_table(shapes: list[tuple[int, int]], rounds: int) -> None:
    from torch import nn

    from vptq_core.kernels import bind_scalar, bind_vq, scalar_linear, vq_linear
    from vptq_core.storage.modules import ScalarQLinear, VQLinear

    print("\nPer-call overhead at 1 token (us per call; x [1, 1, in] bf16; module = forward under "
          "torch.inference_mode; overhead = module - C++ call):\n")
    cols = ["out x in", "layer", "nn.Linear bf16", "C++ call", "LayerKernel", "module", "public call",
            "overhead", "module/dense"]
    widths = [11, 20, 14, 9, 11, 9, 11, 9, 12]
    print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", flush=True)
    for out_f, in_f in shapes:
        for kind in ("2-bit v6 k4096", "scalar 4-bit g128", "scalar 4-bit g128 a8"):
            if kind.startswith("scalar"):
                spec, weights = random_scalar_layer(out_f, in_f, 4, 128, seed=0, dtype=torch.bfloat16)
                act = 8 if kind.endswith("a8") else 16
                module = ScalarQLinear(in_f, out_f, 4, 128, act_bits=act, dtype=torch.bfloat16)
                module.load_state_dict({"codes": weights.codes, "scales": weights.scales, "zeros": weights.zeros})
                kernel = bind_scalar(spec, weights)
                public = lambda x, spec=spec, weights=weights: scalar_linear(x, spec, weights)  # noqa: E731
                dense_w = reference.scalar_dequantize(spec, weights)
            else:
                spec = vq_spec(kind, out_f, in_f)
                weights = random_vq_layer(spec, seed=0, dtype=torch.bfloat16, perm=True)
                module = VQLinear.from_config(spec.layer_config(bias=False, enable_perm=True), dtype=torch.bfloat16)
                module.load_state_dict({"indices": weights.indices, "centroids.weight": weights.centroids,
                                        "perm": weights.perm, "outlier_indices": weights.outlier_indices,
                                        "outlier_centroids.weight": weights.outlier_centroids})
                kernel = bind_vq(spec, weights)
                public = lambda x, spec=spec, weights=weights: vq_linear(x, spec, weights)  # noqa: E731
                dense_w = reference.vq_dequantize(spec, weights)
            linear = nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
            linear.weight.data.copy_(dense_w)
            layer = kernel.layer  # the native layer object behind the bound kernel
            x = torch.randn(1, 1, in_f, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            reps = max(20, int(2e7 / (out_f * in_f)))
            with torch.inference_mode():
                module(x)
                if kernel.backend != "native":
                    raise SystemExit(f"bound backend is {kernel.backend}, not native")
                d, c, k, m, p = rounds_time([lambda: linear(x), lambda: layer(x), lambda: kernel(x),
                                             lambda: module(x), lambda: public(x)], [reps] * 5, rounds)
            cells = [f"{out_f}x{in_f}", kind, fmt_us(d), fmt_us(c), fmt_us(k), fmt_us(m), fmt_us(p),
                     fmt_us(m - c), f"{m / d:.2f}"]
            print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) + " |", flush=True)


if __name__ == "__main__":
    main()
