"""The hold-out training loop shared by layer-wise fine-tuning (``finetune.py``), end-to-end distillation
(``distill.py``) and LRQ's block training (``lrq.py``).

Adam steps on a loss, the learning rate of each parameter group scaled by a schedule (by default a linear
warm-up, then a cosine from 1 to 0); a held-out check before the first step and every ``eval_every`` steps
decides which parameters are kept: the best check's (the starting values included), restored at the end. A
deadline turns the step count into a plan that follows the time left (docs/methods.md#time-budget).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

LrFactor = Callable[[int, int, int], float]  # (step, planned steps, warm-up steps) -> learning-rate factor
Better = Callable[[float, float], bool]  # (new check, best so far) -> keep the new parameters


def cosine_factor(step: int, total: int, warmup: int = 0) -> float:
    """Learning-rate factor at ``step`` (0-based) of ``total``: linear warm-up, then cosine from 1 to 0."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, span) / span))


def constant_factor(step: int, total: int, warmup: int = 0) -> float:
    """Learning-rate factor 1 at every step (for comparisons with a schedule)."""
    return 1.0


def improves(new: float, best: float) -> bool:
    """A check is kept when it is strictly lower than the best so far (ties keep the earlier parameters)."""
    return new < best


def no_worse(new: float, best: float) -> bool:
    """A check is kept unless it is higher than the best so far (ties keep the later parameters)."""
    return not new > best


