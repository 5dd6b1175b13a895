"""Where one decode step of the lean loop goes, part by part, for a bf16 model and its quantized layouts.

Each step of ``vptq_core.quant.lean_decoder.LeanDecoder`` is replayed with a timer around every call: the input
norm, q/k/v (one native call for quantized layers sharing the input, else three), attention (rotary + KV write +
attention), o, the post-attention norm, gate/up + SiLU (one call or three), down, the final norm and the LM head;
"python" is the rest (the loop itself, tuple unpacking, the timers): a plain step's time minus the timed parts.
The same decoder also runs its unfused path (every linear module called on its own, as transformers' modules
are) in alternation, which gives the gain of the fused calls in one run.

Models: ``--shape`` random weights (``bench/decode.py``'s shapes and ``--layout``s, several at once), or
``--checkpoint DIR`` (a packed checkpoint; LM head as ``load_quantized`` sets it). The bf16 original is always
profiled too.

    python bench/decode_profile.py --shape smollm2 --layouts vptq2,vptq3,scalar4,scalar4-a8 --threads 1,2
    python bench/decode_profile.py --checkpoint DIR --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decode import PROMPT, random_dense, random_quantized  # noqa: E402

from vptq_core.models import byte_tokenizer, load_model  # noqa: E402
from vptq_core.quant.lean_decoder import NATIVE_ATTEND_MAX_TOKENS, LeanDecoder  # noqa: E402
from vptq_core.storage.checkpoint import load_quantized  # noqa: E402
from vptq_core.storage.head import quantize_head  # noqa: E402

PARTS = ("embed", "norms", "qkv", "attention", "o", "gate_up+silu", "down", "final norm", "head", "python")
LAYOUTS = ("vptq2", "vptq3", "scalar4", "scalar4-a8")
# wall: time.perf_counter; thread: CPU time of this thread (time.thread_time), which other work on a shared
# machine does not inflate (1 thread only: at 2 threads the kernels' other worker is not counted)
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
CLOCK = {"now": time.perf_counter}


def timed_step(dec: LeanDecoder, token: torch.Tensor, spent: dict[str, float], fused: bool = True) -> torch.Tensor:
    """One ``dec.step(token)`` with a timer around every call (the same calls in the same order as
    ``LeanDecoder._forward`` for one token); adds seconds per part to ``spent``."""
    clock = CLOCK["now"]
    ops, pos = dec.ops, dec.pos
    cos, sin = dec.cos[pos:pos + 1], dec.sin[pos:pos + 1]
    t0 = clock()
    x = dec.embed(token.view(dec.batch, 1))
    t1 = clock()
    spent["embed"] += t1 - t0
    delta = None
    for i, (w1, e1, qkv, o, w2, e2, gate_up, down, scale) in enumerate(dec.layers if fused else dec.plain_layers):
        t0 = clock()
        hn = ops.rms_norm(x, delta, w1, e1)
        t1 = clock()
        if delta is not None:
            x, hn = hn
        else:
            hn = hn[0]
        q, k, v = qkv(hn)
        t2 = clock()
        a = ops.attend(q, k, v, cos, sin, dec.k_cache[i], dec.v_cache[i], pos, dec.num_heads, scale)
        t3 = clock()
        ao = o(a)
        t4 = clock()
        x, hn = ops.rms_norm(x, ao, w2, e2)
        t5 = clock()
        (h,) = gate_up(hn)
        t6 = clock()
        delta = down(h)
        t7 = clock()
        spent["norms"] += (t1 - t0) + (t5 - t4)
        spent["qkv"] += t2 - t1
        spent["attention"] += t3 - t2
        spent["o"] += t4 - t3
        spent["gate_up+silu"] += t6 - t5
        spent["down"] += t7 - t6
    t0 = clock()
    _, hn = ops.rms_norm(x, delta, dec.final_weight, dec.final_eps)
    t1 = clock()
    logits = dec.head(hn)
    t2 = clock()
    spent["final norm"] += t1 - t0
    spent["head"] += t2 - t1
    dec.pos += 1
    return logits[:, -1]


def profile(model: torch.nn.Module, prompt_ids: torch.Tensor, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """ms per step by part for the fused and the unfused path, plus "total" (plain steps, no timers); medians over
    ``rounds`` alternated rounds of ``steps`` steps after the prompt."""
    dec = LeanDecoder(model, prompt_ids.shape[1] + steps + 1)
    results: dict[str, list[dict[str, float]]] = {"fused": [], "unfused": []}
    for r in range(rounds + 1):  # round 0 warms up
        for path in (("fused", "unfused") if r % 2 else ("unfused", "fused")):
            fused = path == "fused"
            saved = dec.layers
            dec.layers = dec.layers if fused else dec.plain_layers
            try:
                token = dec.prefill(prompt_ids).argmax(-1, keepdim=True)
                start = CLOCK["now"]()
                for _ in range(steps):
                    token = dec.step(token).argmax(-1, keepdim=True)
                total = (CLOCK["now"]() - start) / steps
            finally:
                dec.layers = saved
            spent = dict.fromkeys(PARTS, 0.0)
            token = dec.prefill(prompt_ids).argmax(-1, keepdim=True)
            for _ in range(steps):
                token = timed_step(dec, token, spent, fused).argmax(-1, keepdim=True)
            row = {part: spent[part] / steps * 1e3 for part in PARTS}
            row["timed total"] = sum(row.values())
            row["python"] = total * 1e3 - row["timed total"]
            row["total"] = total * 1e3
            if r:
                results[path].append(row)
    return {path: {k: statistics.median(row[k] for row in rows) for k in rows[0]} for path, rows in results.items()}


# native knobs a variant may set (kernels/csrc/native.cpp; prepare-time ones take effect as the layers rebind)
KNOBS = {"index_prefetch": ("set_index_prefetch", 2048), "index8": ("set_index8", 1), "cb16": ("set_cb16", 0),
         "touch": ("set_touch", 1)}


def _parse_variant(text: str) -> tuple[str, dict[str, int]]:
    """"name:knob=value,knob=value" -> (name, {knob: value})."""
    name, _, rest = text.partition(":")
    knobs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in KNOBS or not value.lstrip("-").isdigit():
            raise ValueError(f"variant {text!r}: knobs are {', '.join(KNOBS)} with integer values, e.g. "
                             "pf0:index_prefetch=0")
        knobs[key] = int(value)
    return name, knobs


def _set_knobs(model: torch.nn.Module, knobs: dict[str, int]) -> None:
    from vptq_core.kernels import native

    ext = native._ext()
    for key, (setter, default) in KNOBS.items():
        getattr(ext, setter)(knobs.get(key, default))
    for module in model.modules():
        if hasattr(module, "rebind"):
            module.rebind()


def variants(model: torch.nn.Module, prompt_ids: torch.Tensor, steps: int, rounds: int,
             chosen: list[tuple[str, dict[str, int]]]) -> dict[str, float]:
    """ms per plain decode step of the default kernels and of each variant, rounds alternated; medians."""
    chosen = [("default", {}), *chosen]
    times: dict[str, list[float]] = {name: [] for name, _ in chosen}
    try:
        for r in range(rounds + 1):
            for name, knobs in (chosen if r % 2 else chosen[::-1]):
                _set_knobs(model, knobs)
                dec = LeanDecoder(model, prompt_ids.shape[1] + steps + 1)
                token = dec.prefill(prompt_ids).argmax(-1, keepdim=True)
                start = CLOCK["now"]()
                for _ in range(steps):
                    token = dec.step(token).argmax(-1, keepdim=True)
                if r:
                    times[name].append((CLOCK["now"]() - start) / steps * 1e3)
    finally:
        _set_knobs(model, {})
    return {name: statistics.median(t) for name, t in times.items()}


def _models(args: argparse.Namespace) -> tuple[dict[str, torch.nn.Module], torch.Tensor, str]:
    if args.checkpoint:
        original, tok = load_model(args.original, dtype=torch.bfloat16)
        quantized, qtok = load_quantized(args.checkpoint)
        models = {"bf16 original": original, f"checkpoint {Path(args.checkpoint).name}": quantized}
        label = f"checkpoint {args.checkpoint} vs {args.original} (bf16); LM head as load_quantized sets it"
        tok = tok or qtok
    else:
        original, tok = random_dense(args.shape), byte_tokenizer()
        models = {"bf16 original": original}
        for layout in args.layouts.split(","):
            quantized = random_quantized(original, layout)
            bits = quantize_head(quantized, "auto")
            models[f"{layout} (head {bits or 16}-bit)"] = quantized
        label = f"random weights, shape {args.shape}; LM head of the quantized models as load_quantized sets it"
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    return models, ids, label


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="packed checkpoint directory (save_quantized)")
    source.add_argument("--shape", choices=["0.5b", "smollm2", "tiny"], help="random weights of this model shape")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"with --shape: comma list of {LAYOUTS}")
    parser.add_argument("--original", default="smollm2-135m-instruct", help="with --checkpoint: model or dense dir")
    parser.add_argument("--tokens", type=int, default=24, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    parser.add_argument("--threads", default="1", help="torch CPU threads; a comma list measures each")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or this thread's CPU time (a loaded machine; 1 thread only)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="also time the quantized models with native knobs changed, alternated with the "
                             "defaults: NAME:KNOB=VALUE[,KNOB=VALUE] (knobs: " + ", ".join(KNOBS) + ")")
    args = parser.parse_args(argv)
    try:
        chosen = [_parse_variant(text) for text in args.variants]
    except ValueError as exc:
        parser.error(str(exc))
    if bad := [lay for lay in args.layouts.split(",") if lay not in LAYOUTS]:
        parser.error(f"--layouts {bad[0]!r}: choose from {', '.join(LAYOUTS)}")
    if args.tokens < 1 or args.rounds < 1:
        parser.error("--tokens and --rounds must be >= 1")
    threads = [int(t) for t in args.threads.split(",")]
    if args.clock == "thread" and threads != [1]:
        parser.error("--clock thread measures one thread: use it with --threads 1")
    CLOCK["now"] = CLOCKS[args.clock]
    models, prompt_ids, label = _models(args)
    print("decode step profile (lean loop)")
    print(f"  {label}")
    print(f"  prompt {prompt_ids.shape[1]} tokens; {args.tokens} steps per round; 1 warm-up round, {args.rounds} "
          f"timed rounds, fused and unfused paths alternated; medians; ms per step ({args.clock} clock); "
          f"torch {torch.__version__}")
    print(f"  attention: native up to {NATIVE_ATTEND_MAX_TOKENS} new tokens; python = plain step - timed parts")
    with torch.inference_mode():
        for n in threads:
            torch.set_num_threads(n)
            rows = {}
            for name, model in models.items():
                result = profile(model, prompt_ids, args.tokens, args.rounds)
                rows[name] = result
            print()
            print(f"threads {n}:")
            names = list(rows)
            print("| part | " + " | ".join(f"{name} fused | unfused" for name in names) + " |")
            print("|---|" + "---|---|" * len(names))
            for part in (*PARTS, "total"):
                cells = " | ".join(f"{rows[name]['fused'][part]:.2f} | {rows[name]['unfused'][part]:.2f}"
                                   for name in names)
                print(f"| {part} | {cells} |")
            base = rows[names[0]]["fused"]["total"]
            print("| × bf16 (total) | " + " | ".join(
                f"{base / rows[name]['fused']['total']:.2f} | {base / rows[name]['unfused']['total']:.2f}"
                for name in names) + " |")
            if chosen:
                print()
                print(f"native knob variants, threads {n} (ms per step, plain steps; × = default / variant time):")
                print("| model | variant | knobs | ms | × default |")
                print("|---|---|---|---|---|")
                for name in names[1:]:
                    timed = variants(models[name], prompt_ids, args.tokens, args.rounds, chosen)
                    for (vname, knobs) in [("default", {}), *chosen]:
                        text = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "-"
                        print(f"| {name} | {vname} | {text} | {timed[vname]:.2f} | "
                              f"{timed['default'] / timed[vname]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
