"""The app's memory ceiling: the process's resident memory (RSS) against a limit, checked before a load or a
job spends memory and polled while a job runs, so one upload or job cannot take the server down with every
other user's work in it."""

from __future__ import annotations

from collections.abc import Callable

import psutil

from . import views


def process_rss() -> int:
    """Resident bytes of this process."""
    return psutil.Process().memory_info().rss


class MemoryGuard:
    """``limit_bytes``: the most resident memory the app may use; ``rss`` reads what it uses now."""

    def __init__(self, limit_bytes: int, rss: Callable[[], int] = process_rss) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 1:
            raise ValueError(f"limit_bytes must be a positive integer, got {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self.rss = rss

    def check_room(self, need: int, what: str) -> None:
        """ValueError unless ``need`` more bytes fit under the limit now."""
        used = self.rss()
        if used + need > self.limit_bytes:
            raise ValueError(f"{what} needs about {views.mb(need)} of memory; the server uses {views.mb(used)} of "
                             f"its {views.mb(self.limit_bytes)} memory limit: try again later or with a smaller model")

    def over(self) -> str | None:
        """Why the process must stop spending memory (it is over the limit), or None."""
        used = self.rss()
        if used <= self.limit_bytes:
            return None
        return f"the server's memory reached {views.mb(used)}, over its {views.mb(self.limit_bytes)} limit"
