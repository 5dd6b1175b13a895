"""Peak memory and time of each stage of a quantization run that holds the whole model, by default the VPTQ
"2.5 bits" preset shortened to fit a shared machine: load (the model and, for distillation, the original beside
it, as ``api.quantize_to_dir`` loads them), self-written calibration, the bit plan by sensitivity, distillation.

Protocol: every run is a fresh subprocess (``--tree``: the source tree it imports, e.g. an older checkout for a
before / after pair) on ``--threads`` torch threads that calls the pipeline's own stage functions
(``pipeline.STAGES``) in order; the block stage is replaced by random VQ layer states at each layer's planned
settings (its memory is one block, streamed: ``bench/memory.py``; its time: ``bench/scaling.py``). The resident
set is sampled from ``/proc/self/statm`` every 20 ms by a thread that files each sample under the stage the run is
in, and ``ru_maxrss`` is read at the end. A stage's figure is the highest resident set seen while it ran (the
process's whole footprint, what came before included); "baseline" is the footprint after the imports. The plan's
own split (measurement, distortion table) comes from the run's metrics. ``--breakdown`` splits distillation further
(``distill_parts``): the move to float32, the teacher's top-k, the student build, the first held-out check, the first
step's forward, backward and Adam step, the later steps and checks, the write-back; each part's row also gives the
resident set as it starts (what the parts before left).

Models: a built-in name (``smollm2-135m-instruct``, ``tiny-random-llama``) or a random-weight shape written to a
safetensors directory one tensor at a time (``shape:qwen05b``: hidden 896, MLP 4864, 24 layers, vocabulary
151936, untied head; ``shape:qwen15b``: hidden 1536, MLP 8960, 28 layers; ``shape:tiny`` for the smoke test).

    python bench/stage_memory.py --model smollm2-135m-instruct
    python bench/stage_memory.py --model shape:qwen05b --samples 8 --distill-iters 4
    python bench/stage_memory.py --model shape:qwen05b --tree /tmp/before      # the same run, older code
    python bench/stage_memory.py --model smollm2-135m-instruct --set sensitivity_windows=2
    python bench/stage_memory.py --model shape:qwen05b --samples 4 --distill-iters 2 --breakdown
    python bench/stage_memory.py --model shape:qwen05b --samples 32 --whole      # the real block stage and save
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1 << 30
SHAPES = {  # hidden, intermediate, heads, kv heads, layers, vocabulary, tied head
    "qwen05b": (896, 4864, 14, 2, 24, 151936, False),
    "qwen15b": (1536, 8960, 12, 2, 28, 151936, False),
    "tiny": (64, 128, 4, 2, 2, 259, False),
}


class StageSampler(threading.Thread):
    """The peak resident set of this process per stage, sampled from /proc/self/statm."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.interval, self.page = interval, os.sysconf("SC_PAGE_SIZE")
        self.stage, self.peaks, self.starts, self.entered = "start", {}, {}, {}
        self.done = threading.Event()
        self.metrics: dict = {}  # the run's model metrics (plan, distillation), filed by the worker

    def current(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def sample(self) -> None:
        self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), self.current())

    def enter(self, name: str) -> None:
        self.sample()  # the stage before ends here
        print(f"  {name} ({self.current() / GB:.2f} GB so far)", file=sys.stderr, flush=True)
        self.stage = name
        self.starts[name] = time.perf_counter()
        self.entered.setdefault(name, self.current())
        self.sample()

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            time.sleep(self.interval)

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.sample()


def write_random_model(shape: str, directory: Path, seed: int = 0) -> int:
    """A random bf16 qwen2 model of ``shape`` in ``directory`` (``memory.write_random_weights``); the number of
    parameters."""
    from memory import write_random_weights  # bench/memory.py, beside this script
    from transformers import Qwen2Config

    hidden, inter, heads, kv, layers, vocab, tied = SHAPES[shape]
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                         num_key_value_heads=kv, num_hidden_layers=layers, max_position_embeddings=4096,
                         tie_word_embeddings=tied, dtype="bfloat16")
    return sum(write_random_weights(config, directory, seed).values())


def fake_states(run, seed: int = 0) -> dict:
    """Random VQ layer states in the place of the block stage's, each layer at its settings (the plan's, when the
    run made one), every block linear's weight set to its state's dequantized weight, as the block stage leaves
    the model: what distillation starts from, without the block stage's time."""
    sys.path.insert(0, str(Path(os.environ["PYTHONPATH"])))
    from tests.factories import random_vq_state
    from vptq_core.quant.blocks import block_linears, blocks_prefix, decoder_blocks

    prefix, states = blocks_prefix(run.model), {}
    for b, block in enumerate(decoder_blocks(run.model)):
        for name in block_linears(block):
            linear, full = block.get_submodule(name), f"{prefix}.{b}.{name}"
            layer = run.config.for_layer(full)
            state = random_vq_state(linear.in_features, linear.out_features, vector_len=layer.vector_len,
                                    num_centroids=layer.num_centroids, perm=True, seed=seed + len(states))
            state.centroids = state.centroids * float(linear.weight.detach().float().std())
            linear.weight.data.copy_(state.dequantize().to(linear.weight.dtype))  # as the block stage writes it
            states[full] = state
    return states


