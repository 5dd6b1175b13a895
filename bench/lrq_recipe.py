"""Recipe search for a method's preset, on the DEV split: each variant is a preset (or the method's defaults) with
some settings changed, quantized through ``api.quantize_to_dir`` (what the CLI runs) and scored against the
original on the dev split of wiki and pydocs. Step counts are fixed (no time budget unless a variant sets one), so
a variant's quality does not depend on how loaded the machine is; its wall time does, and is recorded beside the
load average.

    python bench/lrq_recipe.py --base w4a8 --variants base: iters16:iters=16 g0:group_size=0 \\
        --calib-samples 32 --windows 16 --threads 2 --results bench/results/lrq_recipe.jsonl

A variant is NAME:SETTINGS with SETTINGS comma-separated NAME=VALUE (VALUE as JSON, a bare word as a string);
"NAME:" is the base as it is. Every finished variant is appended to ``--results`` (JSON lines), with its config,
the run's stage timings and the scores; variants already there (same name and protocol) are skipped unless
``--rerun``. Choose settings on "dev"; report a preset on "test" once (``python -m vptq_core eval --split test``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXTS = ("wiki", "pydocs")


def parse_variant(text: str) -> tuple[str, dict]:
    """"NAME:a=1,b=x" -> ("NAME", {"a": 1, "b": "x"}); ValueError naming the bad part."""
    name, sep, body = text.partition(":")
    if not sep or not name:
        raise ValueError(f"a variant is NAME:SETTINGS (NAME=VALUE, comma-separated), got {text!r}")
    from vptq_core.quant.settings import parse_assignment

    return name, dict(parse_assignment(item, f"variant {name!r}") for item in filter(None, body.split(",")))


def protocol(args) -> dict:
    return {"model": args.model, "method": args.method, "base": args.base, "calib_text": args.calib_text,
            "calib_samples": args.calib_samples, "calib_seqlen": args.calib_seqlen, "split": args.split,
            "windows": args.windows, "seqlen": args.seqlen, "threads": args.threads, "seed": args.seed}


def load_done(path: Path, proto: dict) -> dict[str, dict]:
    done = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record.get("protocol") == proto:
                done[record["variant"]] = record
    return done


def run_variant(name: str, overrides: dict, args, out_dir: Path) -> dict:
    from vptq_core import api
    from vptq_core.quant import methods
    from vptq_core.quant.config import CalibConfig

    method = methods.get(args.method)
    settings = {**(method.preset(args.base) if args.base else {}), **overrides}
    settings.setdefault("seed", args.seed)
    config = method.make_config(settings)
    calib = CalibConfig(text=args.calib_text, samples=args.calib_samples, seqlen=args.calib_seqlen, seed=args.seed)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    out, summary = api.quantize_to_dir(args.model, method.name, config, calib, out_dir, device="cpu")
    quant_seconds = time.perf_counter() - start
    scores = {}
    for text in TEXTS:
        res = api.evaluate_model(str(out), text=text, seqlen=args.seqlen, max_windows=args.windows, split=args.split)
        scores[text] = {"perplexity": res.perplexity, "bf16": res.reference_perplexity,
                        "ratio": res.perplexity / res.reference_perplexity, "kl": res.kl_divergence,
                        "top1": res.top1_agreement, "windows": res.windows}
    return {"variant": name, "overrides": overrides, "config": config.to_dict(), "protocol": protocol(args),
            "quant_seconds": quant_seconds, "timings": summary.get("timings"),
            "total_bits": summary.get("total_bits_per_weight"),
            "distill": {k: v for k, v in (summary.get("model_metrics", {}).get("distill") or {}).items()
                        if not isinstance(v, (list, dict))},
            "load_before": load_before, "load_after": os.getloadavg()[0], "scores": scores,
            "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def print_table(records: list[dict], args) -> None:
    print(f"\nrecipe search: method {args.method}, base {args.base or '(defaults)'}, model {args.model}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads; "
          f"calibration {args.calib_samples} x {args.calib_seqlen} tokens of {args.calib_text}; scored on the "
          f"{args.split} split, {args.windows} windows of {args.seqlen} tokens per text; fixed step counts, one run "
          "per variant, wall time as the machine's load allowed (load average before / after)")
    print("| variant | settings | total bits | wiki ppl | x bf16 | KL | pydocs ppl | x bf16 | KL | quant s | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        w, p = r["scores"]["wiki"], r["scores"]["pydocs"]
        settings = ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "(base)"
        bits = f"{r['total_bits']:.2f}" if isinstance(r.get("total_bits"), float) else "-"
        print(f"| {r['variant']} | {settings} | {bits} | {w['perplexity']:.2f} | {w['ratio']:.3f} | {w['kl']:.3f} | "
              f"{p['perplexity']:.2f} | {p['ratio']:.3f} | {p['kl']:.3f} | {r['quant_seconds']:.0f} | "
              f"{r['load_before']:.1f} / {r['load_after']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--method", default="lrq")
    parser.add_argument("--base", default="w4a8", help="the preset the variants change ('' = the method's defaults)")
    parser.add_argument("--variants", nargs="+", default=["base:"], help="NAME:SETTINGS, see above")
    parser.add_argument("--calib-text", default="wiki")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument("--split", default="dev", choices=("dev", "test"))
    parser.add_argument("--windows", type=int, default=16, help="evaluation windows per text")
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per evaluation window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default="bench/results/lrq_recipe.jsonl")
    parser.add_argument("--rerun", action="store_true", help="run variants already in the results file again")
    parser.add_argument("--save-dir", help="keep each variant's checkpoint under DIR/VARIANT")
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variants]
    except ValueError as exc:
        parser.error(str(exc))

    import torch

    torch.set_num_threads(args.threads)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    proto = protocol(args)
    done = {} if args.rerun else load_done(results, proto)
    records = []
    for name, overrides in variants:
        if name in done and done[name]["overrides"] == overrides:
            records.append(done[name])
            continue
        with tempfile.TemporaryDirectory(prefix="lrq_recipe_") as tmp:
            out_dir = Path(args.save_dir) / name if args.save_dir else Path(tmp) / name
            record = run_variant(name, overrides, args, out_dir)
        with results.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        records.append(record)
        scores = record["scores"]
        print(f"{name}: wiki x{scores['wiki']['ratio']:.3f}, pydocs x{scores['pydocs']['ratio']:.3f}, "
              f"{record['quant_seconds']:.0f} s", flush=True)
    print_table(records, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
