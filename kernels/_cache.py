"""Per-layer memo keyed on tensor identity, for work that only depends on a layer's (unchanged) tensors.

An entry is reused while every tensor is the same Python object with the same version counter and data
pointer (so in-place updates and ``param.data = ...`` swaps both invalidate it); it dies with its key tensor.
Inference tensors have no version counter: in-place edits of those inside ``torch.inference_mode`` are not
seen (identity and data pointer still are).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


def _state(t: torch.Tensor) -> tuple[int, int]:
    try:
        version = t._version
    except RuntimeError:  # inference tensors (made under torch.inference_mode) have no version counter
        version = -1
    return version, t.data_ptr()


class _Entry:
    __slots__ = ("refs", "state", "value")

    def __init__(self, tensors: tuple[torch.Tensor | None, ...], value: Any) -> None:
        self.refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self.state = tuple(None if t is None else _state(t) for t in tensors)
        self.value = value

    def matches(self, tensors: tuple[torch.Tensor | None, ...]) -> bool:
        if len(tensors) != len(self.refs):
            return False
        for ref, state, t in zip(self.refs, self.state, tensors):
            if t is None:
                if ref is not None:
                    return False
            elif ref is None or ref() is not t or state != _state(t):
                return False
        return True


class LayerMemo:
    """``get(key, tensors, build)`` returns ``build()``'s value, recomputed only when ``tensors`` changed."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def get(self, key: torch.Tensor, tensors: tuple[torch.Tensor | None, ...], build: Callable[[], Any]) -> Any:
        entry = self._entries.get(id(key))
        if entry is not None and entry.matches(tensors):
            return entry.value
        value = build()
        if entry is None:
            weakref.finalize(key, self._entries.pop, id(key), None)
        self._entries[id(key)] = _Entry(tensors, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)
