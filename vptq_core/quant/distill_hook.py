"""End-to-end distillation as a step of a run (docs/methods.md#end-to-end-distillation): when it applies, what the
distillation settings every built-in config shares ask of the run, and what the step costs before it runs.

The training itself (quant/distill.py) is imported when the step runs or is priced, so a method module that
offers it stays light to import.
"""

from __future__ import annotations

import math

import torch

from .config import DistillSettings
from .cost import KD_CHECK_S, KD_NO_CHECKPOINT, KD_STEP_S, KD_TEACHER_S, RunSize, sampling_seconds
from .methods import ModelContext, ModelHook, RunNeeds


def settings_needs(config: DistillSettings, target_chain: str = "quantized") -> RunNeeds:
    """What a config's ``DistillSettings`` ask of the run: the self-written calibration share, the time budget,
    and the teacher's top-k the sampling keeps for distillation on the calibration windows."""
    keeps_teacher = config.distill_iters > 0 and config.distill_data != "sampled"
    return RunNeeds(sampled_share=config.calib_sampled_share, time_budget=config.time_budget,
                    target_chain=target_chain, teacher_topk=config.distill_topk if keeps_teacher else 0)


def _applies(config: DistillSettings) -> bool:
    return config.distill_iters > 0


def _run(ctx: ModelContext) -> dict | None:
    from .distill import distill

    plan = [ctx.config.distill_iters]  # the progress shows the planned total (a time budget may shrink it)
    return distill(ctx.model, ctx.reference, ctx.states, ctx.calib_ids, ctx.config,
                   on_step=lambda step, kl: ctx.on_step("distill", step, plan[0], kl), should_stop=ctx.should_stop,
                   known_teacher=ctx.teacher, deadline=ctx.deadline, on_plan=lambda n: plan.__setitem__(0, n),
                   release_reference=ctx.release_reference)


def distill_seconds(params: int, config: DistillSettings, samples: int, seqlen: int,
                    linear_outputs: int | None = None, self_written: bool = True) -> float:
    """Rough seconds of a config's end-to-end distillation (0 when off) for a model whose passes multiply by ``params``
    parameters (``RunSize.pass_params``) calibrated on ``samples`` windows of ``seqlen`` tokens (and the held-out
    windows drawn on top, ``with_heldout``): the teacher's pass over the windows it uses (not the self-written
    calibration windows, whose top-k comes from the sampling, unless ``self_written`` is False), the sampled
    windows, the training steps and the held-out checks. ``linear_outputs`` (the quantized linears' out_features,
    summed) resolves "auto" checkpointing as the run will (``student.use_checkpointing``); without it the steps are
    priced as checkpointed ones."""
    steps = config.distill_iters
    if not steps:
        return 0.0
    from .calib_windows import holdout_count, with_heldout, written_rows
    from .distill import drawn_windows, eval_every
    from .student import use_checkpointing

    samples = with_heldout(max(int(samples), 1), config)  # the held-out windows come on top of the calibration
    per_window = params * max(int(seqlen) - 1, 1)
    n_val = holdout_count(samples, config.distill_holdout) or samples
    # exactly the windows distillation prepares: the teacher pass and the sampling run only for drawn windows
    drawn = drawn_windows(samples, config)
    teacher, sampled = drawn.calib_rows.numel(), drawn.sample_rows.numel()
    if self_written and config.distill_data != "sampled":
        teacher -= int(torch.isin(drawn.calib_rows, written_rows(samples, config)).sum())
    checks = 1 + math.ceil(steps / eval_every(config))
    batch = config.distill_batch
    step_s = KD_STEP_S
    if linear_outputs and not use_checkpointing(config.distill_checkpointing, linear_outputs, int(seqlen) * batch,
                                                torch.device("cpu")):
        step_s *= KD_NO_CHECKPOINT
    return sampling_seconds(params, sampled, seqlen) + per_window * (
        KD_TEACHER_S * teacher + step_s * steps * batch + KD_CHECK_S * checks * n_val)


def _cost(size: RunSize, config: DistillSettings) -> float:
    return distill_seconds(size.pass_params, config, size.samples, size.seqlen, size.linear_outputs or None,
                           size.self_written)


# Every built-in method's after-model step (its config's ``distill_iters`` > 0).
DISTILL_HOOK = ModelHook("distill", _applies, _run, cost=_cost)
