"""The method registry: a toy method registered in this file runs through the pipeline, the CLI and a checkpoint,
and its settings show in the CLI's flags and the app's form, without touching any other file
(docs/contributing.md, "Adding a method" and "Adding a setting")."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from vptq_core import load_quantized, save_quantized
from vptq_core.cli import build_parser, method_config_from_args
from vptq_core.cli import main as cli_main
from vptq_core.quant import methods
from vptq_core.quant.bits import scalar_bits
from vptq_core.quant.config import ConfigBase
from vptq_core.quant.methods import Method, QuantResult
from vptq_core.quant.pipeline import quantize_model
from vptq_core.quant.rtn import scalar_result
from vptq_core.quant.settings import setting
from vptq_core.quant.states import ScalarLayerState
from vptq_core.studio import form

# ------------------------------------------------------------------- a whole new method, in one place
SIGN_GROUP = "sign 1-bit"  # where the CLI's --help and the app's form show the toy method's settings


@dataclass(frozen=True)
class SignConfig(ConfigBase):
    """Sign-magnitude 1 bit: W ≈ scale * alpha * sign(W), alpha per output channel."""

    magnitude: str = setting("mean", choices=("mean", "rms"), label="magnitude", group=SIGN_GROUP,
                             help="alpha: the mean |W| of the row, or its root mean square")
    scale: float = setting(1.0, lo=0.0, hi=4.0, lo_open=True, label="magnitude scale", hint="× alpha",
                           group=SIGN_GROUP, help="alpha is multiplied by this")


def sign_layer(W: torch.Tensor, H: torch.Tensor, config: SignConfig, bias, cache: dict) -> QuantResult:
    W = W.detach().float()
    alpha = W.abs().mean(1, keepdim=True) if config.magnitude == "mean" else W.pow(2).mean(1, keepdim=True).sqrt()
    alpha = config.scale * alpha
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
    assert summary["method"] == "sign1" and summary["config"] == {"magnitude": "rms", "scale": 1.0}
    assert summary["index_bits_per_weight"] == 1.0
    packed, _ = load_quantized(out)
    weight = packed.get_submodule("model.layers.0.self_attn.q_proj").dequantize().float()
    row_values = weight.abs()
    torch.testing.assert_close(row_values, row_values[:, :1].expand_as(row_values))  # one magnitude per row
    rc = cli_main(["quantize", "--model", "tiny-random-llama", "--method", "sign1", "--bits", "2", "--out",
                   str(tmp_path / "x"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "--bits does not apply to --method sign1 (its settings: magnitude, scale)" in err


# ------------------------------------------------------------- a toy setting: declared once, shown everywhere
def test_toy_setting_is_checked_from_its_declaration(sign_method):
    assert SignConfig(scale=0.5).scale == 0.5
    for bad, message in ((0.0, r"scale must be in \(0.0, 4.0\], got 0.0"), (5, r"scale must be in \(0.0, 4.0\], got 5"),
                         (True, "scale must be a number, got True"), ("1", "scale must be a number, got '1'")):
        with pytest.raises(ValueError, match=message):
            SignConfig(scale=bad)
        with pytest.raises(ValueError, match=message):
            methods.make_config("sign1", {"scale": bad})
    with pytest.raises(ValueError, match="magnitude must be 'mean' or 'rms', got 'max'"):
        SignConfig(magnitude="max")


def test_toy_setting_gets_its_cli_flag(sign_method, tmp_path, capsys):
    with pytest.raises(SystemExit) as shown:
        cli_main(["quantize", "--help"])
    assert shown.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # the help wraps lines
    assert f"{SIGN_GROUP}:" in text
    assert "--scale SCALE alpha is multiplied by this (default 1.0)" in text
    assert "--magnitude {mean,rms} alpha: the mean |W| of the row, or its root mean square (default 'mean')" in text
    out = str(tmp_path / "x")
    rc = cli_main(["quantize", "--model", "tiny-random-llama", "--method", "sign1", "--scale", "5", "--out", out])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.splitlines() == ["python -m vptq_core quantize: error: scale must be in (0.0, 4.0], got 5.0"]
    with pytest.raises(SystemExit) as refused:
        cli_main(["quantize", "--model", "tiny-random-llama", "--method", "sign1", "--magnitude", "max", "--out", out])
    assert refused.value.code == 2 and "argument --magnitude: invalid choice: 'max'" in capsys.readouterr().err
    rc = cli_main(["quantize", "--model", "tiny-random-llama", "--method", "vptq", "--scale", "2", "--out", out])
    assert rc == 2 and "--scale does not apply to --method vptq" in capsys.readouterr().err
    args = build_parser().parse_args(["quantize", "--model", "tiny-random-llama", "--method", "sign1", "--out", out,
                                      "--scale", "0.5", "--magnitude", "rms"])
    assert method_config_from_args(args) == SignConfig(magnitude="rms", scale=0.5)


def test_toy_settings_get_their_form_group(sign_method):
    groups = {g.name: g for g in form.form_groups()}
    sign = groups[SIGN_GROUP]
    assert sign.methods == ("sign1",)  # shown for the toy method only
    assert [[(f.key, f.title, f.kind, f.choices) for f in row] for row in sign.rows] == [[
        ("magnitude", "magnitude", "choice", ("mean", "rms")), ("scale", "magnitude scale (× alpha)", "float", ())]]
    assert sign.fields[1].precision is None and sign.fields[1].help == "alpha is multiplied by this"
    assert all("sign1" not in g.methods for g in groups.values() if g is not sign)
    assert list(groups)[-1] == SIGN_GROUP  # after the built-in groups
    assert form.FIELD_LABELS["scale"] == "magnitude scale"
    assert form.readable("scale must be in (0.0, 4.0], got 5") == "magnitude scale must be in (0.0, 4.0], got 5"
    values = {**form.initial_values(), "scale": 2.0}
    assert form.config_from("sign1", values) == SignConfig(scale=2.0)
    with pytest.raises(ValueError, match=r"scale must be in \(0.0, 4.0\], got 9"):
        form.config_from("sign1", {**values, "scale": 9})


def test_toy_setting_leaves_with_its_method():
    assert SIGN_GROUP not in {g.name for g in form.form_groups()} and "scale" not in form.FIELD_LABELS
