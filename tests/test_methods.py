"""The method registry: a toy method registered in this file runs through the pipeline, the CLI and a checkpoint
without touching any other file (README.md, "Adding a method")."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from vptq_core import load_quantized, save_quantized
from vptq_core.cli import main as cli_main
from vptq_core.quant import methods
from vptq_core.quant.bits import scalar_bits
from vptq_core.quant.config import ConfigBase
from vptq_core.quant.methods import Method, QuantResult
from vptq_core.quant.pipeline import quantize_model
from vptq_core.quant.rtn import scalar_result
from vptq_core.quant.states import ScalarLayerState


# ------------------------------------------------------------------- a whole new method, in one place
@dataclass(frozen=True)
class SignConfig(ConfigBase):
    """Sign-magnitude 1 bit: W ≈ alpha * sign(W), alpha per output channel."""

    magnitude: str = "mean"  # alpha = mean |W| of the row ("mean") or its root mean square ("rms")

    def __post_init__(self) -> None:
        if self.magnitude not in ("mean", "rms"):
            raise ValueError(f"magnitude must be 'mean' or 'rms', got {self.magnitude!r}")


def sign_layer(W: torch.Tensor, H: torch.Tensor, config: SignConfig, bias, cache: dict) -> QuantResult:
    W = W.detach().float()
    alpha = W.abs().mean(1, keepdim=True) if config.magnitude == "mean" else W.pow(2).mean(1, keepdim=True).sqrt()
    # Stored as a 1-bit scalar grid: code 1 -> +alpha, code 0 -> -alpha (scale 2*alpha, zero point 0.5).
    state = ScalarLayerState(
        in_features=W.shape[1], out_features=W.shape[0], bits=1, group_size=W.shape[1],
        codes=(W >= 0).to(torch.uint8), scales=2 * alpha, zeros=torch.full_like(alpha, 0.5),
        bias=None if bias is None else bias.detach().clone(), method="sign1",
    )
    return scalar_result(state, W, H)


SIGN = Method(
    name="sign1", label="Sign 1-bit", description="sign-magnitude 1 bit per weight, one magnitude per row",
    config_class=SignConfig, bits=lambda config, out_f, in_f: scalar_bits(out_f, in_f, 1, 0),
    describe=lambda settings: f"sign {settings.get('magnitude')}", presets={"1 bit": {"magnitude": "mean"}},
    quantize_linear=sign_layer,
)


@pytest.fixture
def sign_method():
    methods.register(SIGN)
    yield SIGN
    methods.unregister(SIGN.name)


# ------------------------------------------------------------------------------------------------ tests
def test_registry_lists_builtins_in_order_and_refuses_duplicates():
    assert methods.names()[:4] == ("vptq", "gptq", "rtn", "lrq")
    for method in methods.all_methods():
        assert set(method.presets) >= {"2.5 bits", "3.5 bits", "4.5 bits"}
        assert method.model_bits(method.make_config(), [(64, 64)]).weights == 64 * 64
    with pytest.raises(ValueError, match="a method named 'vptq' is already registered"):
        methods.register(Method(name="vptq", label="x", description="x", config_class=SignConfig,
                                bits=SIGN.bits, describe=SIGN.describe, quantize_linear=sign_layer))
    with pytest.raises(ValueError, match="exactly one of quantize_linear / quantize_block"):
        Method(name="bad", label="x", description="x", config_class=SignConfig, bits=SIGN.bits,
               describe=SIGN.describe)
    with pytest.raises(ValueError, match="magnitude must be 'mean' or 'rms'"):
        Method(name="bad", label="x", description="x", config_class=SignConfig, bits=SIGN.bits,
               describe=SIGN.describe, quantize_linear=sign_layer, presets={"1 bit": {"magnitude": "max"}})


def test_toy_method_through_pipeline_and_checkpoint(sign_method, tiny_model, calib_ids, tmp_path):
    model, tok = tiny_model
    qmodel, result = quantize_model(model, calib_ids, "sign1", SignConfig())
    assert len(result.states) == 14 and result.method == "sign1"
    assert result.bits.index_bits_per_weight == 1.0
    name = "model.layers.1.mlp.down_proj"
    W = model.get_submodule(name).weight.float()
    expected = torch.where(W >= 0, 1.0, -1.0) * W.abs().mean(1, keepdim=True)
    torch.testing.assert_close(qmodel.get_submodule(name).weight.float(), expected)

    out = save_quantized(model, tok, result.states, tmp_path / "sign", dtype=torch.float32)
    packed, _ = load_quantized(out)
    with torch.no_grad():
        torch.testing.assert_close(packed(calib_ids).logits, qmodel(calib_ids).logits, rtol=1e-4, atol=1e-4)
    layer = json.loads((out / "config.json").read_text())["quantization_config"]["config_for_layers"][name]
    assert layer["bits"] == 1 and layer["method"] == "sign1"


def test_toy_method_through_the_cli(sign_method, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = cli_main(["quantize", "--model", "tiny-random-llama", "--method", "sign1", "--preset", "2",
                   "--out", str(out), "--quiet"])
    assert rc == 2 and "method 'sign1' has no preset '2'; presets: 1 bit" in capsys.readouterr().err
    rc = cli_main(["quantize", "--model", "tiny-random-llama", "--method", "sign1", "--preset", "1",
                   "--set", 'magnitude="rms"', "--calib-samples", "2", "--seqlen", "32", "--out", str(out),
                   "--quiet"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == "sign1" and summary["config"] == {"magnitude": "rms"}
    assert summary["index_bits_per_weight"] == 1.0
    packed, _ = load_quantized(out)
    weight = packed.get_submodule("model.layers.0.self_attn.q_proj").dequantize().float()
    row_values = weight.abs()
    torch.testing.assert_close(row_values, row_values[:, :1].expand_as(row_values))  # one magnitude per row
    rc = cli_main(["quantize", "--model", "tiny-random-llama", "--method", "sign1", "--bits", "2", "--out",
                   str(tmp_path / "x"), "--quiet"])
    assert rc == 2 and "--bits does not apply to --method sign1 (its settings: magnitude)" in capsys.readouterr().err
