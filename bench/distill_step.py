"""What one end-to-end distillation step costs on this machine, by training dtype and activation checkpointing.

Protocol: SmolLM2-135M-Instruct (fp32, the bundled weights) is the teacher; the student is the same model with
every block linear replaced by a random VPTQ layer of the "2.5 bits" preset's shapes (its 2.5-bit budget on
SmolLM2: v6 k4096 for gate/up/down, v5 k1024 for q/o/k/v, 0.5% outlier columns v4 k256, perm; speed does not
depend on the
values, codebooks scaled to the weights' RMS). Each variant runs ``distill`` on the same windows (the bundled
wiki calibration split, ``--seqlen`` tokens): ``--steps`` timed steps after ``--warmup`` steps, no held-out
checks in between (only the one before and after, not timed). Variants run one after another, alternating
order over ``--rounds`` rounds; the table gives the median step time per variant and its ratio to the
variant of the first row. A step = forward + backward + Adam on one window.

    python bench/distill_step.py [--threads 2] [--seqlen 512] [--steps 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.data import calibration_windows  # noqa: E402
from vptq_core.models import load_model  # noqa: E402
from vptq_core.quant.blocks import block_linears, decoder_blocks  # noqa: E402
from vptq_core.quant.config import VPTQConfig  # noqa: E402
from vptq_core.quant.device import cpu_flags, native_bf16  # noqa: E402
from vptq_core.quant.distill import distill  # noqa: E402
from vptq_core.quant.states import VQLayerState  # noqa: E402
from vptq_core.quant.vptq import outlier_columns  # noqa: E402

# projection name suffix -> (v, k) of the "2.5 bits" preset on SmolLM2 (bits_budget 2.5 -> layer cap 3.0137;
# docs/methods.md, "Bit plan by sensitivity")
SHAPES = {"q_proj": (5, 1024), "o_proj": (5, 1024), "k_proj": (5, 1024), "v_proj": (5, 1024),
          "gate_proj": (6, 4096), "up_proj": (6, 4096), "down_proj": (6, 4096)}


def random_state(weight: torch.Tensor, v: int, k: int, gen: torch.Generator) -> VQLayerState:
    out_f, in_f = weight.shape
    osz = outlier_columns(in_f, 0.5, 1)
    rms = float(weight.float().pow(2).mean().sqrt())
    rows, orows = math.ceil(out_f / v), math.ceil(out_f / 4)
    return VQLayerState(
        in_features=in_f, out_features=out_f, vector_len=v, num_centroids=k, group_num=1, group_size=in_f - osz,
        centroids=torch.randn(1, k * v, generator=gen) * rms,
        indices=torch.randint(0, k, (1, rows, in_f - osz), generator=gen),
        outlier_vector_len=4, num_outlier_centroids=256, outlier_size=osz,
        outlier_centroids=torch.randn(1, 256 * 4, generator=gen) * rms,
        outlier_indices=torch.randint(0, 256, (1, orows, osz), generator=gen),
        perm=torch.randperm(in_f, generator=gen))


def student_of(reference: torch.nn.Module, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    import copy

    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(seed)
    names = {id(module): name for name, module in model.named_modules()}
    states = {}
    for block in decoder_blocks(model):
        for name, linear in block_linears(block).items():
            v, k = SHAPES[name.rsplit(".", 1)[-1]]
            state = random_state(linear.weight.data, v, k, gen)
            linear.weight.data = state.dequantize().to(linear.weight.dtype)
            states[names[id(linear)]] = state
    return model, states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="teacher: a built-in model (tiny-random-llama for a quick check of the script)")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them (>= 1: a step is timed from the "
                    "end of the one before)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=["float32", "float32-nockpt", "bfloat16"],
                    help="DTYPE[-nockpt], DTYPE one of float32, bfloat16, auto")
    args = ap.parse_args()
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    reference, tok = load_model(args.model, dtype=torch.float32)
    reference.eval()
    windows = calibration_windows(tok, "wiki", samples=4, seqlen=args.seqlen, seed=0)
    student, states = student_of(reference)
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"# CPU flags: {', '.join(flags) or 'none known'}; native bf16: {native_bf16('cpu')}; "
          f"torch threads {args.threads}; window {args.seqlen} tokens; {len(states)} VQ layers")

    times: dict[str, list[float]] = {v: [] for v in args.variants}
    for rnd in range(args.rounds):
        order = args.variants if rnd % 2 == 0 else list(reversed(args.variants))
        for variant in order:
            dtype, _, flag = variant.partition("-")
            stamps: list[float] = []
            config = VPTQConfig(distill_iters=args.warmup + args.steps, distill_holdout=0.25, distill_topk=64,
                                distill_eval_every=10**6, train_dtype=dtype, distill_checkpointing=flag != "nockpt")
            trial = {name: VQLayerState(**{f: getattr(st, f) for f in st.__dataclass_fields__})
                     for name, st in states.items()}
            distill(student, reference, trial, windows, config, on_step=lambda step, _kl: stamps.append(
                time.perf_counter()))
            steps = [b - a for a, b in zip(stamps[args.warmup - 1:], stamps[args.warmup:])]
            times[variant].extend(steps)
            print(f"# round {rnd + 1} {variant}: " + ", ".join(f"{s:.2f}" for s in steps) + " s", flush=True)

    base = statistics.median(times[args.variants[0]])
    print("\n| variant | median s per step | × first row | steps timed |")
    print("|---|---|---|---|")
    for variant in args.variants:
        med = statistics.median(times[variant])
        print(f"| {variant} | {med:.2f} | {med / base:.2f} | {len(times[variant])} |")
    print(f"\nprocess peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
