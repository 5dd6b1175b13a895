"""The LM head of a loaded checkpoint at 8 / 4 bits (storage.head): what replaces it, its error bound, the
automatic choice, the tied embedding, and clear errors for bad values in the API and the CLI."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint import PROMPT, vq_states
from torch import nn

from vptq_core.cli import build_parser
from vptq_core.models import load_model, tiny_random_llama
from vptq_core.storage import head as head_mod
from vptq_core.storage.checkpoint import load_quantized, save_quantized
from vptq_core.storage.modules import ScalarQLinear


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, tok = tiny_random_llama()
    path = save_quantized(model, tok, vq_states(model), tmp_path_factory.mktemp("head") / "ckpt",
                          report={"method": "vptq"}, dtype=torch.bfloat16)
    return path


def hidden_and_logits(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        hidden = model.model(PROMPT).last_hidden_state
        return hidden, model.lm_head(hidden).float()


@pytest.mark.parametrize("bits", [8, 4])
def test_head_at_bits_is_round_to_nearest_of_the_stored_head(checkpoint, bits):
    stored, _ = load_quantized(checkpoint, head_bits=0)
    model, _ = load_quantized(checkpoint, head_bits=bits)
    assert type(stored.lm_head) is nn.Linear
    head = model.lm_head
    assert isinstance(head, ScalarQLinear) and head.bits == bits and model.vptq_head_bits == bits
    assert head.scales.dtype == torch.bfloat16 and head.codes.device.type == "cpu"
    W = stored.lm_head.weight.detach().float()
    W_hat = head.dequantize().float()
    # every weight within half a grid step of its group's scale (+ the bf16 rounding of the scale and of the
    # dequantized value)
    step = head.scales.float().repeat_interleave(head.group_size, dim=1)[:, : W.shape[1]]
    assert float((((W_hat - W).abs() - W.abs() * 2**-8) / step).max()) <= 0.5 + 2**-6
    # the tied input embedding still reads the stored matrix
    assert torch.equal(model.model.embed_tokens.weight, stored.model.embed_tokens.weight)
    hidden, logits = hidden_and_logits(model)
    torch.testing.assert_close(hidden, hidden_and_logits(stored)[0], rtol=0, atol=0)
    torch.testing.assert_close(logits, (hidden.float() @ W_hat.T), rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT).logits.float(), logits, rtol=0, atol=0)
    err = float((logits - hidden_and_logits(stored)[1]).abs().max())
    assert err < (0.05 if bits == 8 else 0.5), err


def test_auto_takes_large_cpu_heads_only(checkpoint, monkeypatch):
    model, _ = load_quantized(checkpoint)  # "auto": the tiny head (259 x 64) is below the threshold
    assert type(model.lm_head) is nn.Linear and not hasattr(model, "vptq_head_bits")
    monkeypatch.setattr(head_mod, "AUTO_MIN_WEIGHTS", 259 * 64)
    model, _ = load_quantized(checkpoint)
    assert isinstance(model.lm_head, ScalarQLinear) and model.lm_head.bits == 8
    monkeypatch.setenv("VPTQ_NATIVE", "0")  # no native kernels: the head stays (the fallback is slower)
    model, _ = load_quantized(checkpoint)
    assert type(model.lm_head) is nn.Linear
    assert head_mod.quantize_head(model, 8) == 8 and isinstance(model.lm_head, ScalarQLinear)
    assert head_mod.quantize_head(model, 8) == 0  # already quantized: left as it is


def test_load_model_passes_head_bits(checkpoint):
    model, _ = load_model(str(checkpoint), head_bits="4")
    assert isinstance(model.lm_head, ScalarQLinear) and model.lm_head.bits == 4
    dense, _ = load_model("tiny-random-llama", head_bits=8)  # dense models ignore it
    assert type(dense.lm_head) is nn.Linear


@pytest.mark.parametrize("bad", [3, 16, "x", True, None, 8.0])
def test_bad_head_bits(checkpoint, bad):
    with pytest.raises(ValueError, match="head_bits must be one of auto, 0, 4, 8"):
        load_quantized(checkpoint, head_bits=bad)


def test_cli_head_bits_choices(capsys):
    parser = build_parser()
    assert parser.parse_args(["eval", "--model", "m", "--head-bits", "0"]).head_bits == "0"
    assert parser.parse_args(["chat", "--model", "m"]).head_bits == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--model", "m", "--head-bits", "3"])
    assert "invalid choice: '3'" in capsys.readouterr().err


def test_chat_tab_names_the_head_bits():
    from vptq_core.studio import views

    assert "lookup kernels, LM head 8-bit, cpu" in views.models_md("m", 2**20, "", 2**20, "bfloat16", "cpu", 8)
    assert "LM head" not in views.models_md("m", 2**20, "", 2**20, "bfloat16", "cpu")
