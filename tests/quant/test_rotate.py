"""Rotation of the residual stream (quant/rotate.py): the rotated model computes what the original does, from
memory and from a safetensors directory (one file or shards), and families it cannot rotate are refused."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from vptq_core import api, models
from vptq_core.quant import rotate
from vptq_core.quant.config import ScalarConfig
from vptq_core.storage.checkpoint import load_quantized

IDS = torch.tensor([[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.double()


def _with_norms(model):
    """Norm weights away from 1, so that folding them is checked (random models start at exactly 1)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
    return model


def test_random_orthogonal_is_orthogonal_and_seeded():
    q = rotate.random_orthogonal(48, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(48, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(q, rotate.random_orthogonal(48, seed=3))
    assert not torch.allclose(q, rotate.random_orthogonal(48, seed=4))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_a_rotated_model_computes_what_the_original_does(family):
    model, _ = models.tiny_random_model(family, seed=1)
    model = _with_norms(model)
    before = _logits(model)
    q_before = model.model.layers[0].self_attn.q_proj.weight.clone()
    rotate.rotate_model_(model, seed=0)
    assert not torch.allclose(model.model.layers[0].self_attn.q_proj.weight, q_before, atol=1e-3)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not model.config.tie_word_embeddings
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
    torch.testing.assert_close(_logits(model), before, atol=2e-4, rtol=1e-4)


def test_a_family_whose_norms_cannot_fold_is_refused_by_name():
    model, _ = models.tiny_random_model("gemma3", seed=0)
    with pytest.raises(ValueError, match=r"rotate: .*'gemma3_text'.*llama, mistral, qwen2, qwen3"):
        rotate.rotate_model_(model, seed=0)


@pytest.mark.parametrize("shard_bytes", [None, 40_000])
def test_the_rotated_directory_loads_as_the_same_model(tmp_path, monkeypatch, shard_bytes):
    model, tok = models.tiny_random_model("llama", seed=2)
    model = _with_norms(model)
    src = tmp_path / "src"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    if shard_bytes:
        monkeypatch.setattr(rotate, "SHARD_BYTES", shard_bytes)
    out = rotate.rotated_dir(src, seed=7, cache=tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert (out / "tokenizer.json").is_file()
    assert (out / "model.safetensors.index.json").is_file() == bool(shard_bytes)
    rotated, _ = models.load_model(str(out), dtype=torch.float32)
    torch.testing.assert_close(_logits(rotated), _logits(model), atol=2e-4, rtol=1e-4)
    # the same as rotating in memory with the same seed
    in_memory = rotate.rotate_model_(models.load_model(str(src), dtype=torch.float32)[0], seed=7)
    for name, tensor in in_memory.state_dict().items():
        torch.testing.assert_close(rotated.state_dict()[name], tensor, atol=1e-6, rtol=1e-6, msg=name)
    # written once: a second call reuses the directory
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert rotate.rotated_dir(src, seed=7, cache=tmp_path / "cache") == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
    assert rotate.rotated_dir(src, seed=8, cache=tmp_path / "cache") != out


# ---------------------------------------------------------------------------------------- through a whole run
RTN8 = ScalarConfig(bits=8, group_size=32, rotate=True)


def _saved(directory, family="llama"):
    model, tok = models.tiny_random_model(family, seed=0, num_layers=3)
    model = _with_norms(model)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory, model


def _quantized_logits(path):
    model, _ = load_quantized(path, head_bits=0)
    return _logits(model.float())


def test_a_rotated_run_streamed_or_whole_writes_the_same_checkpoint_of_the_same_model(tmp_path, calib, monkeypatch):
    monkeypatch.setattr(api, "cache_dir", lambda: tmp_path / "cache")
    directory, original = _saved(tmp_path / "src")
    streamed, summary = api.quantize_to_dir(str(directory), "rtn", RTN8, calib, tmp_path / "s", stream=True)
    assert summary["streaming"] == "on" and summary["rotated"] is True
    whole, summary = api.quantize_to_dir(str(directory), "rtn", RTN8, calib, tmp_path / "w", stream=False)
    assert summary["streaming"] == "off"
    assert (streamed / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    saved = load_file(str(streamed / "model.safetensors"))
    assert "lm_head.weight" in saved and not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert json.loads((streamed / "config.json").read_text())["tie_word_embeddings"] is False
    assert api.source_model_of(str(streamed)) == str(directory)  # evaluation compares with the model chosen
    # 8-bit grids on the rotated linears: the original model's logits, within the grid's error
    torch.testing.assert_close(_quantized_logits(streamed), _logits(original), atol=0.05, rtol=0)
    unrotated, _ = api.quantize_to_dir(str(directory), "rtn", dataclasses.replace(RTN8, rotate=False), calib,
                                       tmp_path / "u")
    assert not torch.equal(load_file(str(unrotated / "model.safetensors"))["model.embed_tokens.weight"],
                           saved["model.embed_tokens.weight"])


def test_a_model_built_in_code_is_rotated_in_memory(tmp_path, calib):
    out, _ = api.quantize_to_dir("tiny-random-llama", "rtn", RTN8, calib, tmp_path / "m")
    original, _ = models.load_model("tiny-random-llama")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    torch.testing.assert_close(_quantized_logits(out), _logits(original), atol=0.05, rtol=0)


def test_a_rotated_run_of_a_family_it_cannot_rotate_is_refused_before_it_loads(tmp_path, calib, monkeypatch):
    monkeypatch.setattr(api, "cache_dir", lambda: tmp_path / "cache")
    directory, _ = _saved(tmp_path / "gemma", family="gemma3")
    with pytest.raises(ValueError, match=r"rotate: the residual stream of a 'gemma3_text' model cannot be rotated"):
        api.quantize_to_dir(str(directory), "rtn", RTN8, calib, tmp_path / "g")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))


@pytest.mark.parametrize("mode,family,expected", [("auto", "llama", True), ("auto", "gemma3_text", False),
                                                  (False, "llama", False), (True, "qwen2", True)])
def test_auto_rotates_the_families_it_can(mode, family, expected):
    assert rotate.rotates(mode, family) is expected


def test_auto_leaves_a_family_it_cannot_rotate_as_it_is(tmp_path, calib, monkeypatch):
    monkeypatch.setattr(api, "cache_dir", lambda: tmp_path / "cache")
    directory, _ = _saved(tmp_path / "gemma", family="gemma3")
    out, summary = api.quantize_to_dir(str(directory), "rtn", dataclasses.replace(RTN8, rotate="auto"), calib,
                                       tmp_path / "g")
    assert summary["rotated"] is False
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_qwen3_with_its_head_norms_is_rotated_to_the_same_function():
    """Qwen3 normalises q and k per head after the projections: untouched by a rotation of their inputs."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_hidden_layers=2, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = _with_norms(AutoModelForCausalLM.from_config(config).eval())
    before = _logits(model)
    rotate.rotate_model_(model, seed=1)
    assert not torch.equal(model.model.layers[0].self_attn.q_norm.weight, torch.ones(16))  # kept, not folded
    torch.testing.assert_close(_logits(model), before, atol=2e-4, rtol=1e-4)
