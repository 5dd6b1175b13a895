"""llama.cpp's perplexity on an exported GGUF file next to the project's own on the same checkpoint.

Protocol: a GPTQ checkpoint at 4 bits, symmetric, groups of 32 (``--checkpoint``, or quantized here from
``--model`` with the CLI defaults: 32 wiki windows of 512 tokens, bf16 storage) is exported with
``python -m vptq_core export-gguf`` (Q4_0 linears, the bf16 embedding as BF16, norms F32). The evaluation
windows are the project's ``eval`` windows (``--text``, ``--seqlen``, the first ``--windows``), tokenized once
by the project. llama.cpp (llama-cpp-python in its own interpreter, ``--llama-python``) evaluates the same token
ids, one window per context, all logits kept, the weights in the file's layout (``--extra-bufts`` lets it repack
them); the NLL of every next token is taken from its logits in float64. The project's side is
``vptq_core.eval.evaluate`` on the checkpoint loaded in float32 with the head as stored (the weights the GGUF
holds) and, for reference, as ``eval`` loads it by default (bf16, head at 8 bits on the CPU). The paired
difference is the mean per-token NLL difference ± its standard error; the sampling noise of a perplexity is the
standard error of the mean NLL. Figures: bench/results/gguf_export_*.txt.

    python bench/gguf_export.py --llama-python /work/llama-venv/bin/python [--windows 40] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.cli import main as cli_main  # noqa: E402
from vptq_core.data import eval_windows  # noqa: E402
from vptq_core.eval import evaluate  # noqa: E402
from vptq_core.gguf_export import export_gguf  # noqa: E402
from vptq_core.models import cache_dir  # noqa: E402
from vptq_core.storage.checkpoint import load_quantized  # noqa: E402

# Run by --llama-python: the per-token NLL of each window from llama.cpp's logits.
LLAMA_SCRIPT = r"""
import json, sys, time
import numpy as np
import llama_cpp
import llama_cpp.llama
cfg = json.load(open(sys.argv[1]))
n = cfg["seqlen"]
if not cfg["extra_bufts"]:  # keep the weights in the file's layout (no AMX / repacked copies)
    defaults = llama_cpp.llama_model_default_params
    def model_params():
        params = defaults()
        params.use_extra_bufts = False
        return params
    llama_cpp.llama.llama_cpp.llama_model_default_params = model_params
llm = llama_cpp.Llama(model_path=cfg["gguf"], n_ctx=n, n_batch=n, n_ubatch=n, n_threads=cfg["threads"],
                      n_threads_batch=cfg["threads"], logits_all=True, verbose=False)
nll, t0 = [], time.perf_counter()
for ids in cfg["windows"]:
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    top = logits.max(-1)
    logz = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    target = np.asarray(ids[1:])
    nll.extend((logz - logits[np.arange(len(target)), target]).tolist())
