"""The whole-run plan: every stage priced for this model on this device, and a time budget turned into choices."""

from __future__ import annotations

import dataclasses

import pytest

from vptq_core.quant import cost, methods, run_plan
from vptq_core.quant.calib_windows import sampled_count
from vptq_core.quant.config import BUDGET_REF_PARAMS, BUDGET_SCALE_MAX, ScalarConfig
from vptq_core.quant.cost import RunSize, run_seconds, sampling_seconds, stage_seconds
from vptq_core.quant.run_plan import DISTILL_SHARE, MIN_SAMPLES, WRITING_DISTILL_SHARE, plan_run

VPTQ = methods.get("vptq")


def _shapes(hidden: int, kv: int, inter: int, blocks: int) -> tuple[tuple[int, int], ...]:
    block = ((hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
             (hidden, inter))
    return block * blocks


# SmolLM2-135M's and a 0.5B qwen2 model's block linears and other parameters (embedding, tied head, norms)
SMOLLM2 = RunSize(_shapes(576, 192, 1536, 30), 28.4e6, 32, 512)
QWEN05B = RunSize(_shapes(896, 128, 4864, 24), 136.2e6, 32, 512)
PRESET = VPTQ.make_config(VPTQ.preset("2.5 bits"))
FIXED = dataclasses.replace(PRESET, time_budget_scale="fixed")  # 570 s whatever the model


def test_stage_seconds_sum_to_the_run_and_come_in_run_order():
    stages = stage_seconds(VPTQ, SMOLLM2, PRESET)
    assert list(stages) == ["load", "calibrate", "plan", "blocks", "distill", "save"]
    assert sum(stages.values()) == pytest.approx(run_seconds(VPTQ, SMOLLM2, PRESET))
    plain = stage_seconds(VPTQ, SMOLLM2, dataclasses.replace(PRESET, distill_iters=0, calib_sampled_share=0.0,
                                                             allocation="cap", layer_bits_cap=2.5, bits_budget=0.0))
    assert list(plain) == ["load", "blocks", "save"]  # stages a run does not go through are left out


def test_without_a_budget_the_plan_only_prices_the_run_on_this_device():
    config = dataclasses.replace(PRESET, time_budget=0.0)
    plan = plan_run(VPTQ, QWEN05B, config, speed=2.0)
    assert plan.config == config and plan.samples == 32 and plan.plan_windows == 0 and not plan.decisions
    reference = stage_seconds(VPTQ, QWEN05B, config)
    assert plan.stages == pytest.approx({name: s / 2.0 for name, s in reference.items()})
    assert plan.requested_seconds == pytest.approx(plan.seconds)


def test_a_budget_the_run_fits_changes_nothing():
    roomy = dataclasses.replace(PRESET, time_budget=1e6)
    plan = plan_run(VPTQ, SMOLLM2, roomy, speed=1.0)
    assert plan.config == roomy and plan.samples == 32 and not plan.decisions
    assert plan.seconds == pytest.approx(plan.requested_seconds)


def test_a_tight_budget_gives_up_the_cheapest_quality_first_and_says_why(monkeypatch):
    """Slower and slower devices: the plan gives up the sensitivity measurement's windows first; then calibration
    windows down to half of them where that keeps the self-written ones, else the self-written ones and calibration
    windows down to the floor; each only when what came before does not make the run fit, each with its reason."""
    kept, given_up = ["sensitivity_windows", "calib_samples"], ["sensitivity_windows", "calib_sampled_share",
                                                                "calib_samples"]
    seen = set()
    for speed in (1.2, 0.8, 0.6, 0.5, 0.4, 0.3):
        # the writing at twice the reference's pace: never over its 20% of the budget, so never cut for that alone
        plan = plan_run(VPTQ, SMOLLM2, FIXED, speed=speed, writing_speed=2.0)
        applied = [d for d in plan.decisions if d.applied]
        settings = tuple(d.setting for d in applied)
        seen.add(settings)
        assert settings in {tuple(kept[:n]) for n in range(3)} | {tuple(given_up[:n]) for n in (2, 3)}, speed
        if "calib_sampled_share" in settings:
            assert plan.config.calib_sampled_share == 0.0 and "calibrate" not in plan.stages
            writing = sampling_seconds(SMOLLM2.pass_params, 24, 512) / 2.0
            assert applied[1].reason.startswith(f"writing them ~{writing:.0f} s; the run before distillation")
            # keeping them with half the calibration windows would not have fit, not even with distillation's
            # share lowered
            half = SMOLLM2._replace(samples=16, plan_windows=1, writing_scale=speed / 2.0)
            assert not run_plan._fits(VPTQ, half, dataclasses.replace(FIXED, time_budget=0.0), speed, 570.0,
                                      WRITING_DISTILL_SHARE)
            if len(settings) == 3:
                assert applied[2].before == 32 and MIN_SAMPLES <= plan.samples < 32
        else:
            assert plan.config.calib_sampled_share == 0.75
            written = sampled_count(plan.samples, plan.config)
            assert plan.stages["calibrate"] == pytest.approx(sampling_seconds(SMOLLM2.pass_params, written, 512) / 2.0)
            if "calib_samples" in settings:
                assert 16 <= plan.samples < 32 and plan.plan_windows == 1
    assert {(), tuple(kept[:1]), tuple(kept), tuple(given_up)} <= seen, seen
    rest = {name: s for name, s in stage_seconds(VPTQ, SMOLLM2, dataclasses.replace(PRESET, time_budget=0.0)).items()
            if name != "distill"}
    # a budget of which the writing needs a little over 20%, the run fitting with fewer windows: as many as fit, as
    # the run itself decides (sampling.windows_that_fit)
    roomy = 800.0
    assert sum(rest.values()) - rest["calibrate"] + 0.2 * roomy < (1 - DISTILL_SHARE) * roomy
    slower = 1.02 * 0.2 * roomy / rest["calibrate"]  # writing priced ~2% over its share of the budget
    monkeypatch.setattr(cost, "KD_SAMPLE_S", cost.KD_SAMPLE_S * slower)
    plan = plan_run(VPTQ, SMOLLM2, dataclasses.replace(PRESET, time_budget=roomy))
    (decision,) = [d for d in plan.decisions if d.applied]
    written = round(plan.config.calib_sampled_share * 32)
    assert decision.setting == "calib_sampled_share" and 0 < plan.config.calib_sampled_share < 0.75
    assert decision.reason.endswith(f"the {written} of 24 that fit") and 12 <= written < 24
    assert plan.stages["calibrate"] <= 0.2 * roomy < sampling_seconds(SMOLLM2.pass_params, written + 1, 512)
    assert plan.samples == 32 and plan.plan_windows == 0


def test_a_large_model_on_a_slow_device_is_cut_down_in_order_to_the_floors():
    plan = plan_run(VPTQ, QWEN05B, FIXED, speed=0.5)
    applied = [d for d in plan.decisions if d.applied]
    # writing the windows would take over 20% of the budget: they go first, as the run would cut them anyway
    assert [d.setting for d in applied] == ["calib_sampled_share", "sensitivity_windows", "calib_samples"]
    assert "over 20% of the 570 s budget" in applied[0].reason
    assert plan.plan_windows == 1 and plan.samples == MIN_SAMPLES and plan.config.calib_sampled_share == 0.0
    assert applied[2].before == 32 and applied[2].after == MIN_SAMPLES
    # nothing is left for distillation: the plan says so instead of promising its steps
    forecast = plan.decisions[-1]
    assert forecast.setting == "distill_iters" and not forecast.applied and forecast.after == 0
    assert "over the 570 s budget already" in forecast.reason
    assert plan.seconds < plan.requested_seconds
    # the plan's own config is what the run goes on with; every other setting is the preset's
    assert dataclasses.replace(plan.config, calib_sampled_share=PRESET.calib_sampled_share) == FIXED


def test_the_presets_budget_grows_with_the_model_up_to_twice():
    """The preset's 570 s hold for a model of the bundled model's size; a 0.5B one gets sqrt(params / 135M) times
    them (the first decision, in the report and on the command line), a far larger one twice."""
    small = plan_run(VPTQ, SMOLLM2, PRESET, speed=1.0)
    assert small.budget == 570.0 and small.config.time_budget_scale == "model"
    assert "time_budget" not in [d.setting for d in small.decisions]
    plan = plan_run(VPTQ, QWEN05B, PRESET, speed=1.0)
    factor = (QWEN05B.params / BUDGET_REF_PARAMS) ** 0.5
    assert 1.8 < factor < 2.0 and plan.budget == pytest.approx(570.0 * factor)
    scaled = plan.decisions[0]
    assert (scaled.setting, scaled.before, scaled.after) == ("time_budget", 570.0, round(570.0 * factor, 1))
    assert plan.config.time_budget == plan.budget and plan.config.time_budget_scale == "fixed"
    assert plan_run(VPTQ, QWEN05B, plan.config, speed=1.0).budget == plan.budget  # planning again keeps it
    huge = QWEN05B._replace(other_params=QWEN05B.other_params + 10e9)
    assert plan_run(VPTQ, huge, PRESET, speed=1.0).budget == 570.0 * BUDGET_SCALE_MAX
    # without a budget there is nothing to scale
    assert plan_run(VPTQ, QWEN05B, dataclasses.replace(PRESET, time_budget=0.0), speed=1.0).budget == 0


def test_a_faster_device_keeps_more_and_only_as_much_is_cut_as_must_be():
    slow, fast = plan_run(VPTQ, QWEN05B, PRESET, speed=1.0), plan_run(VPTQ, QWEN05B, PRESET, speed=4.0)
    assert fast.samples >= slow.samples and fast.plan_windows in (0, 1, 2, 4)
    for plan in (slow, fast):
        if plan.samples > MIN_SAMPLES:  # the windows kept are the most that fit with distillation's share
            rest = {k: v for k, v in plan.stages.items() if k != "distill"}
            assert sum(rest.values()) <= plan.budget
            more = plan_run(VPTQ, QWEN05B._replace(samples=plan.samples + 1, plan_windows=plan.plan_windows),
                            plan.config, speed=plan.speed)
            assert more.samples <= plan.samples + 1


def test_the_distillation_forecast_counts_the_steps_the_budget_leaves():
    text = dataclasses.replace(PRESET, calib_sampled_share=0.0)
    stages = stage_seconds(VPTQ, SMOLLM2, dataclasses.replace(text, time_budget=0.0))
    rest = sum(v for k, v in stages.items() if k != "distill")
    budget = rest / (1 - DISTILL_SHARE) + 1.0  # just room for distillation's share: nothing else is cut
    assert stages["distill"] > DISTILL_SHARE * budget
    plan = plan_run(VPTQ, SMOLLM2, dataclasses.replace(text, time_budget=budget))
    (forecast,) = plan.decisions
    assert forecast.setting == "distill_iters" and not forecast.applied and forecast.before == 80
    share = (budget - rest) / stages["distill"]  # of distillation's seconds, part of them a fixed teacher pass
    assert 0 < forecast.after < 80 and forecast.after == pytest.approx(80 * share, abs=80 * share * 0.25)
    assert plan.seconds == pytest.approx(budget)
    # the command line says it is a forecast, not a setting: the steps fit themselves to the time left
    assert forecast.line().startswith(f"distill_iters: 80, about {forecast.after} expected to fit (a forecast")


def test_the_report_and_the_command_line_get_every_decision():
    plan = plan_run(VPTQ, QWEN05B, FIXED, speed=0.5)
    data = plan.to_dict()
    assert data["budget_seconds"] == 570.0 and data["samples"] == MIN_SAMPLES and data["plan_windows"] == 1
    assert [d["setting"] for d in data["decisions"]] == [d.setting for d in plan.decisions]
    lines = plan.lines()
    assert lines[0].startswith("estimated ") and "time budget 570 s" in lines[0]
    assert lines[1:] == [d.line() for d in plan.decisions] and "calib_samples: 32 -> 8 (" in lines[3]


def test_a_config_without_distillation_settings_is_only_priced():
    plan = plan_run(methods.get("rtn"), SMOLLM2, ScalarConfig(bits=4), speed=1.0)
    assert not plan.decisions and plan.budget == 0 and set(plan.stages) == {"load", "blocks", "save"}


def test_the_speed_probe_stays_in_range_and_leaves_the_random_streams_alone():
    import torch

    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    speed = run_plan.measure_speed("cpu")
    assert torch.equal(torch.rand(3), expected)
    lo, hi = run_plan.SPEED_RANGE
    assert lo <= speed <= hi


def test_the_writing_is_priced_from_its_own_pace_and_kept_where_it_is_cheap():
    """The speed probe multiplies matrices; the writing reads weights a token at a time. Where the model's own pace
    of writing was measured, the plan prices the writing by it alone: on a 2-vCPU AVX2 machine whose probe read
    0.59x while the model wrote at 1.67x, the "3.5 bits" preset's plan keeps the written windows that the probe's
    price gave up."""
    preset = VPTQ.make_config(VPTQ.preset("3.5 bits"))
    text_first = plan_run(VPTQ, SMOLLM2, preset, speed=0.59)
    assert text_first.config.calib_sampled_share == 0.0 and "calibrate" not in text_first.stages
    plan = plan_run(VPTQ, SMOLLM2, preset, speed=0.59, writing_speed=1.67)
    assert plan.writing_speed == 1.67 and plan.to_dict()["writing_speed"] == 1.67
    assert "(speed 0.59x the reference machine, writing 1.67x)" in plan.lines()[0]
    assert plan.config.calib_sampled_share == 0.75 and "calib_sampled_share" not in [d.setting for d in plan.decisions]
    written = sampled_count(plan.samples, plan.config)
    assert plan.stages["calibrate"] == pytest.approx(sampling_seconds(SMOLLM2.pass_params, written, 512) / 1.67)
    # the other stages keep the probe's price
    alone = plan_run(VPTQ, SMOLLM2._replace(samples=plan.samples, plan_windows=plan.plan_windows),
                     dataclasses.replace(plan.config, time_budget=0.0), speed=0.59)
    assert plan.stages["blocks"] == pytest.approx(alone.stages["blocks"])
    assert plan.stages["plan"] == pytest.approx(alone.stages["plan"])
    # a writing slower than its price is priced by its pace too: over 20% of the budget, fewer windows fit
    slow = plan_run(VPTQ, SMOLLM2, dataclasses.replace(PRESET, time_budget=2000.0), speed=1.0, writing_speed=0.2)
    assert 0 < slow.config.calib_sampled_share < 0.75 and slow.stages["calibrate"] <= 0.2 * 2000.0
    # without one, the probe prices it as before
    assert plan_run(VPTQ, SMOLLM2, preset, speed=0.59, writing_speed=None) == text_first


def test_the_writing_pace_is_measured_as_the_run_writes_and_leaves_the_random_streams_alone(tiny_model, monkeypatch):
    import torch

    model = tiny_model[0]
    size = RunSize(((64, 64),) * 4, 100_000, 8, 64)
    config = dataclasses.replace(PRESET, calib_sampled_share=0.5)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    speed = run_plan.measure_writing_speed(model, size, config)
    assert torch.equal(torch.rand(3), expected)
    lo, hi = run_plan.SPEED_RANGE
    assert speed is not None and lo <= speed <= hi
    assert run_plan.measure_writing_speed(model, size, dataclasses.replace(config, calib_sampled_share=0.0)) is None
    # on a clock that moves 10 ms between reads, every token takes 10 ms: the speed is the price of a token of a
    # batch of the 4 written rows (a model priced at 200 M parameters) over 10 ms times the later tokens' growth
    import itertools
    from types import SimpleNamespace

    ticks = itertools.count()
    monkeypatch.setattr(run_plan, "time", SimpleNamespace(perf_counter=lambda: 0.01 * next(ticks)))
    priced = size._replace(other_params=200_000_000)
    price = sampling_seconds(priced.pass_params, 4, 64) / 63
    expected = price / (0.01 * run_plan.PACE_GROWTH)
    assert lo < expected < hi
    assert run_plan.measure_writing_speed(model, priced, config) == pytest.approx(expected)


def test_the_plans_sensitivity_windows_reach_the_measurement(tiny_model, calib_ids):
    from vptq_core.quant.config import VPTQConfig
    from vptq_core.quant.pipeline import quantize_model
    from vptq_core.quant.run_plan import RunPlan

    config = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0, bits_budget=4.0,
                        allocation="sensitivity")
    _, whole = quantize_model(tiny_model[0], calib_ids, "vptq", config)
    assert whole.model_metrics["allocation"]["windows"] == calib_ids.shape[0]
    plan = RunPlan(config, calib_ids.shape[0], 1, {}, 0.0, 1.0, 0.0)
    _, planned = quantize_model(tiny_model[0], calib_ids, "vptq", config, plan=plan)
    assert planned.model_metrics["allocation"]["windows"] == 1


