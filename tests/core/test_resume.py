"""Long jobs survive: finished blocks are written to <out>/.partial as they finish; a stopped or killed run
resumes from its last finished block and writes the very same checkpoint; a resume with anything different
is refused."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vptq_core.api import quantize_to_dir
from vptq_core.cli import main
from vptq_core.models import tiny_random_model
from vptq_core.quant.config import CalibConfig, LRQConfig, ScalarConfig, VPTQConfig
from vptq_core.resume import PartialRun

ROOT = Path(__file__).resolve().parents[2]
TINY_VQ = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0, finetune_iters=2)
CASES = [
    ("vptq", TINY_VQ),
    ("lrq", LRQConfig(bits=3, iters=3)),  # target_chain "fp" (the default): the original's activations resume too
    ("lrq", LRQConfig(bits=3, iters=3, target_chain="quantized")),
    ("gptq", ScalarConfig(bits=4, group_size=32, act_bits=8, act_granularity="tensor")),
    # half the calibration written by the model: sampled once, before block 0; the resume reuses the activations
    ("gptq", ScalarConfig(bits=4, group_size=32, calib_sampled_share=0.5)),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("model") / "llama3"
    model, tok = tiny_random_model("llama", num_layers=3)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory


def stop_after(layers: int):
    seen = []
    return seen.append, lambda: len(seen) >= layers


def assert_identical(a: Path, b: Path) -> None:
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    ra, rb = (json.loads((p / "quant_report.json").read_text()) for p in (a, b))
    drop = ("seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in ra["layers"]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in rb["layers"]]
    assert ra["sizes"] == rb["sizes"]


@pytest.mark.parametrize("method,config", CASES, ids=[c[0] for c in CASES])
def test_stopped_run_resumes_to_the_same_checkpoint(tmp_path, model_dir, calib, method, config):
    full, summary = quantize_to_dir(str(model_dir), method, config, calib, tmp_path / "full")
    assert summary["resumed_from_block"] == 0 and not (full / ".partial").exists()

    # stops when block 0 is done; with fine-tuning (which polls should_stop too, after block 0's 7 linears) inside
    # block 1, after its first linear
    on_layer, should_stop = stop_after(8 if getattr(config, "finetune_iters", 0) else 7)
    out, summary = quantize_to_dir(str(model_dir), method, config, calib, tmp_path / "cut", on_layer=on_layer,
                                   should_stop=should_stop)
    assert summary["cancelled"] and summary["blocks_done"] == 1
    assert not (out / "model.safetensors").exists()
    assert PartialRun(out).status() == {"blocks_done": 1, "blocks_total": 3}

    replayed = []
    out, summary = quantize_to_dir(str(model_dir), method, config, calib, out, resume=True, on_layer=replayed.append)
    assert summary["resumed_from_block"] == 1 and summary["blocks_done"] == 3 and not summary["cancelled"]
    assert len(replayed) == 21 and [r.block for r in replayed[:7]] == [0] * 7  # block 0's reports come back first
    assert not (out / ".partial").exists()
    assert_identical(full, out)


@pytest.mark.slow  # two CLI subprocesses; the in-process stop-and-resume tests above stay in the fast suite
def test_killed_process_resumes_from_the_last_finished_block(tmp_path, model_dir, text_file):
    flags = ["quantize", "--model", str(model_dir), "--method", "vptq", "--vector-len", "4", "--centroids", "16",
             "--kmeans-iters", "2", "--outlier-percent", "0", "--calib-text", text_file, "--calib-samples", "4",
             "--seqlen", "32", "--quiet"]
    assert main([*flags, "--out", str(tmp_path / "full")]) == 0
    # A separate process that dies (SIGKILL: no cleanup, no exception handlers) in the middle of block 2.
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from vptq_core.api import quantize_to_dir
        from vptq_core.quant.config import CalibConfig, VPTQConfig
        seen = []
        def on_layer(report):
            seen.append(report)
            if len(seen) == 17:
                os.kill(os.getpid(), signal.SIGKILL)
        quantize_to_dir({str(model_dir)!r}, "vptq", VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2,
                        outlier_percent=0.0), CalibConfig(text={text_file!r}, samples=4, seqlen=32, seed=0),
                        {str(tmp_path / "cut")!r}, on_layer=on_layer)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert PartialRun(tmp_path / "cut").status() == {"blocks_done": 2, "blocks_total": 3}
    assert main([*flags, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    assert_identical(tmp_path / "full", tmp_path / "cut")


def test_a_crash_between_a_blocks_files_and_its_commit(tmp_path, model_dir, calib, monkeypatch):
    config = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0)
    full, _ = quantize_to_dir(str(model_dir), "vptq", config, calib, tmp_path / "full")
    commits = []
    original = PartialRun._write_manifest

    def failing(self, data):
        commits.append(data["blocks_done"])
        if data["blocks_done"] == 2:
            raise OSError("disk full")
        original(self, data)

    monkeypatch.setattr(PartialRun, "_write_manifest", failing)
    with pytest.raises(OSError, match="disk full"):
        quantize_to_dir(str(model_dir), "vptq", config, calib, tmp_path / "cut")
    monkeypatch.setattr(PartialRun, "_write_manifest", original)
    partial = PartialRun(tmp_path / "cut")
    assert partial.status()["blocks_done"] == 1 and (partial.dir / "block-00001.safetensors").is_file()
    out, summary = quantize_to_dir(str(model_dir), "vptq", config, calib, tmp_path / "cut", resume=True)
    assert summary["resumed_from_block"] == 1
    assert_identical(full, out)


def test_resume_with_different_settings_is_refused(tmp_path, model_dir, calib):
    config = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0)
    on_layer, should_stop = stop_after(7)
    quantize_to_dir(str(model_dir), "vptq", config, calib, tmp_path / "cut", on_layer=on_layer,
                    should_stop=should_stop)
    other = VPTQConfig(vector_len=4, num_centroids=32, kmeans_iters=2, outlier_percent=0.0)
    with pytest.raises(ValueError, match=r"different settings \(num_centroids: 16 -> 32\)"):
        quantize_to_dir(str(model_dir), "vptq", other, calib, tmp_path / "cut", resume=True)
    with pytest.raises(ValueError, match=r"different calibration \(samples: 4 -> 2\).*calibration data"):
        quantize_to_dir(str(model_dir), "vptq", config, CalibConfig(text=calib.text, samples=2, seqlen=32),
                        tmp_path / "cut", resume=True)
    with pytest.raises(ValueError, match=r"different model \('.*llama3' -> 'tiny-random-llama'\)"):
        quantize_to_dir("tiny-random-llama", "vptq", config, calib, tmp_path / "cut", resume=True)
    with pytest.raises(ValueError, match=r"different method \('vptq' -> 'rtn'\)"):
        quantize_to_dir(str(model_dir), "rtn", ScalarConfig(bits=4), calib, tmp_path / "cut", resume=True)
    assert PartialRun(tmp_path / "cut").status()["blocks_done"] == 1  # a refused resume keeps the run


def test_cli_refuses_to_overwrite_an_unfinished_run(tmp_path, model_dir, calib, text_file, capsys):
    config = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0)
    on_layer, should_stop = stop_after(7)
    quantize_to_dir(str(model_dir), "vptq", config, calib, tmp_path / "cut", on_layer=on_layer,
                    should_stop=should_stop)
    flags = ["quantize", "--model", str(model_dir), "--method", "vptq", "--vector-len", "4", "--centroids", "16",
             "--kmeans-iters", "2", "--outlier-percent", "0", "--calib-text", text_file, "--calib-samples", "4",
             "--seqlen", "32", "--quiet", "--out", str(tmp_path / "cut")]
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds an unfinished run (1 of 3 blocks done" in err and "--resume" in err
    assert main([*flags[:8], "32", *flags[9:], "--resume"]) == 2  # --centroids 32
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "num_centroids: 16 -> 32" in err
    assert main([*flags, "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed_from_block"] == 1


def test_resume_without_a_finished_block_and_starting_over(tmp_path, calib):
    config = ScalarConfig(bits=4, group_size=32)
    on_layer, should_stop = stop_after(3)  # stopped inside block 0: nothing finished
    _, summary = quantize_to_dir("tiny-random-llama", "rtn", config, calib, tmp_path / "x", on_layer=on_layer,
                                 should_stop=should_stop)
    assert summary["cancelled"] and PartialRun(tmp_path / "x").status()["blocks_done"] == 0
    out, summary = quantize_to_dir("tiny-random-llama", "rtn", config, calib, tmp_path / "x", resume=True)
    assert summary["resumed_from_block"] == 0 and (out / "model.safetensors").is_file()
    # resume=False discards an unfinished run and starts over
    on_layer, should_stop = stop_after(7)
    quantize_to_dir("tiny-random-llama", "rtn", config, calib, tmp_path / "y", on_layer=on_layer,
                    should_stop=should_stop)
    out, summary = quantize_to_dir("tiny-random-llama", "rtn", config, calib, tmp_path / "y")
    assert summary["resumed_from_block"] == 0 and not (out / ".partial").exists()
    assert (tmp_path / "x" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_partial_files_are_safetensors_and_json_only(tmp_path, calib):
    on_layer, should_stop = stop_after(7)
    quantize_to_dir("tiny-random-llama", "rtn", ScalarConfig(bits=4), calib, tmp_path / "x", on_layer=on_layer,
                    should_stop=should_stop)
    names = sorted(p.name for p in (tmp_path / "x" / ".partial").iterdir())
    assert names == ["block-00000.json", "block-00000.safetensors", "inputs-00001.safetensors", "run.json"]
    run = json.loads((tmp_path / "x" / ".partial" / "run.json").read_text())
    assert run["blocks_done"] == 1 and run["fingerprint"]["method"] == "rtn"
    assert os.path.getsize(tmp_path / "x" / ".partial" / "inputs-00001.safetensors") > 4 * 32 * 64 * 4


def test_partial_keeps_each_blocks_trained_norms_in_float32(tmp_path, model_dir, calib):
    """A finished block's norms as fine-tuning left them go to ``.partial`` with the block, so that a resumed
    run saves them rather than the original's it reads from disk."""
    config = dataclasses.replace(TINY_VQ, finetune_iters=4, finetune_norm_lr=0.05, finetune_holdout=0.0)
    full, _ = quantize_to_dir(str(model_dir), "vptq", config, calib, tmp_path / "full")
    on_layer, should_stop = stop_after(8)
    out, summary = quantize_to_dir(str(model_dir), "vptq", config, calib, tmp_path / "cut", on_layer=on_layer,
                                   should_stop=should_stop)
    assert summary["blocks_done"] == 1
    kept = PartialRun(out).dense_tensors()
    assert sorted(kept) == ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"]
    original, saved = load_file(str(model_dir / "model.safetensors")), load_file(str(full / "model.safetensors"))
    for name, tensor in kept.items():
        assert tensor.dtype == torch.float32 and not torch.equal(tensor, original[name].float())
        assert torch.equal(tensor, saved[name])
    with safe_open(str(out / ".partial" / "block-00000.safetensors"), "pt") as f:
        assert {key for key in f.keys() if key.startswith("dense::")} == {f"dense::{name}" for name in kept}  # noqa: SIM118