def minibatches(n: int, batch: int, seed: int = 0, device=None,
                generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Endless minibatches of window indices 0..n-1: every window once per epoch, reshuffled each epoch (the
    last partial batch of an epoch left out). Drawn from ``generator``, or from a fresh one seeded by ``seed``."""
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    batch = min(batch, n)
    while True:
        order = torch.randperm(n, generator=gen)
        for i in range(0, n - batch + 1, batch):
            yield order[i : i + batch].to(device)


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on ``device`` for training steps (float32: nothing)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class Snapshot:
    """Copies of tensors, to restore the best parameters seen."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.values = [t.detach().clone() for t in self.tensors]

    def restore(self) -> None:
        with torch.no_grad():
            for t, v in zip(self.tensors, self.values, strict=True):
                t.copy_(v)


def plan_steps(seconds_left: float, step_times: list[float], check_s: float, every: int) -> int:
    """How many more training steps fit ``seconds_left``: each costs the typical step so far (the median of the
    steps after the first, which pays one-time costs; the first alone when it is the only one) plus its share of
    the held-out checks (one every ``every`` steps, ``check_s`` each), and one last check is kept for the end."""
    typical = statistics.median(step_times[1:] or step_times)
    per_step = typical + check_s / max(every, 1)
    return max(0, int((seconds_left - check_s) // per_step)) if per_step > 0 else 0


@dataclass
class TrainResult:
    """What ``train_holdout`` did. ``checks``: (step, value) of every held-out check, the start (step 0) first;
    ``best_index``: the check whose parameters were kept (0: the starting values)."""

    checks: list[tuple[int, float]]
    best_index: int = 0
    steps: int = 0  # steps run
    planned_steps: int = 0  # the schedule's length at the end (fewer than asked when a deadline cut it)
    cancelled: bool = False  # should_stop turned true
    out_of_time: bool = False  # the deadline ended the steps
    step_losses: list[float] = field(default_factory=list)

    @property
    def before(self) -> float:
        return self.checks[0][1]

    @property
    def best(self) -> float:
        return self.checks[self.best_index][1]

    @property
    def best_step(self) -> int:
        return self.checks[self.best_index][0]


class _Plan:
    """The planned step count and its warm-up; with a deadline, re-planned before every step from the steps and
    checks so far (``plan_steps``): it follows what fits both ways, never past the steps asked for."""

    def __init__(self, steps: int, warmup_fraction: float, deadline: float | None, every: int,
                 on_plan: Callable[[int], None] | None) -> None:
        self.asked, self.fraction, self.every = steps, warmup_fraction, every
        self.deadline, self.on_plan = deadline, on_plan
        self.total, self.warmup = steps, int(steps * warmup_fraction)
        self.step_times: list[float] = []
        self.check_s = 0.0

    def fits(self, step: int) -> bool:
        """Before ``step``: re-plan; False when no step fits any more (the plan then ends at ``step``)."""
        if self.deadline is None:
            return True
        now = time.perf_counter()
        # the first step runs while any time is left; the later ones are planned from the steps so far
        left = (plan_steps(self.deadline - now, self.step_times, self.check_s, self.every) if self.step_times
                else int(now < self.deadline))
        fit = min(self.asked, step + left)
        if self.step_times and left > 0 and fit != self.total:
            self.total, self.warmup = fit, int(fit * self.fraction)
            if self.on_plan is not None:
                self.on_plan(self.total)
        if left <= 0:
            self.total = step
            return False
        return True


def train_holdout(
    groups: list[dict],
    step_loss: Callable[[], torch.Tensor],
    check: Callable[[], float],
    steps: int,
    *,
    eval_every: int,
    lr_factor: LrFactor | None = None,
    warmup_fraction: float = 0.0,
    better: Better = improves,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    should_stop: Callable[[], bool] | None = None,
    stop_restores_start: bool = False,
    on_step: Callable[[int, float], None] | None = None,
    deadline: float | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train the parameters of ``groups`` (Adam parameter groups, each ``{"params": [...], "lr": base lr}``) for
    ``steps`` Adam steps on ``step_loss()``, keeping the parameters of the best held-out ``check()``.

    Per step: ``should_stop`` is polled, the deadline re-plans, every group's lr is set to its base lr x
    ``lr_factor(step, planned steps, warm-up steps)`` (default ``cosine_factor``; warm-up: ``warmup_fraction``
    of the planned steps), ``step_loss()`` runs under ``dtype`` autocast on ``device`` (it draws its own batch),
    and ``on_step(step number, loss)`` hears the loss. ``check()`` runs before the first step, after every
    ``eval_every``-th step and after the planned last one; a check replaces the best when ``better(value,
    best)``. When ``should_stop`` or the deadline ends the steps, the steps since the last check are checked
    too, unless ``stop_restores_start``: then a stop puts the starting values back (the caller cancels). On an
    exception the starting values are put back.

    Returns a ``TrainResult``; the parameters hold the kept check's values.
    """
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    if dtype != torch.float32 and device is None:
        raise ValueError(f"autocast to {dtype} needs the device the steps run on")
    lr_factor = lr_factor or cosine_factor
    params = [p for group in groups for p in group["params"]]
    base_lrs = [group["lr"] for group in groups]
    optimizer = torch.optim.Adam(groups)
    plan = _Plan(steps, warmup_fraction, deadline, eval_every, on_plan)
    start = best = Snapshot(params)
    result = TrainResult(checks=[])

    def run_check() -> None:
        nonlocal best
        t0 = time.perf_counter()
        value = check()
        plan.check_s = time.perf_counter() - t0
        result.checks.append((result.steps, value))
        if len(result.checks) > 1 and better(value, result.best):
            result.best_index = len(result.checks) - 1
            best = Snapshot(params)

    try:
        with torch.enable_grad():
            run_check()
            for step in range(steps):
                if should_stop is not None and should_stop():
                    result.cancelled = True
                    break
                if not plan.fits(step):
                    result.out_of_time = True
                    break
                t_step = time.perf_counter()
                for group, lr in zip(optimizer.param_groups, base_lrs, strict=True):
                    group["lr"] = lr * lr_factor(step, plan.total, plan.warmup)
                with autocast(device, dtype):
                    loss = step_loss()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                value = float(loss.detach())
                result.steps = step + 1
                result.step_losses.append(value)
                plan.step_times.append(time.perf_counter() - t_step)
                if on_step is not None:
                    on_step(step + 1, value)
                if (step + 1) % eval_every == 0 or step + 1 == plan.total:
                    run_check()
            result.planned_steps = plan.total
            stopped = result.cancelled or result.out_of_time
            if stopped and stop_restores_start:
                start.restore()
                return result
            if stopped and result.checks[-1][0] < result.steps:
                run_check()  # the steps since the last check may still be the best
    except BaseException:
        start.restore()
        raise
    best.restore()
    return result
