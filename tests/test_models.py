import pytest
import torch

from vptq_core.models import byte_tokenizer, load_model, tiny_random_llama
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


def test_byte_tokenizer_round_trip_and_template():
    tok = byte_tokenizer()
    text = "héllo, wörld! 123"
    assert tok.decode(tok(text)["input_ids"]) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_model_lists_available(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="Available offline: smollm2-135m-instruct, tiny-random-llama"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model("tiny-random-llama", dtype="int3")
