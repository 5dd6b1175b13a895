"""Where a run is, as data: the stage it is in, how much of it is done, and the seconds the whole run has left.

Every stage of a run (``pipeline.STAGES`` and the ones ``api.quantize_to_dir`` adds around them) is announced when
it starts, before any of its work, and again as it advances: ``on_progress(stage, done, total, eta_s)``. ``eta_s``
is the seconds the whole run still needs: what is left of this stage (from its own pace once some of it is done,
else from its planned seconds) plus the planned seconds of the stages after it; None while nothing is known.
The command line's bar, the app's job view and the tests read the same events; ``progress_text`` words them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

OnProgress = Callable[[str, int, int, "float | None"], None]

# What a stage is doing, as a person reads it; the count follows ("quantizing block 5/30").
STAGE_LABELS = {
    "load": "loading the model",
    "calibrate": "writing calibration text",
    "plan": "measuring layer sensitivity",
    "blocks": "quantizing block",
    "distill": "distilling step",
    "embeddings": "quantizing the head and embedding",
    "save": "saving the checkpoint",
    "evaluate": "evaluating",
}


def stage_label(stage: str) -> str:
    return STAGE_LABELS.get(stage, stage)


def duration_text(seconds: float) -> str:
    """``seconds`` as "45 s", "3 min 20 s" or "1 h 05 min"."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress_text(stage: str, done: int, total: int, eta_s: float | None = None) -> str:
    """One line for a progress event: "quantizing block 5/30 · ETA 3 min 20 s" (no count for a one-step stage)."""
    text = stage_label(stage) + (f" {done}/{total}" if total > 1 else "")
    return text + (f" · ETA {duration_text(eta_s)}" if eta_s is not None else "")


class Progress:
    """Turns a run's stage starts and advances into ``on_progress`` events (and ``on_stage(name)`` as each stage
    starts). ``planned``: estimated seconds per stage (``run_plan.RunPlan.stages``); the ETA of a stage that has
    not advanced yet, and of the stages still to come, is taken from it. Stages not in ``planned`` count 0 s."""

    def __init__(self, on_progress: OnProgress | None = None, on_stage: Callable[[str], None] | None = None,
                 planned: dict[str, float] | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self._on_progress = on_progress
        self._on_stage = on_stage
        self.planned = dict(planned or {})
        self._clock = clock
        self.stage: str | None = None
        self.done = 0
        self.total = 1
        self._started = 0.0
        self._first_done = 0
        self.seen: list[str] = []  # the stages started so far, in order

    def start(self, stage: str, total: int = 1, done: int = 0) -> None:
        """``stage`` begins, ``total`` steps long (``done`` of them already, e.g. blocks of a resumed run)."""
        self.stage, self.total, self.done = stage, max(int(total), 1), int(done)
        self._started, self._first_done = self._clock(), int(done)
        self.seen.append(stage)
        if self._on_stage is not None:
            self._on_stage(stage)
        self._emit()

    def advance(self, done: int, total: int | None = None) -> None:
        """The current stage has ``done`` of its steps done (``total`` when it changed, e.g. a shrunk plan)."""
        if self.stage is None:
            return
        if total is not None:
            self.total = max(int(total), 1)
        self.done = min(int(done), self.total)
        self._emit()

    def eta(self) -> float | None:
        """Seconds the run still needs (see the module's docstring); None when nothing is known."""
        if self.stage is None:
            return None
        later = self._later_seconds()
        spent = self._clock() - self._started
        moved = self.done - self._first_done
        if moved > 0:
            left = spent / moved * (self.total - self.done)
        elif self.stage in self.planned:
            left = max(self.planned[self.stage] - spent, 0.0)
        else:
            return None if later is None else later
        return left + (later or 0.0)

    def _later_seconds(self) -> float | None:
        if not self.planned:
            return None
        names = list(self.planned)
        if self.stage not in names:
            return 0.0
        return sum(self.planned[name] for name in names[names.index(self.stage) + 1:])

    def _emit(self) -> None:
        if self._on_progress is not None and self.stage is not None:
            eta = self.eta()
            self._on_progress(self.stage, self.done, self.total, None if eta is None else round(eta, 1))


def stages_named(events: Iterable[tuple]) -> list[str]:
    """The stages a list of ``on_progress`` events named, in order, each once."""
    names: list[str] = []
    for event in events:
        if not names or names[-1] != event[0]:
            names.append(event[0])
    return names
