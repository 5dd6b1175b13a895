"""A browser's quantization runs: start (checked first), resume after a restart, cancel, the live view a timer
polls, the job as JSON, the runs table, and deleting a run.

Restarts: finished runs come back after the app restarts, and so does a run the restart cut off, as
"interrupted" with the blocks it had finished (``jobstore``); ``resume`` queues it again with the same
settings and it continues from its last finished block (``api.quantize_to_dir(resume=True)``: the same
checkpoint as an uninterrupted run). Messages and the job JSON name files, never server paths or session ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import gradio as gr

from ..quant import methods
from ..quant.config import CalibConfig
from . import form, plots, views
from .downloads import Downloads
from .estimate import Estimate, ModelInfo, estimate, model_info, time_estimate
from .quantize_form import QuantizeForm, model_name, read_calibration_file
from .services import Shared, user_error


@dataclass(frozen=True)
class _Prepared:
    """A start the checks accepted: what the job runs and what the page shows of it."""

    name: str
    config: object
    calib: CalibConfig
    calib_text: str | None
    info: ModelInfo
    est: Estimate
    reserve: int  # bytes the run will write: the checkpoint and its zip


class Runs:
    """``make_task(model, method, config, calib, device=, calib_text=, resume=)`` builds a job's task
    (``task.quantization_task``; tests pass stand-ins)."""

    def __init__(self, shared: Shared, quantize_form: QuantizeForm, downloads: Downloads,
                 make_task: Callable[..., Callable]) -> None:
        self.shared = shared
        self.quantize_form = quantize_form
        self.downloads = downloads
        self.make_task = make_task

    # ---------------------------------------------------------------------------------- start / resume
    def check_start(self, model, custom_model, method, calib_source, calib_file, calib_samples, calib_seqlen,
                    request: gr.Request, **settings) -> None:
        """What ``start`` checks, with no outputs: the page runs it first, so a refused Start leaves only its
        message (no error marks on the job's outputs)."""
        try:
            self._prepare(self.shared.owner(request), model, custom_model, method, calib_source, calib_file,
                          calib_samples, calib_seqlen, settings, self.shared.client(request))
        except ValueError as exc:
            raise self.shared.error(exc) from None

    def start(self, model, custom_model, method, calib_source, calib_file, calib_samples, calib_seqlen,
              request: gr.Request, **settings):
        """Validate the settings and queue a quantization job; returns the job id and resets the live view."""
        owner = self.shared.owner(request)
        device = self.shared.settings.device
        try:
            p = self._prepare(owner, model, custom_model, method, calib_source, calib_file, calib_samples,
                              calib_seqlen, settings, self.shared.client(request))
            task = self.make_task(p.name, method, p.config, p.calib, device=device, calib_text=p.calib_text)
            uploaded = p.calib_text is not None
            snap = self.shared.manager.submit(owner, task, title=views.job_title(p.name, method, p.est),
                                              device=device, client=self.shared.client(request), meta={
                "model": p.name, "method": method, "settings": p.config.to_dict(),
                "num_blocks": p.info.num_blocks, "modules": list(p.info.modules), "estimate": asdict(p.est),
                "reserve_bytes": p.reserve,
                "calib": {**p.calib.to_dict(), **({"text": "uploaded file"} if uploaded else {})},
                "calib_uploaded": uploaded,
                "rough_seconds": time_estimate(p.info, p.config, p.calib.samples, p.calib.seqlen, method)})
        except ValueError as exc:
            raise self.shared.error(exc) from None
        return self._watch(snap, p.info.num_blocks, p.info.modules, owner)

    def resume(self, job_id: str, request: gr.Request):
        """Queue a run that a restart cut off again, with the settings it was started with: it continues from
        its last finished block. The same limits as ``start`` apply (jobs queued or running, the queue, the disk
        quotas). Returns what ``start`` returns."""
        owner = self.shared.owner(request)
        manager = self.shared.manager
        try:
            if not job_id:
                raise ValueError("no run to resume: a run interrupted by a restart is shown under Job after the "
                                 "page loads")
            snap = manager.get(job_id, owner, reports=False)
            if snap.status != "interrupted":
                raise ValueError(f"job {job_id} was not interrupted, it cannot be resumed (status: {snap.status})")
            meta = snap.meta
            if not isinstance(meta.get("calib"), dict) or meta.get("method") not in methods.names():
                raise ValueError(f"job {job_id} does not say how it was started; start it again")
            config = methods.make_config(meta["method"], meta.get("settings") or {})
            calib = CalibConfig.from_dict(meta["calib"])
            calib_text = None
            if meta.get("calib_uploaded"):
                path = manager.jobs_dir / snap.id / "calibration.txt"
                if not path.is_file():
                    raise ValueError(f"job {job_id} lost its uploaded calibration text; start it again")
                calib_text = path.read_text(encoding="utf-8")
            reserve = int(meta.get("reserve_bytes") or 0)
            self.shared.check_disk(owner, max(reserve - manager.job_bytes(snap.id, owner), 0), "resuming this run")
            device = self.shared.settings.device
            task = self.make_task(meta["model"], meta["method"], config, calib, device=device,
                                  calib_text=calib_text, resume=True)
            snap = manager.resume(snap.id, owner, task, device=device, client=self.shared.client(request))
        except ValueError as exc:
            raise self.shared.error(exc) from None
        return self._watch(snap, meta.get("num_blocks"), meta.get("modules"), owner)

    def _prepare(self, owner, model, custom_model, method, calib_source, calib_file, calib_samples, calib_seqlen,
                 settings, client: str | None = None) -> _Prepared:
        name = model_name(model, custom_model)
        try:
            config = form.config_from(method, settings)
            calib = CalibConfig(text="wiki", samples=calib_samples, seqlen=calib_seqlen, seed=settings.get("seed", 0))
        except ValueError as exc:
            raise ValueError(form.readable(exc)) from None
        calib_text = None
        if calib_source == form.FILE_SOURCE:
            calib_text = read_calibration_file(calib_file, self.shared.settings.max_calib_bytes)
        info = model_info(name)
        est = estimate(info, method, config)
        self.quantize_form.check_duration(info, method, config, calib.samples, calib.seqlen)
        self.shared.manager.check_submit(owner, client)
        # at least the model once in 16 bits: a run that could not even load it is refused before it is queued
        self.shared.memory.check_room(2 * (info.linear_weights + info.other_params), "loading this model")
        reserve = 2 * est.checkpoint_bytes + len(calib_text or "")  # the checkpoint and its zip
        self.shared.check_disk(owner, reserve, "this run")
        return _Prepared(name, config, calib, calib_text, info, est, reserve)

    def _watch(self, snap, num_blocks, modules, owner: str):
        """The live view reset to a job that was just queued, with the timer that polls it."""
        return (snap.id, self.shared.progress(snap), plots.proxy_error_figure([], num_blocks),
                plots.error_heatmap_figure([], num_blocks, modules), [], "",
                gr.DownloadButton(value=None, visible=False), "", {"job": snap.id, "version": None, "status": None},
                gr.Timer(active=True), self.shared.job_json(snap), self.shared.guard(owner))

    # ------------------------------------------------------------------------------ watching a job
    def job_status(self, job_id: str, request: gr.Request) -> dict:
        """The job as JSON, with every layer report so far (no server paths, no owner)."""
        try:
            return self.shared.job_json(self.shared.manager.get(job_id, self.shared.owner(request)), reports=True)
        except ValueError as exc:
            raise self.shared.error(exc) from None

    def cancel(self, job_id: str, request: gr.Request):
        try:
            snap = self.shared.manager.cancel(job_id, self.shared.owner(request))
        except ValueError as exc:
            raise self.shared.error(exc) from None
        return self.shared.progress(snap), self.shared.job_json(snap)

    def poll(self, job_id: str, seen: dict | None, request: gr.Request):
        """Timer tick: refresh the live view of the watched job; plots and tables only when they changed.
        Returns (progress, line plot, heatmap, layer table, summary, download button, runs table, runs plot,
        chat run picker, delete picker, job JSON, poll state, leave-page guard, timer)."""
        owner = self.shared.owner(request)
        skip = gr.skip()
        if not job_id:
            return (skip,) * 13 + (gr.Timer(active=False),)
        try:
            snap = self.shared.manager.get(job_id, owner)
        except ValueError as exc:
            return ((views.progress_html(None, self.shared.public(exc)),) + (skip,) * 10
                    + ({}, self.shared.guard(owner), gr.Timer(active=False)))
        seen = dict(seen or {})
        version = [snap.id, snap.status, list(snap.reports_version)]
        changed = seen.get("version") != version
        finished_now = changed and not snap.active and seen.get("status") != snap.status
        num_blocks, modules = snap.meta.get("num_blocks"), snap.meta.get("modules")
        lines = heat = table = job_json = skip
        if changed:
            lines = plots.proxy_error_figure(snap.reports, num_blocks)
            heat = plots.error_heatmap_figure(snap.reports, num_blocks, modules)
            table = plots.report_rows(snap.reports)
            job_json = self.shared.job_json(snap)
        summary = download = runs_rows = runs_fig = chat_runs = pick_runs = skip
        if finished_now:
            self.quantize_form.learn_speed(snap)
            summary = views.summary_md(snap)
            download = self.downloads.button(snap, owner)
            runs_rows, runs_fig, choices = self.shared.runs_view(owner)
            chat_runs = (gr.Dropdown(choices=choices, value=snap.id) if snap.status == "done"
                         else gr.Dropdown(choices=choices))
            pick_runs = gr.Dropdown(choices=choices)
        guard = self.shared.guard(owner)
        seen = {"job": snap.id, "version": version, "status": snap.status, "guard": guard}
        return (self.shared.progress(snap), lines, heat, table, summary, download, runs_rows, runs_fig,
                chat_runs, pick_runs, job_json, seen, guard, gr.Timer(active=snap.active))

    # ------------------------------------------------------------------------------------ the runs table
    def list_runs(self, request: gr.Request):
        """(rows of the runs table, bits-vs-perplexity figure) of the browser's finished runs."""
        rows, fig, _choices = self.shared.runs_view(self.shared.owner(request))
        return rows, fig

    def delete_run(self, run_id: str, watched: str, request: gr.Request):
        """Delete one of the browser's runs (an active job is cancelled first) with its files and downloads."""
        owner = self.shared.owner(request)
        if not run_id:
            raise user_error("pick a run to delete")
        try:
            self.shared.manager.delete(run_id, owner)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        rows, fig, choices = self.shared.runs_view(owner)
        reset = run_id == watched
        return (rows, fig, gr.Dropdown(choices=choices, value=None), gr.Dropdown(choices=choices, value=None),
                self.shared.guard(owner), gr.DownloadButton(value=None, visible=False) if reset else gr.skip(),
                "" if reset else gr.skip(), views.progress_html(None, f"run {run_id} was deleted") if reset
                else gr.skip(), "" if reset else gr.skip())
