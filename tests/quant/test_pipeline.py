import dataclasses

import pytest
import torch

from vptq_core.quant.blocks import decoder_blocks
from vptq_core.quant.config import ConfigBase, ScalarConfig, VPTQConfig
from vptq_core.quant.forward import capture_block_inputs, run_block
from vptq_core.quant.pipeline import quantize_model

TINY_VQ = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=3, outlier_percent=0.0)


def test_pass_through_reproduces_logits_exactly(tiny_model, calib_ids):
    model, _ = tiny_model
    with torch.no_grad():
        ref = model(calib_ids, use_cache=False).logits
        hidden, kwargs = capture_block_inputs(model, calib_ids)
        for block in decoder_blocks(model):
            hidden = run_block(block, hidden, kwargs)
        logits = model.lm_head(model.model.norm(hidden))
    assert torch.equal(logits, ref)


def test_reports_stream_per_linear_and_model_matches_states(tiny_model, calib_ids):
    model, _ = tiny_model
    seen = []
    qmodel, result = quantize_model(model, calib_ids, "vptq", TINY_VQ, on_layer=seen.append)
    assert [r.name for r in seen] == list(result.states) and len(seen) == 14
    assert seen[0].name == "model.layers.0.self_attn.q_proj" and seen[0].block == 0
    for r in seen:
        assert 0.02 < r.rel_output_error < 0.1  # one index bit per weight: measured 0.049-0.056 per block
        assert r.index_bits == 1.0 and r.total_bits > 1.0
    # the returned model holds exactly the dequantized states; the input model is untouched

    q = qmodel.get_submodule("model.layers.1.mlp.down_proj").weight
    torch.testing.assert_close(q, result.states["model.layers.1.mlp.down_proj"].dequantize())
    assert not torch.equal(q, model.get_submodule("model.layers.1.mlp.down_proj").weight)
    assert result.blocks_done == 2 and not result.cancelled


def test_quantized_error_grows_as_bits_shrink(tiny_model, calib_ids):
    model, _ = tiny_model
    errs = []
    for bits in (2, 4, 8):
        _, res = quantize_model(model, calib_ids, "gptq", ScalarConfig(bits=bits, group_size=32))
        errs.append(res.reports[-1].rel_output_error)
    assert errs[0] > errs[1] > errs[2]


def test_cancel_stops_between_layers(tiny_model, calib_ids):
    model, _ = tiny_model
    seen = []
    _, result = quantize_model(model, calib_ids, "rtn", ScalarConfig(bits=4), on_layer=seen.append,
                               should_stop=lambda: len(seen) >= 3)
    assert result.cancelled and len(seen) == 3 and len(result.states) == 3


def test_bad_method_and_config(tiny_model, calib_ids):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="unknown method 'awq'"):
        quantize_model(model, calib_ids, "awq", TINY_VQ)
    with pytest.raises(TypeError, match="method 'gptq' takes a ScalarConfig, got VPTQConfig"):
        quantize_model(model, calib_ids, "gptq", TINY_VQ)
    with pytest.raises(ValueError, match=r"calib_ids must be \[samples, seqlen\]"):
        quantize_model(model, calib_ids[0], "vptq", TINY_VQ)


def test_finetune_lowers_block_loss(tiny_model):
    # Fine-tuning is judged on windows it never trained on (here the last 2 of 8). On 4 windows x 64 tokens of
    # this random model, or at lr 2e-3 (10% of its weights' std per Adam step), it only fits the training
    # windows and the held-out check rightly keeps the untuned block.
    model, _ = tiny_model
    ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
    cfg = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=3, finetune_iters=8, finetune_lr=3e-4,
                     finetune_norm_lr=3e-4, finetune_holdout=0.25)
    _, result = quantize_model(model, ids, "vptq", cfg)
    for block in (0, 1):
        extra = next(r.extra for r in result.reports if r.block == block)
        assert extra["finetune_heldout"] == 2 and extra["finetune_best_step"] == 8
        assert extra["finetune_loss_after"] < extra["finetune_loss_before"], block
        assert extra["finetune_rel_after"] < extra["finetune_rel_before"], block


def test_lrq_through_pipeline(tiny_model, calib_ids):
    from vptq_core.quant.config import LRQConfig

    model, _ = tiny_model
    seen = []
    qmodel, result = quantize_model(model, calib_ids, "lrq", LRQConfig(bits=3, iters=6), on_layer=seen.append)
    assert len(result.reports) == len(seen) == 14 and len(result.states) == 14
    for r in result.reports:
        assert r.extra["block_loss_after"] <= r.extra["block_loss_before"]
        assert r.index_bits == 3.0
    st = result.states["model.layers.0.mlp.up_proj"]
    torch.testing.assert_close(qmodel.get_submodule("model.layers.0.mlp.up_proj").weight, st.dequantize().float())


