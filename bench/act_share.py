"""How much of a W4A8 / W8A8 checkpoint's error its activation quantizer makes: the checkpoint evaluated as stored
and again with every linear's activation quantizer switched off (its weights alone).

Protocol: the checkpoint and the model it was made from (its report names it), both loaded in bf16, the LM head as
stored (head bits 0); `eval`'s windows of each text's held-out split (``--split``: dev to choose settings, test to
report), ``--max-windows`` of 512 tokens spread over it; perplexity against the original's, KL(P_orig || P_quant)
per token and the share of positions whose top token agrees. The "weights alone" row is the same model object with
``act_bits`` set to 16 on every scalar linear, so the two rows differ in the activations only.

    python bench/act_share.py --checkpoint DIR [--split dev] [--max-windows 16] [--threads 2]
    python bench/act_share.py --make tiny-random-llama --checkpoint DIR ...   (first quantizes that model with RTN
        W4A8 into DIR: a checkpoint to try the script on)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.api import load_model, source_model_of  # noqa: E402
from vptq_core.eval import evaluate  # noqa: E402


def activation_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that quantize their inputs (``act_bits`` < 16)."""
    return [m for m in model.modules() if getattr(m, "act_bits", 16) < 16]


def make_checkpoint(model: str, out: Path) -> None:
    """RTN W4A8 (groups of 32, per-token activations) of ``model`` into ``out``: a small checkpoint to run on."""
    from vptq_core.api import quantize_to_dir
    from vptq_core.quant import methods
    from vptq_core.quant.config import CalibConfig

    config = methods.make_config("rtn", {"bits": 4, "group_size": 32, "act_bits": 8})
    quantize_to_dir(model, "rtn", config, CalibConfig(samples=2, seqlen=32), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a quantized checkpoint directory with act_bits < 16")
    ap.add_argument("--make", metavar="MODEL", help="first quantize MODEL with RTN W4A8 into --checkpoint")
    ap.add_argument("--split", default="dev", choices=("dev", "test"))
    ap.add_argument("--texts", nargs="+", default=["wiki", "pydocs"])
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.checkpoint)
    if args.make:
        make_checkpoint(args.make, path)
    source = source_model_of(str(path))
    if not source:
        sys.exit(f"{path}: no quant_report.json naming the model it was made from")
    ref, tok = load_model(source, dtype=torch.bfloat16)
    model, _ = load_model(str(path), dtype=torch.bfloat16, head_bits=0)
    layers = activation_layers(model)
    if not layers:
        sys.exit(f"{path}: no linear quantizes its activations (act_bits 16 everywhere): nothing to compare")
    bits = sorted({(m.act_bits, m.act_granularity) for m in layers})
    print(f"# {path}: {len(layers)} linears quantize their inputs ({', '.join(f'{b}-bit {g}' for b, g in bits)}); "
          f"original {source} in bf16; {args.split} split, up to {args.max_windows} windows of {args.seqlen}")
    print("| activations | text | perplexity | × original | KL | same top |")
    print("|---|---|---|---|---|---|")
    for label in ("as stored", "weights alone"):
        if label == "weights alone":
            for m in layers:
                m.act_bits = 16
        for text in args.texts:
            r = evaluate(model, tok, text=text, seqlen=args.seqlen, max_windows=args.max_windows, reference=ref,
                         split=args.split)
            print(f"| {label} | {text} | {r.perplexity:.3f} | {r.perplexity / r.reference_perplexity:.3f} | "
                  f"{r.kl_divergence:.4f} | {100 * r.top1_agreement:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