LRQ = methods.get("lrq")
W4A8 = dataclasses.replace(LRQ.make_config(LRQ.preset("w4a8")), time_budget_scale="fixed")


def test_the_block_work_is_priced_from_its_own_pace():
    """The speed probe multiplies matrices; VPTQ's k-means and sweeps and LRQ's training steps run at their own
    pace, which the plan prices them by where it was measured (``block_pace``): the whole of VPTQ's layer work,
    LRQ's training steps alone (its passes over the calibration are block forwards, which the probe prices)."""
    free = dataclasses.replace(PRESET, time_budget=0.0)
    probe_only = plan_run(VPTQ, SMOLLM2, free, speed=0.6)
    paced = plan_run(VPTQ, SMOLLM2, free, speed=0.6, block_speed=1.2)
    own = VPTQ.cost(SMOLLM2, VPTQ.for_model(free, SMOLLM2.linear_shapes))
    assert probe_only.stages["blocks"] - paced.stages["blocks"] == pytest.approx(own / 0.6 - own / 1.2)
    assert {k: v for k, v in paced.stages.items() if k != "blocks"} == pytest.approx(
        {k: v for k, v in probe_only.stages.items() if k != "blocks"})
    assert "(speed 0.60x the reference machine, block work 1.20x)" in paced.lines()[0]
    assert paced.block_speed == 1.2 and paced.to_dict()["block_speed"] == 1.2
    assert plan_run(VPTQ, SMOLLM2, free, speed=0.6, block_speed=None) == probe_only

    lrq_free = dataclasses.replace(W4A8, time_budget=0.0)
    probe_only = plan_run(LRQ, SMOLLM2, lrq_free, speed=0.6)
    paced = plan_run(LRQ, SMOLLM2, lrq_free, speed=0.6, block_speed=0.3)
    steps = cost.FORWARD_S * SMOLLM2.linear_weights * cost.LRQ_STEP * W4A8.iters * W4A8.batch_size * 512
    assert paced.stages["blocks"] - probe_only.stages["blocks"] == pytest.approx(steps / 0.3 - steps / 0.6)


