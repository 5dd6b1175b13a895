"""A job shows the stage its run is in, the run's ETA and what the run's plan chose, from the first event."""

from __future__ import annotations

import html
from pathlib import Path

from vptq_core.quant import methods
from vptq_core.quant.config import CalibConfig, ScalarConfig
from vptq_core.quant.cost import RunSize
from vptq_core.quant.run_plan import plan_run
from vptq_core.studio import views
from vptq_core.studio.job import Job, JobContext
from vptq_core.studio.task import quantization_task


def _job(tmp_path: Path) -> Job:
    return Job("0123456789ab", "alice", lambda ctx: {}, "a run", "quantize", "cpu", {}, tmp_path / "job")


def test_the_job_phase_is_the_stage_and_its_count_and_the_eta_the_runs(tmp_path: Path):
    job = _job(tmp_path)
    job.status, job.started = "running", 0.0
    ctx = JobContext(job)
    ctx.on_progress("plan", 0, 1, 300.0)
    snap = job.snapshot()
    assert snap.phase == "measuring layer sensitivity" and 295 <= snap.eta_seconds <= 300
    ctx.on_start(14)
    ctx.on_progress("blocks", 2, 24, 120.0)
    ctx.on_layer(type("Report", (), {"block": 1, "module": "mlp.down_proj", "rel_output_error": None,
                                     "to_dict": lambda self: {}})())
    snap = job.snapshot()
    assert snap.phase == "quantizing block 2/24" and 115 <= snap.eta_seconds <= 120  # a layer keeps the stage


def test_the_job_view_shows_the_plans_decisions(tmp_path: Path):
    vptq = methods.get("vptq")
    shapes = ((896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864)) * 24
    plan = plan_run(vptq, RunSize(shapes, 136_000_000, 32, 512), vptq.make_config(vptq.preset("2.5 bits")), 0.5)
    job = _job(tmp_path)
    job.status, job.started = "running", 0.0
    ctx = JobContext(job)
    ctx.on_plan(plan)
    ctx.on_progress("load", 0, 1, None)
    shown = views.progress_html(job.snapshot())
    assert "loading the model" in shown
    for decision in plan.decisions:
        assert f"plan: {html.escape(decision.line())}" in shown
    assert job.snapshot().extras["plan"]["samples"] == plan.samples


def test_the_quantization_task_reports_every_stage(tmp_path: Path):
    job = _job(tmp_path)
    job.out_dir.mkdir(parents=True)
    job.status, job.started = "running", 0.0
    phases = []
    ctx = JobContext(job)
    original = ctx.on_progress

    def on_progress(*event):
        original(*event)
        phases.append(job.snapshot().phase)

    ctx.on_progress = on_progress
    quantization_task("tiny-random-llama", "rtn", ScalarConfig(bits=4), CalibConfig(samples=2, seqlen=32))(ctx)
    assert phases[0] == "loading the model" and "quantizing block 2/2" in phases and phases[-1] == (
        "saving the checkpoint")
    assert "plan" in job.snapshot().extras
