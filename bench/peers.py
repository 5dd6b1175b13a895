"""Decode speed, bytes per token and perplexity against llama.cpp, the CPU runtime people use, in one run.

llama.cpp runs through ``llama-cpp-python`` in its own interpreter (``--llama-python``, a venv built for the
benchmark; not a dependency of the project). The bundled SmolLM2 GGUF (stored as Q4_1) is re-quantized with
llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``, requantizing allowed) to BF16, Q8_0, Q4_K_M and
Q2_K; our side is the bf16 original (``load_model``) and quantized checkpoints (``--checkpoint
DIR[,DIR...]``, e.g. a ``--preset 2.5`` and a ``--preset 3.5`` run), each through the project's lean loop
(``decode_loop``) and through ``model.generate``.

Protocol: every model lives in its own worker process (loaded once; its peak RSS is that process's), so the
runs do not share an allocator or caches; the driver asks one worker at a time, so no two runs overlap. Per
round and thread count, every (model, loop) decodes the same prompt (our tokenizer's ids, fed to both sides as
ids) greedily for ``--tokens`` tokens, end-of-sequence ignored; the order is reversed on odd rounds; one warm-up
run each first. tok/s = (tokens - 1) / time from the first new token to the last (prefill excluded); medians over
``--rounds``. Perplexity: the same token windows (``vptq_core.data.eval_windows`` of ``--text``) through
llama.cpp's logits for every position (``logits_all``) and through ``vptq_core.eval.evaluate``. Bytes per token:
every weight tensor once (GGUF tensor sizes; our modules' tensors, codebooks and scales included) plus the KV
cache at the mean context (llama.cpp's f16, our bf16).

    python bench/peers.py --llama-python /work/llama-venv/bin/python --checkpoint DIR[,DIR] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The history of the English language begins"
GGUF_TYPES = {"BF16": 32, "Q8_0": 7, "Q4_K_M": 15, "Q2_K": 10}  # llama_ftype values


# ------------------------------------------------------------------------------------------------ workers
CLOCK_ENV = "PEERS_CLOCK"  # "thread": the workers time by their calling thread's CPU time (--clock thread)


def _now() -> float:
    """Wall time, or with --clock thread the CPU time of the calling thread: at one thread both runtimes compute on
    it, and other work on a shared machine does not inflate it."""
    return time.thread_time() if os.environ.get(CLOCK_ENV) == "thread" else time.perf_counter()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class LlamaSide:
    """A GGUF file in llama.cpp: one ``Llama`` per thread count (the weights are mmapped once)."""

    def __init__(self, path: str) -> None:
        import llama_cpp

        if os.environ.get("PEERS_LLAMA_EXTRA_BUFTS") == "0":
            # llama.cpp's extra CPU buffer types (AMX, weight repacking) are a model parameter that
            # llama-cpp-python's Llama() does not expose; where its AMX path crashes, the driver turns them off here
            import llama_cpp.llama_cpp as low

            default = low.llama_model_default_params

            def without_extra():  # noqa: ANN202
                params = default()
                params.use_extra_bufts = False
                return params

            low.llama_model_default_params = without_extra
        self.llama_cpp, self.path, self.models = llama_cpp, path, {}

    def _model(self, threads: int, logits_all: bool = False, n_ctx: int = 1024):  # noqa: ANN202
        key = (threads, logits_all, n_ctx)
        if key not in self.models:
            self.models[key] = self.llama_cpp.Llama(self.path, n_threads=threads, n_threads_batch=threads,
                                                    n_ctx=n_ctx, n_batch=512, logits_all=logits_all,
                                                    verbose=False)
        return self.models[key]

    def bytes_per_token(self, context: float) -> dict:
        import gguf

        reader = gguf.GGUFReader(self.path)
        weights = sum(int(t.n_bytes) for t in reader.tensors)
        field = {f.name: f for f in reader.fields.values()}
        arch = bytes(field["general.architecture"].parts[-1]).decode()

        def value(name: str) -> int:
            return int(field[f"{arch}.{name}"].parts[-1][0])

        heads, kv_heads = value("attention.head_count"), value("attention.head_count_kv")
        head_dim = value("embedding_length") // heads
        kv = 2 * value("block_count") * kv_heads * head_dim * context * 2  # f16 cache
        return {"weights": weights, "kv cache": kv, "total": weights + kv}

    def decode(self, prompt: list[int], tokens: int, threads: int, loop: str) -> dict:
        import numpy as np

        llm = self._model(threads)
        llm.reset()
        vocab = llm.n_vocab()

        def next_token() -> int:
            return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

        start = _now()
        llm.eval(prompt)
        ids = [next_token()]
        first = _now()
        for _ in range(tokens - 1):
            llm.eval([ids[-1]])
            ids.append(next_token())
        end = _now()
        return {"ids": ids, "prefill_s": first - start, "decode_s": end - first}

    def nll(self, windows: list[list[int]], threads: int) -> dict:
        import numpy as np

        llm = self._model(threads, logits_all=True, n_ctx=max(len(w) for w in windows))
        total, count = 0.0, 0
        for window in windows:
            llm.reset()
            llm.eval(window)
            logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
            top = logits.max(-1, keepdims=True)
            logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
            total -= float(logp[np.arange(len(window) - 1), window[1:]].sum())
            count += len(window) - 1
        self.models.pop((threads, True, max(len(w) for w in windows)))
        return {"nll_sum": total, "count": count}


class TorchSide:
    """Our model: the bf16 original (``load_model``) or a checkpoint (``load_quantized``, its defaults)."""

    def __init__(self, path: str) -> None:
        sys.path.insert(0, str(ROOT))
        import torch

        from vptq_core.models import load_model

        self.torch = torch
        self.model, self.tok = load_model(path, dtype=torch.bfloat16)

    def bytes_per_token(self, context: float) -> dict:
        sys.path.insert(0, str(ROOT / "bench"))
        from decode import bytes_per_token

        parts = bytes_per_token(self.model, context)
        return {"weights": parts["total"] - parts["kv cache"], "kv cache": parts["kv cache"], "total": parts["total"]}

    def decode(self, prompt: list[int], tokens: int, threads: int, loop: str) -> dict:
        torch = self.torch
        from vptq_core.generation import decode_loop

        torch.set_num_threads(threads)
        ids = torch.tensor([prompt])
        marks: list[float] = []
        start = _now()
        if loop == "lean":
            new = decode_loop(self.model, ids, tokens, eos_ids=(),
                              on_token=lambda _ids: marks.append(_now()))
        else:
            class Marks:
                def put(self, _value) -> None:  # noqa: ANN001
                    marks.append(_now())

                def end(self) -> None:
                    pass

            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0, streamer=Marks())
            new, marks = out[0, len(prompt):].tolist(), marks[1:]
        return {"ids": new, "prefill_s": marks[0] - start, "decode_s": marks[-1] - marks[0]}

    def nll(self, windows: list[list[int]], threads: int) -> dict:
        from vptq_core.eval import evaluate

        self.torch.set_num_threads(threads)
        result = evaluate(self.model, self.tok, windows=self.torch.tensor(windows))
        return {"nll_sum": result.nll * result.tokens, "count": result.tokens}


def worker(kind: str, path: str) -> int:
    """Serve JSON-line requests on stdin: load once, then decode / nll / bytes / peak until stdin closes."""
    side = LlamaSide(path) if kind == "llama" else TorchSide(path)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "peak":
            reply = {"peak_rss": _peak_rss()}
        else:
            reply = getattr(side, op)(**request)
        print(json.dumps(reply), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------- driver
class Worker:
    def __init__(self, python: str, kind: str, path: str, threads: int, extra_bufts: bool = True) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH="",
                   PEERS_LLAMA_EXTRA_BUFTS="1" if extra_bufts else "0")
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--worker", kind, path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited (status {self.proc.wait()})")
        return json.loads(line)

    def ask(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def llama_ready(python: str | None) -> str:
    """"" when ``python`` imports llama_cpp and gguf, else the reason."""
    if not python:
        return "no --llama-python given (an interpreter with llama-cpp-python and gguf)"
    if not Path(python).is_file():
        return f"--llama-python {python}: no such file"
    probe = subprocess.run([python, "-c", "import llama_cpp, gguf, numpy"], capture_output=True, text=True,
                           cwd="/", timeout=120)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"--llama-python {python} cannot import llama_cpp/gguf: {last}"
    return ""


def extra_bufts_work(python: str, path: Path) -> str:
    """"" when llama.cpp decodes with its extra buffer types (AMX, repacking) here, else what happened."""
    try:
        probe = Worker(python, "llama", str(path), 1)
        probe.ask("decode", prompt=[1, 2, 3], tokens=2, threads=1, loop="llama.cpp")
        probe.close()
        return ""
    except RuntimeError as exc:
        return str(exc)


def quantize_ggufs(python: str, source: Path, out_dir: Path, types: list[str]) -> dict[str, Path]:
    """The source GGUF re-quantized to each type with llama.cpp's quantizer (kept in ``out_dir`` for reuse)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in types:
        path = out_dir / f"{source.stem.split('.')[0]}.{name}.gguf"
        if not path.is_file():
            code = ("import llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); "
                    f"p.ftype = {GGUF_TYPES[name]}; p.allow_requantize = True; p.nthread = 2; "
                    "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
            done = subprocess.run([python, "-c", code, str(source), str(path) + ".part"], capture_output=True,
                                  text=True, cwd="/")
            if done.returncode:
                raise RuntimeError(f"llama.cpp could not quantize to {name}: {done.stderr.strip()[-300:]}")
            os.replace(str(path) + ".part", path)
        paths[name] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", help="an interpreter with llama-cpp-python and gguf")
    parser.add_argument("--checkpoint", help="our quantized checkpoints, comma-separated (e.g. a --preset 2.5 and a "
                        "--preset 3.5 run)")
    parser.add_argument("--original", default="smollm2-135m-instruct", help="our bf16 side (load_model name/dir)")
    parser.add_argument("--gguf", help="the GGUF to re-quantize (default: the bundled SmolLM2's)")
    parser.add_argument("--types", default="BF16,Q8_0,Q4_K_M,Q2_K", help=f"of {list(GGUF_TYPES)}")
    parser.add_argument("--gguf-dir", default=str(Path.home() / ".cache" / "vptq_core" / "peers"))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loops", default="lean,generate", help="our loops: lean (decode_loop), generate")
    parser.add_argument("--text", default="wiki", help="perplexity text (vptq_core.data)")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4, help="perplexity windows (0: no perplexity)")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="wall time, or each worker's decoding-thread CPU time (a loaded machine; --threads 1)")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    reason = llama_ready(args.llama_python)
    if reason:
        print(f"bench/peers.py needs llama.cpp: {reason}")
        return 1
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if bad := [t for t in types if t not in GGUF_TYPES]:
        parser.error(f"--types {bad[0]!r}: choose from {', '.join(GGUF_TYPES)}")
    threads = [int(t) for t in args.threads.split(",")]
    loops = [x.strip() for x in args.loops.split(",")]
    if args.clock == "thread" and threads != [1]:
        parser.error("--clock thread measures one thread: use it with --threads 1")
    os.environ[CLOCK_ENV] = args.clock  # the workers (subprocesses) inherit it

    sys.path.insert(0, str(ROOT))
    from vptq_core.data import eval_windows
    from vptq_core.models import _bundled_gguf_file, load_model

    source = Path(args.gguf) if args.gguf else _bundled_gguf_file()
    ggufs = quantize_ggufs(args.llama_python, source, Path(args.gguf_dir), types)
    _, tok = load_model(args.original)
    prompt = tok(PROMPT)["input_ids"]
    windows = eval_windows(tok, args.text, args.seqlen, args.windows).tolist() if args.windows else []

    here = sys.executable
    sides: dict[str, tuple[Worker, list[str]]] = {}
    t0 = time.time()
    crashed = next((f"{name}: {why}" for name, path in ggufs.items()
                    if (why := extra_bufts_work(args.llama_python, path))), "")
    for name, path in ggufs.items():
        sides[f"llama.cpp {name}"] = (Worker(args.llama_python, "llama", str(path), max(threads), not crashed),
                                      ["llama.cpp"])
    sides["ours bf16"] = (Worker(here, "torch", args.original, max(threads)), loops)
    for checkpoint in filter(None, (args.checkpoint or "").split(",")):
        sides[f"ours {Path(checkpoint).name}"] = (Worker(here, "torch", checkpoint, max(threads)), loops)
    runs = [(name, loop) for name, (_, ls) in sides.items() for loop in ls]
    times: dict[tuple[str, str, int], list[float]] = {(n, lp, t): [] for n, lp in runs for t in threads}
    ids: dict[tuple[str, str], list[int]] = {}
    for t in threads:
        for name, loop in runs:  # warm-up
            sides[name][0].ask("decode", prompt=prompt, tokens=min(8, args.tokens), threads=t, loop=loop)
    for r in range(args.rounds):
        for t in threads:
            for name, loop in (runs if r % 2 == 0 else list(reversed(runs))):
                out = sides[name][0].ask("decode", prompt=prompt, tokens=args.tokens, threads=t, loop=loop)
                times[name, loop, t].append((args.tokens - 1) / max(out["decode_s"], 1e-9))
                ids[name, loop] = out["ids"]
    context = len(prompt) + args.tokens / 2
    info = {name: {"bytes": w.ask("bytes_per_token", context=context), "peak": w.ask("peak")["peak_rss"]}
            for name, (w, _) in sides.items()}
    for name, (w, _) in sides.items():
        if windows:
            info[name]["nll"] = w.ask("nll", windows=windows, threads=max(threads))
        w.close()

    base = statistics.median(times["ours bf16", loops[0], threads[0]])
    reference = ids.get(("ours bf16", loops[0]), [])
    print("peers: decode and perplexity against llama.cpp")
    print(f"  prompt {PROMPT!r} ({len(prompt)} tokens, our tokenizer's ids on both sides), {args.tokens} greedy "
          f"tokens, batch 1; threads {args.threads}; {args.rounds} rounds, order reversed on odd rounds, 1 warm-up "
          f"each; tok/s = (tokens - 1) / first-to-last new token; medians; clock: {args.clock}")
    print(f"  llama.cpp: {source.name} re-quantized by llama_model_quantize (allow_requantize); perplexity on "
          f"{len(windows)} windows x {args.seqlen} tokens of {args.text!r}; CPU: {_cpu()}; "
          f"load average {os.getloadavg()[0]:.1f} at the end; {time.time() - t0:.0f} s")
    print("  llama.cpp's extra CPU buffer types (AMX, weight repacking): "
          + (f"OFF: with them a decode crashed here ({crashed})" if crashed else "on (its default)"))
    print()
    head = " | ".join(f"tok/s {t} thr" for t in threads)
    print(f"| runtime / model | loop | {head} | × ours bf16 ({loops[0]}, {threads[0]} thr) | MB per token | "
          "GB/s (1st thr) | perplexity | peak RSS MB | greedy tokens = ours bf16 |")
    print("|---|---|" + "---|" * len(threads) + "---|---|---|---|---|---|")
    for name, loop in runs:
        speeds = [statistics.median(times[name, loop, t]) for t in threads]
        per_token = info[name]["bytes"]["total"]
        nll = info[name].get("nll")
        ppl = f"{2.718281828459045 ** (nll['nll_sum'] / nll['count']):.2f}" if nll else "-"
        same = sum(a == b for a, b in zip(ids[name, loop], reference))
        print(f"| {name} | {loop} | {' | '.join(f'{s:.1f}' for s in speeds)} | {speeds[0] / base:.2f} | "
              f"{per_token / 1e6:.1f} | {speeds[0] * per_token / 1e9:.1f} | {ppl} | {info[name]['peak'] / 2**20:.0f} | "
              f"{same}/{len(reference)} |")
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
