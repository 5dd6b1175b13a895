"""ZeroGPU Spaces: with ``SPACES_ZERO_GPU`` set and a (fake) ``spaces`` module, the app's quantization job runs
inside one ``spaces.GPU`` call with a duration that fits the model, arguments and events crossing as pickles
(as to ZeroGPU's forked worker), progress and cancellation intact; without them nothing changes."""

from __future__ import annotations

import pickle
import sys
import time
import types
from pathlib import Path

import pytest

from vptq_core import api
from vptq_core.models import TINY
from vptq_core.quant.config import CalibConfig, ScalarConfig
from vptq_core.studio import zerogpu
from vptq_core.studio.queue import JobCancelled
from vptq_core.studio.task import quantization_task

CALIB = CalibConfig(samples=2, seqlen=32, seed=0)


class FakeSpaces(types.ModuleType):
    """``spaces.GPU(duration=...)(fn)``: records each call's duration; pickles the arguments and every
    yielded event as ZeroGPU does between the app and its GPU worker."""

    def __init__(self) -> None:
        super().__init__("spaces")
        self.calls: list[dict] = []

    def GPU(self, task=None, *, duration=None, size=None):  # noqa: N802 - the real name
        def decorate(fn):
            def wrapper(*args, **kwargs):
                args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
                seconds = duration(*args, **kwargs) if callable(duration) else duration
                self.calls.append({"fn": fn.__name__, "duration": seconds})
                for event in fn(*args, **kwargs):
                    yield pickle.loads(pickle.dumps(event))

            return wrapper

        return decorate(task) if callable(task) else decorate


class Ctx:
    """The parts of a ``JobContext`` a task uses."""

    def __init__(self, out_dir: Path, stop_after: int | None = None) -> None:
        self.out_dir, self.job_id, self.stop_after = out_dir, "0123456789ab", stop_after
        self.reports, self.phases, self.total, self.stages, self.plan = [], [], None, [], None

    def set_phase(self, text):
        self.phases.append(text)

    def on_start(self, total):
        self.total = total

    def on_layer(self, report):
        self.reports.append(report)

    def on_progress(self, stage, done, total, eta_s):
        self.stages.append(stage)

    def on_plan(self, plan):
        self.plan = plan

    def should_stop(self):
        return self.stop_after is not None and len(self.reports) >= self.stop_after


@pytest.fixture
def fake_spaces(monkeypatch):
    fake = FakeSpaces()
    monkeypatch.setitem(sys.modules, "spaces", fake)
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.delenv(zerogpu.DURATION_ENV, raising=False)
    zerogpu._decorated.clear()
    yield fake
    zerogpu._decorated.clear()


def worker_waits_for_the_cancel(monkeypatch, after: int) -> None:
    """The worker quantizes in a thread of its own and may finish the run before the job's cancel, sent when the
    job has seen ``after`` linears, reaches it (on a loaded machine it did: no ``.partial`` left, the checkpoint
    written). Here, after its ``after``-th linear the worker waits (up to 60 s) until its ``should_stop`` is true,
    so the cancel lands where the test sends it."""
    real = api.quantize_to_dir

    def quantize_to_dir(*args, on_layer, should_stop, **kwargs):
        seen = []

        def layer(report) -> None:
            on_layer(report)
            seen.append(report)
            if len(seen) == after:
                deadline = time.monotonic() + 60
                while not should_stop() and time.monotonic() < deadline:
                    time.sleep(0.01)

        return real(*args, on_layer=layer, should_stop=should_stop, **kwargs)

    monkeypatch.setattr(api, "quantize_to_dir", quantize_to_dir)


@pytest.mark.slow
def test_the_job_runs_in_one_gpu_call_with_progress(fake_spaces, tmp_path: Path):
    ctx = Ctx(tmp_path)
    result = quantization_task(TINY, "rtn", ScalarConfig(bits=4), CALIB)(ctx)
    assert len(fake_spaces.calls) == 1 and fake_spaces.calls[0]["fn"] == "_worker"
    assert 60 <= fake_spaces.calls[0]["duration"] <= 900
    assert ctx.total == 14 and len(ctx.reports) == 14
    assert all(r.rel_output_error is not None for r in ctx.reports)  # filled in when each block ended
    assert any("ZeroGPU" in phase for phase in ctx.phases)
    assert ctx.stages[0] == "load" and "blocks" in ctx.stages and ctx.plan is not None  # from inside the GPU call
    assert Path(result["checkpoint_dir"], "model.safetensors").is_file() and result["summary"]["layers"] == 14


