"""What the whole-model passes of a run cost per model, against the run plan's prices (``vptq_core.quant.cost``).

The passes a run makes over the whole model (the teacher's top-k, a distillation step, writing windows) are priced
per model parameter; models of the same size but another shape (a 262k vocabulary, wider matrices) can cost far
more or less per parameter. This measures them on each model given and prints them beside the price.

Protocol, per model (``--models``: built-in names or model directories; loaded as a run loads the original,
``dtype="auto"``): one warm-up of each pass, then
- teacher: ``teacher.teacher_topk`` (top-64) on ``--windows`` calibration windows of ``--seqlen`` tokens, seconds
  per window;
- step: ``distill`` with the "2.5 bits" preset's distillation settings (batch 1, top-64, checkpointing "auto")
  on a student whose block linears are random VPTQ layers of that preset's shapes (``distill_step.student_of``),
  ``--steps`` timed steps after one, no held-out check between; the median step;
- writing: ``sampling.sample_windows`` (float32, top-64, as the self-written calibration) of ``--write-windows``
  windows in one batch, ``--write-tokens`` tokens each; seconds per window per token.
The price is the cost model's for one window / step / window-token (``cost.KD_*`` times the parameters a pass
multiplies by, ``RunSize.pass_params``) on the reference machine, divided by the speed the run plan's probe
measures (``run_plan.measure_speed``) just before each model.

    python bench/pass_cost.py --models smollm2-135m-instruct gemma3-270m /tmp/sm/w/qwen05b
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def shape_of(model) -> dict:
    """Block-linear weights, the head's weights and vocabulary, all parameters, those a pass multiplies by."""
    from vptq_core.quant.blocks import lookup_params, total_linear_shapes

    linear = sum(o * i for o, i in total_linear_shapes(model))
    head = model.get_output_embeddings().weight
    params = sum(p.numel() for p in model.parameters())
    return {"linear_weights": linear, "head_weights": head.numel(), "vocab": head.shape[0], "params": params,
            "pass_params": params - lookup_params(model)}


