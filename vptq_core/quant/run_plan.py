"""A time budget as a plan for the whole run, made before it starts (docs/methods.md#time-budget).

``plan_run`` prices every stage of a run for this model on this device (``cost.stage_seconds`` on the reference
machine, divided by the device's ``speed``) and, when the config carries a ``time_budget``, chooses what fits it.
Distillation buys the most quality per second, so the plan keeps for it the seconds of its ``distill_iters`` steps,
at most ``DISTILL_SHARE`` of the budget, and makes room for them by giving up, in this order, only as much as it
must: windows of the plan's sensitivity measurement (down to 1), the training steps of the method's block work
(``Method.block_steps``, down to ``MIN_BLOCK_STEPS`` of them), calibration windows down to half of them when that
keeps the self-written ones (with distillation's share lowered to ``WRITING_DISTILL_SHARE`` if it must), else the
self-written ones, and then calibration windows down to ``MIN_SAMPLES``.
Self-written windows whose writing is over its share of the budget (``sampling.SAMPLING_BUDGET_SHARE``) are cut to
that share first, as the run itself would. What still does not fit shortens distillation, which the run itself
fits to what is left (``distill.plan_steps``). Each choice comes with its reason (``Decision``), which the command
line prints, the app's job view shows and the report keeps (``plan``).

``measure_speed`` and ``measure_writing_speed`` are the impure parts: a short matrix-multiply probe on the run's device
against the same probe on the reference machine, and, for the self-written calibration, a few tokens written by the
model itself against their price (``cost.sampling_seconds``); the method's own block work is timed the same way on
block 0 (``block_pace.measure_block_speed``). The writing is priced from its own pace because it
is the stage the probe tells least about: one token at a time for a few rows, it is bound by reading the weights,
not by multiplying them, and on a 2-vCPU AVX2 machine it ran at 1.8x the reference while the probe read 0.47x
(docs/methods.md#time-budget).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .calib_windows import distill_settings, sampled_count
from .config import BUDGET_REF_PARAMS, BUDGET_SCALE_MAX
from .cost import RunSize, sampling_seconds, share_that_fits, stage_seconds
from .methods import Method
from .sampling import MIN_WRITTEN_SHARE, SAMPLE_BATCH, SAMPLING_BUDGET_SHARE, sample_windows

# What the plan keeps for distillation: the seconds of all its steps, but at most this share of the budget.
DISTILL_SHARE = 0.4
# ... and the share it goes down to before it gives up the self-written calibration: with half the calibration
# windows written by the model, 20 distillation steps gave the W4A8 preset a lower KL (summed over both dev texts:
# -4%, 2 seeds) and the same perplexity as all 18 windows from the text with 26 steps, in 7-9% less time
# (bench/results/presets_cli_amd.txt "wh").
WRITING_DISTILL_SHARE = 0.3
# Calibration windows the plan never goes below: fewer leave the Hessians of wide layers badly conditioned.
MIN_SAMPLES = 8
# The share of the method's block training steps (``Method.block_steps``) the plan may step down to.
MIN_BLOCK_STEPS = 0.5
# The sensitivity measurement's windows the plan may step down to (the measurement's own default first).
PLAN_WINDOWS = (4, 2, 1)
# The probe: the median of PROBE_REPEATS timings (a machine shared with other work is slow on average, not at its
# best moment) of PROBE_ITERS float32 products [PROBE_ROWS, PROBE_DIM] x
# [PROBE_DIM, PROBE_DIM]. PROBE_REF_S is the probe time at which the stage constants hold: fitted to whole
# ``--preset 2.5`` runs on an idle machine, whose stage seconds they then match in sum
# (bench/results/run_plan_fit_spr.txt). A wide-vector CPU multiplies float32 matrices much faster than it runs the
# stages (sampling, k-means, sweeps, training steps), so the probe's time there is below this reference's.
# 25 timings (about 0.1 s idle), not 5: a Gemma-3-270M run on an idle machine read 0.30x with 5, where probes of the
# same machine just after read 0.72-1.06x; a slow tenth of a second no longer decides the median. A slow second
# still can: on an idle 2-vCPU AMD EPYC (Zen 4) whose readings had a median of 0.78x one read 0.41x at a run's start,
# and its plan cut the calibration to 17 windows where the run then had time to spare (bench/results/
# presets_cli_zen4.txt cw_s1). So a budgeted run reads the probe again after the writing and block paces (seconds
# later) and keeps the faster reading (``api.plan_stage``; bench/probe_steadiness.py: the faster of two readings).
PROBE_ROWS, PROBE_DIM, PROBE_ITERS, PROBE_REPEATS = 256, 1024, 2, 25
PROBE_REF_S = 0.0046
SPEED_RANGE = (0.05, 100.0)
# The writing's pace: PACE_TOKENS tokens written by the model for as many rows as its first pass writes, the first
# PACE_WARMUP of them (the packing of the weights, the first forward) left out, the median of the rest. They are the
# first tokens of a window, and a token costs more the further along its window it is (attention reads every
# earlier position): over a whole window of 511 a token cost 1.18-1.29x the first 64 on average, in four writings of
# Gemma-3-270M (bench/results/sampling_projection_spr.txt, "seconds per token by chunks": the mean over the first
# chunk that has no warm-up in it).
PACE_TOKENS, PACE_WARMUP = 12, 2
PACE_GROWTH = 1.25


@dataclass(frozen=True)
class Decision:
    """One choice of the plan: ``setting`` went from ``before`` to ``after`` (both as the report shows them) for
    ``reason``. ``applied`` False: a forecast the run carries out itself (distillation's steps)."""

    setting: str
    before: Any
    after: Any
    reason: str
    applied: bool = True

    def line(self) -> str:
        if not self.applied:  # a forecast: the stage measures its own pace and fits itself to the time left
            return (f"{self.setting}: {self.before}, about {self.after} expected to fit (a forecast, not a setting: "
                    f"the stage fits itself to the time left when it runs; {self.reason})")
        return f"{self.setting}: {self.before} -> {self.after} ({self.reason})"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunPlan:
    """What ``plan_run`` chose: the method ``config`` and calibration ``samples`` to run with, the windows of the
    plan hooks' measurement (``plan_windows``, 0 = their default), the seconds per stage on this device in run
    order (``stages``), and the decisions with their reasons."""

    config: Any
    samples: int
    plan_windows: int
    stages: dict[str, float]
    budget: float
    speed: float
    requested_seconds: float  # the run as asked for, on this device, distillation's steps all counted
    decisions: tuple[Decision, ...] = field(default_factory=tuple)
    writing_speed: float | None = None  # the self-written calibration's own measured speed (None: priced by ``speed``)
    block_speed: float | None = None  # the method's own block work's measured speed (None: priced by ``speed``)

    @property
    def seconds(self) -> float:
        return sum(self.stages.values())

    def lines(self) -> list[str]:
        """What the command line prints before the run: the estimate, then one line per decision."""
        head = f"estimated {self.seconds:.0f} s on this device (speed {self.speed:.2f}x the reference machine"
        if self.writing_speed:
            head += f", writing {self.writing_speed:.2f}x"
        if self.block_speed:
            head += f", block work {self.block_speed:.2f}x"
        head += ")"
        if self.budget > 0:
            head += f", time budget {self.budget:.0f} s"
        return [head, *(d.line() for d in self.decisions)]

    def to_dict(self) -> dict:
        """The report's ``plan`` section."""
        writing = round(self.writing_speed, 3) if self.writing_speed else None
        block = round(self.block_speed, 3) if self.block_speed else None
        return {"budget_seconds": self.budget, "speed": round(self.speed, 3), "writing_speed": writing,
                "block_speed": block,
                "requested_seconds": round(self.requested_seconds, 1), "estimated_seconds": round(self.seconds, 1),
                "stages": {name: round(s, 1) for name, s in self.stages.items()}, "samples": self.samples,
                "plan_windows": self.plan_windows, "decisions": [d.to_dict() for d in self.decisions]}


def plan_run(method: Method, size: RunSize, config, speed: float = 1.0, writing_speed: float | None = None,
             block_speed: float | None = None) -> RunPlan:
    """The plan for a run of ``method`` / ``config`` on a model and calibration described by ``size`` on a device
    ``speed`` times as fast as the reference machine (see the module's docstring); ``writing_speed``: the
    self-written calibration's own (``measure_writing_speed``; None: ``speed`` prices it too); ``block_speed``:
    the method's own block work's (``block_pace.measure_block_speed``; None: ``speed`` prices it too). Pure: no
    clock, no model."""
    speed = float(speed) if speed and speed > 0 else 1.0
    writing_speed = float(writing_speed) if writing_speed and writing_speed > 0 else None
    block_speed = float(block_speed) if block_speed and block_speed > 0 else None
    if writing_speed is not None:
        size = size._replace(writing_scale=speed / writing_speed)
    if block_speed is not None:
        size = size._replace(block_scale=speed / block_speed)
    paces = {"writing_speed": writing_speed, "block_speed": block_speed}
    config, scaled = scaled_budget(config, size.params)
    budget = float(method.needs(config).time_budget)
    free = _without_budget(config)
    requested = _seconds(method, size, free, speed)
    if budget <= 0:
        return RunPlan(config, size.samples, size.plan_windows, _device_stages(method, size, config, speed), budget,
                       speed, sum(requested.values()), **paces)
    decisions: list[Decision] = [scaled] if scaled is not None else []
    if _writing_over(method, size, free, speed, budget):  # cut to its share whatever else fits, as the run would
        size, free, decision = _cut_self_written(method, size, free, speed, budget)
        decisions.append(decision)
    share = DISTILL_SHARE
    for cut in (_cut_plan_windows, _cut_block_steps, _cut_samples_for_writing, _keep_writing, _cut_self_written,
                _cut_samples):
        if _fits(method, size, free, speed, budget, share):
            continue
        size, free, decision = cut(method, size, free, speed, budget)
        if decision is not None:
            decisions.append(decision)
            if cut is _keep_writing:
                share = WRITING_DISTILL_SHARE
    for name in ("calib_sampled_share", method.block_steps):  # the settings a cut may have changed
        if name and hasattr(config, name):
            config = dataclasses.replace(config, **{name: getattr(free, name)})
    stages = _device_stages(method, size, config, speed)
    decisions += _distill_forecast(method, size, free, speed, budget)
    return RunPlan(config, size.samples, size.plan_windows, stages, budget, speed, sum(requested.values()),
                   tuple(decisions), **paces)


def scaled_budget(config, params: int) -> tuple[Any, Decision | None]:
    """``config`` with its ``time_budget`` for a model of ``params`` parameters and ``time_budget_scale`` "fixed",
    and the decision (None: the budget stays as given, ``config`` itself). "model": the budget as given for up to
    ``BUDGET_REF_PARAMS`` parameters, times sqrt(params / BUDGET_REF_PARAMS) for more, at most ``BUDGET_SCALE_MAX``
    times."""
    if getattr(config, "time_budget_scale", "fixed") != "model" or config.time_budget <= 0:
        return config, None
    budget = float(config.time_budget)
    factor = min(max(math.sqrt(max(params, 1) / BUDGET_REF_PARAMS), 1.0), BUDGET_SCALE_MAX)
    if factor == 1.0:  # the budget as given
        return config, None
    config = dataclasses.replace(config, time_budget=budget * factor, time_budget_scale="fixed")
    reason = (f"a {params / 1e9:.2f}B-parameter model: the budget of a {BUDGET_REF_PARAMS / 1e6:.0f}M one times "
              f"{factor:.2f}")
    return config, Decision("time_budget", budget, round(config.time_budget, 1), reason)


def _without_budget(config):
    """``config`` with its time budget off: the stages' full seconds, distillation's steps all counted."""
    return dataclasses.replace(config, time_budget=0.0) if hasattr(config, "time_budget") else config


def _seconds(method: Method, size: RunSize, config, speed: float) -> dict[str, float]:
    return {name: s / speed for name, s in stage_seconds(method, size, config).items()}


def _device_stages(method: Method, size: RunSize, config, speed: float) -> dict[str, float]:
    """The stages' seconds on this device under the config's own time budget (seconds on this device: the cost
    models compare it with their reference-machine seconds, so it is scaled to those)."""
    if getattr(config, "time_budget", 0.0):
        config = dataclasses.replace(config, time_budget=config.time_budget * speed)
    return _seconds(method, size, config, speed)


def _rest_and_distill(method, size, config, speed) -> tuple[float, float]:
    stages = _seconds(method, size, config, speed)
    distill = stages.pop("distill", 0.0)
    return sum(stages.values()), distill


def _fits(method, size, config, speed, budget, share: float = DISTILL_SHARE) -> bool:
    rest, distill = _rest_and_distill(method, size, config, speed)
    return rest + min(distill, share * budget) <= budget


def _over_text(method, size, config, speed, budget, share: float = DISTILL_SHARE) -> str:
    rest, distill = _rest_and_distill(method, size, config, speed)
    keep = min(distill, share * budget)
    if keep > 0:
        return f"the run before distillation ~{rest:.0f} s, distillation's share ~{keep:.0f} s, budget {budget:.0f} s"
    return f"the run ~{rest:.0f} s, budget {budget:.0f} s"


def _writing_over(method, size, config, speed, budget) -> bool:
    """Writing the self-written windows would take more than the run lets it (``SAMPLING_BUDGET_SHARE``)."""
    return _seconds(method, size, config, speed).get("calibrate", 0.0) > SAMPLING_BUDGET_SHARE * budget


def _cut_self_written(method, size, config, speed, budget):
    """Fewer self-written windows when writing them all would take more than ``SAMPLING_BUDGET_SHARE`` of the
    budget (as many as fit, ``cost.share_that_fits``, as the run decides) and the run fits with them; else none."""
    share = getattr(config, "calib_sampled_share", 0.0)
    if not share:
        return size, config, None
    writing = _seconds(method, size, config, speed).get("calibrate", 0.0)
    over = _writing_over(method, size, config, speed, budget)
    head = f"writing them ~{writing:.0f} s, over {SAMPLING_BUDGET_SHARE:.0%} of the {budget:.0f} s budget: "
    fewer = share_that_fits(size, method.for_model(config, size.linear_shapes), SAMPLING_BUDGET_SHARE * budget,
                            speed) if over else 0.0
    changed = dataclasses.replace(config, calib_sampled_share=fewer)
    if fewer and _fits(method, size, changed, speed, budget):
        samples = max(size.samples, 1)
        why = f"{head}the {sampled_count(samples, changed)} of {sampled_count(samples, config)} that fit"
        return size, changed, Decision("calib_sampled_share", share, round(fewer, 4), why)
    if over and not fewer:
        why = f"{head}fewer than {MIN_WRITTEN_SHARE:.0%} of them fit, the run would leave them text"
    else:
        why = f"writing them ~{writing:.0f} s; {_over_text(method, size, config, speed, budget)}"
    return size, dataclasses.replace(config, calib_sampled_share=0.0), Decision("calib_sampled_share", share, 0.0,
                                                                                why)


def _cut_plan_windows(method, size, config, speed, budget):
    plan = _seconds(method, size, config, speed).get("plan", 0.0)
    if not plan:
        return size, config, None
    before = min(size.plan_windows or getattr(config, "sensitivity_windows", PLAN_WINDOWS[0]), max(size.samples, 1))
    why = _over_text(method, size, config, speed, budget)
    chosen = size
    for windows in [w for w in PLAN_WINDOWS if w < before]:
        chosen = size._replace(plan_windows=windows)
        if _fits(method, chosen, config, speed, budget):
            break
    if chosen is size:
        return size, config, None
    after = _seconds(method, chosen, config, speed).get("plan", 0.0)
    return chosen, config, Decision("sensitivity_windows", before, chosen.plan_windows,
                                    f"measuring ~{plan:.0f} s -> ~{after:.0f} s; {why}")


def _cut_block_steps(method, size, config, speed, budget):
    """Fewer training steps in the method's block work (``Method.block_steps``), down to ``MIN_BLOCK_STEPS`` of
    them: as many as fit."""
    name = method.block_steps
    before = int(getattr(config, name, 0) or 0) if name else 0
    floor = max(1, math.ceil(MIN_BLOCK_STEPS * before))
    if before <= floor:
        return size, config, None
    why = _over_text(method, size, config, speed, budget)
    chosen = config
    for steps in range(before - 1, floor - 1, -1):
        chosen = dataclasses.replace(config, **{name: steps})
        if _fits(method, size, chosen, speed, budget):
            break
    blocks = _seconds(method, size, config, speed)["blocks"]
    after = _seconds(method, size, chosen, speed)["blocks"]
    return size, chosen, Decision(name, before, getattr(chosen, name),
                                  f"the block stage ~{blocks:.0f} s -> ~{after:.0f} s; {why}")


def _cut_samples_for_writing(method, size, config, speed, budget):
    """Fewer calibration windows, down to half of them, when the run then fits with its self-written windows (priced
    at what they then cost: fewer windows, never more than their share of the budget, which ``plan_run`` saw to
    first); else nothing: the written windows go first (``_cut_self_written``)."""
    if not getattr(config, "calib_sampled_share", 0.0):
        return size, config, None
    cut_size, _, decision = _cut_samples(method, size, config, speed, budget,
                                         floor=max(MIN_SAMPLES, math.ceil(size.samples / 2)))
    if decision is None or not _fits(method, cut_size, config, speed, budget):
        return size, config, None
    return cut_size, config, decision


def _keep_writing(method, size, config, speed, budget):
    """Distillation's share of the budget lowered to ``WRITING_DISTILL_SHARE`` and as many calibration windows as
    then fit, at least half of them, the self-written ones kept, when the run fits so; else nothing
    (``_cut_self_written`` goes on). The caller plans with the lowered share from then on."""
    if not getattr(config, "calib_sampled_share", 0.0):
        return size, config, None
    half = size._replace(samples=max(MIN_SAMPLES, math.ceil(size.samples / 2)))
    if not _fits(method, half, config, speed, budget, WRITING_DISTILL_SHARE):
        return size, config, None
    cut_size, _, decision = _cut_samples(method, size, config, speed, budget, floor=half.samples,
                                         share=WRITING_DISTILL_SHARE)
    kept = (f"the self-written windows kept, distillation's share of the budget {DISTILL_SHARE:.0%} -> "
            f"{WRITING_DISTILL_SHARE:.0%}")
    if decision is None:  # no window to give up: the lowered share alone makes it fit
        return size, config, Decision("distill_share", DISTILL_SHARE, WRITING_DISTILL_SHARE,
                                      f"{kept}; {_over_text(method, size, config, speed, budget)}")
    return cut_size, config, dataclasses.replace(decision, reason=f"{decision.reason}; {kept}")


def _cut_samples(method, size, config, speed, budget, floor: int = MIN_SAMPLES, share: float = DISTILL_SHARE):
    before = int(size.samples)
    if before <= floor:
        return size, config, None
    why = _over_text(method, size, config, speed, budget, share)
    chosen = size
    for samples in range(before - 1, floor - 1, -1):
        chosen = size._replace(samples=samples)
        if _fits(method, chosen, config, speed, budget, share):
            break
    blocks = _seconds(method, size, config, speed)["blocks"]
    after = _seconds(method, chosen, config, speed)["blocks"]
    return chosen, config, Decision("calib_samples", before, chosen.samples,
                                    f"the block stage ~{blocks:.0f} s -> ~{after:.0f} s; {why}")


def _distill_forecast(method, size, config, speed, budget) -> list[Decision]:
    """How many of distillation's steps the plan expects to fit (the run fits them itself, to what is left)."""
    steps = int(getattr(config, "distill_iters", 0) or 0)
    rest, full = _rest_and_distill(method, size, config, speed)
    if not steps or not full or rest + full <= budget:
        return []
    left = max(budget - rest, 0.0)
    one = _rest_and_distill(method, size, dataclasses.replace(config, distill_iters=1), speed)[1]
    per_step = (full - one) / (steps - 1) if steps > 1 else full
    fit = 0 if left < one else min(steps, 1 + math.floor((left - one) / max(per_step, 1e-9)))
    why = (f"distillation ~{full:.0f} s for {steps} steps; the budget leaves it ~{left:.0f} s after ~{rest:.0f} s "
           "before it" if left > 0 else f"the run before distillation ~{rest:.0f} s is over the {budget:.0f} s "
           "budget already")
    return [Decision("distill_iters", steps, fit, why, applied=False)]


def measure_speed(device: torch.device | str = "cpu") -> float:
    """How many times faster than the reference machine ``device`` multiplies float32 matrices now (the probe of
    the module's docstring: the median of a few timings), within ``SPEED_RANGE``."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)  # the run's own random streams stay untouched
    a = torch.rand(PROBE_ROWS, PROBE_DIM, generator=gen).to(device)
    b = (torch.rand(PROBE_DIM, PROBE_DIM, generator=gen) / PROBE_DIM).to(device)
    times = []
    for repeat in range(PROBE_REPEATS + 1):  # the first one warms up
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(PROBE_ITERS):
            a = (a @ b).clamp_(-1.0, 1.0)
        _sync(device)
        if repeat:
            times.append(time.perf_counter() - t0)
    typical = sorted(times)[len(times) // 2]
    lo, hi = SPEED_RANGE
    return min(max(PROBE_REF_S / max(typical, 1e-9), lo), hi)


def measure_writing_speed(model: torch.nn.Module, size: RunSize, config) -> float | None:
    """How many times faster than its price (``cost.sampling_seconds``) ``model`` writes the self-written calibration
    of a run of ``size`` / ``config`` on the CPU now, as the run writes it (``sampling.sample_windows``: the config's
    sample dtype, the rows of its first pass at once), within ``SPEED_RANGE``; None when the run writes none. From
    the pace of ``PACE_TOKENS`` tokens (see there); the run's own random streams stay untouched (each row draws from
    its own generator)."""
    windows = sampled_count(max(int(size.samples), 1), config)
    if not windows:
        return None
    rows = min(windows, SAMPLE_BATCH)
    start = getattr(getattr(model, "config", None), "bos_token_id", None)
    starts = torch.full((rows, 1), start if isinstance(start, int) else 0, dtype=torch.long)
    polls: list[float] = []

    def poll() -> bool:  # before every token
        polls.append(time.perf_counter())
        return False

    sample_windows(model, starts, PACE_TOKENS + 1, batch=SAMPLE_BATCH, should_stop=poll, device=torch.device("cpu"),
                   dtype=distill_settings(config).sample_dtype)
    polls.append(time.perf_counter())
    gaps = sorted(b - a for a, b in zip(polls[PACE_WARMUP:], polls[PACE_WARMUP + 1:]))
    per_token = gaps[len(gaps) // 2] * PACE_GROWTH
    price = sampling_seconds(size.pass_params, rows, size.seqlen) / max(int(size.seqlen) - 1, 1)
    lo, hi = SPEED_RANGE
    return min(max(price / max(per_token, 1e-9), lo), hi)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
