"""The Gradio app driven through its API with gradio_client, in-process on a free local port, on the tiny
model.

The queue and UI wiring (start, queue positions, cancel, live progress, poll, runs, download, sessions, the
settings form) runs gated stand-in tasks (``GatedRuns``): each layer is published when the test releases it,
so these tests are instant and deterministic. ``test_real_run_evaluate_chat_download_reload`` (slow) runs a
real quantization end to end: the numbers the app shows are the library's, chat answers are the library's,
and the downloaded archive loads back to the same model."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import queue
import re
import shutil
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

gradio_client = pytest.importorskip("gradio_client")
import gradio as gr  # noqa: E402
from factories import random_scalar_state  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

import app as studio_app  # noqa: E402
from vptq_core.eval import evaluate  # noqa: E402
from vptq_core.models import TINY, load_model  # noqa: E402
from vptq_core.quant import methods  # noqa: E402
from vptq_core.quant.bits import scalar_bits  # noqa: E402
from vptq_core.quant.blocks import block_linears, decoder_blocks  # noqa: E402
from vptq_core.quant.config import ConfigBase, check_int  # noqa: E402
from vptq_core.quant.methods import Method  # noqa: E402
from vptq_core.quant.pipeline import LayerReport  # noqa: E402
from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.storage.checkpoint import load_quantized, save_quantized  # noqa: E402
from vptq_core.studio import (  # noqa: E402
    form,
    handlers,  # noqa: E402
    views,
)
from vptq_core.studio.chat import ChatSession, GenerationStats  # noqa: E402
from vptq_core.studio.estimate import estimate, model_info  # noqa: E402
from vptq_core.studio.queue import JobCancelled, JobSnapshot  # noqa: E402

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
        archive = ctx.out_dir / "stand-in.zip"
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
                  finetune_iters=0, bits_budget=0.0, layer_bits_cap=0.0, allocation="cap", distill_iters=0,
                  distill_data="calibration",
                  bits=2,
                  group_size=32, act_order=True,
                  rank=0, iters=5,
                  activations=form.WEIGHT_ONLY, calib_source=form.WIKI_SOURCE, calib_file=None, calib_samples=4,
                  calib_seqlen=64, seed=0)
    kwargs.update(overrides)
    return kwargs


def estimate_kwargs(**overrides) -> dict:
    return {k: v for k, v in job_kwargs(**overrides).items() if k not in ("calib_source", "calib_file")}


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
    assert {k: fields[k].value for k in default.preset("2.5 bits")} == default.preset("2.5 bits")
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
    estimate, start = demo.studio.estimate_md(TINY, "", "toy", **{**values, "bits": 2})
    assert "**2.000 index bits**" in estimate and start.interactive


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
        # The form's words for its fields, not the settings' code names.
        (dict(num_centroids=1000), r"^centroids must be a power of two in 2\.\.65536, got 1000"),
        (dict(vector_len=0), r"^vector length must be in 1\.\.16, got 0"),
        (dict(method="lrq", rank=-1), r"^LRQ rank must be in 0\.\.8192, got -1"),
        (dict(calib_samples=0), r"^calibration samples must be in 1\.\.100000, got 0"),
        (dict(seed=2**64), r"^seed must be in 0\.\.18446744073709551615 \(2\*\*64 - 1\), got 18446744073709551616"),
        (dict(seed=-1), r"^seed must be in 0\.\.18446744073709551615"),
        (dict(method="awq"), r"'awq' .* is not in the list of choices: \['vptq', 'gptq', 'rtn', 'lrq'\]"),
        (dict(calib_source=form.FILE_SOURCE), r"no file was uploaded"),
        (dict(model=form.OTHER_MODEL, custom_model="no such model"), r"'no such model' is not a built-in name"),
        (dict(model=form.OTHER_MODEL, custom_model=""), r"type a hub id \(owner/name\) or a local model directory"),
        (dict(method="rtn", activations="4-bit"), r"4-bit is not in the list of choices: \['16-bit \(weight-only\)'"),
    ]
    for overrides, message in cases:
        with pytest.raises(AppError, match=message):
            client.predict(**job_kwargs(**overrides), api_name="/start")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AppError, match=r"cannot reach the Hugging Face hub to fetch 'someone/model'"):
        client.predict(**job_kwargs(model=form.OTHER_MODEL, custom_model="someone/model"), api_name="/start")
    assert served.studio.manager.jobs(client.session_hash) == [] and gated.runs == []
    # A hub id typed in the box counts only when the dropdown says so.
    assert client.predict(**job_kwargs(custom_model="someone/model"), api_name="/start")[0]
    assert [s.meta["model"] for s in served.studio.manager.jobs(client.session_hash)] == [TINY]
    # The live estimate explains instead of raising, and Start is disabled until the settings are accepted.
    # (the API returns the text; the page also gets the Start button's state)
    assert client.predict(**estimate_kwargs(num_centroids=1000), api_name="/estimate").startswith(
        "⚠️ centroids must be a power of two")
    for bad in (dict(num_centroids=1000), dict(seed=2**64), dict(calib_samples=0)):
        text, start = served.studio.estimate_md(**estimate_kwargs(**bad))
        assert text.startswith("⚠️") and start.interactive is False, bad
    assert "seed must be in 0..18446744073709551615" in served.studio.estimate_md(**estimate_kwargs(seed=2**64))[0]
    # A setting that this model's layers cannot meet is refused the same way (no error mark, Start disabled).
    text, start = served.studio.estimate_md(**estimate_kwargs(layer_bits_cap=0.5))
    assert text.startswith("⚠️ max total bits per layer 0.5: no vector length fits a ") and not start.interactive
    with pytest.raises(AppError, match=r"^max total bits per layer 0\.5: no vector length fits"):
        client.predict(**job_kwargs(layer_bits_cap=0.5), api_name="/start")
    good = client.predict(**estimate_kwargs(), api_name="/estimate")
    assert "**1.000 index bits**" in good and "14 linears in 2 blocks" in good
    assert served.studio.estimate_md(**estimate_kwargs())[1].interactive is True
    # The duration is shown before Start, with what it rests on.
    assert re.search(r"Takes ≈ \*\*\d+ s\*\*.*rough: from runs measured on 2 idle CPU cores", good), good
    assert "**3.000 index bits**" in client.predict(**estimate_kwargs(method="gptq", bits=3), api_name="/estimate")
    with pytest.raises(AppError, match=r"evaluation windows must be in 1\.\.512, got 0"):
        client.predict("anything", 0, 64, api_name="/evaluate")
    client.close()


def test_presets_fill_exactly_what_they_fix(served, tmp_path):
    client = Client(served.url, verbose=False)
    keys = list(served.demo.settings_form)
    for method, name in (("vptq", "3.5 bits"), ("lrq", "3.5 bits"), ("gptq", form.CUSTOM)):
        fixed = methods.get(method).presets.get(name, {})
        values = client.predict(method, name, "smollm2-135m-instruct", "", api_name="/preset")
        assert dict(zip(keys, values)) == {k: fixed.get(k, gr.skip()) for k in keys}, (method, name)
    client.close()
    # picking a preset sizes it for the chosen model as picking the model does (no distillation for 7B)
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000).save_pretrained(tmp_path / "big")
    got = dict(zip(keys, served.studio.preset_form("vptq", "2.5 bits", form.OTHER_MODEL, str(tmp_path / "big"))))
    assert got["distill_iters"] == 0 and got["vector_len"] == methods.get("vptq").presets["2.5 bits"]["vector_len"]
    small = dict(zip(keys, served.studio.preset_form("vptq", "2.5 bits", "smollm2-135m-instruct", "")))
    assert small["distill_iters"] == methods.get("vptq").presets["2.5 bits"]["distill_iters"] > 0
    unreadable = dict(zip(keys, served.studio.preset_form("vptq", "2.5 bits", form.OTHER_MODEL, "no such")))
    assert unreadable == small


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
    out = served.studio.poll(job, {}, request)
    (progress, lines, heat, table, summary, download, runs_rows, runs_fig, chat_runs, pick_runs, job_json, seen,
     guard, timer) = out
    assert "2/14 layers" in progress and [row[1] for row in table] == ["self_attn.k_proj", "self_attn.q_proj"]
    assert [t.name for t in lines.data] == ["q_proj", "k_proj"] and job_json["reports"] == 2
    assert all(x == gr.skip() for x in (summary, download, runs_rows, runs_fig, chat_runs, pick_runs))
    assert timer.active and 'data-busy="1"' in guard  # leaving the page now asks first
    # Nothing new: only the progress text (elapsed time) is sent again.
    again = served.studio.poll(job, seen, request)
    assert all(x == gr.skip() for x in again[1:11]) and again[11] == seen and again[13].active
    run.release()
    until(served, client, job, lambda st: st["status"] == "done")
    done = served.studio.poll(job, seen, request)
    archive = Path(served.studio.manager.get(job, client.session_hash).result["archive"])
    served_copy = Path(done[5].value["path"])
    assert "Done:" in done[4] and done[5].visible and served_copy.name == archive.name
    # The page's download is a copy in a fresh random folder of Gradio's cache, not the work directory's file.
    assert served_copy.read_bytes() == archive.read_bytes() and not served_copy.is_relative_to(served.workdir)
    assert re.fullmatch(r"vq-[0-9a-f]{32}", served_copy.parent.name)
    assert done[8].value == job and [c[1] for c in done[8].choices] == [job] and not done[13].active
    assert [c[1] for c in done[9].choices] == [job]
    assert 'data-busy="0" data-unexported="1"' in done[12]  # a result not taken home yet
    assert served.studio.poll(job, done[11], request)[4] == gr.skip()  # the summary is sent once
    assert 'data-unexported="0"' in served.studio.mark_exported(job, request)
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


def _done(served, owner: str, job_id: str) -> JobSnapshot:
    snap = served.studio.manager.wait(job_id, owner, timeout=30)
    assert snap.status == "done", snap.error
    return snap


@pytest.mark.slow  # subprocesses or a served app: seconds each
def test_runs_survive_a_reload_and_api_sessions_are_cleaned_up(served, gated):
    # A page: the browser's lasting identity comes from attach (kept in the browser's local storage).
    page = Client(served.url, verbose=False)
    identity = served.studio.attach(None, as_request(page))[0]
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", identity) and identity != page.session_hash
    job = page.predict(**job_kwargs(), api_name="/start")[0]
    gated.runs[-1].release()
    snap = _done(served, identity, job)
    archive, ckpt = Path(snap.result["archive"]), Path(snap.result["checkpoint_dir"])
    # Reload: the page goes away and a new one comes back with the identity the browser kept.
    served.studio.on_unload(as_request(page))
    page.close()
    assert archive.is_file() and ckpt.is_dir()
    reloaded = Client(served.url, verbose=False)
    ident, watched, poll_state, timer, _ev, rows, _fig, chat_pick, delete_pick, guard = served.studio.attach(
        identity, as_request(reloaded))
    assert (ident, watched, timer.active) == (identity, job, True) and [r[0] for r in rows] == [job]
    assert [c[1] for c in chat_pick.choices] == [job] == [c[1] for c in delete_pick.choices]
    assert 'data-unexported="1"' in guard  # the result was not taken home yet: leaving asks first
    tick = served.studio.poll(job, poll_state, as_request(reloaded))  # the first tick fills the page in again
    assert "Done:" in tick[4] and tick[5].visible and Path(tick[5].value["path"]).read_bytes() == archive.read_bytes()
    downloaded = Path(reloaded.predict(job, api_name="/download"))
    assert downloaded.read_bytes() == archive.read_bytes()
    assert reloaded.predict(api_name="/runs")[0]["data"][0][0] == job
    # The unloaded page keeps acting for its browser (a user may choose to stay on the page) until the link
    # expires with the runs; then the old session reaches nothing. A malformed identity gets a new one.
    assert served.studio.owner(as_request(page)) == identity
    assert served.studio.forget_pages(3600) == 0 and served.studio.forget_pages(0) >= 1
    assert served.studio.owner(as_request(page)) == page.session_hash
    with pytest.raises(ValueError, match=rf"no job '{job}' in this session"):
        served.studio.manager.get(job, page.session_hash)
    stranger = Client(served.url, verbose=False)
    fresh = served.studio.attach("../../" + identity[6:], as_request(stranger))
    assert fresh[0] != identity and fresh[1] == "" and fresh[5] == []
    # Deleting a run removes its files and every download copy made of it.
    copies = list(served.studio._served[job])
    assert copies and all(c.is_file() for c in copies)
    reloaded.predict(job, job, api_name="/delete_run")
    assert not ckpt.parent.exists() and not any(c.exists() for c in copies)
    assert served.studio.manager.jobs(identity) == []

    # An API session that never attached cannot come back: its jobs are cancelled and its runs deleted.
    client = Client(served.url, verbose=False)
    finished_job = client.predict(**job_kwargs(), api_name="/start")[0]
    gated.runs[-1].release()
    ckpt = _done(served, client.session_hash, finished_job).result["checkpoint_dir"]
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
    identity = served.studio.attach(None, as_request(owner))[0]
    job = owner.predict(**job_kwargs(), api_name="/start")[0]
    gated.runs[-1].release()
    snap = _done(served, identity, job)
    archive, ckpt = Path(snap.result["archive"]), Path(snap.result["checkpoint_dir"])
    attacker = Client(served.url, verbose=False)
    served.studio.attach(None, as_request(attacker))
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
    served_copy = served.studio._served[job][-1]
    assert _http_status(base + str(served_copy)) == 200  # the route works: the owner's own copy is served
    assert copy.read_bytes() == archive.read_bytes()
    served.studio.delete_run(job, "", as_request(owner))
    assert _http_status(base + str(served_copy)) == 403  # gone from Gradio's cache with its run

    # Nothing a user sees names the work directory, Gradio's cache or a session: a failed job's error neither.
    def failing(model, method, config, calib, device="cpu", calib_text=None):
        def task(ctx):
            raise OSError(f"cannot open {ctx.out_dir / 'checkpoint' / 'model.safetensors'} (session "
                          f"{identity})")
        return task

    monkeypatch.setattr(served.studio, "make_task", failing)
    failed = owner.predict(**job_kwargs(), api_name="/start")[0]
    assert served.studio.manager.wait(failed, identity, timeout=30).status == "failed"
    monkeypatch.setattr(served.studio, "make_task", gated)
    shown = [owner.predict(**job_kwargs(), api_name="/start"), owner.predict(failed, api_name="/job_status"),
             owner.predict(failed, api_name="/poll"), owner.predict(api_name="/runs")]
    with pytest.raises(AppError) as refused:
        owner.predict(handle_file(__file__), api_name="/upload")
    shown.append(str(refused.value))
    text = json.dumps(shown, default=str)
    assert "model.safetensors" in text  # the error is there, without where the file was
    for secret in (str(served.workdir), str(served.studio.serve_dir), identity, owner.session_hash,
                   attacker.session_hash):
        assert secret not in text, secret
    for c in (owner, attacker):
        c.close()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A real packed checkpoint of the tiny model (random 4-bit RTN states), as zip, made in well under a second."""
    model, tok = load_model(TINY)
    linears = {f"model.layers.{b}.{name}": m for b, block in enumerate(decoder_blocks(model))
               for name, m in block_linears(block).items()}
    states = {name: random_scalar_state(m.in_features, m.out_features, bits=4, group_size=32, seed=i)
              for i, (name, m) in enumerate(linears.items())}
    ckpt = save_quantized(model, tok, states, tmp_path_factory.mktemp("tiny") / "ckpt",
                          report={"model": {"source": TINY}, "method": "rtn"})
    return ckpt


