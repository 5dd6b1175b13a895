import dataclasses
import itertools
import json
import math

import pytest
import torch

from vptq_core.quant import methods
from vptq_core.quant.blocks import block_linears, decoder_blocks, total_linear_shapes
from vptq_core.quant.config import VPTQConfig
from vptq_core.quant.hessian import inverse_hessian_cholesky, prepare_hessian
from vptq_core.quant.pipeline import quantize_model
from vptq_core.quant.sensitivity import (
    LayerSensitivity,
    allocate,
    ladder,
    layer_settings,
    measure,
    measured_windows,
    plan_config,
)
from vptq_core.quant.vptq import config_bits

BASE = VPTQConfig(vector_len=4, num_centroids=256, kmeans_iters=2, outlier_percent=0.0)


def test_ladder_spans_the_index_bits_with_codebooks_up_to_the_configs():
    steps = ladder(VPTQConfig(vector_len=6, num_centroids=4096))
    assert (6, 4096) in steps and (4, 4096) in steps and (8, 4096) in steps and (2, 64) in steps
    assert all(2 <= v <= 8 and 16 <= k <= 4096 for v, k in steps)
    assert all(1.0 <= (k.bit_length() - 1) / v <= 4.0 for v, k in steps)
    assert len(steps) == len(set(steps))
    # with a budget: from one index bit under it, up to 4 or 1.5 over it
    budget = ladder(VPTQConfig(vector_len=6, num_centroids=4096, bits_budget=2.5, allocation="sensitivity"))
    assert min((k.bit_length() - 1) / v for v, k in budget) == 1.5 and (8, 256) not in budget
    high = ladder(VPTQConfig(vector_len=4, num_centroids=4096, bits_budget=3.5, allocation="sensitivity"))
    assert min((k.bit_length() - 1) / v for v, k in high) >= 2.5
    assert max((k.bit_length() - 1) / v for v, k in high) == 5.0  # v2 k1024


def _feedback(linear, x: torch.Tensor, tokens: int) -> float:
    """Σ_j 1/U_jj² per token from the inputs ``x`` [tokens, in], the plain way (damping 0.1, diagonal order)."""
    _, Hd = prepare_hessian(linear.weight.detach(), x.T @ x, 0.1)
    perm = torch.argsort(torch.diag(Hd), descending=True, stable=True)
    U = inverse_hessian_cholesky(Hd[perm][:, perm])
    return float((1 / torch.diag(U).double() ** 2).sum()) / tokens


