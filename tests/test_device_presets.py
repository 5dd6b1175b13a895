"""Every preset of every method, whole, on the emulated accelerator (``emulated_device``) under the device-mismatch
guard (``device_guard``): self-written calibration, the bit plan, the blocks with fine-tuning, distillation, the LM
head and input embedding, save, load, a few tokens of chat and an evaluation against the original. Presets shrunk
for the tiny model (small codebooks, few windows and steps); the plan, the checkpoint's indices and the chat's
tokens equal the CPU run's, its trained floats and the evaluation to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from device_guard import DeviceGuard
from emulated_device import DEVICE, EmulatedDevice, to_host

from vptq_core.quant import methods

PRESETS = ("2.5 bits", "3.5 bits", "4.5 bits")
CASES = [(m, p) for m in ("vptq", "gptq", "rtn", "lrq") for p in PRESETS]
# fine-tuning in float32 where training can autocast (autocast has no emulated device type)
_SHRINK_VPTQ = {"vector_len": 4, "num_centroids": 64, "kmeans_iters": 2, "outlier_percent": 0.0,
                "finetune_iters": 2, "train_dtype": "float32"}


def shrunk(method: str, preset: str):
    """The preset's config, sized for the tiny model: a budget the ladder of its small layers can meet with a
    choice, small codebooks, a few distillation steps on a few windows; every phase the preset has stays on."""
    m = methods.get(method)
    settings = dict(m.presets[preset])
    if method == "vptq":
        settings.update(_SHRINK_VPTQ)
        if settings["num_res_centroids"]:
            settings["num_res_centroids"] = 16
        if settings["bits_budget"]:
            settings["bits_budget"] = max(settings["bits_budget"], 3.0)
        if settings["distill_iters"]:
            settings.update(distill_iters=3, distill_samples=4, distill_eval_every=2)
    else:
        settings["iters"] = 3 if method == "lrq" else settings.get("iters")
        settings = {k: v for k, v in settings.items() if v is not None}
    return m.make_config(settings)


def _whole_run(tmp_path, method: str, config, device: str):
    """quantize_to_dir with the head and embedding, then the checkpoint loaded on ``device``: greedy chat tokens
    and an evaluation against the original on ``device`` -> (directory, summary, tokens, eval, logits)."""
    from vptq_core import api
    from vptq_core.eval import evaluate
    from vptq_core.generation import decode_loop
    from vptq_core.quant.config import CalibConfig
    from vptq_core.storage.checkpoint import load_quantized

    calib = CalibConfig(samples=8, seqlen=32)
    linear_wise = methods.get(method).quantize_block is None  # methods that train whole blocks keep them as they are
    out, summary = api.quantize_to_dir("tiny-random-llama", method, config, calib, tmp_path / device, device=device,
                                       save_dtype=torch.float32, head=linear_wise, embedding=linear_wise)
    loaded, tok = load_quantized(out, device=device, dtype=torch.float32)
    loaded.set_attn_implementation("eager")
    reference, _ = api.load_model("tiny-random-llama")
    reference.to(device)
    prompt = torch.arange(3, 11).unsqueeze(0)
    tokens = decode_loop(loaded, prompt.to(device), 4, cache="dynamic")
    windows = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    result = evaluate(loaded, tok, windows=windows, reference=reference)
    with torch.no_grad():
        logits = to_host(loaded(prompt.to(device), use_cache=False).logits)
    return out, summary, tokens, result, logits


@pytest.fixture
def eager_models(monkeypatch):
    from vptq_core import api

    load_model = api.load_model

    def eager(*args, **kwargs):
        model, tok = load_model(*args, **kwargs)
        model.set_attn_implementation("eager")  # SDPA's C++ math fallback allocates where the emulator cannot see
        return model, tok

    monkeypatch.setattr(api, "load_model", eager)
    monkeypatch.setenv("VPTQ_NEAREST", "torch")  # the search a device takes, on the CPU run too


def test_the_guard_refuses_mixed_devices_and_allows_what_cuda_allows():
    with EmulatedDevice(), DeviceGuard() as guard:
        a = torch.ones(4, 3).to(DEVICE)
        _ = a * torch.tensor(2.0)  # a CPU scalar
        _ = a[torch.tensor([0, 2])]  # CPU indices
        back = a.cpu()  # a copy
        with pytest.raises(RuntimeError, match="tensors on"):
            _ = torch.nn.functional.embedding(torch.tensor([[1, 2]]).to(DEVICE), torch.randn(8, 3))
    assert guard.checked >= 3 and guard.by_device["meta"] >= 2 and back.device.type == "cpu"
    with DeviceGuard(), pytest.raises(RuntimeError, match=r"tensors on \['cpu', 'meta'\]"):
        torch.ones(2, 2) + torch.empty(2, 2, device="meta")  # without the emulator: a real second device type


def test_the_shrunk_presets_keep_each_presets_phases():
    for method, preset in CASES:
        config, full = shrunk(method, preset), methods.get(method).presets[preset]
        for key in ("allocation", "calib_sampled_share"):
            if key in full:
                assert (getattr(config, key) > 0 if key == "calib_sampled_share" else getattr(config, key)) == (
                    full[key] > 0 if key == "calib_sampled_share" else full[key]), (method, preset, key)
        assert bool(config.distill_iters) == bool(full["distill_iters"]), (method, preset)


@pytest.mark.slow
@pytest.mark.parametrize("method,preset", CASES)
def test_every_preset_runs_whole_on_a_device_as_on_the_cpu(tmp_path, eager_models, method, preset):
    from safetensors.torch import load_file

    config = shrunk(method, preset)
    cpu_dir, cpu, cpu_tokens, cpu_eval, cpu_logits = _whole_run(tmp_path, method, config, "cpu")
    with EmulatedDevice() as emu, DeviceGuard() as guard:
        dev_dir, dev, tokens, ev, logits = _whole_run(tmp_path, method, config, str(DEVICE))
    assert not dev["cancelled"] and dev["blocks_done"] == 2
    assert guard.by_device["meta"] > 1000 and emu.to_device > 0  # the work ran on the device, under the guard
    phases = {"allocation": config.to_dict().get("allocation") == "sensitivity",
              "sample_calibration": config.calib_sampled_share > 0, "distill": config.distill_iters > 0,
              "finetune": bool(getattr(config, "finetune_iters", 0)), "lrq_train": method == "lrq"}
    for phase, expected in phases.items():
        assert (dev["timings"].get(phase, 0) > 0) == expected, phase
    def timeless(entry: dict) -> dict:  # the errors are reported to float32 rounding; the checkpoint is compared
        return {k: pytest.approx(v, rel=1e-5) if isinstance(v, float) else timeless(v) if isinstance(v, dict)
                else v for k, v in entry.items() if k != "seconds"}

    assert timeless(cpu.get("embeddings", {})) == timeless(dev.get("embeddings", {}))
    assert bool(dev.get("embeddings")) == (methods.get(method).quantize_block is None)
    assert dev["config"] == cpu["config"] and dev["total_bits_per_weight"] == cpu["total_bits_per_weight"]
    ours, theirs = load_file(dev_dir / "model.safetensors"), load_file(cpu_dir / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key, tensor in ours.items():  # indices exactly; trained floats to float32 rounding (the device's
        if tensor.is_floating_point():  # forward may sum in another order than the CPU's native kernels)
            torch.testing.assert_close(tensor, theirs[key], rtol=1e-5, atol=1e-6, msg=key)
        else:
            assert torch.equal(tensor, theirs[key]), key
    assert tokens == cpu_tokens and len(tokens) == 4
    # the loaded layers run the device's kernel (the torch lookup), not the CPU's native one: float rounding apart
    torch.testing.assert_close(logits, cpu_logits)
    assert ev.perplexity == pytest.approx(cpu_eval.perplexity, rel=1e-5)
    assert ev.kl_divergence == pytest.approx(cpu_eval.kl_divergence, rel=1e-3, abs=1e-7)
    assert ev.top1_agreement == cpu_eval.top1_agreement