def distill_parts(sampler: StageSampler) -> None:
    """Files distillation's resident set under its parts (``--breakdown``): wrappers around the functions
    distillation calls (this process only), each part entered as its first call starts."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from vptq_core.quant import distill as distill_mod
    from vptq_core.quant import student

    steps = [0]

    def enter(part: str) -> None:
        sampler.enter(f"distill: {part}")

    def wrap(module, name: str, before: str, after: str | None = None) -> None:
        inner = getattr(module, name)

        def call(*args, **kwargs):
            enter(before)
            out = inner(*args, **kwargs)
            if after:
                enter(after)
            return out

        setattr(module, name, call)

    wrap(student, "to_training_dtype", "model to float32")
    # (not around ``distill`` itself: a wrapper's arguments would hold the original through the steps)
    wrap(distill_mod, "_training_data", "teacher top-k", "student build")
    wrap(distill_mod, "_train", "student build", "after the steps")
    inner_train = distill_mod.train_holdout

    def train(groups, step_loss, check, *args, **kwargs):
        def loss():
            steps[0] += 1
            enter("step 1 forward" if steps[0] == 1 else "later steps")
            out = step_loss()
            if steps[0] == 1:
                enter("step 1 backward")
            return out

        def checked():
            enter("first check" if steps[0] == 0 else "later steps")
            return check()

        out = inner_train(groups, loss, checked, *args, **kwargs)
        enter("write back")
        return out

    distill_mod.train_holdout = train
    register_optimizer_step_pre_hook(
        lambda *_: enter("step 1 Adam") if steps[0] == 1 else None)


def worker(args) -> None:
    """The stages of one run in this (fresh) process, each through the pipeline's own stage function; prints
    one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    from vptq_core.quant import methods

    method = methods.get(args.method)
    settings = {**method.presets[args.preset], **json.loads(args.settings)} if args.preset else json.loads(
        args.settings)
    config = methods.make_config(args.method, settings)
    sampler = StageSampler()
    baseline = sampler.current()
    sampler.start()
    if args.breakdown:
        distill_parts(sampler)
    t0 = time.perf_counter()
    if args.whole:
        whole_run(args, config, sampler)
    else:
        staged_run(args, method, config, sampler)
    sampler.enter("end")
    sampler.stop()
    ends = sorted(sampler.starts.items(), key=lambda kv: kv[1])
    seconds = {name: later - start for (name, start), (_, later) in zip(ends, ends[1:], strict=False)}
    metrics = sampler.metrics
    plan = metrics.get("allocation") or {}
    print(json.dumps({
        "baseline": baseline, "peaks": {k: v for k, v in sampler.peaks.items() if k not in ("start", "end")},
        "entered": sampler.entered,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "seconds": seconds,
        "total_seconds": time.perf_counter() - t0, "plan_split": {k: plan[k] for k in (
            "measure_seconds", "distortion_seconds", "windows") if k in plan},
        "distill_steps": (metrics.get("distill") or {}).get("steps"),
        "checkpointed_blocks": (metrics.get("distill") or {}).get("checkpointed_blocks")}))


def whole_run(args, config, sampler: StageSampler) -> None:
    """``--whole``: the run as the CLI makes it (``api.quantize_to_dir``: load, plan, calibration, the real block
    stage, distillation, save), each stage filed as ``on_stage`` names it; the report's metrics kept."""
    from vptq_core import api
    from vptq_core.quant.config import CalibConfig

    _, summary = api.quantize_to_dir(args.dir, args.method, config, CalibConfig(samples=args.samples,
                                     seqlen=args.seqlen), args.out, device="cpu", on_stage=sampler.enter)
    sampler.metrics = summary.get("model_metrics") or {}


