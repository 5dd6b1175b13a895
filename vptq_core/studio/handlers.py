"""The app's event handlers (``Studio``): quantize, poll, cancel, download, evaluate, upload, chat. Every
handler works on the jobs and runs of the calling browser session only.

The settings form reaches ``estimate_md`` and ``start`` as keyword arguments named by the form field
(``vector_len=4, bits=2, activations=..., seed=0``; see ``form``), collected into one ``settings`` dict.
What is shown is formatted by ``views``; ``app.py`` lays the page out and wires these handlers to it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from ..api import source_model_of
from ..eval import evaluate
from ..models import BUNDLED, TINY, load_model
from ..quant.config import CalibConfig
from ..storage.archive import DEFAULT_MAX_BYTES, extract_checkpoint
from ..storage.checkpoint import checkpoint_size, load_quantized, read_quantization_config
from . import form, plots, views
from .chat import ChatSession, check_sampling, model_memory_bytes
from .estimate import estimate, model_info
from .model_cache import ModelCache
from .queue import JobManager
from .task import quantization_task


@dataclass(frozen=True)
class AppSettings:
    workdir: Path
    default_model: str = BUNDLED
    device: str = "cpu"
    chat_concurrency: int = 2
    max_upload_bytes: int = DEFAULT_MAX_BYTES
    max_calib_bytes: int = 32 * 1024**2
    eval_windows: int = 4
    eval_seqlen: int = 512
    cleanup_workdir: bool = False  # remove the work dir at exit (it was a fresh temporary one)


def user_error(message) -> gr.Error:
    """A message for the user (shown in the page), not a server fault: no traceback in the log."""
    return gr.Error(str(message), print_exception=False)


class Studio:
    """Event handlers of the app. ``make_task(model, method, config, calib, device=, calib_text=)`` builds a
    job's task (``task.quantization_task``; tests pass stand-ins)."""

    def __init__(self, settings: AppSettings, manager: JobManager | None = None, cache: ModelCache | None = None,
                 make_task: Callable[..., Callable] = quantization_task):
        self.settings = settings
        limits = {"cpu": 1, **({settings.device: 1} if settings.device != "cpu" else {})}
        self.manager = manager or JobManager(settings.workdir, limits=limits)
        self.cache = cache or ModelCache(max_items=4)
        self.make_task = make_task
        self._chat_lock = threading.Lock()
        self._chats: dict[str, list[ChatSession]] = {}
        self._chat_stop: dict[str, threading.Event] = {}
        gpu = settings.device == "cuda"
        self.dtype = "float16" if gpu else "bfloat16"  # fp16 matmuls are very slow on CPU; bf16 is not

    # ----------------------------------------------------------------------------------------- helpers
    @staticmethod
    def owner(request: gr.Request | None) -> str:
        session = getattr(request, "session_hash", None) if request is not None else None
        if not session:
            raise user_error("this action needs a browser session (no session id in the request)")
        return session

    @staticmethod
    def model_name(model: str | None, custom_model: str | None) -> str:
        return (custom_model or "").strip() or (model or "")

    def model_note(self, model: str, custom_model: str) -> str:
        name = self.model_name(model, custom_model)
        if name in (BUNDLED, TINY):
            return views.model_note(name)
        try:
            return views.model_note(name, model_info(name))
        except ValueError as exc:
            return views.model_note(name, error=str(exc))

    def estimate_md(self, model, custom_model, method, **settings) -> str:
        """Live bits per weight and checkpoint size for the current settings (warnings inline, no popup)."""
        name = self.model_name(model, custom_model)
        try:
            config = form.config_from(method, settings)
            info = model_info(name)
        except ValueError as exc:
            return f"⚠️ {exc}"
        return views.estimate_md(info, estimate(info, method, config))

    def _read_calibration_file(self, calib_file) -> str:
        if not calib_file:
            raise ValueError("calibration source is 'my .txt file' but no file was uploaded")
        path = Path(calib_file if isinstance(calib_file, str) else calib_file.get("path", ""))
        if not path.is_file():
            raise ValueError("the uploaded calibration file is gone; upload it again")
        size = path.stat().st_size
        if size > self.settings.max_calib_bytes:
            raise ValueError(f"calibration file is {views.mb(size)}; at most {views.mb(self.settings.max_calib_bytes)} "
                             "allowed")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"calibration file is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if not text.strip():
            raise ValueError("calibration file is empty")
        return text

    # ------------------------------------------------------------------------------------ quantize tab
    def start(self, model, custom_model, method, calib_source, calib_file, calib_samples, calib_seqlen,
              request: gr.Request, **settings):
        """Validate the settings and queue a quantization job; returns the job id and resets the live view."""
        owner = self.owner(request)
        name = self.model_name(model, custom_model)
        try:
            config = form.config_from(method, settings)
            calib = CalibConfig(text="wiki", samples=calib_samples, seqlen=calib_seqlen, seed=settings.get("seed", 0))
            calib_text = self._read_calibration_file(calib_file) if calib_source == form.FILE_SOURCE else None
            info = model_info(name)
            est = estimate(info, method, config)
            task = self.make_task(name, method, config, calib, device=self.settings.device, calib_text=calib_text)
            snap = self.manager.submit(owner, task, title=views.job_title(name, method, est),
                                       device=self.settings.device, meta={
                                           "model": name, "method": method, "settings": config.to_dict(),
                                           "num_blocks": info.num_blocks, "modules": list(info.modules),
                                           "estimate": asdict(est)})
        except ValueError as exc:
            raise user_error(exc) from None
        return (snap.id, views.progress_html(snap), plots.proxy_error_figure([], info.num_blocks),
                plots.error_heatmap_figure([], info.num_blocks, info.modules), [], "",
                gr.DownloadButton(value=None, visible=False), "", {"job": snap.id, "version": None, "status": None},
                gr.Timer(active=True), snap.to_dict(reports=False))

    def job_status(self, job_id: str, request: gr.Request) -> dict:
        """The job as JSON, with every layer report so far."""
        try:
            return self.manager.get(job_id, self.owner(request)).to_dict()
        except ValueError as exc:
            raise user_error(exc) from None

    def cancel(self, job_id: str, request: gr.Request):
        try:
            snap = self.manager.cancel(job_id, self.owner(request))
        except ValueError as exc:
            raise user_error(exc) from None
        return views.progress_html(snap), snap.to_dict(reports=False)

    def runs_view(self, owner: str):
        """(rows of the runs table, bits-vs-perplexity figure, choices of the chat run picker)."""
        rows, points, choices = views.runs_view(self.manager.jobs(owner, statuses=("done",)))
        return rows, plots.runs_figure(points), choices

    def runs(self, request: gr.Request):
        rows, fig, _choices = self.runs_view(self.owner(request))
        return rows, fig

    def poll(self, job_id: str, seen: dict | None, request: gr.Request):
        """Timer tick: refresh the live view of the watched job; plots and tables only when they changed."""
        owner = self.owner(request)
        seen = dict(seen or {})
        skip = gr.skip()
        if not job_id:
            return (skip,) * 11 + (gr.Timer(active=False),)
        try:
            snap = self.manager.get(job_id, owner)
        except ValueError as exc:
            return (views.progress_html(None, str(exc)),) + (skip,) * 10 + (gr.Timer(active=False),)
        version = [snap.id, snap.status, list(snap.reports_version)]
        changed = seen.get("version") != version
        finished_now = changed and not snap.active and seen.get("status") != snap.status
        num_blocks, modules = snap.meta.get("num_blocks"), snap.meta.get("modules")
        lines = heat = table = job_json = skip
        if changed:
            lines = plots.proxy_error_figure(snap.reports, num_blocks)
            heat = plots.error_heatmap_figure(snap.reports, num_blocks, modules)
            table = plots.report_rows(snap.reports)
            job_json = snap.to_dict(reports=False)
        summary = download = runs_rows = runs_fig = chat_runs = skip
        if finished_now:
            summary = views.summary_md(snap)
            result = snap.result or {}
            archive = result.get("archive")
            download = gr.DownloadButton(label=views.download_label(result.get("archive_bytes")), value=archive,
                                         visible=bool(archive))
            runs_rows, runs_fig, choices = self.runs_view(owner)
            chat_runs = (gr.Dropdown(choices=choices, value=snap.id) if snap.status == "done"
                         else gr.Dropdown(choices=choices))
        seen = {"job": snap.id, "version": version, "status": snap.status}
        return (views.progress_html(snap), lines, heat, table, summary, download, runs_rows, runs_fig, chat_runs,
                job_json, seen, gr.Timer(active=snap.active))

    def download(self, job_id: str, request: gr.Request):
        """The packed checkpoint archive of a finished job (for API clients; the UI button gets it on finish)."""
        try:
            snap = self.manager.get(job_id, self.owner(request), reports=False)
        except ValueError as exc:
            raise user_error(exc) from None
        archive = (snap.result or {}).get("archive")
        if snap.status != "done" or not archive:
            raise user_error(f"job {job_id} has no archive to download (status: {snap.status})")
        return archive

    # ------------------------------------------------------------------------------- models and eval
    def _load_quantized(self, ckpt: Path):
        def load():
            model, tok = load_quantized(ckpt, device=self.settings.device, dtype=self.dtype)
            if tok is None:
                raise ValueError(f"checkpoint {ckpt.name} holds no tokenizer; cannot chat with it or evaluate it")
            return model, tok

        return self.cache.get(("quant", str(ckpt), self.settings.device), load)

    def _load_original(self, source: str):
        return self.cache.get(("orig", source, self.dtype, self.settings.device),
                              lambda: load_model(source, dtype=self.dtype, device=self.settings.device))

    def _run_models(self, run_id: str, owner: str):
        """(quantized (model, tok), original (model, tok) or None, why the original is missing, source name)."""
        if not run_id:
            raise ValueError("pick a finished run (or upload a packed checkpoint) first")
        ckpt = self.manager.checkpoint_dir(run_id, owner)
        snap = self.manager.get(run_id, owner, reports=False)
        source = (snap.result or {}).get("source_model")
        quant = self._load_quantized(ckpt)
        original, why = None, ""
        if source:
            try:
                original = self._load_original(source)
            except ValueError as exc:
                why = str(exc)
        else:
            why = "the checkpoint does not say which model it was made from"
        return quant, original, why, source

    def evaluate(self, job_id: str, windows, seqlen, request: gr.Request, progress=gr.Progress()):  # noqa: B008
        """Perplexity, KL and top-1 agreement of the quantized run against its original model."""
        owner = self.owner(request)
        try:
            windows, seqlen = int(windows or 0), int(seqlen or 0)
            if not 1 <= windows <= 512:
                raise ValueError(f"evaluation windows must be in 1..512, got {windows}")
            if not 16 <= seqlen <= 8192:
                raise ValueError(f"evaluation window length must be in 16..8192 tokens, got {seqlen}")
            progress(0.0, desc="loading the models")
            (qmodel, tok), original, _why, _source = self._run_models(job_id, owner)
            result = evaluate(qmodel, tok, text="wiki", seqlen=seqlen, max_windows=windows,
                              reference=original[0] if original else None,
                              on_window=lambda i, n: progress(i / n, desc=f"window {i}/{n}"))
            snap = self.manager.set_extra(job_id, owner, "eval", result.to_dict())
        except ValueError as exc:
            raise user_error(exc) from None
        rows, fig, _choices = self.runs_view(owner)
        return views.eval_md(snap.extras.get("eval")), rows, fig, snap.to_dict(reports=False)

    def evaluate_run(self, run_id: str, windows, seqlen, request: gr.Request,
                     progress=gr.Progress()):  # noqa: B008
        """``evaluate`` for the run picked in the Chat tab (e.g. an uploaded checkpoint)."""
        shown, rows, fig, _job = self.evaluate(run_id, windows, seqlen, request, progress)
        return shown, rows, fig

    # ----------------------------------------------------------------------------------------- chat
    def upload(self, archive, request: gr.Request):
        """Validate and unpack an uploaded checkpoint archive into a new run of this session."""
        owner = self.owner(request)
        if not archive:
            raise user_error("no archive uploaded")
        path = Path(archive if isinstance(archive, str) else archive.get("path", ""))
        limit = self.settings.max_upload_bytes
        try:
            size = path.stat().st_size
            if size > limit:
                raise ValueError(f"archive is {views.mb(size)}; at most {views.mb(limit)} allowed")

            def fill(out_dir: Path) -> dict:
                ckpt = extract_checkpoint(path, out_dir / "checkpoint", max_bytes=limit)
                _config, quantization = read_quantization_config(ckpt)
                report: Any = {}
                if (ckpt / "quant_report.json").is_file():
                    report = json.loads((ckpt / "quant_report.json").read_text(encoding="utf-8"))
                if not isinstance(report, dict):
                    report = {}
                return {"checkpoint_dir": str(ckpt), "source_model": source_model_of(str(ckpt)),
                        "summary": report.get("summary", {}),
                        "method": report.get("method") or quantization.get("quant_method"),
                        "config": report.get("settings", {}), "checkpoint_bytes": checkpoint_size(ckpt),
                        "archive": None}

            snap = self.manager.import_run(owner, fill, title=f"uploaded {path.name}")
        except (ValueError, OSError) as exc:
            raise user_error(f"cannot load {path.name}: {exc}") from None
        rows, fig, choices = self.runs_view(owner)
        return (gr.Dropdown(choices=choices, value=snap.id),
                views.uploaded_md(path.name, snap.id, (snap.result or {}).get("source_model")), rows, fig)

    def chat_load(self, run_id: str, request: gr.Request):
        """Load both models of a run (cached) and describe them; clears both conversations."""
        owner = self.owner(request)
        if not run_id:
            return views.NO_RUN, [], [], "", ""
        try:
            (qmodel, _), original, why, source = self._run_models(run_id, owner)
        except ValueError as exc:
            raise user_error(exc) from None
        original_bytes = model_memory_bytes(original[0]) if original else None
        return (views.models_md(source, original_bytes, why, model_memory_bytes(qmodel), self.dtype,
                                self.settings.device), [], [], "", "")

    def _stop_event(self, owner: str) -> threading.Event:
        with self._chat_lock:
            event = self._chat_stop.setdefault(owner, threading.Event())
        return event

    def chat(self, prompt: str, history_original, history_quantized, run_id: str, temperature, top_p,
             max_new_tokens, request: gr.Request):
        """Answer ``prompt`` with the original model, then with the quantized one (one after the other, so each
        one's tokens/s is measured without the other competing for the same cores), streaming tokens."""
        owner = self.owner(request)
        try:
            max_new_tokens = int(max_new_tokens)
            check_sampling(max_new_tokens, float(temperature), float(top_p))
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError("type a message first")
            quant, original, why, _source = self._run_models(run_id, owner)
        except ValueError as exc:
            raise user_error(exc) from None
        stop = self._stop_event(owner)
        stop.clear()
        histories = [views.normalize_history(history_original), views.normalize_history(history_quantized)]
        stats = ["", ""]
        for history in histories:
            history.append({"role": "user", "content": prompt})
        yield histories[0], histories[1], stats[0], stats[1], ""
        for side, pair in enumerate((original, quant)):
            history = histories[side]
            if pair is None:
                history.append({"role": "assistant", "content": f"(original model not available: {why})"})
                continue
            if stop.is_set():
                history.append({"role": "assistant", "content": "(stopped)"})
                continue
            model, tok = pair
            session = ChatSession(model, tok)
            session.history = [m for m in history[:-1] if m["content"]]
            history.append({"role": "assistant", "content": ""})
            with self._chat_lock:
                self._chats.setdefault(owner, []).append(session)
            try:
                for piece in session.stream(prompt, max_new_tokens=max_new_tokens, temperature=float(temperature),
                                            top_p=float(top_p)):
                    history[-1]["content"] += piece
                    yield histories[0], histories[1], stats[0], stats[1], gr.skip()
            except (ValueError, RuntimeError) as exc:
                raise gr.Error(f"generation failed: {exc}") from None
            finally:
                session.stop()
                with self._chat_lock:
                    active = self._chats.get(owner, [])
                    if session in active:
                        active.remove(session)
            st = session.last_stats
            stats[side] = views.chat_stats_md(st.tokens, st.tokens_per_second, model_memory_bytes(model),
                                              stop.is_set())
            yield histories[0], histories[1], stats[0], stats[1], gr.skip()
        yield histories[0], histories[1], stats[0], stats[1], gr.skip()

    def chat_stop(self, request: gr.Request) -> None:
        owner = self.owner(request)
        self._stop_event(owner).set()
        with self._chat_lock:
            sessions = list(self._chats.get(owner, []))
        for session in sessions:
            session.stop()

    @staticmethod
    def chat_clear():
        return [], [], "", ""

    # -------------------------------------------------------------------------------------- sessions
    def on_unload(self, request: gr.Request) -> None:
        """The tab closed: stop its chats, cancel its jobs, delete its runs and their cached models."""
        owner = getattr(request, "session_hash", None)
        if not owner:
            return
        with self._chat_lock:
            sessions = self._chats.pop(owner, [])
            self._chat_stop.pop(owner, None)
        for session in sessions:
            session.stop()
        dirs = set()
        for snap in self.manager.jobs(owner):
            if snap.result and snap.result.get("checkpoint_dir"):
                dirs.add(snap.result["checkpoint_dir"])
        self.manager.forget_owner(owner)
        self.cache.drop(lambda key: key[0] == "quant" and key[1] in dirs)

