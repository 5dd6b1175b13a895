"""Greedy decode speed of a quantized model vs its bf16 original, in one process on CPU, and where a token's
time goes.

Two sources:
  --checkpoint DIR      a packed checkpoint (save_quantized) against its original (--original, default the
                        bundled SmolLM2-135M-Instruct) in bf16;
  --shape 0.5b|smollm2|tiny  random weights of a model shape (speed does not depend on the values): a bf16 model
                        and the same model with every block linear replaced by a random packed layer of
                        --layout (vptq2 = VPTQ v6 k4096 + 0.5% outliers v4 k256 + perm, the 2-bit default;
                        vptq3 = v4 k4096; scalar4 = 4-bit codes, groups of 128; scalar4-a8 / scalar4-a8asym =
                        W4A8 as LRQ makes it: 4-bit per-channel codes, 8-bit per-token activations, symmetric /
                        asymmetric); --quantize-head also
                        replaces the LM head (untied from the bf16 embedding), as the CLI's --quantize-head.
  --head-bits auto|0|4|8  the quantized model's LM head at run time as ``load_quantized`` sets it (default auto:
                        8-bit round-to-nearest in groups of 128 for a large head on the CPU; vptq_core.storage.head);
                        --head-ab also times the quantized model with its head as stored (bf16) in the same pairs.

Protocol: both models in the same process; a fixed chat prompt; one warm-up run per model; then --pairs pairs of
timed runs, alternating which model goes first; each run = one prefill plus --tokens greedy single-token steps
with a KV cache (end-of-sequence ignored, so every run decodes the same number of tokens). --loop picks the
decode loop, the same for both models: "cache" (a plain forward loop with transformers' dynamic KV cache),
"static" (a preallocated static KV cache), "generate" (transformers' generate()), "lean"
(``vptq_core.generation.decode_loop`` as the app's chat runs it: last-position logits only at prefill, no logits
processors, and for llama-family models ``vptq_core.quant.lean_decoder``: the same linears, the operations between them
fused into native calls, its own preallocated KV cache), "lean-model" / "lean-static" (decode_loop with the
model's own forward and a dynamic / static KV cache).
Decode tokens/s = steps / time of the steps (prefill excluded, reported apart); medians over pairs and the
median of the per-pair ratios. --anatomy adds a table of one decode step's time split into the block linears,
the LM head and the rest (attention, norms, rotary, embedding, Python), measured with timing hooks.

    python bench/decode.py --checkpoint DIR [--original NAME|DIR] [--tokens 64] [--threads 1] [--anatomy]
    python bench/decode.py --shape 0.5b --layout vptq2 [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vptq_core.kernels import VQSpec, available_backends  # noqa: E402
from vptq_core.kernels.synthetic import random_scalar_layer, random_vq_layer  # noqa: E402
from vptq_core.models import byte_tokenizer, load_model  # noqa: E402
from vptq_core.quant import lean_generate  # noqa: E402
from vptq_core.quant.blocks import block_linears, decoder_blocks  # noqa: E402
from vptq_core.quant.embedding import module_name  # noqa: E402
from vptq_core.quant.vptq import outlier_columns  # noqa: E402
from vptq_core.storage.checkpoint import load_quantized  # noqa: E402
from vptq_core.storage.head import quantize_head  # noqa: E402
from vptq_core.storage.modules import ScalarQLinear, VQLinear, set_submodule  # noqa: E402

PROMPT = "Explain in a few sentences why the sky looks blue during the day and red at sunset."
QUANTIZED = (VQLinear, ScalarQLinear)

# name -> (model family config kwargs); vocab sizes as in the real models (the LM head is a large part of a token)
SHAPES = {
    "0.5b": dict(family="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "smollm2": dict(family="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    # tiny-random-llama's shape: seconds for the whole script, to check that it runs (not a speed figure)
    "tiny": dict(family="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=259, tie_word_embeddings=True),
}


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of parameters + buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _module_bytes(module: nn.Module | None, seen: set) -> int:
    """Bytes of the tensors of ``module`` not counted yet (each tensor once: tied weights)."""
    total = 0
    for t in [] if module is None else [*module.parameters(), *module.buffers()]:
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def bytes_per_token(model: nn.Module, context: float) -> dict[str, float]:
    """The bytes one decode step must read, by part: every block linear and the LM head once (codebooks, scales
    and permutations included), one embedding row, the norm weights, and the KV cache of ``context`` earlier
    tokens in the model dtype. A lower bound of a step's memory traffic (activations and scratch not counted)."""
    seen: set = set()
    config = model.config
    blocks = decoder_blocks(model)
    linears = sum(_module_bytes(m, seen) for b in blocks for m in block_linears_any(b))
    head = _module_bytes(model.get_output_embeddings(), seen)
    norms = sum(_module_bytes(m, seen) for b in blocks for m in b.modules() if "Norm" in type(m).__name__)
    inner = getattr(model, "model", model)
    norms += _module_bytes(getattr(inner, "norm", None), seen)
    dtype_bytes = next(p for p in model.parameters() if p.is_floating_point()).element_size()
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    kv = 2 * len(blocks) * kv_heads * head_dim * context * dtype_bytes
    parts = {"linears": linears, "head": head, "embedding row": config.hidden_size * dtype_bytes, "norms": norms,
             "kv cache": kv}
    parts["total"] = sum(parts.values())
    return parts


