"""The app's page: the header, the Quantize and Chat tabs laid out by the ``ui_*`` modules, and the events that
connect them to the handlers (``handlers.Studio``). ``app.py`` builds it (``build_app``) and launches it."""

from __future__ import annotations

import gradio as gr

from ..models import TINY
from . import ui_chat, ui_compare, ui_divergence, ui_job, ui_runs, ui_settings, views
from .app_settings import AppSettings
from .browser_secret import stored_secret
from .handlers import Studio
from .ui_page import Page

TITLE = "VPTQ Studio"


def build_blocks(settings: AppSettings, studio: Studio, examples: list[list[str]] | None = None) -> gr.Blocks:
    """The Gradio Blocks of the studio, queued; ``demo.studio`` is ``studio`` and ``demo.settings_form`` the
    form's components by field. ``examples``: prompts offered in the Chat tab."""
    with gr.Blocks(title=TITLE, analytics_enabled=False, delete_cache=(1800, 3600)) as demo:
        page = Page(settings=settings, studio=studio, small=settings.default_model == TINY, demo=demo)
        identity = gr.BrowserState(None, storage_key="vptq-studio-identity",
                                   secret=settings.browser_secret or stored_secret(settings.workdir))
        header(settings)
        guard = gr.HTML(views.guard_html(False, False), elem_id="vq-guard", container=False)
        page.update(identity=identity, guard=guard)
        with gr.Tabs():
            with gr.Tab("Quantize", id="quantize"):
                with gr.Row(equal_height=False):
                    ui_settings.settings_column(page)
                    ui_job.job_column(page)
                ui_runs.runs_section(page)
                ui_runs.raw_status_section(page)
            with gr.Tab("Chat", id="chat"):
                ui_chat.chat_tab(page, examples or [])
                ui_divergence.divergence_section(page)
            with gr.Tab("Compare runs", id="compare"):
                ui_compare.compare_tab(page)
        page.update(timer=gr.Timer(1.0, active=False), poll_state=gr.State({}), upload_state=gr.State(""))
        demo.studio = studio
        demo.settings_form = page.fields  # one component per form field, keyed by the setting (see studio.form)
        studio.quantize_form.field_keys = tuple(page.fields)
        wire_page(page)
        ui_settings.wire_settings(page)
        ui_job.wire_job(page)
        ui_job.wire_plan(page)
        ui_runs.wire_runs(page)
        ui_chat.wire_upload(page)
        ui_chat.wire_chat(page)
        ui_divergence.wire_divergence(page)
        ui_compare.wire_compare(page)
    # Short handlers run a few at a time; quantization itself is limited by the job manager, chat and
    # evaluation by their own limits.
    demo.queue(default_concurrency_limit=2, max_size=64)
    return demo


def header(settings: AppSettings) -> None:
    retention = views.retention_md(settings.run_ttl_hours, settings.max_runs_per_user, settings.user_quota_bytes)
    gr.Markdown(f"# {TITLE}\nExtreme low-bit quantization of LLMs — VPTQ vector quantization, LRQ, GPTQ and "
                "RTN — in the browser: quantize, watch where the error goes, chat with the result next to the "
                f"original, take the packed weights home. <span class='vq-note'>Jobs run on "
                f"**{settings.device}**. "
                f"{retention}</span>", elem_classes="vq-header", elem_id="vq-header")


def wire_page(page: Page) -> None:
    """The browser's lasting identity comes back from its local storage, and its runs with it; whether pushing
    to the hub can work; a page that goes away stops its chats."""
    p, studio = page, page.studio
    p.demo.load(studio.pages.attach, inputs=p.identity,
                outputs=[p.identity, p.job_id, p.poll_state, p.timer, p.eval_box, p.runs_table, p.runs_plot,
                         p.chat_run, p.delete_pick, p.guard], api_visibility="private", show_progress="hidden")
    p.demo.load(studio.hub.status, outputs=[p.push_note, p.push_btn], api_name="hub_status",
                api_visibility="private", show_progress="hidden")
    p.demo.unload(studio.pages.on_unload)