print(json.dumps({"nll": nll, "seconds": time.perf_counter() - t0, "version": llama_cpp.__version__}))
"""


def llama_reason(python: str | None) -> str | None:
    """Why ``python`` cannot run llama.cpp here (None: it can)."""
    if not python:
        return ("bench/gguf_export.py needs --llama-python: an interpreter with llama-cpp-python (llama_cpp), "
                "built in its own environment")
    if not os.access(python, os.X_OK):
        return f"bench/gguf_export.py: --llama-python {python} is not an executable interpreter"
    probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True, check=False)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"bench/gguf_export.py: --llama-python {python} cannot import llama_cpp ({last})"
    return None


def token_nll(model, windows: torch.Tensor) -> list[float]:
    """The NLL of every next token of each window, as ``evaluate`` sums them."""
    out = []
    with torch.no_grad():
        for ids in windows:
            logp = F.log_softmax(model(ids[None], use_cache=False).logits.float()[0, :-1], dim=-1)
            out += (-logp.gather(1, ids[1:, None])[:, 0]).tolist()
    return out


def mean_stderr(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std() / math.sqrt(len(values)))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def checkpoint_for(args) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)
    ckpt = Path(args.work) / f"{args.model}-gptq4-g32-sym"
    if not (ckpt / "config.json").is_file():
        rc = cli_main(["quantize", "--model", args.model, "--method", "gptq", "--bits", "4", "--group-size", "32",
                       "--set", "sym=true", "--calib-samples", str(args.calib_samples), "--seqlen", str(args.seqlen),
                       "--out", str(ckpt), "--quiet", "--threads", str(args.threads)])
        if rc:
            sys.exit(rc)
    return ckpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", help="an interpreter with llama-cpp-python")
    parser.add_argument("--checkpoint", help="a GGUF-compatible checkpoint (default: quantized here from --model)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--work", default=str(cache_dir() / "bench-gguf"), help="where checkpoint and GGUF go")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--text", default="wiki")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--extra-bufts", action="store_true", help="let llama.cpp repack the weights into its "
                        "extra CPU buffer types (AMX, repacked Q4_0); off by default: on a CPU that reports AMX "
                        "without the kernel enabling it, decoding crashes with them")
    args = parser.parse_args()
    reason = llama_reason(args.llama_python)
    if reason:
        print(reason)
        sys.exit(1)
    torch.set_num_threads(args.threads)
    ckpt = checkpoint_for(args)
    gguf_path = Path(args.work) / f"{ckpt.name}.gguf"
    t0 = time.perf_counter()
    summary = export_gguf(ckpt, gguf_path)
    export_s = time.perf_counter() - t0
    model, tok = load_quantized(ckpt, dtype=torch.float32, head_bits=0)
    windows = eval_windows(tok, args.text, args.seqlen, args.windows)
    ours = evaluate(model, tok, windows=windows)
    ours_nll = token_nll(model, windows)
    default_model, _ = load_quantized(ckpt)
    default = evaluate(default_model, tok, windows=windows)
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"gguf": str(gguf_path), "seqlen": args.seqlen, "threads": args.threads,
                                   "extra_bufts": args.extra_bufts, "windows": windows.tolist()}))
        proc = subprocess.run([args.llama_python, "-c", LLAMA_SCRIPT, str(job)], capture_output=True, text=True,
                              check=False)
    if proc.returncode:
        print(f"llama.cpp failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        sys.exit(1)
    llama = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(llama["nll"]) == len(ours_nll) == ours.tokens
    diff_mean, diff_se = mean_stderr([a - b for a, b in zip(llama["nll"], ours_nll, strict=True)])
    ours_mean, ours_se = mean_stderr(ours_nll)
    llama_mean, llama_se = mean_stderr(llama["nll"])
    print(f"Protocol: see the docstring; {cpu_name()}, {args.threads} threads; checkpoint {ckpt.name}; "
          f"text {args.text!r}: {ours.protocol()}; llama-cpp-python {llama['version']}, extra buffer types "
          f"{'on' if args.extra_bufts else 'off'}")
    print(f"export: {summary['tensors']} ({summary['file_type']}), {summary['size_bytes'] / 1e6:.1f} MB, "
          f"{export_s:.1f} s\n")
    print("| evaluator | perplexity | mean NLL ± s.e. | seconds |")
    print("|---|---|---|---|")
    print(f"| vptq_core eval, float32, head as stored | {ours.perplexity:.4f} | {ours_mean:.5f} ± {ours_se:.5f} | "
          f"{ours.seconds:.1f} |")
    print(f"| llama.cpp on the exported GGUF | {math.exp(llama_mean):.4f} | {llama_mean:.5f} ± {llama_se:.5f} | "
          f"{llama['seconds']:.1f} |")
    print(f"| vptq_core eval, as `eval` loads it (bf16, head auto) | {default.perplexity:.4f} | "
          f"{default.nll:.5f} | {default.seconds:.1f} |")
    print(f"\nper-token NLL, llama.cpp − vptq_core float32: {diff_mean:+.5f} ± {diff_se:.5f} nats "
          f"(paired over {len(ours_nll)} tokens); perplexity ratio {math.exp(llama_mean) / ours.perplexity:.5f}; "
          f"the perplexity's own sampling noise ±{ours_se:.5f} nats")


if __name__ == "__main__":
    main()
