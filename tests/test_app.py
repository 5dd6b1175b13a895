"""The Gradio app driven through its API with gradio_client, in-process on a free local port, on the tiny
model: start jobs and watch layer reports stream in, cancel, finish, evaluate, chat on both sides, download
the archive and load it back; bad settings and bad archives give clear errors; sessions are isolated."""

from __future__ import annotations

import hashlib
import inspect
import math
import re
import socket
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

import app as studio_app  # noqa: E402
from vptq_core.models import TINY  # noqa: E402

STATS = re.compile(r"(\d+) tokens · \*\*([\d.]+) tokens/s\*\*")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("studio")
    settings = studio_app.AppSettings(workdir=workdir, default_model=TINY)
    demo = studio_app.build_app(settings)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_port=port, quiet=True, **studio_app.launch_options(settings))
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}/", studio=demo.studio, workdir=workdir)
    demo.studio.manager.shutdown(timeout=30)
    demo.close()


def job_kwargs(**overrides) -> dict:
    kwargs = dict(model=TINY, custom_model="", method="vptq", vector_len=4, num_centroids=16, num_res_centroids=0,
                  outlier_percent=0, group_num=1, enable_norm=False, enable_perm=True, kmeans_iters=2,
                  finetune_iters=0, bits=2, group_size=32, act_order=True, lrq_rank=0, lrq_iters=5,
                  activations=studio_app.WEIGHT_ONLY,
                  calib_source=studio_app.WIKI_SOURCE, calib_file=None, calib_samples=4, calib_seqlen=64, seed=0)
    kwargs.update(overrides)
    return kwargs


def status(client: Client, job_id: str) -> dict:
    return client.predict(job_id, api_name="/job_status")


