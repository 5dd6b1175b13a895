"""Greedy decode speed of a packed quantized checkpoint vs its bf16 original, in one process on CPU.

Protocol: both models load into the same process; a fixed chat prompt; one warm-up generation per model;
then ``--pairs`` pairs of timed runs, alternating which model goes first; each run = one prefill plus
``--tokens`` greedy single-token steps with a KV cache (end-of-sequence ignored, so every run decodes the
same number of tokens). Decode tokens/s = steps / time of the steps (prefill excluded, reported apart).
The table shows medians over pairs and the median of the per-pair speed ratios.

    python bench/decode.py --checkpoint DIR [--original smollm2-135m-instruct|DIR] [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import available_backends
from vptq_core.storage.checkpoint import load_quantized
from vptq_core.storage.modules import ScalarQLinear, VQLinear

PROMPT = "Explain in a few sentences why the sky looks blue during the day and red at sunset."


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters + buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt_ids: torch.Tensor, steps: int) -> tuple[list[int], float, float]:
    """(generated ids, prefill seconds, decode seconds for ``steps`` single-token steps)."""
    start = time.perf_counter()
    out = model(input_ids=prompt_ids, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    prefill = time.perf_counter() - start
    past, ids = out.past_key_values, [int(token)]
    start = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        ids.append(int(token))
    return ids, prefill, time.perf_counter() - start


def load_original(name: str, dtype: torch.dtype):
    from vptq_core.models import load_model

    return load_model(name, dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="packed checkpoint directory (save_quantized)")
    parser.add_argument("--original", default="smollm2-135m-instruct", help="model name or dense directory")
    parser.add_argument("--tokens", type=int, default=64, help="greedy decode steps per run")
    parser.add_argument("--threads", type=int, default=1, help="torch (and numba) CPU threads")
    parser.add_argument("--pairs", type=int, default=3, help="timed (original, quantized) pairs")
    parser.add_argument("--backend", default=None, help="force a kernel backend: reference | cpu | triton")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.threads < 1 or args.pairs < 1:
        parser.error("--tokens, --threads and --pairs must be >= 1")

    torch.set_num_threads(args.threads)
    try:
        import numba

        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass

    rss0 = rss_bytes()
    original, tok = load_original(args.original, torch.bfloat16)
    rss1 = rss_bytes()
    quantized, qtok = load_quantized(args.checkpoint)
    rss2 = rss_bytes()
    qmodules = [m for m in quantized.modules() if isinstance(m, (VQLinear, ScalarQLinear))]
    for module in qmodules:
        module.backend = args.backend
    tok = tok or qtok
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(prompt_ids, torch.Tensor):  # transformers 5 returns a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    models = {"bf16 original": original, "quantized": quantized}

    for model in models.values():  # warm-up: kernel compilation, allocator, caches
        greedy(model, prompt_ids, min(8, args.tokens))
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    outputs: dict[str, list[int]] = {}
    for pair in range(args.pairs):
        order = list(models) if pair % 2 == 0 else list(reversed(models))
        for name in order:
            gc.collect()
            ids, prefill, decode = greedy(models[name], prompt_ids, args.tokens)
            timings[name].append((prefill, decode))
            outputs[name] = ids

    def tps(name: str) -> list[float]:
        return [args.tokens / decode for _, decode in timings[name]]

    ratios = [q / o for q, o in zip(tps("quantized"), tps("bf16 original"))]
    agree = sum(a == b for a, b in zip(outputs["quantized"], outputs["bf16 original"]))
    first_diff = next((i for i, (a, b) in enumerate(zip(outputs["quantized"], outputs["bf16 original"]))
                       if a != b), None)
    usable = [name for name, (ok, _) in available_backends().items() if ok]
    qlayers = len(qmodules)
    print("decode benchmark")
    print(f"  checkpoint: {args.checkpoint} ({qlayers} quantized linears, "
          f"{type(qmodules[0]).__name__ if qmodules else '-'}); original: {args.original} (bf16)")
    print(f"  prompt: {prompt_ids.shape[1]} tokens (chat template); greedy steps per run: {args.tokens}; "
          f"batch 1; KV cache")
    print(f"  threads: {args.threads}; kernel backend: {args.backend or 'auto'} (usable: {', '.join(usable)}); "
          f"torch {torch.__version__}")
    print(f"  protocol: 1 warm-up run per model, {args.pairs} alternating pairs, medians; ratio = median of "
          "per-pair ratios")
    print()
    header = "| model | decode tok/s (median) | runs | prefill ms | param+buffer MB | RSS after load MB |"
    print(header)
    print("|---|---|---|---|---|---|")
    load_delta = {"bf16 original": rss1 - rss0, "quantized": rss2 - rss1}
    for name, model in models.items():
        runs = ", ".join(f"{v:.1f}" for v in tps(name))
        prefill_ms = statistics.median(p for p, _ in timings[name]) * 1e3
        print(f"| {name} | {statistics.median(tps(name)):.1f} | {runs} | {prefill_ms:.0f} | "
              f"{tensor_bytes(model) / 2**20:.1f} | {load_delta[name] / 2**20:+.0f} |")
    print()
    print(f"speed ratio quantized / bf16: {statistics.median(ratios):.2f}x (per pair: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"memory ratio quantized / bf16 (param+buffer): {tensor_bytes(quantized) / tensor_bytes(original):.2f}")
    print(f"greedy tokens equal to the original: {agree}/{args.tokens + 1}"
          f"{'' if first_diff is None else f' (first difference at step {first_diff})'}")
    print(f"process peak RSS (both models loaded): {peak_rss_bytes() / 2**20:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
