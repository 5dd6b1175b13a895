"""Quantization jobs on ZeroGPU Spaces: the GPU exists only inside ``spaces.GPU`` calls, so a job runs as one.

On a ZeroGPU Space (``SPACES_ZERO_GPU`` set and the ``spaces`` package importable) ``quantize_job`` runs
``api.quantize_to_dir`` inside one ``spaces.GPU(duration=...)`` call on CUDA; everywhere else it is not used and
nothing changes. ZeroGPU runs the decorated function in a forked worker process: its arguments and what it
yields are pickled, and callbacks cannot cross. So the worker is a generator that yields small events
(the number of layers, each finished layer's report, each block's output error once known, a heartbeat every
second, the final summary or the error) and the job's thread turns them into the job's progress; cancelling
the job creates a file in the job directory that the worker's ``should_stop`` looks for (the pipeline stops
between linears). The checkpoint is written by the worker into the job directory (same file system).

The duration asked for (``duration_for``) grows with the model: ``60 s + 1 s per linear + 1 s per million
linear weights`` (SmolLM2-135M: 376 s), or ``$VPTQ_ZEROGPU_DURATION`` seconds when set; at most
``$VPTQ_ZEROGPU_MAX_DURATION`` (default 900). A shorter duration gets a visitor a GPU sooner; one too short ends the
job when it runs out. ``bench/gpu_quantize.py`` measures what a run takes on a GPU.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

from ..quant.results import LayerReport

DURATION_ENV = "VPTQ_ZEROGPU_DURATION"
MAX_DURATION_ENV = "VPTQ_ZEROGPU_MAX_DURATION"
HEARTBEAT_S = 1.0
PROGRESS_EVERY_S = 1.0  # progress events forwarded from the GPU worker, at most one a second per stage
CANCEL_FILE = ".cancel"


def zero_gpu():
    """The ``spaces`` module on a ZeroGPU Space, else None (not on ZeroGPU, or ``spaces`` not installed)."""
    if not os.environ.get("SPACES_ZERO_GPU"):
        return None
    try:
        import spaces  # only installed on Hugging Face Spaces
    except ImportError:
        return None
    return spaces


def duration_for(model_name: str) -> int:
    """Seconds of GPU to ask for one quantization job of ``model_name`` (see the module docstring)."""
    maximum = int(os.environ.get(MAX_DURATION_ENV) or 900)
    fixed = os.environ.get(DURATION_ENV)
    if fixed:
        return max(1, min(int(fixed), maximum))
    from .estimate import model_info

    info = model_info(model_name)
    seconds = 60 + len(info.linear_shapes) + info.linear_weights / 1e6
    return int(max(60, min(seconds, maximum)))


def _duration(model_name, method, config, calib, out_dir, cancel_path, duration, resume=False) -> int:
    return duration  # spaces.GPU calls this with the job's arguments: the duration computed before the call


def _worker(model_name: str, method: str, config, calib, out_dir: str, cancel_path: str, duration: int,
            resume: bool = False):
    """Runs inside the ZeroGPU worker: quantize on CUDA, yield events (see the module docstring)."""
    import torch

    from ..api import quantize_to_dir

    events: queue.Queue = queue.Queue()
    reports: list[LayerReport] = []
    outcome: dict = {}

    def work() -> None:
        try:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            out, summary = quantize_to_dir(
                model_name, method, config, calib, out_dir, device=device,
                on_layer=lambda r: (reports.append(r), events.put(("layer", len(reports) - 1))),
                should_stop=lambda: os.path.exists(cancel_path),
                on_start=lambda total: events.put(("start", total)), resume=resume,
                on_progress=_progress_forwarder(events),
                on_plan=lambda plan: events.put(("plan", plan)),
            )
            outcome["done"] = (str(out), summary)
        except BaseException as exc:  # noqa: BLE001 - reported to the job, which raises it there
            outcome["error"] = (type(exc).__name__, str(exc))
        finally:
            events.put(("end", None))

    thread = threading.Thread(target=work, name="zerogpu-quantize", daemon=True)
    thread.start()
    unknown_error: list[int] = []  # reports whose block output error is not known yet
    try:
        while True:
            try:
                kind, payload = events.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                kind, payload = "tick", None
            for i in [i for i in unknown_error if reports[i].rel_output_error is not None]:
                unknown_error.remove(i)
                yield ("output_error", (i, reports[i].rel_output_error))
            if kind == "layer":
                if reports[payload].rel_output_error is None:
                    unknown_error.append(payload)
                yield ("layer", (payload, reports[payload].to_dict()))
            elif kind == "end":
                break
            else:
                yield (kind, payload)
    finally:  # also when the caller stops listening: the work must stop before the GPU goes back
        if thread.is_alive():
            Path(cancel_path).touch()
            thread.join()
    if "error" in outcome:
        yield ("error", outcome["error"])
    else:
        yield ("done", outcome["done"])


def _progress_forwarder(events: queue.Queue):
    """``on_progress`` that puts a stage's first and last event and at most one a ``PROGRESS_EVERY_S`` between
    them on ``events``: each one crosses to the app's process."""
    last: dict = {"stage": None, "at": 0.0}

    def forward(stage: str, done: int, total: int, eta_s) -> None:
        now = time.monotonic()
        if stage != last["stage"] or done >= total or now - last["at"] >= PROGRESS_EVERY_S:
            last.update(stage=stage, at=now)
            events.put(("progress", (stage, done, total, eta_s)))

    return forward


