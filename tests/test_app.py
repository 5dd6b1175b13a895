"""The Gradio app driven through its API with gradio_client, in-process on a free local port, on the tiny
model.

The queue and UI wiring (start, queue positions, cancel, live progress, poll, runs, download, sessions, the
settings form) runs gated stand-in tasks (``GatedRuns``): each layer is published when the test releases it,
so these tests are instant and deterministic. ``test_real_run_evaluate_chat_download_reload`` (slow) runs a
real quantization end to end: the numbers the app shows are the library's, chat answers are the library's,
and the downloaded archive loads back to the same model."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import socket
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

gradio_client = pytest.importorskip("gradio_client")
import gradio as gr  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

import app as studio_app  # noqa: E402
from vptq_core.eval import evaluate  # noqa: E402
from vptq_core.models import TINY, load_model  # noqa: E402
from vptq_core.quant import methods  # noqa: E402
from vptq_core.quant.bits import scalar_bits  # noqa: E402
from vptq_core.quant.config import ConfigBase, check_int  # noqa: E402
from vptq_core.quant.methods import Method  # noqa: E402
from vptq_core.quant.pipeline import LayerReport  # noqa: E402
from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.storage.checkpoint import load_quantized  # noqa: E402
from vptq_core.studio import form, views  # noqa: E402
from vptq_core.studio.chat import ChatSession  # noqa: E402
from vptq_core.studio.estimate import model_info  # noqa: E402
from vptq_core.studio.queue import JobCancelled  # noqa: E402

STATS = re.compile(r"(\d+) tokens · \*\*([\d.]+) tokens/s\*\*")
LAYERS = 14  # the tiny llama: 2 blocks × 7 linears


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------ stand-in tasks
class GatedRun:
    """One stand-in quantization: publishes the tiny model's layers one per ``release()``, stops between
    layers when cancelled, and returns a result shaped like ``quantization_task``'s."""

    def __init__(self, model: str, method: str, config, calib, calib_text: str | None):
        self.model, self.method, self.config, self.calib, self.calib_text = model, method, config, calib, calib_text
        self.steps = threading.Semaphore(0)
        self.started = threading.Event()

    def release(self, layers: int = LAYERS) -> None:
        for _ in range(layers):
            self.steps.release()

    @staticmethod
    def output_error(block: int) -> float:
        return 0.01 * (block + 1)

    def task(self, ctx) -> dict:
        self.started.set()
        info = model_info(TINY)
        ctx.on_start(len(info.linear_shapes))
        per_block = len(info.modules)
        block_reports: list[LayerReport] = []
        for i, (out_features, in_features) in enumerate(info.linear_shapes):
            assert self.steps.acquire(timeout=30), "the test never released the next layer"
            if ctx.should_stop():
                raise JobCancelled
            block, module = divmod(i, per_block)
            report = LayerReport(block=block, name=f"model.layers.{block}.{info.modules[module]}",
                                 module=info.modules[module], out_features=out_features, in_features=in_features,
                                 method=self.method, rel_proxy_loss=0.001 * (i + 1), rel_weight_error=0.1,
                                 index_bits=2.0, total_bits=2.5, seconds=0.01)
            ctx.on_layer(report)
            block_reports.append(report)
            if module == per_block - 1:  # the block is done: its output error arrives, as in the pipeline
                for r in block_reports:
                    r.rel_output_error = self.output_error(block)
                block_reports = []
        ckpt = ctx.out_dir / "checkpoint"
        ckpt.mkdir()
        (ckpt / "config.json").write_text("{}")
        archive = ctx.out_dir / f"stand-in-{ctx.job_id}.zip"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.write(ckpt / "config.json", "stand-in/config.json")
        summary = {"index_bits_per_weight": 2.0, "total_bits_per_weight": 2.5, "seconds": 0.14, "layers": LAYERS,
                   "method": self.method, "cancelled": False}
        return {"summary": summary, "checkpoint_dir": str(ckpt), "archive": str(archive), "checkpoint_bytes": 2,
                "archive_bytes": archive.stat().st_size, "source_model": self.model, "method": self.method,
                "config": self.config.to_dict(), "calib": self.calib.to_dict()}


class GatedRuns:
    """A ``make_task`` for ``Studio``: one ``GatedRun`` per started job, in start order."""

    def __init__(self):
        self.runs: list[GatedRun] = []

    def __call__(self, model, method, config, calib, device="cpu", calib_text=None):
        run = GatedRun(model, method, config, calib, calib_text)
        self.runs.append(run)
        return run.task

    def release_all(self) -> None:
        for run in self.runs:
            run.release(LAYERS + 1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("studio")
    settings = studio_app.AppSettings(workdir=workdir, default_model=TINY)
    demo = studio_app.build_app(settings)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_port=port, quiet=True, **studio_app.launch_options(settings))
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}/", studio=demo.studio, workdir=workdir, demo=demo)
    demo.studio.manager.shutdown(timeout=30)
    demo.close()


