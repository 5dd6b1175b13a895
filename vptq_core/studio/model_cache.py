"""A small cache of loaded models (chat and evaluation), keyed by what was loaded."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Slot:
    lock: threading.Lock = field(default_factory=threading.Lock)
    value: Any = None
    loaded: bool = False


class ModelCache:
    """Keeps the last ``max_items`` loaded values (models) by key; concurrent requests for the same key load
    it once. Loading errors are not cached."""

    def __init__(self, max_items: int = 4) -> None:
        if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
            raise ValueError(f"max_items must be a positive integer, got {max_items!r}")
        self.max_items = max_items
        self._lock = threading.Lock()
        self._slots: OrderedDict[Hashable, _Slot] = OrderedDict()

    def get(self, key: Hashable, loader: Callable[[], Any]) -> Any:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
            self._slots.move_to_end(key)
        with slot.lock:
            if not slot.loaded:
                try:
                    slot.value, slot.loaded = loader(), True
                except BaseException:
                    with self._lock:
                        if self._slots.get(key) is slot:
                            del self._slots[key]
                    raise
        with self._lock:
            while len(self._slots) > self.max_items:
                oldest = next(iter(self._slots))
                if oldest == key:
                    break
                del self._slots[oldest]
        return slot.value

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            slot = self._slots.get(key)
            return slot is not None and slot.loaded

    def drop(self, predicate: Callable[[Hashable], bool]) -> int:
        """Forget every key for which ``predicate(key)`` is true; returns how many."""
        with self._lock:
            keys = [k for k in self._slots if predicate(k)]
            for k in keys:
                del self._slots[k]
        return len(keys)
