"""Quantization on any device: the torch nearest-centroid search (the one CUDA takes) against the CPU paths,
and every phase run on an emulated accelerator (``emulated_device``: real data, device rules of CUDA, host
syncs and copies counted), compared bit for bit with the CPU. The tests marked ``cuda`` run only where CUDA is."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from emulated_device import DEVICE, EmulatedDevice, to_host

from vptq_core.quant.config import LRQConfig, ScalarConfig, VPTQConfig
from vptq_core.quant.device import exact_float32, nearest_backend, resolve_device, tensors_to
from vptq_core.quant.hessian import HessianAccumulator, inverse_hessian_cholesky, prepare_hessian, proxy_loss
from vptq_core.quant.kmeans import CodebookSearch, nearest, weighted_kmeans
from vptq_core.quant.sweep import error_feedback_sweep
from vptq_core.quant.vptq import vptq_quantize

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _layer(out_features: int = 96, in_features: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(out_features, in_features, generator=gen)
    X = torch.randn(2048, in_features, generator=gen) @ torch.randn(in_features, in_features, generator=gen) * 0.3
    return W, 2 * X.T @ X / X.shape[0]


def _tensors(obj) -> dict[str, torch.Tensor]:
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------------------------------- the search backends
@pytest.mark.parametrize("d,k,n", [(6, 4096, 3000), (4, 256, 4000), (8, 64, 3000), (4, 16, 50)])
def test_torch_search_gives_the_default_paths_assignments(d, k, n):
    gen = torch.Generator().manual_seed(d * k)
    X, C = torch.randn(n, d, generator=gen), torch.randn(k, d, generator=gen)
    default = CodebookSearch(C)
    forced = CodebookSearch(C, backend="torch")
    assert forced.backend == "torch" and default.backend in ("native", "kdtree", "numba")
    a, b = default(X), forced(X)
    exact = torch.cdist(X.double(), C.double())
    # the same centroid, or (float32 expansion rounding) one at the same distance to 1e-5
    chosen = exact.gather(1, b.unsqueeze(1)).squeeze(1)
    assert torch.allclose(chosen, exact.min(dim=1).values, rtol=1e-5, atol=1e-6)
    assert (a == b).float().mean() >= 0.999


def test_nearest_backend_from_the_environment(monkeypatch):
    C = torch.randn(4096, 6)
    monkeypatch.setenv("VPTQ_NEAREST", "torch")
    assert CodebookSearch(C).backend == "torch" and nearest_backend() == "torch"
    monkeypatch.setenv("VPTQ_NEAREST", "kdtree")
    assert CodebookSearch(torch.randn(16, 4)).backend == "kdtree"
    with EmulatedDevice():  # a CPU path named by the environment is ignored on other devices
        assert CodebookSearch(C.to(DEVICE)).backend == "torch"
        with pytest.raises(ValueError, match="runs on CPU float32 codebooks only"):
            CodebookSearch(C.to(DEVICE), backend="kdtree")
    monkeypatch.setenv("VPTQ_NEAREST", "gpu")
    with pytest.raises(ValueError,
                       match=r"\$VPTQ_NEAREST must be one of auto, torch, native, kdtree, numba, got 'gpu'"):
        CodebookSearch(C)


def test_vptq_layer_with_the_torch_search_matches_the_default(monkeypatch):
    W, H = _layer(96, 64)
    config = VPTQConfig(vector_len=4, num_centroids=256, outlier_percent=5.0, num_res_centroids=16, kmeans_iters=4)
    default = vptq_quantize(W, H, config)
    monkeypatch.setenv("VPTQ_NEAREST", "torch")
    forced = vptq_quantize(W, H, config)
    assert forced.rel_proxy_loss == pytest.approx(default.rel_proxy_loss, rel=1e-4)
    assert (forced.state.indices == default.state.indices).float().mean() >= 0.99


# ---------------------------------------------------------------------------------------- the emulated device
def test_emulated_device_enforces_cuda_rules():
    with EmulatedDevice() as emu:
        a = torch.ones(4, 3).to(DEVICE)
        assert a.device == DEVICE and torch.zeros(2, device=DEVICE).device == DEVICE
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            _ = a + torch.ones(4, 3)
        _ = a * torch.tensor(2.0)  # a CPU scalar is fine, as on CUDA
        with pytest.raises(TypeError, match="numpy"):
            a.numpy()
        assert emu.total_syncs == 0
        float(a.sum())
        assert emu.syncs["_local_scalar_dense"] == 1
        a.cpu()
        assert emu.to_host == 1


def test_emulated_parameters_take_new_data_as_on_a_device():
    """``param.data = t`` (how a run swaps a weight's storage) reaches the emulated tensor's wrapped data."""
    with EmulatedDevice():
        linear = torch.nn.Linear(3, 2, bias=False).to(DEVICE)
        new = torch.arange(6.0).reshape(2, 3).to(DEVICE)
        linear.weight.data = new
        assert linear.weight.data_ptr() == new.data_ptr() and linear.weight.requires_grad
        torch.testing.assert_close(to_host(linear(torch.ones(1, 3).to(DEVICE))), torch.tensor([[3.0, 12.0]]))
        linear.weight.data = linear.weight.data.to(torch.float64)
        assert linear.weight.dtype == torch.float64 and to_host(linear.weight).dtype == torch.float64


def test_hessian_phases_follow_the_device_without_host_copies():
    W, H_ref = _layer(96, 64)
    X = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(3))
    cpu_acc = HessianAccumulator(64)
    cpu_acc.add_batch(X)
    Wc, Hc = prepare_hessian(W, cpu_acc.hessian, 0.01)
    U_cpu = inverse_hessian_cholesky(Hc, {})
    with EmulatedDevice() as emu:
        acc = HessianAccumulator(64, device=DEVICE)
        acc.add_batch(X.to(DEVICE))
        Wd, Hd = prepare_hessian(W.to(DEVICE), acc.hessian, 0.01)
        assert emu.total_syncs == 0
        cache: dict = {}
        U = inverse_hessian_cholesky(Hd, cache)
        assert inverse_hessian_cholesky(Hd.clone(), cache) is U  # found again by value, on the device
        loss = proxy_loss(Wd, Wd * 0.9, Hd)
        assert emu.to_host <= 1 and U.device == DEVICE
    for a, b in ((acc.sum, cpu_acc.sum), (Wd, Wc), (Hd, Hc), (U, U_cpu)):
        assert torch.equal(to_host(a), b)
    assert loss == proxy_loss(Wc, Wc * 0.9, Hc)


def test_kmeans_follows_the_device_and_draws_like_the_cpu():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(3000, 4, generator=gen)
    w = torch.rand(3000, generator=gen)
    ref = weighted_kmeans(X, w, k=64, iters=4, seed=3, sample=2000, backend="torch")
    with EmulatedDevice() as emu:
        res = weighted_kmeans(X.to(DEVICE), w.to(DEVICE), k=64, iters=4, seed=3, sample=2000)
    assert res.centroids.device == DEVICE
    assert torch.equal(to_host(res.centroids), ref.centroids) and res.objective == ref.objective
    # per fit: the weights to the host once (the CPU generator draws), the objectives once; one
    # empty-cluster count per iteration
    assert emu.syncs["nonzero"] == 4 and emu.to_host <= 3 and emu.total_syncs <= 4 + 4


def test_sweep_with_torch_search_never_waits_for_the_host():
    """The VPTQ column loop (search, gather, error feedback) on a device: no sync, no host copy, per column or
    at all, and the CPU's result bit for bit."""
    W, H = _layer(96, 64)
    Wd, Hd = prepare_hessian(W, H, 0.1)
    U = inverse_hessian_cholesky(Hd)
    C = weighted_kmeans(W.T.reshape(-1, 4), None, 16, 2).centroids

    def run(W, U, C):
        search = CodebookSearch(C, backend="torch")
        W = W.clone()
        indices = torch.zeros(W.shape[0] // 4, W.shape[1], dtype=torch.long, device=W.device)

        def quantize_column(j, w):
            idx = search(w.view(-1, 4))
            indices[:, j] = idx
            return C[idx].reshape(-1)

        error_feedback_sweep(W, U, quantize_column, block_size=16)
        return W, indices

    W_cpu, idx_cpu = run(Wd, U, C)
    with EmulatedDevice() as emu:
        W_dev, idx_dev = run(Wd.to(DEVICE), U.to(DEVICE), C.to(DEVICE))
    assert emu.total_syncs == 0 and emu.to_host == 0
    assert torch.equal(to_host(W_dev), W_cpu) and torch.equal(to_host(idx_dev), idx_cpu)


def test_tensors_to_moves_a_state_without_its_checks():
    from vptq_core.quant.rtn import rtn_quantize

    state = rtn_quantize(torch.randn(8, 16), 4, 8, bias=torch.zeros(8))
    with EmulatedDevice():
        moved = tensors_to(state, DEVICE)
        assert all(t.device == DEVICE for t in _tensors(moved).values())
        assert state.codes.device.type == "cpu"  # the original is untouched
        back = tensors_to(moved, "cpu")
    assert all(torch.equal(back_t, _tensors(state)[k]) for k, back_t in _tensors(back).items())
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_exact_float32_restores_the_callers_precision():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with exact_float32():
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


# ---------------------------------------------------------------------------------------- the whole pipeline
# fine-tuning in float32 where training can autocast (autocast has no emulated device type)
_FLOAT32_TRAINING = {"train_dtype": "float32"} if "train_dtype" in VPTQConfig.__dataclass_fields__ else {}
TINY_CONFIGS = {
    "vptq": VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=5.0, enable_perm=False,
                       num_res_centroids=4, enable_norm=True, refit_iters=2, finetune_iters=2, **_FLOAT32_TRAINING),
    "gptq": ScalarConfig(bits=3, group_size=32),
    "rtn": ScalarConfig(bits=3, group_size=32, act_bits=8, act_granularity="tensor"),
    "lrq": LRQConfig(bits=3, iters=3, act_bits=8, act_granularity="tensor"),
}
@pytest.mark.slow
@pytest.mark.parametrize("method", ["vptq", "gptq", "rtn", "lrq"])
def test_quantize_model_on_a_device_equals_the_cpu_run(method, monkeypatch):
    """Every phase of every method (Hessians, k-means, sweep, refit, fine-tuning, LRQ training, activation
    calibration) on the emulated device: the same states as on the CPU, bit for bit, and a bounded number of
    host syncs and copies per layer, whatever the layer's width."""
    from vptq_core.models import tiny_random_llama
    from vptq_core.quant.pipeline import quantize_model

    monkeypatch.setenv("VPTQ_NEAREST", "torch")  # the search a device takes, on the CPU run too
    model, _ = tiny_random_llama()
    model.set_attn_implementation("eager")  # SDPA's C++ math fallback allocates where the emulator cannot see
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    _, ref = quantize_model(model, calib, method, TINY_CONFIGS[method], device="cpu")
    with EmulatedDevice() as emu:
        _, res = quantize_model(model, calib, method, TINY_CONFIGS[method], device=DEVICE)
    assert list(res.states) == list(ref.states) and not res.cancelled
    for name, state in res.states.items():
        for key, tensor in _tensors(state).items():
            assert torch.equal(to_host(tensor), _tensors(ref.states[name])[key]), (name, key)
    # Host syncs and copies happen per layer, k-means / CG iteration or training step, never per column: no
    # line of the package waits for the host more than a few times per layer, while every layer has >= 64 columns.
    per_line: collections.Counter = collections.Counter()
    for (what, where), n in emu.where.items():
        if what.startswith("sync") or what == "to_host":
            per_line[where] += n
    layers, narrowest = len(res.states), min(s.in_features for s in res.states.values())
    assert max(per_line.values()) <= 8 * layers < narrowest * layers, per_line.most_common(3)
    assert not [where for where in per_line if "sweep.py" in where]


# ---------------------------------------------------------------------------------------- the bit plan
def _tiny_eager():
    from vptq_core.models import tiny_random_llama

    model, tok = tiny_random_llama()
    model.set_attn_implementation("eager")  # SDPA's C++ math fallback allocates where the emulator cannot see
    return model, tok


def test_the_sensitivity_plan_measures_a_model_left_on_the_cpu_one_block_at_a_time():
    """The plan stage measures the original where it lies (the CPU) with a GPU to work on. Under the emulated
    device any operation that mixes its tensors with CPU ones raises, as on CUDA: the measurement moves blocks and
    activations, never mixes, holds one block on the device at a time, leaves the model where it was, and finds
    the CPU's numbers bit for bit, so the same plan."""
    from vptq_core.quant.blocks import decoder_blocks
    from vptq_core.quant.sensitivity import measure, plan_config
    from vptq_core.quant.vptq import config_bits

    model, _ = _tiny_eager()
    windows = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    config = VPTQConfig(vector_len=4, num_centroids=64, kmeans_iters=2, outlier_percent=0.0, bits_budget=3.0,
                        allocation="sensitivity")
    ref_data = measure(model, windows, 0.1, torch.device("cpu"), labels="data")
    ref_plan, ref_metrics = plan_config(model, windows, config, torch.device("cpu"), config_bits)
    blocks = decoder_blocks(model)
    on_device_at_once = []
    handles = [b.register_forward_pre_hook(lambda *_: on_device_at_once.append(
        sum(next(b.parameters()).device == DEVICE for b in blocks))) for b in blocks]
    try:
        with EmulatedDevice() as emu:
            with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
                model(windows[:1].to(DEVICE))  # the guard: what the measurement did before it moved blocks
            data = measure(model, windows, 0.1, DEVICE, labels="data")
            planned, metrics = plan_config(model, windows, config, DEVICE, config_bits)
    finally:
        for h in handles:
            h.remove()
    assert data == ref_data  # every linear's gradient, weights and feedback, bit for bit
    assert planned.layer_plan == ref_plan.layer_plan  # measured with the model's own labels
    assert len({(v, k) for _, v, k in planned.layer_plan}) > 1  # a plan, not one setting for all
    assert metrics["predicted_loss"] == ref_metrics["predicted_loss"]
    assert max(on_device_at_once) == 1  # blocks came to the device one at a time
    assert emu.to_device > 0 and emu.to_host > 0
    assert all(p.device.type == "cpu" and p.grad is None and p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


@pytest.mark.slow
def test_the_2_5_bits_preset_runs_whole_on_a_device_as_on_the_cpu(tmp_path, monkeypatch):
    """The "2.5 bits" preset, shrunk for the tiny model (small codebooks, few windows and training steps, a budget
    its small layers can meet): self-written calibration, the bit plan by sensitivity, the blocks with fine-tuning,
    distillation, save and load, all on the emulated device; the same checkpoint as the CPU writes, bit for bit."""
    from safetensors.torch import load_file

    from vptq_core import api
    from vptq_core.quant.config import CalibConfig
    from vptq_core.quant.vptq import PRESETS
    from vptq_core.storage.checkpoint import load_quantized
    from vptq_core.studio.form import SMALL_MODEL_VALUES

    load_model = api.load_model

    def eager(*args, **kwargs):
        model, tok = load_model(*args, **kwargs)
        model.set_attn_implementation("eager")  # SDPA's C++ math fallback allocates where the emulator cannot see
        return model, tok

    monkeypatch.setattr(api, "load_model", eager)
    monkeypatch.setenv("VPTQ_NEAREST", "torch")  # the search a device takes, on the CPU run too
    # 64 centroids (not the form's 16) so that the ladder at this budget offers the plan a choice
    shrunk = {**PRESETS["2.5 bits"], **SMALL_MODEL_VALUES, "num_centroids": 64, "bits_budget": 3.0,
              "distill_iters": 3, "distill_samples": 4, "distill_eval_every": 2, "finetune_iters": 2,
              **_FLOAT32_TRAINING}
    config = VPTQConfig(**shrunk)
    assert config.allocation == "sensitivity" and config.calib_sampled_share > 0
    calib = CalibConfig(samples=8, seqlen=32)
    cpu_dir, cpu = api.quantize_to_dir("tiny-random-llama", "vptq", config, calib, tmp_path / "cpu", device="cpu",
                                       save_dtype=torch.float32)
    with EmulatedDevice():
        dev_dir, dev = api.quantize_to_dir("tiny-random-llama", "vptq", config, calib, tmp_path / "dev",
                                           device=str(DEVICE), save_dtype=torch.float32)
        loaded, _ = load_quantized(dev_dir, device=DEVICE, dtype=torch.float32)
        loaded.set_attn_implementation("eager")
        with torch.no_grad():
            logits = to_host(loaded(torch.arange(16).unsqueeze(0).to(DEVICE), use_cache=False).logits)
    assert not dev["cancelled"] and dev["blocks_done"] == 2
    for phase in ("sample_calibration", "allocation", "finetune", "distill"):
        assert dev["timings"][phase] > 0, phase
    assert dev["model_metrics"]["distill"]["steps"] == 3
    assert dev["config"]["layer_plan"] == cpu["config"]["layer_plan"]
    assert len({(v, k) for _, v, k in dev["config"]["layer_plan"]}) > 1
    assert dev["total_bits_per_weight"] <= 3.0
    ours, theirs = load_file(dev_dir / "model.safetensors"), load_file(cpu_dir / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    on_cpu, _ = load_quantized(cpu_dir, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(logits, on_cpu(torch.arange(16).unsqueeze(0), use_cache=False).logits)


# ---------------------------------------------------------------------------------------- real CUDA
@cuda
def test_cuda_sweep_and_layer_match_the_cpu():
    W, H = _layer(192, 128)
    config = VPTQConfig(vector_len=4, num_centroids=256, outlier_percent=2.0, kmeans_iters=4)
    cpu = vptq_quantize(W, H, config)
    gpu = vptq_quantize(W.cuda(), H.cuda(), config)
    assert gpu.state.indices.device.type == "cuda" and gpu.weight.device.type == "cuda"
    assert gpu.rel_proxy_loss == pytest.approx(cpu.rel_proxy_loss, rel=2e-2)
    assert (gpu.state.indices.cpu() == cpu.state.indices).float().mean() >= 0.9


@cuda
def test_cuda_sweep_makes_no_host_sync():
    W, H = _layer(192, 128)
    Wd, Hd = prepare_hessian(W.cuda(), H.cuda(), 0.1)
    U = inverse_hessian_cholesky(Hd)
    C = weighted_kmeans(Wd.T.reshape(-1, 4), None, 256, 2).centroids
    search = CodebookSearch(C)
    indices = torch.zeros(Wd.shape[0] // 4, Wd.shape[1], dtype=torch.long, device="cuda")

    def quantize_column(j, w):
        idx = search(w.view(-1, 4))
        indices[:, j] = idx
        return C[idx].reshape(-1)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        error_feedback_sweep(Wd.clone(), U, quantize_column, block_size=32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert nearest(Wd[:, :1].reshape(-1, 4), C).device.type == "cuda"
