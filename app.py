"""VPTQ Studio: quantize an LLM in the browser, watch where the error goes, chat with the result next to the
original, and download the packed weights.

Run ``python app.py`` (bundled SmolLM2-135M-Instruct, offline). Options: ``--tiny`` (or
``VPTQ_APP_DEFAULT_MODEL=tiny-random-llama``) makes the tiny test model the default, ``--workdir`` (or
``VPTQ_APP_WORKDIR``) sets where runs are written; host and port follow ``GRADIO_SERVER_NAME`` /
``GRADIO_SERVER_PORT`` or ``--host`` / ``--port``. This file is the UI only: layout and event wiring; the work
is done by ``vptq_core``.
"""

from __future__ import annotations

import argparse
import atexit
import html
import json
import os
import shutil
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import gradio as gr

from vptq_core.models import BUNDLED, TINY
from vptq_core.quant import methods
from vptq_core.quant.config import CalibConfig
from vptq_core.storage.archive import DEFAULT_MAX_BYTES, extract_checkpoint
from vptq_core.studio import plots
from vptq_core.studio.estimate import estimate, model_info
from vptq_core.studio.model_cache import ModelCache
from vptq_core.studio.queue import JobManager, JobSnapshot, default_device
from vptq_core.studio.task import quantization_task

ASSETS = Path(__file__).resolve().parent / "assets"
TITLE = "VPTQ Studio"
PRESETS = ("2 bits", "3 bits", "4 bits")
CUSTOM = "custom"
WEIGHT_ONLY = "16-bit (weight-only)"
ACTIVATIONS = {  # label -> (act_bits, act_granularity) for the scalar methods
    WEIGHT_ONLY: (16, "token"),
    "8-bit per token (dynamic)": (8, "token"),
    "8-bit per tensor (static, calibrated)": (8, "tensor"),
}
WIKI_SOURCE = "bundled Wikipedia text"
FILE_SOURCE = "my .txt file"
MODEL_CHOICES = [("SmolLM2-135M-Instruct (bundled, offline)", BUNDLED), ("tiny random llama (for tests)", TINY)]
SMOLLM2_NOTE = ("The bundled SmolLM2-135M-Instruct was shipped as 4-bit **Q4_1** weights (groups of 32), so 4-bit "
                "results on it are flattered: a 4-bit group-32 grid nearly reproduces them. Judge methods at 2–3 bits.")
SESSION_NOTE = ("Runs belong to this browser tab: download the archive before closing or reloading it "
                "(closing the tab cancels its jobs and deletes its runs).")


def available_methods() -> list[tuple[str, str]]:
    return [(m.label, m.name) for m in methods.all_methods()]


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


