"""Runs through the app's API (gradio_client, in-process, on the tiny model): start, queue positions, cancel,
live progress and poll, runs that survive a reload and a restart, sessions that see only their own runs. The
queue side runs gated stand-in tasks (``GatedRuns``), so those tests are instant and deterministic;
``test_real_run_evaluate_chat_download_reload`` (slow) runs a real quantization end to end: the numbers the app
shows are the library's, chat answers are the library's, and the downloaded archive loads back to the same
model."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

gradio_client = pytest.importorskip("gradio_client")
import gradio as gr  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from studio_helpers import (  # noqa: E402
    LAYERS,
    STATS,
    as_request,
    finished,
    gate_jobs,
    job_kwargs,
    serve_app,
    status,
    texts,
    until,
    wait_done,
)

import app as studio_app  # noqa: E402
from vptq_core.eval import evaluate  # noqa: E402
from vptq_core.models import TINY, load_model  # noqa: E402
from vptq_core.quant import methods  # noqa: E402
from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.storage.checkpoint import load_quantized  # noqa: E402
from vptq_core.studio import form, handlers  # noqa: E402
from vptq_core.studio.chat import ChatSession  # noqa: E402
from vptq_core.studio.task import quantization_task  # noqa: E402

served = pytest.fixture(scope="module", name="served")(serve_app)
gated = pytest.fixture(name="gated")(gate_jobs)


@pytest.mark.slow  # subprocesses or a served app: seconds each
def test_queue_progress_cancel_and_sessions(served, gated):
    client = Client(served.url, verbose=False)
    other = Client(served.url, verbose=False)
    # Two jobs: the second waits behind the first (one quantization at a time on the CPU) and is cancelled.
    first = client.predict(**job_kwargs(), api_name="/start")[0]
    second = client.predict(**job_kwargs(method="rtn", bits=4), api_name="/start")[0]
    queued = status(client, second)
    assert (queued["status"], queued["position"], queued["running_ahead"]) == ("queued", 1, 1)
    client.predict(second, api_name="/cancel")
    assert status(client, second)["status"] == "cancelled"
    run, second_run = gated.runs
    assert (run.method, second_run.method, second_run.config.bits) == ("vptq", "rtn", 4)

    # Reports arrive layer by layer, exactly as the task publishes them.
    until(served, client, first, lambda st: st["total_layers"] == LAYERS)
    released = 0
    for done in (1, 5, 7, 9):
        run.release(done - released)
        released = done
        st = until(served, client, first, lambda st, done=done: st["layers_done"] == done)
        assert st["status"] == "running" and len(st["reports"]) == done
        # Block 0's output error arrives with its 7th layer.
        assert [r["rel_output_error"] for r in st["reports"]] == [
            run.output_error(0) if done >= 7 and i < 7 else None for i in range(done)]
    progress = client.predict(first, api_name="/poll")[0]
    assert 'data-status="running"' in progress and "9/14 layers" in progress and "last: block 1 · self_attn.k_proj" \
        in progress

    # Another session cannot see, cancel or chat with this job.
    with pytest.raises(AppError, match=rf"no job '{first}' in this session"):
        status(other, first)
    with pytest.raises(AppError, match=rf"no job '{first}' in this session"):
        other.predict(first, api_name="/cancel")
    with pytest.raises(AppError, match=rf"no job '{first}' in this session"):
        other.predict("hi", [], [], first, 0.0, 1.0, 4, api_name="/chat")

    run.release()
    final = finished(served, client, first)
    assert final["status"] == "done", final["error"]
    assert [r["block"] for r in final["reports"]] == [0] * 7 + [1] * 7
    assert [r["rel_output_error"] for r in final["reports"]] == [run.output_error(0)] * 7 + [run.output_error(1)] * 7
    assert not second_run.started.is_set()  # the cancelled queued job never ran
    assert final["meta"]["settings"] == run.config.to_dict()
    runs = client.predict(api_name="/runs")[0]["data"]
    described = methods.get("vptq").describe(run.config.to_dict())
    assert described.startswith("v4 k16") and [row[:4] for row in runs] == [[first, TINY, "VPTQ", described]]
    assert other.predict(api_name="/runs")[0]["data"] in ([], [[]])
    # The job JSON names the archive by its file name only: no server path, no owner, no job id in the name.
    assert "archive" not in final["result"] and "checkpoint_dir" not in final["result"] and "owner" not in final
    archive = Path(served.studio.manager.get(first, client.session_hash).result["archive"])
    assert final["result"]["archive_name"] == archive.name
    downloaded = Path(client.predict(first, api_name="/download"))
    assert downloaded.read_bytes() == archive.read_bytes() and downloaded.name == archive.name
    with pytest.raises(AppError, match=rf"job {second} has no archive to download \(status: cancelled\)"):
        client.predict(second, api_name="/download")

    # A running job cancelled between layers stops before the next one and keeps nothing.
    third = client.predict(**job_kwargs(method="gptq", bits=3), api_name="/start")[0]
    third_run = gated.runs[-1]
    third_run.release(3)
    until(served, client, third, lambda st: st["layers_done"] == 3)
    assert "cancelling" in client.predict(third, api_name="/cancel")[1]["phase"]
    third_run.release()
    stopped = finished(served, client, third)
    assert (stopped["status"], stopped["layers_done"]) == ("cancelled", 3)
    assert not (served.workdir / "jobs" / third).exists()
    client.close()
    other.close()


def test_poll_refreshes_only_what_changed(served, gated):
    client = Client(served.url, verbose=False)
    request = as_request(client)
    job = client.predict(**job_kwargs(), api_name="/start")[0]
    run = gated.runs[-1]
    until(served, client, job, lambda st: st["total_layers"] == LAYERS)
    run.release(2)
    until(served, client, job, lambda st: st["layers_done"] == 2)
    out = served.studio.runs.poll(job, {}, request)
    (progress, lines, heat, table, summary, download, runs_rows, runs_fig, chat_runs, pick_runs, job_json, seen,
     guard, timer) = out
    assert "2/14 layers" in progress and [row[1] for row in table] == ["self_attn.k_proj", "self_attn.q_proj"]
    assert [t.name for t in lines.data] == ["q_proj", "k_proj"] and job_json["reports"] == 2
    assert all(x == gr.skip() for x in (summary, download, runs_rows, runs_fig, chat_runs, pick_runs))
    assert timer.active and 'data-busy="1"' in guard  # leaving the page now asks first
    # Nothing new: only the progress text (elapsed time) is sent again.
    again = served.studio.runs.poll(job, seen, request)
    assert all(x == gr.skip() for x in again[1:11]) and again[11] == seen and again[13].active
    run.release()
    until(served, client, job, lambda st: st["status"] == "done")
    done = served.studio.runs.poll(job, seen, request)
    archive = Path(served.studio.manager.get(job, client.session_hash).result["archive"])
    served_copy = Path(done[5].value["path"])
    assert "Done:" in done[4] and done[5].visible and served_copy.name == archive.name
    # The page's download is a copy in a fresh random folder of Gradio's cache, not the work directory's file.
    assert served_copy.read_bytes() == archive.read_bytes() and not served_copy.is_relative_to(served.workdir)
    assert re.fullmatch(r"vq-[0-9a-f]{32}", served_copy.parent.name)
    assert done[8].value == job and [c[1] for c in done[8].choices] == [job] and not done[13].active
    assert [c[1] for c in done[9].choices] == [job]
    assert 'data-busy="0" data-unexported="1"' in done[12]  # a result not taken home yet
    assert served.studio.runs.poll(job, done[11], request)[4] == gr.skip()  # the summary is sent once
    assert 'data-unexported="0"' in served.studio.downloads.mark_exported(job, request)
    # Through the API the same tick fills the page's outputs.
    values = client.predict(job, api_name="/poll")  # (the poll state is the session's)
    assert 'data-status="done"' in values[0] and "Done:" in values[4]
    client.close()


def test_activation_and_lrq_settings_reach_the_job(served, gated):
    client = Client(served.url, verbose=False)
    w8a8 = "8-bit per tensor (static, calibrated)"
    rtn = client.predict(**job_kwargs(method="rtn", bits=8, group_size=0, activations=w8a8), api_name="/start")[0]
    lrq = client.predict(**job_kwargs(method="lrq", bits=3, rank=4, iters=7, seed=5,
                                      activations="8-bit per token (dynamic)"), api_name="/start")[0]
    assert status(client, rtn)["meta"]["settings"] == gated.runs[0].config.to_dict()
    settings = status(client, rtn)["meta"]["settings"]
    assert (settings["bits"], settings["group_size"], settings["act_bits"], settings["act_granularity"]) == (
        8, 0, 8, "tensor")
    settings = status(client, lrq)["meta"]["settings"]
    assert (settings["bits"], settings["rank"], settings["iters"], settings["seed"], settings["act_bits"],
            settings["act_granularity"]) == (3, 4, 7, 5, 8, "token")
    assert gated.runs[1].calib.seed == 5 and gated.runs[1].calib.samples == 4
    for job in (rtn, lrq):
        client.predict(job, api_name="/cancel")
    client.close()


@pytest.mark.slow  # subprocesses or a served app: seconds each
def test_runs_survive_a_reload_and_api_sessions_are_cleaned_up(served, gated):
    # A page: the browser's lasting identity comes from attach (kept in the browser's local storage).
    page = Client(served.url, verbose=False)
    identity = served.studio.pages.attach(None, as_request(page))[0]
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", identity) and identity != page.session_hash
    job = page.predict(**job_kwargs(), api_name="/start")[0]
    gated.runs[-1].release()
    snap = wait_done(served, identity, job)
    archive, ckpt = Path(snap.result["archive"]), Path(snap.result["checkpoint_dir"])
    # Reload: the page goes away and a new one comes back with the identity the browser kept.
    served.studio.pages.on_unload(as_request(page))
    page.close()
    assert archive.is_file() and ckpt.is_dir()
    reloaded = Client(served.url, verbose=False)
    ident, watched, poll_state, timer, _ev, rows, _fig, chat_pick, delete_pick, guard = served.studio.pages.attach(
        identity, as_request(reloaded))
    assert (ident, watched, timer.active) == (identity, job, True) and [r[0] for r in rows] == [job]
    assert [c[1] for c in chat_pick.choices] == [job] == [c[1] for c in delete_pick.choices]
    assert 'data-unexported="1"' in guard  # the result was not taken home yet: leaving asks first
    tick = served.studio.runs.poll(job, poll_state, as_request(reloaded))  # the first tick fills the page in again
    assert "Done:" in tick[4] and tick[5].visible and Path(tick[5].value["path"]).read_bytes() == archive.read_bytes()
    downloaded = Path(reloaded.predict(job, api_name="/download"))
    assert downloaded.read_bytes() == archive.read_bytes()
    assert reloaded.predict(api_name="/runs")[0]["data"][0][0] == job
    # The unloaded page keeps acting for its browser (a user may choose to stay on the page) until the link
    # expires with the runs; then the old session reaches nothing. A malformed identity gets a new one.
    assert served.studio.owner(as_request(page)) == identity
    assert served.studio.pages.forget_pages(3600) == 0 and served.studio.pages.forget_pages(0) >= 1
    assert served.studio.owner(as_request(page)) == page.session_hash
    with pytest.raises(ValueError, match=rf"no job '{job}' in this session"):
        served.studio.manager.get(job, page.session_hash)
    stranger = Client(served.url, verbose=False)
    fresh = served.studio.pages.attach("../../" + identity[6:], as_request(stranger))
    assert fresh[0] != identity and fresh[1] == "" and fresh[5] == []
    # Deleting a run removes its files and every download copy made of it.
    copies = list(served.studio.downloads.copies(job))
    assert copies and all(c.is_file() for c in copies)
    reloaded.predict(job, job, api_name="/delete_run")
    assert not ckpt.parent.exists() and not any(c.exists() for c in copies)
    assert served.studio.manager.jobs(identity) == []

    # An API session that never attached cannot come back: its jobs are cancelled and its runs deleted.
    client = Client(served.url, verbose=False)
    finished_job = client.predict(**job_kwargs(), api_name="/start")[0]
    gated.runs[-1].release()
    ckpt = wait_done(served, client.session_hash, finished_job).result["checkpoint_dir"]
    running = client.predict(**job_kwargs(), api_name="/start")[0]
    until(served, client, running, lambda st: st["status"] == "running")
    served.studio.cache.get(("quant", ckpt, "cpu"), lambda: "a loaded model")
    served.studio.pages.on_unload(as_request(client))
    assert served.studio.manager.jobs(client.session_hash) == []
    assert ("quant", ckpt, "cpu") not in served.studio.cache
    gated.runs[-1].release()
    deadline = time.monotonic() + 10
    dirs = [served.workdir / "jobs" / finished_job, served.workdir / "jobs" / running]
    while any(d.exists() for d in dirs) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(d.exists() for d in dirs)
    for c in (client, reloaded, stranger):
        c.close()


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow  # subprocesses or a served app: seconds each
def test_another_session_reaches_no_file_and_no_endpoint(served, gated, monkeypatch):
    owner = Client(served.url, verbose=False)
    identity = served.studio.pages.attach(None, as_request(owner))[0]
    job = owner.predict(**job_kwargs(), api_name="/start")[0]
    gated.runs[-1].release()
    snap = wait_done(served, identity, job)
    archive, ckpt = Path(snap.result["archive"]), Path(snap.result["checkpoint_dir"])
    attacker = Client(served.url, verbose=False)
    served.studio.pages.attach(None, as_request(attacker))
    calls = {"/job_status": (job,), "/cancel": (job,), "/download": (job,), "/evaluate": (job, 2, 64),
             "/evaluate_run": (job, 2, 64), "/chat_load": (job,), "/chat": ("hi", [], [], job, 0.0, 1.0, 4),
             "/delete_run": (job, ""), "/push": (job, "me/repo", True, "token")}
    for endpoint, args in calls.items():
        with pytest.raises(AppError, match=rf"no job '{job}' in this session"):
            attacker.predict(*args, api_name=endpoint)
    progress = attacker.predict(job, api_name="/poll")[0]
    assert "no job" in progress and "Done" not in progress
    # Files by path: the work directory is never served, knowing the job id and the path or not.
    base = f"{served.url}gradio_api/file="
    for path in (archive, ckpt / "config.json", served.workdir / "jobs" / job, served.workdir):
        assert _http_status(base + str(path)) == 403, path
    copy = Path(owner.predict(job, api_name="/download"))  # (the client's local copy of what it fetched)
    served_copy = served.studio.downloads.copies(job)[-1]
    assert _http_status(base + str(served_copy)) == 200  # the route works: the owner's own copy is served
    assert copy.read_bytes() == archive.read_bytes()
    served.studio.runs.delete_run(job, "", as_request(owner))
    assert _http_status(base + str(served_copy)) == 403  # gone from Gradio's cache with its run

    # Nothing a user sees names the work directory, Gradio's cache or a session: a failed job's error neither.
    def failing(model, method, config, calib, device="cpu", calib_text=None):
        def task(ctx):
            raise OSError(f"cannot open {ctx.out_dir / 'checkpoint' / 'model.safetensors'} (session "
                          f"{identity})")
        return task

    monkeypatch.setattr(served.studio.runs, "make_task", failing)
    failed = owner.predict(**job_kwargs(), api_name="/start")[0]
    assert served.studio.manager.wait(failed, identity, timeout=30).status == "failed"
    monkeypatch.setattr(served.studio.runs, "make_task", gated)
    shown = [owner.predict(**job_kwargs(), api_name="/start"), owner.predict(failed, api_name="/job_status"),
             owner.predict(failed, api_name="/poll"), owner.predict(api_name="/runs")]
    with pytest.raises(AppError) as refused:
        owner.predict(handle_file(__file__), api_name="/upload")
    shown.append(str(refused.value))
    text = json.dumps(shown, default=str)
    assert "model.safetensors" in text  # the error is there, without where the file was
    for secret in (str(served.workdir), str(served.studio.shared.serve_dir), identity, owner.session_hash,
                   attacker.session_hash):
        assert secret not in text, secret
    for c in (owner, attacker):
        c.close()


# ------------------------------------------------------------------------------------- real runs (slow)
@pytest.mark.slow
def test_real_run_evaluate_chat_download_reload(served):
    client = Client(served.url, verbose=False)
    job = client.predict(**job_kwargs(), api_name="/start")[0]
    final = finished(served, client, job)
    assert final["status"] == "done", final["error"]
    ckpt = served.studio.manager.checkpoint_dir(job, client.session_hash)
    # The reports the app streamed are the ones the checkpoint's report keeps.
    saved = json.loads((ckpt / "quant_report.json").read_text())
    assert final["reports"] == saved["layers"] and len(saved["layers"]) == LAYERS
    assert [r["block"] for r in final["reports"]] == [0] * 7 + [1] * 7
    for block in (0, 1):
        assert len({r["rel_output_error"] for r in final["reports"] if r["block"] == block}) == 1

    # Evaluation: the numbers the app shows are the library's numbers on the same windows.
    shown = client.predict(job, 2, 64, api_name="/evaluate")[0]
    ev = status(client, job)["extras"]["eval"]
    assert f"Perplexity {ev['perplexity']:.3f}" in shown
    qmodel, tok = load_quantized(ckpt, dtype="bfloat16")
    ref, ref_tok = load_model(TINY, dtype="bfloat16")
    direct = evaluate(qmodel, tok, text="wiki", seqlen=64, max_windows=2, reference=ref)
    assert ev["windows"] == 2 and ev["tokens"] == 2 * 63
    assert ev["perplexity"] == pytest.approx(direct.perplexity, rel=1e-6)
    assert ev["reference_perplexity"] == pytest.approx(direct.reference_perplexity, rel=1e-6)
    assert ev["kl_divergence"] == pytest.approx(direct.kl_divergence, rel=1e-5, abs=1e-9)
    assert ev["top1_agreement"] == pytest.approx(direct.top1_agreement)
    runs = client.predict(api_name="/runs")[0]["data"]
    assert [row[0] for row in runs] == [job] and runs[0][8] == round(ev["perplexity"], 3)

    # Chat on both sides: each side is exactly the library's answer (seeded sampling makes the random tiny
    # model print visible bytes; the Chatbot trims blank lines) and reports the library's token count.
    loaded = client.predict(job, api_name="/chat_load")[0]
    assert "**Original** `tiny-random-llama`" in loaded and "**Quantized**" in loaded
    orig, quant, stats_orig, stats_quant, _ = client.predict("Hello there", [], [], job, 1.0, 1.0, 8,
                                                             api_name="/chat")
    for history, stats, (model, tokenizer) in ((orig, stats_orig, (ref, ref_tok)), (quant, stats_quant, (qmodel, tok))):
        session = ChatSession(model, tokenizer)
        expected = "".join(session.stream("Hello there", max_new_tokens=8, temperature=1.0))
        assert inspect.cleandoc(expected)
        assert texts(history) == [("user", "Hello there"), ("assistant", inspect.cleandoc(expected))]
        match = STATS.search(stats)
        assert match and int(match.group(1)) == session.last_stats.tokens and float(match.group(2)) > 0, stats

    # Download the packed checkpoint and load it back as a new run.
    downloaded = Path(client.predict(job, api_name="/download"))
    archive = Path(served.studio.manager.get(job, client.session_hash).result["archive"])
    assert job not in archive.name and re.fullmatch(r"tiny-random-llama-vptq-\d\.\d\dbit-\d{8}-\d{4}\.zip",
                                                    archive.name), archive.name
    assert hashlib.sha256(downloaded.read_bytes()).digest() == hashlib.sha256(archive.read_bytes()).digest()
    with zipfile.ZipFile(downloaded) as zf:
        assert {Path(n).name for n in zf.namelist()} >= {"config.json", "model.safetensors", "quant_report.json"}
    picker, message, _rows, _fig = client.predict(handle_file(str(downloaded)), api_name="/upload")
    picked = picker["value"]  # the run picker is updated (new choices) and set to the new run
    assert [c[1] for c in picker["choices"]] == [job, picked]
    assert picked != job and f"as run `{picked}`" in message and "made from `tiny-random-llama`" in message
    _, quant_again, _, stats_again, _ = client.predict("Hello there", [], [], picked, 1.0, 1.0, 8, api_name="/chat")
    assert texts(quant_again) == texts(quant)
    assert STATS.search(stats_again).group(1) == STATS.search(stats_quant).group(1)
    # The reloaded weights evaluate to exactly the same numbers.
    shown_again = client.predict(picked, 2, 64, api_name="/evaluate_run")[0]
    assert f"Perplexity {ev['perplexity']:.3f}" in shown_again
    ev_again = status(client, picked)["extras"]["eval"]
    assert (ev_again["perplexity"], ev_again["kl_divergence"]) == (ev["perplexity"], ev["kl_divergence"])
    client.close()


@pytest.mark.slow
def test_closing_the_session_deletes_its_runs(served, tmp_path, monkeypatch):
    """Through Gradio's own unload event, which fires one heartbeat after the client disconnects (15 s by
    default; 0.5 s for this session): a real W8A8 run and an uploaded copy of it are deleted."""
    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.5")  # read when the client's heartbeat stream opens
    client = Client(served.url, verbose=False)
    w8a8 = "8-bit per tensor (static, calibrated)"
    job = client.predict(**job_kwargs(method="rtn", bits=8, group_size=0, activations=w8a8), api_name="/start")[0]
    final = finished(served, client, job)
    assert final["status"] == "done", final["error"]
    ckpt = served.studio.manager.checkpoint_dir(job, client.session_hash)
    saved = json.loads((ckpt / "quant_report.json").read_text())
    assert (saved["settings"]["act_bits"], saved["settings"]["act_granularity"]) == (8, "tensor")
    copy = pack_checkpoint(ckpt, tmp_path / "copy.zip")
    picked = client.predict(handle_file(str(copy)), api_name="/upload")[0]["value"]
    dirs = [served.workdir / "jobs" / job, served.workdir / "jobs" / picked]
    assert all(d.is_dir() for d in dirs)
    client.close()
    deadline = time.monotonic() + 60
    while any(d.exists() for d in dirs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(d.exists() for d in dirs)


# ------------------------------------------------------------------------------------ restarts
class Killed(BaseException):
    """Stands in for the process dying: not an Exception, so the job thread ends without any cleanup."""


def killed_after(layers: int):
    """A ``make_task`` whose real quantization dies right after ``layers`` layers were published."""
    def make(*args, **kwargs):
        real = quantization_task(*args, **kwargs)

        def task(ctx):
            publish, seen = ctx.on_layer, []

            def on_layer(report):
                seen.append(report)
                if len(seen) > layers:
                    raise Killed
                publish(report)

            ctx.on_layer = on_layer
            return real(ctx)

        return task

    return make


def _page(session: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=session)


# Real quantizations (rtn: about 5 s, vptq: about 25 s on 2 cores); the queue's side is tested fast in test_jobs.
RESTART_CASES = [pytest.param("rtn", id="rtn", marks=pytest.mark.slow),
                 pytest.param("vptq", id="vptq", marks=pytest.mark.slow)]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("method", RESTART_CASES)
def test_a_run_cut_off_by_a_restart_resumes_to_the_same_checkpoint(tmp_path, method):
    settings = studio_app.AppSettings(workdir=tmp_path / "work", default_model=TINY)
    calib_file = tmp_path / "calib.txt"  # (short: tokenizing the bundled Wikipedia text takes seconds)
    calib_file.write_text("A small corpus of plain English words for calibration and evaluation. " * 60,
                          encoding="utf-8")
    kwargs = job_kwargs(method=method, calib_source=form.FILE_SOURCE, calib_file=str(calib_file))
    before = handlers.Studio(settings, make_task=killed_after(LAYERS // 2))
    identity = before.pages.attach(None, _page("page-1"))[0]
    job = before.runs.start(**kwargs, request=_page("page-1"))[0]
    before.manager._threads[job].join(120)  # the "process" died in block 1, after block 0 was written
    before.close()
    job_dir = settings.workdir / "jobs" / job
    text = (job_dir / "job.json").read_text(encoding="utf-8")
    description = json.loads(text)
    assert description["owner_sha256"] == hashlib.sha256(identity.encode()).hexdigest()
    assert identity not in text and "page-1" not in text
    assert (description["model"], description["method"], description["state"]) == (TINY, method, "started")
    assert description["calib"] == {"text": "uploaded file", "samples": 4, "seqlen": 64, "seed": 0}
    calib_file.unlink()  # the upload is gone after the restart: the job directory keeps its own copy
    assert description["settings"] == form.config_from(method, kwargs).to_dict()

    # The restart: a new Studio (and JobManager) on the same work directory.
    after = handlers.Studio(settings)
    try:
        stranger = after.pages.attach(None, _page("page-3"))
        assert stranger[1] == "" and after.manager.jobs(stranger[0]) == []
        with pytest.raises(gr.Error, match=rf"no job '{job}' in this session"):
            after.runs.resume(job, _page("page-3"))
        ident, watched, poll_state, timer, *_rest = after.pages.attach(identity, _page("page-2"))
        assert (ident, watched) == (identity, job)
        snap = after.manager.get(job, identity)
        assert snap.status == "interrupted" and snap.extras["interrupted"] == {"blocks_done": 1, "blocks_total": 2}
        tick = after.runs.poll(job, poll_state, _page("page-2"))
        assert "interrupted" in tick[0] and "1 of 2 blocks done" in tick[0] and not tick[-1].active
        calib_file.write_text("A small corpus of plain English words for calibration and evaluation. " * 60,
                              encoding="utf-8")  # the uninterrupted run to compare with, on the same text
        with pytest.raises(gr.Error, match="was not interrupted"):  # (only an interrupted run resumes)
            after.runs.resume(after.runs.start(**kwargs, request=_page("page-2"))[0], _page("page-2"))
        reference = wait_done(SimpleNamespace(studio=after), identity, after.manager.jobs(identity)[-1].id)
        out = after.runs.resume(job, _page("page-2"))
        assert out[0] == job and out[9].active
        resumed = after.manager.wait(job, identity, timeout=300)
        assert resumed.status == "done", resumed.error
        assert resumed.result["summary"]["resumed_from_block"] == 1 and resumed.layers_done == LAYERS
        full = load_file(Path(reference.result["checkpoint_dir"]) / "model.safetensors")
        cont = load_file(Path(resumed.result["checkpoint_dir"]) / "model.safetensors")
        assert full.keys() == cont.keys()
        for name, tensor in full.items():
            assert torch.equal(tensor, cont[name]), name
        assert not (job_dir / "checkpoint" / ".partial").exists()
    finally:
        after.manager.wait(job, identity, timeout=300)
        after.close()

    # Another restart: the finished runs come back with their results for their browser only.
    again = handlers.Studio(settings)
    try:
        assert again.manager.jobs(_page("page-3").session_hash) == []
        rows = again.pages.attach(identity, _page("page-4"))[5]
        assert sorted(r[0] for r in rows) == sorted([job, reference.id])
        back = again.manager.get(job, identity)
        assert back.status == "done" and back.result == resumed.result and back.layers_done == LAYERS
        downloaded = again.downloads.download(job, _page("page-4"))
        assert Path(downloaded).read_bytes() == Path(resumed.result["archive"]).read_bytes()
    finally:
        again.close()
