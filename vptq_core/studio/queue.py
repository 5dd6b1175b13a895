"""Background jobs: a FIFO queue per device with a concurrency limit, jobs owned by one browser session,
per-layer reports published while they run, cancellation between layers, failures kept with their reason,
a limit on the runs one owner keeps, finished runs deleted from disk once they are older than ``max_age_s``,
and listeners told about every deleted job (e.g. to drop copies served for download).

One job's state and what its task sees are ``job``; what a job keeps on disk to come back after a restart is
``jobstore``: a new ``JobManager`` on the same work directory reloads the runs an earlier process left there,
and ``resume`` queues an interrupted one again.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import jobstore
from .job import (
    ACTIVE,
    FINISHED,
    KEPT,
    STATUSES,
    Job,
    JobCancelled,
    JobContext,
    JobSnapshot,
    error_reason,
)
from .jobstore import owner_digest, run_bytes

__all__ = ["ACTIVE", "DEFAULT_LIMITS", "FINISHED", "KEPT", "STATUSES", "Job", "JobCancelled", "JobContext",
           "JobManager", "JobSnapshot", "default_device", "error_reason", "owner_digest"]

DEFAULT_LIMITS = {"cpu": 1, "cuda": 1}
_log = logging.getLogger(__name__)


def default_device() -> str:
    """"cuda" when a CUDA device is usable by background threads, else "cpu". On ZeroGPU Spaces
    (``SPACES_ZERO_GPU``) the GPU only exists inside ``spaces.GPU`` calls, so background jobs use the CPU."""
    import torch  # only here: the queue itself is torch-free (and imports in a few milliseconds)

    if torch.cuda.is_available() and not os.environ.get("SPACES_ZERO_GPU"):
        return "cuda"
    return "cpu"


class JobManager:
    """Runs jobs in background threads, at most ``limits[device]`` at a time per device, first come first
    served. Every call that reads or changes a job names its owner; other owners' jobs are invisible.

    Args:
        workdir: jobs write under ``workdir/jobs/<job id>/``; what earlier processes left there is reloaded when
            it has a valid description (finished and interrupted runs), else removed (see ``jobstore``).
        limits: concurrent jobs per device, e.g. {"cpu": 1, "cuda": 1}.
        max_active_per_owner: queued + running jobs one owner may have.
        max_queued: jobs waiting in all queues together; beyond it ``submit`` refuses.
        max_runs_per_owner: finished runs plus queued/running jobs one owner may keep; beyond it ``submit`` and
            ``import_run`` refuse (nothing is deleted behind the owner's back). Failed and cancelled jobs hold
            no files and do not count; the newest ``keep_failed`` of them are listed.
        max_age_s: finished jobs older than this (since they finished) are deleted with their files (None: kept
            until deleted). ``prune()`` applies it; every submit and listing does too.
        max_active_per_client: queued + running jobs from one client address, over every owner there (None: no
            limit); ``submit``, ``check_submit`` and ``resume`` take the address as ``client`` (``client_address``).
            Addresses are kept in memory only.
    """

    def __init__(self, workdir: str | os.PathLike, limits: dict[str, int] | None = None,
                 max_active_per_owner: int = 2, max_queued: int = 16, max_runs_per_owner: int = 6,
                 max_age_s: float | None = 12 * 3600, keep_failed: int = 10,
                 max_active_per_client: int | None = None) -> None:
        limits = dict(DEFAULT_LIMITS if limits is None else limits)
        for device, limit in limits.items():
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ValueError(f"limits[{device!r}] must be a positive integer, got {limit!r}")
        for name, value in (("max_active_per_owner", max_active_per_owner), ("max_queued", max_queued),
                            ("max_runs_per_owner", max_runs_per_owner), ("keep_failed", keep_failed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_age_s is not None and not max_age_s > 0:
            raise ValueError(f"max_age_s must be positive or None, got {max_age_s!r}")
        self.workdir = Path(workdir)
        self.jobs_dir = self.workdir / "jobs"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self.max_active_per_owner = max_active_per_owner
        self.max_queued = max_queued
        self.max_runs_per_owner = max_runs_per_owner
        self.max_age_s = max_age_s
        self.keep_failed = keep_failed
        self.max_active_per_client = max_active_per_client
        self._clients: dict[str, str] = {}  # job id -> the client address that queued it
        self._lock = threading.RLock()
        self._jobs: dict[str, Job] = {}
        self._queues: dict[str, deque[str]] = {d: deque() for d in limits}
        self._running: dict[str, int] = dict.fromkeys(limits, 0)
        self._threads: dict[str, threading.Thread] = {}
        self._listeners: list[Callable[[str, str], None]] = []
        self._jobs.update((job.id, job) for job in jobstore.restore(self.jobs_dir, max_age_s))
        # Why the process must stop spending memory now, or None (``memory_guard.MemoryGuard.over``): polled by
        # running jobs between layers and checked before a job is queued.
        self.memory_check: Callable[[], str | None] | None = None

    def _adopt_locked(self, owner: str) -> None:
        """Reloaded jobs whose owner hash is ``owner``'s become ``owner``'s."""
        if not any(j.owner_hash for j in self._jobs.values()):
            return
        digest = owner_digest(owner)
        for job in self._jobs.values():
            if job.owner_hash == digest:
                job.owner, job.owner_hash = owner, None

    def on_delete(self, listener: Callable[[str, str], None]) -> None:
        """Call ``listener(job_id, owner)`` after a job and its files are deleted (pruned, deleted by its owner,
        or its owner forgotten). It runs under the manager's lock: keep it short, and do not wait on jobs."""
        self._listeners.append(listener)

    # -------------------------------------------------------------------------------------- submit / run
    def submit(self, owner: str, task: Callable[[JobContext], dict], *, title: str = "", device: str = "cpu",
               kind: str = "quantize", meta: dict | None = None, client: str | None = None) -> JobSnapshot:
        """Queue ``task`` for ``owner`` (from the address ``client``) on ``device``; it starts as soon as the
        device has a free slot."""
        _check_owner(owner)
        if device not in self.limits:
            raise ValueError(f"device must be one of {sorted(self.limits)}, got {device!r}")
        with self._lock:
            self.check_submit(owner, client)
            job_id = self._new_id()
            job = Job(job_id, owner, task, title, kind, device, meta or {}, self.jobs_dir / job_id)
            self._jobs[job_id] = job
            if client:
                self._clients[job_id] = client
            self._queues[device].append(job_id)
            self._dispatch_locked()
            return self._snapshot_locked(job)

    def import_run(self, owner: str, fill: Callable[[Path], dict], *, title: str = "", kind: str = "import",
                   meta: dict | None = None) -> JobSnapshot:
        """Register a finished run made synchronously by ``fill(out_dir) -> result`` (e.g. an uploaded
        archive). If ``fill`` raises, its directory is removed and the error propagates."""
        _check_owner(owner)
        with self._lock:
            self._prune_locked()
            self._check_runs_locked(owner)
            job_id = self._new_id()
            out_dir = self.jobs_dir / job_id
            out_dir.mkdir(parents=True)
        try:
            result = fill(out_dir)
            with self._lock:
                self._check_runs_locked(owner)  # another upload of the same owner may have finished meanwhile
                job = Job(job_id, owner, fill, title, kind, "none", meta or {}, out_dir)
                now = time.time()
                job.status, job.phase, job.result = "done", "done", dict(result or {})
                job.started = job.finished = now
                self._jobs[job_id] = job
                jobstore.describe(job)
                return self._snapshot_locked(job)
        except BaseException:
            shutil.rmtree(out_dir, ignore_errors=True)
            raise

    def _check_runs_locked(self, owner: str) -> None:
        self._adopt_locked(owner)
        kept = [j for j in self._jobs.values()
                if j.owner == owner and not j.forgotten and j.status in (*KEPT, *ACTIVE)]
        if len(kept) >= self.max_runs_per_owner:
            raise ValueError(f"you already have {len(kept)} runs kept or in progress (limit {self.max_runs_per_owner} "
                             f"per browser); delete one under 'Your runs' first")

    def _new_id(self) -> str:
        while True:
            job_id = secrets.token_hex(6)
            if job_id not in self._jobs and not (self.jobs_dir / job_id).exists():
                return job_id

    def _dispatch_locked(self) -> None:
        for device, queue in self._queues.items():
            while queue and self._running[device] < self.limits[device]:
                job = self._jobs[queue.popleft()]
                self._running[device] += 1
                with job.lock:
                    job.status, job.phase, job.started = "running", "starting", time.time()
                thread = threading.Thread(target=self._run, args=(job,), name=f"job-{job.id}", daemon=True)
                self._threads[job.id] = thread
                thread.start()

    def _run(self, job: Job) -> None:
        status, error, detail, result = "done", None, None, None
        try:
            job.out_dir.mkdir(parents=True, exist_ok=True)
            if job.cancel_event.is_set():
                raise JobCancelled
            with self._lock:
                jobstore.describe(job)  # from here on a restart finds it (``jobstore.restore``)
            result = job.task(JobContext(job, self.memory_check))
            if result is not None and not isinstance(result, dict):
                raise TypeError(f"a job task must return a dict or None, got {type(result).__name__}")
        except JobCancelled:
            status, error = ("failed", job.stop_reason) if job.stop_reason else ("cancelled", None)
        except Exception as exc:  # noqa: BLE001 - any task failure is shown to its owner with its reason
            status, error, detail = "failed", error_reason(exc), traceback.format_exc()
            _log.warning("job %s failed: %s", job.id, error, exc_info=True)
        if status != "done":
            shutil.rmtree(job.out_dir, ignore_errors=True)
        # One critical section: whoever sees the job finished (``get``/``wait`` take the manager's lock) also sees
        # the queue moved on and the owner's old runs pruned.
        with self._lock:
            with job.lock:
                job.status, job.error, job.error_detail = status, error, detail
                job.result = dict(result) if status == "done" and result is not None else None
                job.finished = time.time()
                job.phase = {"done": "done", "failed": "failed", "cancelled": "cancelled"}[status]
            jobstore.describe(job)
            self._running[job.device] -= 1
            self._threads.pop(job.id, None)
            if job.forgotten:
                self._delete_locked(job)
            self._dispatch_locked()
            self._prune_owner_locked(job.owner)

    # ------------------------------------------------------------------------------------- queries
    def _owned(self, job_id: str, owner: str) -> Job:
        _check_owner(owner)
        self._adopt_locked(owner)
        job = self._jobs.get(job_id) if isinstance(job_id, str) else None
        if job is None or job.owner != owner or job.forgotten:
            kept = f", and are deleted {self.max_age_s / 3600:g} h after they finish" if self.max_age_s else ""
            raise ValueError(f"no job {job_id!r} in this session (runs belong to the browser that made them{kept})")
        return job

    def _snapshot_locked(self, job: Job, reports: bool = True) -> JobSnapshot:
        position = ahead = 0
        with job.lock:
            queued = job.status == "queued"
        if queued:
            queue = self._queues[job.device]
            position = list(queue).index(job.id) + 1 if job.id in queue else 0
            ahead = self._running[job.device]
        return job.snapshot(position, ahead, reports)

    def get(self, job_id: str, owner: str, reports: bool = True) -> JobSnapshot:
        """The job ``job_id`` of ``owner`` (ValueError if it does not exist or belongs to someone else)."""
        with self._lock:
            return self._snapshot_locked(self._owned(job_id, owner), reports)

    def jobs(self, owner: str, statuses: tuple[str, ...] | None = None, reports: bool = False) -> list[JobSnapshot]:
        """``owner``'s jobs, oldest first, optionally only those with a status in ``statuses``."""
        _check_owner(owner)
        with self._lock:
            self._prune_locked()
            self._adopt_locked(owner)
            found = [self._snapshot_locked(j, reports) for j in self._jobs.values()
                     if j.owner == owner and not j.forgotten]
        return [s for s in found if statuses is None or s.status in statuses]

    def disk_usage(self, owner: str | None = None) -> int:
        """Bytes on disk under the job directories of ``owner`` (None: of every job), their descriptions not
        counted. A queued or running job counts at least its ``meta["reserve_bytes"]`` (what it will write), so
        quotas hold while it runs."""
        with self._lock:
            if owner is not None:
                self._adopt_locked(owner)
            jobs = [(j.out_dir, j.status in ACTIVE, j.meta.get("reserve_bytes") or 0)
                    for j in self._jobs.values() if owner is None or j.owner == owner]
        return sum(max(run_bytes(d), int(reserve) if active else 0) for d, active, reserve in jobs)

    def job_bytes(self, job_id: str, owner: str) -> int:
        """Bytes on disk under the directory of the job ``job_id`` of ``owner``."""
        with self._lock:
            job = self._owned(job_id, owner)
        return run_bytes(job.out_dir)

    def check_submit(self, owner: str, client: str | None = None) -> None:
        """Raise the ValueError ``submit`` would raise for ``owner`` now (limits per owner and per client address,
        a full queue)."""
        _check_owner(owner)
        with self._lock:
            self._prune_locked()
            self._adopt_locked(owner)
            self._check_active_locked(owner)
            self._check_runs_locked(owner)
            self._check_client_locked(client)
            self._check_queue_locked()
        reason = self.memory_check() if self.memory_check is not None else None
        if reason:
            raise ValueError(f"cannot start now: {reason}; try again later")

    def _check_client_locked(self, client: str | None) -> None:
        if not client or self.max_active_per_client is None:
            return
        active = sum(1 for j in self._jobs.values() if j.status in ACTIVE and self._clients.get(j.id) == client)
        if active >= self.max_active_per_client:
            raise ValueError(f"{active} jobs from your network address are queued or running (limit "
                             f"{self.max_active_per_client} per address, whatever the browser or session); wait for "
                             "one to finish")

    def _check_active_locked(self, owner: str) -> None:
        mine = [j for j in self._jobs.values() if j.owner == owner and j.status in ACTIVE]
        if len(mine) >= self.max_active_per_owner:
            raise ValueError(f"you already have {len(mine)} job(s) queued or running (limit "
                             f"{self.max_active_per_owner}); wait for one to finish or cancel it")

    def _check_queue_locked(self) -> None:
        waiting = sum(len(q) for q in self._queues.values())
        if waiting >= self.max_queued:
            raise ValueError(f"the queue is full ({waiting} jobs waiting); try again in a few minutes")

    def update_result(self, job_id: str, owner: str, **fields: Any) -> JobSnapshot:
        """Change fields of a finished job's result (e.g. the archive's size after it was packed again)."""
        with self._lock:
            job = self._owned(job_id, owner)
            with job.lock:
                if job.result is None:
                    raise ValueError(f"job {job_id} has no result (status: {job.status})")
                job.result.update(fields)
            jobstore.describe(job)
            return self._snapshot_locked(job)

    def reassign(self, old_owner: str, new_owner: str) -> int:
        """Give every job of ``old_owner`` to ``new_owner`` (a browser session that learnt its lasting identity
        after starting a job); returns how many."""
        _check_owner(old_owner)
        _check_owner(new_owner)
        with self._lock:
            self._adopt_locked(old_owner)
            mine = [j for j in self._jobs.values() if j.owner == old_owner and not j.forgotten]
            for job in mine:
                job.owner = new_owner
                jobstore.describe(job)
            return len(mine)

    def checkpoint_dir(self, job_id: str, owner: str) -> Path:
        """The checkpoint directory of a finished job of ``owner``."""
        snap = self.get(job_id, owner, reports=False)
        if snap.status != "done" or not snap.result or "checkpoint_dir" not in snap.result:
            raise ValueError(f"job {job_id} has no checkpoint (status: {snap.status})")
        return Path(snap.result["checkpoint_dir"])

    def set_extra(self, job_id: str, owner: str, key: str, value: Any) -> JobSnapshot:
        """Attach a result computed later (e.g. an evaluation) to a job of ``owner``."""
        with self._lock:
            job = self._owned(job_id, owner)
            with job.lock:
                job.extras[key] = value
            jobstore.describe(job)
            return self._snapshot_locked(job)

    def wait(self, job_id: str, owner: str, timeout: float | None = None) -> JobSnapshot:
        """Block until the job has finished (or ``timeout`` seconds passed) and return its snapshot."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            snap = self.get(job_id, owner, reports=False)
            if not snap.active or (deadline is not None and time.monotonic() >= deadline):
                return self.get(job_id, owner)
            time.sleep(0.05)

    def resume(self, job_id: str, owner: str, task: Callable[[JobContext], dict],
               device: str | None = None, client: str | None = None) -> JobSnapshot:
        """Queue an interrupted job of ``owner`` again, in its own directory, with ``task`` (one that continues
        the unfinished run there). The limits on queued and running jobs apply as for ``submit``; the run already
        counts among those the owner keeps."""
        with self._lock:
            job = self._owned(job_id, owner)
            device = job.device if device is None else device
            if device not in self.limits:
                raise ValueError(f"device must be one of {sorted(self.limits)}, got {device!r}")
            with job.lock:
                status = job.status
            if status != "interrupted":
                raise ValueError(f"job {job_id} was not interrupted, it cannot be resumed (status: {status})")
            self._prune_locked()
            self._check_active_locked(owner)
            self._check_client_locked(client)
            self._check_queue_locked()
            if client:
                self._clients[job.id] = client
            with job.lock:
                job.task, job.device, job.cancel_event = task, device, threading.Event()
                job.status, job.phase, job.error, job.error_detail, job.result = (
                    "queued", "waiting in the queue", None, None, None)
                job.reports, job.total_layers, job.finished = [], None, None
                job.started = job.layers_started = None
                job.extras.pop("interrupted", None)
            self._queues[device].append(job.id)
            self._dispatch_locked()
            return self._snapshot_locked(job)

    # ---------------------------------------------------------------------------------- cancel / cleanup
    def cancel(self, job_id: str, owner: str) -> JobSnapshot:
        """Cancel a job of ``owner``: a queued one leaves the queue at once, a running one stops at the next
        layer boundary. Cancelling a finished job changes nothing."""
        with self._lock:
            job = self._owned(job_id, owner)
            with job.lock:
                status = job.status
            if status == "queued":
                self._queues[job.device].remove(job.id)
                with job.lock:
                    job.status, job.phase, job.finished = "cancelled", "cancelled", time.time()
                job.cancel_event.set()
            elif status == "running":
                job.cancel_event.set()
                with job.lock:
                    job.phase = "cancelling (stops after the current layer)"
            return self._snapshot_locked(job)

    def delete(self, job_id: str, owner: str) -> None:
        """Delete a job of ``owner`` with its files; an active one is cancelled and deleted when it stops."""
        with self._lock:
            self._cancel_and_delete_locked(self._owned(job_id, owner), owner)

    def prune(self) -> list[str]:
        """Delete finished jobs older than ``max_age_s``; returns their ids."""
        with self._lock:
            return self._prune_locked()

    def forget_owner(self, owner: str) -> int:
        """The owner is gone (tab closed): cancel their jobs and delete their files. Returns how many jobs."""
        _check_owner(owner)
        with self._lock:
            self._adopt_locked(owner)
            mine = [j for j in self._jobs.values() if j.owner == owner]
            for job in mine:
                self._cancel_and_delete_locked(job, owner)
            return len(mine)

    def _cancel_and_delete_locked(self, job: Job, owner: str) -> None:
        """Cancel ``job`` if active; delete it now, or when it stops if it is still running."""
        with job.lock:
            status = job.status
        if status in ACTIVE:
            self.cancel(job.id, owner)
        with job.lock:
            running = job.status == "running"
        if running:
            job.forgotten = True
        else:
            self._delete_locked(job)

    def _delete_locked(self, job: Job) -> None:
        if self._jobs.pop(job.id, None) is None:
            return
        self._clients.pop(job.id, None)
        shutil.rmtree(job.out_dir, ignore_errors=True)
        for listener in self._listeners:
            try:
                listener(job.id, job.owner)
            except Exception:  # noqa: BLE001 - a listener's failure must not stop the deletion of others
                _log.warning("on_delete listener failed for job %s", job.id, exc_info=True)

    def _prune_owner_locked(self, owner: str) -> None:
        """Failed and cancelled jobs (no files) beyond the newest ``keep_failed`` of the owner are dropped."""
        ended = [j for j in self._jobs.values() if j.owner == owner and j.status in ("failed", "cancelled")]
        for job in ended[: max(len(ended) - self.keep_failed, 0)]:
            self._delete_locked(job)

    def _prune_locked(self) -> list[str]:
        if self.max_age_s is None:
            return []
        now = time.time()
        old = [j for j in self._jobs.values()
               if j.status in FINISHED and j.finished is not None and now - j.finished > self.max_age_s]
        for job in old:
            self._delete_locked(job)
        return [j.id for j in old]

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel every job and wait up to ``timeout`` seconds for running ones to stop."""
        with self._lock:
            for queue in self._queues.values():
                while queue:
                    job = self._jobs[queue.popleft()]
                    with job.lock:
                        job.status, job.phase, job.finished = "cancelled", "cancelled", time.time()
            threads = list(self._threads.values())
            for job in self._jobs.values():
                job.cancel_event.set()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0))


def _check_owner(owner: str) -> None:
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"owner must be a non-empty session id, got {owner!r}")

