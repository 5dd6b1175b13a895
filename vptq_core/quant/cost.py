"""What a run costs, known before it starts: seconds on the reference machine (a 2-core CPU, idle).

A run's seconds are the sum of its stages' (``run_seconds``): starting, loading and saving; the block forwards
every method runs (half a pass more with FP-chain targets); the method's own block work (``Method.cost``); its
plan hooks' (``PlanHook.cost``); the calibration windows the original writes itself; and its after-model
hooks' (``ModelHook.cost``), capped by what a time budget leaves of the run. A method may replace the whole
sum with its own ``Method.estimate_seconds``. The constants are fitted to measured runs (bench/quant_cost.py,
bench/results/, docs/results.md); layer-wise fine-tuning is not priced.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from .methods import Method

# Block forwards, per linear weight per calibration token, both passes (Hessians and targets, then the quantized
# outputs): fitted to SmolLM2-135M's 106 M linear weights over 32 windows of 512 tokens.
_REF_TOKENS = 32 * 512
FORWARD_S = 69.0 / 106.2e6 / _REF_TOKENS
IO_S = 9.0 / 135e6  # loading and saving, per parameter
START_S = 5.0  # starting a job whatever its size (imports, tokenizer, calibration text)
FP_CHAIN_FORWARDS = 1.5  # FP-chain targets: the original blocks run on the original chain's inputs too
GPTQ_SWEEP_S = 0.3e-6  # per weight, a column sweep with one rounding per weight (rough)
ROUND_S = 0.02e-6  # per weight, rounding to a grid
# LRQ's training in block forwards: per training token, and passes over the calibration whatever the steps. With
# the run's threads (2 on the reference machine), fitted to whole runs of `--preset w4a8 --set iters=32` on
# SmolLM2-135M (idle, 2 threads, speed probe 0.92: block stage 225 s; bench/results/presets_cli_dev_spr.txt
# w4a8t32): what the block stage took beyond the block forwards' forecast, split between the two in the ratio
# bench/lrq_threads.py measured on one block (0.94 : 1.02).
LRQ_STEP = 0.72
LRQ_FIXED = 0.78
# Whole-model passes per model parameter a pass multiplies by (``RunSize.pass_params``: the head included, an untied
# input embedding not) per token of a window, fitted to SmolLM2-135M (134.5 M parameters, its head tied to its
# embedding; 511 predicted tokens per window): a distillation training step (forward,
# recomputation, backward), a held-out check, the teacher's pass, and writing windows (one token at a time,
# up to sampling.SAMPLE_BATCH windows at once: a cost per batched pass and one per window).
KD_TOKENS = 134.5e6 * 511
KD_STEP_S = 3.0 / KD_TOKENS
KD_NO_CHECKPOINT = 0.76  # a step without activation checkpointing, against one with it
KD_CHECK_S = 1.5 / KD_TOKENS
KD_TEACHER_S = 1.1 / KD_TOKENS
KD_SAMPLE_S = 1.5 / KD_TOKENS  # per window written; a batched pass costs sampling.PASS_WINDOWS windows' worth besides


class RunSize(NamedTuple):
    """What the estimate knows of a run before it starts: the model's block-linear shapes and its other
    parameters, the calibration windows and their length. ``self_written``: the windows the original would
    write itself are kept (False once they are priced out, as over their share of a time budget).
    ``plan_windows``: the windows a plan hook measures on (0: its own setting, e.g. ``sensitivity_windows``).
    ``lookup_params``: parameters a pass only looks rows up in, never multiplies by (an input embedding that is not
    also the LM head: ``blocks.lookup_params``); 0 for a tied head, whose weights the head multiplies by.
    ``writing_scale``: the writing's reference seconds (``sampling_seconds``) times this, where the model's own pace
    of writing on the device was measured (``run_plan.measure_writing_speed``: the device's speed over its writing
    speed), so that dividing by the device's speed gives the writing's measured seconds. ``block_scale``: the part
    of the method's own block work that its ``Method.pace`` times (``block_pace.measure_block_speed``) priced times
    this, the same way (``Method.cost`` applies it)."""

    linear_shapes: tuple[tuple[int, int], ...]
    other_params: int
    samples: int
    seqlen: int
    self_written: bool = True
    plan_windows: int = 0
    lookup_params: int = 0
    writing_scale: float = 1.0
    block_scale: float = 1.0

    @property
    def linear_weights(self) -> int:
        return sum(o * i for o, i in self.linear_shapes)

    @property
    def params(self) -> int:
        return self.linear_weights + self.other_params

    @property
    def pass_params(self) -> int:
        """The parameters a whole-model pass multiplies by (what its seconds scale with): all but ``lookup_params``."""
        return max(self.params - max(int(self.lookup_params), 0), self.linear_weights)

    @property
    def tokens(self) -> int:
        return max(int(self.samples), 1) * max(int(self.seqlen), 1)

    @property
    def linear_outputs(self) -> int:
        """The quantized linears' out_features, summed."""
        return sum(o for o, _ in self.linear_shapes)


