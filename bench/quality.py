"""Quality vs bits on SmolLM2-135M-Instruct: bf16, RTN, GPTQ, VPTQ (and LRQ) with the same data and code.

Each row quantizes the model with the block pipeline (calibration: bundled wiki, even articles), then
evaluates the quantized model in bf16 against the bf16 original on held-out text of the same domain (wiki,
odd articles) and of another domain (Python's documentation, odd topics: technical prose and code):
perplexity, mean KL(P_bf16 || P_quant) and top-1 agreement. Results are appended to a JSON-lines file
so an interrupted run resumes; the table is printed from that file.

    python bench/quality.py                       # every row (tens of minutes on 2 cores)
    python bench/quality.py --rows rtn-3 vptq-2   # some rows
    python bench/quality.py --list
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.data import calibration_windows  # noqa: E402
from vptq_core.eval import evaluate  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.allocate import cap_for_budget  # noqa: E402
from vptq_core.quant.calib_windows import with_heldout  # noqa: E402
from vptq_core.quant.config import LRQConfig, ScalarConfig, VPTQConfig  # noqa: E402
from vptq_core.quant.distill import distill  # noqa: E402
from vptq_core.quant.pipeline import quantize_model  # noqa: E402
from vptq_core.quant.sampling import sampled_calibration  # noqa: E402
from vptq_core.quant.vptq import PRESETS  # noqa: E402

# SmolLM2-135M's block linears (out, in), 30 blocks: q, k, v, o, gate, up, down
SMOLLM2_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30


def allocated(budget: float, **settings) -> VPTQConfig:
    """``settings`` with the loosest per-layer cap that keeps SmolLM2's total bits within ``budget``."""
    config = VPTQConfig(**settings)
    cap, _ = cap_for_budget(config, SMOLLM2_SHAPES, budget)
    return VPTQConfig(**{**settings, "layer_bits_cap": cap})


# distill_lr is relative to each codebook's RMS (about 0.19 on SmolLM2): 1e-3 / 2.5e-3 are the absolute 2e-4 /
# 5e-4 these rows were first measured with.
KD = {"distill_iters": 32, "distill_lr": 1e-3, "distill_norm_lr": 2e-4, "distill_eval_every": 8}
KD16 = {**KD, "distill_iters": 16, "distill_eval_every": 4}
KD64 = {**KD, "distill_iters": 64, "distill_eval_every": 16}
KD16_LR5 = {**KD16, "distill_lr": 2.5e-3, "distill_norm_lr": 5e-4}
MIXED16 = {"distill_data": "mixed", "distill_samples": 16}

