"""End to end through the command line on the tiny model: quantize -> save -> eval."""

import json
import re

import pytest

from vptq_core.cli import build_parser, main, method_config_from_args, setting_flags


def test_quantize_save_eval_round_trip(tmp_path, text_file, capsys):
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", "tiny-random-llama", "--method", "vptq", "--vector-len", "4",
               "--centroids", "16", "--res-centroids", "4", "--kmeans-iters", "3", "--outlier-percent", "0",
               "--calib-text", text_file,
               "--calib-samples", "4", "--seqlen", "32", "--out", str(out), "--quiet"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["index_bits_per_weight"] == pytest.approx(1.5)
    written = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "quant_report.json", "tokenizer.json"} <= written
    config = json.loads((out / "config.json").read_text())
    layer = config["quantization_config"]["config_for_layers"]["model.layers.0.self_attn.q_proj"]
    assert config["quantization_config"]["quant_method"] == "vptq"
    assert layer["vector_lens"][1] == 4 and layer["num_centroids"][1] == 16 and layer["num_res_centroids"][1] == 4
    report = json.loads((out / "quant_report.json").read_text())
    assert len(report["layers"]) == 14 and report["model"]["source"] == "tiny-random-llama"
    assert report["settings"]["num_res_centroids"] == 4 and "torch" in report["versions"]

    rc = main(["eval", "--model", str(out), "--text", text_file, "--seqlen", "32", "--max-windows", "4", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"perplexity", "kl_divergence", "top1_agreement", "seqlen", "windows", "tokens"} <= set(result)
    assert result["windows"] == 4 and result["tokens"] == 4 * 31
    assert result["kl_divergence"] > 0 and 0 < result["top1_agreement"] <= 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["quantize", "--model", "tiny-random-llama", "--method", "vptq", "--centroids", "100", "--out", "x"],
         "num_centroids must be a power of two in 2..65536, got 100"),
        (["quantize", "--model", "tiny-random-llama", "--method", "awq", "--out", "x"], "invalid choice: 'awq'"),
        (["quantize", "--model", "tiny-random-llama", "--method", "gptq", "--bits", "12", "--out", "x"],
         "bits must be in 1..8, got 12"),
        (["quantize", "--model", "tiny-random-llama", "--method", "rtn", "--calib-text", "/no/file", "--out", "x"],
         "--calib-text must be one of wiki, pydocs or an existing file"),
        (["eval", "--model", "tiny-random-llama", "--seqlen", "0"], "expected a positive integer, got 0"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, message, capsys):
    try:
        rc = main(args)
    except SystemExit as exc:  # argparse errors
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and message in err


# Every method-setting flag the command line has had: flag -> (setting it sets, how it takes its value).
# Generated from the settings' declarations now; this table pins their names, destinations and meanings.
FLAGS = {
    "--vector-len": ("vector_len", "int"), "--centroids": ("num_centroids", "int"),
    "--res-centroids": ("num_res_centroids", "int"), "--outlier-percent": ("outlier_percent", "float"),
    "--outlier-vector-len": ("outlier_vector_len", "int"), "--outlier-centroids": ("outlier_centroids", "int"),
    "--groups": ("group_num", "int"), "--norm": ("enable_norm", "bool"), "--perm": ("enable_perm", "bool"),
    "--codebook-bits": ("codebook_bits", "int"),
    "--kmeans-iters": ("kmeans_iters", "int"), "--finetune-iters": ("finetune_iters", "int"),
    "--layer-bits-cap": ("layer_bits_cap", "float"), "--bits-budget": ("bits_budget", "float"),
    "--allocation": ("allocation", "choice:cap,sensitivity"), "--no-second-order": ("second_order", "false"),
    "--distill-iters": ("distill_iters", "int"), "--distill-data": ("distill_data", "choice:calibration,sampled,mixed"),
    "--calib-sampled-share": ("calib_sampled_share", "float"),
    "--rotate": ("rotate", "words:false,true,auto"), "--time-budget": ("time_budget", "float"),
    "--time-budget-scale": ("time_budget_scale", "choice:fixed,model"),
    "--distill-lr": ("distill_lr", "float"), "--bits": ("bits", "int"), "--group-size": ("group_size", "int"),
    "--no-act-order": ("act_order", "false"), "--rank": ("rank", "int"), "--lr": ("lr", "float"),
    "--iters": ("iters", "int"), "--full-scale": ("full_scale", "true"), "--act-bits": ("act_bits", "int"),
    "--act-granularity": ("act_granularity", "choice:token,token_asym,tensor"),
    "--act-clip": ("act_clip", "choice:absmax,mse"),
    # flags of the settings the app's form shows too
    "--refit-iters": ("refit_iters", "int"), "--distill-samples": ("distill_samples", "int"),
    "--distill-eval-every": ("distill_eval_every", "int"),
    "--sensitivity-windows": ("sensitivity_windows", "int"),
}


def quantize_args(*flags: str, method: str = "vptq"):
    return build_parser().parse_args(["quantize", "--model", "tiny-random-llama", "--method", method, "--out", "x",
                                      *flags])


