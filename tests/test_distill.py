import copy
import dataclasses
import math
import time

import pytest
import torch

from vptq_core.quant.config import LRQConfig, ScalarConfig, VPTQConfig
from vptq_core.quant.distill import bucket_kl, distill, sample_windows, teacher_topk
from vptq_core.quant.pipeline import quantize_model
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


def test_bucket_kl_is_the_full_kl_when_k_covers_the_vocabulary():
    gen = torch.Generator().manual_seed(0)
    t, s = torch.randn(5, 40, generator=gen), torch.randn(5, 40, generator=gen)
    p, q = torch.log_softmax(t, -1), torch.log_softmax(s, -1)
    full = float((p.exp() * (p - q)).sum())
    top, index = p.topk(40, -1)
    rest = torch.full((5,), float("-inf"))
    assert float(bucket_kl(s, top, index, rest)) == pytest.approx(full, rel=1e-5)
    # with k < V the bucket KL is a lower bound (data processing) and positive
    top, index = p.topk(8, -1)
    rest = p.scatter(-1, index, float("-inf")).logsumexp(-1)
    assert 0 < float(bucket_kl(s, top, index, rest)) <= full + 1e-6


def _bucket_kl_by_autograd(logits, t_logp, t_index, t_rest):  # the plain formulation, differentiated by autograd
    lse = logits.logsumexp(-1)
    q_top = logits.gather(-1, t_index) - lse[:, None]
    q_rest = logits.scatter(-1, t_index, float("-inf")).logsumexp(-1) - lse
    p_rest = t_rest.exp()
    kl_top = (t_logp.exp() * (t_logp - q_top)).sum(-1)
    return (kl_top + torch.where(p_rest > 0, p_rest * (t_rest - q_rest), torch.zeros_like(p_rest))).sum()


@pytest.mark.parametrize("k,spread", [(8, 1.0), (64, 1.0), (8, 12.0), (300, 1.0)])
def test_bucket_kl_value_and_gradient_match_the_autograd_formulation(k, spread):
    """The hand-written gradient of bucket_kl against autograd through logsumexp; spread 12: peaked teachers and
    students (the rest bucket holds ~1e-30 of the mass), k 300 of 300: no rest at all."""
    gen = torch.Generator().manual_seed(k)
    vocab = 300
    t = torch.randn(7, vocab, generator=gen, dtype=torch.float64) * spread
    p = torch.log_softmax(t, -1)
    top, index = p.topk(k, -1)
    rest = p.scatter(-1, index, float("-inf")).logsumexp(-1) if k < vocab else torch.full((7,), float("-inf"),
                                                                                             dtype=torch.float64)
    s = (torch.randn(7, vocab, generator=gen, dtype=torch.float64) * spread + t).requires_grad_()
    want = _bucket_kl_by_autograd(s, top, index, rest)
    (want_grad,) = torch.autograd.grad(want, s)
    s32 = s.detach().float().requires_grad_()
    got = bucket_kl(s32 * 1.0, top.float(), index, rest.float())
    got.backward(torch.tensor(2.0))
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s32.grad.double(), 2 * want_grad, rtol=1e-4, atol=1e-6)
    assert torch.isfinite(s32.grad).all()


def test_codebook_steps_are_relative_to_the_models_codebook_rms():
    """distill_lr is a relative step: the codebooks' Adam lr is distill_lr x the median RMS of the model's
    codebook tensors (10x larger weights, 10x larger steps); scalar log-scales keep distill_lr as it is."""
    from tests.factories import random_scalar_state, random_vq_state
    from vptq_core.quant.distill import lr_groups
    from vptq_core.quant.finetune import trainable_linear

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
    """Activation checkpointing on or off trains the same model; "auto" turns it off only when one step's saved
    activations fit a quarter of the free memory."""
    from vptq_core.quant import distill as distill_mod

    model, _ = tiny_model
    trained = []
    for setting in (True, False):
        qmodel, result = quantize_model(model, windows, "vptq", TINY)
        cfg = dataclasses.replace(TINY, distill_iters=4, distill_lr=0.17, distill_holdout=0.25, distill_topk=32,
                                  train_dtype="float32", distill_checkpointing=setting)
        metrics = distill(qmodel, model, result.states, windows, cfg)
        assert metrics["checkpointing"] is setting and metrics["best_step"] > 0
        trained.append({n: st.centroids.clone() for n, st in result.states.items()})
    for name, centroids in trained[0].items():
        torch.testing.assert_close(trained[1][name], centroids, rtol=1e-5, atol=1e-6)
    # auto: 20 bytes per token and linear output against a quarter of the free memory
    need = distill_mod.ACT_BYTES * 5184 * 30 * 512  # SmolLM2-135M, one 512-token window: 1.59 GB
    for free, expected in ((4 * need + 1, False), (4 * need - 1, True), (None, True)):
        monkeypatch.setattr(distill_mod, "free_memory", lambda _device, _f=free: _f)
        assert distill_mod.use_checkpointing("auto", 5184 * 30, 512, torch.device("cpu")) is expected
    assert distill_mod.use_checkpointing(False, 10**9, 10**9, torch.device("cpu")) is False
    assert VPTQConfig().distill_checkpointing == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="distill_checkpointing must be true, false or 'auto'"):
            VPTQConfig(distill_checkpointing=bad)