def test_measure_gives_each_linears_output_gradient_and_its_inputs_feedback(tiny_model, calib_ids):
    model, _ = tiny_model
    windows = calib_ids[:2]
    sens = measure(model, windows, 0.1, torch.device("cpu"), labels="data")
    assert set(sens) == {f"model.layers.{b}.{n}" for b, blk in enumerate(decoder_blocks(model))
                         for n in block_linears(blk)}
    # the same quantities the plain way: outputs kept with retain_grad, inputs stacked, one window at a time
    name = "model.layers.1.mlp.down_proj"
    linear = model.get_submodule(name)
    grads, inputs = [], []
    for i in range(windows.shape[0]):
        kept = {}
        handle = linear.register_forward_hook(lambda _m, args, out: kept.update(x=args[0].detach(), y=out))
        try:
            embeds = model.get_input_embeddings()(windows[i : i + 1]).detach().requires_grad_(True)
            out = model(inputs_embeds=embeds, labels=windows[i : i + 1])
            kept["y"].retain_grad()
            out.loss.backward()
        finally:
            handle.remove()
            model.zero_grad(set_to_none=True)
        grads.append(kept["y"].grad.reshape(-1, linear.out_features))
        inputs.append(kept["x"].reshape(-1, linear.in_features))
    tokens = windows.numel()
    g = torch.cat(grads)
    assert sens[name].grad_sq == pytest.approx(float(g.pow(2).sum()) / (tokens * linear.out_features), rel=1e-5)
    assert sens[name].feedback == pytest.approx(_feedback(linear, torch.cat(inputs), tokens), rel=1e-4)
    # every linear's feedback from its own inputs: linears share a Hessian only where they read the same tensor
    # (q/k/v, gate/up), never because a freed activation's address came back for another input
    stacked: dict[str, list[torch.Tensor]] = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda _m, args, _o, n=n: stacked.setdefault(n, []).append(args[0].detach().reshape(-1, args[0].shape[-1])))
        for n in sens]
    try:
        with torch.no_grad():
            for i in range(windows.shape[0]):
                model(windows[i : i + 1])
    finally:
        for h in hooks:
            h.remove()
    for n, s in sens.items():
        assert s.feedback == pytest.approx(_feedback(model.get_submodule(n), torch.cat(stacked[n]), tokens),
                                           rel=1e-4), n
    s = sens[name]
    assert s.weight == pytest.approx(0.5 * s.grad_sq * s.out_features * s.weight_ms * s.feedback)
    assert s.weight_ms == pytest.approx(float(linear.weight.detach().double().pow(2).mean()))
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was
    # labels drawn from the model's own distribution (the default): seeded, and a loss of its own
    drawn = measure(model, windows, 0.1, torch.device("cpu"), labels="sampled", seed=3)
    assert drawn[name].grad_sq == measure(model, windows, 0.1, torch.device("cpu"), labels="sampled",
                                          seed=3)[name].grad_sq
    assert drawn[name].grad_sq != pytest.approx(sens[name].grad_sq, rel=1e-3)
    assert drawn[name].feedback == sens[name].feedback  # the inputs do not depend on the labels
    with pytest.raises(ValueError, match="labels must be 'data' or 'sampled'"):
        measure(model, windows, 0.1, torch.device("cpu"), labels="gold")


def _layers(weights: list[float], shape=(64, 64)) -> dict[str, LayerSensitivity]:
    return {f"l{i}": LayerSensitivity(shape[0], shape[1], 1.0, 1.0, 1.0, w) for i, w in enumerate(weights)}


def _rho(cfg: VPTQConfig, shape=(64, 64)) -> dict:
    # the relative error of a source at R index bits per weight, 2^(-2R), a little worse for short vectors
    return {shape: {(v, k): 2.0 ** (-2 * (k.bit_length() - 1) / v) * (1 + 0.5 / v) for v, k in ladder(cfg)}}


def test_allocation_spends_the_budget_where_the_loss_feels_it_and_is_close_to_the_best_plan():
    cfg = dataclasses.replace(BASE, bits_budget=4.0, allocation="sensitivity")
    sens, rho = _layers([100.0, 1.0, 1.0]), _rho(BASE)  # the ladder without a budget's floor: 1-4 index bits
    plan = allocate(sens, rho, cfg, 4.0, config_bits)
    bits = {n: config_bits(layer_settings(cfg, *plan.layers[n]), 64, 64).total_bits for n in sens}
    assert sum(bits.values()) <= 4.0 * 3 * 64 * 64
    assert plan.total_bits == pytest.approx(sum(bits.values()) / (3 * 64 * 64))
    assert bits["l0"] > bits["l1"]  # 100x the sensitivity: more bits
    # against every plan there is (ladder^3), for several sensitivities and budgets: the greedy plan (with its
    # single-layer moves after) is the best or close to it
    options = [(step, config_bits(layer_settings(cfg, *step), 64, 64).total_bits) for step in ladder(BASE)]
    for spread in ([100.0, 1.0, 1.0], [10.0, 3.0, 1.0], [5.0, 5.0, 1.0]):
        for budget in (3.5, 4.0, 4.5, 5.0):
            some = _layers(spread)
            got = allocate(some, rho, cfg, budget, config_bits)
            best = min(sum(some[f"l{i}"].weight * rho[(64, 64)][c[i][0]] for i in range(3))
                       for c in itertools.product(options, repeat=3) if sum(b for _, b in c) <= budget * 3 * 64 * 64)
            assert best <= got.predicted <= 1.15 * best
    # equal sensitivities: equal settings
    even = allocate(_layers([1.0, 1.0, 1.0]), rho, cfg, 4.0, config_bits)
    assert len(set(even.layers.values())) == 1
    with pytest.raises(ValueError, match="bits_budget 1 cannot be met by a per-layer plan on this model: the "
                                         "least its ladder reaches is"):
        allocate(sens, rho, cfg, 1.0, config_bits)


