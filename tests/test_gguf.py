"""Local GGUF files as model sources: a tiny llama written here with the ``gguf`` package (the metadata keys
transformers' GGUF loader reads), loaded through ``load_model`` / the CLI, cached once, quantized and
round-tripped; and one clear line for every way a model path can be wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from vptq_core import models
from vptq_core.cli import main
from vptq_core.models import load_model, tiny_random_llama
from vptq_core.quant.config import ScalarConfig
from vptq_core.quant.pipeline import quantize_model
from vptq_core.storage.checkpoint import load_quantized

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache for the dense copies of every test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("VPTQ_CORE_CACHE", str(root))
    return root


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py LlamaModel.permute); the loader undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, tok, arch: str = "llama", tokenizer: bool = True) -> Path:
    """``model`` (a llama) as an F32 GGUF file with the metadata llama.cpp writes."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny random llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if tokenizer:  # byte-level BPE ("gpt2"): the byte alphabet, no merges, ChatML specials as control tokens
        vocab = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
        w.add_tokenizer_model("gpt2")
        w.add_token_list(vocab)
        w.add_token_types([3 if t.startswith("<|") else 1 for t in vocab])
        w.add_token_scores([0.0] * len(vocab))
        w.add_bos_token_id(tok.bos_token_id)
        w.add_eos_token_id(tok.eos_token_id)
        w.add_pad_token_id(tok.pad_token_id)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])  # no output.weight: tied head
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.fixture
def tiny_gguf(tmp_path) -> tuple[Path, torch.nn.Module, object]:
    model, tok = tiny_random_llama()
    return write_gguf(tmp_path / "tiny-llama.F32.gguf", model, tok), model, tok


def test_gguf_file_loads_as_the_model_it_holds(tiny_gguf, cache):
    path, original, tok = tiny_gguf
    model, gtok = load_model(str(path))
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32 and not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert getattr(model, "hf_quantizer", None) is None and "quantization_config" not in model.config.to_dict()
    assert torch.equal(logits(model), logits(original))
    text = "héllo, wörld <|im_end|>"
    assert gtok(text)["input_ids"] == tok(text)["input_ids"]
    (dense,) = (cache / "gguf").iterdir()
    assert dense.name.startswith("tiny-llama.F32-") and (dense / "model.safetensors").is_file()
    source = json.loads((dense / "vptq_core_source.json").read_text())
    assert source["gguf"] == str(path.resolve()) and source["size"] == path.stat().st_size


def test_converted_once_and_again_when_the_file_changes(tiny_gguf, cache, monkeypatch):
    path, _, tok = tiny_gguf
    load_model(str(path))
    first = sorted((cache / "gguf").iterdir())

    def no_conversion(_path):
        raise AssertionError("converted again")

    with monkeypatch.context() as m:
        m.setattr(models, "_convert_gguf", no_conversion)
        load_model(str(path))  # the cached copy
    other, _ = tiny_random_llama(seed=1)
    write_gguf(path, other, tok)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a distinct mtime
    model, _ = load_model(str(path))
    assert torch.equal(logits(model), logits(other))
    second = sorted((cache / "gguf").iterdir())
    assert len(second) == 1 and second != first  # the stale copy is gone


def test_gguf_through_the_cli_quantize_and_reload(tiny_gguf, tmp_path, capsys):
    path, original, tok = tiny_gguf
    text = tmp_path / "calib.txt"
    text.write_text("Plain words for a small calibration text, repeated. " * 40, encoding="utf-8")
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", str(path), "--method", "rtn", "--bits", "4", "--group-size", "32",
               "--calib-text", str(text), "--calib-samples", "4", "--seqlen", "32", "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "quant_report.json").read_text())
    assert report["model"]["source"] == str(path) and len(report["layers"]) == 14
    # the same calibration through the library gives the same fake-quantized model as the checkpoint
    from vptq_core.data import calibration_windows

    calib = calibration_windows(tok, str(text), 4, 32, 0)
    fake, _ = quantize_model(original, calib, "rtn", ScalarConfig(bits=4, group_size=32))
    loaded, loaded_tok = load_quantized(out, dtype=torch.float32)
    assert loaded_tok is not None
    # the CLI stores bf16 by default: close to the float32 fake-quantized model, not equal
    torch.testing.assert_close(logits(loaded), logits(fake), rtol=0.05, atol=0.05)


# ------------------------------------------------------------------------------------------- bad input
def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(ValueError, match=r"GGUF file '.*nothing\.gguf' not found") as info:
        load_model(str(tmp_path / "nothing.gguf"))
    _one_line(info)
    with pytest.raises(ValueError, match="model path '.*/no/such/dir' not found"):
        load_model(str(tmp_path / "no" / "such" / "dir"))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model", encoding="utf-8")
    with pytest.raises(ValueError, match="is not a GGUF file") as info:
        load_model(str(text))
    _one_line(info)
    config = tmp_path / "config.json"
    config.write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(str(config))


def test_damaged_gguf(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])  # inside the metadata
    with pytest.raises(ValueError, match="damaged GGUF header") as info:
        load_model(str(cut))
    _one_line(info)


def test_architecture_the_gguf_loader_does_not_support(tmp_path):
    model, tok = tiny_random_llama()
    path = write_gguf(tmp_path / "bert.gguf", model, tok, arch="bert")
    with pytest.raises(ValueError, match=r"GGUF architecture 'bert' is not supported by transformers' GGUF loader "
                                         r"\(supported: .*llama.*\)") as info:
        load_model(str(path))
    _one_line(info)


def test_gguf_without_tokenizer(tmp_path):
    model, tok = tiny_random_llama()
    path = write_gguf(tmp_path / "bare.gguf", model, tok, tokenizer=False)
    with pytest.raises(ValueError, match="cannot build a tokenizer from the GGUF metadata") as info:
        load_model(str(path))
    _one_line(info)


def test_cli_reports_a_bad_gguf_in_one_line(tmp_path, capsys):
    rc = main(["quantize", "--model", str(tmp_path / "missing.gguf"), "--method", "rtn", "--out",
               str(tmp_path / "out"), "--quiet"])
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert rc == 2 and len(errors) == 1 and "missing.gguf' not found" in errors[0]
    assert not (tmp_path / "out").exists()