@pytest.fixture
def gated(served, monkeypatch):
    """Jobs started in this test run stand-in tasks; every gate opens at the end, so nothing hangs."""
    runs = GatedRuns()
    monkeypatch.setattr(served.studio, "make_task", runs)
    yield runs
    runs.release_all()


def job_kwargs(**overrides) -> dict:
    kwargs = dict(model=TINY, custom_model="", method="vptq", vector_len=4, num_centroids=16, num_res_centroids=0,
                  outlier_percent=0, group_num=1, enable_norm=False, enable_perm=True, kmeans_iters=2,
                  finetune_iters=0, bits=2, group_size=32, act_order=True, rank=0, iters=5,
                  activations=form.WEIGHT_ONLY, calib_source=form.WIKI_SOURCE, calib_file=None, calib_samples=4,
                  calib_seqlen=64, seed=0)
    kwargs.update(overrides)
    return kwargs


def estimate_kwargs(**overrides) -> dict:
    return {k: v for k, v in job_kwargs(**overrides).items() if not k.startswith("calib")}


def status(client: Client, job_id: str) -> dict:
    return client.predict(job_id, api_name="/job_status")


def until(served, client: Client, job_id: str, done, timeout: float = 30) -> dict:
    """Wait until ``done(status)`` holds for the job (watched in-process, no request per check), then return
    its status as the API reports it."""
    deadline = time.monotonic() + timeout
    while True:
        st = served.studio.manager.get(job_id, client.session_hash, reports=False).to_dict(reports=False)
        if done(st):
            return status(client, job_id)
        if st["status"] == "failed":
            raise AssertionError(f"job {job_id} failed: {st['error']}")
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} never got there; last: {st['status']}, {st['layers_done']} layers")
        time.sleep(0.01)


def finished(served, client: Client, job_id: str, timeout: float = 180) -> dict:
    return until(served, client, job_id, lambda st: st["status"] not in ("queued", "running"), timeout)


def texts(history) -> list[tuple[str, str]]:
    return [(m["role"], views.message_text(m["content"])) for m in history]


def as_request(client: Client) -> SimpleNamespace:
    return SimpleNamespace(session_hash=client.session_hash)


# ------------------------------------------------------------------------------------- without a server
def test_message_content_in_both_formats():
    assert views.message_text("plain") == "plain"
    assert views.message_text([{"type": "text", "text": "a"}, {"type": "file", "file": {"path": "x"}},
                               {"type": "text", "text": "b"}]) == "ab"
    assert views.message_text({"type": "text", "text": "one block"}) == "one block"
    assert views.message_text(("/tmp/image.png", "alt")) == ""
    history = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"role": "assistant", "content": "hello"}, {"role": "system", "content": "ignored"}]
    assert views.normalize_history(history) == [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]


def test_settings_form_follows_the_method_registry(tmp_path):
    demo = studio_app.build_app(studio_app.AppSettings(workdir=tmp_path, default_model=TINY))
    fields = demo.settings_form
    every_setting = {s for m in methods.all_methods() for s in m.setting_names}
    assert all(set(form.field_settings(key)) <= every_setting for key in fields), sorted(fields)
    values = {k: c.value for k, c in fields.items()}
    for m in methods.all_methods():
        # A method's config takes exactly the form fields that are its settings.
        config = form.config_from(m.name, values)
        mine = {s for key in fields for s in form.field_settings(key) if s in m.setting_names}
        assert {k: v for k, v in config.to_dict().items() if k in mine} == form.method_settings(m.name, values)
        assert {k: v for k, v in config.to_dict().items() if k not in mine} == {
            k: v for k, v in m.make_config().to_dict().items() if k not in mine}
        # A preset sets exactly what it fixes, through fields the form has.
        for name, fixed in m.presets.items():
            assert form.preset_values(m.name, name, fields) == fixed
            assert form.config_from(m.name, {**values, **fixed}).to_dict().items() >= fixed.items()
        assert form.preset_values(m.name, form.CUSTOM, fields) == {}
    assert form.method_settings("rtn", {"activations": "8-bit per tensor (static, calibrated)", "rank": 3,
                                        "vector_len": 4, "act_order": 0}) == {
        "act_bits": 8, "act_granularity": "tensor", "act_order": False}
    assert form.uses("lrq", ["rank"]) and not form.uses("gptq", ["rank", "vector_len"])
    assert form.uses("vptq", ["vector_len"]) and not form.uses("vptq", ["bits", "activations"])
    with pytest.raises(ValueError, match=r"method must be one of vptq, gptq, rtn, lrq, got 'awq'"):
        form.config_from("awq", values)
    for method, bad, message in (("vptq", {"vector_len": 0}, r"vector_len must be in 1\.\.16, got 0"),
                                 ("rtn", {"bits": 9}, r"bits must be in 1\.\.8, got 9"),
                                 ("lrq", {"iters": -1}, r"iters must be in 0\.\.100000, got -1"),
                                 ("gptq", {"activations": "4-bit"}, r"activations must be one of '16-bit")):
        with pytest.raises(ValueError, match=message):
            form.config_from(method, {**values, **bad})