def wait_done(client: Client, job_id: str, timeout: float = 180) -> tuple[dict, list[int]]:
    """Poll until the job ends; returns the final status and every layer count seen on the way."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = status(client, job_id)
        seen.append(st["layers_done"])
        if st["status"] not in ("queued", "running"):
            return st, seen
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still running after {timeout} s")


def texts(history) -> list[tuple[str, str]]:
    return [(m["role"], studio_app.message_text(m["content"])) for m in history]


def test_message_content_in_both_formats():
    assert studio_app.message_text("plain") == "plain"
    assert studio_app.message_text([{"type": "text", "text": "a"}, {"type": "file", "file": {"path": "x"}},
                                    {"type": "text", "text": "b"}]) == "ab"
    assert studio_app.message_text({"type": "text", "text": "one block"}) == "one block"
    assert studio_app.message_text(("/tmp/image.png", "alt")) == ""
    history = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"role": "assistant", "content": "hello"}, {"role": "system", "content": "ignored"}]
    assert studio_app.normalize_history(history) == [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"}]


def test_bad_settings_give_clear_errors(served, monkeypatch):
    client = Client(served.url, verbose=False)
    cases = [
        (dict(num_centroids=1000), r"num_centroids must be a power of two in 2\.\.65536, got 1000"),
        (dict(vector_len=0), r"vector_len must be in 1\.\.16, got 0"),
        (dict(method="rtn", bits=9), r"bits must be in 1\.\.8, got 9"),
        (dict(calib_samples=0), r"samples must be in 1\.\.100000, got 0"),
        (dict(method="awq"), r"'awq' .* is not in the list of choices: \['vptq', 'gptq', 'rtn'"),
        (dict(calib_source=studio_app.FILE_SOURCE), r"no file was uploaded"),
        (dict(custom_model="no such model"), r"'no such model' is not a built-in name"),
        (dict(method="rtn", activations="4-bit"), r"4-bit is not in the list of choices: \['16-bit \(weight-only\)'"),
    ]
    for overrides, message in cases:
        with pytest.raises(AppError, match=message):
            client.predict(**job_kwargs(**overrides), api_name="/start")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AppError, match=r"cannot reach the Hugging Face hub to fetch 'someone/model'"):
        client.predict(**job_kwargs(custom_model="someone/model"), api_name="/start")
    assert served.studio.manager.jobs(client.session_hash) == []
    # The live estimate explains instead of raising.
    estimate_inputs = {k: v for k, v in job_kwargs(num_centroids=1000).items() if not k.startswith("calib")}
    assert "num_centroids must be a power of two" in client.predict(**estimate_inputs, api_name="/estimate")
    good = client.predict(**{k: v for k, v in job_kwargs().items() if not k.startswith("calib")},
                          api_name="/estimate")
    assert "**1.000 index bits**" in good and "14 linears in 2 blocks" in good
    with pytest.raises(AppError, match=r"evaluation windows must be in 1\.\.512, got 0"):
        client.predict("anything", 0, 64, api_name="/evaluate")
    client.close()


def test_quantize_cancel_evaluate_chat_download_reload(served, tmp_path):
    from vptq_core.eval import evaluate
    from vptq_core.models import load_model
    from vptq_core.storage.checkpoint import load_quantized
    from vptq_core.studio.chat import ChatSession

    client = Client(served.url, verbose=False)
    other = Client(served.url, verbose=False)
    # Two jobs: the second waits behind the first (one quantization at a time on the CPU) and is cancelled.
    # (Settings slow enough, ~0.5 s per layer, that polling sees the reports arrive one by one.)
    first = client.predict(**job_kwargs(vector_len=2, num_centroids=256, kmeans_iters=30), api_name="/start")[0]
    second = client.predict(**job_kwargs(method="rtn", bits=4), api_name="/start")[0]
    queued = status(client, second)
    assert (queued["status"], queued["position"]) == ("queued", 1)
    client.predict(second, api_name="/cancel")
    assert status(client, second)["status"] == "cancelled"

    final, seen = wait_done(client, first)
    assert final["status"] == "done", final["error"]
    assert seen == sorted(seen) and any(0 < n < 14 for n in seen), f"no partial progress seen: {seen}"
    assert len(final["reports"]) == 14 and all(r["rel_output_error"] is not None for r in final["reports"])
    assert [r["block"] for r in final["reports"]] == [0] * 7 + [1] * 7

    # Another session cannot see, cancel or chat with this job.
    with pytest.raises(AppError, match=rf"no job '{first}' in this session"):
        status(other, first)
    with pytest.raises(AppError, match=rf"no job '{first}' in this session"):
        other.predict(first, api_name="/cancel")
    with pytest.raises(AppError, match=rf"no job '{first}' in this session"):
        other.predict("hi", [], [], first, 0.0, 1.0, 4, api_name="/chat")
    assert other.predict(api_name="/runs")[0]["data"] in ([], [[]])

    # A running job cancelled between layers leaves the app healthy.
    third = client.predict(**job_kwargs(kmeans_iters=20, num_centroids=64, vector_len=2), api_name="/start")[0]
    while status(client, third)["layers_done"] < 1:
        time.sleep(0.02)
    client.predict(third, api_name="/cancel")
    stopped, _ = wait_done(client, third)
    assert stopped["status"] == "cancelled" and 1 <= stopped["layers_done"] < 14
    assert not (served.workdir / "jobs" / third).exists()

    # Evaluation: the numbers the app shows are the library's numbers on the same windows.
    shown = client.predict(first, 2, 64, api_name="/evaluate")[0]
    ev = status(client, first)["extras"]["eval"]
    assert f"Perplexity {ev['perplexity']:.3f}" in shown
    ckpt = Path(final["result"]["checkpoint_dir"])
    qmodel, tok = load_quantized(ckpt, dtype="bfloat16")
    ref, _ = load_model(TINY, dtype="bfloat16")
    direct = evaluate(qmodel, tok, text="wiki", seqlen=64, max_windows=2, reference=ref)
    assert ev["windows"] == 2 and ev["tokens"] == 2 * 63
    assert ev["perplexity"] == pytest.approx(direct.perplexity, rel=1e-6)
    assert ev["kl_divergence"] == pytest.approx(direct.kl_divergence, rel=1e-5, abs=1e-9)
    assert ev["top1_agreement"] == pytest.approx(direct.top1_agreement)
    assert math.isfinite(ev["reference_perplexity"]) and ev["kl_divergence"] >= 0
    runs = client.predict(api_name="/runs")[0]["data"]
    assert [row[0] for row in runs] == [first] and runs[0][8] == round(ev["perplexity"], 3)

    # Chat on both sides; the quantized side is exactly the library's greedy answer on the checkpoint.
    loaded = client.predict(first, api_name="/chat_load")[0]
    assert "**Original** `tiny-random-llama`" in loaded and "**Quantized**" in loaded
    # Sampling (seeded) makes the random tiny model print visible bytes; the Chatbot trims blank lines.
    orig, quant, stats_orig, stats_quant, _ = client.predict("Hello there", [], [], first, 1.0, 1.0, 8,
                                                             api_name="/chat")
    expected = "".join(ChatSession(qmodel, tok).stream("Hello there", max_new_tokens=8, temperature=1.0))
    assert inspect.cleandoc(expected)
    assert texts(quant) == [("user", "Hello there"), ("assistant", inspect.cleandoc(expected))]
    assert [role for role, _ in texts(orig)] == ["user", "assistant"]
    for stats in (stats_orig, stats_quant):
        match = STATS.search(stats)
        assert match and 1 <= int(match.group(1)) <= 8 and float(match.group(2)) > 0, stats

    # Download the packed checkpoint and load it back as a new run.
    downloaded = Path(client.predict(first, api_name="/download"))
    archive = Path(final["result"]["archive"])
    assert hashlib.sha256(downloaded.read_bytes()).digest() == hashlib.sha256(archive.read_bytes()).digest()
    with zipfile.ZipFile(downloaded) as zf:
        assert {Path(n).name for n in zf.namelist()} >= {"config.json", "model.safetensors", "quant_report.json"}
    picker, message, _rows, _fig = client.predict(handle_file(str(downloaded)), api_name="/upload")
    picked = picker["value"]  # the run picker is updated (new choices) and set to the new run
    assert [c[1] for c in picker["choices"]] == [first, picked]
    assert picked != first and f"as run `{picked}`" in message and "made from `tiny-random-llama`" in message
    _, quant_again, _, stats_again, _ = client.predict("Hello there", [], [], picked, 1.0, 1.0, 8, api_name="/chat")
    assert texts(quant_again) == texts(quant)
    assert STATS.search(stats_again).group(1) == STATS.search(stats_quant).group(1)
    # The reloaded weights evaluate to exactly the same numbers.
    shown_again = client.predict(picked, 2, 64, api_name="/evaluate_run")[0]
    assert f"Perplexity {ev['perplexity']:.3f}" in shown_again
    ev_again = status(client, picked)["extras"]["eval"]
    assert (ev_again["perplexity"], ev_again["kl_divergence"]) == (ev["perplexity"], ev["kl_divergence"])

    # Bad archives are refused with the reason.
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("../model.safetensors", b"x")
    with pytest.raises(AppError, match=r"cannot load bad.zip: entry '../model.safetensors': path traversal"):
        client.predict(handle_file(str(bad)), api_name="/upload")
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("pytorch_model.bin", b"\x80\x04.")
    with pytest.raises(AppError, match=r"unexpected file 'pytorch_model.bin'"):
        client.predict(handle_file(str(bad)), api_name="/upload")
    client.close()
    other.close()


def test_closing_the_session_deletes_its_runs(served, tmp_path):
    from vptq_core.storage.archive import pack_checkpoint

    client = Client(served.url, verbose=False)
    w8a8 = "8-bit per tensor (static, calibrated)"
    job = client.predict(**job_kwargs(method="rtn", bits=8, group_size=0, activations=w8a8), api_name="/start")[0]
    final, _ = wait_done(client, job)
    assert final["status"] == "done", final["error"]
    assert final["meta"]["settings"]["act_bits"] == 8 and final["meta"]["settings"]["act_granularity"] == "tensor"
    copy = pack_checkpoint(final["result"]["checkpoint_dir"], tmp_path / "copy.zip")
    picked = client.predict(handle_file(str(copy)), api_name="/upload")[0]["value"]
    dirs = [served.workdir / "jobs" / job, served.workdir / "jobs" / picked]
    assert all(d.is_dir() for d in dirs)
    client.close()
    deadline = time.monotonic() + 30
    while any(d.exists() for d in dirs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(d.exists() for d in dirs)