def measure(name: str, args) -> dict:
    from distill_step import student_of

    from vptq_core.data import calibration_windows
    from vptq_core.models import load_model
    from vptq_core.quant import cost
    from vptq_core.quant.config import VPTQConfig
    from vptq_core.quant.distill import distill
    from vptq_core.quant.run_plan import measure_speed
    from vptq_core.quant.sampling import SAMPLE_BATCH, sample_windows, start_tokens
    from vptq_core.quant.states import VQLayerState
    from vptq_core.quant.teacher import teacher_topk

    reference, tok = load_model(name, dtype=getattr(torch, args.dtype) if args.dtype != "auto" else "auto")
    reference.eval()
    size = shape_of(reference)
    windows = calibration_windows(tok, "wiki", samples=max(args.windows, 4), seqlen=args.seqlen, seed=0)
    speed = measure_speed("cpu")
    row = {"model": name, "dtype": str(next(reference.parameters()).dtype).removeprefix("torch."), **size,
           "speed": round(speed, 3)}
    cpu = torch.device("cpu")

    teacher_topk(reference, windows[:1], 64, cpu)  # warm-up
    t0 = time.perf_counter()
    teacher_topk(reference, windows[: args.windows], 64, cpu)
    row["teacher_s"] = (time.perf_counter() - t0) / args.windows
    if args.unwidened:  # the same pass with the model's own products (no float32 widening of bf16 linears)
        with mock.patch("vptq_core.quant.teacher.widened_linears", lambda _model: contextlib.nullcontext()):
            t0 = time.perf_counter()
            teacher_topk(reference, windows[: args.windows], 64, cpu)
            row["teacher_unwidened_s"] = (time.perf_counter() - t0) / args.windows
    if args.teacher_only:
        return row

    starts = start_tokens(reference, windows[: args.write_windows])
    sample_windows(reference, starts[:1], starts.shape[1] + 4, batch=SAMPLE_BATCH, topk=64, dtype="float32")
    t0 = time.perf_counter()
    sample_windows(reference, starts, args.write_tokens, batch=SAMPLE_BATCH, topk=64, dtype="float32")
    row["write_s"] = (time.perf_counter() - t0) / (args.write_windows * (args.write_tokens - starts.shape[1]))

    student, states = student_of(reference)
    stamps: list[float] = []
    config = VPTQConfig(distill_iters=1 + args.steps, distill_holdout=0.25, distill_topk=64, distill_batch=1,
                        distill_eval_every=10**6)
    trial = {n: VQLayerState(**{f: getattr(st, f) for f in st.__dataclass_fields__}) for n, st in states.items()}
    distill(student, reference, trial, windows, config, on_step=lambda step, _kl: stamps.append(time.perf_counter()))
    row["step_s"] = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    del student, trial, states, reference

    tokens = args.seqlen - 1
    params = size["pass_params"]  # what the plan prices a pass by (cost.RunSize.pass_params)
    row["teacher_price"] = cost.KD_TEACHER_S * params * tokens / speed
    row["step_price"] = cost.KD_STEP_S * params * tokens / speed
    # a window's token of the writing: its share of the batched pass's seconds (one token: seqlen 2)
    row["write_price"] = cost.sampling_seconds(params, args.write_windows, 2) / args.write_windows / speed
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=2, help="teacher windows timed")
    ap.add_argument("--steps", type=int, default=2, help="distillation steps timed (after one)")
    ap.add_argument("--write-windows", type=int, default=8)
    ap.add_argument("--write-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="the dtype the models load in (auto: as a run loads the original, as stored)")
    ap.add_argument("--unwidened", action="store_true", help="also time the teacher pass without widening bf16 "
                    "linears to float32 (``device.widened_linears``, what a CPU without bf16 products gets)")
    ap.add_argument("--teacher-only", action="store_true", help="time the teacher pass only")
    ap.add_argument("--json", help="append the rows to this JSON-lines file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vptq_core.quant.device import cpu_flags, native_bf16

    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"# pass costs: {args.threads} threads, CPU flags {', '.join(flags) or 'none known'}, load average "
          f"{os.getloadavg()[0]:.1f}; teacher {args.windows} windows x {args.seqlen}, {args.steps} steps, writing "
          f"{args.write_windows} windows x {args.write_tokens} tokens")
    rows = []
    for name in args.models:
        row = measure(name, args)
        rows.append(row)
        print(f"# {json.dumps(row)}", flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    if args.teacher_only:
        print(f"\n$ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')!r}, bf16 products in hardware: "
              f"{native_bf16('cpu')}")
        print("\n| model | dtype | teacher s/window (as a run) | without widening | × |")
        print("|---|---|---|---|---|")
        for r in rows:
            plain = r.get("teacher_unwidened_s")
            cells = f"{plain:.2f} | {plain / r['teacher_s']:.2f}" if plain else "- | -"
            print(f"| {Path(r['model']).name} | {r['dtype']} | {r['teacher_s']:.2f} | {cells} |")
        return
    print("\n| model | block linears | head (vocab) | params (priced) | teacher s/window (price) | step s (price) | "
          "writing ms/window-token (price) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {Path(r['model']).name} | {r['linear_weights'] / 1e6:.0f} M | {r['head_weights'] / 1e6:.0f} M "
              f"({r['vocab']}) | {r['params'] / 1e6:.0f} M ({r['pass_params'] / 1e6:.0f} M) | "
              f"{r['teacher_s']:.2f} ({r['teacher_price']:.2f}, "
              f"{r['teacher_s'] / r['teacher_price']:.2f}x) | {r['step_s']:.2f} ({r['step_price']:.2f}, "
              f"{r['step_s'] / r['step_price']:.2f}x) | {1e3 * r['write_s']:.2f} ({1e3 * r['write_price']:.2f}, "
              f"{r['write_s'] / r['write_price']:.2f}x) |")


if __name__ == "__main__":
    main()
