import dataclasses

import pytest
import torch

from vptq_core.quant import methods
from vptq_core.quant.allocate import budget_for_model, candidate_caps, cap_for_budget, model_bits
from vptq_core.quant.blocks import total_linear_shapes
from vptq_core.quant.config import VPTQConfig
from vptq_core.quant.pipeline import quantize_model
from vptq_core.quant.vptq import config_bits, layer_config

BASE = VPTQConfig(vector_len=4, num_centroids=256, kmeans_iters=2, outlier_percent=0.0)  # 2 index bits


def test_layer_cap_steps_down_the_vector_length_at_the_same_index_bits():
    # SmolLM2 shapes at v6 k4096: k/v (192x576) pay 5.80 total bits, q/o 3.27, gate/up 2.48, down 2.50
    cfg = VPTQConfig(vector_len=6, num_centroids=4096, layer_bits_cap=2.5)
    picks = {shape: layer_config(cfg, *shape) for shape in [(192, 576), (576, 576), (1536, 576), (576, 1536)]}
    assert {s: (c.vector_len, c.num_centroids) for s, c in picks.items()} == {
        (192, 576): (4, 256), (576, 576): (5, 1024), (1536, 576): (6, 4096), (576, 1536): (5, 1024)}
    for shape, c in picks.items():
        assert c.bits_per_index_weight == 2.0
        assert config_bits(cfg, *shape) == config_bits(dataclasses.replace(c, layer_bits_cap=0.0), *shape)
        assert config_bits(cfg, *shape).total_bits_per_weight <= 2.5
    with pytest.raises(ValueError, match="layer_bits_cap 2.0: no vector length fits a 576x576 layer"):
        layer_config(dataclasses.replace(cfg, layer_bits_cap=2.0), 576, 576)
    with pytest.raises(ValueError, match="layer_bits_cap"):
        VPTQConfig(layer_bits_cap=-1.0)


def test_allocator_meets_the_budget_exactly_codebooks_included(tiny_model, calib_ids):
    model, _ = tiny_model
    shapes = total_linear_shapes(model)
    weights = sum(o * i for o, i in shapes)
    uncapped = model_bits(BASE, shapes).total_bits_per_weight
    budget = 4.0
    assert uncapped > budget  # the tiny model's codebooks are expensive next to its layers
    cap, bits = cap_for_budget(BASE, shapes, budget)
    assert bits.total_bits <= budget * weights
    # the cap that spends most of the budget: no other candidate cap gets closer to it without going over
    for other in candidate_caps(BASE, shapes):
        try:
            total = model_bits(dataclasses.replace(BASE, layer_bits_cap=other), shapes).total_bits
        except ValueError:
            continue
        assert total > budget * weights or total <= bits.total_bits
    # what the run stores is exactly what was allocated (codebooks, permutation, indices); the run resolves a
    # bits_budget itself, and the bits shown before it (Method.model_bits) are the same
    cfg = dataclasses.replace(BASE, bits_budget=budget)
    assert methods.get("vptq").model_bits(cfg, shapes) == bits
    _, result = quantize_model(model, calib_ids, "vptq", cfg)
    assert result.config["layer_bits_cap"] == cap and result.config["bits_budget"] == budget
    assert result.bits == bits
    assert sum(st.storage_bits().total_bits for st in result.states.values()) == bits.total_bits
    assert len({st.spec.vector_len for st in result.states.values()}) > 1  # layers got different settings
    # same index bits per weight, up to the padding of the last vector of a column (32 rows at v3)
    assert all(2.0 <= st.storage_bits().index_bits_per_weight <= 2.1 for st in result.states.values())
    with pytest.raises(ValueError, match="budget 2.0 cannot be met"):
        cap_for_budget(BASE, shapes, 2.0)


def test_checkpoint_round_trips_differing_layer_settings(tmp_path, tiny_model, calib_ids):
    from vptq_core.storage.checkpoint import load_quantized, save_quantized

    model, tok = tiny_model
    cap, _ = cap_for_budget(BASE, total_linear_shapes(model), 4.0)
    qmodel, result = quantize_model(model, calib_ids, "vptq", dataclasses.replace(BASE, layer_bits_cap=cap))
    save_quantized(qmodel, tok, result.states, tmp_path / "ckpt", dtype=torch.float32)
    loaded, _ = load_quantized(tmp_path / "ckpt", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(calib_ids, use_cache=False).logits,
                                   qmodel(calib_ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)


# SmolLM2-135M's block linears: 30 x (q, k, v, o, gate, up, down)
SMOLLM2 = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30


def test_bits_budget_resolves_to_its_cap_once_and_refuses_a_different_cap():
    # the "2.5 bits" preset's budget as the cap allocator spends it (the preset itself plans per layer by sensitivity)
    chosen = dataclasses.replace(methods.get("vptq").make_config(methods.get("vptq").preset("2.5 bits")),
                                 allocation="cap")
    # with the preset's 8-bit codebooks every layer fits v6 k4096 (2 index bits) well under the budget
    eight = chosen.for_model(SMOLLM2)
    layouts = {(layer_config(eight, *shape).vector_len, layer_config(eight, *shape).num_centroids)
               for shape in set(SMOLLM2)}
    assert chosen.codebook_bits == 8 and layouts == {(6, 4096)}
    assert 2.43 < methods.get("vptq").model_bits(chosen, SMOLLM2).total_bits_per_weight < 2.45
    preset = dataclasses.replace(chosen, codebook_bits=16)  # 16-bit codebooks: the cap steps the small layers down
    assert preset.bits_budget == 2.5 and preset.layer_bits_cap == 0.0
    resolved = preset.for_model(SMOLLM2)
    cap, bits = cap_for_budget(dataclasses.replace(preset, bits_budget=0.0), SMOLLM2, 2.5)
    assert resolved.layer_bits_cap == cap and resolved.bits_budget == 2.5
    assert resolved.for_model(SMOLLM2) == resolved  # resolving again changes nothing
    assert methods.get("vptq").model_bits(preset, SMOLLM2) == bits
    assert 2.49 < bits.total_bits_per_weight <= 2.5  # k/v and q/o at v5 k1024, gate/up/down at v6 k4096
    assert {shape: (layer_config(resolved, *shape).vector_len, layer_config(resolved, *shape).num_centroids)
            for shape in set(SMOLLM2)} == {(576, 576): (5, 1024), (192, 576): (5, 1024), (1536, 576): (6, 4096),
                                           (576, 1536): (6, 4096)}
    assert VPTQConfig().for_model(SMOLLM2) == VPTQConfig()  # no budget: the config itself
    with pytest.raises(ValueError, match="bits_budget 2.5 and layer_bits_cap 3 are both set: set one of them"):
        dataclasses.replace(preset, layer_bits_cap=3.0).for_model(SMOLLM2)
    with pytest.raises(ValueError, match="bits_budget 1.5 cannot be met on this model with vector_len 6, "
                                         "num_centroids 4096: the least it reaches is 2.150"):
        dataclasses.replace(preset, bits_budget=1.5).for_model(SMOLLM2)
    with pytest.raises(ValueError, match="bits_budget"):
        VPTQConfig(bits_budget=-1.0)
    # the method resolves it (``Method.for_model``: allocate.budget_for_model); the config asks the method
    assert methods.get("vptq").for_model(preset, SMOLLM2) == budget_for_model(preset, SMOLLM2) == resolved
    # a budget the cap cannot meet is left to a sensitivity plan, whose ladder reaches lower
    planned = dataclasses.replace(preset, bits_budget=1.5, allocation="sensitivity")
    assert budget_for_model(planned, SMOLLM2) is planned
