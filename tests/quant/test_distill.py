import copy
import dataclasses
import time

import pytest
import torch
from safetensors.torch import load_file

from vptq_core.quant.config import LRQConfig, ScalarConfig, VPTQConfig
from vptq_core.quant.distill import distill
from vptq_core.quant.pipeline import quantize_model
from vptq_core.quant.sampling import sample_windows
from vptq_core.storage.checkpoint import load_quantized, save_quantized

TINY = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=3, outlier_percent=0.0)


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))


def _kl(qmodel, reference, ids) -> float:
    """Mean full-vocabulary KL(P_ref || P_q) per predicted token."""
    with torch.no_grad():
        p = torch.log_softmax(reference(ids, use_cache=False).logits[:, :-1].float(), -1)
        q = torch.log_softmax(qmodel(ids, use_cache=False).logits[:, :-1].float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_codebook_steps_are_relative_to_the_models_codebook_rms():
    """distill_lr is a relative step: the codebooks' Adam lr is distill_lr x the median RMS of the model's
    codebook tensors (10x larger weights, 10x larger steps); scalar log-scales keep distill_lr as it is."""
    from tests.factories import random_scalar_state, random_vq_state
    from vptq_core.quant.distill import lr_groups
    from vptq_core.quant.trainable import trainable_linear

    vqs = [random_vq_state(32, 16, vector_len=4, num_centroids=16, seed=s) for s in range(3)]
    sc = random_scalar_state(32, 16, bits=3, group_size=16, seed=1)
    rms = sorted(float(st.centroids.float().pow(2).mean().sqrt()) for st in vqs)
    for factor in (1.0, 10.0):
        layers = {f"v{i}": trainable_linear(dataclasses.replace(st, centroids=st.centroids * factor))
                  for i, st in enumerate(vqs)}
        layers["s"] = trainable_linear(sc)
        groups, got = lr_groups(layers, 2.5e-3)
        assert sorted(got) == pytest.approx([factor * r for r in rms], rel=1e-5)
        assert groups[0]["lr"] == pytest.approx(2.5e-3 * factor * rms[1], rel=1e-5)  # the median
        assert len(groups[0]["params"]) == 3
        assert groups[1] == {"params": [layers["s"].params["log_scale"]], "lr": 2.5e-3}


def test_distillation_lowers_the_kl_on_its_training_windows(tiny_model, windows):
    model, _ = tiny_model
    qmodel, result = quantize_model(model, windows, "vptq", TINY)
    before = _kl(qmodel, model, windows)
    norms = {n: p.detach().clone() for n, p in qmodel.named_parameters() if p.dim() == 1}
    cfg = dataclasses.replace(TINY, distill_iters=12, distill_lr=0.17, distill_norm_lr=3e-3, distill_holdout=0.0,
                              distill_topk=259, train_dtype="float32")
    steps = []
    metrics = distill(qmodel, model, result.states, windows, cfg, on_step=lambda i, kl: steps.append((i, kl)))
    after = _kl(qmodel, model, windows)
    assert [i for i, _ in steps] == list(range(1, 13)) and metrics["steps"] == 12
    assert metrics["kl_after"] < metrics["kl_before"]
    # top-259 of a 259-token vocabulary: the held-out (here: training) KL is the full KL, before and after
    assert metrics["kl_before"] == pytest.approx(before, rel=1e-4)
    assert metrics["kl_after"] == pytest.approx(after, rel=1e-4)
    assert after < 0.9 * before
    assert any(not torch.equal(p, norms[n]) for n, p in qmodel.named_parameters() if n in norms)
    for name, st in result.states.items():  # the fake-quant weights are the states' dequantized weights
        torch.testing.assert_close(qmodel.get_submodule(name).weight, st.dequantize())


def test_checkpointing_changes_memory_not_results(tiny_model, windows, monkeypatch):
    """Activation checkpointing of every block, of none or of some ("auto" within an activation budget) trains
    the same model; "auto" keeps the activations of as many blocks as fit the least of ``ACT_MEMORY_BYTES`` and a
    quarter of the free memory."""
    from vptq_core.quant import student

    model, _ = tiny_model
    trained = []
    per_block = student.ACT_BYTES * sum(m.out_features for m in model.model.layers[0].modules()
                                        if isinstance(m, torch.nn.Linear)) * windows.shape[1]
    monkeypatch.setattr(student, "ACT_MEMORY_BYTES", per_block * 1.5)  # the tiny model's 2 blocks: 1 kept
    for setting, checkpointed in ((True, 2), (False, 0), ("auto", 1)):
        qmodel, result = quantize_model(model, windows, "vptq", TINY)
        cfg = dataclasses.replace(TINY, distill_iters=4, distill_lr=0.17, distill_holdout=0.25, distill_topk=32,
                                  train_dtype="float32", distill_checkpointing=setting)
        metrics = distill(qmodel, model, result.states, windows, cfg)
        assert metrics["checkpointed_blocks"] == checkpointed and metrics["best_step"] > 0
        assert metrics["checkpointing"] is (checkpointed > 0)
        trained.append({n: st.centroids.clone() for n, st in result.states.items()})
    for other in trained[1:]:
        for name, centroids in trained[0].items():
            torch.testing.assert_close(other[name], centroids, rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    # auto: 20 bytes per token and linear output, shared evenly by the blocks, against the budget
    cpu = torch.device("cpu")
    block = student.ACT_BYTES * 5184 * 512  # one SmolLM2-135M block, one 512-token window: 53 MB
    for free, kept in ((1 << 40, student.ACT_MEMORY_BYTES // block), (4 * 3 * block + 1, 3), (4 * block - 1, 0),
                       (None, 0), (4 * 31 * block, min(30, student.ACT_MEMORY_BYTES // block))):
        monkeypatch.setattr(student, "free_memory", lambda _device, _f=free: _f)
        assert student.kept_blocks("auto", 5184 * 30, 512, cpu, 30) == kept
        assert student.use_checkpointing("auto", 5184 * 30, 512, cpu, 30) is (kept < 30)
    assert student.kept_blocks(True, 1, 1, cpu, 30) == 0 and student.kept_blocks(False, 10**9, 10**9, cpu, 30) == 30
    assert student.use_checkpointing(False, 10**9, 10**9, torch.device("cpu")) is False
    assert VPTQConfig().distill_checkpointing == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="distill_checkpointing must be true, false or 'auto'"):
            VPTQConfig(distill_checkpointing=bad)


def test_a_time_budget_shrinks_distillation_to_the_steps_that_fit(tiny_model, windows, monkeypatch):
    """With a deadline the run plans how many steps fit and runs its schedule over that many: the same model as
    a run configured for that many steps; with no time left nothing is trained; the pipeline sets the deadline
    from time_budget."""
    from vptq_core.quant import train as train_mod  # the loop plans the steps and sets the learning rates

    model, _ = tiny_model
    qmodel, result = quantize_model(model, windows, "vptq", TINY)
    cfg = dataclasses.replace(TINY, distill_iters=12, distill_lr=0.17, distill_holdout=0.25, distill_topk=32,
                              distill_eval_every=1, train_dtype="float32")
    runs = []
    for iters, deadline in ((3, None), (12, time.perf_counter() + 3600)):
        q, st = copy.deepcopy(qmodel), copy.deepcopy(result.states)
        plans = []
        # 3 steps fit in all (the clock is not what is tested here: plan_steps is, above)
        monkeypatch.setattr(train_mod, "plan_steps", lambda _left, times, _c, _e: max(0, 3 - len(times)))
        metrics = distill(q, model, st, windows, dataclasses.replace(cfg, distill_iters=iters), deadline=deadline,
                          on_plan=plans.append)
        runs.append((st, metrics, plans))
    (planned, m3, _), (budgeted, m12, plans) = runs
    assert m3["steps"] == m12["steps"] == 3 and m12["planned_steps"] == 3 and plans == [3]
    for name, state in planned.items():
        torch.testing.assert_close(budgeted[name].centroids, state.centroids, rtol=0, atol=0)
    # a short first plan (the first step pays one-time costs) grows again when later steps show more fit: the run
    # takes exactly the steps of its last plan, and none past it (where the schedule's learning rate is 0)
    fits = {1: 2, 2: 5}
    monkeypatch.setattr(train_mod, "plan_steps", lambda _left, times, _c, _e: fits.get(len(times), 7 - len(times)))
    plans, lrs = [], []
    real_cosine = train_mod.cosine_factor
    monkeypatch.setattr(train_mod, "cosine_factor", lambda *a: lrs.append(real_cosine(*a)) or lrs[-1])
    metrics = distill(copy.deepcopy(qmodel), model, copy.deepcopy(result.states), windows, cfg,
                      deadline=time.perf_counter() + 3600, on_plan=plans.append)
    assert plans == [3, 7] and metrics["steps"] == metrics["planned_steps"] == 7 and metrics["out_of_time"]
    assert lrs and min(lrs) > 0  # every step trained (the old plan-only-shrinks loop ran 4 steps at 0)
    monkeypatch.setattr(train_mod, "cosine_factor", real_cosine)
    # the time runs out mid-way (the steps were slower than planned): the run stops there, like a cancel
    monkeypatch.setattr(train_mod, "plan_steps", lambda _left, times, _c, _e: 5 if len(times) < 2 else 0)
    metrics = distill(copy.deepcopy(qmodel), model, copy.deepcopy(result.states), windows, cfg,
                      deadline=time.perf_counter() + 3600)
    assert metrics["steps"] == metrics["planned_steps"] == 2 and metrics["out_of_time"] and not metrics["cancelled"]
    # no time left: nothing trained, nothing changed
    q, st = copy.deepcopy(qmodel), copy.deepcopy(result.states)
    metrics = distill(q, model, st, windows, cfg, deadline=time.perf_counter() - 1)
    assert metrics["steps"] == metrics["planned_steps"] == 0 and metrics["out_of_time"] and metrics["best_step"] == 0
    assert all(torch.equal(st[n].centroids, result.states[n].centroids) for n in st)
    # the pipeline: a budget spent by the block stage leaves distillation no time
    monkeypatch.undo()
    _, res = quantize_model(model, windows, "vptq", dataclasses.replace(cfg, time_budget=1e-3))
    assert res.model_metrics["distill"]["out_of_time"] and res.model_metrics["distill"]["steps"] == 0
    with pytest.raises(ValueError, match="time_budget"):
        VPTQConfig(time_budget=-1.0)


def test_pipeline_distillation_round_trips_through_the_packed_checkpoint(tmp_path, tiny_model, windows):
    model, tok = tiny_model
    cfg = dataclasses.replace(TINY, distill_iters=8, distill_lr=0.17, distill_norm_lr=3e-3, distill_holdout=0.25,
                              distill_eval_every=2, distill_topk=32)
    seen = []
    qmodel, result = quantize_model(model, windows, "vptq", cfg, on_step=lambda *a: seen.append(a))
    metrics = result.model_metrics["distill"]
    assert [a[:3] for a in seen] == [("distill", i, 8) for i in range(1, 9)]
    assert metrics["heldout_windows"] == 2 and metrics["kl_after"] <= metrics["kl_before"]
    assert "distill" in result.timings and result.summary()["model_metrics"]["distill"] is metrics
    # the trained 1-D tensors as distillation left them (the final norm too), for the checkpoint writer
    norms = {n: p for n, p in qmodel.named_parameters() if "norm" in n}
    assert "model.norm.weight" in result.dense and set(norms) <= set(result.dense)
    assert all(torch.equal(result.dense[n], p.detach().float()) for n, p in norms.items())
    save_quantized(qmodel, tok, result.states, tmp_path / "ckpt", dtype=torch.float32)
    loaded, _ = load_quantized(tmp_path / "ckpt", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(windows, use_cache=False).logits, qmodel(windows, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-4)


def test_cancel_during_distillation_keeps_the_best_check_and_marks_the_run(tiny_model, windows):
    model, _ = tiny_model
    calls = []

    def stop():  # polled between linears and blocks (14 + 2), then before each distillation step
        calls.append(1)
        return len(calls) > 40

    cfg = dataclasses.replace(TINY, distill_iters=1000, distill_lr=0.06)
    qmodel, result = quantize_model(model, windows, "vptq", cfg, should_stop=stop)
    metrics = result.model_metrics["distill"]
    assert result.cancelled and metrics["cancelled"] and 0 < metrics["steps"] < 1000
    assert metrics["kl_after"] <= metrics["kl_before"]
    for name, st in result.states.items():
        torch.testing.assert_close(qmodel.get_submodule(name).weight, st.dequantize())


def test_distillation_needs_the_original_model(tiny_model, windows):
    import copy

    model, _ = tiny_model
    cfg = dataclasses.replace(TINY, distill_iters=2)
    with pytest.raises(ValueError, match="distill runs on the whole quantized model.*no reference model"):
        quantize_model(copy.deepcopy(model), windows, "vptq", cfg, inplace=True)
    with pytest.raises(ValueError, match="keep_states=False"):
        quantize_model(model, windows, "vptq", cfg, keep_states=False)


def test_quantize_to_dir_distils_and_writes_the_distilled_model(tmp_path, tiny_model):
    from vptq_core.api import quantize_to_dir
    from vptq_core.quant.config import CalibConfig

    model, _ = tiny_model
    # a step that lowers the check KL at every one of the 4 steps whether the block stage ran in float32 or bf16
    cfg = dataclasses.replace(TINY, distill_iters=4, distill_lr=0.05, distill_norm_lr=3e-3, distill_holdout=0.0,
                              distill_eval_every=1, distill_topk=16)
    steps = []
    out, summary = quantize_to_dir("tiny-random-llama", "vptq", cfg, CalibConfig(samples=4, seqlen=32),
                                   tmp_path / "ckpt", device="cpu", on_step=lambda *a: steps.append(a))
    assert [s[:3] for s in steps] == [("distill", i, 4) for i in range(1, 5)]
    assert summary["streaming"].startswith("off: distill") and "distill" in summary["model_metrics"]
    loaded, _ = load_quantized(out, dtype=torch.float32)
    metrics = summary["model_metrics"]["distill"]
    assert metrics["best_step"] > 0 and metrics["kl_after"] < metrics["kl_before"]
    # the distilled norm weights are what the checkpoint holds, in float32
    assert [n for n, p in loaded.named_parameters() if "norm" in n and not torch.equal(p, model.get_parameter(n))]
    stored = load_file(str(out / "model.safetensors"))
    assert all(stored[n].dtype == torch.float32 and torch.equal(stored[n], p)
               for n, p in loaded.named_parameters() if "norm" in n)
    assert not (tmp_path / "ckpt" / ".partial").exists()


def test_auto_training_dtype_follows_the_hardware(monkeypatch):
    """train_dtype "auto": bf16 autocast where the device multiplies bf16 in hardware, float32 elsewhere (on an
    AVX2-only CPU one distillation step took 135 s in bf16 against 12.6 s in float32)."""
    from vptq_core.quant import device

    assert VPTQConfig().train_dtype == "auto"
    for flags, expected in (({"avx2", "avx512_bf16"}, torch.bfloat16), ({"avx2", "amx_bf16"}, torch.bfloat16),
                            ({"avx2", "avx512f"}, torch.float32), (set(), torch.float32)):
        monkeypatch.setattr(device, "cpu_flags", lambda _f=frozenset(flags): _f)
        assert device.native_bf16("cpu") is (expected == torch.bfloat16)
        assert device.compute_dtype("auto", "cpu") is expected
        assert device.compute_dtype("float32", "cpu") is torch.float32
        assert device.compute_dtype("bfloat16", "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto', 'bfloat16' or 'float32', got 'half'"):
        device.compute_dtype("half")
    with pytest.raises(ValueError, match="train_dtype must be 'auto', 'bfloat16' or 'float32'"):
        VPTQConfig(train_dtype="float16")


def _window_kls(qmodel, reference, ids) -> list[float]:
    return [_kl(qmodel, reference, row[None]) for row in ids]


@pytest.mark.parametrize("data", ["calibration", "sampled", "mixed"])
def test_distillation_trains_on_the_windows_its_data_setting_names(tiny_model, windows, data):
    model, _ = tiny_model
    qmodel, result = quantize_model(model, windows, "vptq", TINY)
    # the windows distillation samples: the training windows' first tokens, the config's seed (reproducible)
    sampled = sample_windows(model, windows[:6, :1], windows.shape[1], seed=TINY.seed)
    calib_kls, sampled_kls = _window_kls(qmodel, model, windows[:6]), _window_kls(qmodel, model, sampled)
    heldout_before = _kl(qmodel, model, windows[-2:])
    steps = []
    cfg = dataclasses.replace(TINY, distill_iters=4, distill_lr=0.17, distill_norm_lr=3e-3, distill_holdout=0.25,
                              distill_topk=259, train_dtype="float32", distill_data=data, distill_samples=6,
                              sample_dtype="model")  # float32 sampling as above, on bf16 hardware too
    metrics = distill(qmodel, model, result.states, windows, cfg, on_step=lambda i, kl: steps.append(kl))
    assert metrics["heldout_windows"] == 2  # the last 2 calibration windows, never trained on, in every mode
    assert metrics["train_windows"] == {"calibration": 6, "sampled": 6, "mixed": 12}[data]
    # 4 steps of one window: only the 4 pool windows drawn (and the 2 held out) get a teacher or are sampled
    assert metrics["drawn_windows"] == 4
    calib_drawn = metrics["teacher_windows"] - 2  # the 2 held-out windows always get a teacher pass
    assert calib_drawn + metrics["sampled_windows"] == 4
    if data != "mixed":
        assert metrics["sampled_windows"] == (0 if data == "calibration" else 4)
    assert metrics["kl_before"] == pytest.approx(heldout_before, rel=1e-4)
    assert metrics["kl_after"] <= metrics["kl_before"]
    # the first step's loss is the (full-vocabulary) KL of one window of the named set, before any update
    pool = {"calibration": calib_kls, "sampled": sampled_kls, "mixed": calib_kls + sampled_kls}[data]
    other = {"calibration": sampled_kls, "sampled": calib_kls, "mixed": []}[data]
    assert min(abs(steps[0] - k) / k for k in pool) < 1e-4
    assert all(abs(steps[0] - k) / k > 1e-3 for k in other)


def test_distill_data_is_checked():
    with pytest.raises(ValueError, match="distill_data must be one of calibration, sampled, mixed"):
        VPTQConfig(distill_data="wiki")


def test_the_run_label_names_the_distillation_data():
    from vptq_core.quant import methods

    describe = methods.get("vptq").describe
    assert describe({"vector_len": 6, "num_centroids": 4096, "distill_iters": 64}).endswith(" kd64")
    assert describe({"vector_len": 6, "num_centroids": 4096, "distill_iters": 64,
                     "distill_data": "mixed"}).endswith(" kd64-mixed")
    lrq = {"bits": 4, "group_size": 0, "rank": 0, "act_bits": 8, "act_granularity": "token", "distill_iters": 32}
    assert methods.get("lrq").describe(lrq) == "4b per-channel rankauto A8 kd32"
    assert methods.get("gptq").describe({"bits": 3, "group_size": 64}) == "3b g64"


def test_the_time_estimate_counts_distillation_as_measured():
    from vptq_core.quant.vptq import PRESETS
    from vptq_core.studio.estimate import distill_estimate, sampling_estimate

    params = 134.5e6  # SmolLM2-135M, embedding included
    base = VPTQConfig(vector_len=6, num_centroids=4096)
    assert distill_estimate(params, base, 32, 512) == 0.0
    # the presets' runs through the CLI (32 calibration windows x 512 tokens, checks every 8 steps, the drawn
    # calibration windows + 4 held out get a teacher pass; AMD machine, alone; README "Calibrating on text the
    # model writes itself"): "3.5 bits" with 48 steps 223.1 s of distillation, "2.5 bits" with 32 steps 156.9 s
    # (199.9 s in a run right after a fresh install). Those runs passed the teacher over all 36 windows (37-41
    # s); now the self-written ones among them bring their top-k from the sampling (1.1 s a window less each).
    from vptq_core.quant.calib_windows import sampled_count
    from vptq_core.quant.distill import drawn_windows

    def written_drawn(config) -> int:  # the blocks see windows 0..31; the last sampled_count(32) are written
        rows = drawn_windows(36, config).calib_rows
        return int(((rows >= 32 - sampled_count(32, config)) & (rows < 32)).sum())

    three = VPTQConfig(**{**PRESETS["3.5 bits"], "calib_sampled_share": 0.5})
    assert three.distill_iters == 48 and written_drawn(three) == 16
    assert distill_estimate(params, three, 32, 512) == pytest.approx(223.1 - 1.1 * 16, rel=0.1)
    two = VPTQConfig(**{**PRESETS["2.5 bits"], "distill_iters": 32})
    assert written_drawn(two) == 24
    assert distill_estimate(params, two, 32, 512) == pytest.approx(156.9 - 1.1 * 24, rel=0.1)
    # writing the self-written calibration windows: 16 in 65.2 and 74.0 s, 24 in 72.8 s (one batched pass)
    assert sampling_estimate(params, 16, 512) == pytest.approx(70, rel=0.1)
    assert sampling_estimate(params, 24, 512) == pytest.approx(72.8, rel=0.2)
    # more steps and more checks cost more; sampling is the cost "calibration" does not pay, and "sampled"
    # skips the training windows' teacher pass
    mixed64 = dataclasses.replace(base, distill_iters=64, distill_eval_every=16, distill_data="mixed")
    assert distill_estimate(params, mixed64, 32, 512) > distill_estimate(
        params, dataclasses.replace(mixed64, distill_iters=32), 32, 512)
    calib64 = dataclasses.replace(mixed64, distill_data="calibration")
    sampled64 = dataclasses.replace(mixed64, distill_data="sampled")
    assert distill_estimate(params, calib64, 32, 512) < distill_estimate(params, sampled64, 32, 512) \
        < distill_estimate(params, mixed64, 32, 512)


def test_held_out_checks_default_to_every_quarter_of_the_steps():
    from vptq_core.quant.distill import eval_every

    assert eval_every(VPTQConfig(distill_iters=16)) == 4
    assert eval_every(VPTQConfig(distill_iters=128)) == 32
    assert eval_every(VPTQConfig(distill_iters=3)) == 1
    assert eval_every(VPTQConfig(distill_iters=16, distill_eval_every=5)) == 5


def test_presets_distil_models_up_to_the_size_limit(tmp_path, capsys):
    from transformers import LlamaConfig

    from vptq_core.cli import build_parser, method_config_from_args
    from vptq_core.quant.distill import PRESET_DISTILL_MAX_PARAMS, sized_preset
    from vptq_core.quant.vptq import PRESETS

    preset = PRESETS["2.5 bits"]
    assert preset["distill_iters"] == 80
    assert sized_preset(preset, 135_000_000) == (preset, "")
    kept, note = sized_preset(preset, PRESET_DISTILL_MAX_PARAMS + 1)
    assert kept == {**preset, "distill_iters": 0, "calib_sampled_share": 0.0}
    assert "80 distillation steps and its self-written calibration windows" in note and "are left out" in note
    kept, note = sized_preset({**preset, "calib_sampled_share": 0.0}, PRESET_DISTILL_MAX_PARAMS + 1)
    assert kept["distill_iters"] == 0 and "the preset's 80 distillation steps are left out" in note
    # the CLI sizes the preset from the model's config alone, and an explicit flag still wins
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000).save_pretrained(tmp_path / "big")
    args = build_parser().parse_args(["quantize", "--method", "vptq", "--model", str(tmp_path / "big"),
                                      "--preset", "2.5",
                                      "--out", str(tmp_path / "o")])
    assert method_config_from_args(args).distill_iters == 0
    assert "left out for a model of 6.7B parameters" in capsys.readouterr().err
    args = build_parser().parse_args(["quantize", "--method", "vptq", "--model", str(tmp_path / "big"),
                                      "--preset", "2.5",
                                      "--distill-iters", "8", "--out", str(tmp_path / "o")])
    assert method_config_from_args(args).distill_iters == 8
    args = build_parser().parse_args(["quantize", "--method", "vptq", "--model", "smollm2-135m-instruct",
                                      "--preset", "2.5",
                                      "--out", str(tmp_path / "o")])
    assert method_config_from_args(args).distill_iters == 80


SCALAR_CASES = [
    ("rtn", ScalarConfig(bits=3, group_size=0, act_bits=8, act_granularity="token")),
    ("gptq", ScalarConfig(bits=3, group_size=32)),
    ("lrq", LRQConfig(bits=3, iters=4, act_bits=8, act_granularity="tensor")),
]


@pytest.mark.parametrize(("method", "config"), SCALAR_CASES, ids=[c[0] for c in SCALAR_CASES])
def test_scalar_distillation_trains_the_scales_and_the_checkpoint_holds_them(tmp_path, tiny_model, windows,
                                                                             method, config):
    model, tok = tiny_model
    qmodel0, result0 = quantize_model(model, windows, method, config)
    before = _kl(qmodel0, model, windows)
    cfg = dataclasses.replace(config, distill_iters=12, distill_lr=1e-2, distill_norm_lr=3e-3, distill_holdout=0.0,
                              distill_topk=259, train_dtype="float32")
    qmodel, result = quantize_model(model, windows, method, cfg)
    metrics = result.model_metrics["distill"]
    after = _kl(qmodel, model, windows)  # with the activation quantizers of W4A8 / W8A8 in place
    # (the random model's KLs are ~1e-4: float32 noise of the log-probabilities is ~1e-8 per token)
    assert metrics["kl_before"] == pytest.approx(before, rel=1e-4, abs=1e-3 * before)
    assert metrics["kl_after"] == pytest.approx(after, rel=1e-4, abs=1e-3 * before)
    assert after < 0.9 * before
    moved = 0
    for name, st in result.states.items():
        st0 = result0.states[name]
        # codes and zero points stay on their grid: only the scales (and the norms) train
        assert torch.equal(st.codes, st0.codes) and torch.equal(st.zeros, st0.zeros)
        assert (st.act_bits, st.act_granularity) == (config.act_bits, config.act_granularity)
        moved += not torch.equal(st.scales, st0.scales)
        torch.testing.assert_close(qmodel.get_submodule(name).weight, st.dequantize())
    assert moved == len(result.states)
    save_quantized(qmodel, tok, result.states, tmp_path / "ckpt", dtype=torch.float32)
    loaded, _ = load_quantized(tmp_path / "ckpt", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(windows, use_cache=False).logits, qmodel(windows, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-4)


def test_the_distillation_check_windows_are_held_out_of_the_block_stage(tiny_model, windows):
    """With distillation on, its held-out windows (the last 2 of 8 here) never reach the block-by-block stage:
    GPTQ's codes (fixed by distillation) are exactly those of a run on the first 6 windows alone, and differ
    from a run on all 8 (the Hessians differ)."""
    from vptq_core.quant.calib_windows import layerwise_count, with_heldout

    model, _ = tiny_model
    config = ScalarConfig(bits=3, group_size=16)
    cfg = dataclasses.replace(config, distill_iters=2, distill_holdout=0.25, distill_topk=16, train_dtype="float32")
    assert layerwise_count(8, cfg) == 6 and layerwise_count(8, config) == 8
    assert layerwise_count(8, dataclasses.replace(cfg, distill_holdout=0.0)) == 8
    # the held-out windows are drawn on top of the calibration: 32 samples + 4 with the default fraction
    default = dataclasses.replace(config, distill_iters=2)
    assert with_heldout(32, default) == 36 and layerwise_count(36, default) == 32
    assert with_heldout(6, cfg) == 8 and with_heldout(32, config) == 32 and with_heldout(1, cfg) == 1
    for samples in range(1, 70):
        drawn = with_heldout(samples, default)
        assert layerwise_count(drawn, default) == samples and layerwise_count(drawn - 1, default) < samples
    _, distilled = quantize_model(model, windows, "gptq", cfg)
    assert distilled.model_metrics["distill"]["heldout_windows"] == 2
    _, first6 = quantize_model(model, windows[:6], "gptq", config)
    _, all8 = quantize_model(model, windows, "gptq", config)
    for name, st in distilled.states.items():
        assert torch.equal(st.codes, first6.states[name].codes), name
    assert any(not torch.equal(st.codes, all8.states[name].codes) for name, st in distilled.states.items())


def test_every_method_takes_the_distillation_settings(tmp_path):
    from vptq_core.cli import build_parser, method_config_from_args
    from vptq_core.quant import methods
    from vptq_core.studio import form

    for m in methods.all_methods():
        assert "distill" in [h.phase for h in m.after_model]
        assert form.uses(m.name, ["distill_iters", "distill_data"])
        # every preset names its distillation steps and step size, and one that distils every distillation field
        # of the form: picking it never keeps another preset's (or another method's step size)
        for preset in m.presets.values():
            assert {"distill_iters", "calib_sampled_share", "time_budget", "distill_lr"} <= set(preset)
            assert preset["distill_lr"] == m.make_config().distill_lr or preset["distill_iters"]
            if preset["distill_iters"]:
                assert {"distill_data", "distill_samples", "distill_eval_every"} <= set(preset)
        args = build_parser().parse_args(["quantize", "--method", m.name, "--model", "tiny-random-llama",
                                          "--distill-iters", "8", "--distill-data", "mixed", "--distill-lr", "0.002",
                                          "--time-budget", "90", "--out", str(tmp_path / "o")])
        config = method_config_from_args(args)
        assert (config.distill_iters, config.distill_data, config.distill_lr) == (8, "mixed", 0.002)
        assert config.time_budget == 90.0 and form.uses(m.name, ["time_budget"])
    with pytest.raises(ValueError, match="distill_data must be one of calibration, sampled, mixed"):
        LRQConfig(distill_data="wiki")


def test_self_written_windows_need_no_teacher_pass(tiny_model, windows):
    """The top-k the sampling computed for the windows the original wrote is its teacher pass on them (fp32
    tolerance: the KV-cache decode vs one forward); distillation handed it runs the teacher on the other windows
    only and trains exactly as with its own pass; quantize_model keeps the top-k of the windows it has written."""
    from vptq_core.quant.sampling import sampled_calibration
    from vptq_core.quant.teacher import teacher_topk

    model, _ = tiny_model
    cfg = ScalarConfig(bits=3, group_size=16, calib_sampled_share=0.5, distill_iters=3, distill_holdout=0.25,
                       distill_topk=16, train_dtype="float32", sample_dtype="model")
    ids, known = sampled_calibration(model, windows, cfg, topk=cfg.distill_topk)
    assert torch.equal(ids, sampled_calibration(model, windows, cfg)) and torch.equal(known["rows"],
                                                                                     torch.arange(3, 6))
    full = teacher_topk(model, ids[3:6], cfg.distill_topk, torch.device("cpu"))
    assert torch.equal(known["index"], full["index"])
    torch.testing.assert_close(known["logp"], full["logp"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(known["rest"], full["rest"], rtol=1e-4, atol=1e-4)
    text = dataclasses.replace(cfg, calib_sampled_share=0.0, distill_iters=0)
    runs = {}
    for name, teacher in (("pass", None), ("known", known)):
        qmodel, result = quantize_model(model, ids, "gptq", text)
        runs[name] = (qmodel, distill(qmodel, model, result.states, ids, cfg, known_teacher=teacher))
    (own_model, own), (reuse_model, reuse) = runs["pass"], runs["known"]
    # 6 training windows, 2 held out: the 3 steps draw some of the 6; the known ones get no pass
    assert own["known_teacher_windows"] == 0 and reuse["known_teacher_windows"] > 0
    assert reuse["teacher_windows"] + reuse["known_teacher_windows"] == own["teacher_windows"]
    assert reuse["kl_before"] == pytest.approx(own["kl_before"], rel=1e-4)
    assert reuse["kl_after"] == pytest.approx(own["kl_after"], rel=0.01)
    with torch.no_grad():
        torch.testing.assert_close(reuse_model(ids[:2]).logits, own_model(ids[:2]).logits, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match=r"known_teacher must cover rows of the 8 windows"):
        distill(quantize_model(model, ids, "gptq", text)[0], model, result.states, ids, cfg,
                known_teacher={**known, "rows": torch.arange(7, 10)})
    # the whole pipeline: the written windows' teacher comes from the sampling
    _, piped = quantize_model(model, windows, "gptq", cfg, reference=model)
    metrics = piped.model_metrics["distill"]
    assert metrics["known_teacher_windows"] > 0
    assert metrics["teacher_windows"] + metrics["known_teacher_windows"] == own["teacher_windows"]
