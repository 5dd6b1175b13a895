"""Progress names the stage from the first event: every stage a run goes through, its count and the ETA."""

from __future__ import annotations

import dataclasses

import pytest

from vptq_core.quant.config import CalibConfig, ScalarConfig, VPTQConfig
from vptq_core.quant.pipeline import quantize_model
from vptq_core.quant.progress import Progress, duration_text, progress_text, stages_named

EVERY = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0, bits_budget=4.0,
                   allocation="sensitivity", calib_sampled_share=0.5, distill_iters=3, distill_topk=8)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_eta_comes_from_the_plan_until_the_stage_has_its_own_pace():
    clock, events = _Clock(), []
    progress = Progress(lambda *e: events.append(e), planned={"load": 5.0, "blocks": 100.0, "save": 10.0},
                        clock=clock)
    progress.start("load")
    assert events[-1] == ("load", 0, 1, 115.0)  # the whole run, from the first event
    clock.now = 3.0
    assert progress.eta() == pytest.approx(2.0 + 110.0)
    progress.start("blocks", total=10)
    clock.now = 13.0  # 10 s into the stage, nothing done: its plan less what passed
    assert progress.eta() == pytest.approx(90.0 + 10.0)
    progress.advance(2)  # 2 blocks in 10 s: 8 more take 40 s
    assert events[-1] == ("blocks", 2, 10, pytest.approx(40.0 + 10.0))
    progress.start("evaluate")  # a stage the plan does not price: only what it knows
    assert progress.eta() == 0.0


def test_without_a_plan_the_eta_is_unknown_until_the_stage_moves():
    clock, events = _Clock(), []
    progress = Progress(lambda *e: events.append(e), clock=clock)
    progress.start("blocks", total=4, done=1)  # a resumed run: its pace counts from here
    assert events[-1] == ("blocks", 1, 4, None)
    clock.now = 6.0
    progress.advance(3)
    assert events[-1] == ("blocks", 3, 4, 3.0)


def test_progress_reads_as_a_line():
    assert progress_text("blocks", 5, 30, 200.0) == "quantizing block 5/30 · ETA 3 min 20 s"
    assert progress_text("plan", 0, 1, None) == "measuring layer sensitivity"
    assert progress_text("distill", 10, 80, 5) == "distilling step 10/80 · ETA 5 s"
    assert duration_text(3725) == "1 h 02 min"


def test_a_run_names_every_stage_it_goes_through_before_its_work(tiny_model, calib_ids):
    model, _ = tiny_model
    events, stages, log = [], [], []

    def on_progress(*event):
        events.append(event)
        log.append(("progress", event[0]))

    _, result = quantize_model(model, calib_ids, "vptq", EVERY, on_stage=stages.append, on_progress=on_progress,
                               on_layer=lambda r: log.append(("layer", r.block)),
                               on_step=lambda *s: log.append(("step", s[0])))
    assert not result.cancelled
    assert stages == ["calibrate", "plan", "blocks", "distill"] == stages_named(events)
    assert log[0] == ("progress", "calibrate")  # the first thing a caller hears names the stage
    first_layer = log.index(("layer", 0))
    assert ("progress", "blocks") in log[:first_layer]
    # the writing counts in windows (of the 2 of 4 the blocks see that the model writes), step by step
    assert [e[1] for e in events if e[0] == "calibrate"] == [0, 1, 2]
    # blocks count to the model's blocks, distillation to its steps
    assert [e[1:3] for e in events if e[0] == "blocks"][-1] == (2, 2)
    assert [e[1:3] for e in events if e[0] == "distill"][-1] == (3, 3)
    assert log.index(("progress", "distill")) < log.index(("step", "distill"))


def test_quantize_to_dir_names_its_stages_from_the_first_second(tmp_path):
    from vptq_core.api import quantize_to_dir

    events, stages, plans = [], [], []
    out, summary = quantize_to_dir("tiny-random-llama", "rtn", ScalarConfig(bits=4), CalibConfig(samples=2, seqlen=32),
                                   tmp_path / "ckpt", device="cpu", head=True, on_stage=stages.append,
                                   on_progress=lambda *e: events.append(e), on_plan=plans.append)
    assert stages == ["load", "blocks", "embeddings", "save"] == stages_named(events)
    assert events[0][:3] == ("load", 0, 1)
    (plan,) = plans
    assert set(plan.stages) == {"load", "blocks", "save"} and not plan.decisions
    assert all(e[3] is not None for e in events[1:])  # once the plan is made, every event has an ETA
    assert summary["plan"]["decisions"] == []


