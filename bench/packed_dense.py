"""Float32 linears: torch's own path (MKL sgemm) vs oneDNN with packed weights (``vptq_core.quant.packed_dense``).

Protocol: random float32 weights of each shape; per shape and row count, both paths warmed up, then ``--rounds``
alternated rounds of ``--calls`` calls each; the table gives the median ms per call and the ratio torch / packed.
The end-to-end effect on self-written calibration: ``bench/sampling.py``.

    python bench/packed_dense.py [--threads 2] [--rows 1 24 512] [--rounds 4] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.quant.device import cpu_flags  # noqa: E402
from vptq_core.quant.packed_dense import PackedLinear, available  # noqa: E402

# (name, out, in): SmolLM2-135M's block linears and LM head, Gemma-3-270M's LM head
SHAPES = [("SmolLM2 q/o", 576, 576), ("SmolLM2 k/v", 192, 576), ("SmolLM2 gate/up", 1536, 576),
          ("SmolLM2 down", 576, 1536), ("SmolLM2 LM head", 49152, 576), ("Gemma-3-270M LM head", 262144, 640)]


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def kernels(args) -> None:
    print("| linear (out x in) | rows | torch ms | packed ms | torch / packed |")
    print("|---|---|---|---|---|")
    for name, out_f, in_f in [s for s in SHAPES if not (args.quick and "LM head" in s[0])]:
        lin = nn.Linear(in_f, out_f, bias=False)
        calls = max(1, args.calls * 576 * 576 // (out_f * in_f))
        for rows in args.rows:
            if out_f * rows > 30_000_000:  # a [rows, vocab] product of 100+ MB: not what sampling multiplies
                continue
            x = torch.randn(rows, in_f)
            packed = PackedLinear(lin, rows)
            plain = lambda: F.linear(x, lin.weight)  # noqa: E731
            fast = lambda: packed(x)  # noqa: E731
            timed(plain, 1), timed(fast, 1)
            a, b = [], []
            for rnd in range(args.rounds):
                for fn, acc in ((plain, a), (fast, b)) if rnd % 2 == 0 else ((fast, b), (plain, a)):
                    acc.append(timed(fn, calls))
            ta, tb = statistics.median(a), statistics.median(b)
            print(f"| {name} ({out_f} x {in_f}) | {rows} | {ta:.3f} | {tb:.3f} | {ta / tb:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 24, 512])
    ap.add_argument("--calls", type=int, default=50, help="calls per round at 576 x 576 (fewer for bigger shapes)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="SmolLM2's block linears only (no LM heads)")
    args = ap.parse_args()
    if not available():
        sys.exit("oneDNN packed linears are unavailable in this torch build")
    torch.set_num_threads(args.threads)
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"# torch {torch.__version__}, {args.threads} threads, CPU flags: {', '.join(flags) or 'none known'}; "
          f"median of {args.rounds} alternated rounds\n")
    kernels(args)


if __name__ == "__main__":
    main()
