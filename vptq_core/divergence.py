"""Where in a text a quantized model departs from its original, token by token: KL(original || quantized) at
every position, whether the top-1 next token differs, each side's top-k next tokens and the probability each
gives the actual next token. Computed window by window and streamed (``divergence_chunks``), bounded by a number
of tokens, a time limit and a stop callback; the per-position math and the summary statistics are ``eval``'s
(``token_divergence``, ``divergence_stats``), so the view and ``evaluate`` cannot disagree."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .data import tokenize_text, wants_bos
from .eval import divergence_stats, model_logits, token_divergence

WINDOW = 512  # tokens per forward pass (with the one token of context each window starts from)
TOP_K = 5
DEFAULT_MAX_TOKENS = 2048
_PARTIAL = "\ufffd"  # what a tokenizer decodes part of a multi-byte character to


@dataclass
class TokenRow:
    """One token of the text. ``predicted`` False: context only (the text's first token when windows start
    without a BOS token), and the divergence fields are None / empty."""

    index: int  # position in the text's token ids
    token_id: int
    text: str  # the token as readable text ("" for the leading bytes of a character a later token completes)
    predicted: bool
    kl: float | None = None  # KL(original || quantized) of the distributions that predicted this token, nats
    delta_p: float | None = None  # p_quantized - p_original of the original's top token
    top1_differs: bool = False
    p_original: float | None = None  # probability the original gave this token
    p_quantized: float | None = None
    top_original: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, probability), best first
    top_quantized: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class DivergenceChunk:
    """What one window adds: its ``rows`` and, over everything so far, ``summary`` (``divergence_stats``
    plus ``tokens`` predicted and each side's perplexity on them). ``done`` of ``total`` text tokens are
    covered; ``text_tokens``: the whole text's (``total`` is fewer when the text was cut at ``max_tokens``).
    ``stopped``: why the text will not be covered fully ("" while going or when done)."""

    rows: list[TokenRow]
    done: int
    total: int
    text_tokens: int
    summary: dict = field(default_factory=dict)
    stopped: str = ""


@dataclass
class Divergence:
    """Every chunk of one text put together (``add``): the rows so far and the latest summary."""

    rows: list[TokenRow] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    done: int = 0
    total: int = 0
    text_tokens: int = 0
    stopped: str = ""

    def add(self, chunk: DivergenceChunk) -> Divergence:
        self.rows.extend(chunk.rows)
        self.summary = chunk.summary or self.summary
        self.done, self.total, self.text_tokens = chunk.done, chunk.total, chunk.text_tokens
        self.stopped = chunk.stopped or self.stopped
        return self

    def coverage_note(self) -> str:
        """"" when the whole text was covered, else what was left out and why."""
        if self.stopped:
            return f"stopped after {self.done} of {self.text_tokens} tokens: {self.stopped}"
        if self.total < self.text_tokens:
            return f"the first {self.total} of {self.text_tokens} tokens (the token limit)"
        return ""


def token_pieces(tokenizer, ids: list[int], context: int = 4) -> list[str]:
    """Each token as the text it adds to the decoded text: decoded after up to ``context`` tokens before it
    (so tokenizers that drop a word's leading space at the start of a decode keep it), and a character split
    over byte tokens shown on the token that completes it (the tokens before it get "")."""
    pieces: list[str] = []
    start = 0  # the first token whose text is not shown yet
    for i in range(len(ids)):
        lo = max(0, start - context)
        before = tokenizer.decode(ids[lo:start]) if start > lo else ""
        now = tokenizer.decode(ids[lo:i + 1])
        if now.endswith(_PARTIAL) and i + 1 < len(ids) and i + 1 - start < 4:
            pieces.append("")
            continue
        pieces.append(now[len(before):] if now.startswith(before) else tokenizer.decode(ids[start:i + 1]))
        start = i + 1
    return pieces


def _check_inputs(tokenizer, text: str | None, ids, max_tokens: int, window: int) -> torch.Tensor:
    if (text is None) == (ids is None):
        raise ValueError("give either a text or token ids, not both and not neither")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max tokens must be an integer >= 2, got {max_tokens!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an integer >= 2, got {window!r}")
    if text is not None:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the text is empty: paste or upload some text first")
        ids = tokenize_text(tokenizer, text)
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() < 2:
        raise ValueError(f"the text has {ids.numel()} token(s); at least 2 are needed to compare predictions")
    return ids


def divergence_chunks(
    original: nn.Module, quantized: nn.Module, tokenizer, text: str | None = None, ids=None,
    max_tokens: int = DEFAULT_MAX_TOKENS, time_limit_s: float | None = None,
    should_stop: Callable[[], bool] | None = None, window: int = WINDOW, k: int = TOP_K, bos: bool | str = "auto",
) -> Iterator[DivergenceChunk]:
    """Per-token divergence of ``quantized`` from ``original`` on ``text`` (or token ids), one chunk per window.

    The text's first ``max_tokens`` tokens are cut into consecutive windows of ``window`` tokens, each starting
    from one token of context as ``evaluate`` does: the BOS token when the tokenizer wants one
    (``data.wants_bos``), else the token before the window (so every token after the first is predicted once).
    ``time_limit_s`` and ``should_stop`` are checked before each window; when either ends the text early, a
    last chunk without rows says why (``stopped``)."""
    ids = _check_inputs(tokenizer, text, ids, max_tokens, window)
    text_tokens = ids.numel()
    ids = ids[:max_tokens]
    total = ids.numel()
    use_bos = wants_bos(tokenizer, bos)
    deadline = None if time_limit_s is None else time.monotonic() + float(time_limit_s)
    should_stop = should_stop or (lambda: False)
    id_list = ids.tolist()
    pieces = token_pieces(tokenizer, id_list)
    names: dict[int, str] = {}
    per_token: dict[str, list[torch.Tensor]] = {"kl": [], "delta_p": [], "agree": [], "nll_o": [], "nll_q": []}
    pos = 0 if use_bos else 1  # the first token predicted
    leading = [] if use_bos else [TokenRow(index=0, token_id=id_list[0], text=pieces[0], predicted=False)]
    step = window - 1
    while pos < total:
        if should_stop():
            yield DivergenceChunk([], pos, total, text_tokens, stopped="stopped")
            return
        if deadline is not None and time.monotonic() > deadline:
            yield DivergenceChunk([], pos, total, text_tokens, stopped=f"time limit ({time_limit_s:g} s)")
            return
        end = min(total, pos + step)
        head = int(tokenizer.bos_token_id) if use_bos else id_list[pos - 1]
        inputs = torch.tensor([[head, *id_list[pos:end]]])
        target = inputs[0, 1:]
        with torch.no_grad():
            logp_q = F.log_softmax(model_logits(quantized, inputs)[0, :-1], dim=-1)
            logp_o = F.log_softmax(model_logits(original, inputs)[0, :-1], dim=-1)
        div = token_divergence(logp_q, logp_o, target=target, k=k)
        index = target.view(-1, 1)
        nll = {"nll_o": -logp_o.gather(-1, index)[:, 0], "nll_q": -logp_q.gather(-1, index)[:, 0]}
        del logp_q, logp_o
        for name, values in (("kl", div.kl), ("delta_p", div.delta_p), ("agree", div.agree), *nll.items()):
            per_token[name].append(values)
        rows = leading + [_row(tokenizer, names, pieces, id_list, pos + j, div, j) for j in range(end - pos)]
        leading = []
        pos = end
        yield DivergenceChunk(rows, pos, total, text_tokens, summary=_summary(per_token))


def _row(tokenizer, names: dict[int, str], pieces: list[str], id_list: list[int], index: int, div, j: int) -> TokenRow:
    def top(ids: torch.Tensor, probs: torch.Tensor) -> list[tuple[int, str, float]]:
        return [(int(i), _name(tokenizer, names, int(i)), float(p)) for i, p in zip(ids[j], probs[j])]

    return TokenRow(index=index, token_id=id_list[index], text=pieces[index], predicted=True, kl=float(div.kl[j]),
                    delta_p=float(div.delta_p[j]), top1_differs=not bool(div.agree[j]),
                    p_original=float(div.p_ref_target[j]), p_quantized=float(div.p_model_target[j]),
                    top_original=top(div.ref_top_ids, div.ref_top_p) if div.ref_top_ids is not None else [],
                    top_quantized=top(div.model_top_ids, div.model_top_p) if div.model_top_ids is not None else [])


def _name(tokenizer, names: dict[int, str], token_id: int) -> str:
    if token_id not in names:
        names[token_id] = readable_token(tokenizer, token_id)
    return names[token_id]


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's printable stand-ins for the 256 bytes) back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


_BYTES = _byte_decoder()


def readable_token(tokenizer, token_id: int) -> str:
    """One token on its own as text; a byte token that is part of a character as its byte (``\\xc3``)."""
    text = tokenizer.decode([token_id])
    if _PARTIAL not in text:
        return text
    raw = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(raw, str) and raw and all(ch in _BYTES for ch in raw):
        return bytes(_BYTES[ch] for ch in raw).decode("utf-8", errors="backslashreplace")
    return raw if isinstance(raw, str) else text


def _summary(per_token: dict[str, list[torch.Tensor]]) -> dict:
    kl, delta_p, agree = (torch.cat(per_token[name]) for name in ("kl", "delta_p", "agree"))
    nll_o, nll_q = (float(torch.cat(per_token[name]).double().mean()) for name in ("nll_o", "nll_q"))
    return {**divergence_stats(kl, delta_p, agree), "tokens": int(kl.numel()),
            "perplexity_original": _exp(nll_o), "perplexity_quantized": _exp(nll_q)}


def _exp(x: float) -> float:
    return math.exp(min(x, 700.0))


def compute_divergence(original: nn.Module, quantized: nn.Module, tokenizer, text: str | None = None, ids=None,
                       **bounds) -> Divergence:
    """Every chunk of ``divergence_chunks`` put together."""
    result = Divergence()
    for chunk in divergence_chunks(original, quantized, tokenizer, text=text, ids=ids, **bounds):
        result.add(chunk)
    return result