ROWS: dict[str, tuple[str, object, str]] = {
    "rtn-2": ("rtn", ScalarConfig(bits=2, group_size=64), "RTN 2-bit g64"),
    "gptq-2": ("gptq", ScalarConfig(bits=2, group_size=64), "GPTQ 2-bit g64"),
    "vptq-2-v4k256": ("vptq", VPTQConfig(vector_len=4, num_centroids=256), "VPTQ v4 k256"),
    "vptq-2-v6k4096": ("vptq", VPTQConfig(vector_len=6, num_centroids=4096), "VPTQ v6 k4096"),
    "vptq-2-v6k4096-nearest": ("vptq", VPTQConfig(vector_len=6, num_centroids=4096, second_order=False),
                               "VPTQ v6 k4096, nearest centroid (no 2nd-order)"),
    "vptq-2-v8k256r256": ("vptq", VPTQConfig(vector_len=8, num_centroids=256, num_res_centroids=256),
                          "VPTQ v8 k256 + residual k256"),
    "vptq-2-v6k4096-ft32": ("vptq", VPTQConfig(vector_len=6, num_centroids=4096, finetune_iters=32),
                            "VPTQ v6 k4096 + centroid fine-tuning (32 steps/block)"),
    "vptq-2-v6k4096-ft64": ("vptq", VPTQConfig(vector_len=6, num_centroids=4096, finetune_iters=64),
                            "VPTQ v6 k4096 + centroid fine-tuning (64 steps/block)"),
    "vptq-2-v6k4096-refit5": ("vptq", VPTQConfig(vector_len=6, num_centroids=4096, refit_iters=5),
                              "VPTQ v6 k4096 + codebook refit (5 CG steps)"),
    "vptq-2.5-alloc": ("vptq", allocated(2.5, vector_len=6, num_centroids=4096),
                       "VPTQ 2.5 total bits: v6 k4096, per-layer cap (allocator)"),
    "vptq-2.5-alloc-kd32": ("vptq", allocated(2.5, vector_len=6, num_centroids=4096, **KD),
                            "VPTQ 2.5 total bits (allocator) + distillation 32 steps"),
    "vptq-2.5-alloc-kd64": ("vptq", allocated(2.5, vector_len=6, num_centroids=4096, **KD64),
                            "VPTQ 2.5 total bits (allocator) + distillation 64 steps"),
    "vptq-2.5-alloc-kd64-sampled": ("vptq", allocated(2.5, vector_len=6, num_centroids=4096, **KD64,
                                                       distill_data="sampled"),
                                    "VPTQ allocator at 2.5 total bits + distillation on 32 sampled windows, 64 steps"),
    "vptq-2.5-alloc-kd64-mixed": ("vptq", allocated(2.5, vector_len=6, num_centroids=4096, **KD64,
                                                     distill_data="mixed"),
                                  "VPTQ allocator at 2.5 total bits + distillation on calibration + 32 sampled "
                                  "windows, 64 steps"),
    "preset-2.5": ("vptq", VPTQConfig(**PRESETS["2.5 bits"]), 'preset "2.5 bits" as the app and CLI run it'),
    "preset-3.5": ("vptq", VPTQConfig(**PRESETS["3.5 bits"]), 'preset "3.5 bits" as the app and CLI run it'),
    "preset-2.5-kd16": ("vptq", VPTQConfig(**{**PRESETS["2.5 bits"], **KD16_LR5}),
                        'preset "2.5 bits" + distillation 16 steps, lr 2.5e-3'),
    "preset-3.5-kd16": ("vptq", VPTQConfig(**{**PRESETS["3.5 bits"], **KD16_LR5}),
                        'preset "3.5 bits" + distillation 16 steps, lr 2.5e-3'),
    "preset-2.5-kd16-mixed16": ("vptq", VPTQConfig(**{**PRESETS["2.5 bits"], **KD16_LR5, **MIXED16}),
                                'preset "2.5 bits" + distillation 16 steps on calibration + 16 sampled windows'),
    "preset-3.5-kd16-mixed16": ("vptq", VPTQConfig(**{**PRESETS["3.5 bits"], **KD16_LR5, **MIXED16}),
                                'preset "3.5 bits" + distillation 16 steps on calibration + 16 sampled windows'),
    "preset-2.5-cs16": ("vptq", VPTQConfig(**{**PRESETS["2.5 bits"], "calib_sampled_share": 0.5}),
                        'preset "2.5 bits", 16 of the 32 calibration windows written by the original model'),
    "preset-3.5-cs16": ("vptq", VPTQConfig(**{**PRESETS["3.5 bits"], "calib_sampled_share": 0.5}),
                        'preset "3.5 bits", 16 of the 32 calibration windows written by the original model'),
    "vptq-2.5-alloc-kd16": ("vptq", allocated(2.5, vector_len=6, num_centroids=4096, **KD16),
                            "VPTQ 2.5 total bits (allocator) + distillation 16 steps"),
    "vptq-2-v6k4096-kd32": ("vptq", VPTQConfig(vector_len=6, num_centroids=4096, **KD),
                            "VPTQ v6 k4096 + distillation 32 steps"),
    "vptq-1-v8k256": ("vptq", VPTQConfig(vector_len=8, num_centroids=256), "VPTQ v8 k256 (no residual)"),
    "rtn-3": ("rtn", ScalarConfig(bits=3, group_size=64), "RTN 3-bit g64"),
    "gptq-3": ("gptq", ScalarConfig(bits=3, group_size=64), "GPTQ 3-bit g64"),
    "vptq-3-v4k4096": ("vptq", VPTQConfig(vector_len=4, num_centroids=4096), "VPTQ v4 k4096"),
    "vptq-3-v4k4096-kd32": ("vptq", VPTQConfig(vector_len=4, num_centroids=4096, **KD),
                            "VPTQ v4 k4096 (3.58 total) + distillation 32 steps"),
    "vptq-3-v4k64r64": ("vptq", VPTQConfig(vector_len=4, num_centroids=64, num_res_centroids=64),
                        "VPTQ v4 k64 + residual k64"),
    "rtn-4": ("rtn", ScalarConfig(bits=4, group_size=64), "RTN 4-bit g64 (flattered: model was Q4_1)"),
    "gptq-4": ("gptq", ScalarConfig(bits=4, group_size=64), "GPTQ 4-bit g64 (flattered: model was Q4_1)"),
    "vptq-4-v4k256r256": ("vptq", VPTQConfig(vector_len=4, num_centroids=256, num_res_centroids=256),
                          "VPTQ v4 k256 + residual k256"),
    "lrq-w3a16": ("lrq", LRQConfig(bits=3), "LRQ W3A16"),
    "rtn-w3a16-pc": ("rtn", ScalarConfig(bits=3, group_size=0), "RTN W3A16 per-channel"),
    "gptq-w3a16-pc": ("gptq", ScalarConfig(bits=3, group_size=0), "GPTQ W3A16 per-channel"),
    "lrq-w4a16": ("lrq", LRQConfig(bits=4), "LRQ W4A16"),
    "rtn-w4a16-pc": ("rtn", ScalarConfig(bits=4, group_size=0), "RTN W4A16 per-channel"),
    "gptq-w4a16-pc": ("gptq", ScalarConfig(bits=4, group_size=0), "GPTQ W4A16 per-channel"),
    "lrq-w4a8": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token"), "LRQ W4A8 (per-token)"),
    "lrq-w4a8-fp64": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token", target_chain="fp", iters=64),
                      "LRQ W4A8 (per-token), FP-chain targets, 64 steps/block"),
    "lrq-w4a8-fp": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token", target_chain="fp"),
                    "LRQ W4A8 (per-token), FP-chain targets"),
    "lrq-w4a8-fp-kd64-mixed": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token", target_chain="fp",
                                                distill_iters=64, distill_data="mixed", distill_lr=5e-3),
                               "LRQ W4A8 (per-token), FP-chain targets + distillation of the scales, 64 steps, mixed"),
    "lrq-w4a8-fp64-kd64-mixed": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token", target_chain="fp",
                                                  iters=64, distill_iters=64, distill_data="mixed", distill_lr=5e-3),
                                 "LRQ W4A8 (per-token), FP-chain targets, 64 steps/block + distillation, 64 steps, "
                                 "mixed"),
    "lrq-w4a8-asym-fp": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token_asym", target_chain="fp"),
                         "LRQ W4A8 (per-token asymmetric), FP-chain targets"),
    "lrq-w4a8-asym-fp-kd64-mixed": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token_asym",
                                                     target_chain="fp", distill_iters=64, distill_data="mixed",
                                                     distill_lr=5e-3),
                                    "LRQ W4A8 (per-token asymmetric), FP-chain targets + distillation, 64 steps, "
                                    "mixed"),
    "lrq-w4a8-asym-fp64-kd64-mixed": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token_asym",
                                                       target_chain="fp", iters=64, distill_iters=64,
                                                       distill_data="mixed", distill_lr=5e-3),
                                      "LRQ W4A8 (per-token asymmetric), FP-chain targets, 64 steps/block + "
                                      "distillation, 64 steps, mixed"),
    "lrq-w4a8-g128-fp-kd64-mixed": ("lrq", LRQConfig(bits=4, group_size=128, act_bits=8, act_granularity="token",
                                                     target_chain="fp", distill_iters=64, distill_data="mixed",
                                                     distill_lr=5e-3),
                                    "LRQ W4A8 g128 (per-token), FP-chain targets + distillation, 64 steps, mixed"),
    "lrq-w4a8-g128-asym-fp-kd64-mixed": ("lrq", LRQConfig(bits=4, group_size=128, act_bits=8,
                                                          act_granularity="token_asym", target_chain="fp",
                                                          distill_iters=64, distill_data="mixed", distill_lr=5e-3),
                                         "LRQ W4A8 g128 (per-token asymmetric), FP-chain targets + distillation, "
                                         "64 steps, mixed"),
    "lrq-w4a8-asym-fp-kd64-mixed-cs16": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token_asym",
                                                          target_chain="fp", distill_iters=64, distill_data="mixed",
                                                          distill_lr=5e-3, calib_sampled_share=0.5),
                                         "LRQ W4A8 (per-token asymmetric), FP-chain targets + distillation, 64 steps, "
                                         "mixed; 16 of the 32 calibration windows written by the original model"),
    "lrq-w4a8-asym-fp-kd128s64-mixed-cs": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token_asym",
                                                            target_chain="fp", distill_iters=128, distill_samples=64,
                                                            distill_eval_every=32, distill_data="mixed",
                                                            distill_lr=5e-3, calib_sampled_share=0.5),
                                           "LRQ W4A8 (per-token asymmetric), FP-chain targets + distillation, 128 "
                                           "steps, calibration + 64 sampled; half the calibration written by the "
                                           "original model"),
    "lrq-w4a8-64": ("lrq", LRQConfig(bits=4, act_bits=8, act_granularity="token", iters=64),
                    "LRQ W4A8 (per-token), 64 steps/block"),
    "rtn-w4a8-pc": ("rtn", ScalarConfig(bits=4, group_size=0, act_bits=8, act_granularity="token"),
                    "RTN W4A8 per-channel (per-token)"),
    "gptq-w4a8-pc": ("gptq", ScalarConfig(bits=4, group_size=0, act_bits=8, act_granularity="token"),
                     "GPTQ W4A8 per-channel (per-token)"),
    "lrq-w8a8": ("lrq", LRQConfig(bits=8, act_bits=8, act_granularity="tensor"), "LRQ W8A8 (per-tensor static)"),
    "rtn-w8a8-pc": ("rtn", ScalarConfig(bits=8, group_size=0, act_bits=8, act_granularity="tensor"),
                    "RTN W8A8 per-channel (per-tensor static)"),
    "gptq-w8a8-pc": ("gptq", ScalarConfig(bits=8, group_size=0, act_bits=8, act_granularity="tensor"),
                     "GPTQ W8A8 per-channel (per-tensor static)"),
    "lrq-w3a16-full": ("lrq", LRQConfig(bits=3, full_scale=True), "FlexRound-style full scale W3A16"),
    # Longer training for the generalisation comparison (run with few calibration windows, e.g. 4: 24 epochs).
    "lrq-w3a16-96": ("lrq", LRQConfig(bits=3, iters=96), "LRQ W3A16, 96 steps/block"),
    "lrq-w3a16-full-96": ("lrq", LRQConfig(bits=3, iters=96, full_scale=True),
                          "FlexRound-style full scale W3A16, 96 steps/block"),
}


