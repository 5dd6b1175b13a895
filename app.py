"""VPTQ Studio: quantize an LLM in the browser, watch where the error goes, chat with the result next to the
original, and download the packed weights.

Run ``python app.py`` (bundled SmolLM2-135M-Instruct, offline). Options: ``--tiny`` (or
``VPTQ_APP_DEFAULT_MODEL=tiny-random-llama``) makes the tiny test model the default, ``--workdir`` (or
``VPTQ_APP_WORKDIR``) sets where runs are written; host and port follow ``GRADIO_SERVER_NAME`` /
``GRADIO_SERVER_PORT`` or ``--host`` / ``--port``; the limits a public machine needs are ``AppSettings`` fields
with an environment variable each (``LIMITS``). This file is the UI only: layout and event wiring; the
handlers are ``vptq_core.studio.handlers.Studio``, what they show is formatted by ``vptq_core.studio.views``
and the settings form's logic is ``vptq_core.studio.form``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

import gradio as gr

from vptq_core.generation import warm_up_kernels
from vptq_core.models import BUNDLED, TINY
from vptq_core.quant import methods
from vptq_core.studio import form, plots, views
from vptq_core.studio.estimate import model_info
from vptq_core.studio.form import CUSTOM, FILE_SOURCE, WIKI_SOURCE
from vptq_core.studio.handlers import AppSettings, Studio
from vptq_core.studio.queue import default_device
from vptq_core.studio.settings_panel import calibration_settings, settings_panel

__all__ = ["AppSettings", "Studio", "build_app", "launch_options", "main", "parse_args", "settings_from"]

ASSETS = Path(__file__).resolve().parent / "assets"
TITLE = "VPTQ Studio"
MODEL_CHOICES = [("SmolLM2-135M-Instruct (bundled, offline)", BUNDLED), ("tiny random llama (for tests)", TINY),
                 ("a hub id or a local directory…", form.OTHER_MODEL)]
# Every limit: (AppSettings field, environment variable, what it takes). Sizes are given in MB (10^6 bytes).
LIMITS = {
    "max_upload_bytes": ("VPTQ_APP_MAX_UPLOAD_MB", "MB"),
    "max_unpacked_bytes": ("VPTQ_APP_MAX_UNPACKED_MB", "MB"),
    "max_entry_bytes": ("VPTQ_APP_MAX_ENTRY_MB", "MB"),
    "max_ratio": ("VPTQ_APP_MAX_RATIO", "ratio"),
    "user_quota_bytes": ("VPTQ_APP_USER_QUOTA_MB", "MB"),
    "total_quota_bytes": ("VPTQ_APP_TOTAL_QUOTA_MB", "MB"),
    "max_runs_per_user": ("VPTQ_APP_MAX_RUNS", "int"),
    "max_jobs_per_user": ("VPTQ_APP_MAX_JOBS", "int"),
    "run_ttl_hours": ("VPTQ_APP_RUN_TTL_HOURS", "hours"),
    "max_prompt_tokens": ("VPTQ_APP_MAX_PROMPT_TOKENS", "int"),
    "chat_concurrency": ("VPTQ_APP_CHAT_CONCURRENCY", "int"),
}
# The page warns before it is left while a job runs or a result was not taken home (the guard element's data).
LEAVE_GUARD_JS = """<script>
window.addEventListener('beforeunload', function (event) {
  var guard = document.querySelector('[data-guard]');
  if (guard && (guard.dataset.busy === '1' || guard.dataset.unexported === '1')) {
    event.preventDefault();
    event.returnValue = '';
  }
});
</script>"""


def _examples() -> list[list[str]]:
    path = ASSETS / "example_prompts.txt"
    if not path.is_file():
        return []
    return [[line.strip()] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _gpu(fn, duration: int):
    """``spaces.GPU`` on Hugging Face Spaces (a GPU is attached for the call on ZeroGPU; elsewhere no effect)."""
    try:
        import spaces  # optional: only installed on Hugging Face Spaces
    except ImportError:
        return fn
    return spaces.GPU(duration=duration)(fn)


# -------------------------------------------------------------------------------------------- layout
def build_app(settings: AppSettings, studio: Studio | None = None) -> gr.Blocks:
    """The Gradio Blocks of the studio (launch it with ``launch_options(settings)``)."""
    app = studio or Studio(settings)
    method_list = methods.all_methods()
    initial = form.initial_values(form.DEFAULT_PRESET)
    known = settings.default_model in (BUNDLED, TINY)
    default_model = settings.default_model if known else form.OTHER_MODEL
    custom_default = "" if known else settings.default_model
    small = settings.default_model == TINY
    initial["iters"] = 20 if small else 200  # LRQ: more steps than the library default when a user waits for it
    if small:  # the presets are sized for SmolLM2; the tiny model's 64-wide layers need tiny codebooks
        initial.update(form.SMALL_MODEL_VALUES)
    samples0, seqlen0 = form.SMALL_MODEL_CALIB if small else form.MODEL_CALIB
    labels = form.FIELD_LABELS

    with gr.Blocks(title=TITLE, analytics_enabled=False, delete_cache=(1800, 3600)) as demo:
        demo.studio = app
        demo.settings_form = fields = {}  # one component per form field, keyed by the setting (see studio.form)
        retention = views.retention_md(settings.run_ttl_hours, settings.max_runs_per_user, settings.user_quota_bytes)
        identity = gr.BrowserState(None, storage_key="vptq-studio-identity", secret=settings.browser_secret)
        gr.Markdown(f"# {TITLE}\nExtreme low-bit quantization of LLMs — VPTQ vector quantization, LRQ, GPTQ and "
                    "RTN — in the browser: quantize, watch where the error goes, chat with the result next to the "
                    f"original, take the packed weights home. <span class='vq-note'>Jobs run on "
                    f"**{settings.device}**. "
                    f"{retention}</span>", elem_classes="vq-header", elem_id="vq-header")
        guard = gr.HTML(views.guard_html(False, False), elem_id="vq-guard", container=False)
        groups: dict[gr.Group, tuple[str, ...]] = {}  # a group of fields -> its field keys (visibility)
        with gr.Tabs():
            with gr.Tab("Quantize", id="quantize"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1, min_width=340):
                        model = gr.Dropdown(MODEL_CHOICES, value=default_model, label="Model", elem_id="model")
                        custom_model = gr.Textbox(value=custom_default, label="hub id or local directory",
                                                  placeholder="e.g. HuggingFaceTB/SmolLM2-360M-Instruct or a path",
                                                  visible=default_model == form.OTHER_MODEL, elem_id="custom-model")
                        model_note = gr.Markdown(app.model_note(default_model, custom_default),
                                                 elem_classes="vq-note")
                        method = gr.Radio([(m.label, m.name) for m in method_list], value=method_list[0].name,
                                          label="Method")
                        preset = gr.Radio([*form.preset_names(), CUSTOM],
                                          value=CUSTOM if small else form.DEFAULT_PRESET, label="Preset",
                                          elem_id="preset")
                        with gr.Accordion("Advanced settings", open=False):
                            panel_fields, panel_groups = settings_panel(initial, method.value)
                            fields.update(panel_fields)
                            groups.update(panel_groups)
                            gr.Markdown("**Calibration**")
                            calib_source = gr.Radio([WIKI_SOURCE, FILE_SOURCE], value=WIKI_SOURCE,
                                                    label="calibration text")
                            calib_file = gr.File(label="calibration .txt (UTF-8)", file_types=[".txt"],
                                                 visible=False, height=90)
                            with gr.Row():
                                calib_samples = gr.Number(samples0, precision=0, label=labels["samples"])
                                calib_seqlen = gr.Number(seqlen0, precision=0, label=labels["seqlen"])
                            fields.update(calibration_settings(initial))
                        estimate_box = gr.Markdown(elem_id="estimate")
                        with gr.Row():
                            start_btn = gr.Button("Start", variant="primary", elem_id="start-btn")
                            cancel_btn = gr.Button("Cancel", variant="stop", elem_id="cancel-btn")
                            resume_btn = gr.Button("Resume", elem_id="resume-btn")  # a run a restart cut off
                    with gr.Column(scale=2, min_width=480):
                        job_id = gr.Textbox(label="Job", interactive=False, max_lines=1, elem_id="job-id")
                        progress = gr.HTML(views.progress_html(None), elem_id="job-progress")
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
                        eval_box = gr.Markdown(elem_id="eval-result", min_height=40)
                        with gr.Accordion("Push to your Hugging Face repo", open=False):
                            push_note = gr.Markdown(elem_id="push-note")
                            if os.environ.get("SPACE_ID"):
                                gr.LoginButton()
                            with gr.Row():
                                push_repo = gr.Textbox(label="repo (your-name/repo-name)", scale=3)
                                push_private = gr.Checkbox(True, label="private", scale=1)
                            push_token = gr.Textbox(label="write token (not needed after signing in on Spaces)",
                                                    type="password")
                            push_btn = gr.Button("Push this run", elem_id="push-btn")
                with gr.Accordion("Your runs: compare settings", open=True):
                    with gr.Row():
                        runs_table = gr.Dataframe(headers=plots.RUN_COLUMNS, value=[], interactive=False,
                                                  max_height=260, show_label=False, scale=3, elem_id="runs-table")
                        runs_plot = gr.Plot(plots.runs_figure([]), show_label=False, scale=2, elem_id="runs-plot")
                    with gr.Row(equal_height=True):
                        runs_btn = gr.Button("Refresh runs", size="sm", scale=1)
                        delete_pick = gr.Dropdown([], value=None, label="run to delete", scale=3,
                                                  allow_custom_value=True, elem_id="delete-pick")
                        delete_btn = gr.Button("Delete the run and its files", size="sm", variant="stop", scale=1,
                                               elem_id="delete-btn")
                with gr.Accordion("Raw job status (JSON)", open=False):
                    job_json = gr.JSON(label="job", elem_id="job-json")
                    status_btn = gr.Button("Refresh with every layer report", size="sm")
                    download_api = gr.Button("api: download", visible=False)
                    upload_api = gr.Button("api: upload", visible=False)
            with gr.Tab("Chat", id="chat"):
                with gr.Row(equal_height=True):
                    chat_run = gr.Dropdown([], value=None, label="Quantized run", allow_custom_value=True, scale=3,
                                           elem_id="chat-run")
                    archive_upload = gr.File(label="…or load a packed checkpoint (.zip)", file_types=[".zip"],
                                             scale=2, height=110, elem_id="archive-upload")
                with gr.Row(equal_height=False, elem_classes="vq-eval-row"):
                    models_box = gr.Markdown(views.NO_RUN, elem_id="chat-models")
                    run_eval_btn = gr.Button("Evaluate this run vs the original", size="md", scale=0,
                                             min_width=260, elem_id="chat-eval-btn")
                run_eval_box = gr.Markdown(elem_id="chat-eval-result", min_height=40)
                gr.Markdown(views.CHAT_SPEED_NOTE, elem_classes="vq-note", elem_id="chat-speed-note")
                with gr.Row(equal_height=True):
                    with gr.Column(elem_classes="vq-chat-col"):
                        gr.Markdown("#### Original model")
                        chat_orig = gr.Chatbot(label="Original model", show_label=False, height=380,
                                               elem_id="chat-original", buttons=["copy"])
                        stats_orig = gr.Markdown(elem_classes="vq-stats", elem_id="stats-original")
                        stop_orig_btn = gr.Button("Stop the original", size="sm", elem_id="chat-stop-original")
                    with gr.Column(elem_classes="vq-chat-col"):
                        gr.Markdown("#### Quantized model")
                        chat_quant = gr.Chatbot(label="Quantized model", show_label=False, height=380,
                                                elem_id="chat-quantized", buttons=["copy"])
                        stats_quant = gr.Markdown(elem_classes="vq-stats", elem_id="stats-quantized")
                        stop_quant_btn = gr.Button("Stop the quantized", size="sm", elem_id="chat-stop-quantized")
                with gr.Row(equal_height=True):
                    prompt = gr.Textbox(placeholder=f"Ask both models something… (at most "
                                                    f"{settings.max_prompt_tokens} tokens with the conversation)",
                                        show_label=False, scale=5, elem_id="chat-prompt", max_lines=4,
                                        max_length=4 * settings.max_prompt_tokens)
                    send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
                    stop_btn = gr.Button("Stop both", variant="stop", scale=1, elem_id="chat-stop")
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
        upload_state = gr.State("")
        app.field_keys = tuple(fields)

        calib_inputs = [calib_source, calib_file, calib_samples, calib_seqlen]

        # Identity: the browser's lasting id comes back from its local storage; its runs come back with it.
        demo.load(app.attach, inputs=identity,
                  outputs=[identity, job_id, poll_state, timer, eval_box, runs_table, runs_plot, chat_run,
                           delete_pick, guard], api_visibility="private", show_progress="hidden")
        demo.load(app.hub_status, outputs=[push_note, push_btn], api_visibility="private", show_progress="hidden")

        # Settings: presets fill the fields they fix; editing a field by hand switches the preset to "custom".
        def apply_preset(method: str, preset: str, model: str | None = None,
                         custom_model: str | None = None) -> list:  # (the parameter names are the API's)
            return app.preset_form(method, preset, model, custom_model)

        def show_groups(method_name: str) -> list:
            return [gr.Group(visible=form.uses(method_name, keys)) for keys in groups.values()]

        gr.on([method.change, preset.change], apply_preset, inputs=[method, preset, model, custom_model],
              outputs=list(fields.values()),
              api_name="preset", show_progress="hidden")
        method.change(show_groups, inputs=method, outputs=list(groups), api_visibility="private",
                      show_progress="hidden")
        fixed = {key for m in method_list for p in m.presets for key in form.preset_values(m.name, p, fields)}
        for key in [k for k in fields if k in fixed]:
            fields[key].input(lambda: CUSTOM, outputs=preset, api_visibility="private", show_progress="hidden")
        calib_source.change(lambda s: gr.File(visible=s == FILE_SOURCE), inputs=calib_source, outputs=calib_file,
                            api_visibility="private", show_progress="hidden")
        model.change(lambda m: gr.Textbox(visible=m == form.OTHER_MODEL), inputs=model, outputs=custom_model,
                     api_visibility="private", show_progress="hidden")
        model_events = [model.change, custom_model.submit, custom_model.blur]
        gr.on(model_events, app.model_note, inputs=[model, custom_model], outputs=model_note, api_name="model_note",
              concurrency_limit=4, show_progress="hidden")
        gr.on(model_events, app.model_defaults, inputs=[model, custom_model, method, preset],
              outputs=[preset, calib_samples, calib_seqlen, *fields.values()], api_name="model_defaults",
              concurrency_limit=4, show_progress="hidden", trigger_mode="always_last")
        model_inputs = [model, custom_model, method]
        gr.on([demo.load] + [c.change for c in [*model_inputs, calib_samples, calib_seqlen, *fields.values()]],
              app.estimate_md, inputs=[*model_inputs, calib_samples, calib_seqlen], inputs_kwargs=fields,
              outputs=[estimate_box, start_btn], api_name="estimate", trigger_mode="always_last",
              show_progress="hidden", concurrency_limit=4)

        live_outputs = [job_id, progress, lines_plot, heat_plot, table, summary, download_btn, eval_box, poll_state,
                        timer, job_json, guard]
        # A refused Start shows its reason and touches no output (check_start has none).
        start_btn.click(app.check_start, inputs=[*model_inputs, *calib_inputs], inputs_kwargs=fields,
                        api_visibility="private", show_progress="hidden", concurrency_limit=4).success(
            app.start, inputs=[*model_inputs, *calib_inputs], inputs_kwargs=fields, outputs=live_outputs,
            api_name="start", concurrency_limit=4, show_progress="hidden")
        resume_btn.click(app.resume, inputs=job_id, outputs=live_outputs, api_name="resume", concurrency_limit=4,
                         show_progress="hidden")
        cancel_btn.click(app.cancel, inputs=job_id, outputs=[progress, job_json], api_name="cancel",
                         concurrency_limit=None, show_progress="hidden")
        timer.tick(app.poll, inputs=[job_id, poll_state],
                   outputs=[progress, lines_plot, heat_plot, table, summary, download_btn, runs_table, runs_plot,
                            chat_run, delete_pick, job_json, poll_state, guard, timer],
                   api_name="poll", show_progress="hidden", concurrency_limit=None)
        status_btn.click(app.job_status, inputs=job_id, outputs=job_json, api_name="job_status",
                         concurrency_limit=None)
        download_api.click(app.download, inputs=job_id, outputs=download_btn, api_name="download")
        download_btn.click(app.mark_exported, inputs=job_id, outputs=guard, api_visibility="private",
                           show_progress="hidden")
        eval_btn.click(_gpu(app.evaluate, 300), inputs=[job_id, eval_windows, eval_seqlen],
                       outputs=[eval_box, runs_table, runs_plot, job_json, download_btn], api_name="evaluate",
                       concurrency_limit=1, concurrency_id="evaluate", show_progress_on=[eval_box])
        run_eval_btn.click(_gpu(app.evaluate_run, 300), inputs=[chat_run, eval_windows, eval_seqlen],
                           outputs=[run_eval_box, runs_table, runs_plot], api_name="evaluate_run",
                           concurrency_limit=1, concurrency_id="evaluate", show_progress_on=[run_eval_box])
        runs_btn.click(app.runs, outputs=[runs_table, runs_plot], api_name="runs")
        delete_btn.click(app.delete_run, inputs=[delete_pick, job_id],
                         outputs=[runs_table, runs_plot, chat_run, delete_pick, guard, download_btn, summary,
                                  progress, job_id], api_name="delete_run", show_progress="hidden")
        push_btn.click(app.push, inputs=[job_id, push_repo, push_private, push_token], outputs=[push_note, guard],
                       api_name="push", concurrency_limit=2)

        # Upload: checked and unpacked first (no outputs, so a refusal marks nothing), then shown.
        uploaded = archive_upload.upload(app.upload_run, inputs=archive_upload, outputs=upload_state,
                                         api_visibility="private", concurrency_limit=2, show_progress="hidden")
        uploaded.success(app.upload_view, inputs=upload_state,
                         outputs=[chat_run, models_box, runs_table, runs_plot, delete_pick, archive_upload, guard],
                         api_visibility="private", show_progress="hidden")
        uploaded.failure(lambda: None, outputs=archive_upload, api_visibility="private", show_progress="hidden")
        upload_api.click(app.upload, inputs=archive_upload, outputs=[chat_run, models_box, runs_table, runs_plot],
                         api_name="upload", concurrency_limit=2)
        chat_run.change(app.chat_load, inputs=chat_run,
                        outputs=[models_box, chat_orig, chat_quant, stats_orig, stats_quant], api_name="chat_load",
                        concurrency_limit=2)
        chat_inputs = [prompt, chat_orig, chat_quant, chat_run, temperature, top_p, max_new_tokens]
        chat_outputs = [chat_orig, chat_quant, stats_orig, stats_quant, prompt]
        chat_fn = _gpu(app.chat, 120)
        gr.on([send_btn.click, prompt.submit], chat_fn, inputs=chat_inputs, outputs=chat_outputs, api_name="chat",
              concurrency_limit=settings.chat_concurrency, concurrency_id="chat", show_progress="hidden")
        stop_btn.click(app.chat_stop, api_name="chat_stop", concurrency_limit=None)
        stop_orig_btn.click(app.chat_stop_original, api_name="chat_stop_original", concurrency_limit=None)
        stop_quant_btn.click(app.chat_stop_quantized, api_name="chat_stop_quantized", concurrency_limit=None)
        clear_btn.click(app.chat_clear, outputs=[chat_orig, chat_quant, stats_orig, stats_quant], api_name="chat_clear")
        demo.unload(app.on_unload)
    # Short handlers run a few at a time; quantization itself is limited by the job manager, chat and
    # evaluation by their own limits above.
    demo.queue(default_concurrency_limit=2, max_size=64)
    return demo


def launch_options(settings: AppSettings) -> dict:
    """Keyword arguments for ``demo.launch``: theme and CSS, the leave-page warning, and no file path of the work
    directory served (it is blocked; downloads are per-request copies in Gradio's cache, see ``Studio``)."""
    return {
        "theme": gr.themes.Soft(primary_hue="indigo"),
        "css_paths": [str(ASSETS / "app.css")],
        "head": LEAVE_GUARD_JS,
        "blocked_paths": [str(settings.workdir)],
        "max_file_size": settings.max_upload_bytes,
        "show_error": True,
        "footer_links": ["api"],
    }


def _env_limit(name: str, kind: str, default):
    """One limit from its environment variable (MB for sizes), or ``default``; SystemExit naming it when bad."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"{name} must be a number, got {raw!r}") from None
    if not value > 0:
        raise SystemExit(f"{name} must be positive, got {raw!r}")
    if kind == "MB":
        return int(value * 1e6)
    if kind == "int":
        if not value.is_integer():
            raise SystemExit(f"{name} must be a whole number, got {raw!r}")
        return int(value)
    return value


def settings_from(args: argparse.Namespace) -> AppSettings:
    workdir = args.workdir or os.environ.get("VPTQ_APP_WORKDIR")
    cleanup = False
    if not workdir:
        workdir, cleanup = tempfile.mkdtemp(prefix="vptq_app_"), True
    default_model = TINY if args.tiny else (args.default_model or os.environ.get("VPTQ_APP_DEFAULT_MODEL") or BUNDLED)
    defaults = AppSettings(workdir=Path(workdir))
    limits = {key: _env_limit(env, kind, getattr(defaults, key)) for key, (env, kind) in LIMITS.items()}
    device = default_device()
    # Evaluating a quantized model on 2 CPU cores costs tens of seconds per 512-token window: keep it modest.
    return AppSettings(workdir=Path(workdir).resolve(), default_model=default_model, device=device,
                       cleanup_workdir=cleanup, eval_windows=4 if device == "cpu" else 16,
                       browser_secret=os.environ.get("VPTQ_APP_SECRET") or None, **limits)


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
    warm_up_kernels()  # build (or load the cached build of) the native CPU kernels in the background
    demo.launch(server_name=args.host, server_port=args.port, **launch_options(settings))


def _warm_up(name: str) -> None:
    try:
        model_info(name)
    except ValueError:
        pass  # the page shows the reason when the model is picked


if __name__ == "__main__":
    main()