def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_uploads_are_limited_and_checked_before_they_become_runs(served, tiny_checkpoint, tmp_path, monkeypatch):
    client = Client(served.url, verbose=False)
    owner = served.studio.attach(None, as_request(client))[0]
    jobs_dir = served.workdir / "jobs"

    def refused(path: Path, message: str) -> None:
        before = set(jobs_dir.iterdir())
        with pytest.raises(AppError, match=message):
            client.predict(handle_file(str(path)), api_name="/upload")
        # nothing written stays on disk (<=: a closed session's runs from an earlier test may go meanwhile)
        assert set(jobs_dir.iterdir()) <= before
        assert not any(p.name == path.name for p in served.studio.serve_dir.rglob("*"))  # the upload is gone too

    # A zip bomb: a valid safetensors header, then 50 MB of zeros, deflated to ~50 kB.
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("config.json", (tiny_checkpoint / "config.json").read_text())
        n = 50_000_000
        zf.writestr("model.safetensors", _safetensors_bytes(
            {"x": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}, bytes(n)))
    assert bomb.stat().st_size < 1_000_000
    refused(bomb, r"cannot load bomb.zip: entry 'model.safetensors' unpacks to 50000\d+ bytes \(50.0 MB\) from \d+ "
                  r"compressed bytes, a ratio of \d+; at most 100 is allowed")
    # Deeply nested JSON: a reason, not a RecursionError.
    nested = tmp_path / "nested.zip"
    with zipfile.ZipFile(nested, "w") as zf:
        zf.writestr("config.json", "[" * 100_000 + "]" * 100_000)
        zf.writestr("model.safetensors", (tiny_checkpoint / "model.safetensors").read_bytes())
    refused(nested, r"cannot load nested.zip: config.json: JSON nested too deeply")

    # A checkpoint whose tensors do not match what its config implies is refused at upload, not at chat.
    good = pack_checkpoint(tiny_checkpoint, tmp_path / "good.zip")
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:, :32].contiguous()
    wrong = tmp_path / "wrong-dir"
    shutil.copytree(tiny_checkpoint, wrong)
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    refused(pack_checkpoint(wrong, tmp_path / "wrong.zip"), r"cannot load wrong.zip: .*model.embed_tokens.weight")
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    name = next(k for k in tensors if k.endswith(".scales"))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    refused(pack_checkpoint(wrong, tmp_path / "dtype.zip"), rf"cannot load dtype.zip: .*{re.escape(name)}")
    assert served.studio.manager.jobs(owner) == []

    # The disk quotas: this browser's, then everyone's; the runs per browser.
    size = sum(p.stat().st_size for p in tiny_checkpoint.iterdir())
    settings = served.studio.settings
    monkeypatch.setattr(served.studio, "settings", dataclasses.replace(settings, user_quota_bytes=size // 2))
    refused(good, rf"archive expands to more than {size // 2} bytes .*\(what is left of your "
                  rf"{re.escape(views.mb(size // 2))} disk quota\)")
    monkeypatch.setattr(served.studio, "settings", dataclasses.replace(settings, total_quota_bytes=size // 2))
    refused(good, r"what is left of the server's .* disk quota")
    monkeypatch.setattr(served.studio, "settings", settings)
    picked = client.predict(handle_file(str(good)), api_name="/upload")[0]["value"]
    assert [s.id for s in served.studio.manager.jobs(owner)] == [picked]
    monkeypatch.setattr(served.studio.manager, "max_runs_per_owner", 1)
    refused(good, r"you already have 1 runs kept or in progress \(limit 1 per browser\); delete one")
    with pytest.raises(AppError, match=r"limit 1 per browser"):
        client.predict(**job_kwargs(), api_name="/start")
    monkeypatch.setattr(served.studio.manager, "max_runs_per_owner", 6)
    used = served.studio.manager.disk_usage(owner)
    monkeypatch.setattr(served.studio, "settings", dataclasses.replace(settings, user_quota_bytes=used + 1000))
    with pytest.raises(AppError, match=rf"this run needs about .* MB; your runs use {used / 1e6:.1f} MB of your "
                                       r"0.\d MB disk quota: delete a run"):
        client.predict(**job_kwargs(), api_name="/start")
    client.predict(picked, "", api_name="/delete_run")
    client.close()


def test_settings_follow_the_model(served, tmp_path):
    keys = list(served.studio.field_keys)
    preset, samples, seqlen, *values = served.studio.model_defaults(TINY, "", "vptq", "2.5 bits")
    assert (preset, (samples, seqlen)) == (form.CUSTOM, form.SMALL_MODEL_CALIB)
    small = {k: v for k, v in zip(keys, values) if v != gr.skip()}
    assert small == form.SMALL_MODEL_VALUES
    info = model_info(TINY)
    two_bits = form.initial_values("2.5 bits")
    # SmolLM2-sized: the 2.5-bit budget cannot be met on 64-wide layers by capping the preset's codebook (the
    # codebook alone costs more); the preset's own per-layer plan is bounded by its budget.
    with pytest.raises(ValueError, match="bits_budget 2.5 cannot be met on this model with vector_len 6, "
                                         "num_centroids 4096: the least it reaches is"):
        estimate(info, "vptq", form.config_from("vptq", {**two_bits, "allocation": "cap"}))
    planned = estimate(info, "vptq", form.config_from("vptq", two_bits))
    assert planned.planned and planned.total_bits_per_weight == 2.5
    assert estimate(info, "vptq", form.config_from("vptq", {**two_bits, **small, "allocation": "cap"})
                    ).total_bits_per_weight < 2
    # A wider model (read from its config alone) gets the chosen preset back, or the 2-bit one after "custom".
    LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=8, vocab_size=1000).save_pretrained(tmp_path / "wide")
    for chosen, expected in (("3.5 bits", "3.5 bits"), (form.CUSTOM, "2.5 bits")):
        preset, samples, seqlen, *values = served.studio.model_defaults(form.OTHER_MODEL, str(tmp_path / "wide"),
                                                                        "vptq", chosen)
        assert (preset, (samples, seqlen)) == (expected, form.MODEL_CALIB)
        assert {k: v for k, v in zip(keys, values) if v != gr.skip()} == form.preset_values("vptq", expected, keys)
    # A 7B-shaped model keeps the preset but not its distillation (whole model + original in memory)
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000).save_pretrained(tmp_path / "big")
    preset, _, _, *values = served.studio.model_defaults(form.OTHER_MODEL, str(tmp_path / "big"), "vptq", "2.5 bits")
    got = {k: v for k, v in zip(keys, values) if v != gr.skip()}
    assert preset == "2.5 bits" and got == {**form.preset_values("vptq", "2.5 bits", keys), "distill_iters": 0,
                                            "calib_sampled_share": 0.0}
    # A model that cannot be read changes nothing (its note says why).
    assert all(v == gr.skip() for v in served.studio.model_defaults(form.OTHER_MODEL, "no such", "vptq", "2.5 bits"))


def test_push_to_the_users_hub_repo(served, tiny_checkpoint, monkeypatch):
    client = Client(served.url, verbose=False)
    request = as_request(client)
    run = client.predict(handle_file(str(pack_checkpoint(tiny_checkpoint, tiny_checkpoint.parent / "h.zip"))),
                         api_name="/upload")[0]["value"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    note, button = served.studio.hub_status()
    assert "Pushing is disabled" in note and "HF_HUB_OFFLINE is set" in note and button.interactive is False
    with pytest.raises(AppError, match=r"cannot reach the Hugging Face hub \(HF_HUB_OFFLINE is set\); pushing is "
                                       r"disabled, download the zip instead"):
        client.predict(run, "me/tiny-rtn", True, "hf_secret", api_name="/push")
    monkeypatch.setattr(handlers, "hub_reachable", lambda: (True, ""))
    calls = []

    class FakeHub:
        def __init__(self, token):
            calls.append(("token", token))

        def create_repo(self, repo_id, private, exist_ok, repo_type):
            calls.append(("create", repo_id, private))

        def upload_folder(self, folder_path, repo_id, repo_type, allow_patterns, commit_message):
            calls.append(("upload", repo_id, sorted(allow_patterns)))
            if repo_id == "me/refused":
                raise RuntimeError("403 Forbidden: token hf_secret cannot write\nmore")

    monkeypatch.setattr(served.studio, "hub_api", lambda token: FakeHub(token))
    with pytest.raises(AppError, match=r"repo must be 'your-name/repo-name'"):
        client.predict(run, "../etc", True, "hf_secret", api_name="/push")
    with pytest.raises(AppError, match=r"sign in with Hugging Face \(on Spaces\) or paste a write token"):
        client.predict(run, "me/tiny-rtn", True, "", api_name="/push")
    message, guard = served.studio.push(run, "me/tiny-rtn", True, "hf_secret", request)
    assert message.startswith("Pushed 8 files to [me/tiny-rtn](https://huggingface.co/me/tiny-rtn) (private)")
    assert calls[:2] == [("token", "hf_secret"), ("create", "me/tiny-rtn", True)]
    assert "README.md" in calls[2][2] and "model.safetensors" in calls[2][2] and 'data-unexported="0"' in guard
    with pytest.raises(AppError, match=r"the hub refused the push: 403 Forbidden: token \*\*\* cannot write$"):
        client.predict(run, "me/refused", False, "hf_secret", api_name="/push")
    client.predict(run, "", api_name="/delete_run")
    client.close()


class FakeSide:
    """A stand-in ``ChatSession``: streams tokens one per ``release()``, so a test decides who is ahead."""

    def __init__(self, model, tokenizer):
        self.model, self.name = torch.nn.Linear(2, 2), model
        self.history: list = []
        self.steps = threading.Semaphore(0)
        self.stopped = threading.Event()
        self.started = threading.Event()
        self.last_stats = None
        self.sent = 0

    def check_prompt(self, prompt, max_new_tokens, max_prompt_tokens=None):
        return None

    def stream(self, prompt, max_new_tokens=8, temperature=0.0, top_p=1.0, max_prompt_tokens=None):
        self.started.set()
        for _ in range(max_new_tokens):
            while not self.steps.acquire(timeout=0.01):
                if self.stopped.is_set():
                    break
            if self.stopped.is_set():
                break
            self.sent += 1
            yield f"{self.name}{self.sent} "
        self.last_stats = GenerationStats(tokens=self.sent, seconds=1.0, first_token_seconds=0.5, prompt_tokens=3)

    def stop(self):
        self.stopped.set()


def test_both_chat_sides_stream_at_once_and_stop_on_their_own(served, monkeypatch):
    sides: dict[str, FakeSide] = {}

    def make_chat(model, tokenizer):
        sides[model] = FakeSide(model, tokenizer)
        return sides[model]

    monkeypatch.setattr(served.studio, "make_chat", make_chat)
    monkeypatch.setattr(served.studio, "_run_models", lambda run_id, owner: (("Q", None), ("O", None), "", TINY))
    request = as_request(SimpleNamespace(session_hash="chat-test-session"))
    replies = served.studio.chat("Hello", [], [], "run", 0.0, 1.0, 6, request)
    first = next(replies)  # the prompt on both sides, empty replies
    assert texts(first[0]) == [("user", "Hello"), ("assistant", "")] and first[4] == ""
    updates: queue.Queue = queue.Queue()
    consumer = threading.Thread(target=lambda: [updates.put(out) for out in replies] + [updates.put(None)],
                                daemon=True)
    consumer.start()
    assert sides["O"].started.wait(5) and sides["Q"].started.wait(5)  # both generate before either gave a token

    def step(side: str):
        """Let ``side`` produce one token; the page update that shows it."""
        sides[side].steps.release()
        while True:
            out = updates.get(timeout=5)
            assert out is not None, "the chat ended early"
            if views.message_text((out[0] if side == "O" else out[1])[-1]["content"]).count(side) == sides[side].sent:
                return out

    out = step("Q")  # the quantized side's first token arrives while the original has given none
    assert (texts(out[0])[-1][1], texts(out[1])[-1][1]) == ("", "Q1 ")
    out = step("O")
    assert (texts(out[0])[-1][1], texts(out[1])[-1][1]) == ("O1 ", "Q1 ")
    served.studio.chat_stop_original(request)  # Stop on one side: the other goes on
    assert sides["O"].stopped.wait(5)
    for _ in range(5):
        out = step("Q")
    assert views.message_text(out[1][-1]["content"]) == "Q1 Q2 Q3 Q4 Q5 Q6 "
    assert views.message_text(out[0][-1]["content"]) == "O1 "
    rest = []
    while (item := updates.get(timeout=5)) is not None:
        rest.append(item)
    final = rest[-1] if rest else out
    assert STATS.search(final[2]).group(1) == "1" and "stopped" in final[2]
    assert STATS.search(final[3]).group(1) == "6" and "stopped" not in final[3]


def test_prompts_are_bounded_by_tokens_and_the_model_context(served, tiny_checkpoint):
    model, tok = load_model(TINY)
    session = ChatSession(model, tok)
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=r"the message is \d+ characters; at most 320 are accepted \(prompts are "
                                         r"limited to 10 tokens\)"):
        session.check_prompt("x" * 321, 4, max_prompt_tokens=10)
    with pytest.raises(ValueError, match=r"the prompt is \d+ tokens with the conversation so far; at most 10 are "
                                         r"allowed: shorten the message or press Clear"):
        session.check_prompt("hello " * 20, 4, max_prompt_tokens=10)
    with pytest.raises(ValueError, match=rf"plus max new tokens \({context}\) is \d+ tokens, more than the model's "
                                         rf"context of {context}"):
        session.check_prompt("hello", context)
    assert session.check_prompt("hello", 4, max_prompt_tokens=100).shape[0] == 1
    # Through the app: the limit and the reason reach the user before anything is generated.
    client = Client(served.url, verbose=False)
    picked = client.predict(handle_file(str(pack_checkpoint(tiny_checkpoint, tiny_checkpoint.parent / "p.zip"))),
                            api_name="/upload")[0]["value"]
    limit = served.studio.settings.max_prompt_tokens
    with pytest.raises(AppError, match=rf"original model: the message is 240000 characters; at most {32 * limit}"):
        client.predict("y" * 240_000, [], [], picked, 0.0, 1.0, 4, api_name="/chat")
    with pytest.raises(AppError, match=rf"original model: the prompt is \d+ tokens .*at most {limit} are allowed"):
        client.predict("hello " * (limit + 10), [], [], picked, 0.0, 1.0, 4, api_name="/chat")
    client.close()


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


def test_sampled_replies_stay_reproducible_with_both_sides_at_once(served):
    """Two sessions sampling at once (as the chat's two sides do) each give what their seed gives alone."""
    model, tok = load_model(TINY)
    alone = "".join(ChatSession(model, tok).stream("Hello", max_new_tokens=12, temperature=1.0, seed=3))
    outs: dict[int, str] = {}

    def side(i: int) -> None:
        outs[i] = "".join(ChatSession(model, tok).stream("Hello", max_new_tokens=12, temperature=1.0, seed=3))

    threads = [threading.Thread(target=side, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert alone and outs == {0: alone, 1: alone}


# ------------------------------------------------------------------------------------ restarts
class Killed(BaseException):
    """Stands in for the process dying: not an Exception, so the job thread ends without any cleanup."""


def killed_after(layers: int):
    """A ``make_task`` whose real quantization dies right after ``layers`` layers were published."""
    def make(*args, **kwargs):
        real = handlers.quantization_task(*args, **kwargs)

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
    identity = before.attach(None, _page("page-1"))[0]
    job = before.start(**kwargs, request=_page("page-1"))[0]
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
        stranger = after.attach(None, _page("page-3"))
        assert stranger[1] == "" and after.manager.jobs(stranger[0]) == []
        with pytest.raises(gr.Error, match=rf"no job '{job}' in this session"):
            after.resume(job, _page("page-3"))
        ident, watched, poll_state, timer, *_rest = after.attach(identity, _page("page-2"))
        assert (ident, watched) == (identity, job)
        snap = after.manager.get(job, identity)
        assert snap.status == "interrupted" and snap.extras["interrupted"] == {"blocks_done": 1, "blocks_total": 2}
        tick = after.poll(job, poll_state, _page("page-2"))
        assert "interrupted" in tick[0] and "1 of 2 blocks done" in tick[0] and not tick[-1].active
        calib_file.write_text("A small corpus of plain English words for calibration and evaluation. " * 60,
                              encoding="utf-8")  # the uninterrupted run to compare with, on the same text
        with pytest.raises(gr.Error, match="was not interrupted"):  # (only an interrupted run resumes)
            after.resume(after.start(**kwargs, request=_page("page-2"))[0], _page("page-2"))
        reference = _done(SimpleNamespace(studio=after), identity, after.manager.jobs(identity)[-1].id)
        out = after.resume(job, _page("page-2"))
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
        rows = again.attach(identity, _page("page-4"))[5]
        assert sorted(r[0] for r in rows) == sorted([job, reference.id])
        back = again.manager.get(job, identity)
        assert back.status == "done" and back.result == resumed.result and back.layers_done == LAYERS
        assert Path(again.download(job, _page("page-4"))).read_bytes() == Path(resumed.result["archive"]).read_bytes()
    finally:
        again.close()
