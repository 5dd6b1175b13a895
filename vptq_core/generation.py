"""Batch-1 generation for the chat, the CLI, the API and the benchmarks, and the kernels' warm-up.

``generate(model, ...)`` is ``model.generate(...)`` with the token loop of ``vptq_core.quant.lean_generate``
wherever it gives transformers' own result (batch-1 greedy or sampled decoding of a llama-family model): the
same prepared logits processors, stopping criteria and random draws, one ``LeanDecoder`` forward per token.
``enable(model)`` makes ``model.generate`` itself do this (``load_quantized`` and ``load_model`` enable the models
they return). Anything else (beams, assisted decoding, scores in the output, ...) runs transformers' own loop.

``decode_loop`` is the bare loop without transformers' preparation (the benchmarks' ``--loop lean``): one prefill
that keeps only the last position's logits, then one forward per token, the next token chosen in place (greedy
argmax, or temperature / top-k / top-p sampling in the order transformers applies them); for llama-family models
(Llama, Qwen2, Mistral) each forward is ``vptq_core.quant.lean_decoder``'s: the model's own linears, the operations
between them fused into a few native calls, its own preallocated KV cache. Greedy output equals
``model.generate``'s (tested).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from vptq_core.quant import lean_generate

CACHES = ("auto", "lean", "dynamic", "static")


def warm_up_kernels(background: bool = True) -> tuple[bool, str]:
    """Start building (or loading the cached build of) the native CPU kernels now, in a background thread by
    default, so that the first forward does not wait for the compiler. (usable now, reason); never raises."""
    from vptq_core.kernels import native

    return native.warm_up(background=background)


def _eos_ids(model: nn.Module) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """One token id [1, 1] from logits [1, vocab]: temperature, then top-k, then top-p, then a multinomial draw."""
    scores = logits.float() / temperature
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1)


def decode_loop(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *, cache: str = "auto",
                temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                eos_ids: Iterable[int] | None = None, on_token: Callable[[torch.Tensor], bool | None] | None = None,
                ) -> list[int]:
    """Batch-1 generation: the new token ids (the end-of-sequence token included when it ends the reply).

    ``cache``: "auto" (the lean decoder of ``vptq_core.quant.lean_decoder`` with its own preallocated cache where the
    model is a supported llama-family model, else "dynamic"), "lean" (that decoder, or an error naming why the
    model is not supported), "dynamic" (the model's forward with transformers' DynamicCache) or "static" (the
    model's forward with a StaticCache preallocated for prompt + new tokens). ``temperature`` 0 = greedy.
    ``on_token(ids)`` sees the ids so far ([1, prompt + new]) after each new token; returning True stops.
    ``eos_ids``: default the model's ``generation_config.eos_token_id``.
    """
    from transformers import DynamicCache, StaticCache

    from vptq_core.quant.lean_decoder import LeanDecoder, unsupported_reason

    if cache not in CACHES:
        raise ValueError(f"cache must be one of {list(CACHES)}, got {cache!r}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, tokens], got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = _eos_ids(model) if eos_ids is None else {int(e) for e in eos_ids}
    n = input_ids.shape[1]
    device = input_ids.device
    if cache == "auto":
        cache = "dynamic" if unsupported_reason(model, n + max_new_tokens) else "lean"
    buffer = torch.empty(1, n + max_new_tokens, dtype=input_ids.dtype, device=device)
    buffer[:, :n] = input_ids
    new: list[int] = []
    with torch.inference_mode():
        if cache == "lean":
            lean = LeanDecoder(model, n + max_new_tokens)
            forward = lean.step
            logits = lean.prefill(input_ids)
        else:
            kv = (StaticCache(config=model.config, max_cache_len=n + max_new_tokens) if cache == "static"
                  else DynamicCache(config=model.config))
            position = torch.arange(n, device=device)
            logits = model(input_ids=input_ids, past_key_values=kv, use_cache=True, cache_position=position,
                           logits_to_keep=1).logits[:, -1]
            position = position[-1:] + 1

            def forward(token: torch.Tensor) -> torch.Tensor:
                out = model(input_ids=token, past_key_values=kv, use_cache=True, cache_position=position).logits
                position.add_(1)
                return out[:, -1]

        for step in range(max_new_tokens):
            token = (logits.argmax(-1, keepdim=True) if temperature <= 0
                     else _sample(logits, temperature, top_k, top_p))
            value = int(token)
            new.append(value)
            buffer[:, n + step] = value
            if on_token is not None and on_token(buffer[:, : n + step + 1]):
                break
            if value in eos or step + 1 == max_new_tokens:
                break
            logits = forward(token)
    return new


def generate(model: nn.Module, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - generate()'s own signature
    """``model.generate(*args, **kwargs)`` with the lean token loop wherever it gives transformers' result
    (``vptq_core.quant.lean_generate``), whether or not ``enable`` was called on the model."""
    return lean_generate.generate(model, *args, **kwargs)


def enable(model: nn.Module) -> nn.Module:
    """Make ``model.generate`` itself run the lean loop where it applies (``load_quantized`` and ``load_model``
    do this for the models they return); returns ``model``."""
    return lean_generate.enable(model)


_SHARES = {"active": 0, "threads": 0}
_SHARES_LOCK = threading.Lock()


@contextlib.contextmanager
def cpu_share(index: int, count: int) -> Iterator[list[int]]:
    """Run this thread's model work on its own share of the process's CPUs: share ``index`` of ``count``
    contiguous slices (the two sides of a chat generating at once get one core each on two cores), so that two
    generations do not fight over the same cores. torch's OpenMP thread count is a per-thread setting: this thread
    gets as many threads as CPUs in its share and is pinned to them (Linux); other running threads keep theirs.
    torch also keeps one default for threads started later: it is the process's again once the last share
    ends. Yields the CPUs; changes nothing (yields them all) with fewer CPUs than shares or without OpenMP."""
    if not 0 <= index < count:
        raise ValueError(f"share index must be in 0..{count - 1}, got {index}")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if count < 2 or len(cpus) < count or "OpenMP" not in torch.__config__.parallel_info():
        yield cpus
        return
    mine = cpus[index * len(cpus) // count:(index + 1) * len(cpus) // count]
    with _SHARES_LOCK:
        if _SHARES["active"] == 0:
            _SHARES["threads"] = torch.get_num_threads()
        _SHARES["active"] += 1
    before = os.sched_getaffinity(0)  # pid 0: this thread
    try:
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
        yield mine
    finally:
        os.sched_setaffinity(0, before)
        with _SHARES_LOCK:
            _SHARES["active"] -= 1
            torch.set_num_threads(_SHARES["threads"])  # this thread's and the default for new ones