def staged_run(args, method, config, sampler: StageSampler) -> None:
    """The pipeline's stages in this process, the block stage replaced by random states (``fake_states``)."""
    from vptq_core.data import calibration_windows
    from vptq_core.models import load_model
    from vptq_core.quant import pipeline
    from vptq_core.quant.calib_windows import with_heldout

    sampler.enter("load")
    model, tok = load_model(args.dir, dtype="auto")
    calib_ids = calibration_windows(tok, "wiki", with_heldout(args.samples, config), args.seqlen, 0)
    reference = load_model(args.dir, dtype="auto")[0] if method.needs(config).reference else None
    try:  # the original as ``api.original_for`` makes it
        from vptq_core.quant.student import share_outer_weights
    except ImportError:  # an older tree (--tree): a whole second copy, as its api loaded it
        share_outer_weights = None
    if reference is not None and share_outer_weights is not None:
        share_outer_weights(reference, model)
    run = pipeline.start_run(model, calib_ids, method, config, "cpu", True, reference=reference,
                             on_layer=lambda _r: None, should_stop=lambda: False)
    del reference  # handed to the run, as ``api.quantize_to_dir`` hands it: distillation may let it go
    for stage in pipeline.STAGES:
        if stage.name == "blocks":
            sampler.enter("blocks (random states)")
            run.result.states.update(fake_states(run))
        elif stage.applies(run):
            sampler.enter(stage.name)
            stage.run(run)
    sampler.metrics = run.result.model_metrics


def model_dir(model: str, work: Path) -> tuple[str, int | None]:
    """The name or directory the run loads, and its parameter count when written here."""
    if not model.startswith("shape:"):
        return model, None
    shape = model.removeprefix("shape:")
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    directory = work / shape
    if (directory / "model.safetensors").exists():
        return str(directory), None
    t0 = time.perf_counter()
    params = write_random_model(shape, directory)
    print(f"wrote {shape} ({params / 1e9:.2f} B parameters) in {time.perf_counter() - t0:.0f} s", flush=True)
    return str(directory), params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or shape:NAME")
    parser.add_argument("--method", default="vptq")
    parser.add_argument("--preset", default="2.5 bits", help="a preset of the method ('' for none)")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="settings over the preset (JSON "
                        "values)")
    parser.add_argument("--samples", type=int, default=8, help="calibration windows")
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per window")
    parser.add_argument("--distill-iters", type=int, default=4, help="distillation steps (0: the preset's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tree", default=str(ROOT), help="the source tree the run imports")
    parser.add_argument("--workdir", help="where random models and outputs go (default: a temporary directory)")
    parser.add_argument("--results", help="append the run as one JSON line to this file")
    parser.add_argument("--breakdown", action="store_true", help="split distillation into its parts")
    parser.add_argument("--whole", action="store_true", help="the whole run as the CLI makes it (the real block "
                        "stage, the embeddings, the save) instead of the pipeline's stages with random states")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    settings = {"time_budget": 0.0}  # every stage runs to its end, whatever the machine's speed
    if args.distill_iters:
        settings["distill_iters"] = args.distill_iters
    for item in args.set:
        name, _, value = item.partition("=")
        try:
            settings[name] = json.loads(value)
        except json.JSONDecodeError:
            settings[name] = value
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vptq-stage-memory-"))
    sys.path.insert(0, str(ROOT))
    directory, _ = model_dir(args.model, work)
    tree = str(Path(args.tree).resolve())
    print(f"protocol: {args.model}, {args.method} preset {args.preset!r} with {json.dumps(settings)}, calibration "
          f"{args.samples} x {args.seqlen} tokens (bundled wiki), {args.threads} threads, code: {tree}; a fresh "
          f"process; RSS sampled every 20 ms per stage (on_stage) and ru_maxrss; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--dir", directory, "--out",
           str(work / "out"), "--method", args.method, "--preset", args.preset, "--settings", json.dumps(settings),
           "--samples", str(args.samples), "--seqlen", str(args.seqlen), "--threads", str(args.threads)]
    cmd += ["--breakdown"] if args.breakdown else []
    cmd += ["--whole"] if args.whole else []
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=tree, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}): its errors are above")
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\n| stage | peak RSS | seconds | RSS at its start |\n|---|---|---|---|")
    for stage, peak in run["peaks"].items():
        start = run.get("entered", {}).get(stage)
        print(f"| {stage} | {peak / GB:.2f} GB | {run['seconds'].get(stage, 0.0):.1f} | "
              f"{'' if start is None else f'{start / GB:.2f} GB'} |")
    peak = max([run["ru_maxrss"], *run["peaks"].values()])
    print(f"| **whole run** | **{peak / GB:.2f} GB** | {run['total_seconds']:.1f} | |")
    split = run["plan_split"]
    print(f"\nbaseline (after imports) {run['baseline'] / GB:.2f} GB; ru_maxrss {run['ru_maxrss'] / GB:.2f} GB; plan: "
          + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in split.items())
          + f"; distillation steps {run['distill_steps']}, checkpointed blocks {run.get('checkpointed_blocks')}")
    if args.results:
        row = {"model": args.model, "method": args.method, "preset": args.preset, "settings": settings,
               "samples": args.samples, "seqlen": args.seqlen, "threads": args.threads, "tree": tree,
               "peak": peak, **run}
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
