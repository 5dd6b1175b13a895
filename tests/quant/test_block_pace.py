"""The method's own block work timed on block 0 before a run (``quant.block_pace``): what it measures, against which
price, and that it leaves the model and the run's random streams as they were."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from vptq_core.models import open_streaming, tiny_random_model
from vptq_core.quant import block_pace, lrq, methods, vptq
from vptq_core.quant.blocks import decoder_blocks, total_linear_shapes
from vptq_core.quant.config import LRQConfig, VPTQConfig
from vptq_core.quant.cost import FORWARD_S, LRQ_STEP, RunSize
from vptq_core.quant.vptq_cost import vptq_layer_phases

TINY_VQ = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0)
TINY_LRQ = LRQConfig(bits=4, group_size=32, iters=4, batch_size=1)


def _size(model, seqlen: int = 32) -> RunSize:
    shapes = tuple(total_linear_shapes(model))
    return RunSize(shapes, 0, 4, seqlen)


def _fake_clock(monkeypatch, module, step: float = 0.01) -> None:
    """``module``'s clock moves ``step`` seconds between reads."""
    ticks = itertools.count()
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: step * next(ticks)))


@pytest.mark.parametrize("name, config", [("lrq", TINY_LRQ), ("vptq", TINY_VQ)])
def test_the_pace_is_measured_on_a_copy_and_leaves_the_random_streams_alone(tiny_model, name, config):
    model = tiny_model[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    speed = block_pace.measure_block_speed(model, methods.get(name), _size(model), config)
    assert torch.equal(torch.rand(3), expected)
    lo, hi = block_pace.SPEED_RANGE
    assert speed is not None and lo <= speed <= hi
    after = model.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())


def test_a_method_without_a_pace_is_priced_by_the_speed_probe(tiny_model):
    from vptq_core.quant.config import ScalarConfig

    model = tiny_model[0]
    assert methods.get("rtn").pace is None
    assert block_pace.measure_block_speed(model, methods.get("rtn"), _size(model), ScalarConfig(bits=4)) is None


def test_lrq_times_its_training_steps_against_their_price(tiny_model, monkeypatch):
    """On a clock that moves 10 us between reads every training step takes 10 us (the steps are timed between the
    polls the training makes before each): the speed is one step's price (``cost.lrq_seconds``' step part: the
    block's weights x LRQ_STEP x the step's tokens) over 10 us."""
    model = tiny_model[0]
    _fake_clock(monkeypatch, lrq, step=1e-5)
    speed = block_pace.measure_block_speed(model, methods.get("lrq"), _size(model, seqlen=32), TINY_LRQ)
    block = decoder_blocks(model)[0]
    weights = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    expected = FORWARD_S * weights * LRQ_STEP * 32 / 1e-5
    lo, hi = block_pace.SPEED_RANGE
    assert lo < expected < hi
    assert speed == pytest.approx(expected)


def test_vptq_times_block_0s_linears_until_enough_seconds_against_their_price(tiny_model, monkeypatch):
    """10 ms per linear on the fake clock: with 25 ms asked for, the first three linears are timed, and the speed
    is their price with the run's settings (``vptq_layer_phases``) over 30 ms."""
    model = tiny_model[0]
    _fake_clock(monkeypatch, vptq)
    monkeypatch.setattr(vptq, "PACE_SECONDS", 0.025)
    speed = block_pace.measure_block_speed(model, methods.get("vptq"), _size(model), TINY_VQ)
    block = decoder_blocks(model)[0]
    shapes = [tuple(m.weight.shape) for m in block.modules() if isinstance(m, torch.nn.Linear)][:3]
    priced = sum(vptq_layer_phases(o, i, TINY_VQ)["whole"] for o, i in shapes)
    lo, hi = block_pace.SPEED_RANGE
    assert lo < priced / 0.03 < hi
    assert speed == pytest.approx(priced / 0.03)


def test_a_streamed_model_is_timed_on_its_weights_and_keeps_its_blocks_on_disk(tmp_path, monkeypatch):
    """A streamed model's block 0 is read from disk into the probe's copy; the model's own block stays on the meta
    device. On the fake clock the probe times the same steps as on the whole model, and their losses are those of
    the same weights."""
    model, tok = tiny_random_model("llama", num_layers=2)
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    source = open_streaming(str(tmp_path))
    assert all(p.is_meta for p in decoder_blocks(source.model)[0].parameters())
    whole = block_pace.build_probe(model, 16, torch.device("cpu"))
    streamed = block_pace.build_probe(source.model, 16, torch.device("cpu"), source.weights)
    assert all(p.is_meta for p in decoder_blocks(source.model)[0].parameters())
    torch.testing.assert_close(streamed.targets, whole.targets)
    for name in whole.hessians:
        torch.testing.assert_close(streamed.hessians[name], whole.hessians[name])
    _fake_clock(monkeypatch, lrq, step=1e-5)
    size = _size(model, seqlen=16)
    speed = block_pace.measure_block_speed(model, methods.get("lrq"), size, TINY_LRQ)
    lo, hi = block_pace.SPEED_RANGE
    assert lo < speed < hi
    assert block_pace.measure_block_speed(source.model, methods.get("lrq"), size, TINY_LRQ,
                                          weights=source.weights) == pytest.approx(speed)


def test_the_pace_prices_the_run_config_as_the_run_resolves_it(tiny_model, monkeypatch):
    """A bits budget is resolved for the model before the probe (``Method.for_model``), as the run resolves it."""
    model = tiny_model[0]
    seen = []
    method = dataclasses.replace(methods.get("vptq"), pace=lambda probe, config: (seen.append(config), (1.0, 2.0))[1])
    budgeted = dataclasses.replace(TINY_VQ, bits_budget=2.5, allocation="cap")
    assert method.for_model(budgeted, _size(model).linear_shapes) != budgeted  # resolving changes it
    assert block_pace.measure_block_speed(model, method, _size(model), budgeted) == pytest.approx(2.0)
    assert seen == [method.for_model(budgeted, _size(model).linear_shapes)]