def test_settings_groups_and_presets_in_the_page_config(tmp_path):
    """The page starts with the default method's groups shown and its 2-bit preset applied."""
    demo = studio_app.build_app(studio_app.AppSettings(workdir=tmp_path))
    fields = demo.settings_form
    default = methods.all_methods()[0]
    assert {k: fields[k].value for k in default.preset("2 bits")} == default.preset("2 bits")
    shown = {k for k, c in fields.items() if _visible(c)}
    assert shown == {k for k in fields if form.uses(default.name, [k])}


@dataclass(frozen=True)
class ToyConfig(ConfigBase):
    bits: int = 3
    flavour: str = "plain"  # a setting the form has no field for

    def __post_init__(self) -> None:
        check_int("bits", self.bits, 1, 8)


@pytest.fixture
def toy_method():
    """A method the app has never heard of, registered for one test."""
    toy = methods.register(Method(
        name="toy", label="Toy", description="a test method", config_class=ToyConfig,
        bits=lambda config, out_f, in_f: scalar_bits(out_f, in_f, config.bits, 0),
        describe=lambda settings: f"toy {settings.get('bits')}", presets={"2 bits": {"bits": 2, "flavour": "hot"}},
        quantize_linear=lambda W, H, config, bias, cache: None,
    ))
    yield toy
    methods.unregister(toy.name)


def test_a_newly_registered_method_gets_its_fields(tmp_path, toy_method):
    demo = studio_app.build_app(studio_app.AppSettings(workdir=tmp_path, default_model=TINY))
    fields = demo.settings_form
    method_radio = next(b for b in demo.blocks.values() if isinstance(b, gr.Radio) and b.label == "Method")
    assert ("Toy", "toy") in method_radio.choices
    values = {k: c.value for k, c in fields.items()}
    assert form.config_from("toy", values) == ToyConfig(bits=values["bits"])  # flavour keeps its default
    assert form.preset_values("toy", "2 bits", fields) == {"bits": 2}
    shown = {k for k in fields if form.uses("toy", [k])}
    assert shown == {"bits"}
    estimate = demo.studio.estimate_md(TINY, "", "toy", **{**values, "bits": 2})
    assert "**2.000 index bits**" in estimate


def _visible(component) -> bool:
    parent = component.parent
    while parent is not None:
        if getattr(parent, "visible", True) is False:
            return False
        parent = parent.parent
    return component.visible is not False


# ------------------------------------------------------------------------------------ through the API
def test_bad_settings_give_clear_errors(served, gated, monkeypatch):
    client = Client(served.url, verbose=False)
    cases = [
        (dict(num_centroids=1000), r"num_centroids must be a power of two in 2\.\.65536, got 1000"),
        (dict(method="lrq", rank=-1), r"rank must be in 0\.\.8192, got -1"),
        (dict(calib_samples=0), r"samples must be in 1\.\.100000, got 0"),
        (dict(method="awq"), r"'awq' .* is not in the list of choices: \['vptq', 'gptq', 'rtn', 'lrq'\]"),
        (dict(calib_source=form.FILE_SOURCE), r"no file was uploaded"),
        (dict(custom_model="no such model"), r"'no such model' is not a built-in name"),
        (dict(method="rtn", activations="4-bit"), r"4-bit is not in the list of choices: \['16-bit \(weight-only\)'"),
    ]
    for overrides, message in cases:
        with pytest.raises(AppError, match=message):
            client.predict(**job_kwargs(**overrides), api_name="/start")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AppError, match=r"cannot reach the Hugging Face hub to fetch 'someone/model'"):
        client.predict(**job_kwargs(custom_model="someone/model"), api_name="/start")
    assert served.studio.manager.jobs(client.session_hash) == [] and gated.runs == []
    # The live estimate explains instead of raising.
    assert "num_centroids must be a power of two" in client.predict(**estimate_kwargs(num_centroids=1000),
                                                                    api_name="/estimate")
    good = client.predict(**estimate_kwargs(), api_name="/estimate")
    assert "**1.000 index bits**" in good and "14 linears in 2 blocks" in good
    assert "**3.000 index bits**" in client.predict(**estimate_kwargs(method="gptq", bits=3), api_name="/estimate")
    with pytest.raises(AppError, match=r"evaluation windows must be in 1\.\.512, got 0"):
        client.predict("anything", 0, 64, api_name="/evaluate")
    client.close()


