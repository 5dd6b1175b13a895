"""In-domain vs out-of-domain quality of quantized checkpoints (e.g. LRQ low-rank vs full-scale).

Calibration text is Wikipedia (the bundled wiki's "calib" split). Each checkpoint is evaluated against the bf16
original on the held-out ``--split`` (test by default; dev for choosing settings; docs/methods.md#evaluation-protocol)
of (1) wiki (same domain, unseen documents) and (2) pydocs (Python's documentation topics: technical prose and code,
a different domain). Same protocol for both: non-overlapping windows of ``--seqlen`` tokens, at most ``--windows``
spread over the split, ppl = exp(mean NLL), KL(P_bf16 || P_quant) per token (mean, median, p99), Δp of the
original's top token, same top token; both models run in bf16.

    python bench/quality.py --calib-samples 4 --rows lrq-w3a16-96 lrq-w3a16-full-96 --save-dir out/q
    python bench/generalisation.py out/q/lrq-w3a16-96 out/q/lrq-w3a16-full-96
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.data import DEFAULT_EVAL_SPLIT, EVAL_SPLITS, TEXTS  # noqa: E402
from vptq_core.eval import evaluate  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.storage.checkpoint import load_quantized  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", help="checkpoint directories written by save_quantized")
    parser.add_argument("--original", default="smollm2-135m-instruct")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--split", choices=EVAL_SPLITS, default=DEFAULT_EVAL_SPLIT,
                        help="held-out split of both texts: test to report, dev to choose settings")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for ckpt in args.checkpoints:
        if not (Path(ckpt) / "config.json").is_file():
            parser.error(f"{ckpt!r} is not a checkpoint directory (no config.json)")
    reference, tok = load_model(args.original, dtype=torch.bfloat16)
    print(f"{args.windows} x {args.seqlen}-token windows of the {args.split} split of each text; reference "
          f"{args.original} in bf16")
    print("| checkpoint | text | ppl | bf16 ppl | ppl × bf16 | KL mean | KL median | KL p99 | Δp mean | same top |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ckpt in args.checkpoints:
        model, _ = load_quantized(ckpt, dtype=torch.bfloat16)
        for text in TEXTS:
            ev = evaluate(model, tok, text=text, seqlen=args.seqlen, max_windows=args.windows, reference=reference,
                          split=args.split)
            print(f"| {Path(ckpt).name} | {text} | {ev.perplexity:.2f} | {ev.reference_perplexity:.2f} | "
                  f"{ev.perplexity / ev.reference_perplexity:.3f} | {ev.kl_divergence:.3f} | {ev.kl_median:.4f} | "
                  f"{ev.kl_p99:.2f} | {100 * ev.delta_p_mean:+.2f}% | {ev.top1_agreement:.1%} |", flush=True)


if __name__ == "__main__":
    main()
