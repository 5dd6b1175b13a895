"""Quantization cost against model size: seconds per million block weights, per phase.

Two random-weight shapes go through ``quantize_model`` with the same method settings and the same
calibration size (VPTQ with the CLI defaults: v6 k4096 + 0.5% outliers, 5 k-means iterations; 32 windows x
512 tokens), and the per-phase wall time (``QuantizeResult.timings``) is divided by the number of quantized
weights:

    smollm2   SmolLM2-135M's shape: hidden 576, intermediate 1536, 9 heads / 3 KV heads (30 layers)
    qwen05b   a 0.5B-class qwen2 shape: hidden 896, intermediate 4864, 14 heads / 2 KV heads (24 layers)

Every block of a shape costs the same, so ``--layers N`` (default 4) quantizes only N blocks of each and
the per-weight figures hold for the full depth (the full-depth time is extrapolated and marked so). The
vocabulary is small (only block linears are quantized). Each measurement runs in its own subprocess;
``--before DIR`` also runs the same measurements against another source tree (e.g. ``git archive HEAD |
tar -x -C DIR``), alternating trees so both see the same machine load, and prints both tables and the ratio.

    python bench/scaling.py                                  # this tree, 4 blocks per shape
    python bench/scaling.py --before /tmp/before --layers 2  # before/after in one run
    python bench/scaling.py --method rtn --samples 8 --seqlen 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {
    "smollm2": dict(family="llama", hidden=576, intermediate=1536, heads=9, kv_heads=3, layers=30),
    "qwen05b": dict(family="qwen2", hidden=896, intermediate=4864, heads=14, kv_heads=2, layers=24),
    # tiny-random-llama's shape: checks that the script runs (not a cost figure); not in the default --shapes
    "tiny": dict(family="llama", hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2),
}
PHASES = ("capture_inputs", "hessians_targets", "kmeans", "inverse_hessian", "sweep", "quantize", "block_outputs")


def build_model(shape: str, layers: int, vocab: int, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    s = SHAPES[shape]
    kwargs = dict(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], num_hidden_layers=layers,
                  max_position_embeddings=4096)
    config = (LlamaConfig(tie_word_embeddings=True, **kwargs) if s["family"] == "llama"
              else Qwen2Config(tie_word_embeddings=True, **kwargs))
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def worker(args) -> None:
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch

    torch.set_num_threads(args.threads)
    from vptq_core.quant import methods
    from vptq_core.quant.blocks import block_linears, decoder_blocks
    from vptq_core.quant.pipeline import quantize_model

    model = build_model(args.shape, args.layers, args.vocab, args.seed)
    weights = sum(m.weight.numel() for b in decoder_blocks(model) for m in block_linears(b).values())
    calib = torch.randint(0, args.vocab, (args.samples, args.seqlen), generator=torch.Generator().manual_seed(1))
    config = methods.make_config(args.method, json.loads(args.settings))
    t0 = time.perf_counter()
    _, result = quantize_model(model, calib, args.method, config, device="cpu", inplace=True)
    wall = time.perf_counter() - t0
    losses = [r.rel_proxy_loss for r in result.reports]
    print(json.dumps({
        "shape": args.shape, "tree": args.tree, "layers": args.layers, "weights": weights, "seconds": wall,
        "timings": dict(result.timings), "mean_rel_proxy_loss": sum(losses) / len(losses),
        "rel_output_error_last": result.reports[-1].rel_output_error,
    }))


def run_one(tree: str, shape: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", tree, "--shape", shape,
           "--layers", str(args.layers), "--samples", str(args.samples), "--seqlen", str(args.seqlen),
           "--method", args.method, "--settings", args.settings, "--threads", str(args.threads),
           "--vocab", str(args.vocab), "--seed", str(args.seed)]
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({tree}, {shape}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def per_mw(row: dict, phase: str | None = None) -> float:
    value = row["seconds"] if phase is None else row["timings"].get(phase, 0.0)
    return value / (row["weights"] / 1e6)


def table(rows: list[dict], title: str) -> str:
    phases = [p for p in PHASES if any(p in r["timings"] for r in rows)]
    lines = [f"{title}", "",
             "| shape | blocks | block weights | " + " | ".join(phases) + " | total s | s / M weights "
             "| full depth (extrapolated) |",
             "|---|---|---|" + "---|" * len(phases) + "---|---|---|"]
    for r in rows:
        full = SHAPES[r["shape"]]["layers"]
        cells = [f"{r['timings'].get(p, 0.0):.1f} ({per_mw(r, p):.3f})" for p in phases]
        lines.append(f"| {r['shape']} | {r['layers']} | {r['weights'] / 1e6:.2f} M | " + " | ".join(cells)
                     + f" | {r['seconds']:.1f} | {per_mw(r):.3f} | {r['seconds'] * full / r['layers']:.0f} s "
                     f"({full} blocks) |")
    by = {r["shape"]: r for r in rows}
    if {"smollm2", "qwen05b"} <= set(by):
        ratio = per_mw(by["qwen05b"]) / per_mw(by["smollm2"])
        lines += ["", f"s / M weights, qwen05b / smollm2: **{ratio:.2f}x** (phase cells: seconds (s / M weights))"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="blocks quantized per shape")
    parser.add_argument("--samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per window")
    parser.add_argument("--method", default="vptq")
    parser.add_argument("--settings", default="{}", help="method settings as JSON (default: the CLI defaults)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "qwen05b"], choices=list(SHAPES))
    parser.add_argument("--before", help="another source tree to measure too (the code before a change)")
    parser.add_argument("--json", help="append the raw rows to this JSON-lines file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=str(ROOT), help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    trees = ([("before", args.before)] if args.before else []) + [("after" if args.before else "this tree", str(ROOT))]
    print(f"protocol: {args.method} {args.settings}, calibration {args.samples} x {args.seqlen} random tokens, "
          f"{args.layers} blocks per shape, {args.threads} torch threads, vocab {args.vocab}, one subprocess per "
          f"row, trees alternated; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for shape in args.shapes:
        for label, tree in trees:
            row = run_one(tree, shape, args)
            row["label"] = label
            results[label].append(row)
            print(f"  {label:9s} {shape:8s} {row['seconds']:7.1f} s  {per_mw(row):.3f} s/M weights  "
                  f"mean rel. proxy loss {row['mean_rel_proxy_loss']:.5f}", flush=True)
            if args.json:
                with open(args.json, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"load average at end {os.getloadavg()[0]:.1f}\n")
    for label, rows in results.items():
        print(table(rows, f"### {label}"))
        print()
    if args.before:
        for b, a in zip(results["before"], results[trees[-1][0]], strict=True):
            print(f"{a['shape']}: after / before = {a['seconds'] / b['seconds']:.2f} (total); per phase: "
                  + ", ".join(f"{p} {a['timings'].get(p, 0) / max(b['timings'].get(p, 0), 1e-9):.2f}"
                              for p in PHASES if p in b["timings"]))


if __name__ == "__main__":
    main()
