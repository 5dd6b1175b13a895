"""The pre-run estimate of the app: what a model is made of, bits and checkpoint size, and the rough duration
of each method's run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from vptq_core.models import TINY, tiny_random_llama
from vptq_core.quant.config import PRESET_TIME_BUDGET, VPTQConfig
from vptq_core.studio.estimate import estimate, model_info


def test_model_info_and_its_errors(tmp_path: Path, monkeypatch):
    info = model_info(TINY)
    assert info.num_blocks == 2
    assert info.modules == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert info.linear_shapes[:7] == ((64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128))
    model, tok = tiny_random_llama()
    total = sum(p.numel() for p in model.parameters())
    assert info.other_params + info.linear_weights == total
    # A dense local directory is read from its config alone and agrees.
    model.save_pretrained(tmp_path / "dense")
    local = model_info(str(tmp_path / "dense"))
    assert (local.linear_shapes, local.other_params) == (info.linear_shapes, info.other_params)
    (tmp_path / "quant").mkdir()
    (tmp_path / "quant" / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "vptq"}}))
    with pytest.raises(ValueError, match=r"already a quantized checkpoint"):
        model_info(str(tmp_path / "quant"))
    with pytest.raises(ValueError, match=r"has no config.json"):
        model_info(str(tmp_path))
    with pytest.raises(ValueError, match=r"'not a model' is not a built-in name"):
        model_info("not a model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"cannot reach the Hugging Face hub to fetch 'someone/some-model'"):
        model_info("someone/some-model")


def test_estimate_counts_codebooks_and_kept_weights():
    info = model_info(TINY)
    config = VPTQConfig(vector_len=4, num_centroids=16, outlier_percent=0.0, enable_perm=False)
    est = estimate(info, "vptq", config)
    weights = info.linear_weights
    # 4 index bits per 4-vector, plus one 16-entry fp16 codebook of 4-vectors per linear.
    codebook_bits = len(info.linear_shapes) * 16 * 4 * 16
    assert est.index_bits_per_weight == 1.0
    assert est.total_bits_per_weight == pytest.approx((weights + codebook_bits) / weights)
    assert est.quantized_bytes == (weights + codebook_bits) // 8
    assert est.checkpoint_bytes == est.quantized_bytes + 2 * info.other_params
    assert est.dense_bytes == 2 * (weights + info.other_params)


def test_time_estimate_sums_each_layer_with_its_own_settings():
    from vptq_core.quant.vptq import layer_config
    from vptq_core.studio.estimate import vptq_layer_phases

    capped = VPTQConfig(vector_len=6, num_centroids=4096, layer_bits_cap=2.5)
    # SmolLM2's k/v projection (192x576) does not fit 2.5 bits at v6 k4096: it is estimated as the v4 k256 the
    # run will use, and costs less than the uncapped layer
    small = layer_config(capped, 192, 576)
    assert (small.vector_len, small.num_centroids) == (4, 256)
    assert vptq_layer_phases(192, 576, capped) == vptq_layer_phases(192, 576, small)
    assert vptq_layer_phases(192, 576, capped)["whole"] < vptq_layer_phases(
        192, 576, dataclasses.replace(capped, layer_bits_cap=0.0))["whole"]
    # a residual codebook adds its k-means and a second sweep; more k-means iterations cost more
    plain = VPTQConfig(vector_len=4, num_centroids=256, outlier_percent=0.0)
    res = dataclasses.replace(plain, num_res_centroids=256)
    p, r = vptq_layer_phases(1536, 576, plain), vptq_layer_phases(1536, 576, res)
    assert r["kmeans"] == pytest.approx(2 * p["kmeans"]) and r["sweep"] > 2 * p["sweep"]
    assert vptq_layer_phases(1536, 576, dataclasses.replace(plain, kmeans_iters=10))["kmeans"] > p["kmeans"]
    # a layer with fewer vectors than centroids needs no k-means (every vector is a centroid)
    assert vptq_layer_phases(16, 64, VPTQConfig(vector_len=8, num_centroids=256, outlier_percent=0.0))[
        "kmeans"] == 0.0


def test_time_estimate_of_the_presets_matches_their_runs(monkeypatch):
    """The runs the constants were checked against (CLI, SmolLM2-135M, 32 x 512 calibration tokens, 2 threads,
    alone on the AMD machine; README "Quantization time"): the pipeline's seconds in quant_report.json. Those runs
    searched codebooks with the k-d tree, which the estimate prices when the search is forced to it."""
    monkeypatch.setenv("VPTQ_NEAREST", "kdtree")
    from vptq_core.quant import run_plan
    from vptq_core.quant.vptq import PRESETS
    from vptq_core.studio.estimate import plan_estimate, time_estimate, vptq_layer_phases

    info = model_info("smollm2-135m-instruct")
    # those runs checkpointed the blocks during distillation, had no time budget, ran 5 k-means iterations and
    # stored 16-bit codebooks; "2.5 bits" capped every layer at 2.5 bits then (its total-bits budget came later)
    measured = {"distill_checkpointing": True, "time_budget": 0.0, "kmeans_iters": 5, "codebook_bits": 16}
    two = VPTQConfig(**{**PRESETS["2.5 bits"], "distill_iters": 32, "bits_budget": 0.0, "layer_bits_cap": 2.5,
                        "allocation": "cap",
                        **measured})
    # ... and "3.5 bits" capped every layer at 3.5 bits (its budget, planned by sensitivity, came later still)
    three = VPTQConfig(**{**PRESETS["3.5 bits"], "calib_sampled_share": 0.5, "bits_budget": 0.0, "layer_bits_cap": 3.5,
                          "allocation": "cap", **measured})
    # per layer: the sum of the 210 layers' seconds (k-means, sweep, the rest) in the run
    assert sum(vptq_layer_phases(o, i, two)["whole"] for o, i in info.linear_shapes) == pytest.approx(116, rel=0.15)
    assert sum(vptq_layer_phases(o, i, three)["whole"] for o, i in info.linear_shapes) == pytest.approx(78, rel=0.15)
    # whole runs: 416 s ("2.5 bits"), 440 s ("3.5 bits" with half self-written calibration)
    assert time_estimate(info, two, 32, 512) == pytest.approx(416, rel=0.1)
    assert time_estimate(info, three, 32, 512) == pytest.approx(440, rel=0.1)
    # under a time budget the estimate is the run's plan (quant/run_plan.py): a budget that leaves distillation its
    # share caps distillation at what the rest leaves of it
    no_kd = time_estimate(info, dataclasses.replace(two, distill_iters=0), 32, 512)
    roomy = no_kd / (1 - run_plan.DISTILL_SHARE) + 10
    long_kd = dataclasses.replace(two, distill_iters=80, time_budget=roomy)
    assert time_estimate(info, dataclasses.replace(long_kd, time_budget=0.0), 32, 512) > roomy
    assert time_estimate(info, long_kd, 32, 512) == pytest.approx(roomy)
    # ... and a tighter one gives up the self-written windows, sensitivity windows, then calibration windows
    no_kd_text = time_estimate(info, dataclasses.replace(two, distill_iters=0, calib_sampled_share=0.0), 32, 512)
    assert no_kd_text < no_kd
    tight = dataclasses.replace(two, time_budget=60)
    plan = plan_estimate(info, tight, 32, 512)
    assert time_estimate(info, tight, 32, 512) == pytest.approx(plan.seconds) and plan.seconds < no_kd_text
    assert plan.config.calib_sampled_share == 0.0 and plan.samples == run_plan.MIN_SAMPLES
    # unchecked blocks (the "auto" setting where the activations fit) make the steps cheaper
    assert time_estimate(info, dataclasses.replace(two, distill_checkpointing=False), 32, 512) < time_estimate(
        info, two, 32, 512)


def test_time_estimate_of_lrq_matches_its_runs():
    """LRQ's W4A8 preset with 32 training steps per block (it has 64 now) and 48 distillation steps as a user ran it
    on 2 idle threads (bench/results/presets_cli_dev_spr.txt): with the calibration all text, w4a8t32 and w4a8s50
    took 464 s and 446 s with the speed probe at 0.92 (427 s and 410 s on the reference machine); half of it written
    by the model, w4a8s50s1 took 501 s with the probe at 1.00. Every run ended within the preset's budget, so the
    estimate without it is what they ran."""
    from vptq_core.quant.config import LRQConfig
    from vptq_core.quant.lrq import PRESETS
    from vptq_core.studio.estimate import time_estimate

    info = model_info("smollm2-135m-instruct")
    w4a8 = LRQConfig(**{**PRESETS["w4a8"], "iters": 32, "time_budget": 0.0})
    assert time_estimate(info, w4a8, 32, 512) == pytest.approx(501, rel=0.1)
    text = dataclasses.replace(w4a8, calib_sampled_share=0.0)
    assert time_estimate(info, text, 32, 512) == pytest.approx((427 + 410) / 2, rel=0.1)
    # each training step costs: half the steps, less time; the preset's 64 steps fit its budget at the reference pace
    assert time_estimate(info, dataclasses.replace(text, iters=16), 32, 512) < time_estimate(info, text, 32, 512)
    assert time_estimate(info, dataclasses.replace(w4a8, iters=PRESETS["w4a8"]["iters"]), 32, 512) < PRESET_TIME_BUDGET


def test_reading_a_models_shapes_leaves_torchs_default_dtype_alone(tmp_path):
    """A config naming bf16 would make transformers set torch's (process-wide) default dtype while it builds;
    another thread's job would then make bf16 tensors where it expects float32."""
    import threading

    import torch
    from torch import nn

    from vptq_core.studio.estimate import _meta_model

    model, tok = tiny_random_llama()
    model.to(torch.bfloat16).save_pretrained(str(tmp_path)), tok.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    seen, paused, looked = [], threading.Event(), threading.Event()
    builder: list[int] = []

    def hook(module, name, param):
        if threading.get_ident() in builder and not paused.is_set():
            paused.set()
            assert looked.wait(30)

    def build():
        builder.append(threading.get_ident())
        _meta_model(str(tmp_path))

    handle = nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        thread = threading.Thread(target=build)
        thread.start()
        assert paused.wait(60)
        seen.append(torch.get_default_dtype())
        looked.set()
        thread.join(60)
    finally:
        handle.remove()
    assert seen == [torch.float32]
