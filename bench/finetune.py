"""Layer-wise fine-tuning of 2-bit VPTQ on SmolLM2-135M-Instruct: what each piece buys.

``blocks``: layer-wise fine-tuning variants on real blocks. Protocol: SmolLM2 blocks ``--blocks`` with
inputs from the original blocks before them, VPTQ ``--preset`` (default "2.5 bits") quantization of the block
on ``--calib`` wiki calibration windows x ``--seqlen`` (512) tokens (even articles, seed 0); each variant
fine-tunes a copy of the quantized block; error = relative block-output error ||Y_q - Y||^2 / ||Y||^2 on
``--held`` windows of the held-out wiki split (odd articles) and of Python's docs (pydocs, odd topics), and on
the training windows ("fit"). ``legacy`` is the fine-tuning of the previous version (centroids only, random
batches of 2 with replacement, constant lr, accepted on the first 2 training windows).

The whole recipe (quantization, then end-to-end distillation, evaluated before and after distilling on
held-out wiki and pydocs) is measured by ``bench/quality.py`` rows ``*-kd*``.

    python bench/finetune.py blocks [--blocks 3 15 27] [--iters 32]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.data import calibration_windows, eval_windows  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.blocks import block_linears, decoder_blocks  # noqa: E402
from vptq_core.quant.config import VPTQConfig  # noqa: E402
from vptq_core.quant.finetune import finetune_block_centroids  # noqa: E402
from vptq_core.quant.forward import (  # noqa: E402
    capture_block_inputs,
    hessians_and_targets,
    run_batched,
    run_block,
)
from vptq_core.quant.states import VQLayerState  # noqa: E402
from vptq_core.quant.vptq import PRESETS, vptq_quantize  # noqa: E402


# ------------------------------------------------------------------------------------------- blocks
def legacy_finetune(block, states, inputs, targets, forward, config, batch_size=2) -> dict:
    """The previous version's fine-tuning, for comparison: centroids only, Adam at a constant lr on random
    batches (with replacement), accepted when the loss on the first ``batch_size`` windows went down."""
    linears = {name: block.get_submodule(name) for name in states}
    keys = ("centroids", "res_centroids", "outlier_centroids")
    params = {name: {k: nn.Parameter(getattr(st, k).detach().float().clone()) for k in keys
                     if getattr(st, k) is not None} for name, st in states.items()}
    optimizer = torch.optim.Adam([p for d in params.values() for p in d.values()], lr=config.finetune_lr)
    gen = torch.Generator().manual_seed(config.seed)
    probe = torch.arange(min(batch_size, inputs.shape[0]))
    saved = {name: lin.weight for name, lin in linears.items()}

    def loss_on(idx):
        for name, lin in linears.items():
            del lin.weight
            lin.weight = dataclasses.replace(states[name], **params[name]).dequantize()
        out = forward(block, inputs[idx])
        return torch.mean((out.float() - targets[idx].float()) ** 2)

    try:
        with torch.enable_grad():
            with torch.no_grad():
                before = float(loss_on(probe))
            for _ in range(config.finetune_iters):
                idx = torch.randint(0, inputs.shape[0], (min(batch_size, inputs.shape[0]),), generator=gen)
                optimizer.zero_grad(set_to_none=True)
                loss_on(idx).backward()
                optimizer.step()
            with torch.no_grad():
                after = float(loss_on(probe))
    finally:
        for name, lin in linears.items():
            del lin.weight
            lin.weight = saved[name]
    with torch.no_grad():
        for name, lin in linears.items():
            if after <= before:
                for key, p in params[name].items():
                    setattr(states[name], key, p.detach().clone())
            lin.weight.data.copy_(states[name].dequantize())
    return {"accepted": after <= before}


def block_variants(iters: int) -> dict[str, tuple[dict, dict]]:
    """name -> (VPTQConfig overrides, finetune kwargs)."""
    new = {"finetune_iters": iters}
    return {
        "no fine-tuning": ({}, {}),
        "legacy: centroids, const lr, random batches, accept on 2 train windows": ({"finetune_iters": iters},
                                                                                  {"legacy": True}),
        "centroids, const lr, epochs, held-out, fp32": (
            {**new, "finetune_norm_lr": 0.0, "train_dtype": "float32"}, {"lr_schedule": "constant"}),
        "centroids, cosine, epochs, held-out, fp32": ({**new, "finetune_norm_lr": 0.0, "train_dtype": "float32"}, {}),
        "centroids, cosine, held-out, bf16": ({**new, "finetune_norm_lr": 0.0}, {}),
        "+ norms lr 1e-3 (bf16)": ({**new, "finetune_norm_lr": 1e-3}, {}),
        "+ norms lr 1e-2 (bf16)": ({**new, "finetune_norm_lr": 1e-2}, {}),
        "+ norms 1e-3, centroid lr 3e-3": ({**new, "finetune_norm_lr": 1e-3, "finetune_lr": 3e-3}, {}),
        "+ norms 1e-3, batch 4": ({**new, "finetune_norm_lr": 1e-3, "finetune_batch": 4}, {}),
        "+ norms 1e-3, 2x steps, eval every 1/4": (
            {**new, "finetune_iters": 2 * iters, "finetune_norm_lr": 1e-3, "finetune_eval_every": iters // 2}, {}),
    }


def run_blocks(args) -> None:
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=torch.float32)
    calib = calibration_windows(tok, "wiki", args.calib, args.seqlen, seed=0)
    held_wiki = eval_windows(tok, "wiki", args.seqlen, args.held)
    held_py = eval_windows(tok, "pydocs", args.seqlen, args.held)
    ids = torch.cat([calib, held_wiki, held_py])
    n, h = args.calib, args.held
    parts = {"fit": slice(0, n), "wiki held-out": slice(n, n + h), "pydocs held-out": slice(n + h, n + 2 * h)}
    base = VPTQConfig(**PRESETS[args.preset])
    print(f"blocks {args.blocks}, VPTQ {args.preset} ({base.vector_len=}, {base.num_centroids=}), {n} calibration "
          f"windows (held out for decisions: the last {round(n * base.finetune_holdout)}), {h}+{h} held-out "
          f"windows x {args.seqlen} tokens, {args.iters} steps, {args.threads} threads; relative block-output error")
    print("| block | variant | fit | wiki held-out | pydocs held-out | seconds |")
    print("|---|---|---|---|---|---|")
    records = []
    with torch.no_grad():
        inps, kwargs = capture_block_inputs(model, ids)
        blocks = decoder_blocks(model)
        done = 0
        for b in sorted(args.blocks):
            for i in range(done, b):
                inps = run_batched(blocks[i], inps, kwargs)
            done = b
            block = blocks[b]
            kw = kwargs.at(b)
            linears = block_linears(block)
            hessians, _ = hessians_and_targets(block, linears, inps[:n], kw)
            targets = run_batched(block, inps, kw)
            qblock = copy.deepcopy(block)
            states: dict[str, VQLayerState] = {}
            cache: dict = {}
            t0 = time.perf_counter()
            for name, lin in block_linears(qblock).items():
                res = vptq_quantize(lin.weight.data, hessians[name], base, lin.bias, hessian_cache=cache)
                lin.weight.data.copy_(res.weight)
                states[name] = res.state
            quant_s = time.perf_counter() - t0
            del hessians

            def forward(blk, x, kw=kw):
                return run_block(blk, x, kw)

            def rel(blk, part, targets=targets, forward=forward):
                sl = parts[part]
                out = run_batched(blk, inps[sl], kw)
                return float(((out - targets[sl]) ** 2).sum() / (targets[sl] ** 2).sum())

            for label, (overrides, extra) in block_variants(args.iters).items():
                if args.only and not any(s in label for s in args.only):
                    continue
                work = copy.deepcopy(qblock)
                work_states = {k: copy.deepcopy(v) for k, v in states.items()}
                config = dataclasses.replace(base, **overrides)
                t0 = time.perf_counter()
                metrics = {}
                if config.finetune_iters:
                    if extra.get("legacy"):
                        metrics = legacy_finetune(work, work_states, inps[:n], targets[:n], forward, config)
                    else:
                        metrics = finetune_block_centroids(work, work_states, inps[:n], targets[:n], forward, config,
                                                           **extra)
                seconds = time.perf_counter() - t0
                errs = {part: rel(work, part) for part in parts}
                records.append({"block": b, "variant": label, **errs, "seconds": seconds, "quant_seconds": quant_s,
                                "metrics": metrics})
                print(f"| {b} | {label} | {errs['fit']:.5f} | {errs['wiki held-out']:.5f} | "
                      f"{errs['pydocs held-out']:.5f} | {seconds:.0f} |", flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in records) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("blocks", help="layer-wise fine-tuning variants on real blocks")
    p.add_argument("--blocks", type=int, nargs="+", default=[3, 15, 27])
    p.add_argument("--calib", type=int, default=16)
    p.add_argument("--held", type=int, default=4)
    p.add_argument("--iters", type=int, default=32)
    p.add_argument("--preset", default="2.5 bits", choices=list(PRESETS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a built-in model (tiny-random-llama for a quick check of the script)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window")
    p.add_argument("--only", nargs="*", help="run only variants whose label contains one of these strings")
    p.add_argument("--out", help="write the records as JSON lines")
    args = parser.parse_args()
    if args.cmd == "blocks":
        run_blocks(args)


if __name__ == "__main__":
    main()
