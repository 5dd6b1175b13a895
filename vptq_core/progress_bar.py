"""The command line's progress bar: the stage a run is in, its count and the run's ETA, from the first second.

It reads the run's ``on_progress`` events (quant/progress.py) and counts the ETA down between them, so a long
stage without steps of its own (the sensitivity measurement) still shows time passing.
"""

from __future__ import annotations

import threading
import time

from .quant.progress import progress_text

TICK_S = 1.0


class StageBar:
    """A tqdm bar whose description is the current stage ("quantizing block 5/30 · ETA 3 min 20 s"); the
    postfix keeps the detail of the last linear or step. ``close()`` when the run ends."""

    def __init__(self, file=None) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=1, file=file, bar_format="{desc} |{bar}| [{elapsed}]{postfix}", dynamic_ncols=True)
        self._lock = threading.Lock()
        self._event: tuple[str, int, int, float | None] | None = None
        self._at = time.monotonic()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="progress-bar", daemon=True)
        if getattr(self._bar.fp, "isatty", lambda: False)():  # a log file gets the events, not a line a second
            self._ticker.start()

    def on_progress(self, stage: str, done: int, total: int, eta_s: float | None) -> None:
        with self._lock:
            if self._event is None or self._event[0] != stage:
                self._bar.set_postfix_str("", refresh=False)  # the last stage's detail does not carry over
            if self._event is None or self._event[0] != stage or self._bar.total != total:
                self._bar.reset(total=max(total, 1))
            self._event, self._at = (stage, done, total, eta_s), time.monotonic()
            self._bar.n = done
            self._show()

    def write(self, text: str) -> None:
        """A line of its own above the bar."""
        with self._lock:
            self._bar.write(text, file=self._bar.fp)

    def detail(self, text: str) -> None:
        with self._lock:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.refresh()

    def _show(self) -> None:
        stage, done, total, eta = self._event
        if eta is not None:
            eta = max(eta - (time.monotonic() - self._at), 0.0)
        self._bar.set_description_str(progress_text(stage, done, total, eta), refresh=False)
        self._bar.refresh()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            with self._lock:
                if self._event is not None:
                    self._show()

    def close(self) -> None:
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        with self._lock:
            self._bar.close()