def test_a_sensitivity_run_quantizes_every_layer_as_planned_within_the_budget(tmp_path, tiny_model, calib_ids):
    from vptq_core.storage.checkpoint import load_quantized, save_quantized

    model, tok = tiny_model
    shapes = total_linear_shapes(model)
    weights = sum(o * i for o, i in shapes)
    cfg = dataclasses.replace(BASE, bits_budget=4.0, allocation="sensitivity")
    qmodel, result = quantize_model(model, calib_ids, "vptq", cfg)
    plan = {name: (v, k) for name, v, k in result.config["layer_plan"]}
    assert set(plan) == set(result.states)
    for name, state in result.states.items():
        assert (state.spec.vector_len, state.spec.num_centroids) == plan[name]
    assert result.bits.total_bits <= 4.0 * weights
    assert result.bits.total_bits == sum(config_bits(layer_settings(cfg, *plan[n]), st.out_features,
                                                     st.in_features).total_bits for n, st in result.states.items())
    info = result.model_metrics["allocation"]
    assert info["total_bits"] == pytest.approx(result.bits.total_bits_per_weight)
    assert sum(info["settings"].values()) == len(result.states)
    assert info["predicted_loss"] <= info["predicted_loss_cap"]
    assert result.timings["allocation"] > 0
    # the run's config carries its plan: a JSON round trip rebuilds the same config, which quantizes the same way
    again = VPTQConfig.from_dict(json.loads(json.dumps(result.config)))
    assert again.layer_plan == tuple(tuple(e) for e in result.config["layer_plan"])
    assert methods.get("vptq").before_blocks[0].applies(again) is False  # planned: nothing to measure
    # the checkpoint stores every layer's own settings and loads to the same logits
    save_quantized(qmodel, tok, result.states, tmp_path / "ckpt", dtype=torch.float32)
    loaded, _ = load_quantized(tmp_path / "ckpt", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(calib_ids, use_cache=False).logits,
                                   qmodel(calib_ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)


def test_a_sensitivity_run_stops_cleanly_when_cancelled_during_the_measurement(tiny_model, calib_ids):
    model, _ = tiny_model
    cfg = dataclasses.replace(BASE, bits_budget=4.0, allocation="sensitivity")
    _, result = quantize_model(model, calib_ids, "vptq", cfg, should_stop=lambda: True)
    assert result.cancelled and not result.states


def test_allocation_settings_are_checked():
    with pytest.raises(ValueError, match="allocation must be one of"):
        VPTQConfig(allocation="greedy")
    with pytest.raises(ValueError, match="allocation 'sensitivity' spends a bits_budget: set bits_budget"):
        VPTQConfig(allocation="sensitivity")
    with pytest.raises(ValueError, match="allocation 'sensitivity' plans single codebooks"):
        VPTQConfig(allocation="sensitivity", bits_budget=3.0, num_res_centroids=256, num_centroids=256)
    with pytest.raises(ValueError, match="layer_plan entries must be"):
        VPTQConfig(layer_plan=(("a.b", 4),))
    with pytest.raises(ValueError, match="layer_plan num_centroids of 'a.b' must be a power of two"):
        VPTQConfig(layer_plan=(("a.b", 4, 100),))
    planned = VPTQConfig(layer_plan=[["a.b", 3, 64]])
    assert planned.layer_plan == (("a.b", 3, 64),)
    assert (planned.for_layer("a.b").vector_len, planned.for_layer("a.b").num_centroids) == (3, 64)
    assert planned.for_layer("a.c") is planned


def test_streaming_is_refused_for_a_sensitivity_plan(tmp_path):
    from vptq_core.api import quantize_to_dir
    from vptq_core.quant.config import CalibConfig

    cfg = dataclasses.replace(BASE, bits_budget=4.0, allocation="sensitivity")
    with pytest.raises(ValueError, match="cannot stream block by block with allocation: it measures the whole model"):
        quantize_to_dir("tiny-random-llama", "vptq", cfg, CalibConfig(samples=2, seqlen=32), tmp_path / "out",
                        stream=True)


def test_the_estimate_before_start_bounds_a_planned_run_by_its_budget():
    from vptq_core.studio import views
    from vptq_core.studio.estimate import allocation_estimate, estimate, model_info, time_estimate

    info = model_info("tiny-random-llama")
    capped = dataclasses.replace(BASE, bits_budget=4.0)
    planned = dataclasses.replace(capped, allocation="sensitivity")
    est = estimate(info, "vptq", planned)
    assert est.planned and est.total_bits_per_weight == 4.0
    assert est.quantized_bytes == math.ceil(4.0 * info.linear_weights / 8)
    assert "≤ 4.000 total bits" in views.estimate_md(info, est)
    assert not estimate(info, "vptq", capped).planned
    # the measurement before the first block is priced, and only for a plan still to be made
    assert allocation_estimate(info, planned, 64) > 0
    assert allocation_estimate(info, capped, 64) == 0
    assert allocation_estimate(info, dataclasses.replace(planned, layer_plan=(("x", 4, 16),)), 64) == 0
    # ... and its block stage is priced lower than the capped one: the plan's smaller codebooks (their k-means at
    # the share whole runs measured, tests/quant/test_cost.py)
    from vptq_core.quant.cost import stage_seconds
    from vptq_core.studio.estimate import run_size

    vptq, size = methods.get("vptq"), run_size(info, 4, 64)
    saved = stage_seconds(vptq, size, capped)["blocks"] - stage_seconds(vptq, size, planned)["blocks"]
    assert saved > 0.0
    assert time_estimate(info, planned, 4, 64) == pytest.approx(
        time_estimate(info, capped, 4, 64) + allocation_estimate(info, planned, 64) - saved)


def test_the_measured_windows_spread_over_text_and_self_written_ones():
    windows = torch.arange(32).unsqueeze(1).expand(32, 8)
    assert measured_windows(windows)[:, 0].tolist() == [0, 10, 21, 31]
    assert measured_windows(windows[:2])[:, 0].tolist() == [0, 1]


def _measured_the_whole_models_way(model, windows: torch.Tensor) -> dict[str, LayerSensitivity]:
    """Every block linear's sensitivity from one forward and backward of the whole model per window (outputs kept
    with retain_grad, inputs stacked): what the block-by-block measurement must equal."""
    names = [f"model.layers.{b}.{n}" for b, blk in enumerate(decoder_blocks(model)) for n in block_linears(blk)]
    grads: dict[str, list] = {n: [] for n in names}
    inputs: dict[str, list] = {n: [] for n in names}
    kept: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_m, args, out):
            inputs[name].append(args[0].detach().reshape(-1, args[0].shape[-1]))
            out.retain_grad()
            kept[name] = out
        return record

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        for i in range(windows.shape[0]):
            embeds = model.get_input_embeddings()(windows[i : i + 1]).detach().requires_grad_(True)
            model(inputs_embeds=embeds, labels=windows[i : i + 1]).loss.backward()
            for n in names:
                grads[n].append(kept[n].grad.reshape(-1, kept[n].shape[-1]))
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    tokens = windows.numel()
    out = {}
    for n in names:
        linear = model.get_submodule(n)
        g = float(torch.cat(grads[n]).pow(2).sum()) / (tokens * linear.out_features)
        ms = float(linear.weight.detach().double().pow(2).mean())
        fb = _feedback(linear, torch.cat(inputs[n]), tokens)
        out[n] = LayerSensitivity(linear.out_features, linear.in_features, g, ms, fb,
                                  0.5 * g * linear.out_features * ms * fb)
    return out


