"""Smoke test of every benchmark script in bench/: each runs as a subprocess on a tiny model (or tiny shapes) for a
few seconds, one thread, and must exit as it should and print its table. The figures are not checked (they mean
nothing at this size); that the scripts still run against today's code is.

A new script in bench/ must be added to ``SMOKES`` (``test_every_bench_script_is_smoke_run``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TINY = "tiny-random-llama"
# A hang guard, not a speed check: each run takes seconds alone, more on a loaded machine.
TIMEOUT_S = 180


@dataclass(frozen=True)
class Smoke:
    """How one script is smoke-run: its arguments (``{root}`` = a directory shared by the runs of this module),
    the text its output must contain (stdout + stderr, and ``log`` when the script writes its output to a file),
    the exit status it must end with, extra environment, and a script whose outputs it reads (run first)."""

    args: tuple[str, ...]
    expect: tuple[str, ...]
    returncode: int = 0
    env: dict[str, str] = field(default_factory=dict)
    after: str | None = None
    log: str | None = None
    gpu: bool = False  # needs CUDA: without a GPU it must exit with ``returncode`` and a one-line reason
    gpu_table: bool = False  # the GPU checks: without a GPU every row must say "skipped: no CUDA" (skipped with one)


QUALITY_ROW = "vptq-2-v6k4096-kd32"  # quantization then distillation: both paths of bench/quality.py
NO_CUDA = "torch.cuda.is_available() is False"

SMOKES: dict[str, Smoke] = {
    "bench/act_share.py": Smoke(
        ("--make", TINY, "--checkpoint", "{root}/act_share", "--max-windows", "1", "--seqlen", "32", "--threads",
         "1"),
        ("14 linears quantize their inputs (8-bit token)", "| activations | text | perplexity | × original |",
         "| as stored | wiki |", "| weights alone | pydocs |")),
    "bench/ablation.py": Smoke(
        ("--model", TINY, "--layers", "0:self_attn.q_proj", "1:mlp.down_proj", "--calib-samples", "2",
         "--seqlen", "32"),
        ("| layer | variant | rel. proxy loss | rel. weight error | seconds |", "2nd-order + outliers")),
    "bench/app_load.py": Smoke(
        ("--sessions", "1", "--chats", "1"),
        ("| session | events | refused by a limit | failures |", " | 0 | - |", "| probes | unanswered |")),
    "bench/decode.py": Smoke(
        ("--shape", "tiny", "--tokens", "2", "--pairs", "1", "--loop", "lean,generate", "--anatomy"),
        ("| model | decode tok/s (median) |", "speed ratio quantized / bf16", "| model | total | block linears |",
         "| model | linears | head | embedding row | norms | kv cache | total | ceiling × bf16 |", "| generate | 1 |")),
    "bench/peers.py": Smoke((), ("bench/peers.py needs llama.cpp: no --llama-python given",), returncode=1),
    "bench/decode_profile.py": Smoke(
        ("--shape", "tiny", "--layouts", "vptq2,scalar4-a8", "--tokens", "2", "--rounds", "1", "--variants",
         "pf0:index_prefetch=0"),
        ("| part | bf16 original fused | unfused |", "| gate_up+silu |", "| × bf16 (total) |",
         "| vptq2 (head 16-bit) | pf0 | index_prefetch=0 |")),
    "bench/run_stages.py": Smoke(
        ("--shape", "tiny", "--method", "rtn", "--preset", "4.5 bits", "--samples", "2", "--seqlen", "32",
         "--threads", "1"),
        ("| stage | measured s | estimated s (reference) |", "| blocks |", "full depth (2 blocks)")),
    "bench/distill_step.py": Smoke(
        ("--model", TINY, "--threads", "1", "--seqlen", "32", "--steps", "1", "--warmup", "1", "--rounds", "1",
         "--variants", "float32"),
        ("| variant | median s per step | × first row | steps timed |", "| float32 |")),
    "bench/probe_steadiness.py": Smoke(
        ("--model", TINY, "--seconds", "0", "--seqlen", "32", "--threads", "1"),
        ("| timing | readings | median pace | min | max | cv |", "| matmul probe | 2 |", "| block 0 forward | 2 |",
         "| matmul probe, the faster of two | 1 |")),
    "bench/pass_cost.py": Smoke(
        ("--models", TINY, "--threads", "1", "--seqlen", "32", "--windows", "1", "--steps", "1", "--write-windows", "2",
         "--write-tokens", "8"),
        ("| model | block linears | head (vocab) | params (priced) |", "| tiny-random-llama |")),
    "bench/distill_variants.py": Smoke(
        ("--model", TINY, "--row", "rtn-2", "--variants", "kd1:distill_iters=1", "--calib-samples", "2",
         "--seqlen", "32", "--distill-seqlen", "16", "--windows", "1", "--threads", "1",
         "--cache", "{root}/distill_variants/cache",
         "--results", "{root}/distill_variants/results.jsonl"),
        ("| variant | settings | wiki ppl | x bf16 |", "| kd1 |", "| none |")),
    "bench/finetune.py": Smoke(
        ("blocks", "--model", TINY, "--blocks", "1", "--calib", "4", "--held", "1", "--iters", "2", "--seqlen", "32",
         "--only", "no fine-tuning", "legacy", "+ norms lr 1e-3"),
        ("| block | variant | fit | wiki held-out | pydocs held-out | seconds |", "| 1 | legacy:")),
    # reads the checkpoint bench/quality.py wrote with --save-dir, as docs describe the pair
    "bench/generalisation.py": Smoke(
        (f"{{root}}/quality/ckpt/{QUALITY_ROW}", "--original", TINY, "--seqlen", "32", "--windows", "1",
         "--threads", "1"),
        ("| checkpoint | text | ppl | bf16 ppl | ppl × bf16 | KL mean | KL median |", f"| {QUALITY_ROW} | pydocs |",
         "test split of each text"), after="bench/quality.py"),
    # every step starts as on a GPU and refuses in one line; the table has a "skipped: no CUDA" row per step
    "bench/gpu.sh": Smoke((), ("| step | status | seconds | figures |",
                               *(f"| {step} | skipped: no CUDA" for step in (
                                   "1 Triton kernel tests (CUDA)", "2 Triton vs cuBLAS fp16",
                                   "3a decode 2-bit SmolLM2 shape vs fp16", "3b decode 2-bit 0.5B shape vs fp16",
                                   "4 preset 2.5 SmolLM2 on CUDA", "5 NCCL, 2 processes"))), gpu_table=True),
    "bench/gpu_assets.py": Smoke(("--no-download", "--gguf", "bench/README.md", "--out", "{root}/assets",
                                  "--max-mb", "0.004"), ("part1: ", "part2: ", "carry each part")),
    "bench/gpu_steps.py": Smoke(("--steps", "5", "--quick"), ("| 5 NCCL, 2 processes | skipped: no CUDA",),
                                gpu_table=True),
    "bench/gpu_quantize.py": Smoke(("--model", TINY), ("no CUDA device: GPU figures need a GPU",), returncode=1,
                                   gpu=True),
    # needs llama-cpp-python in its own interpreter: without --llama-python, one line saying so
    "bench/gguf_export.py": Smoke(("--model", TINY), ("bench/gguf_export.py needs --llama-python",), returncode=1),
    "bench/head_quality.py": Smoke(
        ("--model", TINY, "--samples", "2", "--seqlen", "32", "--windows", "1", "--threads", "1",
         "--rows", "runtime-8,gptq-4"),
        ("| head | wiki ppl | × bf16 | pydocs ppl |", "| runtime-8 ", "| gptq-4 ")),
    "bench/kernels.py": Smoke(
        ("--tokens", "1", "--rounds", "1", "--configs", "2-bit v6 k4096", "--shapes", "192x576"),
        ("native/dense", "|     192x576 |     2-bit v6 k4096 |", "Per-call overhead", "module/dense")),
    "bench/kernels_gpu.py": Smoke(("--reps", "1"), (f"bench/kernels_gpu.py needs a CUDA device: {NO_CUDA}",),
                                  returncode=1, gpu=True),
    "bench/lrq_overfit.py": Smoke(
        ("--model", TINY, "--block", "1", "--calib", "2", "--held", "1", "--seqlen", "32", "--grid", "2:auto",
         "2:full"),
        ("| steps | scale | calib error | held-out error | seconds |", "| 2 | full (FlexRound-style) |")),
    "bench/lrq_threads.py": Smoke(
        ("--model", TINY, "--block", "1", "--samples", "2", "--seqlen", "32", "--iters", "2", "--threads", "1", "2",
         "--rounds", "1"),
        ("| steps | threads | seconds per block | × first thread count |", "| 2 | 2 |")),
    "bench/lrq_steps.py": Smoke(
        ("--model", TINY, "--blocks", "1", "--samples", "2", "--held", "1", "--seqlen", "32", "--grid", "2:0.01",
         "2:0.005"),
        ("| block | steps | lr | calib error | wiki dev error | pydocs dev error | seconds |", "| 1 | 2 | 0.005 |")),
    "bench/lrq_recipe.py": Smoke(
        ("--model", TINY, "--base", "w4a8", "--variants", "base:group_size=32,iters=1,distill_iters=1",
         "--calib-samples", "2", "--calib-seqlen", "32", "--seqlen", "32", "--windows", "1", "--threads", "1",
         "--results", "{root}/lrq_recipe/results.jsonl"),
        ("| variant | settings | total bits | wiki ppl | x bf16 |", "| base | group_size=32", "dev split")),
    # reads every file in bench/results/ and compares the page it would write with docs/results.md
    "bench/make_results.py": Smoke(("--check",), ("docs/results.md is up to date",)),
    "bench/memory.py": Smoke(
        ("--shape", "tiny", "--layers", "1", "--samples", "2", "--seqlen", "16", "--threads", "1",
         "--workdir", "{root}/memory"),
        ("| layers | block weights | file | peak RSS |", "formula terms:")),
    "bench/packed_dense.py": Smoke(
        ("--quick", "--threads", "1", "--rows", "1", "--rounds", "1", "--calls", "1"),
        ("| linear (out x in) | rows | torch ms | packed ms | torch / packed |", "SmolLM2 down (576 x 1536)")),
    # writes its output to $OUT/NAME.log and the evaluations to $OUT/NAME_{wiki,pydocs}.json
    "bench/preset_run.sh": Smoke(
        ("t", "--set", "vector_len=4", "--set", "num_centroids=16", "--calib-samples", "2", "--seqlen", "32",
         "--quiet"),
        ("== ", "t: --set vector_len=4", "Exit status: 0", "done"),
        env={"MODEL": TINY, "WINDOWS": "1", "THREADS": "1", "OUT": "{root}/presets"}, log="{root}/presets/t.log"),
    "bench/chat_screenshot.py": Smoke(
        ("--tiny", "--checkpoint", "{root}/presets/t", "--replies", "1", "--tokens", "4", "--port", "0",
         "--screenshot", "{root}/chat.png"),
        ("reply 1: original ", "median quantized / original", "screenshot: "), after="bench/preset_run.sh"),
    "bench/preset_summary.py": Smoke(
        ("t",), ("wall ", "total /", "index bits", "  wiki ", "  pydocs "), env={"OUT": "{root}/presets"},
        after="bench/preset_run.sh"),
    "bench/quality.py": Smoke(
        ("--model", TINY, "--rows", QUALITY_ROW, "--calib-samples", "2", "--calib-seqlen", "32", "--seqlen", "32",
         "--windows", "1", "--threads", "1", "--results", "{root}/quality/results.jsonl", "--save-dir",
         "{root}/quality/ckpt"),
        ("| row | seeds | total bits | wiki test × bf16 | KL mean | KL median | KL p99 | Δp mean | same top |",
         f"| {QUALITY_ROW} | 0 | ", "'test' split (headline)")),
    "bench/quant_cost.py": Smoke(
        ("--model", TINY, "--block", "0", "--quick", "--grid", "2:16", "--threads", "1"),
        ("| layer | settings | k-means s | pred | sweep s |", "whole layer measured / predicted")),
    "bench/sampling.py": Smoke(
        ("--model", TINY, "--rows", "2", "--seqlen", "16", "--topk", "4", "--threads", "1", "--runs", "1"),
        ("| path | s (median) | runs | tokens/s |", "| lean decoder, packed linears |")),
    "bench/sampling_projection.py": Smoke(
        ("--model", TINY, "--threads", "1", "--seqlen", "128"),
        ("| poll | seconds so far | projected total s | decision |", "all windows written")),
    "bench/scaling.py": Smoke(
        ("--shapes", "tiny", "--layers", "1", "--samples", "2", "--seqlen", "16", "--vocab", "64", "--threads", "1",
         "--method", "rtn", "--settings", '{"bits": 4, "group_size": 32}'),
        ("| shape | blocks | block weights |", "| tiny | 1 |")),
    "bench/stage_profile.py": Smoke(
        ("--shape", "tiny", "--samples", "2", "--seqlen", "16", "--threads", "1", "--repeats", "1"),
        ("| piece | float32 s | bf16 path s | float32 / bf16 |", "| hessians_targets |",
         "| inverse factor by reversed Cholesky vs float64, worst input |")),
    "bench/stage_memory.py": Smoke(
        ("--model", "shape:tiny", "--samples", "4", "--seqlen", "32", "--distill-iters", "2", "--threads", "1",
         "--set", "vector_len=4", "num_centroids=64", "bits_budget=6.0", "--workdir", "{root}/stage_memory",
         "--breakdown"),
        ("| stage | peak RSS | seconds |", "| plan |", "| distill |", "| distill: teacher top-k |",
         "| distill: step 1 backward |", "| **whole run** |")),
    "bench/search.py": Smoke(
        ("--cells", "4:256:64", "--rounds", "1", "--layer-shapes", "64x32"),
        ("| d | k | queries | native ms | kdtree ms |", "| layer | config | auto s | k-d tree s |", "| 64x32 |")),
}


def bench_scripts() -> set[str]:
    """Every script in bench/, as a path relative to the repository root."""
    return {p.relative_to(ROOT).as_posix() for pattern in ("*.py", "*.sh") for p in BENCH.glob(pattern)}


def test_every_bench_script_is_smoke_run():
    on_disk = bench_scripts()
    assert sorted(on_disk - set(SMOKES)) == [], "add a smoke run of each new bench script to SMOKES"
    stale = set(SMOKES) - on_disk
    assert sorted(stale) == [], "SMOKES names scripts that are not in bench/"
    for name, smoke in SMOKES.items():
        assert smoke.after is None or smoke.after in SMOKES, name


def _environment(root: Path, extra: dict[str, str]) -> dict[str, str]:
    threads = {key: "1" for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                    "NUMBA_NUM_THREADS")}
    # the shell scripts call `python`: this interpreter's
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, **threads, "PATH": path, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    return {**env, **{key: value.replace("{root}", str(root)) for key, value in extra.items()}}


def _run(name: str, smoke: Smoke, root: Path) -> tuple[int, str]:
    script = ROOT / name
    args = [arg.replace("{root}", str(root)) for arg in smoke.args]
    command = ["bash", str(script), *args] if name.endswith(".sh") else [sys.executable, str(script), *args]
    proc = subprocess.run(command, cwd=ROOT, env=_environment(root, smoke.env), capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    output = proc.stdout + proc.stderr
    if smoke.log:
        log = Path(smoke.log.replace("{root}", str(root)))
        output += log.read_text(encoding="utf-8") if log.is_file() else f"\n(no log {log})"
    return proc.returncode, output


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """run(name) -> (exit status, output) of the script's smoke run, each run once per module (a script that
    reads another's outputs runs after it)."""
    root = tmp_path_factory.mktemp("bench")
    done: dict[str, tuple[int, str]] = {}

    def run(name: str) -> tuple[int, str]:
        if name not in done:
            smoke = SMOKES[name]
            if smoke.after:
                code, output = run(smoke.after)
                assert code == 0, f"{smoke.after} (whose outputs {name} reads) failed:\n{output[-3000:]}"
            done[name] = _run(name, smoke, root)
        return done[name]

    return run


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _native_reason(name: str) -> str | None:
    """Why a script that needs the native CPU kernels or oneDNN cannot run here (None: it can)."""
    if name in ("bench/kernels.py", "bench/search.py", "bench/decode_profile.py"):
        from vptq_core.kernels import native

        usable, reason = native.status()
        return None if usable else f"native kernels unusable: {reason}"
    if name == "bench/packed_dense.py":
        from vptq_core.quant.packed_dense import available

        return None if available() else "oneDNN packed linears unavailable in this torch build"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKES))
def test_bench_script_runs(name, bench_run):
    smoke = SMOKES[name]
    if (smoke.gpu or smoke.gpu_table) and _cuda_available():
        pytest.skip("a GPU is present: run bash bench/gpu.sh on it (this test checks the refusal without one)")
    reason = _native_reason(name)
    if reason:
        pytest.skip(reason)
    code, output = bench_run(name)
    assert code == smoke.returncode, f"{name} exited {code}, expected {smoke.returncode}:\n{output[-3000:]}"
    missing = [text for text in smoke.expect if text not in output]
    assert missing == [], f"{name}: {missing} not in its output:\n{output[-3000:]}"
    if smoke.gpu:
        reason_lines = [line for line in output.splitlines() if line.strip()]
        assert len(reason_lines) == 1, f"{name} should say why in one line without a GPU:\n{output}"
