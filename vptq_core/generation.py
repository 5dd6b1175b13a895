"""A lean decode loop for batch-1 chat, the same for quantized and original models, and the kernels' warm-up.

``generate(model, **kwargs)`` takes the keyword arguments a chat passes to ``model.generate`` (``input_ids``,
``attention_mask``, ``max_new_tokens``, ``streamer``, ``stopping_criteria``, ``pad_token_id``, ``do_sample``,
``temperature``, ``top_p``, ``top_k``) and runs ``decode_loop``: one prefill that keeps only the last position's
logits, then one forward per token with a KV cache, the next token chosen in place (greedy argmax, or
temperature / top-k / top-p sampling in the order transformers applies them), no logits-processor objects and no
per-step concatenation of the ids; for llama-family models (Llama, Qwen2, Mistral) each forward is
``vptq_core.quant.lean_decoder``'s: the model's own linears, the operations between them fused into a few native calls,
its own preallocated KV cache. Anything else (batch > 1, beams, other generation settings) goes to
``model.generate`` unchanged, so the function is always a drop-in. Greedy output equals ``model.generate``'s
(tested). ``bench/decode.py --loop lean`` measures it against ``generate`` for both models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

# Generation settings this loop applies itself; a model whose generation_config sets anything else that changes
# the output (repetition penalty, bad words, ...) is handed to model.generate.
_HANDLED = {"input_ids", "attention_mask", "max_new_tokens", "streamer", "stopping_criteria", "pad_token_id",
            "do_sample", "temperature", "top_p", "top_k"}
_NEUTRAL = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
            "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
            "forced_eos_token_id": None, "min_length": 0, "min_new_tokens": None, "typical_p": 1.0,
            "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "sequence_bias": None,
            "renormalize_logits": False, "exponential_decay_length_penalty": None, "length_penalty": 1.0}


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


def supported(model: nn.Module, kwargs: dict) -> bool:
    """Whether ``decode_loop`` reproduces ``model.generate(**kwargs)`` for these arguments."""
    if set(kwargs) - _HANDLED:
        return False
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        return False
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return False
    config = getattr(model, "generation_config", None)
    if config is not None:
        for name, neutral in _NEUTRAL.items():
            if getattr(config, name, neutral) not in (neutral, None):
                return False
        if getattr(config, "num_beams", 1) not in (1, None):
            return False
    return callable(getattr(model, "forward", None)) and hasattr(model, "config")


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


def generate(model: nn.Module, **kwargs) -> torch.Tensor:
    """``model.generate(**kwargs)`` through ``decode_loop`` where it gives the same result (see the module
    docstring); returns the ids [1, prompt + new] like ``generate``, and feeds ``streamer`` the same way."""
    if not supported(model, kwargs):
        return model.generate(**kwargs)
    ids = kwargs["input_ids"]
    config = getattr(model, "generation_config", None)
    max_new = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None) or 20
    sample = bool(kwargs.get("do_sample", getattr(config, "do_sample", False)))
    temperature = kwargs.get("temperature") if "temperature" in kwargs else getattr(config, "temperature", 1.0)
    top_k = kwargs.get("top_k") if "top_k" in kwargs else getattr(config, "top_k", None)
    top_p = kwargs.get("top_p") if "top_p" in kwargs else getattr(config, "top_p", None)
    if sample and temperature is None:
        temperature = 1.0
    streamer = kwargs.get("streamer")
    criteria = kwargs.get("stopping_criteria") or []
    if streamer is not None:
        streamer.put(ids.cpu())

    def on_token(so_far: torch.Tensor) -> bool:
        if streamer is not None:
            streamer.put(so_far[0, -1:].cpu())
        return any(bool(torch.as_tensor(c(so_far, None)).any()) for c in criteria)

    try:
        new = decode_loop(model, ids, int(max_new), temperature=float(temperature) if sample else 0.0,
                          top_k=top_k if sample else None, top_p=top_p if sample else None,
                          on_token=on_token if (streamer is not None or criteria) else None)
    finally:
        if streamer is not None:
            streamer.end()
    return torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1)
