"""The time estimate asks the method: its own whole-run estimate, or the stage costs it and its hooks declare."""

from __future__ import annotations

import math

import pytest

from vptq_core.quant import cost, methods
from vptq_core.quant.bits import scalar_bits
from vptq_core.quant.config import ScalarConfig, VPTQConfig
from vptq_core.quant.methods import Method, ModelHook, PlanHook
from vptq_core.quant.rtn import rtn_layer
from vptq_core.studio.estimate import estimate, method_for, model_info, time_estimate

TINY = "tiny-random-llama"


def _toy(name: str, **fields) -> Method:
    return Method(name=name, label=name, description="a toy", config_class=ScalarConfig,
                  bits=lambda config, out_f, in_f: scalar_bits(out_f, in_f, config.bits, 0),
                  describe=lambda settings: name, quantize_linear=lambda W, H, c, b, cache: rtn_layer(W, H, c, b),
                  **fields)


@pytest.fixture
def registered():
    added = []

    def register(method: Method) -> Method:
        added.append(methods.register(method).name)
        return method

    yield register
    for name in added:
        methods.unregister(name)


def test_a_method_with_its_own_estimate_is_priced_by_it(registered):
    info = model_info(TINY)
    toy = registered(_toy("priced", estimate_seconds=lambda size, config: 42.0 + size.samples))
    assert time_estimate(info, ScalarConfig(), 4, 64, method="priced") == 42.0 + 4
    assert time_estimate(info, ScalarConfig(), 8, 64, method=toy) == 42.0 + 8


def test_a_method_is_priced_by_its_own_block_cost_and_its_hooks(registered):
    info = model_info(TINY)
    config = ScalarConfig()
    plain = registered(_toy("plain"))
    costly = registered(_toy("costly", cost=lambda size, config: 100.0))
    base = time_estimate(info, config, 4, 64, method=plain)
    # without a cost of its own a method rounds every weight once
    assert base - time_estimate(info, config, 4, 64, method=costly) == pytest.approx(
        cost.ROUND_S * info.linear_weights - 100.0)
    planned = registered(_toy("planned", before_blocks=(PlanHook("measure", lambda c: True, None,
                                                                 cost=lambda size, c: 7.0),)))
    assert time_estimate(info, config, 4, 64, method=planned) == pytest.approx(base + 7.0)
    # the after-model hooks get what a time budget leaves of the run, never more
    polish = ModelHook("polish", lambda c: True, None, cost=lambda size, c: 1000.0)
    polished = registered(_toy("polished", after_model=(polish,),
                               config_needs=lambda c: methods.RunNeeds(time_budget=c.time_budget)))
    assert time_estimate(info, config, 4, 64, method=polished) == pytest.approx(base + 1000.0)
    budget = ScalarConfig(time_budget=base + 10.0)
    assert time_estimate(info, budget, 4, 64, method=polished) == pytest.approx(base + 10.0)


def test_rtn_and_gptq_are_each_priced_as_themselves():
    info = model_info(TINY)
    config = ScalarConfig()
    rtn, gptq = time_estimate(info, config, 4, 64, method="rtn"), time_estimate(info, config, 4, 64, method="gptq")
    assert gptq - rtn == pytest.approx((cost.GPTQ_SWEEP_S - cost.ROUND_S) * info.linear_weights)
    # a caller that names no method gets the first registered method taking the config's class
    assert method_for(config).name == "gptq" and time_estimate(info, config, 4, 64) == gptq
    assert method_for(VPTQConfig()).name == "vptq"
    with pytest.raises(ValueError, match="no registered method takes a dict; name the method"):
        method_for({})


def test_the_bits_before_a_run_are_a_plans_bound_when_the_method_plans(registered):
    info = model_info(TINY)
    bound = PlanHook("measure", lambda c: c.bits == 3, None, bits_bound=lambda c: 3.25)
    registered(_toy("bounded", before_blocks=(bound,)))
    planned = estimate(info, "bounded", ScalarConfig(bits=3))
    assert planned.planned and planned.total_bits_per_weight == 3.25
    assert planned.quantized_bytes == math.ceil(3.25 * info.linear_weights / 8)
    exact = estimate(info, "bounded", ScalarConfig(bits=4))
    assert not exact.planned and exact.index_bits_per_weight == 4.0 < exact.total_bits_per_weight


def test_run_size_counts_what_the_cost_models_use():
    size = cost.RunSize(((8, 4), (2, 4)), other_params=10, samples=0, seqlen=16)
    assert size.linear_weights == 40 and size.params == 50 and size.linear_outputs == 10
    assert size.tokens == 16 and size.self_written  # at least one window