def test_a_slow_block_training_gives_up_training_steps_before_calibration_windows():
    """LRQ's training steps can run at half the probe's pace (a 2-vCPU AVX2 machine): the w4a8 plan then lowers its
    block training steps first, down to half of them, and cuts calibration windows only when that is not enough;
    where the training runs at the probe's pace it keeps every step."""
    plan = plan_run(LRQ, SMOLLM2, W4A8, speed=1.0, writing_speed=1.6, block_speed=1.0)
    assert plan.config.iters == W4A8.iters == 64 and not [d for d in plan.decisions if d.applied]
    slower = [plan_run(LRQ, SMOLLM2, W4A8, speed=1.0, writing_speed=1.6, block_speed=b) for b in (0.45, 0.3, 0.15)]
    for plan in slower:
        applied = [d for d in plan.decisions if d.applied]
        assert applied[0].setting == "iters" and applied[0].before == 64
        assert plan.config.iters == applied[0].after and 32 <= plan.config.iters < 64
        assert applied[0].reason.startswith("the block stage ~")
        if len(applied) > 1:  # windows go only once the steps are down to half
            assert plan.config.iters == 32
    assert [d.setting for d in slower[0].decisions if d.applied] == ["iters"] and slower[0].samples == 32
    assert slower[-1].config.iters == 32 and slower[-1].samples < 32
    # the block stage is priced with the chosen steps at the measured pace
    chosen = slower[1]
    size = SMOLLM2._replace(samples=chosen.samples)
    again = plan_run(LRQ, size, dataclasses.replace(chosen.config, time_budget=0.0), speed=1.0, writing_speed=1.6,
                     block_speed=0.3)
    assert again.stages["blocks"] == pytest.approx(chosen.stages["blocks"])