def test_presets_fill_exactly_what_they_fix(served):
    client = Client(served.url, verbose=False)
    keys = list(served.demo.settings_form)
    for method, name in (("vptq", "3 bits"), ("lrq", "3 bits"), ("gptq", form.CUSTOM)):
        fixed = methods.get(method).presets.get(name, {})
        values = client.predict(method, name, api_name="/preset")
        assert dict(zip(keys, values)) == {k: fixed.get(k, gr.skip()) for k in keys}, (method, name)
    client.close()


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
    assert [row[:4] for row in runs] == [[first, TINY, "VPTQ", "v4 k16"]]
    assert other.predict(api_name="/runs")[0]["data"] in ([], [[]])
    downloaded = Path(client.predict(first, api_name="/download"))
    assert downloaded.read_bytes() == Path(final["result"]["archive"]).read_bytes()
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
    out = served.studio.poll(job, {}, request)
    progress, lines, heat, table, summary, download, runs_rows, runs_fig, chat_runs, job_json, seen, timer = out
    assert "2/14 layers" in progress and [row[1] for row in table] == ["self_attn.k_proj", "self_attn.q_proj"]
    assert [t.name for t in lines.data] == ["q_proj", "k_proj"] and job_json["reports"] == 2
    assert all(x == gr.skip() for x in (summary, download, runs_rows, runs_fig, chat_runs)) and timer.active
    # Nothing new: only the progress text (elapsed time) is sent again.
    again = served.studio.poll(job, seen, request)
    assert all(x == gr.skip() for x in again[1:10]) and again[10] == seen and again[11].active
    run.release()
    until(served, client, job, lambda st: st["status"] == "done")
    done = served.studio.poll(job, seen, request)
    archive = Path(status(client, job)["result"]["archive"])
    assert "Done:" in done[4] and done[5].visible and Path(done[5].value["path"]).name == archive.name
    assert done[8].value == job and [c[1] for c in done[8].choices] == [job] and not done[11].active
    assert served.studio.poll(job, done[10], request)[4] == gr.skip()  # the summary is sent once
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


def test_bad_archives_are_refused_with_the_reason(served, tmp_path):
    client = Client(served.url, verbose=False)
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
    assert served.studio.manager.jobs(client.session_hash) == []
    client.close()


def test_unload_cancels_jobs_and_deletes_runs(served, gated):
    client = Client(served.url, verbose=False)
    finished_job = client.predict(**job_kwargs(), api_name="/start")[0]
    gated.runs[-1].release()
    ckpt = finished(served, client, finished_job)["result"]["checkpoint_dir"]
    running = client.predict(**job_kwargs(), api_name="/start")[0]
    until(served, client, running, lambda st: st["status"] == "running")
    served.studio.cache.get(("quant", ckpt, "cpu"), lambda: "a loaded model")
    served.studio.on_unload(as_request(client))
    assert served.studio.manager.jobs(client.session_hash) == []
    assert ("quant", ckpt, "cpu") not in served.studio.cache
    gated.runs[-1].release()
    deadline = time.monotonic() + 10
    dirs = [served.workdir / "jobs" / finished_job, served.workdir / "jobs" / running]
    while any(d.exists() for d in dirs) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(d.exists() for d in dirs)
    client.close()


# ------------------------------------------------------------------------------------- real runs (slow)
@pytest.mark.slow
def test_real_run_evaluate_chat_download_reload(served):
    client = Client(served.url, verbose=False)
    job = client.predict(**job_kwargs(), api_name="/start")[0]
    final = finished(served, client, job)
    assert final["status"] == "done", final["error"]
    ckpt = Path(final["result"]["checkpoint_dir"])
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
    archive = Path(final["result"]["archive"])
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
    saved = json.loads((Path(final["result"]["checkpoint_dir"]) / "quant_report.json").read_text())
    assert (saved["settings"]["act_bits"], saved["settings"]["act_granularity"]) == (8, "tensor")
    copy = pack_checkpoint(final["result"]["checkpoint_dir"], tmp_path / "copy.zip")
    picked = client.predict(handle_file(str(copy)), api_name="/upload")[0]["value"]
    dirs = [served.workdir / "jobs" / job, served.workdir / "jobs" / picked]
    assert all(d.is_dir() for d in dirs)
    client.close()
    deadline = time.monotonic() + 60
    while any(d.exists() for d in dirs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(d.exists() for d in dirs)
