"""The Quantize tab's lower sections: the browser's runs (a table and a bits-vs-perplexity plot to compare
settings, delete a run) and the raw job status as JSON (with the buttons that exist for API clients only)."""

from __future__ import annotations

import gradio as gr

from . import plots
from .ui_page import Page


def runs_section(page: Page) -> None:
    with gr.Accordion("Your runs: compare settings", open=True):
        with gr.Row():
            runs_table = gr.Dataframe(headers=plots.RUN_COLUMNS, value=[], interactive=False, max_height=260,
                                      show_label=False, scale=3, elem_id="runs-table")
            runs_plot = gr.Plot(plots.runs_figure([]), show_label=False, scale=2, elem_id="runs-plot")
        gr.Markdown(f"<span class='vq-note'>{plots.RUNS_PROTOCOL}</span>")
        with gr.Row(equal_height=True):
            runs_btn = gr.Button("Refresh runs", size="sm", scale=1)
            delete_pick = gr.Dropdown([], value=None, label="run to delete", scale=3, allow_custom_value=True,
                                      elem_id="delete-pick")
            delete_btn = gr.Button("Delete the run and its files", size="sm", variant="stop", scale=1,
                                   elem_id="delete-btn")
    page.update(runs_table=runs_table, runs_plot=runs_plot, runs_btn=runs_btn, delete_pick=delete_pick,
                delete_btn=delete_btn)


def raw_status_section(page: Page) -> None:
    with gr.Accordion("Raw job status (JSON)", open=False):
        job_json = gr.JSON(label="job", elem_id="job-json")
        status_btn = gr.Button("Refresh with every layer report", size="sm")
        download_api = gr.Button("api: download", visible=False)
        upload_api = gr.Button("api: upload", visible=False)
    page.update(job_json=job_json, status_btn=status_btn, download_api=download_api, upload_api=upload_api)


def wire_runs(page: Page) -> None:
    """The job's JSON, the API's download, refreshing the runs and deleting one."""
    p, studio = page, page.studio
    p.status_btn.click(studio.runs.job_status, inputs=p.job_id, outputs=p.job_json, api_name="job_status",
                       concurrency_limit=None)
    p.download_api.click(studio.downloads.download, inputs=p.job_id, outputs=p.download_btn, api_name="download")
    p.runs_btn.click(studio.runs.list_runs, outputs=[p.runs_table, p.runs_plot], api_name="runs")
    p.delete_btn.click(studio.runs.delete_run, inputs=[p.delete_pick, p.job_id],
                       outputs=[p.runs_table, p.runs_plot, p.chat_run, p.delete_pick, p.guard, p.download_btn,
                                p.summary, p.progress, p.job_id], api_name="delete_run", show_progress="hidden")