def test_a_budget_the_tiny_run_cannot_keep_is_planned_and_reported(tmp_path, monkeypatch):
    """A run whose budget its self-written calibration would overrun: the plan leaves it out, says why before the
    run, and the report keeps the decision."""
    import json

    from vptq_core import api
    from vptq_core.quant import cost

    monkeypatch.setattr(api, "measure_speed", lambda device: 1.0)
    monkeypatch.setattr(cost, "KD_SAMPLE_S", cost.KD_SAMPLE_S * 1e6)  # writing priced far over the budget
    config = ScalarConfig(bits=4, calib_sampled_share=0.5, time_budget=60.0)
    plans = []
    out, summary = api.quantize_to_dir("tiny-random-llama", "rtn", config, CalibConfig(samples=4, seqlen=32),
                                       tmp_path / "ckpt", device="cpu", on_plan=plans.append)
    (decision,) = plans[0].decisions
    assert decision.setting == "calib_sampled_share" and decision.after == 0.0
    report = json.loads((out / "quant_report.json").read_text())
    assert report["settings"]["calib_sampled_share"] == 0.0
    assert "blocks" in plans[0].stages and "sample_calibration" not in report["summary"]["timings"]
    assert report["plan"]["decisions"][0]["setting"] == "calib_sampled_share"
    assert summary["plan"]["decisions"] == [decision.line()]


def test_a_budgeted_run_prices_its_block_work_by_its_pace_on_block_0(tmp_path, monkeypatch):
    """Under a time budget the run times its method's block work on block 0 before the plan
    (``block_pace.measure_block_speed``): the plan's first line and the report give that pace. It reads the speed
    probe again after the paces and keeps the faster reading; without a budget it reads it once."""
    import json

    from vptq_core import api

    readings = [0.4, 0.8, 0.3]  # a slow moment first, then the machine as it is, then one more slow moment
    calls = []
    monkeypatch.setattr(api, "measure_speed", lambda device: calls.append(device) or readings[len(calls) - 1])
    config = VPTQConfig(vector_len=4, num_centroids=16, outlier_percent=0.0, kmeans_iters=1, time_budget=600.0)
    plans = []
    out, _ = api.quantize_to_dir("tiny-random-llama", "vptq", config, CalibConfig(samples=4, seqlen=32),
                                 tmp_path / "ckpt", device="cpu", on_plan=plans.append)
    speed = plans[0].block_speed
    assert speed is not None and speed > 0
    assert f"block work {speed:.2f}x" in plans[0].lines()[0]
    assert json.loads((out / "quant_report.json").read_text())["plan"]["block_speed"] == round(speed, 3)
    assert len(calls) == 2 and plans[0].speed == 0.8 and "speed 0.80x" in plans[0].lines()[0]
    # without a budget nothing is timed, and the probe is read once
    plans.clear()
    api.quantize_to_dir("tiny-random-llama", "vptq", dataclasses.replace(config, time_budget=0.0),
                        CalibConfig(samples=4, seqlen=32), tmp_path / "free", device="cpu", on_plan=plans.append)
    assert plans[0].block_speed is None
    assert len(calls) == 3 and plans[0].speed == 0.3


def test_the_sensitivity_plan_counts_its_blocks(tmp_path):
    """The plan stage of a sensitivity allocation: "measuring layer sensitivity 1/3, 2/3" as each of the tiny model's
    2 blocks is measured, then 3/3 with the distortion table."""
    config = VPTQConfig(vector_len=4, num_centroids=16, outlier_percent=0.0, kmeans_iters=1, allocation="sensitivity",
                        bits_budget=2.5, sensitivity_windows=1)
    events = []
    from vptq_core.api import quantize_to_dir

    quantize_to_dir("tiny-random-llama", "vptq", config, CalibConfig(samples=2, seqlen=32), tmp_path / "ckpt",
                    device="cpu", on_progress=lambda *e: events.append(e))
    plan = [(done, total) for stage, done, total, _ in events if stage == "plan"]
    assert plan == [(0, 3), (1, 3), (2, 3), (3, 3)]
