"""Quality vs bits on SmolLM2-135M-Instruct: bf16, RTN, GPTQ, VPTQ (and LRQ) with the same data and code.

Each row quantizes the model with the block pipeline (calibration: the bundled wiki's "calib" split, windows drawn
with the seed), then evaluates the quantized model in bf16 against the bf16 original on the held-out "dev" and
"test" splits of the calibration's domain (wiki) and of another (pydocs: Python's documentation, technical prose
and code); docs/methods.md#evaluation-protocol. Statistics as llama.cpp's ``--kl-divergence`` prints them:
perplexity, KL(P_bf16 || P_quant) per token (mean, median, p99), Δp of the original's top token, same top token.
With ``--seeds`` every row runs once per quantization seed (the calibration windows' and the method's) and the
table shows the mean and the min–max over the seeds; the headline is the test split, dev is for choosing settings.
Results are appended to a JSON-lines file (one line per row and seed) so an interrupted run resumes; the table is
printed from that file.

    python bench/quality.py                                 # every row, seed 0 (hours on 2 cores)
    python bench/quality.py --rows gptq-3 gptq-4 --seeds 0 1 2
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


TEXTS = ("wiki", "pydocs")  # the calibration's domain, another
SPLITS = ("test", "dev")  # test: the reported figures; dev: for choosing settings
STATS = ("perplexity", "reference_perplexity", "kl_divergence", "kl_median", "kl_p99", "delta_p_mean",
         "delta_p_p01", "delta_p_p99", "top1_agreement")


def scores(qmodel, tok, args, splits: tuple[str, ...] = SPLITS) -> tuple[dict, str]:
    """``qmodel`` (bf16) against the bf16 original on each split of each text -> ({"wiki/test": {stat: value}},
    the test split's protocol line)."""
    out, protocol = {}, ""
    for text in TEXTS:
        for split in splits:
            ev = evaluate(qmodel, tok, text=text, seqlen=args.seqlen, max_windows=args.windows,
                          reference=args.reference, split=split)
            out[f"{text}/{split}"] = {**{k: getattr(ev, k) for k in STATS}, "windows": ev.windows,
                                      "tokens": ev.tokens}
            protocol = protocol or ev.protocol()
    return out, protocol


def flat(found: dict) -> dict:
    """The test split's figures under the keys older readers of the results know (wiki plain, pydocs ``ood_``)."""
    out = {}
    for text, prefix in (("wiki", ""), ("pydocs", "ood_")):
        got = found.get(f"{text}/test")
        if got:
            out.update({f"{prefix}perplexity": got["perplexity"], f"{prefix}bf16_perplexity":
                        got["reference_perplexity"], f"{prefix}kl": got["kl_divergence"],
                        f"{prefix}top1": got["top1_agreement"]})
    return out


def run_row(key: str, model, tok, calib: torch.Tensor, args, seed: int = 0) -> dict:
    method, config, label = ROWS[key]
    config = dataclasses.replace(config, seed=seed)
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
        found, _ = scores(qb, tok, args, splits=("test",))
        before_kd = {"quant_seconds": quant_only, "scores": found, **flat(found)}
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

        name = key if seed == args.seeds[0] else f"{key}-seed{seed}"
        save_quantized(model, tok, result.states, Path(args.save_dir) / name, dtype=torch.bfloat16,
                       report={"model": {"source": args.model}, "summary": result.summary()})
    qmodel = qmodel.to(torch.bfloat16)
    found, protocol = scores(qmodel, tok, args)
    # The calibration windows themselves (seen while quantizing), against the original on the same windows:
    # the gap to the held-out numbers shows how much a method fitted its calibration text.
    seen = None if args.skip_calib_eval else evaluate(qmodel, tok, windows=calib[: args.calib_samples],
                                                       reference=args.reference)
    return {
        "row": key, "seed": seed, "eval_split": "test", "scores": found, **flat(found), "ood_text": "pydocs",
        "timings": result.summary()["timings"],
        "calib_perplexity": seen and seen.perplexity, "calib_kl": seen and seen.kl_divergence,
        "calib_bf16_perplexity": seen and seen.reference_perplexity,
        "model": args.model, "label": label, "method": method, "config": config.to_dict(),
        "before_distill": before_kd, "model_metrics": result.model_metrics, "load": os.getloadavg(),
        "index_bits": result.bits.index_bits_per_weight, "total_bits": result.bits.total_bits_per_weight,
        "quant_seconds": seconds, "threads": torch.get_num_threads(), "windows": args.windows,
        "calib": {"samples": args.calib_samples, "seqlen": args.calib_seqlen, "text": "wiki", "split": "calib",
                  "seed": seed},
        "protocol": protocol,
        "layers": [
            {k: r.to_dict()[k] for k in ("name", "rel_proxy_loss", "rel_weight_error", "rel_output_error")}
            for r in result.reports
        ],
    }


def spread(values: list[float], digits: int = 3) -> str:
    """The mean of ``values`` and, over more than one, their min–max: "1.234 (1.220–1.250)"."""
    text = f"{sum(values) / len(values):.{digits}f}"
    if len(values) > 1:
        text += f" ({min(values):.{digits}f}–{max(values):.{digits}f})"
    return text


def by_row(records: list[dict]) -> dict[str, list[dict]]:
    """Records of the new protocol (per-split scores) grouped by row, each row's seeds in order."""
    rows: dict[str, list[dict]] = {}
    for r in records:
        if isinstance(r.get("scores"), dict):
            rows.setdefault(r["row"], []).append(r)
    return {k: sorted(v, key=lambda r: r.get("seed") or 0) for k, v in rows.items()}


def row_cells(group: list[dict], text: str) -> list[str]:
    """``text``'s test split: × bf16 and KL mean (mean and min–max over the seeds), KL median and p99, Δp of the
    original's top token and same top token (means over the seeds); and × bf16 on its dev split."""
    def values(split: str, stat: str) -> list[float]:
        return [r["scores"][f"{text}/{split}"][stat] for r in group if f"{text}/{split}" in r["scores"]]

    def ratios(split: str) -> list[float]:
        return [a / b for a, b in zip(values(split, "perplexity"), values(split, "reference_perplexity"))]

    if not values("test", "perplexity"):
        return ["-"] * 7
    def mean(stat: str, digits: int, scale: float = 1.0, sign: str = "") -> str:
        got = values("test", stat)
        return f"{scale * sum(got) / len(got):{sign}.{digits}f}"

    dev = ratios("dev")
    return [spread(ratios("test")), spread(values("test", "kl_divergence")), mean("kl_median", 4),
            mean("kl_p99", 2), mean("delta_p_mean", 2, 100, "+") + "%", mean("top1_agreement", 1, 100) + "%",
            spread(dev) if dev else "-"]


def print_table(records: list[dict], model: str) -> None:
    groups = by_row(records)
    old = sorted({r["row"] for r in records if not isinstance(r.get("scores"), dict)})
    first = next(iter(groups.values()), [{}])[0]
    print(f"\n{model}. Protocol: calibration = windows of the wiki 'calib' split (seeded); evaluation = the held-out "
          "'test' split (headline) and 'dev' split of wiki (the calibration's domain) and pydocs (another), "
          "windows spread over each split; quantized and original both bf16; mean (min–max) over the seeds.")
    if first:
        print(f"evaluation: {first['protocol']}; calibration: {first['calib']['samples']} x "
              f"{first['calib']['seqlen']} tokens; threads: {first['threads']}")
    header = ["row", "seeds", "total bits"]
    for text in TEXTS:
        header += [f"{text} test × bf16", "KL mean", "KL median", "KL p99", "Δp mean", "same top",
                   f"{text} dev × bf16"]
    header.append("quant s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key, group in groups.items():
        line = [key, " ".join(str(r.get("seed", 0)) for r in group),
                f"{sum(r['total_bits'] for r in group) / len(group):.2f}"]
        for text in TEXTS:
            line += row_cells(group, text)
        line.append(spread([r["quant_seconds"] for r in group], 0))
        print("| " + " | ".join(line) + " |")
    if old:
        print(f"(old protocol, not shown: {', '.join(old)}: evaluated on the first windows of dev and test together)")


def read_results(files: list[Path]) -> dict[tuple[str, int | None], dict]:
    """Records by (row, seed); a later file's, or a later line's, replaces an earlier one."""
    done = {}
    for file in files:
        if file.is_file():
            for line in file.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    done[(rec["row"], rec.get("seed"))] = rec
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="model to quantize (a built-in name such as gemma3-270m, a directory or a .gguf file); "
                             "keep one results file per model")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), help="rows to run (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0],
                        help="quantization seeds (calibration windows and the method's own); each row runs once per "
                             "seed, the table shows mean and min–max")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--results", nargs="+", default=["bench/results/quality.jsonl"],
                        help="JSON-lines files: new rows are appended to the first; the table reads them all "
                             "(a later file's row replaces an earlier one's)")
    parser.add_argument("--rerun", action="store_true", help="recompute rows already in the results file")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=16, help="evaluation windows per text and split")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--skip-calib-eval", action="store_true",
                        help="do not evaluate on the calibration windows themselves (saves time)")
    parser.add_argument("--save-dir", help="also write each row's packed checkpoint under DIR/ROW (DIR/ROW-seedN for "
                                           "the seeds after the first)")
    args = parser.parse_args()
    if args.list:
        for key, (_, _, label) in ROWS.items():
            print(f"{key:<26} {label}")
        return
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; allowed: {', '.join(ROWS)}")
    if any(seed < 0 for seed in args.seeds):
        parser.error(f"seeds must be >= 0, got {args.seeds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.results[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    done = read_results([Path(p) for p in args.results[1:]] + [path])
    if not args.table_only:
        model, tok = load_model(args.model, dtype=torch.float32)
        args.reference, _ = load_model(args.model, dtype=torch.bfloat16)
        # enough windows for every row; a row takes the first ones (one seed stream: the first n of more are
        # the n windows themselves)
        most = max(with_heldout(args.calib_samples, ROWS[key][1]) for key in args.rows)
        for seed in args.seeds:
            calib = calibration_windows(tok, "wiki", most, args.calib_seqlen, seed=seed)
            for key in args.rows:
                if (key, seed) in done and not args.rerun:
                    continue
                rec = run_row(key, model, tok, calib, args, seed)
                done[(key, seed)] = rec
                with open(path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"{key} seed {seed}: wiki test {rec['perplexity'] / rec['bf16_perplexity']:.3f}x bf16, "
                      f"pydocs test {rec['ood_perplexity'] / rec['ood_bf16_perplexity']:.3f}x; bits "
                      f"{rec['index_bits']:.2f}/{rec['total_bits']:.2f} in {rec['quant_seconds']:.0f}s", flush=True)
    order = {k: i for i, k in enumerate(ROWS)}
    chosen = [rec for (row, seed), rec in done.items() if row in args.rows and (seed in args.seeds or seed is None)]
    chosen.sort(key=lambda r: (order.get(r["row"], len(order)), r.get("seed") or 0))
    print_table(chosen, args.model)
    if os.environ.get("QUALITY_JSON"):
        print(json.dumps(chosen))


if __name__ == "__main__":
    main()
