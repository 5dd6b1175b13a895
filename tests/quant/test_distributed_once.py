"""Several ranks with training and measurement (gloo, two processes): the bit plan, the self-written calibration,
fine-tuned blocks, LRQ's trained blocks, activation scales and distilled tensors are computed by rank 0 and sent to
the other ranks, so the ranks end equal even when the other rank's training is perturbed (a global forward hook adds
noise to every output that a gradient flows through), and equal to one process; a stop asked on rank 1 alone, during
fine-tuning or during distillation, stops both ranks there; a failure in rank 0's training raises on both."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
from factories import free_port

from vptq_core.quant import distributed, distributed_once
from vptq_core.quant.config import LRQConfig, VPTQConfig

TRAINED = {**{"vector_len": 4, "num_centroids": 64, "kmeans_iters": 2, "outlier_percent": 0.0},
           "num_res_centroids": 0, "bits_budget": 3.0, "allocation": "sensitivity", "calib_sampled_share": 0.5,
           "finetune_iters": 2, "distill_iters": 2, "distill_samples": 4, "distill_eval_every": 1,
           "distill_batch": 2}
CONFIGS = {
    "vptq": ("vptq", VPTQConfig(**TRAINED)),  # plan, self-written calibration, fine-tuning, distillation
    "lrq": ("lrq", LRQConfig(bits=3, iters=2, act_bits=8, act_granularity="tensor")),  # a block trained whole
}
LONG = 100_000  # steps a stopped run never gets near


def _tensors(obj) -> dict[str, torch.Tensor]:
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return {k: v.clone() for k, v in values.items() if isinstance(v, torch.Tensor)}


def _calib() -> torch.Tensor:
    return torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))


def _run(name: str, config=None, should_stop=None, on_step=None):
    from vptq_core.models import tiny_random_llama
    from vptq_core.quant.pipeline import quantize_model

    method, default = CONFIGS[name]
    model, _ = tiny_random_llama()
    _, result = quantize_model(model, _calib(), method, config or default, device="cpu", should_stop=should_stop,
                               on_step=on_step)
    return result


def _outcome(result) -> dict:
    return {"states": {n: _tensors(s) for n, s in result.states.items()},
            "dense": {n: t.clone() for n, t in result.dense.items()}, "config": result.config,
            "plan": result.config.get("layer_plan"), "cancelled": result.cancelled, "blocks": result.blocks_done,
            "rng": torch.get_rng_state()}


def _noise(module, args, output):
    """Noise on every output a gradient flows through: training and measurement differ, quantization does not."""
    if isinstance(output, torch.Tensor) and output.requires_grad and output.is_floating_point():
        return output + 1e-2 * torch.randn_like(output)
    return None


def _waiting_in(tag: str) -> str | None:
    """The key of the ``once`` call for ``tag`` this rank waits in (None when elsewhere)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is distributed_once.once.__code__ and frame.f_locals.get("tag") == tag:
            return frame.f_locals.get("done")
        frame = frame.f_back
    return None


