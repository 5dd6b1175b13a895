"""Peak memory of a streamed quantization run against the number of layers: bounded by one block.

For each layer count, a random-weight model of a large shape is written to a safetensors directory one
tensor at a time (built on the meta device, never materialised as a whole), then quantized by
``api.quantize_to_dir`` in a fresh subprocess, blocks streamed from the file. The subprocess samples its
resident set (``/proc/self/statm``, every 20 ms) and reads ``resource.getrusage`` at the end; the peak is
compared with the formula

    predicted = one block in fp32 + calibration activations (inputs, targets, outputs: 3 x n x seq x hidden
                fp32) + the non-block tensors (embeddings, LM head, final norm, stored dtype)

and with the formula plus the block's Hessians (fp32, one per distinct linear input) and the process's own
footprint before the run (torch, transformers, the tokenizer: "baseline").

    python bench/memory.py                                  # llama-7B shape, 2 / 4 / 8 layers, RTN 4-bit
    python bench/memory.py --layers 2 8 --method gptq --samples 16 --seqlen 256
    python bench/memory.py --shape qwen05b --layers 24      # the 0.5B-class figure
    python bench/memory.py --shape qwen05b --layers 24 --before /tmp/before   # the same, old code (full load)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    "llama7b": dict(family="llama", hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000,
                    tied=False),
    "qwen05b": dict(family="qwen2", hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True),
    # tiny-random-llama's shape (the byte tokenizer's 259 tokens): checks that the script runs, no memory figure
    "tiny": dict(family="llama", hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=259, tied=True),
}
GB = 1 << 30


def model_config(shape: str, layers: int):
    from transformers import LlamaConfig, Qwen2Config

    s = SHAPES[shape]
    kwargs = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], num_hidden_layers=layers,
                  max_position_embeddings=4096, tie_word_embeddings=s["tied"], dtype="bfloat16")
    return LlamaConfig(**kwargs) if s["family"] == "llama" else Qwen2Config(**kwargs)


def write_random_model(shape: str, layers: int, directory: Path, seed: int = 0) -> dict:
    """config.json + model.safetensors (bf16, random) + a byte tokenizer of ``shape`` with ``layers`` blocks."""
    return write_random_weights(model_config(shape, layers), directory, seed)


def write_random_weights(config, directory: Path, seed: int = 0) -> dict:
    """config.json + model.safetensors (bf16, random: norms 1, biases 0, the rest N(0, 0.02)) + a byte tokenizer
    for a transformers ``config``, one tensor in memory at a time -> parameters {"block": n, "other": n}."""
    import accelerate
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import initialization as hf_init

    from vptq_core.models import byte_tokenizer
    from vptq_core.storage.checkpoint import SafetensorsWriter

    with accelerate.init_empty_weights(include_buffers=False), hf_init.no_init_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tied = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    counts = {"block": 0, "other": 0}
    with SafetensorsWriter(directory / "model.safetensors") as writer:
        for name, meta in skeleton.state_dict().items():
            if name in tied:
                continue
            if name.endswith("norm.weight"):
                tensor = torch.ones(meta.shape, dtype=torch.bfloat16)
            elif name.endswith(".bias"):
                tensor = torch.zeros(meta.shape, dtype=torch.bfloat16)
            else:
                tensor = (torch.randn(meta.shape, generator=gen) * 0.02).to(torch.bfloat16)
            counts["block" if ".layers." in name else "other"] += tensor.numel()
            writer.add(name, tensor)
            del tensor
        writer.close(metadata={"format": "pt"})
    config.save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return counts


class RssSampler(threading.Thread):
    """Peak resident set of this process, sampled from /proc/self/statm."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak, self._stop_event = interval, 0, threading.Event()
        self.page = os.sysconf("SC_PAGE_SIZE")

    def current(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, self.current())
        return self.peak


def worker(args) -> None:
    """One quantization run in this (fresh) process; prints one JSON line."""
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import inspect

    import torch

    torch.set_num_threads(args.threads)
    from vptq_core.api import quantize_to_dir
    from vptq_core.quant import methods
    from vptq_core.quant.config import CalibConfig

    config = methods.make_config(args.method, json.loads(args.settings))
    calib = CalibConfig(text="wiki", samples=args.samples, seqlen=args.seqlen, seed=0)
    sampler = RssSampler()
    baseline = sampler.current()
    sampler.start()
    kwargs = {"stream": True} if "stream" in inspect.signature(quantize_to_dir).parameters else {}
    t0 = time.perf_counter()
    _, summary = quantize_to_dir(args.dir, args.method, config, calib, args.out, device="cpu", **kwargs)
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"baseline": baseline, "peak_sampled": peak, "ru_maxrss": maxrss, "seconds": seconds,
                      "timings": summary.get("timings"), "streaming": summary.get("streaming", "n/a (old code)")}))


