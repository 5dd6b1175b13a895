"""How steady the plan's speed probe is against the passes it prices: the matrix-multiply probe
(``run_plan.measure_speed``), a forward of block 0 as the block-pace probe builds it (``block_pace.build_probe``: two
windows of the run's length, float32) and a whole-model float32 forward of one window, timed in turn for
``--seconds``. Each is given as a pace against its price on the reference machine (the probe's own reading; the
block forward against half of ``cost.FORWARD_S``, which prices both of the block stage's passes; the model forward
against ``cost.KD_CHECK_S``, the held-out check's pass) with its median, spread and coefficient of variation, and
the probe as a budgeted run reads it (``api.plan_stage``): the faster of two readings, here about a second apart.

    python bench/probe_steadiness.py --seconds 150 --threads 2

Run it alone on the machine: other work moves every reading.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.block_pace import build_probe  # noqa: E402
from vptq_core.quant.blocks import lookup_params  # noqa: E402
from vptq_core.quant.cost import FORWARD_S, KD_CHECK_S  # noqa: E402
from vptq_core.quant.device import cpu_flags  # noqa: E402
from vptq_core.quant.run_plan import measure_speed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seconds", type=float, default=150.0, help="how long to alternate the three timings")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32)[0]
    probe = build_probe(model, args.seqlen, torch.device("cpu"))
    ids = torch.randint(0, model.config.vocab_size, (1, args.seqlen), generator=torch.Generator().manual_seed(1))
    block_weights = sum(linear.weight.numel() for linear in probe.linears.values())
    block_price = FORWARD_S / 2 * block_weights * probe.inputs.shape[0] * probe.inputs.shape[1]
    pass_params = sum(p.numel() for p in model.parameters()) - lookup_params(model)  # as cost.RunSize.pass_params
    model_price = KD_CHECK_S * pass_params * (args.seqlen - 1)
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"# probe steadiness: {args.model}, {args.threads} threads, CPU flags {', '.join(flags) or 'none known'}, "
          f"load average {os.getloadavg()[0]:.1f}; block 0 forward {probe.inputs.shape[0]} x {args.seqlen} tokens "
          f"(price {block_price * 1e3:.1f} ms), model forward 1 x {args.seqlen} (price {model_price:.2f} s); "
          f"alternated for {args.seconds:.0f} s")
    paces: dict[str, list[float]] = {"matmul probe": [], "block 0 forward": [], "model forward": []}
    with torch.no_grad():
        model(ids)
        probe.forward(probe.block, probe.inputs)
        end = time.monotonic() + args.seconds
        while time.monotonic() < end or len(paces["matmul probe"]) < 2:  # at least one pair
            paces["matmul probe"].append(measure_speed())
            t0 = time.perf_counter()
            probe.forward(probe.block, probe.inputs)
            paces["block 0 forward"].append(block_price / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            model(ids)
            paces["model forward"].append(model_price / (time.perf_counter() - t0))
    probe = paces["matmul probe"]  # as a budgeted run reads it: twice, seconds apart, the faster kept
    paces["matmul probe, the faster of two"] = [max(a, b) for a, b in zip(probe[::2], probe[1::2])]
    print("\n| timing | readings | median pace | min | max | cv |\n|---|---|---|---|---|---|")
    for name, values in paces.items():
        cv = statistics.pstdev(values) / statistics.mean(values)
        print(f"| {name} | {len(values)} | {statistics.median(values):.3f}x | {min(values):.3f}x | "
              f"{max(values):.3f}x | {cv:.3f} |")


if __name__ == "__main__":
    main()
