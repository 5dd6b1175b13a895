"""Standard tasks through lm-eval: a small multiple-choice task written here (a YAML config over a local JSONL
file) scores the original the same through the project's wrapper as through lm-eval's own HF model; the
quantized side runs beside it; tasks that are unknown or whose data cannot be fetched stop in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval_task import REMOTE, TASK, write_tasks  # noqa: E402

from vptq_core.cli import main  # noqa: E402
from vptq_core.models import load_model, tiny_random_llama  # noqa: E402
from vptq_core.tasks import TaskSettings, task_manager, task_scores  # noqa: E402


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def original_dir(tmp_path_factory) -> Path:
    """The tiny llama as a plain Hugging Face directory: what lm-eval's own HF model loads by path."""
    root = tmp_path_factory.mktemp("original")
    model, tok = tiny_random_llama()
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def manager(tasks_dir):
    return task_manager(tasks_dir)


def lm_eval_own(original_dir: Path, manager) -> dict:
    """lm-eval's HF model loading the directory itself, same settings as TaskSettings(batch_size=2)."""
    lm = HFLM(pretrained=str(original_dir), device="cpu", dtype="float32", batch_size=2)
    out = simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, log_samples=False, random_seed=0,
                          numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, bootstrap_iters=1000)
    return out["results"][TASK]


def test_wrapper_scores_the_original_as_lm_eval_does(original_dir, manager):
    model, tok = load_model(str(original_dir))
    ours = task_scores(model, tok, [TASK], TaskSettings(batch_size=2), manager)
    theirs = lm_eval_own(original_dir, manager)
    assert ours[(TASK, "acc")] == (theirs["acc,none"], theirs["acc_stderr,none"])
    assert ours[(TASK, "acc_norm")] == (theirs["acc_norm,none"], theirs["acc_norm_stderr,none"])
    assert 0 < theirs["acc_stderr,none"]  # a real spread over the eight items, not a constant


@pytest.mark.slow  # a quantization and three lm-eval runs
def test_checkpoint_and_original_side_by_side(original_dir, tasks_dir, manager, tmp_path, text_file, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(["quantize", "--model", str(original_dir), "--method", "rtn", "--bits", "2", "--calib-text",
                 text_file, "--calib-samples", "2", "--seqlen", "32", "--out", str(ckpt), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["tasks", "--model", str(ckpt), "--tasks", TASK, "--include-path", str(tasks_dir),
                 "--batch-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["metric"]: r for r in out["rows"]}
    assert set(rows) == {"acc", "acc_norm"} and out["settings"]["batch_size"] == 2
    theirs = lm_eval_own(original_dir, manager)  # the reference is the checkpoint's source directory
    assert (rows["acc"]["original"], rows["acc"]["original_stderr"]) == (theirs["acc,none"],
                                                                           theirs["acc_stderr,none"])
    quantized = [rows[m]["quantized"] for m in rows]
    assert all(v is not None and 0 <= v <= 1 for v in quantized)
    # the markdown table with --limit: both columns and the settings line
    assert main(["tasks", "--model", str(ckpt), "--tasks", TASK, "--include-path", str(tasks_dir),
                 "--limit", "4", "--batch-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "| task | metric | original | quantized | Δ |" in text and f"| {TASK} | acc |" in text
    assert "limit 4, batch size 2, seed 0" in text


def _error(capsys, args: list[str]) -> str:
    capsys.readouterr()
    rc = main(["tasks", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith("python -m vptq_core tasks: error: "), err
    return err


def test_unknown_task_is_one_line(tasks_dir, capsys):
    err = _error(capsys, ["--model", "tiny-random-llama", "--tasks", "no_such_task_anywhere",
                          "--include-path", str(tasks_dir)])
    assert "unknown lm-eval task 'no_such_task_anywhere'" in err


def test_task_data_that_cannot_be_fetched_is_one_line(tasks_dir, capsys, monkeypatch):
    # offline as on a machine without the hub: no retries, the answer at once
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    err = _error(capsys, ["--model", "tiny-random-llama", "--tasks", f"{TASK},{REMOTE}",
                          "--include-path", str(tasks_dir)])
    assert f"task data cannot be fetched for {REMOTE!r}" in err


def test_bad_settings(capsys):
    assert "--limit must be positive" in _error(capsys, ["--model", "m", "--tasks", TASK, "--limit", "0"])
    assert "name at least one lm-eval task" in _error(capsys, ["--model", "m", "--tasks", " , "])