def test_plan_steps_fits_the_steps_and_checks_into_the_time_left():
    from vptq_core.quant.distill import plan_steps

    # typical step = median of the steps after the first (10 s), checks of 4 s every 2 steps, one kept for the end
    assert plan_steps(100.0, [30.0, 10.0, 11.0, 9.0], 4.0, 2) == 8  # (100 - 4) // (10 + 2)
    assert plan_steps(100.0, [30.0], 4.0, 2) == 3  # only the first step known: (100 - 4) // 32
    assert plan_steps(3.0, [1.0, 1.0], 4.0, 2) == 0
    assert plan_steps(-5.0, [1.0], 0.0, 1) == 0


def test_a_time_budget_shrinks_distillation_to_the_steps_that_fit(tiny_model, windows, monkeypatch):
    """With a deadline the run plans how many steps fit and runs its schedule over that many: the same model as
    a run configured for that many steps; with no time left nothing is trained; the pipeline sets the deadline
    from time_budget."""
    from vptq_core.quant import distill as distill_mod

    model, _ = tiny_model
    qmodel, result = quantize_model(model, windows, "vptq", TINY)
    cfg = dataclasses.replace(TINY, distill_iters=12, distill_lr=0.17, distill_holdout=0.25, distill_topk=32,
                              distill_eval_every=1, train_dtype="float32")
    runs = []
    for iters, deadline in ((3, None), (12, time.perf_counter() + 3600)):
        q, st = copy.deepcopy(qmodel), copy.deepcopy(result.states)
        plans = []
        # 3 steps fit in all (the clock is not what is tested here: plan_steps is, above)
        monkeypatch.setattr(distill_mod, "plan_steps", lambda _left, times, _c, _e: max(0, 3 - len(times)))
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
    monkeypatch.setattr(distill_mod, "plan_steps", lambda _left, times, _c, _e: fits.get(len(times), 7 - len(times)))
    plans, lrs = [], []
    real_cosine = distill_mod.cosine_factor
    monkeypatch.setattr(distill_mod, "cosine_factor", lambda *a: lrs.append(real_cosine(*a)) or lrs[-1])
    metrics = distill(copy.deepcopy(qmodel), model, copy.deepcopy(result.states), windows, cfg,
                      deadline=time.perf_counter() + 3600, on_plan=plans.append)
    assert plans == [3, 7] and metrics["steps"] == metrics["planned_steps"] == 7 and metrics["out_of_time"]
    assert lrs and min(lrs) > 0  # every step trained (the old plan-only-shrinks loop ran 4 steps at 0)
    monkeypatch.setattr(distill_mod, "cosine_factor", real_cosine)
    # the time runs out mid-way (the steps were slower than planned): the run stops there, like a cancel
    monkeypatch.setattr(distill_mod, "plan_steps", lambda _left, times, _c, _e: 5 if len(times) < 2 else 0)
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


def test_teacher_topk_shapes_and_mass(tiny_model, windows):
    model, _ = tiny_model
    t = teacher_topk(model, windows[:2], 16, torch.device("cpu"))
    assert t["logp"].shape == t["index"].shape == (2, 63, 16) and t["rest"].shape == (2, 63)
    total = torch.logaddexp(t["logp"].logsumexp(-1), t["rest"])
    torch.testing.assert_close(total, torch.zeros_like(total), atol=1e-5, rtol=0)


