"""Nearest-centroid search speed: the backends of ``vptq_core.quant.kmeans.CodebookSearch`` on the (d, k) pairs VPTQ
uses, at the query counts of a sweep column (one column's vectors) and of a k-means iteration (the fitted sample),
and one whole layer's ``vptq_quantize`` with the automatic search against the k-d tree.

Usage: python bench/search.py [--threads 1] [--rounds 5] [--no-layer] [--cells D:K:QUERIES ...]
       [--layer-shapes OUTxIN ...]

Protocol: Gaussian centroids and queries (seeded), float32 CPU. Per cell every backend answers once (warm-up, and
its answer is checked against float64 brute force: "exact" counts the queries whose chosen centroid is at the
nearest distance to 1e-5), then ``--rounds`` rounds run the backends in turn, each round timing a batch of calls;
a cell reports the median per-call time. Ratios are against the k-d tree of the same cell. The layer table times
``vptq_quantize`` on a random [out, in] layer with a correlated Hessian, alternating the automatic search and the
forced k-d tree (``VPTQ_NEAREST``), median of the rounds, with the k-means / sweep split of the last round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vptq_core.kernels import native  # noqa: E402
from vptq_core.quant.config import VPTQConfig  # noqa: E402
from vptq_core.quant.kmeans import CodebookSearch  # noqa: E402
from vptq_core.quant.vptq import vptq_quantize  # noqa: E402

BACKENDS = ("native", "kdtree", "numba", "torch")
# (d, k, queries): a sweep column of SmolLM2's 576 / 1536 outputs (96-256 vectors), k-means' fitted sample
# (at most 64 per centroid), and the shapes where the tree takes over
CELLS = [(6, 4096, 256), (6, 4096, 65536), (4, 4096, 384), (4, 4096, 65536), (8, 256, 192), (8, 256, 16384),
         (2, 4096, 4096), (12, 4096, 256), (4, 16384, 4096), (6, 65536, 4096), (8, 65536, 4096)]
LAYERS = [(1536, 576), (576, 1536)]


def cell(text: str) -> tuple[int, int, int]:
    """``D:K:QUERIES`` -> (d, k, queries)."""
    try:
        d, k, n = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"cell must be D:K:QUERIES (three integers), got {text!r}") from None
    return d, k, n


def layer_shape(text: str) -> tuple[int, int]:
    """``OUTxIN`` -> (out, in)."""
    try:
        out_f, in_f = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layer shape must be OUTxIN (two integers), got {text!r}") from None
    return out_f, in_f


def time_calls(fns: dict[str, object], reps: dict[str, int], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            times[name].append((time.perf_counter() - t0) / reps[name])
    return {name: statistics.median(t) for name, t in times.items()}


def search_table(rounds: int, cells: list[tuple[int, int, int]]) -> None:
    cols = ["d", "k", "queries"] + [f"{b} ms" for b in BACKENDS] + ["native/kdtree", "auto picks", "exact"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for d, k, n in cells:
        gen = torch.Generator().manual_seed(d * 100003 + k)
        C, X = torch.randn(k, d, generator=gen), torch.randn(n, d, generator=gen)
        exact = torch.cdist(X.double(), C.double()).min(dim=1).values
        fns, reps, ok = {}, {}, []
        for b in BACKENDS:
            if b == "torch" and n * k > 1 << 26:
                continue  # minutes per call
            search = CodebookSearch(C, backend=b)
            idx = search(X)
            chosen = (X.double() - C.double()[idx]).norm(dim=1)
            ok.append(int(torch.isclose(chosen, exact, rtol=1e-5, atol=1e-6).sum()))
            fns[b] = lambda s=search: s(X)
            reps[b] = max(1, int(2e6 / (n * k * d) * 50))
        t = time_calls(fns, reps, rounds)
        cells = [str(d), str(k), str(n)] + [f"{t[b] * 1e3:.2f}" if b in t else "-" for b in BACKENDS]
        cells += [f"{t['native'] / t['kdtree']:.2f}", CodebookSearch(C).backend, f"{min(ok)}/{n}"]
        print("| " + " | ".join(cells) + " |", flush=True)


def layer_table(rounds: int, layers: list[tuple[int, int]]) -> None:
    config = VPTQConfig(vector_len=6, num_centroids=4096, num_res_centroids=0)
    print("\n| layer | config | auto s | k-d tree s | auto/tree | auto k-means / sweep s | tree k-means / sweep s |")
    print("|---|---|---|---|---|---|---|")
    for out_f, in_f in layers:
        gen = torch.Generator().manual_seed(out_f + in_f)
        X = torch.randn(4096, in_f, generator=gen) @ (torch.eye(in_f) + 0.1 * torch.randn(in_f, in_f, generator=gen))
        H = X.T @ X / X.shape[0]
        W = torch.randn(out_f, in_f, generator=gen) * 0.05
        walls: dict[str, list[float]] = {"auto": [], "kdtree": []}
        split: dict[str, dict] = {}
        for _ in range(rounds):
            for mode in walls:
                if mode == "kdtree":
                    os.environ["VPTQ_NEAREST"] = "kdtree"
                try:
                    t0 = time.perf_counter()
                    result = vptq_quantize(W, H, config)
                    walls[mode].append(time.perf_counter() - t0)
                finally:
                    os.environ.pop("VPTQ_NEAREST", None)
                split[mode] = result.timings
        a, b = statistics.median(walls["auto"]), statistics.median(walls["kdtree"])
        print(f"| {out_f}x{in_f} | v6 k4096 | {a:.2f} | {b:.2f} | {a / b:.2f} | "
              f"{split['auto']['kmeans']:.2f} / {split['auto']['sweep']:.2f} | "
              f"{split['kdtree']['kmeans']:.2f} / {split['kdtree']['sweep']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the native search follows)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-layer", action="store_true", help="skip the whole-layer table")
    parser.add_argument("--layer-shapes", type=layer_shape, nargs="+", default=LAYERS,
                        help="OUTxIN layers of the whole-layer table (default: "
                        + " ".join(f"{o}x{i}" for o, i in LAYERS) + ")")
    parser.add_argument("--cells", type=cell, nargs="+", default=CELLS,
                        help="(d, k, queries) cells D:K:QUERIES of the search table (default: the built-in ones)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    usable, reason = native.status()
    if not usable:
        raise SystemExit(reason)
    print(f"Protocol: CPU ({native.isa()} kernels), torch {torch.__version__}, threads={torch.get_num_threads()} "
          f"(the k-d tree queries with as many workers), float32, Gaussian data | per cell: one checked call per "
          f"backend, then {args.rounds} rounds in turn, median per-call time\n")
    search_table(args.rounds, args.cells)
    if not args.no_layer:
        layer_table(max(3, args.rounds // 2), args.layer_shapes)


if __name__ == "__main__":
    main()
