"""The hold-out training loop shared by fine-tuning, distillation and LRQ (``quant/train.py``), on a toy problem
whose checks are scripted: which parameters are kept, the learning rates each step uses, stops and deadlines."""

import math
import time

import pytest
import torch

from vptq_core.quant import train as train_mod
from vptq_core.quant.train import (
    constant_factor,
    cosine_factor,
    improves,
    minibatches,
    no_worse,
    plan_steps,
    train_holdout,
)

START = 1.0


class Toy:
    """One parameter pulled towards 3 by Adam; ``check`` returns the next scripted value and records the
    parameter it scored; ``step_loss`` records the learning rate of each step."""

    def __init__(self, checks: list[float], lr: float = 0.1) -> None:
        self.w = torch.nn.Parameter(torch.tensor([START]))
        self.groups = [{"params": [self.w], "lr": lr}]
        self.scripted = list(checks)
        self.scored: list[torch.Tensor] = []
        self.lrs: list[float] = []

    def check(self) -> float:
        self.scored.append(self.w.detach().clone())
        return self.scripted.pop(0)

    def step_loss(self) -> torch.Tensor:
        self.lrs.append(self.groups[0]["lr"])
        return ((self.w - 3.0) ** 2).sum()


def test_plan_steps_fits_the_steps_and_checks_into_the_time_left():
    # typical step = median of the steps after the first (10 s), checks of 4 s every 2 steps, one kept for the end
    assert plan_steps(100.0, [30.0, 10.0, 11.0, 9.0], 4.0, 2) == 8  # (100 - 4) // (10 + 2)
    assert plan_steps(100.0, [30.0], 4.0, 2) == 3  # only the first step known: (100 - 4) // 32
    assert plan_steps(3.0, [1.0, 1.0], 4.0, 2) == 0
    assert plan_steps(-5.0, [1.0], 0.0, 1) == 0


def test_cosine_schedule_and_minibatches():
    assert cosine_factor(0, 10) == 1.0 and cosine_factor(10, 10) == 0.0 and 0.4 < cosine_factor(5, 10) < 0.6
    assert cosine_factor(0, 10, warmup=2) < cosine_factor(1, 10, warmup=2) < cosine_factor(2, 10, warmup=2) == 1.0
    gen = minibatches(5, 2, seed=0)
    epoch = torch.cat([next(gen), next(gen)])
    assert len(set(epoch.tolist())) == 4  # without replacement within an epoch


