"""What a job keeps on disk so that it survives a restart of the process, and what its files weigh.

A job that starts writes its description (``job.json``: the owner's identity as a SHA-256 hash, never the
identity itself, the title, kind, device, times and ``meta``) into its directory, and a finished one adds its
result (paths relative to the job directory), extras and layer reports. ``restore`` reloads every job directory
with a valid description: finished runs come back as they were, a run that was cut off (no result, but an
unfinished run in ``<job dir>/checkpoint/.partial``, ``api.partial_status``, or none yet) comes back as
"interrupted" with the blocks it had finished (maybe none). Reloaded jobs belong to nobody until a caller
presents the identity whose hash they hold (``Job.owner_hash``). Anything else there (no or a malformed
description, expired) is deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from .job import Job, JobContext

DESCRIPTION = "job.json"
DESCRIPTION_FORMAT = 1
MAX_DESCRIPTION_BYTES = 16_000_000
RESULT_PATHS = ("checkpoint_dir", "archive")  # result fields that are paths inside the job directory
JOB_ID = re.compile(r"^[0-9a-f]{12}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_log = logging.getLogger(__name__)


def owner_digest(owner: str) -> str:
    """What a job's description stores of its owner: the SHA-256 hex digest of the identity."""
    return hashlib.sha256(owner.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------------------ writing
def describe(job: Job) -> None:
    """Write ``job``'s description into its directory (atomic; the directory must exist). Jobs that did not
    finish well write none (their directory goes)."""
    with job.lock:
        if job.status not in ("running", "done", "interrupted") or job.forgotten or not job.out_dir.is_dir():
            return
        owner_hash = job.owner_hash or owner_digest(job.owner)
        data = {"format": DESCRIPTION_FORMAT, "id": job.id, "owner_sha256": owner_hash, "title": job.title,
                "kind": job.kind, "device": job.device, "created": job.created, "started": job.started,
                "finished": job.finished, "state": "done" if job.status == "done" else "started",
                "model": job.meta.get("model"), "method": job.meta.get("method"),
                "settings": job.meta.get("settings"), "calib": job.meta.get("calib"),
                "meta": job.meta, "extras": {k: v for k, v in job.extras.items() if k != "interrupted"}}
        if job.status == "done":
            result = dict(job.result or {})
            for key in RESULT_PATHS:
                if result.get(key) is not None:
                    result[key] = os.path.relpath(result[key], job.out_dir)
            data["result"] = result
            data["reports"] = [r.to_dict() for r in job.reports]
    try:
        text = json.dumps(data, default=_plain)
        tmp = job.out_dir / f".{DESCRIPTION}.tmp"
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, job.out_dir / DESCRIPTION)
    except (OSError, TypeError, ValueError):  # the run goes on; it only would not come back after a restart
        _log.warning("cannot write the description of job %s", job.id, exc_info=True)


# ------------------------------------------------------------------------------------------ reading
def restore(jobs_dir: Path, max_age_s: float | None) -> list[Job]:
    """The jobs an earlier process left in ``jobs_dir`` with a valid description (not older than ``max_age_s``
    since they finished); every other job directory there is removed."""
    now, jobs = time.time(), []
    for path in sorted(jobs_dir.iterdir()):
        if not path.is_dir() or path.is_symlink() or not JOB_ID.match(path.name):
            continue
        try:
            job = read_job(path, now, max_age_s)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with a leftover, it is removed
            _log.info("removing job directory %s: %s", path.name, exc)
            job = None
        if job is None:
            shutil.rmtree(path, ignore_errors=True)
        else:
            jobs.append(job)
    return jobs


def read_job(path: Path, now: float, max_age_s: float | None) -> Job | None:
    """The job described in ``path`` (None, or ValueError why, when it cannot come back)."""
    file = path / DESCRIPTION
    if not file.is_file() or file.is_symlink():
        return None
    if file.stat().st_size > MAX_DESCRIPTION_BYTES:
        raise ValueError(f"{DESCRIPTION} is larger than {MAX_DESCRIPTION_BYTES} bytes")
    data = json.loads(file.read_text(encoding="utf-8"))
    _check_description(data, path.name)
    job = Job(path.name, "", _not_resumed, data["title"], data["kind"], data["device"], data["meta"], path)
    job.owner_hash = data["owner_sha256"]
    job.created, job.started, job.extras = float(data["created"]), data.get("started"), dict(data["extras"])
    if data["state"] == "done":
        _restore_finished(job, data)
    elif data["state"] == "started":
        if not _restore_interrupted(job):
            return None  # cut off, and nothing says how to start it again
    else:
        raise ValueError(f"state must be 'started' or 'done', got {data['state']!r}")
    if max_age_s is not None and now - job.finished > max_age_s:
        return None
    return job


