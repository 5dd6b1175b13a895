"""Checkpoints with 8-bit codebooks (``codebook_bits`` 8): what the file holds, that it loads back to the model the
run had, that the sizes count what is stored, and clear errors for damaged ones."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VQ_LAYOUTS
from factories import random_vq_state
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from vptq_core.models import tiny_random_llama
from vptq_core.quant.codebook_grid import from_grid
from vptq_core.storage.checkpoint import load_quantized, save_quantized
from vptq_core.storage.modules import Int8Codebook, VQLinear, replace_linears

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 77, 8, 1, 64]])
Q = "model.layers.0.self_attn.q_proj"


def _states(model: nn.Module) -> dict:
    """Every layout of ``VQ_LAYOUTS`` (residual, outliers, groups, norm, perm) with 8-bit codebooks."""
    states = {}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    for i, (name, m) in enumerate(linears):
        state = random_vq_state(m.in_features, m.out_features, **VQ_LAYOUTS[name.rpartition(".")[2]], seed=i)
        state = dataclasses.replace(state, codebook_bits=8)
        state.snap_codebooks()
        states[name] = state
    return states


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits.float()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict, nn.Module]:
    model, tok = tiny_random_llama()
    states = _states(model)
    path = save_quantized(model, tok, states, tmp_path_factory.mktemp("cb8") / "ckpt", report={"method": "vptq"},
                          dtype=torch.bfloat16)
    return path, states, model


def test_the_file_holds_int8_codebooks_with_float32_scales_and_says_so(checkpoint):
    path, states, _ = checkpoint
    layers = json.loads((path / "config.json").read_text())["quantization_config"]["config_for_layers"]
    assert all(entry["codebook_bits"] == 8 for entry in layers.values())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name, state in states.items():
            for table_name, (table, v) in state.codebook_tables().items():
                codes = f.get_tensor(f"{name}.{table_name}.weight")
                scale = f.get_tensor(f"{name}.{table_name}.scale")
                assert codes.dtype == torch.int8 and scale.dtype == torch.float32
                assert codes.shape == table.shape and scale.shape == (table.shape[0], v)
                # the stored grid gives the state's table back (to float32 rounding)
                torch.testing.assert_close(from_grid(codes, scale, v), table, rtol=2e-7, atol=0)


def test_it_loads_back_to_the_in_memory_model_exactly(checkpoint):
    path, states, _ = checkpoint
    model, _ = load_quantized(path)
    reference, _ = tiny_random_llama()
    reference = replace_linears(reference, states, torch.bfloat16)
    for param in reference.parameters():
        param.data = param.data.to(torch.bfloat16)
    q = model.get_submodule(Q)
    assert isinstance(q, VQLinear) and isinstance(q.centroids, Int8Codebook)
    assert q.centroids.table.dtype == torch.bfloat16 and q.centroids.scale.dtype == torch.float32
    ref_sd = reference.state_dict()
    for key, tensor in model.state_dict().items():
        assert tensor.dtype == ref_sd[key].dtype and torch.equal(tensor, ref_sd[key]), key
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=0, atol=0)
    for name, state in states.items():  # every codebook the kernels read is the state's, in the model dtype
        for table_name, (table, _) in state.codebook_tables().items():
            loaded = getattr(model.get_submodule(name), table_name).table
            assert torch.equal(loaded, table.to(torch.bfloat16)), (name, table_name)


def test_float32_loading_reads_the_states_tables_and_a_dtype_change_keeps_the_scales_float32(checkpoint):
    path, states, _ = checkpoint
    exact, _ = load_quantized(path, dtype=torch.float32)
    for name, state in states.items():  # the tables themselves: the norm tensors beside them are stored in bf16
        for table_name, (table, _) in state.codebook_tables().items():
            loaded = getattr(exact.get_submodule(name), table_name).table
            assert loaded.dtype == torch.float32
            torch.testing.assert_close(loaded, table, rtol=2e-7, atol=0)
    exact.to(torch.bfloat16)
    q = exact.get_submodule(Q)
    assert q.centroids.scale.dtype == torch.float32 and q.centroids.table.dtype == torch.bfloat16


def test_the_report_and_the_bits_count_what_is_stored(checkpoint):
    path, states, _ = checkpoint
    sizes = json.loads((path / "quant_report.json").read_text())["sizes"]
    stored = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in states:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if key.startswith(f"{name}.") and "centroids." in key:
                    t = f.get_tensor(key)
                    stored += t.numel() * t.element_size()
    assert sizes["codebook_bytes"] == stored
    # the bits the plan priced: index + codebooks (+ perm, norm as counted for 16-bit codebooks too)
    wide = {n: dataclasses.replace(s, codebook_bits=16) for n, s in states.items()}
    saved = sum(w.storage_bits().total_bits - s.storage_bits().total_bits for w, s in zip(wide.values(),
                                                                                          states.values()))
    entries = sum(t.numel() for s in states.values() for t, _ in s.codebook_tables().values())
    assert 8 * stored == 16 * entries - saved


def _damaged(checkpoint, tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint[0], path)
    return path


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t[f"{Q}.centroids.scale"].fill_(0), "8-bit codebook's scales must be positive and finite"),
    (lambda t: t[f"{Q}.centroids.scale"].fill_(float("nan")), "8-bit codebook's scales must be positive"),
    (lambda t: t.update({f"{Q}.centroids.scale": t[f"{Q}.centroids.scale"].bfloat16()}),
     rf"tensor '{Q}.centroids.scale' has dtype BF16, expected F32"),
    (lambda t: t.update({f"{Q}.centroids.weight": t[f"{Q}.centroids.weight"].bfloat16()}),
     rf"tensor '{Q}.centroids.weight' has dtype BF16, expected I8"),
    (lambda t: t.pop(f"{Q}.centroids.scale"), rf"missing tensors \['{Q}.centroids.scale'\]"),
], ids=["zero-scale", "nan-scale", "scale-dtype", "codes-dtype", "no-scale"])
def test_a_damaged_8_bit_codebook_is_named(checkpoint, tmp_path, edit, match):
    path = _damaged(checkpoint, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        load_quantized(path)


def test_a_codebook_width_other_than_16_or_8_is_refused(checkpoint, tmp_path):
    path = _damaged(checkpoint, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_for_layers"][Q]["codebook_bits"] = 4
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="codebook_bits must be 16 or 8, got 4"):
        load_quantized(path)


def test_transformers_loads_and_saves_it_as_load_quantized_does(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from vptq_core.storage import hf_integration

    hf_integration.install()
    path = checkpoint[0]
    ours, _ = load_quantized(path)
    theirs = AutoModelForCausalLM.from_pretrained(str(path))
    q = theirs.get_submodule(Q)
    assert q.centroids.scale.dtype == torch.float32 and q.centroids.table.dtype == torch.bfloat16
    theirs_sd = theirs.state_dict()
    for key, tensor in ours.state_dict().items():
        assert tensor.dtype == theirs_sd[key].dtype and torch.equal(tensor, theirs_sd[key]), key
    torch.testing.assert_close(_logits(theirs), _logits(ours), rtol=0, atol=0)
    theirs.save_pretrained(str(tmp_path / "resaved"))
    again, _ = load_quantized(tmp_path / "resaved")
    torch.testing.assert_close(_logits(again), _logits(ours), rtol=0, atol=0)