@pytest.mark.slow
def test_cancelling_reaches_the_gpu_worker(fake_spaces, tmp_path: Path, monkeypatch):
    worker_waits_for_the_cancel(monkeypatch, after=2)
    with pytest.raises(JobCancelled):
        quantization_task(TINY, "rtn", ScalarConfig(bits=4), CALIB)(Ctx(tmp_path, stop_after=2))
    assert (tmp_path / zerogpu.CANCEL_FILE).exists()
    # no checkpoint written; only the finished blocks, kept for a resume
    assert not (tmp_path / "checkpoint" / "model.safetensors").exists()
    assert {p.name for p in (tmp_path / "checkpoint").iterdir()} <= {".partial"}


@pytest.mark.slow
def test_a_resume_continues_in_the_gpu_call(fake_spaces, tmp_path: Path, monkeypatch):
    """Cancelled after 2 of 14 linears (its finished block kept), then resumed through the GPU worker: the same
    checkpoint, byte for byte, as an uninterrupted ZeroGPU run, and the resumed run says where it started."""
    whole = quantization_task(TINY, "rtn", ScalarConfig(bits=4), CALIB)(Ctx(tmp_path / "whole"))
    stopped = tmp_path / "stopped"
    with monkeypatch.context() as patch, pytest.raises(JobCancelled):
        worker_waits_for_the_cancel(patch, after=8)
        quantization_task(TINY, "rtn", ScalarConfig(bits=4), CALIB)(Ctx(stopped, stop_after=8))
    assert (stopped / "checkpoint" / ".partial").is_dir()
    resumed = quantization_task(TINY, "rtn", ScalarConfig(bits=4), CALIB, resume=True)(Ctx(stopped))
    assert resumed["summary"]["resumed_from_block"] >= 1
    assert (Path(resumed["checkpoint_dir"], "model.safetensors").read_bytes()
            == Path(whole["checkpoint_dir"], "model.safetensors").read_bytes())
    assert len(fake_spaces.calls) == 3


def test_errors_cross_with_their_message(fake_spaces, tmp_path: Path):
    with pytest.raises(ValueError, match="no such model"):
        quantization_task(str(tmp_path / "no such model"), "rtn", ScalarConfig(bits=4), CALIB)(Ctx(tmp_path))


def test_duration_grows_with_the_model_and_obeys_the_limits(monkeypatch):
    tiny = zerogpu.duration_for(TINY)
    assert tiny == 74  # 60 s + 14 linears + a few thousand weights (under one million: 0 s)
    monkeypatch.setattr("vptq_core.studio.estimate.model_info", lambda name: types.SimpleNamespace(
        linear_shapes=[(576, 576)] * 210, linear_weights=106_168_320))  # SmolLM2-135M's 210 linears
    assert zerogpu.duration_for("smollm2-135m-instruct") == 60 + 210 + 106
    monkeypatch.setattr("vptq_core.studio.estimate.model_info", lambda name: types.SimpleNamespace(
        linear_shapes=[(4096, 4096)] * 224, linear_weights=6_476_005_376))  # a 7B model: capped
    assert zerogpu.duration_for("7b") == 900
    monkeypatch.setenv(zerogpu.DURATION_ENV, "123")
    assert zerogpu.duration_for(TINY) == 123
    monkeypatch.setenv(zerogpu.MAX_DURATION_ENV, "100")
    assert zerogpu.duration_for(TINY) == 100


def test_elsewhere_nothing_changes(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    monkeypatch.setitem(sys.modules, "spaces", FakeSpaces())
    assert zerogpu.zero_gpu() is None  # spaces installed, but not on ZeroGPU
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setitem(sys.modules, "spaces", None)  # on ZeroGPU, but spaces not importable
    assert zerogpu.zero_gpu() is None


def test_handlers_run_on_a_gpu_only_where_spaces_is_installed(monkeypatch):
    def evaluate(job_id):
        yield f"evaluated {job_id}"

    monkeypatch.setitem(sys.modules, "spaces", None)  # not on Spaces: the handler itself
    assert zerogpu.on_gpu(evaluate, 300) is evaluate
    fake = FakeSpaces()
    monkeypatch.setitem(sys.modules, "spaces", fake)
    wrapped = zerogpu.on_gpu(evaluate, 300)
    assert wrapped is not evaluate and list(wrapped("abc")) == ["evaluated abc"]
    assert fake.calls == [{"fn": "evaluate", "duration": 300}]
