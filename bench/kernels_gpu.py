"""GPU kernel speed: fused Triton lookup GEMV vs cuBLAS fp16 F.linear, and Triton dequantize + matmul for prefill.

Usage (needs an NVIDIA GPU): python bench/kernels_gpu.py [--reps 200]

Random but valid fp16 layers (2-bit v6 k4096, 3-bit v4 k4096, v8 k256 + residual 256; perm on). Both Triton
paths (fused lookup GEMV, dequantize + cuBLAS matmul) at 1, 8 and 128 tokens, which shows where
``kernels.ops.TRITON_FUSED_MAX_TOKENS`` should sit. Timing: CUDA events around each call after warm-up,
median over repetitions; ratios are against cuBLAS fp16 F.linear in the same run. Every Triton result is
checked against the torch reference before it is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vptq_core.kernels import VQSpec, VQWeights, vq_dequantize, vq_linear  # noqa: E402
from vptq_core.kernels.synthetic import random_vq_layer  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096)]  # (out, in)
CONFIGS = {"2-bit v6 k4096": (6, 4096, -1), "3-bit v4 k4096": (4, 4096, -1), "v8 k256+res256": (8, 256, 256)}


def cuda_time(fn: Callable[[], object], reps: int, warmup: int = 10) -> float:
    """Median milliseconds per call measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels_gpu.py needs a CUDA device: torch.cuda.is_available() is False")
    from vptq_core.kernels import triton_kernels

    device = torch.device("cuda")
    print(f"Protocol: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, fp16 activations and "
          f"codebooks, fp32 accumulation in the Triton kernels | warm-up 10 calls, median of {args.reps} "
          "CUDA-event timings | ratios vs cuBLAS fp16 F.linear in this run")
    print(f"| {'out x in':>11} | {'config':<15} | {'tokens':>6} | {'path':<22} | {'cuBLAS fp16 us':>14} | "
          f"{'triton us':>9} | {'triton/cuBLAS':>13} |")
    print(f"|{'-' * 13}|{'-' * 17}|{'-' * 8}|{'-' * 24}|{'-' * 16}|{'-' * 11}|{'-' * 15}|")
    for out_f, in_f in SHAPES:
        for name, (v, k, kr) in CONFIGS.items():
            spec = VQSpec(in_f, out_f, v, k, num_res_centroids=kr)
            layer = random_vq_layer(spec, seed=0, dtype=torch.float16, perm=True, device=device)
            dense = vq_dequantize(spec, layer).contiguous()
            for tokens, fused in ((1, True), (1, False), (8, True), (8, False), (128, True), (128, False)):
                path = "fused lookup GEMV" if fused else "dequantize + matmul"
                x = torch.randn(tokens, in_f, device=device, dtype=torch.float16)
                got = triton_kernels.vq_linear(x, spec, layer, fused=fused)
                expected = vq_linear(x.float(), spec, VQWeights(*[t.float() if t is not None and t.is_floating_point()
                                                                  else t for t in layer]),
                                     backend="reference")
                torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
                base = cuda_time(lambda: F.linear(x, dense), args.reps)
                ours = cuda_time(lambda: triton_kernels.vq_linear(x, spec, layer, fused=fused), args.reps)
                print(f"| {out_f:>5}x{in_f:<5} | {name:<15} | {tokens:>6} | {path:<22} | {base * 1e3:>14.1f} | "
                      f"{ours * 1e3:>9.1f} | {ours / base:>13.2f} |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
