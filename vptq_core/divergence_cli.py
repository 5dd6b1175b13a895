"""``python -m vptq_core diff``: where a quantized run departs from its original on a text, token by token,
written as one self-contained HTML file (``divergence_html``); a one-line summary on stdout."""

from __future__ import annotations

import argparse
from pathlib import Path

from .divergence import DEFAULT_MAX_TOKENS

HELP = "per-token KL between a run and its original on a text, as a self-contained HTML file"


def add_diff_parser(sub, positive, head_bits_choices: list[str], head_bits_help: str) -> argparse.ArgumentParser:
    """The ``diff`` subcommand's flags (``positive``: the command line's positive-integer type)."""
    d = sub.add_parser("diff", help=HELP, description=HELP + ".",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--model", required=True, help="the quantized checkpoint directory (or any model name)")
    source = d.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="a UTF-8 text file to compare the two models on")
    source.add_argument("--prompt", help="the text itself, given on the command line")
    d.add_argument("--out", required=True, help="the HTML file to write")
    d.add_argument("--original", default=None, help="the original model (a name or directory); default: the source "
                   "model recorded in the checkpoint")
    d.add_argument("--max-tokens", type=positive, default=DEFAULT_MAX_TOKENS,
                   help="compare at most the text's first this many tokens")
    d.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds (what is done so "
                   "far is written)")
    d.add_argument("--threads", type=positive)
    d.add_argument("--head-bits", choices=head_bits_choices, default="auto", help=head_bits_help)
    return d


def _read_text(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--text {path!r}: no such file (give a UTF-8 text file, or the text itself with --prompt)")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {path!r} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise ValueError(f"--text {path!r} is empty")
    return text


def cmd_diff(args) -> int:
    import torch

    from .api import source_model_of
    from .divergence import compute_divergence
    from .divergence_html import divergence_document, summary_line
    from .models import BUNDLED, load_model

    text = _read_text(args.text) if args.text is not None else args.prompt
    if not text or not text.strip():
        raise ValueError("--prompt is empty: give some text to compare the models on")
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise ValueError(f"--out {args.out!r} must be a file in an existing directory")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    original = args.original or (source_model_of(args.model) if Path(args.model).is_dir() else None)
    if not original:
        raise ValueError(f"--model {args.model!r} records no source model: name the original with --original")
    quantized, tok = load_model(args.model, head_bits=args.head_bits)
    reference, _ = load_model(original, dtype=torch.bfloat16 if original == BUNDLED else None)
    result = compute_divergence(reference, quantized, tok, text=text, max_tokens=args.max_tokens,
                                time_limit_s=args.time_limit)
    if not result.rows:
        raise ValueError(f"nothing was compared: {result.stopped or 'no tokens'}")
    title = f"{Path(args.model).name or args.model} vs its original {original}"
    out.write_text(divergence_document(result, title=title), encoding="utf-8")
    note = result.coverage_note()
    print(f"{summary_line(result.summary)}{f' ({note})' if note else ''} -> {out}")
    return 0

