"""What the app's tests share: the app served in-process on a free local port (``serve_app``), gated
stand-in quantization tasks (``GatedRuns``) that publish each layer when a test releases it, the form's keyword
arguments, waiting on a job, and a real packed checkpoint of the tiny model. A test module makes fixtures of
the generators with ``pytest.fixture(name=...)``, so each module gets its own app."""

from __future__ import annotations

import re
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

gradio_client = pytest.importorskip("gradio_client")
from factories import free_port, random_scalar_state  # noqa: E402, F401 - free_port: for the tests that import it here
from gradio_client import Client  # noqa: E402

import app as studio_app  # noqa: E402
from vptq_core.models import TINY, load_model  # noqa: E402
from vptq_core.quant.blocks import block_linears, decoder_blocks  # noqa: E402
from vptq_core.quant.results import LayerReport  # noqa: E402
from vptq_core.storage.checkpoint import save_quantized  # noqa: E402
from vptq_core.studio import form, views  # noqa: E402
from vptq_core.studio.estimate import model_info  # noqa: E402
from vptq_core.studio.queue import JobCancelled, JobSnapshot  # noqa: E402

STATS = re.compile(r"(\d+) tokens · \*\*([\d.]+) tokens/s\*\*")
LAYERS = 14  # the tiny llama: 2 blocks × 7 linears


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


def serve_app(tmp_path_factory):
    """The app served in-process (module-scoped fixture ``served``)."""
    workdir = tmp_path_factory.mktemp("studio")
    settings = studio_app.AppSettings(workdir=workdir, default_model=TINY)
    demo = studio_app.build_app(settings)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_port=port, quiet=True, **studio_app.launch_options(settings))
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}/", studio=demo.studio, workdir=workdir, demo=demo)
    demo.studio.manager.shutdown(timeout=30)
    demo.close()


def gate_jobs(served, monkeypatch):
    """Jobs started in this test run stand-in tasks; every gate opens at the end, so nothing hangs."""
    runs = GatedRuns()
    monkeypatch.setattr(served.studio.runs, "make_task", runs)
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


def wait_done(served, owner: str, job_id: str) -> JobSnapshot:
    snap = served.studio.manager.wait(job_id, owner, timeout=30)
    assert snap.status == "done", snap.error
    return snap


def make_tiny_checkpoint(tmp_path_factory) -> Path:
    """A real packed checkpoint of the tiny model (random 4-bit RTN states), as zip, made in well under a second."""
    model, tok = load_model(TINY)
    linears = {f"model.layers.{b}.{name}": m for b, block in enumerate(decoder_blocks(model))
               for name, m in block_linears(block).items()}
    states = {name: random_scalar_state(m.in_features, m.out_features, bits=4, group_size=32, seed=i)
              for i, (name, m) in enumerate(linears.items())}
    ckpt = save_quantized(model, tok, states, tmp_path_factory.mktemp("tiny") / "ckpt",
                          report={"model": {"source": TINY}, "method": "rtn"})
    return ckpt