def _inside(name: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != name:
        frame = frame.f_back
    return frame is not None


def _stop_in(rank: int, tag: str, polls: list[str]):
    """A stop asked on rank 1 alone, while it waits for rank 0's ``tag`` step; ``polls`` counts rank 0's polls
    inside its training (one per step)."""

    def stop() -> bool:
        if rank == 0:
            if _inside("train_holdout"):
                polls.append(tag)
            return False
        return _waiting_in(tag) is not None

    return stop


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    report: dict = {}
    try:
        distributed.init_from_env("cpu")
        handle = None
        if rank == 1:  # rank 1 alone trains and measures differently
            torch.manual_seed(1234)
            handle = torch.nn.modules.module.register_module_forward_hook(_noise)
        for name in CONFIGS:
            report[name] = _outcome(_run(name))
        if rank == 1:  # the noise matters: rank 1 on its own ends elsewhere
            distributed.disable()
            report["alone"] = _outcome(_run("vptq"))
            distributed.enable()
        distributed.barrier()
        if handle is not None:
            handle.remove()

        steps: list[tuple[str, int]] = []

        def on_step(phase, step, _steps, _loss):
            steps.append((phase, step))

        # a stop on rank 1 during fine-tuning (rank 0 trains, rank 1 waits): both stop there
        for tag, changes in (("finetune", {"finetune_iters": LONG, "distill_iters": 0}),
                             ("distill", {"distill_iters": LONG})):
            steps.clear()
            polls: list[str] = []
            config = dataclasses.replace(CONFIGS["vptq"][1], **changes)
            stopped = _run("vptq", config, should_stop=_stop_in(rank, tag, polls), on_step=on_step)
            report[f"stop_{tag}"] = {**_outcome(stopped), "steps": list(steps), "polls": len(polls),
                                     "metrics": stopped.model_metrics.get("distill")}
        # a failure in rank 0's fine-tuning: rank 0 raises it, rank 1 a RuntimeError naming the step
        from vptq_core.quant import finetune

        def broken(*_args, **_kwargs):
            raise ValueError("fine-tuning broke on rank 0")

        finetune.finetune_block_centroids = broken
        try:
            _run("vptq", dataclasses.replace(CONFIGS["vptq"][1], distill_iters=0))
            report["failure"] = "no error"
        except (ValueError, RuntimeError) as exc:
            report["failure"] = f"{type(exc).__name__}: {exc}"
    except BaseException:  # noqa: BLE001 - the parent asserts on it
        report["error"] = traceback.format_exc()
    finally:
        torch.save(report, Path(out) / f"rank{rank}.pt")
        distributed.shutdown()



def _assert_same(a: dict, b: dict, what: str, rng: bool = False) -> None:
    assert a["config"] == b["config"] and a["plan"] == b["plan"], what
    assert list(a["states"]) == list(b["states"]) and a["dense"].keys() == b["dense"].keys(), what
    for layer, tensors in a["states"].items():
        for key, tensor in tensors.items():
            assert torch.equal(tensor, b["states"][layer][key]), (what, layer, key)
    for key, tensor in a["dense"].items():
        assert torch.equal(tensor, b["dense"][key]), (what, key)
    if rng:  # between ranks: the random generator too, as rank 0's computation left it
        assert torch.equal(a["rng"], b["rng"]), what


def test_without_ranks_once_and_the_shared_stop_call_straight_through():
    flag = [False]

    def stop() -> bool:
        return flag[0]

    assert distributed_once.shared_stop(stop) is stop
    assert distributed_once.once("x", lambda: 41 + 1, stop, "cpu", apply=lambda v: flag.__setitem__(0, True)) == 42
    assert not flag[0]  # ``apply`` is for the ranks that did not compute
    value = {"t": torch.arange(3)}
    assert distributed_once.share(value, "cpu") is value


@pytest.mark.slow
def test_two_gloo_ranks_take_rank_0s_training_and_stop_together(tmp_path: Path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread counts change float rounding: one thread, like each rank
    try:
        single = {name: _outcome(_run(name)) for name in CONFIGS}
    finally:
        torch.set_num_threads(threads)

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, str(tmp_path)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)  # a hang guard only: a stop that did not reach rank 0 would train for LONG steps
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for report in ranks:
        assert "error" not in report, report.get("error")

    # (a) + (c): rank 1's perturbed training never reaches a result: both ranks end with the one-process tensors
    for name in CONFIGS:
        for r, report in enumerate(ranks):
            _assert_same(report[name], single[name], f"{name} rank {r}")
        _assert_same(ranks[0][name], ranks[1][name], f"{name} ranks", rng=True)
    assert len({(v, k) for _, v, k in single["vptq"]["plan"]}) > 1  # a real plan, measured
    alone = ranks[1]["alone"]  # the perturbation alone changes the plan's measurement and the trained tensors
    assert any(not torch.equal(t, single["vptq"]["dense"][k]) for k, t in alone["dense"].items())

    # (b) a stop on rank 1 alone: both ranks cancelled at the same point with the same tensors; rank 0 polled
    # (one poll per step) far fewer times than the steps it was asked for
    for phase in ("stop_finetune", "stop_distill"):
        a, b = (report[phase] for report in ranks)
        assert a["cancelled"] and b["cancelled"], phase
        assert a["blocks"] == b["blocks"], phase
        _assert_same(a, b, phase)
        assert 1 <= a["polls"] < LONG and b["polls"] == 0, phase  # rank 0 trains, rank 1 waits
    assert ranks[0]["stop_finetune"]["blocks"] == 0  # block 0's fine-tuning stopped
    # during distillation: every block done, distillation stopped early on rank 0, its metrics on both ranks
    a, b = ranks[0]["stop_distill"], ranks[1]["stop_distill"]
    assert a["blocks"] == 2 and a["metrics"] == b["metrics"]
    assert a["metrics"]["cancelled"] and a["metrics"]["steps"] < LONG  # stopped at its first poll or soon after
    distill = [step for phase, step in a["steps"] if phase == "distill"]
    assert max(distill, default=0) == a["metrics"]["steps"] and not b["steps"]
    # a failure while rank 0 computes for all: every rank raises instead of waiting
    assert ranks[0]["failure"] == "ValueError: fine-tuning broke on rank 0"
    assert ranks[1]["failure"] == ("RuntimeError: rank 0 failed during finetune (ValueError); its output says why")