def test_hessians_shared_only_by_linears_with_the_same_input(tiny_model, calib_ids):
    from vptq_core.quant.blocks import block_linears
    from vptq_core.quant.forward import hessians_and_targets

    model, _ = tiny_model
    with torch.no_grad():
        hidden, kwargs = capture_block_inputs(model, calib_ids)
        block = decoder_blocks(model)[0]
        linears = block_linears(block)
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
        hooks = [m.register_forward_hook(lambda _m, a, _o, n=n: seen[n].append(a[0].clone()))
                 for n, m in linears.items()]
        run_block(block, hidden, kwargs)
        for h in hooks:
            h.remove()
        hessians, _ = hessians_and_targets(block, linears, hidden, kwargs)
    assert hessians["self_attn.q_proj"] is hessians["self_attn.k_proj"] is hessians["self_attn.v_proj"]
    assert hessians["mlp.gate_proj"] is hessians["mlp.up_proj"]
    assert len({id(h) for h in hessians.values()}) == 4
    for name, inputs in seen.items():
        X = torch.cat(inputs).reshape(-1, linears[name].in_features).float()
        torch.testing.assert_close(hessians[name], 2 * X.T @ X / X.shape[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method,granularity", [("gptq", "tensor"), ("rtn", "token")])
def test_scalar_methods_with_activation_quantization(tmp_path, tiny_model, calib_ids, method, granularity):
    from vptq_core.storage.checkpoint import load_quantized, save_quantized

    model, tok = tiny_model
    weight_only, _ = quantize_model(model, calib_ids, method, ScalarConfig(bits=8, group_size=0))
    config = ScalarConfig(bits=8, group_size=0, act_bits=8, act_granularity=granularity)
    qmodel, result = quantize_model(model, calib_ids, method, config)
    for st in result.states.values():
        assert (st.act_bits, st.act_granularity) == (8, granularity)
        assert (st.act_scale is not None and float(st.act_scale) > 0) == (granularity == "tensor")
    if granularity == "tensor":
        # the static scale is absmax / 127 of the linear's input over the calibration windows
        seen = []
        block = decoder_blocks(weight_only)[0]
        h = block.self_attn.q_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0].abs().max()))
        with torch.no_grad():
            weight_only(calib_ids, use_cache=False)
        h.remove()
        scale = result.states["model.layers.0.self_attn.q_proj"].act_scale
        torch.testing.assert_close(scale, (max(seen) / 127).reshape(()), rtol=1e-5, atol=0)
    with torch.no_grad():
        fake = qmodel(calib_ids, use_cache=False).logits
        plain = weight_only(calib_ids, use_cache=False).logits
    assert not torch.equal(fake, plain)  # activations are quantized in the returned model
    assert (fake - plain).abs().max() < 0.05 * plain.abs().max()  # 8-bit activations: a small change
    save_quantized(model, tok, result.states, tmp_path / "ckpt")
    loaded, _ = load_quantized(tmp_path / "ckpt", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(calib_ids, use_cache=False).logits, fake, rtol=1e-4, atol=1e-4)


def test_activation_settings_are_validated():
    with pytest.raises(ValueError, match="act_bits must be 4, 8 or 16"):
        ScalarConfig(act_bits=6)
    with pytest.raises(ValueError, match="act_granularity must be 'token'.*'token_asym'.*got 'channel'"):
        ScalarConfig(act_bits=8, act_granularity="channel")


def test_phase_timings_cover_the_run(tiny_model, calib_ids):
    model, _ = tiny_model
    _, vq = quantize_model(model, calib_ids, "vptq", TINY_VQ)
    t = vq.summary()["timings"]
    assert set(t) == {"capture_inputs", "hessians_targets", "kmeans", "inverse_hessian", "sweep", "block_outputs"}
    assert all(v >= 0 for v in t.values()) and sum(vq.timings.values()) <= vq.seconds
    _, rtn = quantize_model(model, calib_ids, "rtn", ScalarConfig(bits=4))
    assert set(rtn.timings) == {"capture_inputs", "hessians_targets", "quantize", "block_outputs"}


# ------------------------------------------------------------------------------- the stages and what they need
def test_each_builtin_method_says_what_a_run_with_its_config_needs():
    from vptq_core.quant import methods
    from vptq_core.quant.config import PRESET_TIME_BUDGET, LRQConfig
    from vptq_core.quant.methods import RunNeeds

    vptq, gptq, rtn, lrq = (methods.get(name) for name in ("vptq", "gptq", "rtn", "lrq"))
    for method, config in ((vptq, VPTQConfig()), (gptq, ScalarConfig()), (rtn, ScalarConfig())):
        needs = method.needs(config)
        assert needs == RunNeeds() and not needs.whole_model and not needs.reference and not needs.fp_chain
    # a preset that plans, writes its own calibration and distils within a time budget
    preset = vptq.make_config({**vptq.preset("2.5 bits")})
    needs = vptq.needs(preset)
    assert needs.plan == ("allocation",) and needs.after_model == ("distill",)
    assert needs.sampled_share == 0.75 and needs.time_budget == PRESET_TIME_BUDGET
    assert needs.teacher_topk == preset.distill_topk and needs.whole_model and needs.reference
    # a planned config has nothing left to measure; distillation on sampled data keeps no teacher from the writing
    planned = VPTQConfig(layer_plan=(("a.b", 3, 64),), distill_iters=2, distill_data="sampled")
    assert vptq.needs(planned).plan == () and vptq.needs(planned).teacher_topk == 0
    assert vptq.needs(VPTQConfig(target_chain="fp")).fp_chain
    # self-written calibration alone needs the whole model, not the original beside it
    written = rtn.needs(ScalarConfig(calib_sampled_share=0.5))
    assert written.whole_model and not written.reference and written.after_model == ()
    assert gptq.needs(ScalarConfig(distill_iters=4)).after_model == ("distill",)
    # LRQ fits the original model's own block outputs by default
    assert lrq.needs(LRQConfig()).target_chain == "fp" and lrq.needs(LRQConfig(target_chain="quantized")) == RunNeeds()