# ------------------------------------------------------------------------------------------- formatting
def _mb(n: float | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress_html(snap: JobSnapshot | None, message: str = "") -> str:
    """The progress bar and its line of text for one job snapshot."""
    if snap is None:
        text = html.escape(message or "No job yet: pick the settings and press Start.")
        return (f'<div class="vq-progress-wrap"><div class="vq-progress"><div class="vq-progress-bar" '
                f'style="width:0%"></div></div><div class="vq-progress-text">{text}</div></div>')
    total, done = snap.total_layers, snap.layers_done
    fraction = (done / total) if total else 0.0
    if snap.status == "done":
        fraction = 1.0
    parts = []
    if snap.status == "queued":
        parts.append(f"position {snap.position} in the {snap.device} queue ({snap.running_ahead} job(s) running "
                     f"ahead)")
    elif snap.status == "running":
        parts.append(snap.phase)
        if total:
            parts.append(f"{done}/{total} layers")
        if snap.current:
            parts.append(f"last: {snap.current}")
        if snap.eta_seconds is not None:
            parts.append(f"ETA {_duration(snap.eta_seconds)}")
        parts.append(f"elapsed {_duration(snap.elapsed)}")
    elif snap.status == "done":
        parts.append(f"{done} layers in {_duration(snap.elapsed)} on {snap.device}")
    elif snap.status == "cancelled":
        parts.append(f"stopped after {done} layer(s); nothing was saved")
    text = " · ".join(html.escape(p) for p in parts)
    error = f'<div class="vq-error">{html.escape(snap.error)}</div>' if snap.error else ""
    return (f'<div class="vq-progress-wrap" data-status="{snap.status}"><div class="vq-progress">'
            f'<div class="vq-progress-bar {snap.status}" style="width:{100 * fraction:.1f}%"></div></div>'
            f'<div class="vq-progress-text"><span class="vq-status">{snap.status}</span> '
            f'<code>{html.escape(snap.id)}</code> {html.escape(snap.title)}<br>{text}</div>{error}</div>')


def message_text(content) -> str:
    """Text of one chat message's content: a string, a list of blocks ({"type": "text", "text": ...}), one
    block, or a (path, alt) tuple. Non-text blocks contribute nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        if content.get("type", "text") == "text" and isinstance(content.get("text"), str):
            return content["text"]
        return ""
    if isinstance(content, list):
        return "".join(message_text(c) for c in content)
    return ""  # a (file path, alt text) tuple or a component: no text


def normalize_history(history) -> list[dict]:
    """Chatbot value -> [{"role", "content": str}] with text-only contents (Gradio 6 may send blocks)."""
    messages = []
    for m in history or []:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if role in ("user", "assistant"):
            messages.append({"role": role, "content": message_text(content)})
    return messages


# ----------------------------------------------------------------------------------------------- the app
class Studio:
    """Event handlers; every handler works on the jobs and runs of the calling browser session only."""

    def __init__(self, settings: AppSettings, manager: JobManager | None = None, cache: ModelCache | None = None):
        self.settings = settings
        limits = {"cpu": 1, **({settings.device: 1} if settings.device != "cpu" else {})}
        self.manager = manager or JobManager(settings.workdir, limits=limits)
        self.cache = cache or ModelCache(max_items=4)
        self.methods = available_methods()
        self._chat_lock = threading.Lock()
        self._chats: dict[str, list] = {}
        self._chat_stop: dict[str, threading.Event] = {}
        gpu = settings.device == "cuda"
        self.dtype = "float16" if gpu else "bfloat16"  # fp16 matmuls are very slow on CPU; bf16 is not

    # ----------------------------------------------------------------------------------------- helpers
    @staticmethod
    def owner(request: gr.Request | None) -> str:
        session = getattr(request, "session_hash", None) if request is not None else None
        if not session:
            raise _user_error("this action needs a browser session (no session id in the request)")
        return session

    def config_from(self, method: str, vector_len, num_centroids, num_res_centroids, outlier_percent, group_num,
                    enable_norm, enable_perm, kmeans_iters, finetune_iters, bits, group_size, act_order, lrq_rank,
                    lrq_iters, activations, seed):
        """The validated method config (ValueError naming the field)."""
        if method not in dict((v, k) for k, v in self.methods):
            raise ValueError(f"method must be one of {', '.join(v for _, v in self.methods)}, got {method!r}")
        if method == "vptq":
            settings = dict(vector_len=vector_len, num_centroids=num_centroids, num_res_centroids=num_res_centroids,
                            outlier_percent=outlier_percent, group_num=group_num, enable_norm=bool(enable_norm),
                            enable_perm=bool(enable_perm), kmeans_iters=kmeans_iters, finetune_iters=finetune_iters,
                            seed=seed)
        elif method in ("gptq", "rtn"):
            settings = dict(bits=bits, group_size=group_size, act_order=bool(act_order), **_act_settings(activations))
        else:
            settings = dict(bits=bits, group_size=group_size, rank=lrq_rank, iters=lrq_iters, seed=seed,
                            **_act_settings(activations))
        return methods.make_config(method, settings)

    @staticmethod
    def model_name(model: str | None, custom_model: str | None) -> str:
        return (custom_model or "").strip() or (model or "")

    def model_note(self, model: str, custom_model: str) -> str:
        name = self.model_name(model, custom_model)
        if name == BUNDLED:
            return SMOLLM2_NOTE
        if name == TINY:
            return "A tiny random llama (2 blocks, hidden 64): seconds to quantize, its chat output is noise."
        try:
            info = model_info(name)
        except ValueError as exc:
            return f"⚠️ {exc}"
        return f"`{name}`: {info.num_blocks} blocks, {len(info.linear_shapes)} linears to quantize."

    def estimate_md(self, model, custom_model, method, vector_len, num_centroids, num_res_centroids, outlier_percent,
                    group_num, enable_norm, enable_perm, kmeans_iters, finetune_iters, bits, group_size, act_order,
                    lrq_rank, lrq_iters, activations, seed) -> str:
        """Live bits per weight and checkpoint size for the current settings (warnings inline, no popup)."""
        name = self.model_name(model, custom_model)
        try:
            config = self.config_from(method, vector_len, num_centroids, num_res_centroids, outlier_percent,
                                      group_num, enable_norm, enable_perm, kmeans_iters, finetune_iters, bits,
                                      group_size, act_order, lrq_rank, lrq_iters, activations, seed)
            info = model_info(name)
        except ValueError as exc:
            return f"⚠️ {exc}"
        est = estimate(info, method, config)
        warning = ""
        if est.total_bits_per_weight > 1.5 * est.index_bits_per_weight:
            warning = ("  \n⚠️ Codebooks and scales outweigh the indices on this model's small layers: use fewer "
                       "centroids or longer vectors.")
        return (f"**{est.index_bits_per_weight:.3f} index bits** per weight · **{est.total_bits_per_weight:.3f} "
                f"total bits** (with codebooks, scales, permutations)  \n"
                f"Checkpoint ≈ **{_mb(est.checkpoint_bytes)}** + tokenizer files: quantized linears "
                f"{_mb(est.quantized_bytes)} + "
                f"embeddings, norms and the rest {_mb(est.other_bytes)} at 16 bits · the 16-bit model is "
                f"{_mb(est.dense_bytes)}  \n{len(info.linear_shapes)} linears in {info.num_blocks} blocks, "
                f"{info.linear_weights / 1e6:.1f} M weights quantized{warning}")

    def apply_preset(self, method: str, preset: str):
        """Setting values of a preset for the method (outputs: the VPTQ fields, then bits and group size)."""
        skip9 = [gr.skip()] * 9
        if preset not in PRESETS:
            return [*skip9, gr.skip(), gr.skip()]
        if method == "vptq":
            values = {**asdict(methods.make_config("vptq")), **methods.get("vptq").preset(preset)}
            return [values["vector_len"], values["num_centroids"], values["num_res_centroids"],
                    values["outlier_percent"], values["group_num"], values["enable_norm"], values["enable_perm"],
                    values["kmeans_iters"], values["finetune_iters"], gr.skip(), gr.skip()]
        values = methods.get(method).preset(preset)
        return [*skip9, values["bits"], values["group_size"]]

    @staticmethod
    def method_visibility(method: str):
        return (gr.update(visible=method == "vptq"), gr.update(visible=method != "vptq"),
                gr.update(visible=method == "gptq"), gr.update(visible=method == "lrq"))

    def _read_calibration_file(self, calib_file) -> str:
        if not calib_file:
            raise ValueError("calibration source is 'my .txt file' but no file was uploaded")
        path = Path(calib_file if isinstance(calib_file, str) else calib_file.get("path", ""))
        if not path.is_file():
            raise ValueError("the uploaded calibration file is gone; upload it again")
        size = path.stat().st_size
        if size > self.settings.max_calib_bytes:
            raise ValueError(f"calibration file is {_mb(size)}; at most {_mb(self.settings.max_calib_bytes)} allowed")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"calibration file is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if not text.strip():
            raise ValueError("calibration file is empty")
        return text

    # ------------------------------------------------------------------------------------ quantize tab
    def start(self, model, custom_model, method, vector_len, num_centroids, num_res_centroids, outlier_percent,
              group_num, enable_norm, enable_perm, kmeans_iters, finetune_iters, bits, group_size, act_order,
              lrq_rank, lrq_iters, activations, calib_source, calib_file, calib_samples, calib_seqlen, seed,
              request: gr.Request):
        """Validate the settings and queue a quantization job; returns the job id and resets the live view."""
        owner = self.owner(request)
        name = self.model_name(model, custom_model)
        try:
            config = self.config_from(method, vector_len, num_centroids, num_res_centroids, outlier_percent,
                                      group_num, enable_norm, enable_perm, kmeans_iters, finetune_iters, bits,
                                      group_size, act_order, lrq_rank, lrq_iters, activations, seed)
            calib = CalibConfig(text="wiki", samples=calib_samples, seqlen=calib_seqlen, seed=seed)
            calib_text = self._read_calibration_file(calib_file) if calib_source == FILE_SOURCE else None
            info = model_info(name)
            est = estimate(info, method, config)
            title = f"{name} · {method.upper()} · {est.total_bits_per_weight:.2f} bits"
            task = quantization_task(name, method, config, calib, device=self.settings.device, calib_text=calib_text)
            snap = self.manager.submit(owner, task, title=title, device=self.settings.device, meta={
                "model": name, "method": method, "settings": config.to_dict(), "num_blocks": info.num_blocks,
                "modules": list(info.modules), "estimate": asdict(est)})
        except ValueError as exc:
            raise _user_error(exc) from None
        return (snap.id, progress_html(snap), plots.proxy_error_figure([], info.num_blocks),
                plots.error_heatmap_figure([], info.num_blocks, info.modules), [], "",
                gr.DownloadButton(value=None, visible=False), "", {"job": snap.id, "version": None, "status": None},
                gr.Timer(active=True), snap.to_dict(reports=False))

    def job_status(self, job_id: str, request: gr.Request) -> dict:
        """The job as JSON, with every layer report so far."""
        try:
            return self.manager.get(job_id, self.owner(request)).to_dict()
        except ValueError as exc:
            raise _user_error(exc) from None

    def cancel(self, job_id: str, request: gr.Request):
        try:
            snap = self.manager.cancel(job_id, self.owner(request))
        except ValueError as exc:
            raise _user_error(exc) from None
        return progress_html(snap), snap.to_dict(reports=False)

    def summary_md(self, snap: JobSnapshot) -> str:
        if snap.status != "done" or not snap.result:
            return ""
        s = snap.result.get("summary", {})
        bits = (f"**{s['index_bits_per_weight']:.3f}** index / **{s['total_bits_per_weight']:.3f}** total bits per "
                f"weight" if s.get("total_bits_per_weight") else "bits unknown")
        size = _mb(snap.result.get("checkpoint_bytes"))
        return (f"### Done: {html.escape(snap.title)}\n{bits} · checkpoint **{size}**"
                f" · quantized in **{_duration(s.get('seconds'))}** ({_duration(snap.elapsed)} with loading and "
                f"saving) on {snap.device} · {s.get('layers', '?')} layers")

    def eval_md(self, snap: JobSnapshot) -> str:
        ev = snap.extras.get("eval")
        if not ev:
            return ""
        text = f"**Perplexity {ev['perplexity']:.3f}**"
        if ev.get("reference_perplexity") is not None:
            text += (f" (original {ev['reference_perplexity']:.3f}) · KL to the original **{ev['kl_divergence']:.4f}**"
                     f" nats/token · top-1 agreement **{100 * ev['top1_agreement']:.1f}%**")
        return (f"{text}  \n<span class='vq-note'>{ev['windows']} windows × {ev['seqlen']} tokens of the "
                f"{'bundled Wikipedia' if ev['text'] == 'wiki' else 'uploaded'} evaluation text "
                f"({ev['tokens']} predicted tokens, {ev['seconds']:.0f} s)</span>")

    def runs_view(self, owner: str):
        """(rows of the runs table, bits-vs-perplexity figure, choices of the chat run picker)."""
        rows, points, choices = [], [], []
        for snap in self.manager.jobs(owner, statuses=("done",)):
            result = snap.result or {}
            s = result.get("summary") or {}
            ev = snap.extras.get("eval") or {}
            method = (result.get("method") or s.get("method") or "?").lower()
            label = f"{method.upper()} {s['total_bits_per_weight']:.2f}b" if s.get("total_bits_per_weight") else method
            rows.append([
                snap.id, result.get("source_model") or "?", method.upper(),
                _describe(method, result.get("config") or s.get("config") or {}),
                _round(s.get("index_bits_per_weight"), 3), _round(s.get("total_bits_per_weight"), 3),
                _round((result.get("checkpoint_bytes") or 0) / 1e6, 1),
                _round(s["seconds"] / 60, 2) if s.get("seconds") is not None else None,
                _round(ev.get("perplexity"), 3), _round(ev.get("reference_perplexity"), 3),
                _round(ev.get("kl_divergence"), 4),
                _round(100 * ev["top1_agreement"], 1) if ev.get("top1_agreement") is not None else None,
            ])
            points.append({"label": f"{label} ({snap.id[:4]})", "method": method,
                           "total_bits": s.get("total_bits_per_weight"), "perplexity": ev.get("perplexity"),
                           "reference_perplexity": ev.get("reference_perplexity")})
            kind = "uploaded" if snap.kind == "import" else (result.get("source_model") or "")
            choices.append((f"{snap.id} · {label} · {kind}", snap.id))
        return rows, plots.runs_figure(points), choices

    def runs(self, request: gr.Request):
        rows, fig, choices = self.runs_view(self.owner(request))
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
            return (progress_html(None, str(exc)),) + (skip,) * 10 + (gr.Timer(active=False),)
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
            summary = self.summary_md(snap)
            archive = (snap.result or {}).get("archive")
            download = gr.DownloadButton(
                label=f"Download the packed checkpoint ({_mb((snap.result or {}).get('archive_bytes'))} zip)",
                value=archive, visible=bool(archive))
            runs_rows, runs_fig, choices = self.runs_view(owner)
            chat_runs = (gr.Dropdown(choices=choices, value=snap.id) if snap.status == "done"
                         else gr.Dropdown(choices=choices))
        seen = {"job": snap.id, "version": version, "status": snap.status}
        return (progress_html(snap), lines, heat, table, summary, download, runs_rows, runs_fig, chat_runs, job_json,
                seen, gr.Timer(active=snap.active))

    def download(self, job_id: str, request: gr.Request):
        """The packed checkpoint archive of a finished job (for API clients; the UI button gets it on finish)."""
        try:
            snap = self.manager.get(job_id, self.owner(request), reports=False)
        except ValueError as exc:
            raise _user_error(exc) from None
        archive = (snap.result or {}).get("archive")
        if snap.status != "done" or not archive:
            raise _user_error(f"job {job_id} has no archive to download (status: {snap.status})")
        return archive

    # ------------------------------------------------------------------------------- models and eval
    def _load_quantized(self, ckpt: Path):
        from vptq_core.storage.checkpoint import load_quantized

        def load():
            model, tok = load_quantized(ckpt, device=self.settings.device, dtype=self.dtype)
            if tok is None:
                raise ValueError(f"checkpoint {ckpt.name} holds no tokenizer; cannot chat with it or evaluate it")
            return model, tok

        return self.cache.get(("quant", str(ckpt), self.settings.device), load)

    def _load_original(self, source: str):
        from vptq_core.models import load_model

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
        from vptq_core.eval import evaluate

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
            raise _user_error(exc) from None
        rows, fig, _choices = self.runs_view(owner)
        return self.eval_md(snap), rows, fig, snap.to_dict(reports=False)

    def evaluate_run(self, run_id: str, windows, seqlen, request: gr.Request,
                     progress=gr.Progress()):  # noqa: B008
        """``evaluate`` for the run picked in the Chat tab (e.g. an uploaded checkpoint)."""
        shown, rows, fig, _job = self.evaluate(run_id, windows, seqlen, request, progress)
        return shown, rows, fig

    # ----------------------------------------------------------------------------------------- chat
    def upload(self, archive, request: gr.Request):
        """Validate and unpack an uploaded checkpoint archive into a new run of this session."""
        from vptq_core.api import source_model_of
        from vptq_core.storage.checkpoint import checkpoint_size, read_quantization_config

        owner = self.owner(request)
        if not archive:
            raise _user_error("no archive uploaded")
        path = Path(archive if isinstance(archive, str) else archive.get("path", ""))
        try:
            size = path.stat().st_size
            if size > self.settings.max_upload_bytes:
                raise ValueError(f"archive is {_mb(size)}; at most {_mb(self.settings.max_upload_bytes)} allowed")

            def fill(out_dir: Path) -> dict:
                ckpt = extract_checkpoint(path, out_dir / "checkpoint", max_bytes=self.settings.max_upload_bytes)
                _config, quantization = read_quantization_config(ckpt)
                report = {}
                if (ckpt / "quant_report.json").is_file():
                    report = json.loads((ckpt / "quant_report.json").read_text(encoding="utf-8"))
                method = report.get("method") if isinstance(report, dict) else None
                return {"checkpoint_dir": str(ckpt), "source_model": source_model_of(str(ckpt)),
                        "summary": report.get("summary", {}) if isinstance(report, dict) else {},
                        "method": method or quantization.get("quant_method"), "config": report.get("settings", {}),
                        "checkpoint_bytes": checkpoint_size(ckpt), "archive": None}

            snap = self.manager.import_run(owner, fill, title=f"uploaded {path.name}")
        except (ValueError, OSError) as exc:
            raise _user_error(f"cannot load {path.name}: {exc}") from None
        rows, fig, choices = self.runs_view(owner)
        source = (snap.result or {}).get("source_model") or "unknown"
        return (gr.Dropdown(choices=choices, value=snap.id), f"Loaded `{path.name}` as run `{snap.id}` "
                f"(made from `{source}`).", rows, fig)

    def chat_load(self, run_id: str, request: gr.Request):
        """Load both models of a run (cached) and describe them; clears both conversations."""
        owner = self.owner(request)
        if not run_id:
            return "Pick a finished run or upload a packed checkpoint.", [], [], "", ""
        try:
            (qmodel, _), original, why, source = self._run_models(run_id, owner)
        except ValueError as exc:
            raise _user_error(exc) from None
        return (self._models_md(qmodel, original, why, source), [], [], "", "")

    def _models_md(self, qmodel, original, why: str, source: str | None) -> str:
        from vptq_core.studio.chat import model_memory_bytes

        device, dtype = self.settings.device, self.dtype
        left = (f"**Original** `{source}` ({dtype}, {device}): weights {_mb(model_memory_bytes(original[0]))}"
                if original else f"**Original** not available: {why}")
        right = (f"**Quantized** ({dtype} activations, lookup kernels, {device}): weights "
                 f"{_mb(model_memory_bytes(qmodel))}")
        return f"{left}  \n{right}"

    def _stop_event(self, owner: str) -> threading.Event:
        with self._chat_lock:
            event = self._chat_stop.setdefault(owner, threading.Event())
        return event

    def chat(self, prompt: str, history_original, history_quantized, run_id: str, temperature, top_p,
             max_new_tokens, request: gr.Request):
        """Answer ``prompt`` with the original model, then with the quantized one (one after the other, so each
        one's tokens/s is measured without the other competing for the same cores), streaming tokens."""
        from vptq_core.studio.chat import ChatSession, check_sampling, model_memory_bytes

        owner = self.owner(request)
        try:
            max_new_tokens = int(max_new_tokens)
            check_sampling(max_new_tokens, float(temperature), float(top_p))
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError("type a message first")
            quant, original, why, _source = self._run_models(run_id, owner)
        except ValueError as exc:
            raise _user_error(exc) from None
        stop = self._stop_event(owner)
        stop.clear()
        histories = [normalize_history(history_original), normalize_history(history_quantized)]
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
            stats[side] = (f"{st.tokens} tokens · **{st.tokens_per_second:.1f} tokens/s** · weights "
                           f"{_mb(model_memory_bytes(model))}" + (" · stopped" if stop.is_set() else ""))
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


def _act_settings(activations) -> dict:
    if activations in (None, ""):
        activations = WEIGHT_ONLY
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(repr(a) for a in ACTIVATIONS)}, got {activations!r}")
    act_bits, granularity = ACTIVATIONS[activations]
    return {"act_bits": act_bits, "act_granularity": granularity}


def _user_error(message) -> gr.Error:
    """A message for the user (shown in the page), not a server fault: no traceback in the log."""
    return gr.Error(str(message), print_exception=False)


def _round(value, digits: int):
    return None if value is None else round(float(value), digits)


def _describe(method: str, settings: dict) -> str:
    """The method's one-line label of a run's settings ("" for an unknown method or no settings)."""
    if not settings or method not in methods.names():
        return ""
    return methods.get(method).describe(settings)


def _examples() -> list[list[str]]:
    path = ASSETS / "example_prompts.txt"
    if not path.is_file():
        return []
    return [[line.strip()] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _gpu(fn, duration: int):
    """``spaces.GPU`` on Hugging Face Spaces (a GPU is attached for the call on ZeroGPU; elsewhere no effect)."""
    try:
        import spaces
    except ImportError:
        return fn
    return spaces.GPU(duration=duration)(fn)


# -------------------------------------------------------------------------------------------- layout
def build_app(settings: AppSettings, studio: Studio | None = None) -> gr.Blocks:
    """The Gradio Blocks of the studio (launch it with ``launch_options(settings)``)."""
    app = studio or Studio(settings)
    method_choices = app.methods
    vptq_defaults = {**asdict(methods.make_config("vptq")), **methods.get("vptq").preset("2 bits")}
    default_model = settings.default_model if settings.default_model in (BUNDLED, TINY) else BUNDLED
    custom_default = "" if settings.default_model in (BUNDLED, TINY) else settings.default_model
    small = settings.default_model == TINY
    if small:  # the presets are sized for SmolLM2; the tiny model's 64-wide layers need tiny codebooks
        vptq_defaults.update(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0)

    with gr.Blocks(title=TITLE, analytics_enabled=False, delete_cache=(1800, 3600)) as demo:
        demo.studio = app
        gr.Markdown(f"# {TITLE}\nExtreme low-bit quantization of LLMs — VPTQ vector quantization, LRQ, GPTQ and "
                    "RTN — in the browser: quantize, watch where the error goes, chat with the result next to the "
                    f"original, take the packed weights home. <span class='vq-note'>Jobs run on "
                    f"**{settings.device}**. {SESSION_NOTE}</span>",
                    elem_classes="vq-header")
        with gr.Tabs():
            with gr.Tab("Quantize", id="quantize"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1, min_width=340):
                        model = gr.Dropdown(MODEL_CHOICES, value=default_model, label="Model")
                        custom_model = gr.Textbox(value=custom_default, label="…or a hub id / local directory",
                                                  placeholder="e.g. HuggingFaceTB/SmolLM2-360M-Instruct or a path")
                        model_note = gr.Markdown(app.model_note(default_model, custom_default),
                                                 elem_classes="vq-note")
                        method = gr.Radio(method_choices, value="vptq", label="Method")
                        preset = gr.Radio([*PRESETS, CUSTOM], value=CUSTOM if small else "2 bits", label="Preset")
                        with gr.Accordion("Advanced settings", open=False):
                            with gr.Group(visible=True) as vptq_group:
                                with gr.Row():
                                    vector_len = gr.Number(vptq_defaults["vector_len"], precision=0,
                                                           label="vector length")
                                    num_centroids = gr.Number(vptq_defaults["num_centroids"], precision=0,
                                                              label="centroids (power of 2)")
                                    num_res_centroids = gr.Number(vptq_defaults["num_res_centroids"], precision=0,
                                                                  label="residual centroids (0 = none)")
                                with gr.Row():
                                    outlier_percent = gr.Number(vptq_defaults["outlier_percent"],
                                                                label="outlier columns %")
                                    group_num = gr.Number(vptq_defaults["group_num"], precision=0, label="groups")
                                    kmeans_iters = gr.Number(vptq_defaults["kmeans_iters"], precision=0,
                                                             label="k-means iterations")
                                with gr.Row():
                                    enable_norm = gr.Checkbox(vptq_defaults["enable_norm"], label="normalize columns")
                                    enable_perm = gr.Checkbox(vptq_defaults["enable_perm"],
                                                              label="permute columns (Hessian order)")
                                    finetune_iters = gr.Number(vptq_defaults["finetune_iters"], precision=0,
                                                               label="fine-tune iterations")
                            with gr.Group(visible=False) as scalar_group, gr.Row():
                                bits = gr.Number(2, precision=0, label="bits")
                                group_size = gr.Number(64, precision=0, label="group size (0 = per channel)")
                                activations = gr.Dropdown(list(ACTIVATIONS), value=WEIGHT_ONLY,
                                                          label="activations (W·A8 = 8-bit inputs to the linears)")
                            with gr.Group(visible=False) as gptq_group:
                                act_order = gr.Checkbox(True, label="act order (GPTQ)")
                            with gr.Group(visible=False) as lrq_group, gr.Row():
                                lrq_rank = gr.Number(0, precision=0, label="LRQ rank (0 = auto)")
                                lrq_iters = gr.Number(20 if small else 200, precision=0,
                                                      label="LRQ iterations per block")
                            gr.Markdown("**Calibration**")
                            calib_source = gr.Radio([WIKI_SOURCE, FILE_SOURCE], value=WIKI_SOURCE,
                                                    label="calibration text")
                            calib_file = gr.File(label="calibration .txt (UTF-8)", file_types=[".txt"],
                                                 visible=False, height=90)
                            with gr.Row():
                                calib_samples = gr.Number(4 if small else 32, precision=0, label="samples")
                                calib_seqlen = gr.Number(64 if small else 512, precision=0,
                                                         label="tokens per sample")
                                seed = gr.Number(0, precision=0, label="seed")
                        estimate_box = gr.Markdown(elem_id="estimate")
                        with gr.Row():
                            start_btn = gr.Button("Start", variant="primary", elem_id="start-btn")
                            cancel_btn = gr.Button("Cancel", variant="stop", elem_id="cancel-btn")
                    with gr.Column(scale=2, min_width=480):
                        job_id = gr.Textbox(label="Job", interactive=False, max_lines=1, elem_id="job-id")
                        progress = gr.HTML(progress_html(None), elem_id="job-progress")
                        lines_plot = gr.Plot(plots.proxy_error_figure([]), show_label=False, elem_id="plot-lines")
                        heat_plot = gr.Plot(plots.error_heatmap_figure([]), show_label=False, elem_id="plot-heatmap")
                        table = gr.Dataframe(headers=plots.REPORT_COLUMNS, value=[], interactive=False,
                                             max_height=260, label="Layer reports (newest first)",
                                             elem_id="layer-table")
                        summary = gr.Markdown(elem_id="job-summary")
                        download_btn = gr.DownloadButton("Download the packed checkpoint", visible=False,
                                                         elem_id="download-btn")
                        with gr.Row(equal_height=False, elem_classes="vq-eval-row"):
                            eval_windows = gr.Number(2 if small else settings.eval_windows, precision=0,
                                                     label="evaluation windows", min_width=120)
                            eval_seqlen = gr.Number(64 if small else settings.eval_seqlen, precision=0,
                                                    label="tokens per window", min_width=120)
                            eval_btn = gr.Button("Evaluate vs the original", elem_id="eval-btn", min_width=200)
                        eval_box = gr.Markdown(elem_id="eval-result")
                with gr.Accordion("Your runs: compare settings", open=True):
                    with gr.Row():
                        runs_table = gr.Dataframe(headers=plots.RUN_COLUMNS, value=[], interactive=False,
                                                  max_height=260, show_label=False, scale=3, elem_id="runs-table")
                        runs_plot = gr.Plot(plots.runs_figure([]), show_label=False, scale=2, elem_id="runs-plot")
                    runs_btn = gr.Button("Refresh runs", size="sm")
                with gr.Accordion("Raw job status (JSON)", open=False):
                    job_json = gr.JSON(label="job")
                    status_btn = gr.Button("Refresh with every layer report", size="sm")
                    download_api = gr.Button("api: download", visible=False)
            with gr.Tab("Chat", id="chat"):
                with gr.Row(equal_height=True):
                    chat_run = gr.Dropdown([], value=None, label="Quantized run", allow_custom_value=True, scale=3,
                                           elem_id="chat-run")
                    archive_upload = gr.File(label="…or load a packed checkpoint (.zip)", file_types=[".zip"],
                                             scale=2, height=110, elem_id="archive-upload")
                with gr.Row(equal_height=False, elem_classes="vq-eval-row"):
                    models_box = gr.Markdown("Pick a finished run or upload a packed checkpoint.",
                                             elem_id="chat-models")
                    run_eval_btn = gr.Button("Evaluate this run vs the original", size="md", scale=0,
                                             min_width=260, elem_id="chat-eval-btn")
                run_eval_box = gr.Markdown(elem_id="chat-eval-result")
                with gr.Row(equal_height=True):
                    with gr.Column(elem_classes="vq-chat-col"):
                        gr.Markdown("#### Original model")
                        chat_orig = gr.Chatbot(label="Original model", show_label=False, height=380,
                                               elem_id="chat-original", buttons=["copy"])
                        stats_orig = gr.Markdown(elem_classes="vq-stats", elem_id="stats-original")
                    with gr.Column(elem_classes="vq-chat-col"):
                        gr.Markdown("#### Quantized model")
                        chat_quant = gr.Chatbot(label="Quantized model", show_label=False, height=380,
                                                elem_id="chat-quantized", buttons=["copy"])
                        stats_quant = gr.Markdown(elem_classes="vq-stats", elem_id="stats-quantized")
                with gr.Row(equal_height=True):
                    prompt = gr.Textbox(placeholder="Ask both models something…", show_label=False, scale=5,
                                        elem_id="chat-prompt", max_lines=4)
                    send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
                    stop_btn = gr.Button("Stop", variant="stop", scale=1, elem_id="chat-stop")
                    clear_btn = gr.Button("Clear", scale=1, elem_id="chat-clear")
                with gr.Accordion("Sampling", open=False):
                    with gr.Row():
                        temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
                        top_p = gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="top-p")
                        max_new_tokens = gr.Slider(1, 1024, value=64 if small else 160, step=1,
                                                   label="max new tokens")
                examples = _examples()
                if examples:
                    gr.Examples(examples, inputs=[prompt], label="Example prompts")
        timer = gr.Timer(1.0, active=False)
        poll_state = gr.State({})

        vptq_fields = [vector_len, num_centroids, num_res_centroids, outlier_percent, group_num, enable_norm,
                       enable_perm, kmeans_iters, finetune_iters]
        other_fields = [bits, group_size, act_order, lrq_rank, lrq_iters, activations]
        settings_inputs = [model, custom_model, method, *vptq_fields, *other_fields, seed]
        calib_inputs = [calib_source, calib_file, calib_samples, calib_seqlen]

        # Settings: presets fill the fields; editing a field by hand switches the preset to "custom".
        gr.on([method.change, preset.change], app.apply_preset, inputs=[method, preset],
              outputs=[*vptq_fields, bits, group_size], api_name="preset", show_progress="hidden")
        method.change(app.method_visibility, inputs=method, outputs=[vptq_group, scalar_group, gptq_group, lrq_group],
                      api_visibility="private", show_progress="hidden")
        for f in [*vptq_fields, bits, group_size]:
            f.input(lambda: CUSTOM, outputs=preset, api_visibility="private", show_progress="hidden")
        calib_source.change(lambda s: gr.File(visible=s == FILE_SOURCE), inputs=calib_source, outputs=calib_file,
                            api_visibility="private", show_progress="hidden")
        gr.on([model.change, custom_model.submit, custom_model.blur], app.model_note, inputs=[model, custom_model],
              outputs=model_note, api_name="model_note", concurrency_limit=4)
        gr.on([demo.load] + [c.change for c in settings_inputs], app.estimate_md, inputs=settings_inputs,
              outputs=estimate_box, api_name="estimate", trigger_mode="always_last", show_progress="hidden",
              concurrency_limit=4)

        live_outputs = [job_id, progress, lines_plot, heat_plot, table, summary, download_btn, eval_box, poll_state,
                        timer, job_json]
        start_btn.click(app.start, inputs=[*settings_inputs[:-1], *calib_inputs, seed], outputs=live_outputs,
                        api_name="start", concurrency_limit=4)
        cancel_btn.click(app.cancel, inputs=job_id, outputs=[progress, job_json], api_name="cancel",
                         concurrency_limit=None)
        timer.tick(app.poll, inputs=[job_id, poll_state],
                   outputs=[progress, lines_plot, heat_plot, table, summary, download_btn, runs_table, runs_plot,
                            chat_run, job_json, poll_state, timer],
                   api_name="poll", show_progress="hidden", concurrency_limit=None)
        status_btn.click(app.job_status, inputs=job_id, outputs=job_json, api_name="job_status",
                         concurrency_limit=None)
        download_api.click(app.download, inputs=job_id, outputs=download_btn, api_name="download")
        eval_btn.click(_gpu(app.evaluate, 300), inputs=[job_id, eval_windows, eval_seqlen],
                       outputs=[eval_box, runs_table, runs_plot, job_json], api_name="evaluate",
                       concurrency_limit=1, concurrency_id="evaluate")
        run_eval_btn.click(_gpu(app.evaluate_run, 300), inputs=[chat_run, eval_windows, eval_seqlen],
                           outputs=[run_eval_box, runs_table, runs_plot], api_name="evaluate_run",
                           concurrency_limit=1, concurrency_id="evaluate")
        runs_btn.click(app.runs, outputs=[runs_table, runs_plot], api_name="runs")

        archive_upload.upload(app.upload, inputs=archive_upload, outputs=[chat_run, models_box, runs_table, runs_plot],
                              api_name="upload", concurrency_limit=2)
        chat_run.change(app.chat_load, inputs=chat_run,
                        outputs=[models_box, chat_orig, chat_quant, stats_orig, stats_quant], api_name="chat_load",
                        concurrency_limit=2)
        chat_inputs = [prompt, chat_orig, chat_quant, chat_run, temperature, top_p, max_new_tokens]
        chat_outputs = [chat_orig, chat_quant, stats_orig, stats_quant, prompt]
        chat_fn = _gpu(app.chat, 120)
        gr.on([send_btn.click, prompt.submit], chat_fn, inputs=chat_inputs, outputs=chat_outputs, api_name="chat",
              concurrency_limit=settings.chat_concurrency, concurrency_id="chat", show_progress="minimal")
        stop_btn.click(app.chat_stop, api_name="chat_stop", concurrency_limit=None)
        clear_btn.click(app.chat_clear, outputs=[chat_orig, chat_quant, stats_orig, stats_quant], api_name="chat_clear")
        demo.unload(app.on_unload)
    # Short handlers run a few at a time; quantization itself is limited by the job manager, chat and
    # evaluation by their own limits above.
    demo.queue(default_concurrency_limit=2, max_size=64)
    return demo


def launch_options(settings: AppSettings) -> dict:
    """Keyword arguments for ``demo.launch``: theme and CSS, and only the work dir served as files."""
    return {
        "theme": gr.themes.Soft(primary_hue="indigo"),
        "css_paths": [str(ASSETS / "app.css")],
        "allowed_paths": [str(settings.workdir)],
        "max_file_size": settings.max_upload_bytes,
        "show_error": True,
        "footer_links": ["api"],
    }


def settings_from(args: argparse.Namespace) -> AppSettings:
    workdir = args.workdir or os.environ.get("VPTQ_APP_WORKDIR")
    cleanup = False
    if not workdir:
        workdir, cleanup = tempfile.mkdtemp(prefix="vptq_app_"), True
    default_model = TINY if args.tiny else (args.default_model or os.environ.get("VPTQ_APP_DEFAULT_MODEL") or BUNDLED)
    chat = int(os.environ.get("VPTQ_APP_CHAT_CONCURRENCY", "2"))
    max_upload = int(float(os.environ.get("VPTQ_APP_MAX_UPLOAD_MB", str(DEFAULT_MAX_BYTES / 1e6))) * 1e6)
    device = default_device()
    # Evaluating a quantized model on 2 CPU cores costs tens of seconds per 512-token window: keep it modest.
    return AppSettings(workdir=Path(workdir).resolve(), default_model=default_model, device=device,
                       chat_concurrency=max(chat, 1), max_upload_bytes=max_upload, cleanup_workdir=cleanup,
                       eval_windows=4 if device == "cpu" else 16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=f"{TITLE}: quantize, inspect and chat with low-bit LLMs.")
    parser.add_argument("--host", default=None,
                        help="interface to listen on (default: GRADIO_SERVER_NAME or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: GRADIO_SERVER_PORT or 7860)")
    parser.add_argument("--workdir", default=None, help="where runs are written (default: VPTQ_APP_WORKDIR or a "
                        "fresh temporary directory removed at exit)")
    parser.add_argument("--default-model", default=None, help="model selected at start (default: "
                        f"VPTQ_APP_DEFAULT_MODEL or {BUNDLED})")
    parser.add_argument("--tiny", action="store_true", help=f"make {TINY} the default model (tests, quick demos)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_from(args)
    if settings.cleanup_workdir:
        atexit.register(shutil.rmtree, settings.workdir, True)
    demo = build_app(settings)
    # Build the default model's shapes (and the bundled model's dense cache) before the first visitor asks.
    threading.Thread(target=_warm_up, args=(settings.default_model,), daemon=True).start()
    demo.launch(server_name=args.host, server_port=args.port, **launch_options(settings))


def _warm_up(name: str) -> None:
    try:
        model_info(name)
    except ValueError:
        pass  # the page shows the reason when the model is picked


if __name__ == "__main__":
    main()