def test_the_block_by_block_measurement_gives_the_whole_models_numbers_and_plan(tiny_model, calib_ids):
    """The measurement runs one block at a time (every window through a block before the next), holding one
    block's activations and Hessians: its numbers are those of the whole model's forward and backward, so its
    plan is the same."""
    from vptq_core.quant.sensitivity import distortion

    model, _ = tiny_model
    windows = calib_ids[:3]
    ours = measure(model, windows, 0.1, torch.device("cpu"), labels="data")
    theirs = _measured_the_whole_models_way(model, windows)
    assert set(ours) == set(theirs)
    for name, s in ours.items():
        t = theirs[name]
        assert s.grad_sq == pytest.approx(t.grad_sq, rel=1e-5), name
        assert s.feedback == pytest.approx(t.feedback, rel=1e-4), name
        assert s.weight_ms == pytest.approx(t.weight_ms, rel=1e-9), name
    cfg = dataclasses.replace(BASE, bits_budget=4.0, allocation="sensitivity")
    shapes = {(s.out_features, s.in_features) for s in ours.values()}
    rho = distortion(model, {shape: ladder(cfg) for shape in shapes}, list(ours), cfg)
    assert allocate(ours, rho, cfg, 4.0, config_bits).layers == allocate(theirs, rho, cfg, 4.0, config_bits).layers