def test_setting_flags_keep_their_names_destinations_and_meanings():
    untouched = quantize_args()
    generated = {meta.flag: name for group in setting_flags().values() for name, meta in group.items()}
    assert generated == {flag: dest for flag, (dest, _kind) in FLAGS.items()}
    for flag, (dest, kind) in FLAGS.items():
        assert getattr(untouched, dest) is None, flag  # unset: the method's (or the preset's) value
        if kind == "int":
            assert getattr(quantize_args(flag, "3"), dest) == 3
        elif kind == "float":
            assert getattr(quantize_args(flag, "0.5"), dest) == 0.5
        elif kind == "bool":
            no_flag = "--no-" + flag.removeprefix("--")
            assert getattr(quantize_args(flag), dest) is True and getattr(quantize_args(no_flag), dest) is False
        elif kind in ("true", "false"):
            assert getattr(quantize_args(flag), dest) is (kind == "true")
        elif kind.startswith("words:"):  # a choice of bools and words, written as JSON writes the bools
            for word in kind.removeprefix("words:").split(","):
                assert getattr(quantize_args(flag, word), dest) == {"true": True, "false": False}.get(word, word)
            for bad in ("bogus", "True", "1"):
                with pytest.raises(SystemExit):
                    quantize_args(flag, bad)
        else:
            for choice in kind.removeprefix("choice:").split(","):
                assert getattr(quantize_args(flag, choice), dest) == choice
            with pytest.raises(SystemExit):
                quantize_args(flag, "bogus")


def test_flags_and_set_reach_the_config(capsys):
    config = method_config_from_args(quantize_args("--no-second-order", "--no-perm", "--refit-iters", "4",
                                                   "--set", "damp_percent=0.05", "--set", "target_chain=fp"))
    assert (config.second_order, config.enable_perm, config.refit_iters) == (False, False, 4)
    assert (config.damp_percent, config.target_chain) == (0.05, "fp")
    config = method_config_from_args(quantize_args("--no-act-order", "--act-bits", "8", method="gptq"))
    assert (config.act_order, config.act_bits, config.clip_search) == (False, 8, False)
    assert method_config_from_args(quantize_args("--full-scale", "--preset", "3.5", method="lrq")).full_scale
    with pytest.raises(ValueError, match=r"--rank does not apply to --method gptq \(its settings: act_bits, "):
        method_config_from_args(quantize_args("--rank", "4", method="gptq"))
    with pytest.raises(ValueError, match="act_bits must be 4, 8 or 16"):
        method_config_from_args(quantize_args("--act-bits", "6", method="rtn"))
    with pytest.raises(ValueError, match="--set takes NAME=VALUE, got 'damp_percent'"):
        method_config_from_args(quantize_args("--set", "damp_percent"))


def test_help_shows_each_group_with_help_and_defaults(capsys):
    with pytest.raises(SystemExit) as shown:
        main(["quantize", "--help"])
    assert shown.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for group in ("VPTQ:", "scalar grid (GPTQ / RTN / LRQ):", "column order (GPTQ):", "LRQ:",
                  "distillation (every method):", "calibration:"):
        assert group in text
    assert "--vector-len VECTOR_LEN weights per vector (default 6)" in text
    assert "--res-centroids NUM_RES_CENTROIDS residual codebook size; 0 = none (default 0)" in text
    assert "--norm, --no-norm per-input-column normalisation (default False)" in text
    assert "--no-second-order ablation: plain nearest-centroid assignment (default True)" in text
    assert "--group-size GROUP_SIZE weights per scale; 0 = per channel (default gptq, rtn: 128; lrq: 0)" in text
    assert "(default vptq: 0.0025; gptq, rtn, lrq: 0.002)" in text
    assert "--allocation {cap,sensitivity} how --bits-budget is spent" in text
    assert "--calib-sampled-share CALIB_SAMPLED_SHARE share (0..1)" in text and "--calib-text CALIB_TEXT" in text
    assert "--damp-percent" not in text and "--layer-plan" not in text  # --set only; internal


def test_quantize_prints_its_plan_and_names_each_stage_on_the_bar(tmp_path, text_file, capsys, monkeypatch):
    from vptq_core import api
    from vptq_core.quant import cost

    monkeypatch.setattr(api, "measure_speed", lambda device: 1.0)
    monkeypatch.setattr(cost, "KD_SAMPLE_S", cost.KD_SAMPLE_S * 1e6)  # writing priced far over the budget
    rc = main(["quantize", "--model", "tiny-random-llama", "--method", "rtn", "--bits", "4", "--calib-text", text_file,
               "--calib-samples", "4", "--seqlen", "32", "--calib-sampled-share", "0.5", "--time-budget", "60",
               "--out", str(tmp_path / "ckpt")])
    assert rc == 0
    captured = capsys.readouterr()
    plan = re.findall(r"plan: [^\r\n]*", captured.err)
    assert plan[0].startswith("plan: estimated ") and "time budget 60 s" in plan[0]
    assert plan[1].startswith("plan: calib_sampled_share: 0.5 -> 0.0 (writing them ~")
    bar = captured.err.replace("\r", "\n")
    assert bar.index("loading the model") < bar.index("quantizing block 0/2") < bar.index("saving the checkpoint")
    assert "quantizing block 2/2" in bar and "ETA" in bar
    assert json.loads(captured.out)["plan"]["decisions"] == [line.removeprefix("plan: ") for line in plan[1:]]
