"""Time of writing calibration windows with the original model (``calib_sampled_share``; ``sampling.sample_windows``):
the model's own forward with transformers' KV cache, the lean decoder, and the lean decoder with the float32 linears
through oneDNN with packed weights (``packed_dense``, what the pipeline runs), in one process.

Protocol: the bundled SmolLM2-135M-Instruct in float32 (what the presets sample with where the CPU has no bf16
instructions; ``--dtype auto`` picks bf16 copies where it has them), --rows windows of --seqlen tokens started from
the BOS token, batch 32 as the pipeline uses, the teacher's top-k recorded as the presets record it; one warm-up
of each path on a short draw, then --runs runs of each, the order reversed every run; medians. The paths draw with
the same per-row generators; the table says how many windows came out identical to the first path's (fp32
rounding moves a draw now and then).

    python bench/sampling.py [--rows 32] [--seqlen 256] [--topk 32] [--threads 2] [--runs 2]
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

from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant import lean_decoder, sampling  # noqa: E402

PACKED = "lean decoder, packed linears"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=sampling.SAMPLE_DTYPES)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a built-in model (tiny-random-llama for a quick check of the script)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32)
    model = (model[0] if isinstance(model, tuple) else model).eval()
    starts = torch.full((args.rows, 1), int(model.config.bos_token_id or 1), dtype=torch.long)

    def run(path: str, seqlen: int) -> tuple[float, torch.Tensor]:
        patch = (mock.patch.object(lean_decoder.LeanDecoder, "for_model", return_value=None) if path == "model forward"
                 else contextlib.nullcontext())
        with patch:
            start = time.perf_counter()
            windows, _ = sampling.sample_windows(model, starts, seqlen, seed=0, batch=sampling.SAMPLE_BATCH,
                                                topk=args.topk, dtype=args.dtype, pack=path == PACKED)
            return time.perf_counter() - start, windows

    paths = ("model forward", "lean decoder", PACKED)
    for p in paths:
        run(p, 8)
    times: dict[str, list[float]] = {p: [] for p in paths}
    drawn: dict[str, torch.Tensor] = {}
    for r in range(args.runs):
        for p in (paths if r % 2 == 0 else paths[::-1]):
            seconds, drawn[p] = run(p, args.seqlen)
            times[p].append(seconds)
    same = {p: int((drawn[paths[0]] == drawn[p]).all(1).sum()) for p in paths}
    print(f"sampling benchmark: {args.model} float32 model, sample dtype", args.dtype,
          f"({sampling.sampling_dtype(model, args.dtype) or 'model'}); {args.rows} windows x {args.seqlen} tokens, "
          f"batch {sampling.SAMPLE_BATCH}, top-{args.topk} teacher; {args.threads} threads; {args.runs} alternated "
          "runs each after a warm-up; medians")
    print()
    print("| path | s (median) | runs | tokens/s | speed-up over the model forward | windows identical to its |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(times[paths[0]])
    for p in paths:
        med = statistics.median(times[p])
        print(f"| {p} | {med:.1f} | {', '.join(f'{t:.1f}' for t in times[p])} | "
              f"{args.rows * (args.seqlen - 1) / med:.0f} | {base / med:.2f}x | {same[p]} / {args.rows} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
