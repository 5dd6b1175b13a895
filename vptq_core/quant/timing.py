"""Wall time per phase, accumulated across calls (k-means, sweep, block forwards, ...)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Timings(dict):
    """phase -> seconds; ``with timings.timed("sweep"): ...`` adds the block's wall time to its phase."""

    def add(self, phase: str, seconds: float) -> None:
        self[phase] = self.get(phase, 0.0) + seconds

    def merge(self, other: dict) -> None:
        for phase, seconds in other.items():
            self.add(phase, seconds)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)