def test_quantize_to_dir_distils_and_writes_the_distilled_model(tmp_path, tiny_model):
    from vptq_core.api import quantize_to_dir
    from vptq_core.quant.config import CalibConfig

    model, _ = tiny_model
    cfg = dataclasses.replace(TINY, distill_iters=4, distill_lr=0.17, distill_norm_lr=3e-3, distill_holdout=0.0,
                              distill_eval_every=1, distill_topk=16)
    steps = []
    out, summary = quantize_to_dir("tiny-random-llama", "vptq", cfg, CalibConfig(samples=4, seqlen=32),
                                   tmp_path / "ckpt", device="cpu", on_step=lambda *a: steps.append(a))
    assert [s[:3] for s in steps] == [("distill", i, 4) for i in range(1, 5)]
    assert summary["streaming"].startswith("off: distill") and "distill" in summary["model_metrics"]
    loaded, _ = load_quantized(out, dtype=torch.float32)
    metrics = summary["model_metrics"]["distill"]
    assert metrics["best_step"] > 0 and metrics["kl_after"] < metrics["kl_before"]
    # the distilled norm weights are what the checkpoint holds
    assert [n for n, p in loaded.named_parameters() if "norm" in n and not torch.equal(p, model.get_parameter(n))]
    assert not (tmp_path / "ckpt" / ".partial").exists()


