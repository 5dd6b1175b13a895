"""Streaming chat with a (quantized or original) model: chat template, sampling settings, stop, stats."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from vptq_core import generation
from vptq_core.models import GLOBAL_RNG_LOCK

from . import template_guard

_SAMPLING = GLOBAL_RNG_LOCK  # held by a sampled generation (see ChatSession.stream) and a tiny model's build

@dataclass
class GenerationStats:
    """One reply: ``tokens`` generated in ``seconds`` (prompt processing included), the first one after
    ``first_token_seconds``; ``prompt_tokens`` in the prompt (with the conversation so far)."""

    tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: float | None = None
    prompt_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second after the first (the decode rate, prompt processing excluded);
        the overall rate for replies of one token."""
        if self.tokens >= 2 and self.first_token_seconds is not None and self.seconds > self.first_token_seconds:
            return (self.tokens - 1) / (self.seconds - self.first_token_seconds)
        return self.tokens_per_second


def model_context(model, tokenizer=None) -> int | None:
    """The longest sequence the model takes (its config's ``max_position_embeddings``; else a sane
    ``tokenizer.model_max_length``), or None when neither says."""
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for cfg in (text_config, config):
        value = getattr(cfg, "max_position_embeddings", None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10**7 else None


def model_memory_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (shared tensors counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= 4096:
        raise ValueError(f"max_new_tokens must be an integer in 1..4096, got {max_new_tokens!r}")
    if not 0.0 <= float(temperature) <= 5.0:
        raise ValueError(f"temperature must be in [0, 5] (0 = greedy), got {temperature}")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class ChatSession:
    """A conversation with one model. ``stream`` yields text pieces as tokens are generated."""

    def __init__(self, model, tokenizer, system_prompt: str | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.history: list[dict] = []
        self.last_stats = GenerationStats()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.history = []

    def stop(self) -> None:
        self._stop.set()

    def prompt_ids(self, messages: list[dict]) -> torch.Tensor:
        msgs = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + messages
        if getattr(self.tokenizer, "chat_template", None):
            ids = template_guard.chat_prompt_ids(self.tokenizer, msgs)  # out of process, within limits
        else:
            text = "\n".join(f"{m['role']}: {m['content']}" for m in msgs) + "\nassistant:"
            ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        return ids

    def check_prompt(self, prompt: str, max_new_tokens: int, max_prompt_tokens: int | None = None) -> torch.Tensor:
        """The prompt's token ids (the conversation so far + ``prompt``), after checking that they fit: at most
        ``max_prompt_tokens`` (None: no limit of its own), and with ``max_new_tokens`` within the model's
        context. ValueError naming the limit and the value otherwise."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("prompt must be a non-empty string")
        if max_prompt_tokens is not None and len(prompt) > 32 * max_prompt_tokens:
            raise ValueError(f"the message is {len(prompt)} characters; at most {32 * max_prompt_tokens} are "
                             f"accepted (prompts are limited to {max_prompt_tokens} tokens)")
        ids = self.prompt_ids(self.history + [{"role": "user", "content": prompt}])
        n = int(ids.shape[1])
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            raise ValueError(f"the prompt is {n} tokens with the conversation so far; at most {max_prompt_tokens} "
                             "are allowed: shorten the message or press Clear")
        context = model_context(self.model, self.tokenizer)
        if context is not None and n + max_new_tokens > context:
            raise ValueError(f"the prompt ({n} tokens with the conversation so far) plus max new tokens "
                             f"({max_new_tokens}) is {n + max_new_tokens} tokens, more than the model's context of "
                             f"{context}: lower max new tokens, shorten the message or press Clear")
        return ids

    def stream(self, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, max_prompt_tokens: int | None = None,
               cpu_share: tuple[int, int] | None = None) -> Iterator[str]:
        """Add ``prompt`` as a user turn, yield the reply piece by piece, then append it to the history.
        ``last_stats`` describes the reply once it is complete. ``cpu_share`` (index, count): a greedy reply is
        generated on that share of the CPUs (``generation.cpu_share``), e.g. one core per side when two sides
        generate at once."""
        check_sampling(max_new_tokens, temperature, top_p)
        messages = self.history + [{"role": "user", "content": prompt}]
        ids = self.check_prompt(prompt, max_new_tokens, max_prompt_tokens)
        device = next(self.model.parameters()).device
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
        stop_event = self._stop
        stop_event.clear()
        counter: dict = {"n": 0, "first": None}

        class _Stop(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                counter["n"] = input_ids.shape[1] - ids.shape[1]
                if counter["first"] is None and counter["n"] >= 1:
                    counter["first"] = time.perf_counter()
                return stop_event.is_set()

        kwargs = dict(
            input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device), max_new_tokens=max_new_tokens,
            streamer=streamer, stopping_criteria=StoppingCriteriaList([_Stop()]),
            pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
        )
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=float(temperature), top_p=float(top_p))
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        errors: list[BaseException] = []

        # Sampling draws from torch's one global generator: two sides sampling at once would take each other's
        # numbers, so sampled replies take turns (each stays what its seed gives); greedy ones run at once.
        sampling = _SAMPLING if temperature > 0 else contextlib.nullcontext()

        def run() -> None:
            try:
                # sampled replies take turns, so each may use every core
                share = (generation.cpu_share(*cpu_share) if cpu_share and temperature <= 0
                         else contextlib.nullcontext())
                with sampling, share:
                    torch.manual_seed(seed)
                    with torch.no_grad():
                        generation.generate(self.model, **kwargs)  # lean loop where it equals generate()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)
                streamer.end()

        with self._lock:
            t0 = time.perf_counter()
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            reply = ""
            for piece in streamer:
                reply += piece
                yield piece
            thread.join()
            first = counter["first"] - t0 if counter["first"] is not None else None
            self.last_stats = GenerationStats(tokens=max(counter["n"], 0), seconds=time.perf_counter() - t0,
                                              first_token_seconds=first, prompt_tokens=int(ids.shape[1]))
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}") from errors[0]
        self.history = messages + [{"role": "assistant", "content": reply}]
