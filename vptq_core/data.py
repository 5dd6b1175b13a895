"""Calibration and evaluation text.

"wiki" is the English Wikipedia sample shipped in the ``gensim`` wheel, "pydocs" Python's documentation topics.
Each is split by document so that no two splits share text: even documents calibrate ("calib"); the odd ones are
dealt alternately to "dev" (for choosing settings) and "test" (for reporting); "eval" is dev and test together.
Any UTF-8 text file works too, used whole for every split (docs/methods.md#evaluation-protocol).
"""

from __future__ import annotations

import bz2
import functools
import importlib.metadata
import json
import os
import re
import xml.etree.ElementTree as ET

import torch

from .models import cache_dir

WIKI = "wiki"
PYDOCS = "pydocs"  # Python's own documentation topics (standard library): technical prose and code
TEXTS = (WIKI, PYDOCS)
_WIKI_FILE = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
SPLITS = ("calib", "dev", "test", "eval")
EVAL_SPLITS = ("test", "dev", "eval")  # the held-out ones
DEFAULT_EVAL_SPLIT = "test"


@functools.lru_cache(maxsize=1)
def wiki_articles() -> tuple[str, ...]:
    """Cleaned plain-text articles (markup removed), in file order; cached as JSON after the first parse."""
    cached = cache_dir() / "wiki_articles_v1.json"
    if cached.is_file():
        with open(cached, encoding="utf-8") as f:
            return tuple(json.load(f))
    articles = _parse_wiki()
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(list(articles), f)
    tmp.replace(cached)
    return articles


def _parse_wiki() -> tuple[str, ...]:
    try:
        path = str(importlib.metadata.distribution("gensim").locate_file(_WIKI_FILE))
    except importlib.metadata.PackageNotFoundError:
        raise ValueError("the bundled 'wiki' text needs the gensim package: pip install gensim") from None
    # gensim (which ships the text) takes seconds to import: only when the wiki text is first parsed.
    from gensim.corpora.wikicorpus import filter_wiki

    articles = []
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if not elem.tag.endswith("}page"):
                continue
            title = next((c.text for c in elem.iter() if c.tag.endswith("}title")), "") or ""
            ns = next((c.text for c in elem.iter() if c.tag.endswith("}ns")), "0")
            text = next((c.text for c in elem.iter() if c.tag.endswith("}text")), "") or ""
            elem.clear()
            if ns != "0" or text.lstrip().lower().startswith("#redirect"):
                continue
            body = _clean(filter_wiki(text))
            if len(body) > 200:
                articles.append(f"{title}\n\n{body}")
    return tuple(articles)


def _clean(text: str) -> str:
    lines = []
    for line in text.splitlines():
        line = re.sub(r"[ \t]+", " ", re.sub(r"'{2,}", "", line)).strip()
        if line and not re.fullmatch(r"[=\W\d]*", line):
            lines.append(line)
    return "\n".join(lines)


def pydoc_topics() -> tuple[str, ...]:
    """The documentation topics of this Python (``pydoc_data.topics``), sorted by name, each text once (some
    topics are aliases of others)."""
    import pydoc_data.topics as topics  # ~1 MB of text: imported only when this text is asked for

    return tuple(dict.fromkeys(topics.topics[name] for name in sorted(topics.topics)))


def split_documents(documents: tuple[str, ...], split: str) -> tuple[str, ...]:
    """The documents of ``split``: "calib" the even ones; of the odd ones, "dev" every other one from the first,
    "test" the rest; "eval" all odd ones. No document is in two of calib, dev and test."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if split == "calib":
        return documents[0::2]
    held_out = documents[1::2]
    return {"dev": held_out[0::2], "test": held_out[1::2], "eval": held_out}[split]


def load_text(source: str, split: str) -> str:
    """Text of ``source`` ("wiki", "pydocs" or a UTF-8 file path) for ``split`` (``SPLITS``): the built-in texts
    split by document (``split_documents``); a file is used whole."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if source in TEXTS:
        documents = wiki_articles() if source == WIKI else pydoc_topics()
        return "\n\n".join(split_documents(documents, split))
    if not isinstance(source, str) or not os.path.isfile(source):
        raise ValueError(f"text source must be one of {', '.join(TEXTS)} or an existing UTF-8 text file, got "
                         f"{source!r}")
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"text file {source!r} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise ValueError(f"text file {source!r} is empty")
    return text


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids [n] of the whole text, no special tokens."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer`` puts its BOS token in front of every text it encodes: it says so (``add_bos_token``)
    or does it (a probe text encoded with its special tokens starts with ``bos_token_id``; Gemma's tokenizer read
    from a GGUF file adds one while its ``add_bos_token`` says False)."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return False
    if getattr(tokenizer, "add_bos_token", False):
        return True
    ids = tokenizer("a", add_special_tokens=True, return_attention_mask=False)["input_ids"]
    return bool(ids) and int(ids[0]) == int(bos_id)