_decorated: dict = {}


def _gpu_worker(spaces):
    if id(spaces) not in _decorated:
        _decorated[id(spaces)] = spaces.GPU(duration=_duration)(_worker)
    return _decorated[id(spaces)]


def quantize_job(spaces, ctx, model_name: str, method: str, config, calib, out_dir: Path, resume: bool = False):
    """``api.quantize_to_dir`` in one ``spaces.GPU`` call, with the job's progress and cancellation
    (``ctx``: the task's ``JobContext``); ``resume`` continues an interrupted run from its last finished block, as
    ``quantize_to_dir(resume=True)`` does. Returns (checkpoint directory, summary)."""
    cancel_path = Path(ctx.out_dir) / CANCEL_FILE
    cancel_path.unlink(missing_ok=True)
    duration = duration_for(model_name)
    ctx.set_phase(f"waiting for a ZeroGPU GPU (up to {duration} s of GPU time)")
    reports: list[LayerReport] = []
    result = None
    for kind, payload in _gpu_worker(spaces)(model_name, method, config, calib, str(out_dir), str(cancel_path),
                                              duration, resume):
        if ctx.should_stop() and not cancel_path.exists():
            cancel_path.touch()
        if kind == "start":
            ctx.on_start(payload)
        elif kind == "progress":
            ctx.on_progress(*payload)
        elif kind == "plan":
            ctx.on_plan(payload)
        elif kind == "layer":
            report = LayerReport(**payload[1])
            reports.append(report)
            ctx.on_layer(report)
        elif kind == "output_error":
            index, value = payload
            reports[index].rel_output_error = value
        elif kind == "error":
            name, text = payload
            raise (ValueError(text) if name == "ValueError" else RuntimeError(f"{name}: {text}" if text else name))
        elif kind == "done":
            result = payload
    if result is None:
        raise RuntimeError("the ZeroGPU worker ended without a result")
    out, summary = result
    return Path(out), summary


def on_gpu(fn, duration: int):
    """``spaces.GPU(duration=duration)(fn)`` where the ``spaces`` package is installed (Hugging Face Spaces: on
    ZeroGPU a GPU is attached for the call; elsewhere it has no effect), else ``fn`` itself."""
    try:
        import spaces  # only installed on Hugging Face Spaces
    except ImportError:
        return fn
    return spaces.GPU(duration=duration)(fn)