# ------------------------------------------------------------------------------------------- decode loops
# The loops' clock: wall time, or (--clock thread) this thread's CPU time, which other work on a shared machine
# does not inflate (one thread only: with more, the kernels' other workers are not counted).
CLOCK = {"now": time.perf_counter}


def _now() -> float:
    return CLOCK["now"]()

def _cache_loop(model: nn.Module, prompt_ids: torch.Tensor, steps: int, static: bool) -> tuple[list[int], float, float]:
    from transformers import DynamicCache, StaticCache

    cache = (StaticCache(config=model.config, max_cache_len=prompt_ids.shape[1] + steps + 1) if static
             else DynamicCache(config=model.config))
    start = _now()
    positions = torch.arange(prompt_ids.shape[1])
    out = model(input_ids=prompt_ids, past_key_values=cache, use_cache=True, cache_position=positions)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    prefill = _now() - start
    ids = [int(token)]
    position = torch.tensor([prompt_ids.shape[1]])
    start = _now()
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        position += 1
        ids.append(int(token))
    return ids, prefill, _now() - start


class _Marks:
    """A streamer that only notes when each new token arrives (generate() first puts the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, _value: torch.Tensor) -> None:
        self.times.append(_now())

    def end(self) -> None:
        pass


def _generate_loop(model: nn.Module, prompt_ids: torch.Tensor, steps: int,
                   own: bool = False) -> tuple[list[int], float, float]:
    """``model.generate`` (the lean token loop on models the project loads); ``own``: transformers' own loop
    (the class's ``generate``, as a model built by plain transformers runs it). Prefill = time to the first new
    token; decode = first to last new token."""
    generate = (lambda **kw: type(model).generate(model, **kw)) if own else model.generate
    marks = _Marks()
    start = _now()
    out = generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False, pad_token_id=0,
                   max_new_tokens=steps + 1, min_new_tokens=steps + 1, streamer=marks)
    new = marks.times[1:]
    return out[0, prompt_ids.shape[1]:].tolist(), new[0] - start, max(new[-1] - new[0], 1e-9)


def _lean_loop(model: nn.Module, prompt_ids: torch.Tensor, steps: int, cache: str) -> tuple[list[int], float, float]:
    """vptq_core.generation.decode_loop (what the app's chat runs): prefill = time to the first token."""
    from vptq_core.generation import decode_loop

    marks: list[float] = []
    start = _now()
    ids = decode_loop(model, prompt_ids, steps + 1, cache=cache, eos_ids=(),
                      on_token=lambda _ids: marks.append(_now()))
    return ids, marks[0] - start, max(marks[-1] - marks[0], 1e-9)


LOOPS: dict[str, Callable] = {
    "cache": lambda m, p, s: _cache_loop(m, p, s, static=False),
    "static": lambda m, p, s: _cache_loop(m, p, s, static=True),
    "generate": _generate_loop,
    "transformers": lambda m, p, s: _generate_loop(m, p, s, own=True),
    "lean": lambda m, p, s: _lean_loop(m, p, s, "auto"),
    "lean-model": lambda m, p, s: _lean_loop(m, p, s, "dynamic"),
    "lean-static": lambda m, p, s: _lean_loop(m, p, s, "static"),
}


# ---------------------------------------------------------------------------------------------- anatomy
def _time_modules(model: nn.Module, run: Callable[[], object]) -> tuple[dict[str, float], float]:
    """({"linears": s, "head": s} spent inside the block linears and the LM head during ``run()``, wall s)."""
    spent = {"linears": 0.0, "head": 0.0}
    starts: dict[int, float] = {}
    targets = [(m, "linears") for block in decoder_blocks(model) for m in block_linears_any(block)]
    targets.append((model.get_output_embeddings(), "head"))
    handles = []
    for module, kind in targets:
        def pre(m, _a):
            starts[id(m)] = time.perf_counter()

        def post(m, _a, _o, kind=kind):
            spent[kind] += time.perf_counter() - starts[id(m)]

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    finally:
        for h in handles:
            h.remove()
    return spent, wall


@torch.inference_mode()
def anatomy(model: nn.Module, prompt_ids: torch.Tensor, steps: int, loop: Callable) -> dict[str, float]:
    """ms per decode step of ``loop`` (one of LOOPS): total (no hooks), block linears, LM head, rest = total -
    linears - head. The hooked times of a prefill-only run are subtracted, so only the ``steps`` decode steps
    count."""
    loop(model, prompt_ids, 4)
    _, _, plain = loop(model, prompt_ids, steps)
    with_steps, hooked = _time_modules(model, lambda: loop(model, prompt_ids, steps))
    prefill_only, _ = _time_modules(model, lambda: loop(model, prompt_ids, 0))
    linears = (with_steps["linears"] - prefill_only["linears"]) / steps
    head = (with_steps["head"] - prefill_only["head"]) / steps
    total = plain / steps
    return {"total": total * 1e3, "linears": linears * 1e3, "head": head * 1e3,
            "rest": (total - linears - head) * 1e3, "hook_overhead": (hooked - plain) / steps * 1e3}


def block_linears_any(block: nn.Module) -> list[nn.Module]:
    """The block's linear layers, dense or quantized."""
    return [m for m in block.modules() if isinstance(m, (nn.Linear, *QUANTIZED))]


# ----------------------------------------------------------------------------------------- random models
def random_dense(shape: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kwargs = dict(SHAPES[shape])
    family = kwargs.pop("family")
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    config = config_cls(**kwargs, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_cls(config).to(torch.bfloat16)
    return model.eval()


def random_packed(layout: str, out_f: int, in_f: int, bias: bool, seed: int) -> nn.Module:
    """A random packed layer of ``layout`` (bf16 tensors) in place of a [out_f, in_f] linear."""
    if layout.startswith("scalar4"):
        # scalar4: weight-only, groups of 128; scalar4-a8 / scalar4-a8asym: LRQ's W4A8 (per-channel weights,
        # 8-bit per-token activations, symmetric / asymmetric)
        act = {"scalar4": None, "scalar4-a8": "token", "scalar4-a8asym": "token_asym"}[layout]
        group = 128 if act is None else in_f
        spec, w = random_scalar_layer(out_f, in_f, 4, group, seed=seed, dtype=torch.bfloat16, bias=bias)
        module = ScalarQLinear(in_f, out_f, 4, group, bias=bias, act_bits=16 if act is None else 8,
                               act_granularity=act or "token", dtype=torch.bfloat16)
        tensors = {"codes": w.codes, "scales": w.scales, "zeros": w.zeros, "bias": w.bias}
    else:
        v, k = (6, 4096) if layout == "vptq2" else (4, 4096)
        outliers = outlier_columns(in_f, 0.5, 1)
        spec = VQSpec(in_f, out_f, v, k, outlier_vector_len=4, num_outlier_centroids=256, outlier_size=outliers)
        w = random_vq_layer(spec, seed=seed, dtype=torch.bfloat16, perm=True, bias=bias)
        module = VQLinear.from_config(spec.layer_config(bias=bias, enable_perm=True), dtype=torch.bfloat16)
        tensors = {"indices": w.indices, "centroids.weight": w.centroids, "perm": w.perm,
                   "outlier_indices": w.outlier_indices, "outlier_centroids.weight": w.outlier_centroids,
                   "bias": w.bias}
    module.load_state_dict({k: t for k, t in tensors.items() if t is not None}, strict=True)
    return module


def random_quantized(dense: nn.Module, layout: str, head: bool = False) -> nn.Module:
    """A copy of ``dense`` whose block linears (and, with ``head``, the LM head, as ``--quantize-head`` does) are
    random packed layers of ``layout``; the input embedding stays bf16."""
    model = copy.deepcopy(dense)
    for b, block in enumerate(decoder_blocks(model)):
        for i, (name, linear) in enumerate(block_linears(block).items()):
            module = random_packed(layout, linear.out_features, linear.in_features, linear.bias is not None, b * 16 + i)
            set_submodule(block, name, module)
    if head:
        lm_head = model.get_output_embeddings()
        packed = random_packed(layout, lm_head.out_features, lm_head.in_features, lm_head.bias is not None, 9999)
        set_submodule(model, module_name(model, lm_head), packed)
        model.config.tie_word_embeddings = False
    return model


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="packed checkpoint directory (save_quantized)")
    source.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this model shape")
    parser.add_argument("--quantize-head", action="store_true",
                        help="with --shape: the LM head is a packed layer of --layout too (as --quantize-head)")
    parser.add_argument("--layout", choices=["vptq2", "vptq3", "scalar4", "scalar4-a8", "scalar4-a8asym"],
                        default="vptq2",
                        help="with --shape: the quantized layers")
    parser.add_argument("--original", default="smollm2-135m-instruct", help="with --checkpoint: model or dense dir")
    parser.add_argument("--tokens", type=int, default=64, help="greedy decode steps per run")
    parser.add_argument("--threads", default="1",
                        help="torch CPU threads (the kernels use torch's pool); a comma list (1,2) measures each")
    parser.add_argument("--pairs", type=int, default=3, help="timed (original, quantized) pairs")
    parser.add_argument("--loop", default="cache",
                        help=f"decode loop for both models, one of {sorted(LOOPS)}; a comma list measures each")
    parser.add_argument("--backend", default=None, help="force a kernel backend: reference | native | cpu | triton")
    parser.add_argument("--anatomy", action="store_true", help="also split one decode step's time")
    parser.add_argument("--touch-ab", action="store_true",
                        help="also time the quantized model with the native GEMV's codebook touch off "
                             "(kernels/csrc: touch_lines), in the same alternated pairs")
    parser.add_argument("--head-bits", choices=["auto", "0", "4", "8"], default="auto",
                        help="the quantized model's LM head at run time, as load_quantized sets it (auto: 8 bits "
                             "for a large head on the CPU; 0: as stored, bf16); not with --quantize-head")
    parser.add_argument("--head-ab", action="store_true",
                        help="also time the quantized model with its LM head as stored (bf16), same alternated pairs")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="time the loops by wall clock, or by this thread's CPU time (a loaded machine; "
                             "--threads 1 only)")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="prompt length: the chat prompt repeated / cut to this many tokens (0: as it is)")
    parser.add_argument("--device", default="cpu", help="run both models on this device (cuda: GPU comparison)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                        help="dtype of both models (float16 for the GPU comparison)")
    args = parser.parse_args(argv)
    try:
        thread_counts = [int(t) for t in str(args.threads).split(",")]
    except ValueError:
        parser.error(f"--threads must be a number or a comma list of numbers, got {args.threads!r}")
    loops = [name.strip() for name in args.loop.split(",")]
    if unknown := [name for name in loops if name not in LOOPS]:
        parser.error(f"--loop {unknown[0]!r}: choose from {', '.join(sorted(LOOPS))}")
    if args.tokens < 1 or min(thread_counts) < 1 or args.pairs < 1:
        parser.error("--tokens, --threads and --pairs must be >= 1")
    if args.clock == "thread" and thread_counts != [1]:
        parser.error("--clock thread measures one thread: use it with --threads 1")
    CLOCK["now"] = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"bench/decode.py --device {args.device} needs a CUDA device: torch.cuda.is_available() is "
                         "False")
    torch.set_num_threads(thread_counts[0])

    rss0 = rss_bytes()
    if args.checkpoint:
        original, tok = load_model(args.original, dtype=torch.bfloat16)
        rss1 = rss_bytes()
        quantized, qtok = load_quantized(args.checkpoint, head_bits=0)  # the head is set below, after .to()
        tok = tok or qtok
        label = f"checkpoint {args.checkpoint} vs {args.original} (bf16)"
    else:
        original, tok = random_dense(args.shape), byte_tokenizer()
        rss1 = rss_bytes()
        quantized = random_quantized(original, args.layout, head=args.quantize_head)
        for model in (original, quantized):  # as load_model / load_quantized hand them out
            lean_generate.enable(model)
        label = (f"random weights, shape {args.shape} ({SHAPES[args.shape]}), quantized layout {args.layout}"
                 + (", LM head quantized too (untied; embedding bf16)" if args.quantize_head else ""))
    rss2 = rss_bytes()
    qmodules = [m for m in quantized.modules() if isinstance(m, QUANTIZED)]
    for module in qmodules:
        module.backend = args.backend
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]
    if args.prompt_tokens > 0:
        reps = -(-args.prompt_tokens // prompt_ids.shape[1])
        prompt_ids = prompt_ids.repeat(1, reps)[:, :args.prompt_tokens]
    dtype = getattr(torch, args.dtype)
    if args.device != "cpu" or dtype != torch.bfloat16:
        original, quantized = original.to(args.device, dtype), quantized.to(args.device, dtype)
        prompt_ids = prompt_ids.to(args.device)
    stored_head = copy.copy(quantized)  # the same modules but its own child dict: the head as stored
    stored_head._modules = dict(quantized._modules)
    stored_head.__dict__.pop("generate", None)  # the copied one would run ``quantized``
    lean_generate.enable(stored_head)
    head_bits = 0 if args.quantize_head else quantize_head(quantized, args.head_bits)
    rss2 = rss_bytes()
    label += (f"; LM head at run time: {head_bits}-bit round-to-nearest, groups of 128 (--head-bits {args.head_bits})"
              if head_bits else f"; LM head as stored (--head-bits {args.head_bits})")
    models = {"bf16 original": original, "quantized": quantized}
    head_as_stored = "quantized, LM head as stored"
    if args.head_ab and head_bits:
        models[head_as_stored] = stored_head
    untouched = "quantized, codebooks not touched"
    if args.touch_ab:
        models[untouched] = quantized
    context = prompt_ids.shape[1] + args.tokens / 2  # the mean KV length a decode step reads
    bytes_of = {name: bytes_per_token(model, context) for name, model in models.items()}
    summary = []
    for loop_name in loops:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            setting = dict(vars(args), loop=loop_name, threads=threads)
            summary.append(_measure(setting, models, prompt_ids, label, qmodules, untouched, head_as_stored,
                                    head_bits, load_delta=(rss0, rss1, rss2), bytes_of=bytes_of))
    _print_bytes(bytes_of, context)
    _print_summary(summary, bytes_of)
    print(f"process peak RSS (both models loaded): {peak_rss_bytes() / 2**20:.0f} MB")
    return 0


def _print_bytes(bytes_of: dict[str, dict[str, float]], context: float) -> None:
    print()
    print(f"bytes one decode step reads (MB; KV cache at the mean context of {context:.0f} tokens):")
    parts = [p for p in next(iter(bytes_of.values())) if p != "total"]
    print(f"| model | {' | '.join(parts)} | total | ceiling × bf16 |")
    print("|---|" + "---|" * (len(parts) + 2))
    base = bytes_of["bf16 original"]["total"]
    for name, b in bytes_of.items():
        print(f"| {name} | {' | '.join(f'{b[p] / 1e6:.2f}' for p in parts)} | {b['total'] / 1e6:.1f} | "
              f"{base / b['total']:.2f} |")


def _print_summary(summary: list[dict], bytes_of: dict[str, dict[str, float]]) -> None:
    """One row per (loop, threads): speeds, the ratio, effective GB/s and how close the ratio is to its ceiling."""
    ceiling = bytes_of["bf16 original"]["total"] / bytes_of["quantized"]["total"]
    print()
    print("summary (ceiling = bytes per token of bf16 / of the quantized model; GB/s = bytes per token × tok/s):")
    print("| loop | threads | bf16 tok/s | quantized tok/s | ratio | ceiling | ratio / ceiling | bf16 GB/s | "
          "quantized GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in summary:
        o, q = row["tok/s"]["bf16 original"], row["tok/s"]["quantized"]
        print(f"| {row['loop']} | {row['threads']} | {o:.1f} | {q:.1f} | {row['ratio']:.2f}x | {ceiling:.2f}x | "
              f"{row['ratio'] / ceiling:.0%} | {o * bytes_of['bf16 original']['total'] / 1e9:.1f} | "
              f"{q * bytes_of['quantized']['total'] / 1e9:.1f} |")


def _measure(args: dict, models: dict, prompt_ids: torch.Tensor, label: str, qmodules: list, untouched: str,
             head_as_stored: str, head_bits: int, load_delta: tuple[int, int, int],
             bytes_of: dict[str, dict[str, float]]) -> dict:
    """Warm up, time ``pairs`` alternated pairs of one loop at one thread count, print its tables; the summary row."""
    args = argparse.Namespace(**args)
    loop = LOOPS[args.loop]
    rss0, rss1, rss2 = load_delta

    def run(name: str, steps: int) -> tuple[list[int], float, float]:
        if name != untouched:
            return loop(models[name], prompt_ids, steps)
        from vptq_core.kernels import native

        native._ext().set_touch(0)
        try:
            return loop(models[name], prompt_ids, steps)
        finally:
            native._ext().set_touch(1)

    with torch.inference_mode():
        for name in models:  # warm-up: kernel builds, allocator, caches
            run(name, min(8, args.tokens))
        timings: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
        outputs: dict[str, list[int]] = {}
        for pair in range(args.pairs):
            order = list(models) if pair % 2 == 0 else list(reversed(models))
            for name in order:
                gc.collect()
                ids, prefill, decode = run(name, args.tokens)
                timings[name].append((prefill, decode))
                outputs[name] = ids

    def tps(name: str) -> list[float]:
        return [args.tokens / decode for _, decode in timings[name]]

    ratios = [q / o for q, o in zip(tps("quantized"), tps("bf16 original"))]
    agree = sum(a == b for a, b in zip(outputs["quantized"], outputs["bf16 original"]))
    usable = [name for name, (ok, _) in available_backends().items() if ok]
    chosen = sorted({getattr(m._kernel, "backend", "?") for m in qmodules if m._kernel is not None})
    print("decode benchmark")
    print(f"  {label}; {len(qmodules)} quantized linears ({type(qmodules[0]).__name__ if qmodules else '-'})")
    print(f"  prompt: {prompt_ids.shape[1]} tokens (chat template); greedy steps per run: {args.tokens}; batch 1; "
          f"loop: {args.loop}")
    print(f"  device: {args.device}, dtype {args.dtype}")
    print(f"  threads: {args.threads}; kernel backend: {args.backend or 'auto'} -> {', '.join(chosen) or '-'} "
          f"(usable: {', '.join(usable)}); torch {torch.__version__}")
    print(f"  protocol: 1 warm-up run per model, {args.pairs} alternating pairs, medians; ratio = median of "
          f"per-pair ratios; clock: {args.clock}")
    print()
    print("| model | decode tok/s (median) | runs | prefill ms | param+buffer MB | RSS after load MB |")
    print("|---|---|---|---|---|---|")
    load_delta = {"bf16 original": rss1 - rss0, "quantized": rss2 - rss1, untouched: 0, head_as_stored: 0}
    for name, model in models.items():
        runs = ", ".join(f"{v:.1f}" for v in tps(name))
        prefill_ms = statistics.median(p for p, _ in timings[name]) * 1e3
        print(f"| {name} | {statistics.median(tps(name)):.1f} | {runs} | {prefill_ms:.0f} | "
              f"{tensor_bytes(model) / 2**20:.1f} | {load_delta[name] / 2**20:+.0f} |")
    print()
    print(f"speed ratio quantized / bf16: {statistics.median(ratios):.2f}x (per pair: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    prefill = [q[0] / o[0] for q, o in zip(timings["quantized"], timings["bf16 original"])]
    print(f"prefill time quantized / bf16 ({prompt_ids.shape[1]} tokens): {statistics.median(prefill):.2f}x (per "
          f"pair: {', '.join(f'{r:.2f}' for r in prefill)})")
    if args.touch_ab:
        ab = [a / b for a, b in zip(tps("quantized"), tps(untouched))]
        print(f"codebook touch on / off: {statistics.median(ab):.2f}x (per pair: {', '.join(f'{r:.2f}' for r in ab)})")
    if head_as_stored in models:
        ab = [a / b for a, b in zip(tps("quantized"), tps(head_as_stored))]
        print(f"LM head {head_bits}-bit / as stored: {statistics.median(ab):.2f}x (per pair: "
              f"{', '.join(f'{r:.2f}' for r in ab)})")
    original, quantized = models["bf16 original"], models["quantized"]
    print(f"memory ratio quantized / bf16 (param+buffer): {tensor_bytes(quantized) / tensor_bytes(original):.2f}")
    for name in ("bf16 original", "quantized"):
        per_token = bytes_of[name]["total"]
        print(f"{name}: {per_token / 1e6:.1f} MB per token, {statistics.median(tps(name)) * per_token / 1e9:.1f} GB/s")
    if args.checkpoint:
        print(f"greedy tokens equal to the original: {agree}/{args.tokens + 1}")
    if args.anatomy:
        print()
        print(f"anatomy of one decode step (ms; {args.tokens} steps after the prompt, loop {args.loop}; linears and "
              "head timed with hooks, rest = total without hooks - linears - head):")
        print("| model | total | block linears | LM head | rest | hook overhead |")
        print("|---|---|---|---|---|---|")
        for name, model in models.items():
            a = anatomy(model, prompt_ids, args.tokens, LOOPS[args.loop])
            print(f"| {name} | {a['total']:.2f} | {a['linears']:.2f} | {a['head']:.2f} | {a['rest']:.2f} | "
                  f"{a['hook_overhead']:.2f} |")
    print()
    return {"loop": args.loop, "threads": args.threads, "ratio": statistics.median(ratios),
            "tok/s": {name: statistics.median(tps(name)) for name in models}}


if __name__ == "__main__":
    sys.exit(main())
