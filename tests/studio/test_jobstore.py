"""The job store: job directories an earlier process left are reloaded when their description is valid (for
their owner only) and removed otherwise; a description round-trips; what a job's files weigh."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from vptq_core.models import TINY
from vptq_core.quant.results import LayerReport
from vptq_core.resume import PartialRun
from vptq_core.studio import views
from vptq_core.studio.job import Job
from vptq_core.studio.jobstore import DESCRIPTION, StoredReport, describe, read_job, run_bytes
from vptq_core.studio.queue import JobManager, owner_digest


def test_stale_job_dirs_are_removed_on_start(tmp_path: Path):
    (tmp_path / "jobs" / "0123456789ab").mkdir(parents=True)
    (tmp_path / "jobs" / "keep-me").mkdir()
    JobManager(tmp_path)
    assert not (tmp_path / "jobs" / "0123456789ab").exists() and (tmp_path / "jobs" / "keep-me").is_dir()


def test_a_description_round_trips_without_the_owner_and_is_not_counted_as_the_runs_files(tmp_path: Path):
    job = Job("0123456789ab", "alice", lambda ctx: {}, "a run", "quantize", "cpu", {"model": TINY},
              tmp_path / "0123456789ab")
    (job.out_dir / "checkpoint").mkdir(parents=True)
    (job.out_dir / "checkpoint" / "weights.bin").write_bytes(b"x" * 10)
    describe(job)  # a queued job has nothing worth keeping yet
    assert not (job.out_dir / DESCRIPTION).exists()
    job.status, job.started, job.finished = "done", 100.0, 160.0
    job.result = {"checkpoint_dir": str(job.out_dir / "checkpoint"), "archive": None, "where": Path("a") / "b"}
    job.reports = [StoredReport({"block": 0, "module": "mlp.down_proj", "rel_output_error": 0.5})]
    job.extras = {"eval": {"perplexity": 9.5}}
    describe(job)
    text = (job.out_dir / DESCRIPTION).read_text(encoding="utf-8")
    data = json.loads(text)
    assert "alice" not in text and data["owner_sha256"] == owner_digest("alice")
    assert data["result"]["checkpoint_dir"] == "checkpoint" and data["result"]["where"] == str(Path("a") / "b")
    assert run_bytes(job.out_dir) == 10  # the description is the store's own, not the run's
    back = read_job(job.out_dir, now=200.0, max_age_s=None)
    assert (back.owner, back.owner_hash, back.status, back.finished) == ("", owner_digest("alice"), "done", 160.0)
    assert back.result["checkpoint_dir"] == str(job.out_dir / "checkpoint") and back.extras == job.extras
    assert [r.to_dict() for r in back.reports] == [r.to_dict() for r in job.reports] and back.total_layers == 1
    assert read_job(job.out_dir, now=160.0 + 3601, max_age_s=3600) is None  # expired
    data["state"] = "paused"
    (job.out_dir / DESCRIPTION).write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError, match=r"state must be 'started' or 'done', got 'paused'"):
        read_job(job.out_dir, now=200.0, max_age_s=None)


# ------------------------------------------------------------------------------------------ restarts
class _Killed(BaseException):
    """Stands in for the process dying mid-run: the job thread ends without any cleanup."""


def _finished_run(ctx):
    ckpt = ctx.out_dir / "checkpoint"
    ckpt.mkdir(exist_ok=True)  # (a resumed run finds its unfinished one there)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ctx.out_dir / "run.zip").write_bytes(b"zip")
    ctx.on_start(1)
    ctx.on_layer(LayerReport(block=0, name="model.layers.0.mlp.down_proj", module="mlp.down_proj", out_features=4,
                             in_features=4, method="rtn", rel_proxy_loss=0.25, rel_weight_error=0.5, index_bits=2.0,
                             total_bits=2.5, seconds=0.1, rel_output_error=0.125))
    return {"checkpoint_dir": str(ckpt), "archive": str(ctx.out_dir / "run.zip"), "summary": {"layers": 1}}


def _cut_off(ctx):
    PartialRun(ctx.out_dir / "checkpoint").start({"model": "m"}, 3)  # what quantize_to_dir writes first
    raise _Killed


def _leftover(jobs_dir: Path, job_id: str, **fields) -> Path:
    directory = jobs_dir / job_id
    (directory / "checkpoint").mkdir(parents=True)
    data = {"format": 1, "id": job_id, "owner_sha256": owner_digest("alice"), "title": "t", "kind": "quantize",
            "device": "cpu", "created": time.time(), "started": time.time(), "finished": time.time(),
            "state": "done", "meta": {}, "extras": {}, "result": {"checkpoint_dir": "checkpoint"}, "reports": []}
    data.update(fields)
    (directory / "job.json").write_text(json.dumps(data), encoding="utf-8")
    return directory


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_runs_come_back_after_a_restart_for_their_owner_only(tmp_path: Path):
    before = JobManager(tmp_path)
    done = before.wait(before.submit("alice", _finished_run, title="done", meta={"model": TINY}).id, "alice", 10)
    before.set_extra(done.id, "alice", "eval", {"perplexity": 12.5})
    cut = before.submit("alice", _cut_off, title="cut", meta={"model": TINY, "method": "rtn"}).id
    before._threads[cut].join(10)
    assert before.get(cut, "alice").status == "running"  # nobody noticed: the process is gone
    jobs = tmp_path / "jobs"
    for job_id in (done.id, cut):
        text = (jobs / job_id / "job.json").read_text(encoding="utf-8")
        assert "alice" not in text and json.loads(text)["owner_sha256"] == owner_digest("alice")
    # What else an earlier process may leave: each is removed at start-up.
    (jobs / "0123456789ab").mkdir()  # no description
    (jobs / "0123456789ac").mkdir()
    (jobs / "0123456789ac" / "job.json").write_text("{not json", encoding="utf-8")
    bad = [_leftover(jobs, "0123456789ad", finished=time.time() - 13 * 3600),  # expired
           _leftover(jobs, "0123456789ae", result={"checkpoint_dir": "../0123456789ab"}),  # outside its directory
           _leftover(jobs, "0123456789af", id="0123456789aa"),  # not its own directory
           _leftover(jobs, "0123456789b0", state="started"),  # started, with no method or blocks to resume
           _leftover(jobs, "0123456789b1", owner_sha256="alice"),  # a raw id instead of a hash
           _leftover(jobs, "0123456789b2", reports=[{"block": "x"}])]
    kept = _leftover(jobs, "0123456789b3")

    after = JobManager(tmp_path, max_active_per_owner=1, max_runs_per_owner=4)
    assert sorted(p.name for p in jobs.iterdir()) == sorted([done.id, cut, kept.name])
    assert not any(p.exists() for p in bad)
    assert after.jobs("bob") == [] and after.disk_usage("bob") == 0
    for call in (lambda: after.get(cut, "bob"), lambda: after.resume(cut, "bob", _finished_run)):
        with pytest.raises(ValueError, match=f"no job '{cut}' in this session"):
            call()
    assert after.disk_usage() >= len(b"weights")
    snaps = {s.id: s for s in after.jobs("alice", reports=True)}
    assert sorted(snaps) == sorted([done.id, cut, kept.name])
    back = snaps[done.id]
    assert (back.status, back.title, back.meta, back.extras) == ("done", "done", {"model": TINY},
                                                                  {"eval": {"perplexity": 12.5}})
    assert back.result == done.result and back.reports == done.reports and back.layers_done == 1
    assert after.checkpoint_dir(done.id, "alice") == jobs / done.id / "checkpoint"
    interrupted = snaps[cut]
    assert interrupted.status == "interrupted" and not interrupted.active
    assert interrupted.extras == {"interrupted": {"blocks_done": 0, "blocks_total": 3}}
    assert "0 of 3 blocks" in interrupted.phase
    shown = views.progress_html(interrupted)
    assert 'data-status="interrupted"' in shown and "0 of 3 blocks done" in shown and "press Resume" in shown

    # Limits still apply: a running job blocks the resume (1 active per owner), and the interrupted run counts
    # among the runs kept (4: done, interrupted, the leftover, the running one), so nothing new may start.
    gate = threading.Event()
    running = after.submit("alice", lambda ctx: {"ok": gate.wait(10)}).id
    with pytest.raises(ValueError, match=r"you already have 1 job\(s\) queued or running \(limit 1\)"):
        after.resume(cut, "alice", _finished_run)
    gate.set()
    after.wait(running, "alice", timeout=10)
    with pytest.raises(ValueError, match="4 runs kept or in progress"):
        after.submit("alice", lambda ctx: {})
    with pytest.raises(ValueError, match="was not interrupted"):
        after.resume(done.id, "alice", _finished_run)
    resumed = after.resume(cut, "alice", _finished_run)
    assert resumed.status in ("queued", "running") and resumed.extras == {}
    finished = after.wait(cut, "alice", timeout=10)
    assert finished.status == "done" and finished.result["checkpoint_dir"] == str(jobs / cut / "checkpoint")
    assert json.loads((jobs / cut / "job.json").read_text(encoding="utf-8"))["state"] == "done"
    # A page that attaches after starting: its jobs' descriptions follow the identity.
    job = after.wait(after.submit("session-1", _finished_run).id, "session-1", timeout=10)
    after.reassign("session-1", "identity-A")
    text = (jobs / job.id / "job.json").read_text(encoding="utf-8")
    assert json.loads(text)["owner_sha256"] == owner_digest("identity-A") and "session-1" not in text
    assert JobManager(tmp_path).get(job.id, "identity-A").status == "done"