def _check_description(data, job_id: str) -> None:
    if not isinstance(data, dict) or data.get("format") != DESCRIPTION_FORMAT:
        raise ValueError(f"{DESCRIPTION} is not a job description of format {DESCRIPTION_FORMAT}")
    _expect(data.get("id") == job_id, "its id is not its directory's name")
    _expect(isinstance(data.get("owner_sha256"), str) and _SHA256.match(data["owner_sha256"]),
            "owner_sha256 is not a SHA-256 hex digest")
    for key in ("title", "kind", "device", "state"):
        _expect(isinstance(data.get(key), str), f"{key} is not a string")
    for key in ("created", "started", "finished"):
        _expect(data.get(key) is None or _number(data[key]), f"{key} is not a time")
    _expect(_number(data.get("created")), "created is not a time")
    for key in ("meta", "extras"):
        _expect(isinstance(data.get(key), dict), f"{key} is not an object")
    reports = data.get("reports", [])
    _expect(isinstance(reports, list) and all(_report_ok(r) for r in reports), "reports are malformed")


def _restore_finished(job: Job, data: dict) -> None:
    """A finished run: its result (paths back to absolute ones inside its directory) and its reports."""
    path = job.out_dir
    result = data.get("result")
    _expect(isinstance(result, dict), "a finished job has no result")
    result = dict(result)
    for key in RESULT_PATHS:
        rel = result.get(key)
        if rel is None:
            continue
        _expect(isinstance(rel, str), f"result {key} is not a path")
        target = (path / rel).resolve()
        _expect(target.is_relative_to(path.resolve()) and target.exists(),
                f"result {key} {rel!r} is not inside the job directory")
        result[key] = str(path / rel)
    _expect(_number(data.get("finished")), "a finished job has no finish time")
    job.status, job.phase, job.result, job.finished = "done", "done", result, float(data["finished"])
    job.reports = [StoredReport(r) for r in data.get("reports", [])]
    job.total_layers = len(job.reports) or None


def _restore_interrupted(job: Job) -> bool:
    """A run the restart cut off: "interrupted" with the blocks it had finished, none when it was cut off before
    its first block (still loading the model or calibrating). False when it does not say how it was started
    (nothing to resume)."""
    status = _partial_status(job.out_dir)
    if status is not None:
        job.finished = (Path(status["dir"]) / "run.json").stat().st_mtime  # when it last finished a block
    else:
        total = job.meta.get("num_blocks")
        if not (job.meta.get("method") and isinstance(total, int) and not isinstance(total, bool) and total > 0):
            return False
        status = {"blocks_done": 0, "blocks_total": total}
        job.finished = (job.out_dir / DESCRIPTION).stat().st_mtime  # when it started
    job.status = "interrupted"
    job.phase = f"interrupted by a restart after {status['blocks_done']} of {status['blocks_total']} blocks"
    job.extras["interrupted"] = {"blocks_done": int(status["blocks_done"]),
                                 "blocks_total": int(status["blocks_total"])}
    return True


class StoredReport:
    """A layer report read back from a job's description (what snapshots read of a ``LayerReport``)."""

    def __init__(self, data: dict) -> None:
        self._data = dict(data)
        self.block, self.module = data["block"], data["module"]
        self.rel_output_error = data.get("rel_output_error")

    def to_dict(self) -> dict:
        return dict(self._data)


# ------------------------------------------------------------------------------------------ disk usage
def run_bytes(job_dir: Path) -> int:
    """What a job's files take on disk, without its description (the manager's own, a few kB)."""
    try:
        own = (job_dir / DESCRIPTION).stat().st_size
    except OSError:
        own = 0
    return _tree_bytes(job_dir) - own


def _tree_bytes(path: Path) -> int:
    total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                total += _tree_bytes(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


# ------------------------------------------------------------------------------------------ helpers
def _report_ok(data) -> bool:
    return (isinstance(data, dict) and isinstance(data.get("block"), int) and isinstance(data.get("module"), str)
            and (data.get("rel_output_error") is None or _number(data["rel_output_error"])))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{DESCRIPTION}: {what}")


def _plain(value):
    """JSON for values of a result or report that are not plain (numpy or torch scalars, paths)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _not_resumed(ctx: JobContext) -> dict:
    raise ValueError("this run was interrupted by a restart; resume it to continue")


def _partial_status(job_dir: Path) -> dict | None:
    """The unfinished run in ``<job dir>/checkpoint`` (``api.partial_status``), or None."""
    from ..api import partial_status  # only here: the job store itself is torch-free

    return partial_status(job_dir / "checkpoint")
