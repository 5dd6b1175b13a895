"""End-to-end distillation of a quantized model against the original model's next-token distributions
(docs/methods.md#end-to-end-distillation).

After every block is quantized (and maybe fine-tuned layer by layer), the tensors that stay in the packed
format and are cheap to move are trained together: every VPTQ layer's codebooks (main, residual, outlier;
``weight_scale`` / ``weight_bias`` when normalisation is on) or every scalar layer's per-group scales (RTN,
GPTQ, LRQ: as log-scales, codes and zero points fixed, activations fake-quantized as at run time for W4A8 /
W8A8), and every 1-D tensor of the model (the norms inside the blocks, the final norm, linear biases).
Indices, codes, embeddings and the LM head stay fixed. Objective, per predicted token: KL(P_orig || P_quant).

- **Teacher** (``teacher.py``): the reference model runs once per window, before training, and only its top
  ``distill_topk`` log-probabilities (+ the log of the mass of all the others) are kept; the KL is taken over
  those k tokens plus one bucket for the rest.
- **Data** (``distill_data``): the calibration windows, ``distill_samples`` windows the reference writes itself
  (``sampling.sample_windows``, the teacher's top-k taken from the sampling's own logits), or both. The
  held-out windows are always calibration windows.
- **Student** (``student.py``): the quantized model with its quantized linears replaced by
  ``trainable.trainable_linear`` (the weight gathered from the codebooks, or scaled codes, in each forward), the
  decoder blocks under activation checkpointing (``distill_checkpointing``; "auto": the blocks whose saved
  activations pass an activation budget, ``kept_blocks``) and the LM head + loss in checkpointed chunks of
  tokens; bf16 autocast for the training steps where the device multiplies bf16 in hardware (``train_dtype``),
  float32 parameters and Adam state; the input embedding and LM head may stay in their stored dtype
  (``stored_dtype_modules``: computed as float32).
- **Held-out** (``train.train_holdout``): ``distill_holdout`` of the windows are never trained on; the KL on
  them is checked every ``distill_eval_every`` steps (0: every quarter of the steps) and at the end (float32),
  and the best check wins, the starting point included: distillation never leaves the model worse on those
  windows. Under a time budget the steps are planned from the time left (docs/methods.md#time-budget).

The result is written back in place: the states' codebooks or scales (and biases), the fake-quant model's
linear weights (dequantized) and its norm weights, so ``save_quantized(qmodel, ...)`` writes the distilled model.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .blocks import decoder_blocks
from .calib_windows import holdout_count
from .code_update import CodeUpdates
from .config import DistillSettings
from .device import compute_dtype, return_freed_memory
from .repetition import MAX_REPEATED_SHARE
from .sampling import SAMPLE_BATCH, sample_windows, start_tokens
from .states import ScalarLayerState, VQLayerState
from .student import Student, check_head, checkpointed_blocks, kept_blocks, stored_dtype_modules
from .teacher import stack_teacher, teacher_for
from .train import minibatches, train_holdout
from .trainable import (
    CodebookLinear,
    dense_parameters,
    only_trainable,
    released_weights,
    swapped_in,
    trainable_linear,
    write_states,
)

OnStep = Callable[[int, float], None]
WARMUP_FRACTION = 0.05  # of the steps, linear learning-rate warm-up before the cosine decay


def eval_every(config: DistillSettings) -> int:
    """Steps between held-out checks: ``distill_eval_every``, or a quarter of the steps when it is 0."""
    return config.distill_eval_every or max(1, config.distill_iters // 4)


class Drawn(NamedTuple):
    """What ``drawn_windows`` plans."""

    pool: int  # training pool size: calibration windows 0..calib_pool-1, then the sampled windows
    calib_pool: int
    drawn: torch.Tensor  # pool indices the steps draw
    calib_rows: torch.Tensor  # calibration rows that need a teacher pass (drawn + held out)
    sample_rows: torch.Tensor  # sampled rows to draw


def drawn_windows(n: int, config: DistillSettings) -> Drawn:
    """What distillation of ``n`` calibration windows under ``config`` prepares, before any work.

    The training pool is the calibration windows 0..n_train-1 (calibration modes), then ``distill_samples``
    sampled windows (sampled modes). Which pool windows the steps draw depends on the seed alone, so only those
    (and the held-out windows) get a teacher pass or are sampled: 16 steps of a 44-window pool need 16, not 44.
    """
    n_val = holdout_count(n, config.distill_holdout)
    n_train = n - n_val
    val_rows = torch.arange(n_train, n) if n_val else torch.arange(n)
    n_calib_pool = n_train if config.distill_data != "sampled" else 0
    pool = n_calib_pool + (config.distill_samples if config.distill_data != "calibration" else 0)
    seen = torch.zeros(pool, dtype=torch.bool)
    for rows in itertools.islice(minibatches(pool, config.distill_batch, config.seed), config.distill_iters):
        seen[rows] = True
        if bool(seen.all()):  # every pool window drawn: the remaining steps add none
            break
    drawn = seen.nonzero().flatten()
    calib_rows = torch.unique(torch.cat([drawn[drawn < n_calib_pool], val_rows]))
    return Drawn(pool, n_calib_pool, drawn, calib_rows, drawn[drawn >= n_calib_pool] - n_calib_pool)


def lr_groups(trainables: dict[str, nn.Module], lr: float) -> tuple[list[dict], list[float]]:
    """Adam groups of the trainable layers' tensors, and the RMS of each VPTQ codebook tensor.

    The VPTQ codebooks step by ``lr`` times the median RMS of the model's codebook tensors, so ``lr`` is a step
    relative to the model's weight scale, which differs several-fold between models; the scalar layers'
    log-scales are relative already and take ``lr`` as it is.
    """
    vq, plain, rms = [], [], []
    for layer in trainables.values():
        for p in layer.params.values():
            if isinstance(layer, CodebookLinear):
                vq.append(p)
                rms.append(float(p.detach().float().pow(2).mean().sqrt()))
            else:
                plain.append(p)
    groups = []
    if vq:
        groups.append({"params": vq, "lr": lr * max(statistics.median(rms), 1e-8)})
    if plain:
        groups.append({"params": plain, "lr": lr})
    return groups, rms


class _Data(NamedTuple):
    """The windows distillation trains on and checks, prepared before the first step."""

    windows: torch.Tensor  # token ids [rows, seq] on the training device: drawn and held-out windows
    teacher: dict[str, torch.Tensor]  # the teacher's top-k on each row of ``windows``
    heldout: torch.Tensor  # the rows of ``windows`` the checks score
    where: torch.Tensor  # where[i]: the row of ``windows`` holding training-pool window i (-1: never drawn)


def _training_data(reference: nn.Module, windows: torch.Tensor, config: DistillSettings, device: torch.device,
                   should_stop: Callable[[], bool], known: dict[str, torch.Tensor] | None,
                   metrics: dict) -> _Data | None:
    """The windows the steps draw and the held-out ones, with the teacher's top-k on each (None if cancelled).

    Calibration windows need a teacher pass (unless ``known`` has it); sampled windows get theirs from the
    sampling. Held-out: the last calibration windows (all of them when none is held out, then also trained on
    in the calibration modes). Only the windows the steps draw are prepared (``drawn_windows``).
    """
    n = windows.shape[0]
    n_train = n - holdout_count(n, config.distill_holdout)
    val_rows = torch.arange(n_train, n) if n_train < n else torch.arange(n)
    plan = drawn_windows(n, config)
    t0 = time.perf_counter()
    teacher, passes = teacher_for(reference, windows, plan.calib_rows, config.distill_topk, device, should_stop,
                                  known)
    metrics["teacher_seconds"] = time.perf_counter() - t0
    if teacher is None:
        return None
    used = windows[plan.calib_rows].to(device)
    where = torch.full((plan.pool,), -1, dtype=torch.long)
    position = torch.full((n,), -1, dtype=torch.long)
    position[plan.calib_rows] = torch.arange(plan.calib_rows.numel())
    where[: plan.calib_pool] = position[: plan.calib_pool]
    if plan.sample_rows.numel():
        # windows sampled from the original model, each started from a training window's first token (``start_tokens``)
        t0 = time.perf_counter()
        starts = start_tokens(reference, windows[plan.sample_rows % n_train])
        got = sample_windows(reference, starts, windows.shape[1], seed=config.seed, batch=SAMPLE_BATCH,
                             should_stop=should_stop, topk=config.distill_topk, device=device,
                             rows=plan.sample_rows, dtype=config.sample_dtype, max_repeated=MAX_REPEATED_SHARE)
        metrics["sample_seconds"] = time.perf_counter() - t0
        if got is None:
            return None
        sampled, sampled_teacher = got
        where[plan.calib_pool + plan.sample_rows] = torch.arange(used.shape[0], used.shape[0] + sampled.shape[0])
        used = torch.cat([used, sampled.to(device)])
        teacher = stack_teacher([teacher, sampled_teacher], cat=True)
    metrics["sampled_windows"] = int(plan.sample_rows.numel())
    metrics.update(train_windows=plan.pool, drawn_windows=int(plan.drawn.numel()), teacher_windows=passes,
                   known_teacher_windows=int(plan.calib_rows.numel()) - passes)
    return _Data(used, teacher, position[val_rows], where)


def _param_groups(trainables: dict[str, nn.Module], dense: list[nn.Parameter], config: DistillSettings,
                  metrics: dict) -> list[dict]:
    """Adam groups: the layers' codebooks or log-scales (``lr_groups``; none when ``distill_lr`` is 0) and the
    1-D tensors at ``distill_norm_lr``."""
    groups = []
    if config.distill_lr > 0:
        groups, rms = lr_groups(trainables, config.distill_lr)
        if rms:  # min, median, max
            metrics["codebook_rms"] = [min(rms), statistics.median(rms), max(rms)]
    if dense:
        groups.append({"params": dense, "lr": config.distill_norm_lr})
    if not groups:
        raise ValueError("distill_lr and distill_norm_lr are both 0: nothing to train")
    return groups


def _check_inputs(qmodel: nn.Module, reference: nn.Module, states: dict, windows: torch.Tensor) -> None:
    if not states:
        raise ValueError("states must name the quantized linears of qmodel")
    bad = [name for name, st in states.items() if not isinstance(st, (VQLayerState, ScalarLayerState))]
    if bad:
        raise TypeError(f"distill trains VPTQ codebooks or scalar scales; {bad[0]!r} is a "
                        f"{type(states[bad[0]]).__name__}, not a VQLayerState or ScalarLayerState")
    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"windows must be token ids [n, seq >= 2], got shape {tuple(windows.shape)}")
    ref_vocab = reference.get_output_embeddings().out_features
    if ref_vocab != qmodel.get_output_embeddings().out_features:
        raise ValueError(f"reference has a vocabulary of {ref_vocab}, the quantized model "
                         f"{qmodel.get_output_embeddings().out_features}")


def distill(
    qmodel: nn.Module,
    reference: nn.Module,
    states: dict[str, VQLayerState | ScalarLayerState],
    windows: torch.Tensor,
    config: DistillSettings,
    on_step: OnStep | None = None,
    should_stop: Callable[[], bool] | None = None,
    known_teacher: dict[str, torch.Tensor] | None = None,
    deadline: float | None = None,
    on_plan: Callable[[int], None] | None = None,
    release_reference: Callable[[], None] | None = None,
) -> dict:
    """Distil ``qmodel`` (the fake-quantized model ``quantize_model`` returns) towards ``reference``.

    Args:
        qmodel: its linears named in ``states`` hold the dequantized weights; trained on its own device.
        reference: the original model (any dtype/device, e.g. bf16), same vocabulary.
        states: full module name -> ``VQLayerState`` / ``ScalarLayerState`` of ``qmodel``'s quantized linears
            (updated in place).
        windows: token ids [n, seq]; the last ``holdout_count(n, config.distill_holdout)`` are held out.
        config: any method's config (``DistillSettings``): ``distill_iters`` steps of ``distill_batch`` windows,
            ``distill_lr`` (relative: codebooks step by it times the model's median codebook RMS, ``lr_groups``;
            log-scales of scalar layers), ``distill_norm_lr`` (1-D tensors, absolute),
            ``distill_topk``, ``distill_eval_every``,
            ``distill_checkpointing``, ``train_dtype``, ``seed``.
        on_step: called after every step with (step, training KL per token of that step's windows).
        should_stop: polled before every step; when true the run stops there and keeps the best check so far.
        known_teacher: the original model's top-k on some of ``windows``, already computed ({"rows" [m]
            window numbers, "logp" / "index" [m, seq-1, distill_topk], "rest" [m, seq-1]}; e.g. what
            ``sampled_calibration(topk=...)`` kept of the windows the original wrote): those get no teacher pass.
        deadline: a ``time.perf_counter()`` value the steps must end by (the run's ``time_budget``): before each
            step the run plans how many of ``distill_iters`` steps still fit (``train.plan_steps``, from the steps and
            checks so far) and its schedule runs over that many (never more); when none fits it stops like a
            cancel (keeping the best check). No time left at the start: nothing is trained.
        on_plan: hears the new step count each time the deadline changes the plan.
        release_reference: called once ``reference`` is no longer needed (the teacher's top-k and any sampled
            windows made, before the student is built): a caller that holds the original only for this drops it
            there, so the steps run without it in memory (this function keeps no reference to it after).

    Returns metrics: ``steps`` done, ``planned_steps`` (< ``distill_iters`` when the deadline cut them),
    ``cancelled``, ``heldout_windows``, ``kl_before`` / ``kl_after`` (held-out
    bucket KL per token; after <= before), ``best_step`` (0 = nothing kept), ``train_kl_first`` /
    ``train_kl_last``, ``teacher_seconds``, ``seconds``, ``codebook_rms`` (VPTQ: min, median, max).
    """
    t_start = time.perf_counter()
    _check_inputs(qmodel, reference, states, windows)
    should_stop = should_stop or (lambda: False)
    device = next(qmodel.parameters()).device
    n_val = holdout_count(windows.shape[0], config.distill_holdout)
    metrics = {"steps": 0, "cancelled": False, "heldout_windows": n_val, "data": config.distill_data}
    if deadline is not None and time.perf_counter() >= deadline:
        metrics.update(planned_steps=0, out_of_time=True, best_step=0, seconds=time.perf_counter() - t_start)
        return metrics
    # the fake-quant weights of the trained linears are not used until the end, when the states give them again:
    # not held through the teacher pass and the steps
    with released_weights({name: qmodel.get_submodule(name) for name in states}, states):
        data = _training_data(reference, windows, config, device, should_stop, known_teacher, metrics)
        del reference  # every use of the original is behind: the steps use the teacher's top-k
        if release_reference is not None:
            release_reference()
        if data is None:
            metrics.update(cancelled=True, seconds=time.perf_counter() - t_start)
            return metrics
        _train(qmodel, states, data, config, device, metrics, on_step, should_stop, deadline, on_plan)
    metrics["seconds"] = time.perf_counter() - t_start
    return metrics


def _train(qmodel: nn.Module, states: dict, data: _Data, config: DistillSettings, device: torch.device,
           metrics: dict, on_step: OnStep | None, should_stop: Callable[[], bool], deadline: float | None,
           on_plan: Callable[[int], None] | None) -> None:
    """The training of ``distill``: the student's trainable tensors in float32, the held-out loop, the kept
    check written back into ``states`` (``distill`` puts the dequantized states into ``qmodel``'s linears after);
    its figures go into ``metrics``."""
    windows, teacher = data.windows, data.teacher
    tokens = windows.shape[1] - 1  # predicted tokens per window
    linears = {name: qmodel.get_submodule(name) for name in states}
    dense = dense_parameters(qmodel) if config.distill_norm_lr > 0 else []
    dense_dtypes = [p.dtype for p in dense]
    was_training = qmodel.training
    qmodel.eval()
    blocks = len(decoder_blocks(qmodel))
    kept = kept_blocks(config.distill_checkpointing, sum(st.out_features for st in states.values()),
                       windows.shape[1] * config.distill_batch, device, blocks)
    metrics["checkpointing"] = kept < blocks
    metrics["checkpointed_blocks"] = blocks - kept
    codes = (CodeUpdates(config.distill_code_every, config.distill_code_share, config.distill_code_step)
             if config.distill_code_every else None)  # discrete code updates (code_update.py)

    def heldout_kl() -> float:
        with torch.no_grad():
            total = 0.0
            for i in data.heldout.tolist():
                total += float(student.kl_sum(windows[i : i + 1], teacher, torch.tensor([i], device=device)))
        kl = total / (data.heldout.numel() * tokens)
        return_freed_memory()  # the steps' and the check's freed heap, back to the system at every check
        metrics.setdefault("kl_before", kl)  # the first check: the starting point
        if codes is not None:
            codes.checked(kl)
        return kl

    batches = (data.where[rows] for rows in minibatches(data.where.numel(), config.distill_batch, config.seed))

    def step_loss() -> torch.Tensor:
        rows = next(batches)
        if codes is not None:
            codes.before_step()
        return student.kl_sum(windows[rows], teacher, rows) / (rows.numel() * tokens)

    def step_done(step: int, value: float) -> None:
        if not math.isfinite(value):
            raise FloatingPointError(f"distillation loss is {value} at step {step}")
        if codes is not None:
            codes.after_step()
        metrics.setdefault("train_kl_first", value)
        metrics["train_kl_last"] = value
        metrics["steps"] = step
        if on_step is not None:
            on_step(step, value)

    def make(name: str, linear: nn.Module) -> nn.Module:
        if codes is not None:
            return codes.linear(name, states[name], linear.bias, device)
        return trainable_linear(states[name], linear.bias, device)

    try:
        for p in dense:  # train 1-D tensors in float32 (put back in their dtype after)
            p.data = p.data.float()
        with (stored_dtype_modules(qmodel), swapped_in(qmodel, list(states), make) as trainables,
              checkpointed_blocks(qmodel, kept)):
            student = Student(qmodel, kept < blocks)
            check_head(student, qmodel, windows)
            groups = _param_groups(trainables, dense, config, metrics)
            with only_trainable(qmodel, [p for group in groups for p in group["params"]]):
                result = train_holdout(
                    groups, step_loss, heldout_kl, config.distill_iters, eval_every=eval_every(config),
                    warmup_fraction=WARMUP_FRACTION, device=device, dtype=compute_dtype(config.train_dtype, device),
                    should_stop=should_stop, on_step=step_done, deadline=deadline, on_plan=on_plan)
            if codes is not None:
                metrics.update(codes_moved=codes.finish(result.best_index), code_updates=codes.changed)
            write_states(linears, trainables, states)
    finally:
        for p, dt in zip(dense, dense_dtypes, strict=True):
            p.data = p.data.to(dt)
        qmodel.train(was_training)
    metrics["cancelled"] = result.cancelled
    if result.out_of_time:
        metrics["out_of_time"] = True
    metrics.update(planned_steps=result.planned_steps, kl_after=result.best, best_step=result.best_step)


def distill_label(settings) -> str:
    """The run label's distillation part (every method's): `` kd16``, `` kd64-mixed``, or "" when off."""
    if not settings.get("distill_iters"):
        return ""
    data = settings.get("distill_data", "calibration")
    return f" kd{settings['distill_iters']}" + ("" if data == "calibration" else f"-{data}")


# Distillation trains the whole model in memory next to the original (no block streaming): the presets that
# include it keep it for models up to this many parameters and leave it out above (``sized_preset``).
PRESET_DISTILL_MAX_PARAMS = 1_500_000_000


def sized_preset(settings: dict, params: int) -> tuple[dict, str]:
    """A preset's ``settings`` for a model of ``params`` parameters, and a note when something was left out:
    above ``PRESET_DISTILL_MAX_PARAMS`` its distillation steps and its self-written calibration windows (both
    hold the whole model in memory, distillation the original too)."""
    if params <= PRESET_DISTILL_MAX_PARAMS:
        return settings, ""
    parts, kept = [], dict(settings)
    if settings.get("distill_iters"):
        parts.append(f"{settings['distill_iters']} distillation steps")
        kept["distill_iters"] = 0
    if settings.get("calib_sampled_share"):
        parts.append(f"{'its ' if parts else ''}self-written calibration windows "
                     f"({settings['calib_sampled_share']:g} of them)")
        kept["calib_sampled_share"] = 0.0
    if not parts:
        return settings, ""
    note = (f"the preset's {' and '.join(parts)} are left out for a model of {params / 1e9:.1f}B parameters "
            f"(presets do these for models up to {PRESET_DISTILL_MAX_PARAMS / 1e9:g}B: they hold the whole model in "
            "memory); set them to have them anyway")
    return kept, note
