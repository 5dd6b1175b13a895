"""The presets table: every preset of every method resolves to a valid config, the W4A8 and "-best" presets hold
their recipes, the CLI lists them and refuses an unknown one in one line, and ``--method lrq --preset w4a8`` runs
end to end on the tiny model into a checkpoint that loads back."""

from __future__ import annotations

import json

import pytest
import torch

from vptq_core.cli import build_parser
from vptq_core.cli import main as cli_main
from vptq_core.quant import methods
from vptq_core.quant.config import PRESET_TIME_BUDGET, LRQConfig
from vptq_core.studio import form

TINY = "tiny-random-llama"


def test_every_preset_resolves_to_a_valid_config_of_its_method():
    for m in methods.all_methods():
        for name in m.presets:
            config = m.make_config(m.preset(name))
            assert isinstance(config, m.config_class), (m.name, name)
            assert config.to_dict().items() >= {k: v for k, v in m.preset(name).items()}.items(), (m.name, name)


def test_the_w4a8_preset_is_the_recipe():
    config = methods.get("lrq").make_config(methods.get("lrq").preset("w4a8"))
    assert isinstance(config, LRQConfig)
    recipe = {"bits": 4, "group_size": 128, "act_bits": 8, "act_granularity": "token_asym", "target_chain": "fp",
              "iters": 64, "lr": 5e-3, "rank": 0, "clip_search": True, "distill_iters": 48,
              "distill_data": "calibration", "distill_lr": 2e-3, "distill_eval_every": 8, "calib_sampled_share": 0.5,
              "time_budget": PRESET_TIME_BUDGET}
    assert {k: getattr(config, k) for k in recipe} == recipe
    assert PRESET_TIME_BUDGET < 600  # the preset promises a run within 10 minutes


@pytest.mark.parametrize("method,best,base", [("vptq", "2.5-best", "2.5 bits"), ("vptq", "3.5-best", "3.5 bits"),
                                              ("lrq", "w4a8-best", "w4a8")])
def test_a_best_preset_is_its_tier_without_a_time_budget(method, best, base):
    m = methods.get(method)
    fast, slow = m.make_config(m.preset(base)), m.make_config(m.preset(best))
    assert fast.time_budget == PRESET_TIME_BUDGET and slow.time_budget == 0.0
    assert m.bits(fast, 576, 1536) == m.bits(slow, 576, 1536)  # the same bits: only the effort differs
    assert slow.distill_iters >= fast.distill_iters > 0
    if method == "vptq":
        assert (slow.bits_budget, slow.allocation, slow.vector_len) == (fast.bits_budget, fast.allocation,
                                                                        fast.vector_len)
    else:  # the block training and the distillation step chosen for the tier: the best preset only runs longer
        recipe = ("iters", "lr", "distill_lr", "calib_sampled_share", "act_granularity")
        assert [getattr(slow, k) for k in recipe] == [getattr(fast, k) for k in recipe]


def test_the_cli_and_the_app_list_every_preset():
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["quantize"].format_help().split())
    for m in methods.all_methods():
        for name in m.presets:
            assert name in help_text, name
    assert {"w4a8", "w4a8-best", "2.5-best", "3.5-best"} <= set(form.preset_names())


def test_an_unknown_preset_is_refused_in_one_line_naming_the_allowed_ones(tmp_path, capsys):
    rc = cli_main(["quantize", "--model", TINY, "--method", "lrq", "--preset", "w4a16", "--out", str(tmp_path / "x"),
                   "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.endswith("method 'lrq' has no preset 'w4a16'; presets: 2.5 bits, 3.5 bits, 4.5 bits, w4a8, w4a8-best")
    assert not (tmp_path / "x").exists()
    rc = cli_main(["quantize", "--model", TINY, "--method", "vptq", "--preset", "w4a8", "--out", str(tmp_path / "y"),
                   "--quiet"])
    assert rc == 2 and "2.5-best, 3.5-best" in capsys.readouterr().err


def test_the_w4a8_preset_through_the_cli_writes_a_checkpoint_that_loads_back(tmp_path, capsys):
    from vptq_core.storage.checkpoint import load_quantized

    out = tmp_path / "w4a8"
    # tiny sizes: groups of 32 fit the 64-wide layers; one LRQ step per block, two distillation steps
    rc = cli_main(["quantize", "--model", TINY, "--method", "lrq", "--preset", "w4a8", "--group-size", "32",
                   "--iters", "1", "--distill-iters", "2", "--distill-eval-every", "1", "--calib-samples", "4",
                   "--seqlen", "32", "--threads", "1", "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads(captured.out)
    config = summary["config"]
    assert (config["bits"], config["group_size"], config["act_bits"], config["act_granularity"]) == (4, 32, 8,
                                                                                                     "token_asym")
    assert config["distill_lr"] == 2e-3 and config["lr"] == 5e-3 and config["time_budget"] == PRESET_TIME_BUDGET
    assert summary["model_metrics"]["distill"]["steps"] == 2
    model, tok = load_quantized(out, dtype=torch.float32, head_bits=0)
    layers = json.loads((out / "config.json").read_text())["quantization_config"]["config_for_layers"]
    assert layers and all(layer["bits"] == 4 for layer in layers.values())
    ids = tok("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
