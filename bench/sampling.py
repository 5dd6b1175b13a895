"""Time of writing calibration windows with the original model (``calib_sampled_share``; ``sampling.sample_windows``):
the model's own forward with transformers' KV cache, the lean decoder, and the lean decoder with the float32 linears
through oneDNN with packed weights (``packed_dense``, what the pipeline runs), in one process.

Protocol: the bundled SmolLM2-135M-Instruct in float32, sampled in each --dtype (float32 is the default on every
machine; ``bfloat16`` runs bf16 copies of the weights, ``auto`` bf16 only where the CPU multiplies it), --rows
windows of --seqlen tokens started from the BOS token, batch 32 as the pipeline uses, the teacher's top-k recorded
as the presets record it; one warm-up of each path and dtype on a short draw, then --runs runs of each, the order
reversed every run; medians. The paths draw with the same per-row generators; the table says how many windows came
out identical to the first row's (rounding moves a draw now and then). ``--repetition``: the share of repeated
4-grams of the windows written (``repetition.repeated_share``) against as many text windows of the calib splits.

    python bench/sampling.py [--rows 32] [--seqlen 256] [--topk 32] [--threads 2] [--runs 2]
    python bench/sampling.py --dtype float32 bfloat16 --paths "lean decoder, packed linears" --repetition
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.data import TEXTS, calibration_windows  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant import lean_decoder, repetition, sampling  # noqa: E402
from vptq_core.quant.device import native_bf16  # noqa: E402

PACKED = "lean decoder, packed linears"
PATHS = ("model forward", "lean decoder", PACKED)
THRESHOLDS = (0.2, 0.3, 0.5, 0.7)  # shares of repeated 4-grams the --repetition table counts windows over


def repetition_rows(name: str, windows: torch.Tensor) -> str:
    """One table row: the repeated-4-gram shares of ``windows`` (median, p90, max) and how many exceed each of
    THRESHOLDS."""
    shares = torch.tensor([repetition.repeated_share(w) for w in windows], dtype=torch.float64)
    over = " | ".join(f"{int((shares > t).sum())}" for t in THRESHOLDS)
    return (f"| {name} | {shares.numel()} | {float(shares.median()):.3f} | {float(shares.quantile(0.9)):.3f} | "
            f"{float(shares.max()):.3f} | {over} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--dtype", nargs="+", default=[sampling.DEFAULT_SAMPLE_DTYPE], choices=sampling.SAMPLE_DTYPES,
                    help="sample dtypes to compare (each path runs in each)")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--repetition", action="store_true",
                    help="also the share of repeated 4-grams of the written windows and of as many text windows "
                         "(wiki and pydocs calib split), against the degenerate-window limit")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a built-in model (tiny-random-llama for a quick check of the script)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=torch.float32)
    model = model.eval()
    starts = torch.full((args.rows, 1), int(model.config.bos_token_id or 1), dtype=torch.long)

    def run(path: str, dtype: str, seqlen: int) -> tuple[float, torch.Tensor]:
        patch = (mock.patch.object(lean_decoder.LeanDecoder, "for_model", return_value=None) if path == "model forward"
                 else contextlib.nullcontext())
        with patch:
            start = time.perf_counter()
            windows, _ = sampling.sample_windows(model, starts, seqlen, seed=0, batch=sampling.SAMPLE_BATCH,
                                                topk=args.topk, dtype=dtype, pack=path == PACKED)
            return time.perf_counter() - start, windows

    combos = [(p, d) for d in args.dtype for p in args.paths]
    for combo in combos:
        run(*combo, 8)
    times: dict[tuple, list[float]] = {c: [] for c in combos}
    drawn: dict[tuple, torch.Tensor] = {}
    for r in range(args.runs):
        for c in (combos if r % 2 == 0 else combos[::-1]):
            seconds, drawn[c] = run(*c, args.seqlen)
            times[c].append(seconds)
    same = {c: int((drawn[combos[0]] == drawn[c]).all(1).sum()) for c in combos}
    dtypes = ", ".join(f"{d} ({sampling.sampling_dtype(model, d) or 'model'})" for d in args.dtype)
    print(f"sampling benchmark: {args.model} float32 model, sample dtype {dtypes}; {args.rows} windows x "
          f"{args.seqlen} tokens from the BOS token, batch {sampling.SAMPLE_BATCH}, top-{args.topk} teacher; "
          f"{args.threads} threads; {args.runs} alternated runs each after a warm-up; medians; CPU bf16 in hardware: "
          f"{native_bf16('cpu')}")
    print()
    print("| path | s (median) | runs | tokens/s | speed-up over the first row | windows identical to its | "
          "sample dtype |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(times[combos[0]])
    for c in combos:
        med = statistics.median(times[c])
        print(f"| {c[0]} | {med:.1f} | {', '.join(f'{t:.1f}' for t in times[c])} | "
              f"{args.rows * (args.seqlen - 1) / med:.0f} | {base / med:.2f}x | {same[c]} / {args.rows} | {c[1]} |")
    if args.repetition:
        print(f"\nrepeated 4-grams per window (repetition.repeated_share; degenerate over "
              f"{repetition.MAX_REPEATED_SHARE}); windows over each share:")
        print("| windows | n | median | p90 | max | " + " | ".join(f"> {t}" for t in THRESHOLDS) + " |")
        print("|---|---|---|---|---|" + "---|" * len(THRESHOLDS))
        for d in args.dtype:
            print(repetition_rows(f"written, {d}", drawn[(args.paths[-1], d)]))
        for text in TEXTS:
            print(repetition_rows(f"text, {text} calib", calibration_windows(tok, text, args.rows, args.seqlen, 0)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