def test_a_plan_measured_on_fewer_windows_is_close_to_the_full_measurements(tiny_model):
    """``sensitivity_windows``: the plan from 2 of 8 windows, scored by the 8-window measurement, predicts a loss
    increase within 10% of the 8-window plan's own (and most layers get the same settings)."""
    from vptq_core.quant.sensitivity import distortion

    model, _ = tiny_model
    windows = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    cfg = dataclasses.replace(BASE, bits_budget=4.0, allocation="sensitivity")
    full = measure(model, measured_windows(windows, 8), 0.1, torch.device("cpu"))
    few = measure(model, measured_windows(windows, 2), 0.1, torch.device("cpu"))
    shapes = {(s.out_features, s.in_features) for s in full.values()}
    rho = distortion(model, {shape: ladder(cfg) for shape in shapes}, list(full), cfg)
    best = allocate(full, rho, cfg, 4.0, config_bits)
    cheap = allocate(few, rho, cfg, 4.0, config_bits)
    scored = sum(full[n].weight * rho[(full[n].out_features, full[n].in_features)][step]
                 for n, step in cheap.layers.items())
    assert best.predicted <= scored <= 1.10 * best.predicted
    same = sum(cheap.layers[n] == best.layers[n] for n in best.layers)
    assert same >= 0.5 * len(best.layers)
    assert measured_windows(windows, 2).shape[0] == 2
    # the setting reaches the measurement: the plan's report says how many windows it measured
    _, metrics = plan_config(model, windows, dataclasses.replace(cfg, sensitivity_windows=2), torch.device("cpu"),
                             config_bits)
    assert metrics["windows"] == 2
    with pytest.raises(ValueError, match="sensitivity_windows must be"):
        VPTQConfig(sensitivity_windows=0)


def test_the_loss_taken_a_few_positions_at_a_time_gives_the_same_measurement(tiny_model, calib_ids, monkeypatch):
    from vptq_core.quant import block_backward

    model, _ = tiny_model
    windows = calib_ids[:2]
    whole = {labels: measure(model, windows, 0.1, torch.device("cpu"), labels=labels, seed=5)
             for labels in ("data", "sampled")}
    monkeypatch.setattr(block_backward, "LOSS_CHUNK_BYTES", 10 * 4 * model.config.vocab_size)  # 10 positions
    for labels, ref in whole.items():
        parts = measure(model, windows, 0.1, torch.device("cpu"), labels=labels, seed=5)
        for name, s in parts.items():
            assert s.grad_sq == pytest.approx(ref[name].grad_sq, rel=1e-5), (labels, name)
            assert s.feedback == ref[name].feedback