def test_minibatches_from_a_given_generator_draw_one_permutation_per_epoch():
    got = minibatches(5, 2, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(7)
    first, second = torch.randperm(5, generator=gen), torch.randperm(5, generator=gen)
    want = [first[0:2], first[2:4], second[0:2], second[2:4]]  # the last partial batch of an epoch left out
    assert all(torch.equal(next(got), w) for w in want)
    assert torch.equal(next(minibatches(3, 8, seed=1)), torch.randperm(3, generator=torch.Generator().manual_seed(1)))


def test_the_best_check_is_restored_when_later_checks_are_worse():
    toy = Toy([1.0, 0.5, 0.7, 0.9])
    result = train_holdout(toy.groups, toy.step_loss, toy.check, 6, eval_every=2)
    assert result.checks == [(0, 1.0), (2, 0.5), (4, 0.7), (6, 0.9)]
    assert (result.best_index, result.best_step, result.best, result.before) == (1, 2, 0.5, 1.0)
    assert (result.steps, result.planned_steps, result.cancelled, result.out_of_time) == (6, 6, False, False)
    assert torch.equal(toy.w.detach(), toy.scored[1]) and not torch.equal(toy.scored[1], toy.scored[3])
    assert len(result.step_losses) == 6 and result.step_losses[0] == 4.0  # (1 - 3)^2 before the first update


def test_the_start_is_kept_when_no_check_beats_it():
    toy = Toy([1.0, 2.0, 1.0])
    result = train_holdout(toy.groups, toy.step_loss, toy.check, 4, eval_every=2)
    assert result.best_index == 0 and result.best_step == 0 and result.best == 1.0
    assert torch.equal(toy.w.detach(), torch.tensor([START]))


def test_ties_keep_the_earlier_parameters_unless_asked_otherwise():
    assert not improves(1.0, 1.0) and improves(0.9, 1.0) and not improves(1.1, 1.0)
    assert no_worse(1.0, 1.0) and no_worse(0.9, 1.0) and not no_worse(1.1, 1.0)
    strict, later = Toy([1.0, 1.0]), Toy([1.0, 1.0])
    assert train_holdout(strict.groups, strict.step_loss, strict.check, 2, eval_every=2).best_index == 0
    assert torch.equal(strict.w.detach(), torch.tensor([START]))
    assert train_holdout(later.groups, later.step_loss, later.check, 2, eval_every=2, better=no_worse).best_index == 1
    assert torch.equal(later.w.detach(), later.scored[1]) and not torch.equal(later.w.detach(), torch.tensor([START]))


def test_learning_rates_follow_the_warmup_and_cosine_schedule():
    toy = Toy([1.0] * 3, lr=0.3)
    train_holdout(toy.groups, toy.step_loss, toy.check, 8, eval_every=4, warmup_fraction=0.25)  # 2 warm-up steps
    cosine = [0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(6)]
    assert toy.lrs == pytest.approx([0.3 * f for f in [1 / 3, 2 / 3, *cosine]], rel=1e-12)
    assert toy.lrs[2] == 0.3
    flat = Toy([1.0] * 2, lr=0.3)
    train_holdout(flat.groups, flat.step_loss, flat.check, 5, eval_every=5, lr_factor=constant_factor)
    assert flat.lrs == [0.3] * 5


def test_should_stop_stops_between_steps_and_checks_the_steps_since_the_last_check():
    toy = Toy([1.0, 0.5])
    polls = []
    result = train_holdout(toy.groups, toy.step_loss, toy.check, 10, eval_every=5,
                           should_stop=lambda: polls.append(1) or len(polls) > 3)
    assert len(polls) == 4 and len(toy.lrs) == 3 and result.steps == 3 and result.cancelled
    assert result.checks == [(0, 1.0), (3, 0.5)] and result.best_step == 3 and result.planned_steps == 10
    assert torch.equal(toy.w.detach(), toy.scored[1])


def test_a_stop_can_restore_the_start_instead():
    toy = Toy([1.0])
    polls = []
    result = train_holdout(toy.groups, toy.step_loss, toy.check, 10, eval_every=5, stop_restores_start=True,
                           should_stop=lambda: polls.append(1) or len(polls) > 2)
    assert result.cancelled and result.steps == 2 and result.checks == [(0, 1.0)]
    assert torch.equal(toy.w.detach(), torch.tensor([START]))


def test_an_error_in_a_step_restores_the_start():
    toy = Toy([1.0])

    def failing() -> torch.Tensor:
        if len(toy.lrs) == 2:
            raise FloatingPointError("step 3")
        return toy.step_loss()

    with pytest.raises(FloatingPointError, match="step 3"):
        train_holdout(toy.groups, failing, toy.check, 5, eval_every=5)
    assert torch.equal(toy.w.detach(), torch.tensor([START]))


def test_a_deadline_plans_the_steps_and_stretches_the_schedule(monkeypatch):
    """Before the first step any time left runs it; then the plan follows plan_steps (here: scripted by how many
    steps ran), the schedule runs over the plan, and the run ends where the plan does."""
    left = {1: 3, 2: 2, 3: 1}  # steps ran -> steps that still fit
    monkeypatch.setattr(train_mod, "plan_steps", lambda _seconds, times, _check_s, _every: left.get(len(times), 0))
    toy = Toy([1.0] * 4, lr=1.0)
    plans = []
    result = train_holdout(toy.groups, toy.step_loss, toy.check, 10, eval_every=3,
                           deadline=time.perf_counter() + 3600, on_plan=plans.append)
    assert plans == [4] and (result.steps, result.planned_steps, result.out_of_time) == (4, 4, True)
    # step 0 under the asked-for 10 steps, steps 1-3 under the plan of 4; checks after step 3 and the planned last
    assert toy.lrs == [cosine_factor(0, 10)] + [cosine_factor(s, 4) for s in (1, 2, 3)]
    assert toy.lrs[3] == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 4)), rel=1e-12)
    assert [step for step, _ in result.checks] == [0, 3, 4]
    # no time left at all: nothing runs, nothing changes
    late = Toy([1.0])
    result = train_holdout(late.groups, late.step_loss, late.check, 10, eval_every=3,
                           deadline=time.perf_counter() - 1.0)
    assert (result.steps, result.planned_steps, result.out_of_time, result.checks) == (0, 0, True, [(0, 1.0)])
    assert torch.equal(late.w.detach(), torch.tensor([START]))


def test_on_step_hears_every_step_loss():
    toy = Toy([1.0, 1.0])
    heard = []
    result = train_holdout(toy.groups, toy.step_loss, toy.check, 3, eval_every=3,
                           on_step=lambda step, loss: heard.append((step, loss)))
    assert heard == list(enumerate(result.step_losses, start=1)) and heard[0] == (1, 4.0)


def test_bad_arguments_are_refused():
    toy = Toy([1.0])
    with pytest.raises(ValueError, match="eval_every must be >= 1, got 0"):
        train_holdout(toy.groups, toy.step_loss, toy.check, 3, eval_every=0)
    with pytest.raises(ValueError, match="autocast to torch.bfloat16 needs the device"):
        train_holdout(toy.groups, toy.step_loss, toy.check, 3, eval_every=1, dtype=torch.bfloat16)
