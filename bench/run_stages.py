"""Stage times of a whole run against the plan's estimate: where a preset's seconds go on this machine.

A random-weight model of one of bench/scaling.py's shapes (``--layers`` of its blocks, its real vocabulary) goes
through ``quantize_model`` with a preset (default VPTQ "2.5 bits": self-written calibration, the sensitivity plan,
the blocks, distillation) with its time budget off and ``--distill-steps`` steps, so that every stage runs in full.
Each stage's wall seconds come from the run's progress events (from one stage's start to the next one's); the
estimate is the plan's for the same model and settings (``run_plan.plan_run``) on the reference machine, and with
the device speed the probe measured just before the run (``run_plan.measure_speed``). The table prints both and
their ratio; ``--json`` appends the raw row. The full-depth line prices the whole model (all its blocks) with the
plan as the command line would, at the measured speed and the preset's own time budget.

    python bench/run_stages.py --shape smollm2 --layers 4
    python bench/run_stages.py --shape qwen05b --layers 2 --json bench/results/run_stages.jsonl
    python bench/run_stages.py --shape qwen05b --plan-only --speed 0.5   # what a run would choose, full depth
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB = {"smollm2": 49152, "qwen05b": 151936, "tiny": 256}


def full_size(shape: str, samples: int, seqlen: int):
    """The ``RunSize`` of the shape at its full depth (block linears, embedding, norms; tied head)."""
    from scaling import SHAPES

    from vptq_core.quant.cost import RunSize

    s = SHAPES[shape]
    hidden, inter, kv = s["hidden"], s["intermediate"], s["hidden"] // s["heads"] * s["kv_heads"]
    block = ((hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
             (hidden, inter))
    other = VOCAB[shape] * hidden + (2 * s["layers"] + 1) * hidden
    return RunSize(block * s["layers"], other, samples, seqlen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", choices=list(VOCAB))
    parser.add_argument("--layers", type=int, default=2, help="blocks of the shape built and quantized")
    parser.add_argument("--method", default="vptq")
    parser.add_argument("--preset", default="2.5 bits")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--distill-steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", help="append the raw row to this JSON-lines file")
    parser.add_argument("--plan-only", action="store_true", help="print the full-depth plan's lines and stop")
    parser.add_argument("--speed", type=float, help="the device speed the plan assumes (default: the probe's)")
    parser.add_argument("--writing-speed", type=float,
                        help="with --plan-only: the self-written calibration's own speed (a run measures it on the "
                             "model, run_plan.measure_writing_speed; default: priced by --speed)")
    parser.add_argument("--block-speed", type=float,
                        help="with --plan-only: the method's own block work's speed (block 0 timed before a run, "
                             "block_pace.measure_block_speed; default: priced by --speed)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from scaling import build_model

    from vptq_core.quant import methods
    from vptq_core.quant.blocks import lookup_params, total_linear_shapes
    from vptq_core.quant.cost import RunSize
    from vptq_core.quant.pipeline import quantize_model
    from vptq_core.quant.run_plan import measure_speed, plan_run

    method = methods.get(args.method)
    preset = method.make_config(method.preset(args.preset))
    if args.plan_only:
        speed = args.speed or measure_speed("cpu")
        size = full_size(args.shape, args.samples, args.seqlen)
        for line in plan_run(method, size, preset, speed, args.writing_speed, args.block_speed).lines():
            print(f"plan: {line}")
        return
    steps = min(args.distill_steps, preset.distill_iters) if preset.distill_iters else 0
    config = dataclasses.replace(preset, time_budget=0.0, distill_iters=steps)
    model = build_model(args.shape, args.layers, VOCAB[args.shape], 0)
    shapes = tuple(total_linear_shapes(model))
    linear = sum(o * i for o, i in shapes)
    size = RunSize(shapes, sum(p.numel() for p in model.parameters()) - linear, args.samples, args.seqlen,
                   lookup_params=lookup_params(model))
    calib = torch.randint(0, VOCAB[args.shape], (args.samples, args.seqlen), generator=torch.Generator().manual_seed(1))
    speed = args.speed or measure_speed("cpu")
    plan = plan_run(method, size, config, speed)
    load = os.getloadavg()[0]
    marks: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    _, result = quantize_model(model, calib, method, config, device="cpu", on_stage=lambda s: marks.append(
        (s, time.perf_counter())))
    end = time.perf_counter()
    measured = {name: (marks[i + 1][1] if i + 1 < len(marks) else end) - at for i, (name, at) in enumerate(marks)}
    speed_after = measure_speed("cpu")
    full = plan_run(method, full_size(args.shape, args.samples, args.seqlen), preset, speed)
    row = {"shape": args.shape, "layers": args.layers, "preset": args.preset, "distill_steps": steps,
           "samples": args.samples, "seqlen": args.seqlen, "threads": args.threads, "load_avg": round(load, 1),
           "speed_before": round(speed, 3), "speed_after": round(speed_after, 3), "seconds": round(end - t0, 1),
           "measured": {k: round(v, 1) for k, v in measured.items()},
           "estimated": {k: round(v, 1) for k, v in plan.stages.items() if k in measured},
           "estimated_reference": {k: round(v * speed, 1) for k, v in plan.stages.items() if k in measured},
           "timings": {k: round(v, 1) for k, v in result.timings.items()},
           "full_depth_plan": full.to_dict()}
    print(f"protocol: {args.method} preset {args.preset!r} with {steps} distillation steps and no time budget, "
          f"{args.shape} shape with {args.layers} blocks (vocabulary {VOCAB[args.shape]}), random weights, "
          f"{args.samples} x {args.seqlen} random calibration tokens, {args.threads} torch threads, no warm-up run, "
          f"load average {load:.1f} at start; probe speed {speed:.2f}x before, {speed_after:.2f}x after")
    print()
    print("| stage | measured s | estimated s (reference) | estimated s (at probe speed) | measured / estimated |")
    print("|---|---|---|---|---|")
    for name, seconds in measured.items():
        est = plan.stages.get(name)
        cells = (f"{est * speed:.1f} | {est:.1f} | {seconds / est:.2f}" if est else "- | - | -")
        print(f"| {name} | {seconds:.1f} | {cells} |")
    print(f"| whole | {end - t0:.1f} | {sum(plan.stages[k] for k in measured if k in plan.stages) * speed:.1f} | "
          f"{sum(plan.stages[k] for k in measured if k in plan.stages):.1f} | |")
    print()
    print("phases (QuantizeResult.timings): " + ", ".join(f"{k} {v:.1f}" for k, v in result.timings.items()))
    print(f"full depth ({len(full_size(args.shape, 1, 1).linear_shapes) // 7} blocks), preset as is, at "
          f"{speed:.2f}x: " + "; ".join(full.lines()))
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