def test_sampled_windows_follow_the_model_and_are_reproducible(tiny_model):
    model, _ = tiny_model
    starts = torch.tensor([[5], [7], [9]])
    a = sample_windows(model, starts, 24, seed=3, batch=2)
    assert a.shape == (3, 24) and a.dtype == torch.long
    assert torch.equal(a[:, :1], starts)
    assert torch.equal(a, sample_windows(model, starts, 24, seed=3, batch=3))  # batching does not change rows
    # rows name the row numbers: a subset of a draw is exactly those rows of the draw
    assert torch.equal(a[[0, 2]], sample_windows(model, starts[[0, 2]], 24, seed=3, rows=torch.tensor([0, 2])))
    with pytest.raises(ValueError, match="rows must name one row number per start"):
        sample_windows(model, starts, 24, rows=torch.tensor([0, 1]))
    assert not torch.equal(a, sample_windows(model, starts, 24, seed=4))
    # ancestral sampling: every sampled token has the probability the model gives it after its prefix > 0,
    # and at a tiny temperature sampling is greedy decoding
    greedy = sample_windows(model, starts, 24, seed=0, temperature=1e-4)
    with torch.no_grad():
        logits = model(greedy, use_cache=False).logits[:, :-1]
    torch.testing.assert_close(greedy[:, 1:], logits.argmax(-1), rtol=0, atol=0)
    # the teacher recorded while sampling is the teacher's own pass over the finished windows
    windows, teacher = sample_windows(model, starts, 24, seed=3, topk=7)
    assert torch.equal(windows, a)
    again = teacher_topk(model, windows, 7, torch.device("cpu"))
    assert teacher["logp"].shape == (3, 23, 7)
    torch.testing.assert_close(teacher["logp"], again["logp"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(teacher["rest"], again["rest"], rtol=1e-4, atol=1e-5)
    assert torch.equal(teacher["index"], again["index"])
    with pytest.raises(ValueError, match="starts must be token ids"):
        sample_windows(model, torch.tensor([1, 2]), 24)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sample_windows(model, starts, 24, temperature=0)


def test_sampling_in_bf16_is_the_model_with_bf16_parameters(tiny_model, monkeypatch):
    """sample_dtype: "bfloat16" runs a float32 model through bf16 copies of its parameters (the module itself is
    left as it is): the same windows and teacher as a copy whose parameters were cast to bf16 (buffers kept);
    "auto" does so only where the hardware multiplies bf16 (device.native_bf16), "model" never."""
    import copy

    from vptq_core.quant import distill as distill_mod

    model, _ = tiny_model
    starts = torch.tensor([[5], [7], [9]])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cast = copy.deepcopy(model)
    for p in cast.parameters():
        p.data = p.data.to(torch.bfloat16)
    got, got_teacher = sample_windows(model, starts, 24, seed=3, topk=5, dtype="bfloat16")
    want, want_teacher = sample_windows(cast, starts, 24, seed=3, topk=5, dtype="model")
    assert torch.equal(got, want)
    for key in ("logp", "index", "rest"):
        assert torch.equal(got_teacher[key], want_teacher[key]), key
    assert all(torch.equal(p, before[n]) and p.dtype == torch.float32 for n, p in model.named_parameters())
    assert distill_mod.sampling_dtype(model, "model") is None
    assert distill_mod.sampling_dtype(cast, "bfloat16") is None  # already bf16: nothing to copy
    for native, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(distill_mod, "native_bf16", lambda _device, _v=native: _v)
        assert distill_mod.sampling_dtype(model, "auto") is expected
    with pytest.raises(ValueError, match="sample_dtype must be one of"):
        distill_mod.sampling_dtype(model, "float16")
    with pytest.raises(ValueError, match="sample_dtype must be 'auto', 'bfloat16' or 'model'"):
        VPTQConfig(sample_dtype="fp16")


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
    from vptq_core.quant.distill import drawn_windows, sampled_count

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


def test_scale_linear_is_the_scalar_layer_with_its_activation_quantizer():
    from tests.factories import random_scalar_state
    from vptq_core.quant.act_quant import quantize_activations
    from vptq_core.quant.finetune import ScaleLinear, trainable_linear

    st = random_scalar_state(40, 24, bits=3, group_size=16, act_bits=8, act_granularity="token", seed=1)
    layer = trainable_linear(st)
    assert isinstance(layer, ScaleLinear) and list(dict(layer.named_parameters())) == ["params.log_scale"]
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.linear(quantize_activations(x, 8, "token"), st.dequantize().float())
    torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(layer.trained()["scales"], st.scales)
    with torch.no_grad():
        layer.params["log_scale"].fill_(math.log(2.0))  # a log-scale moves every scale by the same factor
    torch.testing.assert_close(layer.trained_state().dequantize(), 2 * st.dequantize())
    with pytest.raises(TypeError, match="no trainable form for dict"):
        trainable_linear({})


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
    from vptq_core.quant.finetune import layerwise_count, with_heldout

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


def test_sampled_calibration_replaces_the_last_block_stage_windows(tiny_model, windows):
    """calib_sampled_share: the last share of the windows the block stage sees are the original model's own
    samples (started from the replaced windows' first tokens, reproducible, not distillation's draws); the text
    windows before them and distillation's held-out windows after them stay as they were."""
    from vptq_core.quant.distill import CALIB_SAMPLE_ROWS, sampled_calibration, sampled_count

    model, _ = tiny_model
    cfg = ScalarConfig(bits=3, group_size=16, calib_sampled_share=0.5, distill_iters=2, distill_holdout=0.25,
                       sample_dtype="model")  # float32 as sample_windows below, on bf16 hardware too
    got = sampled_calibration(model, windows, cfg)  # 8 windows: 6 for the blocks (3 sampled), 2 held out
    assert torch.equal(got[:3], windows[:3]) and torch.equal(got[6:], windows[6:])
    assert torch.equal(got[3:6, 0], windows[3:6, 0]) and not torch.equal(got[3:6], windows[3:6])
    expect = sample_windows(model, windows[3:6, :1], 64, seed=0, rows=torch.arange(3, 6) + CALIB_SAMPLE_ROWS)
    assert torch.equal(got[3:6], expect)
    assert torch.equal(sampled_calibration(model, windows, cfg), got)
    assert not torch.equal(sample_windows(model, windows[3:6, :1], 64, seed=0), got[3:6])  # distillation's rows
    off = dataclasses.replace(cfg, calib_sampled_share=0.0)
    assert sampled_calibration(model, windows, off) is windows
    # the share rounds half up, and a share > 0 samples at least one window
    share = dataclasses.replace(off, calib_sampled_share=0.5)
    assert [sampled_count(n, share) for n in (0, 1, 2, 5, 6, 32)] == [0, 1, 1, 3, 3, 16]
    assert sampled_count(32, dataclasses.replace(off, calib_sampled_share=0.01)) == 1
    assert sampled_count(32, dataclasses.replace(off, calib_sampled_share=1.0)) == 32
    assert sampled_count(32, off) == 0
    with pytest.raises(ValueError, match=r"calib_sampled_share must be in \[0\.0, 1\.0\], got 1\.5"):
        dataclasses.replace(cfg, calib_sampled_share=1.5)
    assert sampled_calibration(model, windows, cfg, should_stop=lambda: True) is None


def test_self_written_windows_stay_text_when_too_slow_for_the_time_budget(tiny_model, windows):
    """Under a time_budget the writing may take SAMPLING_BUDGET_SHARE of it, projected from its first tokens:
    over it every window stays text (and says why); within it the windows are written as without a budget. The
    pipeline records the decision, and the time estimate leaves the writing out by the same rule."""
    from vptq_core.quant import distill as distill_mod
    from vptq_core.quant.distill import sampled_calibration
    from vptq_core.studio import estimate as est

    model, _ = tiny_model
    cfg = ScalarConfig(bits=3, group_size=16, calib_sampled_share=0.5, distill_iters=2, distill_holdout=0.25)
    info: dict = {}
    got, teacher = sampled_calibration(model, windows, dataclasses.replace(cfg, time_budget=1e-3), topk=4,
                                       info=info)
    assert got is windows and teacher is None
    assert info["self_written"] == 0 and info["limit_seconds"] == 0.0  # 20% of 1 ms, rounded to 0.1 s
    assert info["projected_seconds"] >= info["limit_seconds"]
    assert "calibration stays text" in info["reason"]
    roomy: dict = {}
    assert torch.equal(sampled_calibration(model, windows, dataclasses.replace(cfg, time_budget=1e6), info=roomy),
                       sampled_calibration(model, windows, cfg)) and not roomy
    _, result = quantize_model(copy.deepcopy(model), windows, "rtn",
                               dataclasses.replace(cfg, distill_iters=0, time_budget=1e-3))
    assert result.model_metrics["calibration"]["self_written"] == 0
    # the estimate: where the writing would exceed its share of the budget the run is priced without it
    def shaped(hidden: int, blocks: int) -> est.ModelInfo:
        shapes = ((hidden, hidden), (hidden // 4, hidden), (hidden // 4, hidden), (hidden, hidden),
                  (4 * hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)) * blocks
        return est.ModelInfo(name="synthetic", num_blocks=blocks, modules=("q", "k", "v", "o", "g", "u", "d"),
                             linear_shapes=shapes, other_params=50_000 * hidden)

    preset = VPTQConfig(vector_len=6, num_centroids=4096, calib_sampled_share=0.75, distill_iters=48,
                        distill_data="calibration", time_budget=570.0)
    text = dataclasses.replace(preset, calib_sampled_share=0.0)
    big, small = shaped(2048, 24), shaped(64, 2)
    params = big.linear_weights + big.other_params
    assert est.sampling_estimate(params, distill_mod.sampled_count(32, preset), 512) > \
        distill_mod.SAMPLING_BUDGET_SHARE * preset.time_budget
    assert est.time_estimate(big, preset, 32, 512) == est.time_estimate(big, text, 32, 512)
    assert est.time_estimate(small, preset, 32, 512) != est.time_estimate(small, text, 32, 512)


def test_writing_projection_allows_for_tokens_growing_dearer_along_the_window():
    """Tokens cost more further along the window. The early decisions (PROJECT_AFTER polls and the doublings) use
    the mean cost so far, a lower bound of the total; the one at a quarter of the first window fits the growth and
    projects the total closely, also under timing noise and a short busy spell, and never more than GROWTH_CAP x
    the mean-cost projection when a long one throws the fit off; after it there is no decision."""
    from vptq_core.quant.distill import GROWTH_CAP, PROJECT_AFTER, WritingProjection

    per_batch, setup, warm = 511, 0.25, 0.5
    final = per_batch // 4

    def run(batches: int, a: float, b: float, noise: float = 0.0, busy: range = range(0)):
        gen = torch.Generator().manual_seed(0)
        projection, now, got = WritingProjection(per_batch, batches, start=0.0), setup, {}
        for k in range(1, per_batch * batches + 1):
            projected = projection.poll(now)
            if projected is not None:
                got[k] = projected
            pos = (k - 1) % per_batch
            jitter = 1 + noise * float(torch.randn((), generator=gen))
            now += (a + b * pos) * jitter * (4.0 if k in busy else 1.0) + (warm if k == 1 else 0.0)
        return got, now, projection

    # Gemma-3-270M-like: 0.15 s a token at the start, 2.4x that at the end of the window
    for batches in (1, 3):
        got, total, _ = run(batches, 0.15, 4e-4)
        assert sorted(got) == [PROJECT_AFTER, 2 * PROJECT_AFTER, 4 * PROJECT_AFTER, final]
        assert got[final] == pytest.approx(total, rel=0.01)
        # the early ones are lower bounds: the growth is still ahead
        assert all(got[k] < total for k in got if k != final)
    noisy, total, _ = run(1, 0.15, 4e-4, noise=0.3)
    assert noisy[final] == pytest.approx(total, rel=0.1)
    # a busy spell of 11 tokens moves the medians' fit little; one over the whole last quarter is capped
    short, total, _ = run(1, 0.05, 0.0, busy=range(110, 121))
    assert short[final] == pytest.approx(total, rel=0.05)
    long, total, projection = run(1, 0.05, 0.0, busy=range(90, 128))
    assert long[final] == pytest.approx(GROWTH_CAP * projection.flat()) and long[final] < 4 * total
    # a writing too short to reach a decision is never stopped by one
    tiny = WritingProjection(8, 1, start=0.0)
    assert all(tiny.poll(float(k)) is None for k in range(8))


def test_self_written_windows_need_no_teacher_pass(tiny_model, windows):
    """The top-k the sampling computed for the windows the original wrote is its teacher pass on them (fp32
    tolerance: the KV-cache decode vs one forward); distillation handed it runs the teacher on the other windows
    only and trains exactly as with its own pass; quantize_model keeps the top-k of the windows it has written."""
    from vptq_core.quant.distill import sampled_calibration, teacher_topk

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


def test_the_block_stage_calibrates_on_the_sampled_windows(tiny_model, windows):
    """GPTQ with calib_sampled_share = GPTQ on the windows sampled_calibration returns (codes equal), not on the
    text's; the sampling's time is its own phase, a cancel during it marks the run, streamed weights are refused."""
    from vptq_core.quant.distill import sampled_calibration

    model, _ = tiny_model
    text = ScalarConfig(bits=3, group_size=16)
    cfg = dataclasses.replace(text, calib_sampled_share=0.5)
    _, sampled = quantize_model(model, windows, "gptq", cfg)
    _, same = quantize_model(model, sampled_calibration(model, windows, cfg), "gptq", text)
    _, plain = quantize_model(model, windows, "gptq", text)
    for name, st in sampled.states.items():
        assert torch.equal(st.codes, same.states[name].codes), name
    assert any(not torch.equal(st.codes, plain.states[name].codes) for name, st in sampled.states.items())
    assert sampled.timings["sample_calibration"] > 0 and "sample_calibration" not in plain.timings
    _, stopped = quantize_model(model, windows, "gptq", cfg, should_stop=lambda: True)
    assert stopped.cancelled and not stopped.states
    with pytest.raises(ValueError, match="calib_sampled_share.*not possible with streamed weights"):
        quantize_model(model, windows, "gptq", cfg, weights=object())


def test_quantize_to_dir_loads_the_whole_model_for_sampled_calibration(tmp_path):
    from vptq_core.api import quantize_to_dir
    from vptq_core.quant.config import CalibConfig

    cfg = ScalarConfig(bits=4, group_size=16, calib_sampled_share=0.5)
    with pytest.raises(ValueError, match="cannot stream block by block with calib_sampled_share"):
        quantize_to_dir("tiny-random-llama", "rtn", cfg, CalibConfig(samples=4, seqlen=32), tmp_path / "a",
                        device="cpu", stream=True)
    _, summary = quantize_to_dir("tiny-random-llama", "gptq", cfg, CalibConfig(samples=4, seqlen=32), tmp_path / "b",
                                 device="cpu")
    assert summary["streaming"].startswith("off: calib_sampled_share") and summary["timings"]["sample_calibration"] > 0


def test_draw_follows_the_distribution_and_never_picks_a_zero(monkeypatch):
    from vptq_core.quant.distill import _draw

    p = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.cat([_draw(p.log(), 1.0, [gen])[0] for _ in range(4000)]), minlength=6)
    assert counts[[1, 4, 5]].sum() == 0
    torch.testing.assert_close(counts.float() / 4000, p[0], rtol=0, atol=0.03)
    # u at the very top (rounding): the last token with probability > 0, not one past the end
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1))
    assert _draw(p.log(), 1.0, [gen]).tolist() == [[3]]
    two = torch.tensor([[0.0, 1.0, 0.0], [0.6, 0.4, 0.0]]).log()
    assert _draw(two, 1.0, [gen, gen]).tolist() == [[1], [1]]
