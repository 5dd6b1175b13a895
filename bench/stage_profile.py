"""The block stage's work per block, piece by piece: what it pushes through each block, in which dtype, what each
piece costs on this machine in float32 and in the bf16 path, and what the bf16 path changes in the numbers.

Usage: python bench/stage_profile.py [--shape qwen05b] [--blocks 2] [--samples 16] [--seqlen 512] [--threads 2]
                                     [--results FILE.txt]

Protocol: a random-weight model of ``--shape`` (bench/scaling.py's shapes: qwen05b = 896 wide, 4864 MLP, 14/2
heads, q/k/v biases; smollm2 = SmolLM2-135M's shape; tiny) with ``--blocks`` blocks, random calibration tokens
(``--samples`` windows of ``--seqlen``). The inputs of the last block come from pushing the windows through the
blocks before it, so its activations are a block deep. On that block, each piece runs once to warm up and then
``--repeats`` times in each variant, the variants alternated (float32 then bf16, and again), the fastest kept:

    hessians_targets   the original block on every window, one Hessian per distinct linear input accumulated by
                       hooks and the block's outputs kept (forward.hessians_and_targets): float32 / bf16 autocast
                       forward with bf16 Hessian products (float32 sums)
    block_outputs      the block on every window (forward.run_batched), the pass that gives the next block's inputs
    inverse_hessian    the upper Cholesky factor of H⁻¹ for each distinct input (q/k/v share one, gate/up share one):
                       Cholesky factor of the explicit inverse (cholesky, cholesky_inverse, cholesky) / one Cholesky
                       factor of the reversed H and one triangular solve (hessian.inverse_hessian_cholesky)

Then the numbers: relative Frobenius difference of the bf16 path's Hessians and targets to float32's, and the
factor's to a float64 reference for both methods; and VPTQ (v6 k4096, 3 k-means iterations) on q_proj and down_proj
with the float32 and the bf16 Hessian, both scored on the float32 Hessian (relative proxy loss), beside the same
with three k-means seeds on the float32 Hessian (the noise one run has anyway).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scaling import SHAPES, build_model  # noqa: E402

from vptq_core.quant.blocks import block_linears, decoder_blocks  # noqa: E402
from vptq_core.quant.config import VPTQConfig  # noqa: E402
from vptq_core.quant.forward import (  # noqa: E402
    BATCH,
    block_dtype,
    capture_block_inputs,
    hessians_and_targets,
    kwargs_to,
    run_batched,
)
from vptq_core.quant.hessian import inverse_hessian_cholesky, prepare_hessian, proxy_loss  # noqa: E402
from vptq_core.quant.vptq import vptq_quantize  # noqa: E402


def inverse_via_explicit_inverse(H: torch.Tensor) -> torch.Tensor:
    """The factor as computed before: Cholesky of H, the explicit inverse, Cholesky of that (upper)."""
    L = torch.linalg.cholesky(H)
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def fastest(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def block_inputs(model, args) -> tuple[torch.nn.Module, torch.Tensor, dict]:
    """The last block, its inputs (float32, pushed through the blocks before it) and its arguments."""
    ids = torch.randint(0, args.vocab, (args.samples, args.seqlen), generator=torch.Generator().manual_seed(1))
    inps, kwargs = capture_block_inputs(model, ids)
    inps, kwargs = inps.float(), kwargs_to(kwargs, torch.device("cpu"), torch.float32)
    blocks = decoder_blocks(model)
    for b in range(len(blocks) - 1):
        inps = run_batched(blocks[b], inps, kwargs.at(b))
    return blocks[-1], inps, kwargs.at(len(blocks) - 1)


def distinct_hessians(hessians: dict) -> dict[str, torch.Tensor]:
    """One entry per distinct input (the first linear reading it)."""
    seen: dict[int, str] = {}
    for name, H in hessians.items():
        seen.setdefault(id(H), name)
    return {name: hessians[name] for name in seen.values()}


def profile(args) -> list[str]:
    model = build_model(args.shape, args.blocks, args.vocab, args.seed)
    lines: list[str] = []
    with torch.no_grad():
        block, inps, kw = block_inputs(model, args)
        linears = block_linears(block)
        bf16 = torch.bfloat16
        variants = {"float32": torch.float32, "bf16": bf16}
        results: dict[tuple[str, str], object] = {}
        seconds: dict[tuple[str, str], float] = {}
        for phase, fn in (("hessians_targets", lambda d: hessians_and_targets(block, linears, inps, kw, d)),
                          ("block_outputs", lambda d: run_batched(block, inps, kw, d))):
            for name, dtype in variants.items():  # warm-up, and the result each variant gives
                results[(phase, name)] = fn(dtype)
            for _ in range(args.repeats):  # alternated: float32, bf16, float32, bf16, ...
                for name, dtype in variants.items():
                    t = fastest(lambda fn=fn, dtype=dtype: fn(dtype), 1)
                    seconds[(phase, name)] = min(seconds.get((phase, name), float("inf")), t)
        H32, T32 = results[("hessians_targets", "float32")]
        H16, T16 = results[("hessians_targets", "bf16")]
        prepared = {}
        for name, H in distinct_hessians(H32).items():
            W = linears[name].weight.detach().float()
            prepared[name] = prepare_hessian(W, H, VPTQConfig().damp_percent)[1]
        inv_s = {"float32": 0.0, "bf16": 0.0}
        inv_err = {"explicit inverse": [], "reversed Cholesky": []}
        for Hd in prepared.values():
            ref = inverse_via_explicit_inverse(Hd.double())
            old, new = inverse_via_explicit_inverse(Hd), inverse_hessian_cholesky(Hd)
            inv_err["explicit inverse"].append(rel(old, ref))
            inv_err["reversed Cholesky"].append(rel(new, ref))
            best_old = best_new = float("inf")
            for _ in range(args.repeats):
                best_old = min(best_old, fastest(lambda Hd=Hd: inverse_via_explicit_inverse(Hd), 1))
                best_new = min(best_new, fastest(lambda Hd=Hd: inverse_hessian_cholesky(Hd), 1))
            inv_s["float32"] += best_old
            inv_s["bf16"] += best_new

    n, seq = inps.shape[:2]
    sizes = ", ".join(f"{name} {H.shape[0]}" for name, H in distinct_hessians(H32).items())
    lines += [
        f"### {args.shape}: one block's pieces ({n} windows x {seq} tokens, {BATCH} windows per call)", "",
        "What the block stage runs per block: the original block once on every window (Hessians by hooks on its "
        "linears, its outputs kept as targets), the quantized block once on every window (the next block's "
        "inputs and the output error); with target_chain 'fp' the original block once more on the original "
        f"model's own activations. Distinct linear inputs (one Hessian, one inverse factor each): {sizes}. "
        f"This machine's block dtype (auto): {block_dtype('cpu')}.", "",
        "| piece | float32 s | bf16 path s | float32 / bf16 |", "|---|---|---|---|",
    ]
    for phase in ("hessians_targets", "block_outputs"):
        a, b = seconds[(phase, "float32")], seconds[(phase, "bf16")]
        lines.append(f"| {phase} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    a, b = inv_s["float32"], inv_s["bf16"]
    lines.append(f"| inverse_hessian (explicit inverse / reversed Cholesky, both float32) | {a:.3f} | {b:.3f} | "
                 f"{a / b:.2f}x |")
    lines += ["", "| what the bf16 path changes | relative difference |", "|---|---|"]
    for name, H in distinct_hessians(H32).items():
        lines.append(f"| Hessian of {name}'s input (bf16 path vs float32) | {rel(H16[name], H):.2e} |")
    lines.append(f"| block outputs, bf16 autocast vs float32 | {rel(T16, T32):.2e} |")
    for method, errs in inv_err.items():
        lines.append(f"| inverse factor by {method} vs float64, worst input | {max(errs):.2e} |")
    lines += ["", "| layer | rel. proxy loss, float32 H | bf16-path H (scored on float32 H) | ratio | "
              "k-means seeds 0, 1, 2 on float32 H |", "|---|---|---|---|---|"]
    for name in args.layers:
        W = linears[name].weight.detach().float()
        config = VPTQConfig(kmeans_iters=3)
        loss32 = proxy_loss(W, vptq_quantize(W, H32[name], config).weight, H32[name])[1]
        loss16 = proxy_loss(W, vptq_quantize(W, H16[name], config).weight, H32[name])[1]
        seeds = [proxy_loss(W, vptq_quantize(W, H32[name], VPTQConfig(kmeans_iters=3, seed=s)).weight,
                            H32[name])[1] for s in range(3)]
        ratio = f"{loss16 / loss32:.4f}" if loss32 > 0 else "-"  # a layer k-means fits exactly: nothing to compare
        lines.append(f"| {name} | {loss32:.5f} | {loss16:.5f} | {ratio} | "
                     + ", ".join(f"{s:.5f}" for s in seeds) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen05b", choices=list(SHAPES))
    parser.add_argument("--blocks", type=int, default=2, help="blocks of the model; the last one is profiled")
    parser.add_argument("--samples", type=int, default=16, help="calibration windows")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per variant (alternated), fastest kept")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", nargs="+", default=["self_attn.q_proj", "mlp.down_proj"],
                        help="linears VPTQ-quantized with each Hessian")
    parser.add_argument("--results", help="also write the output to this file")
    args = parser.parse_args()
    if args.blocks < 1 or args.samples < 1 or args.seqlen < 2 or args.repeats < 1:
        raise SystemExit("--blocks, --samples and --repeats must be >= 1, --seqlen >= 2")
    torch.set_num_threads(args.threads)
    header = [f"protocol: {platform.processor() or platform.machine()}, {args.threads} torch threads, random-weight "
              f"{args.shape} with {args.blocks} blocks (the last profiled), {args.samples} x {args.seqlen} random "
              f"tokens, one warm-up, {args.repeats} timed runs per variant alternated (fastest kept); load average "
              f"at start {os.getloadavg()[0]:.1f}", ""]
    lines = header + profile(args) + ["", f"load average at end {os.getloadavg()[0]:.1f}"]
    text = "\n".join(lines)
    print(text)
    if args.results:
        Path(args.results).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
