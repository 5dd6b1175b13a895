"""How the writing of self-written calibration windows is projected under a time budget.

Protocol: a bundled model, 32 wiki calibration windows x 512 tokens (``--seqlen``; seed 0), the "2.5 bits"
preset's settings (the windows it writes: 21 of them, one batch), ``--threads`` threads. The original model writes
the windows as ``sampling.sampled_calibration`` does, with ``--budget`` as the run's ``time_budget``; every poll's
time is recorded and ``sampling.WritingProjection``'s decisions are printed: the poll, the seconds so far, the
projection, and what the writing did (went on, went on with the windows that fit, or stopped). With a budget too
large to stop anything the whole writing runs, so the printed total is the true one and the cost per token along
the window is shown by chunks of 64 tokens.

    python bench/sampling_projection.py --model gemma3-270m                 # the preset's 570 s
    python bench/sampling_projection.py --model gemma3-270m --budget 1e6    # the whole writing
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.data import calibration_windows  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant import calib_windows, sampling  # noqa: E402
from vptq_core.quant.config import VPTQConfig  # noqa: E402
from vptq_core.quant.vptq import PRESETS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--budget", type=float, default=PRESETS["2.5 bits"]["time_budget"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per calibration window")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    calib = calibration_windows(tok, "wiki", 32, args.seqlen, seed=0)
    config = VPTQConfig(**{**PRESETS["2.5 bits"], "time_budget": args.budget})
    times, decisions = [], []
    poll = sampling.WritingProjection.poll

    def recording(self, now):
        times.append(now - self.start)
        got = poll(self, now)
        if got is not None:
            decisions.append((len(times), now - self.start, got))
        return got

    sampling.WritingProjection.poll = recording
    info: dict = {}
    t0 = time.perf_counter()
    sampling.sampled_calibration(model, calib, config, topk=config.distill_topk, info=info)
    seconds = time.perf_counter() - t0
    limit = sampling.SAMPLING_BUDGET_SHARE * args.budget
    print(f"{args.model}: {calib_windows.written_rows(32, config).numel()} windows, time budget {args.budget:g} s "
          f"(writing limit {limit:g} s), {args.threads} threads")
    print("| poll | seconds so far | projected total s | decision |")
    print("|---|---|---|---|")
    planned = info.get("planned", calib_windows.written_rows(32, config).numel())
    for i, (k, at, projected) in enumerate(decisions):
        last = i == len(decisions) - 1
        if projected <= limit:
            what = "go on"
        elif not last:  # the lower bound over: the writing went on when some of the windows still fit
            what = "over: the later decision decides"
        else:
            what = f"go on with {info['self_written']} of {planned}" if info.get("self_written") else "stop: all text"
        print(f"| {k} | {at:.1f} | {projected:.1f} | {what} |")
    print(f"writing took {seconds:.1f} s; {info['reason'] if 'reason' in info else 'all windows written'}")
    cost = [b - a for a, b in zip(times, times[1:])]
    if "reason" not in info and cost:
        chunks = [sum(cost[i:i + 64]) / len(cost[i:i + 64]) for i in range(0, len(cost), 64)]
        print("seconds per token by chunks of 64 tokens: " + " ".join(f"{c:.3f}" for c in chunks))


if __name__ == "__main__":
    main()