def predicted(shape: str, layers: int, samples: int, seqlen: int) -> dict:
    s = SHAPES[shape]
    h, i = s["hidden"], s["intermediate"]
    kv = h * s["kv_heads"] // s["heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * i  # linear weights (norms are negligible)
    other = s["vocab"] * h * (1 if s["tied"] else 2) + h
    return {
        "block_fp32": 4 * block,
        "activations": 3 * samples * seqlen * h * 4,
        "non_block": 2 * other,
        "hessians": 4 * (3 * h * h + i * i),
        "block_weights": block * layers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama7b")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--method", default="rtn")
    parser.add_argument("--settings", default='{"bits": 4, "group_size": 128}', help="method settings, JSON")
    parser.add_argument("--samples", type=int, default=8, help="calibration windows")
    parser.add_argument("--seqlen", type=int, default=256, help="tokens per window")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", help="where the random models go (default: a temporary directory)")
    parser.add_argument("--before", help="run the quantization with another source tree (e.g. the code before "
                        "streaming) instead of this one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=str(ROOT), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    tree = args.before or str(ROOT)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vptq-memory-"))
    print(f"protocol: {args.shape} shape (bf16 random weights), {args.method} {args.settings}, calibration "
          f"{args.samples} x {args.seqlen} tokens (bundled wiki), {args.threads} threads, code: {tree}; peak RSS "
          f"= max(/proc/self/statm sampled every 20 ms, ru_maxrss) of a fresh process running "
          f"api.quantize_to_dir; load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for layers in args.layers:
        directory = work / f"{args.shape}-{layers}"
        t0 = time.perf_counter()
        counts = write_random_model(args.shape, layers, directory)
        write_s = time.perf_counter() - t0
        file_bytes = (directory / "model.safetensors").stat().st_size
        out = work / f"out-{layers}"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", tree, "--dir", str(directory),
               "--out", str(out), "--method", args.method, "--settings", args.settings, "--samples",
               str(args.samples), "--seqlen", str(args.seqlen), "--threads", str(args.threads)]
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"worker failed ({layers} layers):\n{proc.stderr[-3000:]}")
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        pred = predicted(args.shape, layers, args.samples, args.seqlen)
        peak = max(run["peak_sampled"], run["ru_maxrss"])
        formula = pred["block_fp32"] + pred["activations"] + pred["non_block"]
        row = {"layers": layers, "block_weights": counts["block"], "file_bytes": file_bytes, "peak": peak,
               "baseline": run["baseline"], "seconds": run["seconds"], "write_seconds": write_s,
               "formula": formula, "formula_full": formula + pred["hessians"] + run["baseline"],
               "streaming": run["streaming"], "timings": run["timings"]}
        rows.append(row)
        print(f"  {layers} layers: peak {peak / GB:.2f} GB in {run['seconds']:.0f} s (file written in "
              f"{write_s:.0f} s; {run['streaming']})", flush=True)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    pred = predicted(args.shape, 1, args.samples, args.seqlen)
    print(f"\nformula terms: block fp32 {pred['block_fp32'] / GB:.2f} GB, activations {pred['activations'] / GB:.2f} "
          f"GB, non-block {pred['non_block'] / GB:.2f} GB, Hessians {pred['hessians'] / GB:.2f} GB\n")
    print("| layers | block weights | file | peak RSS | time | formula (block + act. + non-block) | formula + "
          "Hessians + baseline | baseline (imports) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['block_weights'] / 1e9:.2f} B | {r['file_bytes'] / GB:.2f} GB | "
              f"**{r['peak'] / GB:.2f} GB** | {r['seconds']:.0f} s | {r['formula'] / GB:.2f} GB | "
              f"{r['formula_full'] / GB:.2f} GB | {r['baseline'] / GB:.2f} GB |")
    if len(rows) > 1:
        growth = (rows[-1]["peak"] - rows[0]["peak"]) / max(rows[-1]["layers"] - rows[0]["layers"], 1)
        print(f"\npeak growth per extra layer: {growth / (1 << 20):+.0f} MB "
              f"(a block is {pred['block_fp32'] / 2 / (1 << 20):.0f} MB in bf16)")
        per_block = rows[-1]["seconds"] / rows[-1]["layers"]
        print(f"extrapolated 32 layers: peak ~{rows[-1]['peak'] / GB:.2f} GB (the peak does not depend on the number "
              f"of layers), ~{per_block * 32 / 60:.0f} min at {per_block:.0f} s per block with this calibration")


if __name__ == "__main__":
    main()