@dataclasses.dataclass(frozen=True)
class _BareConfig(ConfigBase):
    bits: int = 4
    group_size: int = 0
    sym: bool = False
    clip_search: bool = False


def test_a_method_without_needs_of_its_own_needs_nothing_but_its_hooks(tiny_model, calib_ids):
    from vptq_core.quant.methods import Method, ModelHook, RunNeeds
    from vptq_core.quant.rtn import rtn_layer, scalar_config_bits

    hook = ModelHook("polish", lambda config: True, lambda ctx: {"steps": 1})
    bare = Method(name="bare", label="Bare", description="x", config_class=_BareConfig, bits=scalar_config_bits,
                  describe=lambda s: "bare", quantize_linear=lambda W, H, c, b, cache: rtn_layer(W, H, c, b),
                  after_model=(hook,))
    config = _BareConfig()
    assert bare.needs(config) == RunNeeds(after_model=("polish",))
    assert bare.for_model(config, [(64, 64)]) is config
    stages = []
    _, result = quantize_model(tiny_model[0], calib_ids, bare, config, on_stage=stages.append)
    assert stages == ["blocks", "distill"] and result.model_metrics["polish"] == {"steps": 1}


def test_a_method_reusing_a_builtin_config_reads_its_settings_as_their_owner_does():
    from vptq_core.quant import methods
    from vptq_core.quant.methods import Method

    vptq = methods.get("vptq")
    probe = Method(name="probe", label="probe", description="x", config_class=VPTQConfig, bits=vptq.bits,
                   describe=vptq.describe, quantize_linear=vptq.quantize_linear)
    config = VPTQConfig(target_chain="fp", calib_sampled_share=0.25, time_budget=60.0)
    assert probe.needs(config) == vptq.needs(dataclasses.replace(config, distill_iters=0))
    assert probe.needs(config).fp_chain and probe.needs(config).after_model == ()  # the hooks are its own


def test_quantize_model_goes_through_its_stages_in_order(tiny_model, calib_ids):
    model, _ = tiny_model
    stages = []
    quantize_model(model, calib_ids, "rtn", ScalarConfig(bits=4), on_stage=stages.append)
    assert stages == ["blocks"]
    stages.clear()
    every = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0, bits_budget=4.0,
                       allocation="sensitivity", calib_sampled_share=0.5, distill_iters=1, distill_topk=8)
    _, result = quantize_model(model, calib_ids, "vptq", every, on_stage=stages.append)
    assert stages == ["calibrate", "plan", "blocks", "distill"] and not result.cancelled
    assert {"sample_calibration", "allocation", "distill"} <= set(result.timings)
    # a stop ends the run after the stage it happened in
    stages.clear()
    _, result = quantize_model(model, calib_ids, "vptq", every, on_stage=stages.append, should_stop=lambda: True)
    assert stages == ["calibrate"] and result.cancelled and not result.states


def test_quantize_to_dir_goes_through_every_stage_in_order(tmp_path):
    from vptq_core.api import quantize_to_dir
    from vptq_core.quant.config import CalibConfig

    stages = []
    out, summary = quantize_to_dir("tiny-random-llama", "rtn", ScalarConfig(bits=4), CalibConfig(samples=2, seqlen=32),
                                   tmp_path / "ckpt", device="cpu", head=True, on_stage=stages.append)
    assert stages == ["load", "blocks", "embeddings", "save"]
    assert (out / "config.json").is_file() and "embeddings" in summary


def test_streaming_follows_what_the_method_needs(tmp_path):
    from vptq_core.api import quantize_to_dir
    from vptq_core.quant.config import CalibConfig

    calib = CalibConfig(samples=2, seqlen=32)
    with pytest.raises(ValueError, match="cannot stream block by block with distill: it trains the whole model"):
        quantize_to_dir("tiny-random-llama", "rtn", ScalarConfig(distill_iters=2), calib, tmp_path / "a", stream=True)
    with pytest.raises(ValueError, match="the LM head and embedding can be quantized with vptq, gptq or rtn"):
        quantize_to_dir("tiny-random-llama", "lrq", methods_config("lrq"), calib, tmp_path / "b", head=True)


def methods_config(name: str):
    from vptq_core.quant import methods

    return methods.get(name).make_config()
