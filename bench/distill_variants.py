"""End-to-end distillation variants from ONE quantization: what the data, steps and learning rate buy.

Protocol: SmolLM2-135M-Instruct (fp32 teacher), ``--row`` of ``bench/quality.py`` (any method) quantized once
(distillation off) on 32 wiki calibration windows x 512 tokens (``--calib-samples``, ``--seqlen``; even articles,
seed 0); distillation also gets the held-out check windows drawn on top of them, as in the pipeline (4 more by
default); its layer states are cached under ``--cache`` (safetensors + JSON) so later runs skip the quantization.
Each variant distils a fresh copy of that quantized model with the row's distillation settings overridden by the
variant's, then the model is evaluated in bf16 against the bf16 original on ``--windows`` held-out windows of the
same length of wiki and of Python's docs (pydocs, another domain), from ``--split``: "dev" (default) to choose
settings, "test" to report. Results are appended to ``--results`` (one JSON line per variant; a variant already
there is skipped). VPTQ rows take the discrete code updates as variants too (``distill_code_every=4,...``).

    python bench/distill_variants.py --row vptq-2.5-alloc-kd64 \\
        --variants calib64:distill_data=calibration sampled64:distill_data=sampled \\
                   mixed128:distill_data=mixed,distill_iters=128,distill_eval_every=32
    python bench/distill_variants.py --row lrq-w4a8-fp --variants mixed32:distill_iters=32,distill_data=mixed
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import ROWS  # noqa: E402

from vptq_core.data import calibration_windows  # noqa: E402
from vptq_core.eval import evaluate  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.act_quant import install_activation_quant  # noqa: E402
from vptq_core.quant.calib_windows import with_heldout  # noqa: E402
from vptq_core.quant.distill import distill  # noqa: E402
from vptq_core.quant.pipeline import quantize_model  # noqa: E402
from vptq_core.quant.sampling import sampled_calibration  # noqa: E402
from vptq_core.quant.states import ScalarLayerState, VQLayerState  # noqa: E402

STATE_CLASSES = {cls.__name__: cls for cls in (VQLayerState, ScalarLayerState)}


def save_states(states: dict[str, VQLayerState | ScalarLayerState], directory: Path, meta: dict) -> None:
    tensors, fields = {}, {}
    for name, st in states.items():
        fields[name] = {"__class__": type(st).__name__}
        for f in dataclasses.fields(st):
            value = getattr(st, f.name)
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{f.name}"] = value.contiguous()
            else:
                fields[name][f.name] = value
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "states.safetensors"))
    (directory / "states.json").write_text(json.dumps({"meta": meta, "fields": fields}))


def load_states(directory: Path) -> tuple[dict[str, VQLayerState | ScalarLayerState], dict]:
    info = json.loads((directory / "states.json").read_text())
    tensors = load_file(str(directory / "states.safetensors"))
    states = {}
    for name, fields in info["fields"].items():
        own = {key.split("/", 1)[1]: t for key, t in tensors.items() if key.split("/", 1)[0] == name}
        cls = STATE_CLASSES[fields.pop("__class__", "VQLayerState")]
        states[name] = cls(**fields, **own)
    return states, info["meta"]


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition(":")
    overrides = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        overrides[key] = value
    return name, overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a bundled model (vptq_core.models)")
    parser.add_argument("--row", default="vptq-2.5-alloc-kd64", help="a row of bench/quality.py")
    parser.add_argument("--variants", nargs="+", required=True, help="NAME:setting=value,... (the row's config "
                        "fields)")
    parser.add_argument("--cache", default=None, help="directory for the quantized states (default: /tmp/...)")
    parser.add_argument("--results", default="bench/results/distill_variants.jsonl")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per calibration and evaluation window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--distill-seqlen", type=int, default=0,
                        help="distil on the first N tokens of each calibration window (0: all of them)")
    parser.add_argument("--eval-seqlen", type=int, default=0, help="tokens per evaluation window (0: --seqlen)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the undistilled row (\"none\")")
    parser.add_argument("--split", default="dev", choices=("dev", "test"),
                        help="the evaluation split: dev to choose settings, test to report")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    method, config, _ = ROWS[args.row]
    variants = [parse_variant(v) for v in args.variants]
    for _name, overrides in variants:
        dataclasses.replace(config, **overrides)  # a bad setting fails before any work
    model_tag = "" if args.model == "smollm2-135m-instruct" else f"{args.model}-"
    seqlen_tag = "" if args.seqlen == 512 else f"-{args.seqlen}"
    cache = Path(args.cache or f"/tmp/distill_variants/{model_tag}{args.row}-{args.calib_samples}{seqlen_tag}-heldout")
    results = Path(args.results)
    done = set()
    if results.is_file():
        done = {(r["row"], r["variant"]) for r in map(json.loads, results.read_text().splitlines())}

    model, tok = load_model(args.model, dtype=torch.float32)
    reference, _ = load_model(args.model, dtype=torch.bfloat16)
    # the calibration windows and, drawn on top of them, distillation's held-out check windows (``with_heldout``)
    calib = calibration_windows(tok, "wiki", with_heldout(args.calib_samples, dataclasses.replace(
        config, distill_iters=max(config.distill_iters, 1))), args.seqlen, seed=0)
    # A row with self-written calibration (``calib_sampled_share``, the presets): the original model writes those
    # windows once, as the pipeline does (its top-k on them kept for distillation); they are cached with the states.
    written = None
    if getattr(config, "calib_sampled_share", 0):
        if (cache / "written.safetensors").is_file():
            written = load_file(str(cache / "written.safetensors"))
        else:
            t0 = time.perf_counter()
            calib_w, teacher = sampled_calibration(model, calib, config, topk=config.distill_topk)
            written = {"windows": calib_w, **{f"teacher.{k}": v for k, v in (teacher or {}).items()},
                       "seconds": torch.tensor(time.perf_counter() - t0)}
            cache.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in written.items()}, str(cache / "written.safetensors"))
        calib = written["windows"]
    known = {k.split(".", 1)[1]: v for k, v in (written or {}).items() if k.startswith("teacher.")} or None
    if (cache / "states.json").is_file():
        states, meta = load_states(cache)
    else:
        t0 = time.perf_counter()
        _, result = quantize_model(model, calib[: args.calib_samples], method,
                                   dataclasses.replace(config, distill_iters=0, calib_sampled_share=0.0,
                                                       time_budget=0.0), device="cpu")
        meta = {"quant_seconds": time.perf_counter() - t0, "total_bits": result.bits.total_bits_per_weight,
                "index_bits": result.bits.index_bits_per_weight}
        if written:
            meta["sample_seconds"] = float(written["seconds"])
        states = result.states
        save_states(states, cache, meta)

    def quantized() -> tuple[torch.nn.Module, dict]:
        qmodel = copy.deepcopy(model)
        own = {name: dataclasses.replace(st) for name, st in states.items()}
        with torch.no_grad():
            for name, st in own.items():
                qmodel.get_submodule(name).weight.copy_(st.dequantize())
        acts = {name: st for name, st in own.items() if getattr(st, "act_bits", 16) < 16}
        install_activation_quant({name: qmodel.get_submodule(name) for name in acts}, acts)  # W4A8 / W8A8
        return qmodel, own

    def scores(qmodel) -> dict:
        qb = copy.deepcopy(qmodel).to(torch.bfloat16)
        out = {}
        for text in ("wiki", "pydocs"):
            ev = evaluate(qb, tok, text=text, seqlen=args.eval_seqlen or args.seqlen, max_windows=args.windows,
                          reference=reference,
                          split=args.split)
            out[text] = {"perplexity": ev.perplexity, "ratio": ev.perplexity / ev.reference_perplexity,
                         "kl": ev.kl_divergence, "top1": ev.top1_agreement, "bf16": ev.reference_perplexity}
        return out

    for name, overrides in ([] if args.no_baseline else [("none", {})]) + variants:
        if (args.row, name) in done:
            continue
        qmodel, own = quantized()
        cfg = dataclasses.replace(config, **overrides)
        metrics = {}
        if name != "none":
            with torch.enable_grad():
                # the written windows' teacher was kept at the row's top-k: another top-k takes its own teacher pass
                fits = known is not None and known["logp"].shape[-1] == cfg.distill_topk
                fits = fits and not args.distill_seqlen
                short = calib[:, : args.distill_seqlen] if args.distill_seqlen else calib
                metrics = distill(qmodel, model, own, short, cfg, known_teacher=known if fits else None)
        rec = {"model": args.model, "row": args.row, "variant": name, "overrides": overrides, "config": cfg.to_dict(),
               "quant": meta, "distill": metrics, "scores": scores(qmodel), "load": os.getloadavg(),
               "threads": args.threads, "calib_samples": args.calib_samples, "windows": args.windows,
               "split": args.split, "distill_seqlen": args.distill_seqlen or args.seqlen,
               "eval_seqlen": args.eval_seqlen or args.seqlen}
        with open(results, "a") as f:
            f.write(json.dumps(rec) + "\n")
        s = rec["scores"]
        print(f"{name}: wiki {s['wiki']['ratio']:.2f}x  pydocs {s['pydocs']['ratio']:.2f}x  "
              f"distill {metrics.get('seconds', 0):.0f}s", flush=True)

    print(f"\n{args.row}, quantized once ({meta['index_bits']:.2f} index / {meta['total_bits']:.3f} total bits, "
          f"{args.calib_samples} calibration windows), {args.windows} evaluation windows per text, bf16 vs bf16")
    print("| variant | settings | wiki ppl | x bf16 | KL | pydocs ppl | x bf16 | KL | held-out KL before -> after "
          "(best step) | distill s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rec in map(json.loads, results.read_text().splitlines()):
        if rec["row"] != args.row:
            continue
        w, p, d = rec["scores"]["wiki"], rec["scores"]["pydocs"], rec["distill"]
        kd = (f"{d['kl_before']:.3f} -> {d['kl_after']:.3f} ({d['best_step']})" if d else "-")
        print(f"| {rec['variant']} | {rec['overrides'] or '-'} | {w['perplexity']:.2f} | {w['ratio']:.2f} | "
              f"{w['kl']:.3f} | {p['perplexity']:.2f} | {p['ratio']:.2f} | {p['kl']:.3f} | {kd} | "
              f"{d.get('seconds', 0):.0f} |")


if __name__ == "__main__":
    main()