def run_row(key: str, model, tok, calib: torch.Tensor, args) -> dict:
    method, config, label = ROWS[key]
    t0 = time.perf_counter()
    kd_iters = getattr(config, "distill_iters", 0)
    before_kd = None
    if kd_iters:
        # The same run as quantize_model with distillation (its after-model hook is this distill call), split
        # so the model is also evaluated before distilling: one quantization gives both rows.
        # as the pipeline does: the block stage gets the calibration windows, distillation also the held-out
        # check windows drawn on top of them (``with_heldout``)
        # calib_sampled_share: the windows the original writes are drawn once, for both stages (as in the pipeline)
        # (and, as there, their teacher top-k comes from the sampling: distillation passes the teacher over the rest)
        topk = config.distill_topk if config.distill_data != "sampled" else 0
        ids = sampled_calibration(model, calib[: with_heldout(args.calib_samples, config)], config, topk=topk)
        ids, known = ids if topk else (ids, None)
        sample_s = time.perf_counter() - t0
        qmodel, result = quantize_model(model, ids[: args.calib_samples], method,
                                        dataclasses.replace(config, distill_iters=0, calib_sampled_share=0.0),
                                        device="cpu")
        if config.calib_sampled_share:
            result.timings["sample_calibration"] = sample_s
        quant_only = time.perf_counter() - t0
        qb = copy.deepcopy(qmodel).to(torch.bfloat16)
        before_kd = {"quant_seconds": quant_only}
        for text, prefix in (("wiki", ""), ("pydocs", "ood_")):
            ev = evaluate(qb, tok, text=text, seqlen=args.seqlen, max_windows=args.windows, reference=args.reference)
            before_kd.update({f"{prefix}perplexity": ev.perplexity, f"{prefix}kl": ev.kl_divergence,
                              f"{prefix}top1": ev.top1_agreement})
        del qb
        t1 = time.perf_counter()
        with torch.enable_grad():
            metrics = distill(qmodel, model, result.states, ids, config, known_teacher=known)
        result.model_metrics["distill"] = metrics
        result.timings["distill"] = time.perf_counter() - t1
        seconds = quant_only + result.timings["distill"]
    else:
        qmodel, result = quantize_model(model, calib[: args.calib_samples], method, config, device="cpu")
        seconds = time.perf_counter() - t0
    if args.save_dir:
        from vptq_core.storage.checkpoint import save_quantized

        save_quantized(model, tok, result.states, Path(args.save_dir) / key, dtype=torch.bfloat16,
                       report={"model": {"source": args.model}, "summary": result.summary()})
    qmodel = qmodel.to(torch.bfloat16)
    ev = evaluate(qmodel, tok, text="wiki", seqlen=args.seqlen, max_windows=args.windows, reference=args.reference)
    # The calibration windows themselves (seen while quantizing), against the original on the same windows:
    # the gap to the held-out numbers shows how much a method fitted its calibration text.
    seen = None if args.skip_calib_eval else evaluate(qmodel, tok, windows=calib[: args.calib_samples],
                                                       reference=args.reference)
    other = evaluate(qmodel, tok, text="pydocs", seqlen=args.seqlen, max_windows=args.windows,
                     reference=args.reference)
    return {
        "ood_text": "pydocs", "ood_perplexity": other.perplexity, "ood_bf16_perplexity": other.reference_perplexity,
        "ood_kl": other.kl_divergence, "ood_top1": other.top1_agreement, "timings": result.summary()["timings"],
        "calib_perplexity": seen and seen.perplexity, "calib_kl": seen and seen.kl_divergence,
        "calib_bf16_perplexity": seen and seen.reference_perplexity,
        "model": args.model, "row": key, "label": label, "method": method, "config": config.to_dict(),
        "before_distill": before_kd, "model_metrics": result.model_metrics, "load": os.getloadavg(),
        "index_bits": result.bits.index_bits_per_weight, "total_bits": result.bits.total_bits_per_weight,
        "perplexity": ev.perplexity, "kl": ev.kl_divergence, "top1": ev.top1_agreement,
        "bf16_perplexity": ev.reference_perplexity, "quant_seconds": seconds, "threads": torch.get_num_threads(),
        "calib": {"samples": args.calib_samples, "seqlen": args.calib_seqlen}, "protocol": ev.protocol(),
        "layers": [
            {k: r.to_dict()[k] for k in ("name", "rel_proxy_loss", "rel_weight_error", "rel_output_error")}
            for r in result.reports
        ],
    }


