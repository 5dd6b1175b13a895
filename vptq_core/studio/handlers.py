"""The app's event handlers (``Studio``): quantize, poll, cancel, download, evaluate, upload, push, chat. Every
handler works on the jobs and runs of the calling browser only.

Who owns what: each browser gets a random, unguessable identity kept in its local storage (a
``gr.BrowserState`` the page sends to ``attach`` when it loads; never shown). ``attach`` maps the page's session
to that identity, so runs survive a reload and come back in every tab of the same browser; API clients that
never attach own their runs by their session id, and lose them when they disconnect. Finished runs are deleted
``AppSettings.run_ttl_hours`` after they finish.

Restarts: finished runs come back after the app restarts, and so does a run the restart cut off, as
"interrupted" with the blocks it had finished (``queue``: the job's description is kept in its directory, its
owner as a hash of the identity); ``resume`` queues it again with the same settings and it continues from its
last finished block (``api.quantize_to_dir(resume=True)``: the same checkpoint as an uninterrupted run).

Downloads: the work directory is never served. A download is a fresh copy (a hard link where possible) of the
run's archive in a directory with a random name inside Gradio's cache, made for the request that asked;
those copies are deleted with their run. Messages and the job JSON name files, never server paths or ids of
sessions.

The settings form reaches ``estimate_md`` and ``start`` as keyword arguments named by the form field
(``vector_len=4, bits=2, activations=..., seed=0``; see ``form``), collected into one ``settings`` dict.
What is shown is formatted by ``views``; ``app.py`` lays the page out and wires these handlers to it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gradio as gr
from gradio.utils import get_upload_folder

from ..api import source_model_of
from ..eval import evaluate
from ..models import BUNDLED, TINY, load_model
from ..quant import methods
from ..quant.config import CalibConfig
from ..quant.distill import sized_preset
from ..storage.archive import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRY_BYTES,
    DEFAULT_MAX_FILES,
    DEFAULT_MAX_RATIO,
    allowed_file,
    extract_checkpoint,
    pack_checkpoint,
)
from ..storage.checkpoint import checkpoint_size, load_quantized, read_quantization_config
from . import form, plots, views
from .card import CARD_NAME, write_model_card
from .chat import ChatSession, check_sampling, model_memory_bytes
from .estimate import estimate, hub_reachable, model_info, time_estimate
from .model_cache import ModelCache
from .queue import ACTIVE, JobManager
from .task import quantization_task

IDENTITY = re.compile(r"^[A-Za-z0-9_-]{43}$")  # secrets.token_urlsafe(32)
SIDES = ("original", "quantized")
_HUB_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


@dataclass(frozen=True)
class AppSettings:
    """The app's settings; every limit also has a command-line flag and an environment variable
    (``app.LIMITS``). Sizes are bytes (the flags and variables take MB = 10^6 bytes)."""

    workdir: Path
    default_model: str = BUNDLED
    device: str = "cpu"
    chat_concurrency: int = 2  # chat events served at once (each runs both models)
    max_upload_bytes: int = DEFAULT_MAX_BYTES  # an uploaded archive (zip) as sent
    max_unpacked_bytes: int = DEFAULT_MAX_BYTES  # an uploaded archive unpacked, all files together
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES  # one file of an uploaded archive, unpacked
    max_ratio: float = DEFAULT_MAX_RATIO  # unpacked / compressed bytes, per file and for the whole archive
    max_archive_files: int = DEFAULT_MAX_FILES
    user_quota_bytes: int = 5_000_000_000  # disk for one browser's runs (checkpoints, archives, uploads)
    total_quota_bytes: int = 20_000_000_000  # disk for every run of every browser
    max_runs_per_user: int = 6  # runs kept + jobs queued or running, per browser
    max_jobs_per_user: int = 2  # jobs queued or running, per browser
    run_ttl_hours: float = 12.0  # finished runs are deleted this long after they finish
    max_prompt_tokens: int = 1024  # a chat prompt with the conversation so far
    max_calib_bytes: int = 32_000_000  # an uploaded calibration .txt
    eval_windows: int = 4
    eval_seqlen: int = 512
    cleanup_workdir: bool = False  # remove the work dir at exit (it was a fresh temporary one)
    browser_secret: str | None = None  # encrypts the identity in the browser (None: random per process)


def user_error(message) -> gr.Error:
    """A message for the user (shown in the page), not a server fault: no traceback in the log."""
    return gr.Error(str(message), print_exception=False)


class Studio:
    """Event handlers of the app. ``make_task(model, method, config, calib, device=, calib_text=)`` builds a
    job's task (``task.quantization_task``; tests pass stand-ins); ``make_chat(model, tokenizer)`` one side's
    ``ChatSession``; ``hub_api(token=)`` a ``huggingface_hub.HfApi``."""

    def __init__(self, settings: AppSettings, manager: JobManager | None = None, cache: ModelCache | None = None,
                 make_task: Callable[..., Callable] = quantization_task,
                 make_chat: Callable[..., ChatSession] = ChatSession, hub_api: Callable[..., Any] | None = None,
                 janitor_interval_s: float = 60.0):
        self.settings = settings
        limits = {"cpu": 1, **({settings.device: 1} if settings.device != "cpu" else {})}
        self.manager = manager or JobManager(settings.workdir, limits=limits,
                                             max_active_per_owner=settings.max_jobs_per_user,
                                             max_runs_per_owner=settings.max_runs_per_user,
                                             max_age_s=settings.run_ttl_hours * 3600)
        self.cache = cache or ModelCache(max_items=4)
        self.make_task = make_task
        self.make_chat = make_chat
        self.hub_api = hub_api
        self.serve_dir = Path(get_upload_folder())
        if Path(settings.workdir).resolve().is_relative_to(self.serve_dir.resolve()):
            raise ValueError(f"the work directory must not be inside Gradio's cache ({self.serve_dir}): files there "
                             "are served to anyone who knows their path")
        self.roots = tuple(str(Path(r).resolve()) for r in (settings.workdir, self.serve_dir, tempfile.gettempdir()))
        self._lock = threading.Lock()
        self._identities: dict[str, str] = {}  # page session -> browser identity
        self._unloaded: dict[str, float] = {}  # page session -> when its page was last seen unloading
        self._served: dict[str, list[Path]] = {}  # job id -> download copies in Gradio's cache
        self._chats: dict[str, dict[str, tuple[ChatSession, threading.Event]]] = {}  # page session -> side -> ...
        self._speed: dict[tuple[str, str], float] = {}  # (device, method) -> measured / rough seconds, last run
        self.field_keys: tuple[str, ...] = ()  # the form's fields in page order (``app.build_app`` sets them)
        gpu = settings.device == "cuda"
        self.dtype = "float16" if gpu else "bfloat16"  # fp16 matmuls are very slow on CPU; bf16 is not
        self.manager.on_delete(self._run_deleted)
        self._closed = threading.Event()
        threading.Thread(target=self._janitor, args=(janitor_interval_s,), name="studio-janitor", daemon=True).start()

    # ----------------------------------------------------------------------------------------- helpers
    def owner(self, request: gr.Request | None) -> str:
        """Who the request acts for: the browser identity its page attached, else its session id."""
        session = getattr(request, "session_hash", None) if request is not None else None
        if not session:
            raise user_error("this action needs a browser session (no session id in the request)")
        with self._lock:
            return self._identities.get(session, session)

    def hidden(self) -> list[str]:
        """Every page session id and browser identity known now (never shown to anyone)."""
        with self._lock:
            return [*self._identities, *self._identities.values()]

    def public(self, text) -> str:
        """``text`` without server paths, session ids or identities (for messages shown to users)."""
        return views.scrub(str(text), self.roots, self.hidden())

    def progress(self, snap, message: str = "") -> str:
        return views.progress_html(snap, message, roots=self.roots, hidden=self.hidden())

    def error(self, exc) -> gr.Error:
        """A refusal for the user: the form's words for settings, no server paths or session ids."""
        return user_error(self.public(form.readable(exc)))

    def job_json(self, snap, reports: bool = False) -> dict:
        return views.public_job(snap, reports=reports, roots=self.roots, hidden=self.hidden())

    @staticmethod
    def model_name(model: str | None, custom_model: str | None) -> str:
        """The model a form names: the dropdown's choice, or the textbox when the dropdown says "a hub id or
        a local directory" (``form.OTHER_MODEL``; the textbox is ignored otherwise). API clients that send no
        dropdown value get the textbox."""
        custom = (custom_model or "").strip()
        if model == form.OTHER_MODEL or not model:
            if not custom:
                raise ValueError("type a hub id (owner/name) or a local model directory in the box under Model")
            return custom
        return model

    def model_note(self, model: str, custom_model: str) -> str:
        try:
            name = self.model_name(model, custom_model)
        except ValueError as exc:
            return views.model_note("", error=str(exc))
        if name in (BUNDLED, TINY):
            return views.model_note(name)
        try:
            return views.model_note(name, model_info(name))
        except ValueError as exc:
            return views.model_note(name, error=self.public(exc))

    def estimate_md(self, model, custom_model, method, calib_samples=None, calib_seqlen=None, **settings):
        """Live bits per weight, checkpoint size and a rough duration for the current settings (warnings inline,
        no popup), and the Start button: disabled while the settings are refused."""
        try:
            name = self.model_name(model, custom_model)
            config = form.config_from(method, settings)
            samples, seqlen = _calib_size(calib_samples, calib_seqlen)
            info = model_info(name)
            est = estimate(info, method, config)  # (a setting may not fit this model's layers)
            seconds, basis = self.predicted_seconds(info, method, config, samples, seqlen)
        except ValueError as exc:
            return f"⚠️ {self.public(form.readable(exc))}", gr.Button(interactive=False)
        return views.estimate_md(info, est, seconds, basis), gr.Button(interactive=True)

    def predicted_seconds(self, info, method: str, config, samples: int, seqlen: int) -> tuple[float | None, str]:
        """(seconds a run should take here, what that rests on): ``estimate.time_estimate`` (a 2-core CPU) times
        what this server's last finished run of the method took against its own estimate; None on another
        device until a run there has finished."""
        rough = time_estimate(info, config, samples, seqlen)
        with self._lock:
            factor = self._speed.get((self.settings.device, method))
        if factor is not None:
            return rough * factor, (f"from this server's last {views.method_label(method)} run, which took "
                                    f"{factor:.2g}× the rough estimate")
        if self.settings.device != "cpu":
            return None, f"no estimate on {self.settings.device} until a run has finished here"
        return rough, ("rough: from runs measured on 2 idle CPU cores (VPTQ layer by layer, with each layer's own "
                       "settings); a busy server is slower, layer-wise fine-tuning is not counted")

    @staticmethod
    def _sized(values: dict, info) -> dict:
        """A preset's form values for the model ``info`` describes (distillation only up to the size limit)."""
        return sized_preset(values, info.linear_weights + info.other_params)[0]

    def preset_form(self, method, preset, model=None, custom_model=None) -> list:
        """The preset changed (or the method): one value per form field in ``form`` order, ``gr.skip()`` where
        the preset fixes nothing, sized for the chosen model when it can be read (as ``model_defaults``)."""
        keys = list(self.field_keys)
        values = form.preset_values(method, preset, keys)
        if model is not None:
            try:
                values = self._sized(values, model_info(self.model_name(model, custom_model)))
            except ValueError:
                pass  # an unreadable model keeps the preset as it is (its note says why)
        return [values.get(k, gr.skip()) for k in keys]

    def model_defaults(self, model, custom_model, method, preset):
        """The model changed: settings sized for it. Narrow models (the tiny test model) get small codebooks
        and calibration (the presets are sized for SmolLM2); others get the chosen preset back (the 2-bit one
        when it was "custom") and the usual calibration. Returns (preset, calibration samples, tokens per sample,
        then one value per form field in ``form`` order, ``gr.skip()`` where unchanged)."""
        keys = list(self.field_keys)
        skip = [gr.skip()] * (3 + len(keys))
        try:
            info = model_info(self.model_name(model, custom_model))
        except ValueError:
            return skip
        width = max((max(shape) for shape in info.linear_shapes), default=0)
        if width <= form.SMALL_MODEL_WIDTH:
            samples, seqlen = form.SMALL_MODEL_CALIB
            return [form.CUSTOM, samples, seqlen, *(form.SMALL_MODEL_VALUES.get(k, gr.skip()) for k in keys)]
        chosen = preset if preset in form.preset_names() else form.DEFAULT_PRESET
        values = self._sized(form.preset_values(method, chosen, keys), info)
        samples, seqlen = form.MODEL_CALIB
        return [chosen, samples, seqlen, *(values.get(k, gr.skip()) for k in keys)]

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

    def _check_disk(self, owner: str, need: int, what: str) -> None:
        """ValueError unless ``need`` more bytes fit in the owner's quota and in the total one."""
        s = self.settings
        used = self.manager.disk_usage(owner)
        if used + need > s.user_quota_bytes:
            raise ValueError(f"{what} needs about {views.mb(need)}; your runs use {views.mb(used)} of your "
                             f"{views.mb(s.user_quota_bytes)} disk quota: delete a run under 'Your runs' first")
        total = self.manager.disk_usage()
        if total + need > s.total_quota_bytes:
            raise ValueError(f"{what} needs about {views.mb(need)}; the server's runs use {views.mb(total)} of "
                             f"{views.mb(s.total_quota_bytes)} (the disk quota of all users): try again later")

    def _guard(self, owner: str) -> str:
        snaps = self.manager.jobs(owner)
        busy = any(s.active for s in snaps)
        unexported = any(s.status == "done" and s.kind != "import" and not s.extras.get("exported") for s in snaps)
        return views.guard_html(busy, unexported)

    # ---------------------------------------------------------------------------- identity and reload
    def attach(self, identity, request: gr.Request):
        """Page load: bind this page's session to the browser's identity (a new random one the first time) and
        show its runs again. Returns the identity to keep in the browser, the job to watch (the newest active
        one, else the newest) with a poll state that makes the next tick fill the page in, its evaluation, the
        runs table, plot and pickers, and the leave-page guard."""
        session = getattr(request, "session_hash", None)
        if not session:
            raise user_error("this page has no session id")
        if not isinstance(identity, str) or not IDENTITY.match(identity):
            identity = secrets.token_urlsafe(32)
        with self._lock:
            self._identities[session] = identity
            self._unloaded.pop(session, None)
        self.manager.reassign(session, identity)  # jobs started before the page attached
        snaps = self.manager.jobs(identity)
        interrupted = [s for s in snaps if s.status == "interrupted"]  # cut off by a restart: shown to resume
        watched = ([s for s in snaps if s.active] or interrupted or snaps or [None])[-1]
        rows, fig, choices = self.runs_view(identity)
        job = watched.id if watched else ""
        ev = views.eval_md(watched.extras.get("eval")) if watched else ""
        return (identity, job, {"job": job} if watched else {}, gr.Timer(active=bool(watched)), ev, rows, fig,
                gr.Dropdown(choices=choices), gr.Dropdown(choices=choices, value=None), self._guard(identity))

    def _janitor(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                self.manager.prune()
                self.forget_pages(self.settings.run_ttl_hours * 3600)
            except Exception:  # noqa: BLE001 - the janitor must keep running
                pass

    def forget_pages(self, older_than_s: float) -> int:
        """Drop the identity of page sessions that unloaded more than ``older_than_s`` seconds ago (their browser
        comes back through a new session; the runs stay with the identity). Returns how many."""
        cutoff = time.time() - older_than_s
        with self._lock:
            gone = [session for session, when in self._unloaded.items() if when <= cutoff]
            for session in gone:
                self._unloaded.pop(session, None)
                self._identities.pop(session, None)
        return len(gone)

    def close(self) -> None:
        self._closed.set()

    def _run_deleted(self, job_id: str, owner: str) -> None:
        """A run was deleted (by its owner, expiry or a closed API session): its download copies and models go."""
        with self._lock:
            copies = self._served.pop(job_id, [])
        for path in copies:
            shutil.rmtree(path.parent, ignore_errors=True)
        prefix = str(self.manager.jobs_dir / job_id)
        self.cache.drop(lambda key: key[0] == "quant" and (key[1] == prefix or key[1].startswith(prefix + os.sep)))

    # ------------------------------------------------------------------------------------ quantize tab
    def _prepare(self, owner, model, custom_model, method, calib_source, calib_file, calib_samples, calib_seqlen,
                 settings):
        name = self.model_name(model, custom_model)
        try:
            config = form.config_from(method, settings)
            calib = CalibConfig(text="wiki", samples=calib_samples, seqlen=calib_seqlen, seed=settings.get("seed", 0))
        except ValueError as exc:
            raise ValueError(form.readable(exc)) from None
        calib_text = self._read_calibration_file(calib_file) if calib_source == form.FILE_SOURCE else None
        info = model_info(name)
        est = estimate(info, method, config)
        self.manager.check_submit(owner)
        reserve = 2 * est.checkpoint_bytes + len(calib_text or "")  # the checkpoint and its zip
        self._check_disk(owner, reserve, "this run")
        return name, config, calib, calib_text, info, est, reserve

    def check_start(self, model, custom_model, method, calib_source, calib_file, calib_samples, calib_seqlen,
                    request: gr.Request, **settings) -> None:
        """What ``start`` checks, with no outputs: the page runs it first, so a refused Start leaves only its
        message (no error marks on the job's outputs)."""
        try:
            self._prepare(self.owner(request), model, custom_model, method, calib_source, calib_file, calib_samples,
                          calib_seqlen, settings)
        except ValueError as exc:
            raise self.error(exc) from None

    def start(self, model, custom_model, method, calib_source, calib_file, calib_samples, calib_seqlen,
              request: gr.Request, **settings):
        """Validate the settings and queue a quantization job; returns the job id and resets the live view."""
        owner = self.owner(request)
        try:
            name, config, calib, calib_text, info, est, reserve = self._prepare(
                owner, model, custom_model, method, calib_source, calib_file, calib_samples, calib_seqlen, settings)
            task = self.make_task(name, method, config, calib, device=self.settings.device, calib_text=calib_text)
            snap = self.manager.submit(owner, task, title=views.job_title(name, method, est),
                                       device=self.settings.device, meta={
                                           "model": name, "method": method, "settings": config.to_dict(),
                                           "num_blocks": info.num_blocks, "modules": list(info.modules),
                                           "estimate": asdict(est), "reserve_bytes": reserve,
                                           "calib": {**calib.to_dict(), **({"text": "uploaded file"} if calib_text
                                                                            is not None else {})},
                                           "calib_uploaded": calib_text is not None,
                                           "rough_seconds": time_estimate(info, config, calib.samples,
                                                                          calib.seqlen)})
        except ValueError as exc:
            raise self.error(exc) from None
        return (snap.id, self.progress(snap), plots.proxy_error_figure([], info.num_blocks),
                plots.error_heatmap_figure([], info.num_blocks, info.modules), [], "",
                gr.DownloadButton(value=None, visible=False), "", {"job": snap.id, "version": None, "status": None},
                gr.Timer(active=True), self.job_json(snap), self._guard(owner))

    def resume(self, job_id: str, request: gr.Request):
        """Queue a run that a restart cut off again, with the settings it was started with: it continues from
        its last finished block. The same limits as ``start`` apply (jobs queued or running, the queue, the disk
        quotas). Returns what ``start`` returns."""
        owner = self.owner(request)
        try:
            if not job_id:
                raise ValueError("no run to resume: a run interrupted by a restart is shown under Job after the "
                                 "page loads")
            snap = self.manager.get(job_id, owner, reports=False)
            if snap.status != "interrupted":
                raise ValueError(f"job {job_id} was not interrupted, it cannot be resumed (status: {snap.status})")
            meta = snap.meta
            if not isinstance(meta.get("calib"), dict) or meta.get("method") not in methods.names():
                raise ValueError(f"job {job_id} does not say how it was started; start it again")
            config = methods.make_config(meta["method"], meta.get("settings") or {})
            calib = CalibConfig.from_dict(meta["calib"])
            calib_text = None
            if meta.get("calib_uploaded"):
                path = self.manager.jobs_dir / snap.id / "calibration.txt"
                if not path.is_file():
                    raise ValueError(f"job {job_id} lost its uploaded calibration text; start it again")
                calib_text = path.read_text(encoding="utf-8")
            reserve = int(meta.get("reserve_bytes") or 0)
            self._check_disk(owner, max(reserve - self.manager.job_bytes(snap.id, owner), 0), "resuming this run")
            task = self.make_task(meta["model"], meta["method"], config, calib, device=self.settings.device,
                                  calib_text=calib_text, resume=True)
            snap = self.manager.resume(snap.id, owner, task, device=self.settings.device)
        except ValueError as exc:
            raise self.error(exc) from None
        num_blocks, modules = meta.get("num_blocks"), meta.get("modules")
        return (snap.id, self.progress(snap), plots.proxy_error_figure([], num_blocks),
                plots.error_heatmap_figure([], num_blocks, modules), [], "",
                gr.DownloadButton(value=None, visible=False), "", {"job": snap.id, "version": None, "status": None},
                gr.Timer(active=True), self.job_json(snap), self._guard(owner))

    def job_status(self, job_id: str, request: gr.Request) -> dict:
        """The job as JSON, with every layer report so far (no server paths, no owner)."""
        try:
            return self.job_json(self.manager.get(job_id, self.owner(request)), reports=True)
        except ValueError as exc:
            raise self.error(exc) from None

    def cancel(self, job_id: str, request: gr.Request):
        try:
            snap = self.manager.cancel(job_id, self.owner(request))
        except ValueError as exc:
            raise self.error(exc) from None
        return self.progress(snap), self.job_json(snap)

    def runs_view(self, owner: str):
        """(rows of the runs table, bits-vs-perplexity figure, choices of the run pickers)."""
        rows, points, choices = views.runs_view(self.manager.jobs(owner, statuses=("done",)))
        return rows, plots.runs_figure(points), choices

    def runs(self, request: gr.Request):
        rows, fig, _choices = self.runs_view(self.owner(request))
        return rows, fig

    def poll(self, job_id: str, seen: dict | None, request: gr.Request):
        """Timer tick: refresh the live view of the watched job; plots and tables only when they changed.
        Returns (progress, line plot, heatmap, layer table, summary, download button, runs table, runs plot,
        chat run picker, delete picker, job JSON, poll state, leave-page guard, timer)."""
        owner = self.owner(request)
        seen = dict(seen or {})
        skip = gr.skip()
        if not job_id:
            return (skip,) * 13 + (gr.Timer(active=False),)
        try:
            snap = self.manager.get(job_id, owner)
        except ValueError as exc:
            return ((views.progress_html(None, self.public(exc)),) + (skip,) * 10
                    + ({}, self._guard(owner), gr.Timer(active=False)))
        version = [snap.id, snap.status, list(snap.reports_version)]
        changed = seen.get("version") != version
        finished_now = changed and not snap.active and seen.get("status") != snap.status
        num_blocks, modules = snap.meta.get("num_blocks"), snap.meta.get("modules")
        lines = heat = table = job_json = skip
        if changed:
            lines = plots.proxy_error_figure(snap.reports, num_blocks)
            heat = plots.error_heatmap_figure(snap.reports, num_blocks, modules)
            table = plots.report_rows(snap.reports)
            job_json = self.job_json(snap)
        summary = download = runs_rows = runs_fig = chat_runs = pick_runs = skip
        if finished_now:
            self._learn_speed(snap)
            summary = views.summary_md(snap)
            download = self._download_button(snap, owner)
            runs_rows, runs_fig, choices = self.runs_view(owner)
            chat_runs = (gr.Dropdown(choices=choices, value=snap.id) if snap.status == "done"
                         else gr.Dropdown(choices=choices))
            pick_runs = gr.Dropdown(choices=choices)
        guard = self._guard(owner)
        seen = {"job": snap.id, "version": version, "status": snap.status, "guard": guard}
        return (self.progress(snap), lines, heat, table, summary, download, runs_rows, runs_fig,
                chat_runs, pick_runs, job_json, seen, guard, gr.Timer(active=snap.active))

    def _learn_speed(self, snap) -> None:
        """A run finished: how long it took against its rough estimate corrects the next estimates."""
        rough, seconds = snap.meta.get("rough_seconds"), (snap.result or {}).get("summary", {}).get("seconds")
        if snap.status == "done" and snap.kind == "quantize" and rough and seconds:
            with self._lock:
                self._speed[(snap.device, snap.meta.get("method"))] = float(seconds) / float(rough)

    # -------------------------------------------------------------------------------------- downloads
    def _serve(self, snap, owner: str) -> str | None:
        """A copy of the run's archive for this request only: a hard link (else a copy) in a new directory with
        a random name in Gradio's cache, deleted with the run. None when the run has no archive."""
        archive = (snap.result or {}).get("archive")
        if snap.status != "done" or not archive or not Path(archive).is_file():
            return None
        folder = self.serve_dir / f"vq-{secrets.token_hex(16)}"
        folder.mkdir(parents=True)
        target = folder / Path(archive).name
        try:
            os.link(archive, target)
        except OSError:
            shutil.copyfile(archive, target)
        with self._lock:
            self._served.setdefault(snap.id, []).append(target)
        # The run may have been deleted meanwhile: then this copy goes too.
        if snap.id not in {s.id for s in self.manager.jobs(owner)}:
            self._run_deleted(snap.id, owner)
            return None
        return str(target)

    def _download_button(self, snap, owner: str):
        path = self._serve(snap, owner)
        return gr.DownloadButton(label=views.download_label((snap.result or {}).get("archive_bytes")), value=path,
                                 visible=bool(path))

    def download(self, job_id: str, request: gr.Request):
        """The packed checkpoint archive of a finished job (for API clients; the page's button gets it when the
        job finishes). A fresh copy for this request; counts as taken home."""
        owner = self.owner(request)
        try:
            snap = self.manager.get(job_id, owner, reports=False)
            path = self._serve(snap, owner)
            if path is None:
                raise ValueError(f"job {job_id} has no archive to download (status: {snap.status})")
            self.manager.set_extra(job_id, owner, "exported", True)
        except ValueError as exc:
            raise self.error(exc) from None
        return path

    def mark_exported(self, job_id: str, request: gr.Request) -> str:
        """The page's download button was clicked: the run is taken home (no more leave-page warning for it)."""
        owner = self.owner(request)
        try:
            self.manager.set_extra(job_id, owner, "exported", True)
        except ValueError:
            pass
        return self._guard(owner)

    def delete_run(self, run_id: str, watched: str, request: gr.Request):
        """Delete one of the browser's runs (an active job is cancelled first) with its files and downloads."""
        owner = self.owner(request)
        if not run_id:
            raise user_error("pick a run to delete")
        try:
            self.manager.delete(run_id, owner)
        except ValueError as exc:
            raise self.error(exc) from None
        rows, fig, choices = self.runs_view(owner)
        reset = run_id == watched
        return (rows, fig, gr.Dropdown(choices=choices, value=None), gr.Dropdown(choices=choices, value=None),
                self._guard(owner), gr.DownloadButton(value=None, visible=False) if reset else gr.skip(),
                "" if reset else gr.skip(), views.progress_html(None, f"run {run_id} was deleted") if reset
                else gr.skip(), "" if reset else gr.skip())

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
                why = self.public(exc)
        else:
            why = "the checkpoint does not say which model it was made from"
        return quant, original, why, source

    def _refresh_card(self, snap, owner: str):
        """Write the run's model card again (with its evaluation) and pack its archive again; the new snapshot."""
        result = snap.result or {}
        if snap.kind == "import" or not result.get("checkpoint_dir"):
            return snap
        ckpt = Path(result["checkpoint_dir"])
        write_model_card(ckpt, result.get("source_model"), snap.extras.get("eval"))
        archive = result.get("archive")
        if archive:
            packed = pack_checkpoint(ckpt, archive)  # atomic: copies already served keep their content
            snap = self.manager.update_result(snap.id, owner, archive_bytes=packed.stat().st_size,
                                              checkpoint_bytes=checkpoint_size(ckpt))
        return snap

    def _evaluate(self, job_id: str, windows, seqlen, owner: str, progress):
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
        return self._refresh_card(snap, owner)

    def evaluate(self, job_id: str, windows, seqlen, request: gr.Request, progress=gr.Progress()):  # noqa: B008
        """Perplexity, KL and top-1 agreement of the quantized run against its original model; the model card
        in the run's zip gets them (a fresh download copy is returned)."""
        owner = self.owner(request)
        try:
            snap = self._evaluate(job_id, windows, seqlen, owner, progress)
        except ValueError as exc:
            raise self.error(exc) from None
        rows, fig, _choices = self.runs_view(owner)
        download = self._download_button(snap, owner) if (snap.result or {}).get("archive") else gr.skip()
        return views.eval_md(snap.extras.get("eval")), rows, fig, self.job_json(snap), download

    def evaluate_run(self, run_id: str, windows, seqlen, request: gr.Request,
                     progress=gr.Progress()):  # noqa: B008
        """``evaluate`` for the run picked in the Chat tab (e.g. an uploaded checkpoint)."""
        owner = self.owner(request)
        try:
            snap = self._evaluate(run_id, windows, seqlen, owner, progress)
        except ValueError as exc:
            raise self.error(exc) from None
        rows, fig, _choices = self.runs_view(owner)
        return views.eval_md(snap.extras.get("eval")), rows, fig

    # ------------------------------------------------------------------------------------------- hub
    def hub_status(self):
        """Whether pushing to the hub can work from this server: (note, push button)."""
        reachable, why = hub_reachable()
        if not reachable:
            return (f"⚠️ Pushing is disabled: this server cannot reach the Hugging Face hub ({why}). Download the "
                    "zip instead.", gr.Button(interactive=False))
        return "", gr.Button(interactive=True)

    def push(self, job_id: str, repo_id: str, private: bool, token: str, request: gr.Request,
             oauth_token: gr.OAuthToken | None = None) -> tuple[str, str]:
        """Upload a finished run's checkpoint (with its model card) to the user's own hub repo, with the user's
        token (Sign in with Hugging Face on Spaces, a pasted write token elsewhere; never the server's)."""
        owner = self.owner(request)
        try:
            snap = self.manager.get(job_id, owner, reports=False)
            if snap.status != "done" or not (snap.result or {}).get("checkpoint_dir"):
                raise ValueError(f"job {job_id or '(none)'} has no checkpoint to push (status: {snap.status})")
            repo_id = (repo_id or "").strip()
            if not _HUB_REPO.match(repo_id):
                raise ValueError(f"repo must be 'your-name/repo-name' (letters, digits, '-', '_', '.'), got "
                                 f"{repo_id!r}")
            reachable, why = hub_reachable()
            if not reachable:
                raise ValueError(f"cannot reach the Hugging Face hub ({why}); pushing is disabled, download the zip "
                                 "instead")
            secret = (oauth_token.token if oauth_token is not None else "") or (token or "").strip()
            if not secret:
                raise ValueError("sign in with Hugging Face (on Spaces) or paste a write token to push")
            snap = self._refresh_card(snap, owner)
            ckpt = Path(snap.result["checkpoint_dir"])
            if snap.kind == "import" and not (ckpt / CARD_NAME).is_file():
                write_model_card(ckpt, snap.result.get("source_model"), snap.extras.get("eval"))
            api = self.hub_api(token=secret) if self.hub_api else _hf_api(secret)
            files = sorted(p.name for p in ckpt.iterdir() if p.is_file() and allowed_file(p.name))
            try:
                api.create_repo(repo_id, private=bool(private), exist_ok=True, repo_type="model")
                api.upload_folder(folder_path=str(ckpt), repo_id=repo_id, repo_type="model", allow_patterns=files,
                                  commit_message=f"Upload {snap.title} (VPTQ Studio)")
            except Exception as exc:  # noqa: BLE001 - the hub client raises many kinds; one line for the user
                text = str(exc).replace(secret, "***").splitlines()[0][:300] if str(exc) else type(exc).__name__
                raise ValueError(f"the hub refused the push: {text}") from None
            self.manager.set_extra(job_id, owner, "exported", True)
            self.manager.set_extra(job_id, owner, "pushed", repo_id)
        except ValueError as exc:
            raise self.error(exc) from None
        return (f"Pushed {len(files)} files to [{repo_id}](https://huggingface.co/{repo_id})"
                f"{' (private)' if private else ''}.", self._guard(owner))

    # ----------------------------------------------------------------------------------------- upload
    def _remove_upload(self, path: Path) -> None:
        """Delete an uploaded file from Gradio's upload folder (with its folder, when that is left empty)."""
        try:
            if path.resolve().is_relative_to(self.serve_dir.resolve()) and path.is_file():
                path.unlink()
                if path.parent != self.serve_dir and not any(path.parent.iterdir()):
                    path.parent.rmdir()
        except OSError:
            pass

    def upload_run(self, archive, request: gr.Request) -> str:
        """Check, unpack and verify an uploaded checkpoint archive into a new run of this browser; returns the
        run id. Refused archives leave nothing on disk; the uploaded file itself is deleted either way.

        Checked: the zip's size, the runs per browser, the disk quotas (this browser's, everyone's), each file's
        and the total unpacked size and compression ratio while unpacking (not from the zip's headers), the
        file names and kinds (``storage.archive``), then the checkpoint is loaded as chat would load it, so every
        tensor's name, shape, dtype and index range is checked against what its config implies
        (``storage.checkpoint.load_quantized``)."""
        owner = self.owner(request)
        if not archive:
            raise user_error("no archive uploaded")
        path = Path(archive if isinstance(archive, str) else archive.get("path", ""))
        s = self.settings
        try:
            try:
                size = path.stat().st_size
                if size > s.max_upload_bytes:
                    raise ValueError(f"archive is {views.mb(size)}; at most {views.mb(s.max_upload_bytes)} allowed")
                self.manager.check_submit(owner)
                user_left = s.user_quota_bytes - self.manager.disk_usage(owner)
                total_left = s.total_quota_bytes - self.manager.disk_usage()
                budget, label = s.max_unpacked_bytes, "the unpacked-size limit"
                if user_left < budget:
                    budget, label = max(user_left, 0), (f"what is left of your {views.mb(s.user_quota_bytes)} disk "
                                                        f"quota")
                if total_left < budget:
                    budget, label = max(total_left, 0), (f"what is left of the server's "
                                                         f"{views.mb(s.total_quota_bytes)} disk quota")

                def fill(out_dir: Path) -> dict:
                    ckpt = extract_checkpoint(path, out_dir / "checkpoint", max_bytes=budget,
                                              max_files=s.max_archive_files, max_entry_bytes=s.max_entry_bytes,
                                              max_ratio=s.max_ratio, total_label=label)
                    _config, quantization = read_quantization_config(ckpt)
                    try:
                        self._load_quantized(ckpt)  # every tensor checked against the config; cached for chat
                    except BaseException:
                        self.cache.drop(lambda key: key[0] == "quant" and key[1] == str(ckpt))
                        raise
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
            finally:
                self._remove_upload(path)
        except (ValueError, OSError) as exc:
            raise self.error(f"cannot load {path.name}: {exc}") from None
        return snap.id

    def upload_view(self, run_id: str, request: gr.Request):
        """After an accepted upload: the run pickers set to the new run, its description, the runs table."""
        owner = self.owner(request)
        rows, fig, choices = self.runs_view(owner)
        try:
            snap = self.manager.get(run_id, owner, reports=False)
        except ValueError as exc:
            raise self.error(exc) from None
        title = snap.title.removeprefix("uploaded ")
        return (gr.Dropdown(choices=choices, value=snap.id), views.uploaded_md(title, snap.id,
                (snap.result or {}).get("source_model")), rows, fig, gr.Dropdown(choices=choices), None,
                self._guard(owner))

    def upload(self, archive, request: gr.Request):
        """``upload_run`` then ``upload_view`` in one call (the API's /upload)."""
        run_id = self.upload_run(archive, request)
        picker, message, rows, fig, _pick, _file, _guard = self.upload_view(run_id, request)
        return picker, message, rows, fig

    # ----------------------------------------------------------------------------------------- chat
    def chat_load(self, run_id: str, request: gr.Request):
        """Load both models of a run (cached) and describe them; clears both conversations."""
        owner = self.owner(request)
        if not run_id:
            return views.NO_RUN, [], [], "", ""
        try:
            (qmodel, _), original, why, source = self._run_models(run_id, owner)
        except ValueError as exc:
            raise self.error(exc) from None
        original_bytes = model_memory_bytes(original[0]) if original else None
        return (views.models_md(source, original_bytes, why, model_memory_bytes(qmodel), self.dtype,
                                self.settings.device, getattr(qmodel, "vptq_head_bits", 0)), [], [], "", "")

    def chat(self, prompt: str, history_original, history_quantized, run_id: str, temperature, top_p,
             max_new_tokens, request: gr.Request):
        """Answer ``prompt`` with the original and the quantized model at the same time (one thread each, the
        same prompt and sampling settings), streaming both replies; each side's speed is its decode rate
        measured while the other side runs too. A side stops on its own Stop button or on Stop both."""
        owner = self.owner(request)
        session_id = request.session_hash
        try:
            max_new_tokens = int(max_new_tokens)
            check_sampling(max_new_tokens, float(temperature), float(top_p))
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError("type a message first")
            quant, original, why, _source = self._run_models(run_id, owner)
        except ValueError as exc:
            raise self.error(exc) from None
        histories = {"original": views.normalize_history(history_original),
                     "quantized": views.normalize_history(history_quantized)}
        sessions: dict[str, ChatSession] = {}
        for side, pair in zip(SIDES, (original, quant)):
            if pair is None:
                continue
            session = self.make_chat(*pair)
            session.history = [m for m in histories[side] if m["content"]]
            try:
                session.check_prompt(prompt, max_new_tokens, self.settings.max_prompt_tokens)
            except ValueError as exc:
                raise self.error(f"{side} model: {exc}") from None
            sessions[side] = session
        stats = {"original": "", "quantized": ""}
        for side in SIDES:
            histories[side].append({"role": "user", "content": prompt})
            if side not in sessions:
                histories[side].append({"role": "assistant", "content": f"(original model not available: {why})"})
            else:
                histories[side].append({"role": "assistant", "content": ""})

        def shown(clear_prompt=False):
            return (histories["original"], histories["quantized"], stats["original"], stats["quantized"],
                    "" if clear_prompt else gr.skip())

        yield shown(clear_prompt=True)
        stops = {side: threading.Event() for side in sessions}
        with self._lock:
            self._chats[session_id] = {side: (sessions[side], stops[side]) for side in sessions}
        events: queue.Queue = queue.Queue()

        def run(side: str, session: ChatSession) -> None:
            try:
                for piece in session.stream(prompt, max_new_tokens=max_new_tokens, temperature=float(temperature),
                                            top_p=float(top_p), max_prompt_tokens=self.settings.max_prompt_tokens):
                    events.put((side, "piece", piece))
                    if stops[side].is_set():
                        session.stop()  # (a Stop pressed before generation began)
                events.put((side, "done", session.last_stats))
            except Exception as exc:  # noqa: BLE001 - shown in that side's pane; the other side goes on
                events.put((side, "error", self.public(exc)))

        threads = [threading.Thread(target=run, args=(side, session), name=f"chat-{side}", daemon=True)
                   for side, session in sessions.items()]
        for thread in threads:
            thread.start()
        pending = set(sessions)
        try:
            while pending:
                batch = [events.get()]
                while True:  # coalesce whatever else arrived: one page update per batch
                    try:
                        batch.append(events.get_nowait())
                    except queue.Empty:
                        break
                for side, kind, payload in batch:
                    message = histories[side][-1]
                    if kind == "piece":
                        message["content"] += payload
                    elif kind == "done":
                        pending.discard(side)
                        stats[side] = views.chat_stats_md(payload, model_memory_bytes(sessions[side].model),
                                                          stops[side].is_set())
                    else:
                        pending.discard(side)
                        message["content"] += f"\n(generation failed: {payload})"
                yield shown()
        finally:  # the page went away or the event was cancelled: stop both generations
            for side, session in sessions.items():
                stops[side].set()
                session.stop()
            with self._lock:
                if self._chats.get(session_id, {}).keys() == sessions.keys():
                    self._chats.pop(session_id, None)
        yield shown()

    def _stop_sides(self, request: gr.Request, sides: tuple[str, ...]) -> None:
        session_id = getattr(request, "session_hash", None)
        with self._lock:
            active = dict(self._chats.get(session_id, {}))
        for side in sides:
            if side in active:
                session, event = active[side]
                event.set()
                session.stop()

    def chat_stop(self, request: gr.Request) -> None:
        """Stop both sides."""
        self._stop_sides(request, SIDES)

    def chat_stop_original(self, request: gr.Request) -> None:
        self._stop_sides(request, ("original",))

    def chat_stop_quantized(self, request: gr.Request) -> None:
        self._stop_sides(request, ("quantized",))

    @staticmethod
    def chat_clear():
        return [], [], "", ""

    # -------------------------------------------------------------------------------------- sessions
    def on_unload(self, request: gr.Request) -> None:
        """A page went away (closed or reloaded): its chats stop. A browser's runs stay (they expire
        ``run_ttl_hours`` after they finish), and so does the page's link to its identity for as long: the page
        may still be there (Gradio's client disconnects on ``beforeunload`` even when the user then chooses to
        stay on the page). An API session's jobs are cancelled and its runs deleted, since nobody can come back
        to them."""
        session = getattr(request, "session_hash", None)
        if not session:
            return
        with self._lock:
            chats = self._chats.pop(session, {})
            identity = self._identities.get(session)
            if identity is not None:
                self._unloaded[session] = time.time()
        for chat_session, event in chats.values():
            event.set()
            chat_session.stop()
        if identity is None:
            self.manager.forget_owner(session)


def _calib_size(samples, seqlen) -> tuple[int, int]:
    """The calibration size fields as ints (ValueError naming the field, as ``CalibConfig`` checks them); a field
    not given (a caller without them) takes the usual size."""
    samples = form.MODEL_CALIB[0] if samples is None else samples
    seqlen = form.MODEL_CALIB[1] if seqlen is None else seqlen
    calib = CalibConfig(samples=_as_int(samples, "samples"), seqlen=_as_int(seqlen, "seqlen"))
    return calib.samples, calib.seqlen


def _as_int(value, name: str):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _hf_api(token: str):
    from huggingface_hub import HfApi

    return HfApi(token=token)


def active_statuses() -> tuple[str, ...]:
    return ACTIVE
