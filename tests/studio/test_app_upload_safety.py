"""Uploads a hostile or unlucky visitor may send, through the served app: two sessions uploading at once, a
checkpoint whose header claims more memory than the app has, configs the app does not serve, a recorded
original that names a server path, another user's run or a hub model; and the memory ceiling on jobs."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import struct
import threading
import time
import zipfile
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from studio_helpers import (  # noqa: E402
    as_request,
    estimate_kwargs,
    finished,
    gate_jobs,
    job_kwargs,
    make_tiny_checkpoint,
    serve_app,
    until,
)

from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.studio import form, run_models  # noqa: E402
from vptq_core.studio.memory_guard import process_rss  # noqa: E402
from vptq_core.studio.upload_files import UploadedFiles  # noqa: E402

served = pytest.fixture(scope="module", name="served")(serve_app)
tiny_checkpoint = pytest.fixture(scope="module", name="tiny_checkpoint")(make_tiny_checkpoint)
gated = pytest.fixture(name="gated")(gate_jobs)


def _variant(ckpt: Path, out: Path, config=None, report=None, files: dict | None = None) -> Path:
    """A zip of a copy of ``ckpt`` with config.json / quant_report.json changed by the given functions."""
    copy = out.with_suffix("")
    shutil.copytree(ckpt, copy)
    for name, change in (("config.json", config), ("quant_report.json", report)):
        if change is not None:
            data = json.loads((copy / name).read_text())
            change(data)
            (copy / name).write_text(json.dumps(data))
    for name, data in (files or {}).items():
        (copy / name).write_bytes(data)
    return pack_checkpoint(copy, out)


def _claiming(header: dict) -> bytes:
    """A safetensors file whose header lists ``header`` and whose data section is left out."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def _upload(client: Client, archive: Path) -> str:
    return client.predict(handle_file(str(archive)), api_name="/upload")[0]["value"]


