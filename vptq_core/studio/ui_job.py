"""The Quantize tab's job column: the watched job's progress, error plots and layer table, its summary and
download, evaluation against the original, and the push to the user's hub repo; and their events (start,
resume, cancel, the timer's poll, download, evaluate, push)."""

from __future__ import annotations

import os

import gradio as gr

from . import plots, views
from .ui_page import Page
from .zerogpu import on_gpu


def job_column(page: Page) -> None:
    settings, small = page.settings, page.small
    with gr.Column(scale=2, min_width=480):
        job_id = gr.Textbox(label="Job", interactive=False, max_lines=1, elem_id="job-id")
        progress = gr.HTML(views.progress_html(None), elem_id="job-progress")
        lines_plot = gr.Plot(plots.proxy_error_figure([]), show_label=False, elem_id="plot-lines")
        heat_plot = gr.Plot(plots.error_heatmap_figure([]), show_label=False, elem_id="plot-heatmap")
        plan_section(page)
        table = gr.Dataframe(headers=plots.REPORT_COLUMNS, value=[], interactive=False, max_height=260,
                             label="Layer reports (newest first)", elem_id="layer-table")
        summary = gr.Markdown(elem_id="job-summary")
        download_btn = gr.DownloadButton("Download the packed checkpoint", visible=False, elem_id="download-btn")
        with gr.Row(equal_height=False, elem_classes="vq-eval-row"):
            eval_windows = gr.Number(2 if small else settings.eval_windows, precision=0, label="evaluation windows",
                                     min_width=120)
            eval_seqlen = gr.Number(64 if small else settings.eval_seqlen, precision=0, label="tokens per window",
                                    min_width=120)
            eval_btn = gr.Button("Evaluate vs the original", elem_id="eval-btn", min_width=200)
        eval_box = gr.Markdown(elem_id="eval-result", min_height=40)
        tasks_section(page)
        with gr.Accordion("Push to your Hugging Face repo", open=False):
            push_note = gr.Markdown(elem_id="push-note")
            if os.environ.get("SPACE_ID"):
                gr.LoginButton()
            with gr.Row():
                push_repo = gr.Textbox(label="repo (your-name/repo-name)", scale=3)
                push_private = gr.Checkbox(True, label="private", scale=1)
            push_token = gr.Textbox(label="write token (not needed after signing in on Spaces)", type="password")
            push_btn = gr.Button("Push this run", elem_id="push-btn")
    page.update(job_id=job_id, progress=progress, lines_plot=lines_plot, heat_plot=heat_plot, table=table,
                summary=summary, download_btn=download_btn, eval_windows=eval_windows, eval_seqlen=eval_seqlen,
                eval_btn=eval_btn, eval_box=eval_box, push_note=push_note, push_repo=push_repo,
                push_private=push_private, push_token=push_token, push_btn=push_btn)


def tasks_section(page: Page) -> None:
    """Standard lm-eval tasks on the watched run and its original."""
    with gr.Accordion("Standard tasks (lm-eval)", open=False):
        with gr.Row(equal_height=False):
            task_names = gr.Textbox(label="lm-eval tasks, comma-separated", placeholder="arc_easy, hellaswag",
                                    scale=3, elem_id="task-names")
            task_limit = gr.Number(20, precision=0, label="documents per task", min_width=120)
            tasks_btn = gr.Button("Run on the run and the original", elem_id="tasks-btn", min_width=200)
        tasks_box = gr.Markdown(elem_id="tasks-result")
    page.update(task_names=task_names, task_limit=task_limit, tasks_btn=tasks_btn, tasks_box=tasks_box)


def wire_tasks(page: Page) -> None:
    page.tasks_btn.click(on_gpu(page.studio.tasks.run, 600), inputs=[page.job_id, page.task_names, page.task_limit],
                         outputs=page.tasks_box, api_name="tasks", concurrency_limit=1, concurrency_id="evaluate",
                         show_progress_on=[page.tasks_box])


def wire_job(page: Page) -> None:
    """Start (checked first), resume, cancel, the timer's poll, download, evaluate and push."""
    p, studio = page, page.studio
    runs = studio.runs
    live_outputs = [p.job_id, p.progress, p.lines_plot, p.heat_plot, p.table, p.summary, p.download_btn, p.eval_box,
                    p.poll_state, p.timer, p.job_json, p.guard]
    start_inputs = [*p.model_inputs, *p.calib_inputs]
    # A refused Start shows its reason and touches no output (check_start has none).
    p.start_btn.click(runs.check_start, inputs=start_inputs, inputs_kwargs=p.fields, api_visibility="private",
                      show_progress="hidden", concurrency_limit=4).success(
        runs.start, inputs=start_inputs, inputs_kwargs=p.fields, outputs=live_outputs, api_name="start",
        concurrency_limit=4, show_progress="hidden")
    p.resume_btn.click(runs.resume, inputs=p.job_id, outputs=live_outputs, api_name="resume", concurrency_limit=4,
                       show_progress="hidden")
    p.cancel_btn.click(runs.cancel, inputs=p.job_id, outputs=[p.progress, p.job_json], api_name="cancel",
                       concurrency_limit=None, show_progress="hidden")
    p.timer.tick(runs.poll, inputs=[p.job_id, p.poll_state],
                 outputs=[p.progress, p.lines_plot, p.heat_plot, p.table, p.summary, p.download_btn, p.runs_table,
                          p.runs_plot, p.chat_run, p.delete_pick, p.job_json, p.poll_state, p.guard, p.timer],
                 api_name="poll", show_progress="hidden", concurrency_limit=None)
    p.download_btn.click(studio.downloads.mark_exported, inputs=p.job_id, outputs=p.guard, api_visibility="private",
                         show_progress="hidden")
    p.eval_btn.click(on_gpu(studio.evaluation.evaluate, 300), inputs=[p.job_id, p.eval_windows, p.eval_seqlen],
                     outputs=[p.eval_box, p.runs_table, p.runs_plot, p.job_json, p.download_btn],
                     api_name="evaluate", concurrency_limit=1, concurrency_id="evaluate",
                     show_progress_on=[p.eval_box])
    wire_tasks(p)
    p.push_btn.click(studio.hub.push, inputs=[p.job_id, p.push_repo, p.push_private, p.push_token],
                     outputs=[p.push_note, p.guard], api_name="push", concurrency_limit=2)


def plan_section(page: Page) -> None:
    """The bit plan of the watched job, shown once it is measured (runs that plan bits by sensitivity)."""
    page.update(plan_plot=gr.Plot(visible=False, show_label=False, elem_id="plot-bit-plan"),
                plan_shown=gr.State(""))


def wire_plan(page: Page) -> None:
    """The plan's plot follows the watched job: on every tick of the job's timer and when another job is shown."""
    p = page
    gr.on([p.timer.tick, p.job_id.change], p.studio.bit_plan.show, inputs=[p.job_id, p.plan_shown],
          outputs=[p.plan_plot, p.plan_shown], api_visibility="private", show_progress="hidden",
          concurrency_limit=None)