def test_distillation_gives_up_part_of_its_share_before_the_self_written_windows():
    """Where half the calibration windows with the self-written ones do not fit beside distillation's 40%, the plan
    lowers that share to ``WRITING_DISTILL_SHARE`` and keeps as many windows as then fit, the written ones among them;
    only where even that does not fit are the written windows given up."""
    free = dataclasses.replace(W4A8, time_budget=0.0)
    kept = plan_run(LRQ, SMOLLM2, W4A8, speed=0.58, writing_speed=1.54, block_speed=0.31)
    applied = [d for d in kept.decisions if d.applied]
    assert [d.setting for d in applied] == ["iters", "calib_samples"]
    assert kept.config.calib_sampled_share == W4A8.calib_sampled_share and kept.config.iters == 32
    assert applied[1].reason.endswith("the self-written windows kept, distillation's share of the budget 40% -> 30%")
    size = SMOLLM2._replace(writing_scale=0.58 / 1.54, block_scale=0.58 / 0.31)
    config = dataclasses.replace(free, iters=32)
    half = size._replace(samples=16)
    assert not run_plan._fits(LRQ, half, config, 0.58, 570.0)  # at distillation's full share: no room for them
    # as many windows as fit with the lowered share, at least half of them
    assert 16 <= kept.samples < 32
    assert run_plan._fits(LRQ, size._replace(samples=kept.samples), config, 0.58, 570.0, WRITING_DISTILL_SHARE)
    assert not run_plan._fits(LRQ, size._replace(samples=kept.samples + 1), config, 0.58, 570.0,
                              WRITING_DISTILL_SHARE)
    # the forecast leaves distillation what the other stages leave: about the lowered share
    forecast = kept.decisions[-1]
    assert forecast.setting == "distill_iters" and 0 < forecast.after < W4A8.distill_iters
    assert kept.budget - sum(s for name, s in kept.stages.items() if name != "distill") >= WRITING_DISTILL_SHARE * 570

    # slower still: not even half the windows fit beside the lowered share, and the written windows go
    dropped = plan_run(LRQ, SMOLLM2, W4A8, speed=0.47, writing_speed=1.34, block_speed=0.31)
    assert [d.setting for d in dropped.decisions if d.applied] == ["iters", "calib_sampled_share", "calib_samples"]
    assert dropped.config.calib_sampled_share == 0.0
    slow = SMOLLM2._replace(samples=16, writing_scale=0.47 / 1.34, block_scale=0.47 / 0.31)
    assert not run_plan._fits(LRQ, slow, config, 0.47, 570.0, WRITING_DISTILL_SHARE)

    # no window to give up (the floor already): the lowered share alone is the decision
    few = plan_run(LRQ, SMOLLM2._replace(samples=MIN_SAMPLES), W4A8, speed=0.46, writing_speed=1.5, block_speed=0.23)
    applied = [d for d in few.decisions if d.applied]
    assert [(d.setting, d.before, d.after) for d in applied[1:]] == [("distill_share", DISTILL_SHARE,
                                                                       WRITING_DISTILL_SHARE)]
    assert few.samples == MIN_SAMPLES and few.config.calib_sampled_share == W4A8.calib_sampled_share
    assert applied[1].line().startswith("distill_share: 0.4 -> 0.3 (the self-written windows kept")