def wants_bos(tokenizer, bos: bool | str = "auto") -> bool:
    """Whether windows start with the tokenizer's BOS token: ``bos`` True/False, or "auto" = when the tokenizer
    adds one to every text itself (``adds_bos``, e.g. Gemma's: without it the model is far off)."""
    if bos == "auto":
        bos = adds_bos(tokenizer)
    if not isinstance(bos, bool):
        raise ValueError(f"bos must be True, False or 'auto', got {bos!r}")
    if bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError(f"{type(tokenizer).__name__} has no BOS token to start windows with")
    return bos


def _with_bos(windows: torch.Tensor, tokenizer, bos: bool) -> torch.Tensor:
    """[n, seqlen] windows cut from seqlen - 1 tokens, with the BOS token in front when ``bos``."""
    if not bos:
        return windows
    start = torch.full((windows.shape[0], 1), int(tokenizer.bos_token_id), dtype=windows.dtype)
    return torch.cat([start, windows], dim=1)


def calibration_windows(tokenizer, source: str, samples: int, seqlen: int, seed: int = 0,
                        bos: bool | str = "auto") -> torch.Tensor:
    """``samples`` random windows of ``seqlen`` tokens from the calibration split -> [samples, seqlen]
    (with ``wants_bos``: the BOS token, then ``seqlen - 1`` text tokens)."""
    bos = wants_bos(tokenizer, bos)
    seqlen -= int(bos)
    ids = tokenize_text(tokenizer, load_text(source, "calib"))
    if ids.numel() <= seqlen:
        raise ValueError(
            f"calibration text has {ids.numel()} tokens, fewer than seqlen+1 ({seqlen + 1}); use a longer text "
            "or a shorter --seqlen"
        )
    starts = window_starts(ids.numel(), samples, seqlen, seed)
    return _with_bos(torch.stack([ids[s : s + seqlen] for s in starts]), tokenizer, bos)


def window_starts(tokens: int, samples: int, seqlen: int, seed: int) -> list[int]:
    """Start offsets of ``samples`` windows of ``seqlen`` tokens in a text of ``tokens`` tokens: distinct slots of
    a grid of non-overlapping windows (shifted by a random offset) when the text holds that many, so no window
    shares tokens with another (distillation's held-out windows are then truly held out); random, possibly
    overlapping offsets when the text is shorter."""
    gen = torch.Generator().manual_seed(seed)
    span = tokens - 1  # every window needs its next token inside the text
    slots = span // seqlen
    if samples > slots:
        return torch.randint(0, tokens - seqlen, (samples,), generator=gen).tolist()
    offset = int(torch.randint(0, span - slots * seqlen + 1, (1,), generator=gen))
    chosen = torch.randperm(slots, generator=gen)[:samples]
    return [offset + int(slot) * seqlen for slot in chosen]


def spread_indices(total: int, wanted: int | None) -> list[int]:
    """``wanted`` of ``range(total)`` spread evenly over it (the middle of each of ``wanted`` equal stretches),
    all of them when ``wanted`` is None or not smaller: a few windows then sample the whole text, not its start."""
    if wanted is None or wanted >= total:
        return list(range(total))
    return [int((i + 0.5) * total / wanted) for i in range(wanted)]


def eval_windows(tokenizer, source: str, seqlen: int, max_windows: int | None = None,
                 bos: bool | str = "auto", split: str = DEFAULT_EVAL_SPLIT) -> torch.Tensor:
    """Standard perplexity protocol: tokenize ``split`` of ``source`` once, cut it into non-overlapping windows
    of ``seqlen`` tokens, drop the remainder; with ``max_windows``, that many of them spread evenly over the
    whole text (``spread_indices``) -> [windows, seqlen]. With ``wants_bos`` each window is the BOS token and
    ``seqlen - 1`` text tokens (the BOS token is never a predicted target)."""
    if split not in EVAL_SPLITS:
        raise ValueError(f"evaluation windows come from a held-out split ({', '.join(EVAL_SPLITS)}), got {split!r}")
    bos = wants_bos(tokenizer, bos)
    seqlen -= int(bos)
    ids = tokenize_text(tokenizer, load_text(source, split))
    n = ids.numel() // seqlen
    if n == 0:
        raise ValueError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1, got {max_windows}")
    windows = ids[: n * seqlen].view(n, seqlen)[spread_indices(n, max_windows)]
    return _with_bos(windows, tokenizer, bos)
