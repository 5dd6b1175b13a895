"""End to end through the command line on the tiny model: quantize -> save -> eval."""

import json

import pytest

from vptq_core.cli import main


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
