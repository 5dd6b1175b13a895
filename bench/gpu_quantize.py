"""Quantize SmolLM2 end to end on CUDA (every phase on the GPU) and print the time per phase.

Protocol: one ``api.quantize_to_dir`` run per row on ``--device`` (default cuda), the CLI defaults of the
method (VPTQ: v6 k4096 + 0.5% outliers, 5 k-means iterations, the torch nearest-centroid search on CUDA),
32 x 512 calibration tokens of the bundled wiki text; wall time of the whole call (model load, calibration,
quantization, checkpoint write) and ``summary["timings"]`` per phase; peak GPU memory from
``torch.cuda.max_memory_allocated``; then perplexity of the checkpoint on 16 held-out windows.
``--compare-cpu N`` also quantizes the first N blocks on the CPU and on the GPU and prints the largest
relative difference of the per-layer proxy losses (same results up to float tolerance).

    python bench/gpu_quantize.py                                  # VPTQ defaults, SmolLM2, CUDA
    python bench/gpu_quantize.py --method gptq --settings '{"bits": 4, "group_size": 128}'
    python bench/gpu_quantize.py --model DIR_OR_GGUF --quantize-head --quantize-embedding
    python bench/gpu_quantize.py --compare-cpu 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(args, device: str, out: Path) -> dict:
    import torch

    from vptq_core.api import evaluate_model, quantize_to_dir
    from vptq_core.quant import methods
    from vptq_core.quant.config import CalibConfig

    config = methods.make_config(args.method, json.loads(args.settings))
    calib = CalibConfig(text="wiki", samples=args.samples, seqlen=args.seqlen, seed=0)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    _, summary = quantize_to_dir(args.model, args.method, config, calib, out, device=device,
                                 head=args.quantize_head, embedding=args.quantize_embedding)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    row = {"device": device, "wall_s": wall, "pipeline_s": summary["seconds"], "timings": summary["timings"],
           "peak_gpu_bytes": peak, "bits": summary.get("total_bits_per_weight")}
    if args.eval_windows:
        ev = evaluate_model(str(out), reference=args.model, seqlen=512, max_windows=args.eval_windows)
        row["eval"] = ev.to_dict()
    return row


def compare(args, blocks: int) -> float:
    """Largest relative difference of per-layer proxy losses, CPU vs CUDA, over the first ``blocks`` blocks."""
    import torch

    from vptq_core.data import calibration_windows
    from vptq_core.models import load_model
    from vptq_core.quant import methods
    from vptq_core.quant.pipeline import quantize_model

    config = methods.make_config(args.method, json.loads(args.settings))
    model, tok = load_model(args.model, dtype=torch.float32)
    ids = calibration_windows(tok, "wiki", args.samples, args.seqlen, 0)
    losses = {}
    for device in ("cpu", "cuda"):
        seen = []

        def on_layer(report, seen=seen):
            seen.append(report.rel_proxy_loss)

        def stop(seen=seen):
            return len(seen) >= blocks * 7

        quantize_model(model, ids, args.method, config, on_layer=on_layer, should_stop=stop, device=device)
        losses[device] = seen[: blocks * 7]
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["cpu"], losses["cuda"], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--method", default="vptq")
    parser.add_argument("--settings", default="{}", help="method settings, JSON (default: the CLI defaults)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows to evaluate (0: none)")
    parser.add_argument("--quantize-head", action="store_true")
    parser.add_argument("--quantize-embedding", action="store_true")
    parser.add_argument("--compare-cpu", type=int, default=0, metavar="BLOCKS")
    parser.add_argument("--out", help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args()

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: GPU figures need a GPU (use --device cpu to try the script)")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else os.uname().machine
    print(f"protocol: {args.model}, {args.method} {args.settings}, calibration {args.samples} x {args.seqlen} "
          f"tokens, device {args.device} ({name}), torch {torch.__version__}; wall = the whole quantize_to_dir "
          "call; phases from summary['timings']", flush=True)
    out = Path(args.out or tempfile.mkdtemp(prefix="vptq-gpu-"))
    row = run(args, args.device, out)
    print(f"\nwall {row['wall_s']:.1f} s, pipeline {row['pipeline_s']:.1f} s, total bits/weight {row['bits']}, "
          f"peak GPU memory {(row['peak_gpu_bytes'] or 0) / 2**30:.2f} GiB")
    print("| phase | seconds | share |\n|---|---|---|")
    total = sum(row["timings"].values()) or 1.0
    for phase, seconds in sorted(row["timings"].items(), key=lambda kv: -kv[1]):
        print(f"| {phase} | {seconds:.1f} | {seconds / total:.0%} |")
    if "eval" in row:
        ev = row["eval"]
        print(f"\nperplexity {ev.get('perplexity'):.2f} (original {ev.get('reference_perplexity')}), KL "
              f"{ev.get('kl_divergence')}, top-1 {ev.get('top1_agreement')}")
    if args.compare_cpu:
        print(f"\nCPU vs {args.device}, first {args.compare_cpu} blocks: largest relative difference of the "
              f"per-layer proxy losses {compare(args, args.compare_cpu):.2e}")
    print(json.dumps(row, default=str))


if __name__ == "__main__":
    main()