# ------------------------------------------------------------------------------------- two sessions at once
def test_two_sessions_upload_the_same_and_different_archives_at_once(served, tiny_checkpoint, tmp_path):
    """Ten rounds of two sessions uploading at the same moment (the same archive, then two different ones):
    every upload loads, and afterwards both sessions still chat with what they uploaded."""
    clients = [Client(served.url, verbose=False) for _ in range(2)]
    first = pack_checkpoint(tiny_checkpoint, tmp_path / "a.zip")
    second = _variant(tiny_checkpoint, tmp_path / "b.zip",
                      report=lambda r: r.setdefault("summary", {}).update({"note": "b"}))
    errors: list[str] = []
    runs: list[list[str]] = [[], []]

    def upload(i: int, archive: Path) -> None:
        try:
            runs[i].append(_upload(clients[i], archive))
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(f"session {i}: {exc}")

    for round_ in range(10):
        archives = (first, first) if round_ % 2 == 0 else (first, second)
        threads = [threading.Thread(target=upload, args=(i, a)) for i, a in enumerate(archives)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [], errors
        if round_ < 9:  # keep under the runs cap; the last round's runs are chatted with
            for i, client in enumerate(clients):
                client.predict(runs[i][-1], "", api_name="/delete_run")
    assert [len(r) for r in runs] == [10, 10]
    for i, client in enumerate(clients):
        orig, quant, _stats_o, stats_q, _ = client.predict("Hello", [], [], runs[i][-1], 0.0, 1.0, 4,
                                                           api_name="/chat")
        assert quant[-1]["role"] == "assistant" and "tokens" in stats_q
        assert "not available" not in json.dumps(orig)  # the built-in original loads in both sessions
        client.close()


@pytest.mark.slow
def test_after_concurrent_uploads_both_sessions_quantize_and_chat(served, tiny_checkpoint, tmp_path):
    """Uploads in two sessions at once, then a real quantization in each and a chat with each run."""
    clients = [Client(served.url, verbose=False) for _ in range(2)]
    archive = pack_checkpoint(tiny_checkpoint, tmp_path / "c.zip")
    threads = [threading.Thread(target=_upload, args=(c, archive)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    jobs = [c.predict(**job_kwargs(method="rtn", bits=4, group_size=32), api_name="/start")[0] for c in clients]
    for client, job in zip(clients, jobs, strict=True):
        final = finished(served, client, job)
        assert final["status"] == "done", final["error"]
        _orig, quant, _so, stats, _ = client.predict("Hello", [], [], job, 0.0, 1.0, 4, api_name="/chat")
        assert quant[-1]["role"] == "assistant" and "tokens" in stats
        client.close()


def test_an_uploaded_file_goes_when_its_last_request_is_done(tmp_path):
    serve = tmp_path / "serve"
    path = serve / "abc" / "a.zip"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"zip")
    files = UploadedFiles(serve, grace_s=0.5)
    with files.hold(path), files.hold(path):
        pass
    assert path.is_file()  # uploaded less than grace_s ago: another session's request may be on its way
    with files.hold(path):
        time.sleep(0.8)
        assert path.is_file()  # held: the timer leaves it
    time.sleep(0.8)
    assert not path.exists() and not path.parent.exists()
    outside = tmp_path / "outside.zip"
    outside.write_bytes(b"x")
    with files.hold(outside):
        pass
    time.sleep(0.8)
    assert outside.is_file()  # only files in Gradio's upload folder are deleted


# ------------------------------------------------------------------------------------ memory and configs
def test_a_checkpoint_claiming_more_memory_than_allowed_is_refused_before_unpacking(served, tiny_checkpoint,
                                                                                   tmp_path, monkeypatch):
    client = Client(served.url, verbose=False)
    jobs_dir = served.workdir / "jobs"
    n = 250_000_000  # five tensors of 250 M fp16 numbers: 2.5 GB claimed by a header of a few hundred bytes
    big = {f"t{i}": {"dtype": "F16", "shape": [n], "data_offsets": [2 * n * i, 2 * n * (i + 1)]} for i in range(5)}
    archive = _variant(tiny_checkpoint, tmp_path / "big.zip", files={"model.safetensors": _claiming(big)})
    assert archive.stat().st_size < 100_000
    before_dirs, before_rss = set(jobs_dir.iterdir()), process_rss()
    with pytest.raises(AppError, match=r"cannot load big.zip: loading this checkpoint needs about 3\d{3}\.\d MB "
                                       r"of memory \(2500\.0 MB of tensors\); at most 2000\.0 MB per upload"):
        client.predict(handle_file(str(archive)), api_name="/upload")
    # A 608 MB checkpoint under the per-upload limit, against a memory ceiling with 300 MB left.
    n = 76_000_000
    mid = {f"t{i}": {"dtype": "F32", "shape": [n], "data_offsets": [4 * n * i, 4 * n * (i + 1)]} for i in range(2)}
    archive = _variant(tiny_checkpoint, tmp_path / "mid.zip", files={"model.safetensors": _claiming(mid)})
    monkeypatch.setattr(served.studio.shared.memory, "limit_bytes", process_rss() + 300_000_000)
    with pytest.raises(AppError, match=r"loading this checkpoint needs about \d+\.\d MB of memory; the server uses "
                                       r"\d+\.\d MB of its \d+\.\d MB memory limit"):
        client.predict(handle_file(str(archive)), api_name="/upload")
    assert set(jobs_dir.iterdir()) <= before_dirs
    assert process_rss() - before_rss < 50_000_000  # nothing was allocated for the claimed tensors
    client.close()


@pytest.mark.parametrize(("change", "reason"), [
    pytest.param(lambda c: c.update(model_type="gpt_neo", max_position_embeddings=65_536),
                 r"config.json: model_type 'gpt_neo' is not served here; allowed: llama, qwen2", id="gpt-neo"),
    pytest.param(lambda c: c.update(max_position_embeddings=10**8),
                 r"config.json: max_position_embeddings must be a whole number from 1 to 1048576, got 100000000",
                 id="positions"),
    pytest.param(lambda c: c.update(num_attention_heads=0),
                 r"config.json: num_attention_heads must be a whole number from 1 to 256, got 0", id="zero-heads"),
    pytest.param(lambda c: c.update(hidden_size=63),
                 r"config.json: hidden_size \(63\) must be a multiple of num_attention_heads \(4\)", id="heads"),
    pytest.param(lambda c: c.update(vocab_size=True),
                 r"config.json: vocab_size must be a whole number from 1 to 300000, got True", id="bool"),
])
def test_configs_the_app_does_not_serve_are_refused_before_any_model_is_built(served, tiny_checkpoint, tmp_path,
                                                                             monkeypatch, change, reason):
    client = Client(served.url, verbose=False)
    built: list = []
    monkeypatch.setattr("vptq_core.storage.checkpoint.empty_model", lambda *a, **k: built.append(a))
    archive = _variant(tiny_checkpoint, tmp_path / "cfg.zip", config=change)
    with pytest.raises(AppError) as refused:
        client.predict(handle_file(str(archive)), api_name="/upload")
    message = str(refused.value)
    assert message.count("\n") == 0 and "modulo" not in message
    assert re.search(reason, message), message
    assert built == []
    client.close()


# ------------------------------------------------------------------------ what an upload names as its original
def test_a_recorded_original_is_shown_not_loaded_unless_trusted(served, tiny_checkpoint, tmp_path, monkeypatch):
    owner, stranger = Client(served.url, verbose=False), Client(served.url, verbose=False)
    theirs = _upload(stranger, pack_checkpoint(tiny_checkpoint, tmp_path / "theirs.zip"))
    their_dir = served.workdir / "jobs" / theirs / "checkpoint"
    loaded: list[str] = []
    real = run_models.load_model
    monkeypatch.setattr(run_models, "load_model", lambda name, **kw: loaded.append(name) or real(name, **kw))
    monkeypatch.setattr(served.studio.shared, "settings", dataclasses.replace(
        served.studio.shared.settings, allowed_hub_models=("big-org/huge-model",), max_hub_model_bytes=10**9))
    monkeypatch.setattr("vptq_core.studio.sources.hub_model_bytes", lambda repo: 400 * 10**9)
    opened: list[str] = []
    real_open = Path.open

    def watch_open(self, *args, **kwargs):
        if self.name == "passwd" or str(self).startswith(str(their_dir)):
            opened.append(str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", watch_open)
    cases = {
        str(their_dir): "checkpoint (a path)",
        "/etc/passwd": "passwd (a path)",
        "../../etc/passwd": "passwd (a path)",
        "app.py": "app.py",
        "big-org/huge-model": "big-org/huge-model",
        "someone/not-allowed": "someone/not-allowed",
    }
    shown_everywhere = []
    for i, (source, shown) in enumerate(cases.items()):
        archive = _variant(tiny_checkpoint, tmp_path / f"s{i}.zip", report=lambda r, s=source: r.update(
            model={"source": s}))
        picker, message, _rows, _fig = owner.predict(handle_file(str(archive)), api_name="/upload")
        run = picker["value"]
        described = owner.predict(run, api_name="/chat_load")[0]
        assert "**Original** not available" in described and f"`{shown}`" in described, described
        if source == "big-org/huge-model":
            assert "holds 400000.0 MB of weights; at most 1000.0 MB are loaded here" in described
        orig, _quant, *_ = owner.predict("hi", [], [], run, 0.0, 1.0, 2, api_name="/chat")
        assert "original model not available" in json.dumps(orig)
        shown_everywhere += [message, described, json.dumps(orig), json.dumps(owner.predict(api_name="/runs"))]
        owner.predict(run, "", api_name="/delete_run")
    assert loaded == [] and opened == []
    text = "\n".join(shown_everywhere)
    for secret in (str(served.workdir), "/etc/passwd", theirs):
        assert secret not in text, secret
    # A built-in name is loaded as before.
    archive = _variant(tiny_checkpoint, tmp_path / "builtin.zip")
    run = _upload(owner, archive)
    assert "**Original** `tiny-random-llama`" in owner.predict(run, api_name="/chat_load")[0]
    assert set(loaded) <= {"tiny-random-llama"}  # (it may come from the model cache instead)
    for c in (owner, stranger):
        c.close()


# ------------------------------------------------------------------------------------- the memory ceiling
def test_jobs_stop_at_the_memory_ceiling_and_starts_are_refused_over_it(served, gated, monkeypatch):
    client = Client(served.url, verbose=False)
    job = client.predict(**job_kwargs(), api_name="/start")[0]
    until(served, client, job, lambda st: st["status"] == "running")
    gated.runs[0].release(3)
    until(served, client, job, lambda st: st["layers_done"] == 3)
    limit = served.studio.shared.memory.limit_bytes
    monkeypatch.setattr(served.studio.shared.memory, "limit_bytes", 1_000_000)
    gated.runs[0].release()
    final = finished(served, client, job)
    assert final["status"] == "failed"
    assert final["error"].startswith("stopped: the server's memory reached ")
    assert "over its 1.0 MB limit" in final["error"]
    with pytest.raises(AppError, match=r"cannot start now: the server's memory reached \d+\.\d MB, over its 1\.0 MB "
                                       r"limit; try again later"):
        client.predict(**job_kwargs(), api_name="/start")
    # Not over the ceiling, but without room for the model itself: refused before it is queued.
    monkeypatch.setattr(served.studio.shared.memory, "rss", lambda: 900_000_000)
    monkeypatch.setattr(served.studio.shared.memory, "limit_bytes", 900_001_000)
    with pytest.raises(AppError, match=r"loading this model needs about \d+\.\d+ MB of memory; the server uses "
                                       r"900\.0 MB of its 900\.0 MB memory limit"):
        client.predict(**job_kwargs(), api_name="/start")
    monkeypatch.setattr(served.studio.shared.memory, "rss", process_rss)
    monkeypatch.setattr(served.studio.shared.memory, "limit_bytes", limit)
    again = client.predict(**job_kwargs(), api_name="/start")[0]
    assert len(gated.runs) == 2  # a stand-in task again: the ceiling lifted, the next job runs as before
    gated.runs[-1].release(20)
    assert finished(served, client, again)["status"] == "done"
    client.close()


# ----------------------------------------------------------------------------------- small ones
def test_start_is_disabled_and_refused_over_the_duration_limit(served, monkeypatch):
    client = Client(served.url, verbose=False)
    setup = served.studio.quantize_form
    assert setup.estimate_md(**estimate_kwargs())[1].interactive is True
    monkeypatch.setattr(served.studio.shared, "settings", dataclasses.replace(
        served.studio.shared.settings, max_estimate_hours=1e-6))
    shown, start = setup.estimate_md(**estimate_kwargs())
    assert start.interactive is False
    assert re.search(r"Takes ≈ .*⚠️ this run would take about \d+ h; a run may take at most 1e-06 h here", shown,
                     re.S), shown
    assert "a run may take at most 1e-06 h here" in client.predict(**estimate_kwargs(), api_name="/estimate")
    with pytest.raises(AppError, match=r"this run would take about \d+ h; a run may take at most 1e-06 h here"):
        client.predict(**job_kwargs(), api_name="/start")
    client.close()


def test_a_newly_picked_run_shows_its_own_evaluation(served, tiny_checkpoint, tmp_path):
    client = Client(served.url, verbose=False)
    first = _upload(client, pack_checkpoint(tiny_checkpoint, tmp_path / "e1.zip"))
    second = _upload(client, pack_checkpoint(tiny_checkpoint, tmp_path / "e2.zip"))
    evaluation = {"perplexity": 12.5, "reference_perplexity": 11.0, "kl_divergence": 0.1, "top1_agreement": 0.9,
                  "windows": 2, "seqlen": 64, "tokens": 126, "text": "wiki", "seconds": 1.0}
    served.studio.manager.set_extra(first, client.session_hash, "eval", evaluation)
    request = as_request(client)
    assert "Perplexity 12.500" in served.studio.evaluation.picked_view(first, request)
    assert served.studio.evaluation.picked_view(second, request) == ""
    for run in (first, second):
        client.predict(run, "", api_name="/delete_run")
    client.close()


def test_a_long_or_malformed_chat_history_gets_one_clear_line(served, tiny_checkpoint, tmp_path):
    client = Client(served.url, verbose=False)
    run = _upload(client, pack_checkpoint(tiny_checkpoint, tmp_path / "h.zip"))
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(600)]
    with pytest.raises(AppError) as refused:
        client.predict("hi", history, [], run, 0.0, 1.0, 2, api_name="/chat")
    assert str(refused.value) == ("chat history has 600 messages; at most 200 are accepted: clear the chat and "
                                  "start again")
    with pytest.raises(AppError) as refused:
        client.predict("hi", [{"role": "robot", "content": 3}], [], run, 0.0, 1.0, 2, api_name="/chat")
    assert str(refused.value).startswith("chat history message 0: expected")
    # Plain-text messages of a reasonable history are accepted as the page's own.
    orig, _quant, *_ = client.predict("hi", history[:4], [], run, 0.0, 1.0, 2, api_name="/chat")
    assert len(orig) == 6
    client.predict(run, "", api_name="/delete_run")
    client.close()


@pytest.mark.slow
def test_a_run_calibrated_on_an_uploaded_file_ships_no_server_path(served, tmp_path):
    client = Client(served.url, verbose=False)
    calib = tmp_path / "my-notes.txt"
    calib.write_text("A small corpus of plain English words for calibration and evaluation. " * 60, encoding="utf-8")
    job = client.predict(**job_kwargs(method="rtn", bits=4, group_size=32, calib_source=form.FILE_SOURCE,
                                      calib_file=handle_file(str(calib))), api_name="/start")[0]
    final = finished(served, client, job)
    assert final["status"] == "done", final["error"]
    downloaded = Path(client.predict(job, api_name="/download"))
    with zipfile.ZipFile(downloaded) as zf:
        contents = {name: zf.read(name) for name in zf.namelist()}
    report = json.loads(next(v for k, v in contents.items() if k.endswith("quant_report.json")))
    assert report["calibration"]["text"] == "calibration.txt" and len(report["calibration"]["text_sha256"]) == 64
    for name, data in contents.items():
        if name.endswith((".json", ".md", ".jinja", ".txt")):
            text = data.decode("utf-8")
            for secret in (str(served.workdir), job, str(tmp_path), str(Path.home())):
                assert secret not in text, (name, secret)
    client.close()


def test_the_new_limits_come_from_the_environment(monkeypatch, tmp_path):
    import app as studio_app

    monkeypatch.setenv("VPTQ_APP_MEMORY_LIMIT_MB", "15000")
    monkeypatch.setenv("VPTQ_APP_MAX_LOAD_MB", "500")
    monkeypatch.setenv("VPTQ_APP_MAX_ESTIMATE_HOURS", "2.5")
    monkeypatch.setenv("VPTQ_APP_MAX_CHAT_MESSAGES", "40")
    monkeypatch.setenv("VPTQ_APP_ALLOWED_HUB_MODELS", "org/model-a, org2/b.c")
    settings = studio_app.settings_from(studio_app.parse_args(["--workdir", str(tmp_path)]))
    assert (settings.memory_limit_bytes, settings.max_load_bytes) == (15_000_000_000, 500_000_000)
    assert (settings.max_estimate_hours, settings.max_chat_messages) == (2.5, 40)
    assert settings.allowed_hub_models == ("org/model-a", "org2/b.c")
    monkeypatch.setenv("VPTQ_APP_ALLOWED_HUB_MODELS", "org/model-a,/etc/passwd")
    with pytest.raises(SystemExit, match=r"VPTQ_APP_ALLOWED_HUB_MODELS: '/etc/passwd' is not a hub id"):
        studio_app.settings_from(studio_app.parse_args(["--workdir", str(tmp_path)]))