def test_whole_model_passes_are_priced_by_what_they_multiply_by_not_an_untied_input_embedding():
    from transformers import LlamaConfig, LlamaForCausalLM

    from vptq_core.quant.blocks import lookup_params, total_linear_shapes
    from vptq_core.quant.calib_windows import sampled_count
    from vptq_core.quant.distill_hook import DISTILL_HOOK, distill_seconds
    from vptq_core.quant.vptq_cost import allocation_seconds

    def model(tied: bool):
        return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))

    tied, untied = model(True), model(False)
    assert lookup_params(tied) == 0 and lookup_params(untied) == 512 * 32
    shapes = tuple(total_linear_shapes(untied))
    other = sum(p.numel() for p in untied.parameters()) - sum(o * i for o, i in shapes)
    size = cost.RunSize(shapes, other, 32, 512, lookup_params=lookup_params(untied))
    assert size.pass_params == size.params - 512 * 32 and size.params == sum(p.numel() for p in untied.parameters())
    assert cost.RunSize(shapes, other, 32, 512).pass_params == size.params  # unknown: every parameter
    preset = methods.get("vptq").make_config(methods.get("vptq").preset("2.5 bits"))
    assert cost.writing_seconds(size, preset) == pytest.approx(
        cost.sampling_seconds(size.pass_params, sampled_count(32, preset), 512))
    assert DISTILL_HOOK.cost(size, preset) == pytest.approx(
        distill_seconds(size.pass_params, preset, 32, 512, size.linear_outputs))
    # the sensitivity measurement's passes too: the untied embedding's share is what the tied-size price adds
    full = size._replace(lookup_params=0)
    assert allocation_seconds(full, preset) > allocation_seconds(size, preset)
    assert cost.stage_seconds(methods.get("vptq"), size, preset)["load"] == pytest.approx(
        cost.stage_seconds(methods.get("vptq"), full, preset)["load"])  # loading reads every parameter


def test_a_bit_plans_block_stage_is_priced_at_the_measured_share_of_the_capped_layout():
    """The sensitivity plan gives many layers smaller codebooks than the capped layout priced per shape; a planned
    run is priced at PLANNED_SHARE of the capped layout for its codebook width, and the whole of it at the measured
    pace of that work (``RunSize.block_scale``). A layer plan already made, and the cap allocation, keep the whole
    price."""
    import dataclasses

    from vptq_core.quant.cost import RunSize
    from vptq_core.quant.vptq_cost import PLANNED_SHARE, vptq_layer_phases, vptq_seconds

    size = RunSize(((576, 576), (192, 576), (1536, 576), (576, 1536)), 0.0, 32, 512)
    planned = methods.get("vptq").make_config(methods.get("vptq").preset("2.5 bits"))
    assert planned.allocation == "sensitivity" and planned.codebook_bits == 8
    assert 0.0 < PLANNED_SHARE[8] < PLANNED_SHARE[16] < 1.0
    whole = sum(vptq_layer_phases(o, i, planned)["whole"] for o, i in size.linear_shapes)
    assert vptq_seconds(size, planned) == pytest.approx(PLANNED_SHARE[8] * whole)
    wide = dataclasses.replace(planned, codebook_bits=16)  # the same layouts priced, at the 16-bit plans' share
    assert vptq_seconds(size, wide) == pytest.approx(PLANNED_SHARE[16] * whole)
    # a device that runs this work at half its price takes twice the seconds
    assert vptq_seconds(size._replace(block_scale=2.0), planned) == pytest.approx(2.0 * PLANNED_SHARE[8] * whole)
    capped = dataclasses.replace(planned, allocation="cap", bits_budget=0.0, layer_bits_cap=2.5)
    assert vptq_seconds(size, capped) == pytest.approx(sum(vptq_layer_phases(o, i, capped)["whole"]
                                                           for o, i in size.linear_shapes))
    made = dataclasses.replace(planned, layer_plan=(("model.layers.0.self_attn.q_proj", 4, 256),))
    assert vptq_seconds(size, made) == pytest.approx(sum(vptq_layer_phases(o, i, made)["whole"]
                                                         for o, i in size.linear_shapes))
    # more k-means iterations cost more, by the priced share of their k-means
    more = dataclasses.replace(planned, kmeans_iters=planned.kmeans_iters + 10)
    extra = sum(vptq_layer_phases(o, i, more)["kmeans"] for o, i in size.linear_shapes) - sum(
        vptq_layer_phases(o, i, planned)["kmeans"] for o, i in size.linear_shapes)
    assert extra > 0.0
    assert vptq_seconds(size, more) - vptq_seconds(size, planned) == pytest.approx(PLANNED_SHARE[8] * extra)
