"""One background job: its state (guarded by its own lock), the immutable ``JobSnapshot`` the UI renders, and
the ``JobContext`` its task reports through.

A task is ``task(ctx: JobContext) -> dict``: it writes under ``ctx.out_dir``, reports through
``ctx.on_start`` / ``ctx.on_layer`` / ``ctx.set_phase``, polls ``ctx.should_stop()`` and raises
``JobCancelled`` to end as cancelled. Its returned dict becomes the job's ``result``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..quant.progress import progress_text

STATUSES = ("queued", "running", "done", "failed", "cancelled", "interrupted")
ACTIVE = ("queued", "running")
FINISHED = ("done", "failed", "cancelled", "interrupted")  # interrupted: cut off by a restart, can be resumed
KEPT = ("done", "interrupted")  # statuses that hold files and count against the runs an owner may keep


class JobCancelled(Exception):
    """Raised by a task (or inside it) to end the job as cancelled."""


@dataclass(frozen=True)
class JobSnapshot:
    """A consistent, immutable view of a job at one moment (what the UI renders)."""

    id: str
    owner: str
    title: str
    kind: str
    device: str
    status: str
    phase: str
    position: int  # 1-based place in its device queue while queued, else 0
    running_ahead: int  # jobs running on the same device while this one waits
    total_layers: int | None
    layers_done: int
    current: str  # e.g. "block 3 · mlp.down_proj" (last finished layer)
    reports: tuple[dict, ...]
    reports_version: tuple[int, int]  # (reports, reports with their block's output error): changes on news
    error: str | None
    result: dict | None
    extras: dict
    meta: dict
    created: float
    started: float | None
    finished: float | None
    eta_seconds: float | None

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    @property
    def elapsed(self) -> float:
        if self.started is None:
            return 0.0
        return (self.finished or time.time()) - self.started

    def to_dict(self, reports: bool = True) -> dict:
        data = dataclasses.asdict(self)
        data["reports"] = list(self.reports) if reports else len(self.reports)
        data["reports_version"] = list(self.reports_version)
        data["elapsed"] = round(self.elapsed, 2)
        return data


class Job:
    """One unit of background work. Its mutable state is guarded by ``self.lock``; read it through
    ``snapshot()``."""

    def __init__(self, job_id: str, owner: str, task: Callable, title: str, kind: str, device: str, meta: dict,
                 out_dir: Path) -> None:
        self.id = job_id
        self.owner = owner
        self.task = task
        self.title = title
        self.kind = kind
        self.device = device
        self.meta = dict(meta)
        self.out_dir = out_dir
        self.created = time.time()
        self.lock = threading.Lock()
        self.cancel_event = threading.Event()
        self.status = "queued"
        self.phase = "waiting in the queue"
        self.total_layers: int | None = None
        self.reports: list = []
        self.error: str | None = None
        self.error_detail: str | None = None
        self.result: dict | None = None
        self.extras: dict = {}
        self.started: float | None = None
        self.layers_started: float | None = None
        self.finished: float | None = None
        self.forgotten = False  # owner gone: delete the outputs as soon as the job ends
        self.owner_hash: str | None = None  # reloaded after a restart: owned by whoever's identity hashes to this
        self.stop_reason: str | None = None  # why the job was stopped from inside (the memory ceiling)
        self.progress_eta: tuple[float, float] | None = None  # (the run's ETA, when it was said): on_progress

    def snapshot(self, position: int = 0, running_ahead: int = 0, reports: bool = True) -> JobSnapshot:
        with self.lock:
            done = len(self.reports)
            with_output = sum(1 for r in self.reports if r.rel_output_error is not None)
            rows = tuple(r.to_dict() for r in self.reports) if reports else ()
            current = f"block {self.reports[-1].block} · {self.reports[-1].module}" if self.reports else ""
            eta = None
            if self.status == "running" and self.progress_eta is not None:
                eta = max(self.progress_eta[0] - (time.time() - self.progress_eta[1]), 0.0)
            elif self.status == "running" and self.total_layers and done and self.layers_started is not None:
                spent = time.time() - self.layers_started
                eta = spent / done * max(self.total_layers - done, 0)
            return JobSnapshot(
                id=self.id, owner=self.owner, title=self.title, kind=self.kind, device=self.device,
                status=self.status, phase=self.phase, position=position, running_ahead=running_ahead,
                total_layers=self.total_layers, layers_done=done, current=current, reports=rows,
                reports_version=(done, with_output), error=self.error,
                result=dict(self.result) if self.result is not None else None, extras=dict(self.extras),
                meta=dict(self.meta), created=self.created, started=self.started, finished=self.finished,
                eta_seconds=eta,
            )


class JobContext:
    """What a running task sees: its output directory and the progress / cancellation callbacks."""

    def __init__(self, job: Job, memory_check: Callable[[], str | None] | None = None) -> None:
        self._job = job
        self._memory_check = memory_check

    @property
    def job_id(self) -> str:
        return self._job.id

    @property
    def out_dir(self) -> Path:
        return self._job.out_dir

    def set_phase(self, text: str) -> None:
        with self._job.lock:
            self._job.phase = text

    def on_start(self, total_layers: int) -> None:
        """The number of layers the task will report (enables the progress bar and ETA)."""
        with self._job.lock:
            self._job.total_layers = int(total_layers)
            self._job.layers_started = time.time()
            if self._job.progress_eta is None:
                self._job.phase = "quantizing"

    def on_layer(self, report) -> None:
        """Publish one finished layer (a ``LayerReport``; its ``rel_output_error`` may be filled in later)."""
        job = self._job
        with job.lock:
            job.reports.append(report)
            if job.progress_eta is not None:  # the stage's own progress says where the run is
                return
            if job.total_layers and len(job.reports) >= job.total_layers:
                job.phase = "saving the checkpoint"
            else:
                job.phase = "quantizing"

    def on_progress(self, stage: str, done: int, total: int, eta_s: float | None) -> None:
        """The run's stage, its count and the run's ETA (quant/progress.py) become the job's phase and ETA."""
        with self._job.lock:
            self._job.phase = progress_text(stage, done, total)
            self._job.progress_eta = (float(eta_s), time.time()) if eta_s is not None else None

    def on_plan(self, plan) -> None:
        """The run's plan (``run_plan.RunPlan``) before it starts: ``extras["plan"]``, with its lines."""
        with self._job.lock:
            self._job.extras = {**self._job.extras, "plan": {**plan.to_dict(), "lines": plan.lines()}}

    def on_metrics(self, phase: str, metrics: dict) -> None:
        """A plan made before the first block (e.g. the bit plan by sensitivity): ``extras["model_metrics"]``."""
        with self._job.lock:
            self._job.extras = {**self._job.extras,
                                "model_metrics": {**self._job.extras.get("model_metrics", {}), phase: metrics}}

    def should_stop(self) -> bool:
        """Cancelled by its owner, or over the app's memory ceiling (the job then fails with that reason)."""
        if self._memory_check is not None and self._job.stop_reason is None:
            reason = self._memory_check()
            if reason:
                self._job.stop_reason = f"stopped: {reason}; a smaller model or fewer calibration samples may fit"
        return self._job.cancel_event.is_set() or self._job.stop_reason is not None


def error_reason(exc: BaseException) -> str:
    """What a job's owner is shown of a failure: a ValueError's own words, else the exception's type and text."""
    text = str(exc).strip()
    if isinstance(exc, ValueError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