def estimate_seconds(method: Method, size: RunSize, config) -> float:
    """Rough seconds of a run of ``method`` / ``config``: the method's own estimate, else ``run_seconds``."""
    if method.estimate_seconds is not None:
        return float(method.estimate_seconds(size, config))
    return run_seconds(method, size, config)


def run_seconds(method: Method, size: RunSize, config) -> float:
    """The stages' seconds, summed (``stage_seconds``, see the module's docstring)."""
    return sum(stage_seconds(method, size, config).values())


def stage_seconds(method: Method, size: RunSize, config) -> dict[str, float]:
    """Seconds per stage of a run, in run order: "load" (starting, loading), "calibrate" (the windows the original
    writes itself), "plan" (the plan hooks), "blocks" (the block forwards and the method's own block work),
    "distill" (the after-model hooks) and "save". A time budget caps the after-model hooks at what the rest leaves
    of it, never the block stage, and writes only the self-written windows that fit in
    ``sampling.SAMPLING_BUDGET_SHARE`` of it (``share_that_fits``; none when fewer than half of them fit), as the
    run does. Stages a run does not go through are left out."""
    from .sampling import SAMPLING_BUDGET_SHARE

    config = method.for_model(config, size.linear_shapes)
    needs = method.needs(config)
    forwards = FP_CHAIN_FORWARDS if needs.fp_chain else 1.0
    stages = {"load": START_S + IO_S * size.params / 2}
    writing = writing_seconds(size, config) if needs.sampled_share and size.self_written else 0.0
    budget = needs.time_budget
    if budget > 0 and writing > SAMPLING_BUDGET_SHARE * budget:
        config = dataclasses.replace(config, calib_sampled_share=share_that_fits(size, config,
                                                                                 SAMPLING_BUDGET_SHARE * budget))
        writing = writing_seconds(size, config)
        if not writing:
            size = size._replace(self_written=False)
    if writing:
        stages["calibrate"] = writing
    hooks = [hook.cost(size, config) for hook in method.before_blocks if hook.cost and hook.phase in needs.plan]
    if hooks:
        stages["plan"] = sum(hooks)
    stages["blocks"] = forwards * FORWARD_S * size.linear_weights * size.tokens + (method.cost or rounding_seconds)(
        size, config)
    after = [hook.cost(size, config) for hook in method.after_model if hook.cost and hook.phase in needs.after_model]
    save = IO_S * size.params / 2
    if after:
        left = max(0.0, budget - sum(stages.values()) - save)
        stages["distill"] = min(sum(after), left) if budget > 0 else sum(after)
    stages["save"] = save
    return stages


def rounding_seconds(size: RunSize, _config: Any) -> float:
    """A method's block work when it rounds every weight once (RTN; the default of ``Method.cost``)."""
    return ROUND_S * size.linear_weights


def sweep_seconds(size: RunSize, _config: Any) -> float:
    """GPTQ's block work: a column sweep with error feedback over every weight."""
    return GPTQ_SWEEP_S * size.linear_weights


def lrq_seconds(size: RunSize, config) -> float:
    """LRQ's block work: ``iters`` training steps of ``batch_size`` windows per block, ``LRQ_STEP`` block
    forwards per training token (times ``size.block_scale``: the steps are what ``lrq`` times before a run), plus
    ``LRQ_FIXED`` passes over the calibration (no-grad block forwards, which the device's speed prices)."""
    steps = config.iters * config.batch_size * max(int(size.seqlen), 1)
    return FORWARD_S * size.linear_weights * (LRQ_STEP * steps * size.block_scale + LRQ_FIXED * size.tokens)


def writing_seconds(size: RunSize, config) -> float:
    """The calibration windows of the block stage the original writes itself (``calib_windows.sampled_count``)."""
    from .calib_windows import sampled_count

    windows = sampled_count(max(int(size.samples), 1), config)
    return sampling_seconds(size.pass_params, windows, size.seqlen) * size.writing_scale


def share_that_fits(size: RunSize, config, seconds: float, speed: float = 1.0) -> float:
    """The ``calib_sampled_share`` under which writing the block stage's self-written windows (``writing_seconds``)
    takes at most ``seconds`` on a device ``speed`` times as fast as the reference: the config's own when they all
    fit, else that of as many of them as fit (``sampling.windows_that_fit``, as the run decides), 0 when fewer than
    ``sampling.MIN_WRITTEN_SHARE`` of them do."""
    from .calib_windows import distill_settings, sampled_count
    from .sampling import windows_that_fit

    samples = max(int(size.samples), 1)
    planned = sampled_count(samples, config)
    fit = windows_that_fit(planned, lambda n: sampling_seconds(size.pass_params, n, size.seqlen) * size.writing_scale
                           / speed, seconds)
    return distill_settings(config).calib_sampled_share if fit == planned else fit / samples


def sampling_seconds(params: int, windows: int, seqlen: int) -> float:
    """Rough seconds for the original model of ``params`` parameters to write ``windows`` windows of ``seqlen``
    tokens (``sampling.sample_windows``, up to ``SAMPLE_BATCH`` at once: ``sampling.window_equivalents``)."""
    from .sampling import window_equivalents

    return params * max(int(seqlen) - 1, 1) * KD_SAMPLE_S * window_equivalents(windows)
