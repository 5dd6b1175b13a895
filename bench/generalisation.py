"""In-domain vs out-of-domain quality of quantized checkpoints (e.g. LRQ low-rank vs full-scale).

Calibration text is Wikipedia (the bundled wiki, even articles). Each checkpoint is evaluated against the
bf16 original on (1) the held-out wiki articles (odd articles: same domain, unseen text) and (2) Python's
own documentation (``pydoc_data.topics`` from the standard library: technical prose and code, a different
domain). Same protocol for both: non-overlapping windows of ``--seqlen`` tokens, at most ``--windows``,
ppl = exp(mean NLL), mean KL(P_bf16 || P_quant), top-1 agreement; both models run in bf16.

    python bench/quality.py --calib-samples 4 --rows lrq-w3a16-96 lrq-w3a16-full-96 --save-dir out/q
    python bench/generalisation.py out/q/lrq-w3a16-96 out/q/lrq-w3a16-full-96
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.eval import evaluate  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.storage.checkpoint import load_quantized  # noqa: E402


def pydoc_text(path: Path) -> str:
    """Write Python's documentation topics to ``path`` (UTF-8) and return the path as a string."""
    import pydoc_data.topics as topics

    path.write_text("\n\n".join(topics.topics[k] for k in sorted(topics.topics)), encoding="utf-8")
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", help="checkpoint directories written by save_quantized")
    parser.add_argument("--original", default="smollm2-135m-instruct")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for ckpt in args.checkpoints:
        if not (Path(ckpt) / "config.json").is_file():
            parser.error(f"{ckpt!r} is not a checkpoint directory (no config.json)")
    reference, tok = load_model(args.original, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        texts = {"wiki held-out": "wiki", "python docs": pydoc_text(Path(tmp) / "pydoc.txt")}
        print(f"{args.windows} x {args.seqlen}-token windows per text; reference {args.original} in bf16")
        print("| checkpoint | text | ppl | bf16 ppl | ppl × bf16 | KL | top-1 |")
        print("|---|---|---|---|---|---|---|")
        for ckpt in args.checkpoints:
            model, _ = load_quantized(ckpt, dtype=torch.bfloat16)
            for name, text in texts.items():
                ev = evaluate(model, tok, text=text, seqlen=args.seqlen, max_windows=args.windows,
                              reference=reference)
                print(f"| {Path(ckpt).name} | {name} | {ev.perplexity:.2f} | {ev.reference_perplexity:.2f} | "
                      f"{ev.perplexity / ev.reference_perplexity:.2f} | {ev.kl_divergence:.3f} | "
                      f"{ev.top1_agreement:.1%} |", flush=True)


if __name__ == "__main__":
    main()