def print_table(results: list[dict], bf16_ppl: float | None, model: str) -> None:
    print(f"\n{model}, bundled wiki text. Protocol: calibration = even articles, "
          "random windows; evaluation = odd articles, non-overlapping windows; quantized and original both bf16.")
    if results:
        print(f"evaluation: {results[0]['protocol']}; calibration: {results[0]['calib']}; "
              f"threads: {results[0]['threads']}")
    header = (f"| {'row':<50} | idx bits | total bits | wiki ppl | × bf16 | KL | top-1 | pydocs ppl | × bf16 | KL "
              "| top-1 | quant s | calib windows |")
    print(header)
    print("|" + "---|" * 13)
    if bf16_ppl:
        ood = next((r["ood_bf16_perplexity"] for r in results if "ood_bf16_perplexity" in r), None)
        ood_text = f"{ood:.2f}" if ood else "-"
        print(f"| {'bf16 original':<50} | 16 | 16 | {bf16_ppl:.2f} | 1.00 | 0 | 100% | {ood_text} | 1.00 | 0 | 100% "
              "| - | - |")
    for r in results:
        if "ood_perplexity" in r:
            ood = (f"{r['ood_perplexity']:.2f} | {r['ood_perplexity'] / r['ood_bf16_perplexity']:.2f} | "
                   f"{r['ood_kl']:.3f} | {r['ood_top1']:.1%}")
        else:
            ood = "- | - | - | -"
        print(f"| {r['label']:<50} | {r['index_bits']:.2f} | {r['total_bits']:.2f} | {r['perplexity']:.2f} | "
              f"{r['perplexity'] / r['bf16_perplexity']:.2f} | {r['kl']:.3f} | {r['top1']:.1%} | {ood} | "
              f"{r['quant_seconds']:.0f} | {r['calib']['samples']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="model to quantize (a built-in name such as gemma3-270m, a directory or a .gguf file); "
                             "keep one results file per model")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), help="rows to run (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--results", nargs="+", default=["bench/results/quality.jsonl"],
                        help="JSON-lines files: new rows are appended to the first; the table reads them all "
                             "(a later file's row replaces an earlier one's)")
    parser.add_argument("--rerun", action="store_true", help="recompute rows already in the results file")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--skip-calib-eval", action="store_true",
                        help="do not evaluate on the calibration windows themselves (saves time)")
    parser.add_argument("--save-dir", help="also write each row's packed checkpoint under DIR/ROW")
    args = parser.parse_args()
    if args.list:
        for key, (_, _, label) in ROWS.items():
            print(f"{key:<26} {label}")
        return
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; allowed: {', '.join(ROWS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.results[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    for file in [Path(p) for p in args.results[1:]] + [path]:
        if file.is_file():
            for line in file.read_text().splitlines():
                rec = json.loads(line)
                done[rec["row"]] = rec
    if not args.table_only:
        model, tok = load_model(args.model, dtype=torch.float32)
        args.reference, _ = load_model(args.model, dtype=torch.bfloat16)
        # enough windows for every row; a row takes the first ones (one seed stream: the first n of more are
        # the n windows themselves)
        most = max(with_heldout(args.calib_samples, ROWS[key][1]) for key in args.rows)
        calib = calibration_windows(tok, "wiki", most, args.calib_seqlen, seed=0)
        for key in args.rows:
            if key in done and not args.rerun:
                continue
            rec = run_row(key, model, tok, calib, args)
            done[key] = rec
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{key}: ppl {rec['perplexity']:.2f} (bf16 {rec['bf16_perplexity']:.2f}) "
                  f"bits {rec['index_bits']:.2f}/{rec['total_bits']:.2f} in {rec['quant_seconds']:.0f}s", flush=True)
    rows = [done[k] for k in ROWS if k in done and k in args.rows]
    print_table(rows, rows[0]["bf16_perplexity"] if rows else None, args.model)
    if os.environ.get("QUALITY_JSON"):
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
