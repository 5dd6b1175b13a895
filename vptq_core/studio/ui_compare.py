"""The Compare tab: pick two or more finished runs and see their numbers side by side and their per-layer errors
overlaid (``compare.Compare``); and its events."""

from __future__ import annotations

import gradio as gr

from . import compare
from .ui_page import Page


def compare_tab(page: Page) -> None:
    gr.Markdown("Pick two or more finished runs: their bits, size, evaluation against the original (perplexity, "
                "KL statistics, how often the top token is the same) and decode speed side by side, and their "
                "per-layer errors overlaid. Evaluate a run (Quantize or Chat tab) to fill in its perplexity and KL; "
                "chat with it to record its decode speed. A number a run does not have is shown as –.",
                elem_classes="vq-note")
    with gr.Row(equal_height=False):
        pick = gr.Dropdown([], value=[], multiselect=True, label="Runs to compare", scale=5,
                           max_choices=compare.MAX_RUNS, elem_id="compare-pick")
        button = gr.Button("Compare", variant="primary", scale=0, min_width=160, elem_id="compare-btn")
    table = gr.Dataframe(value=[], headers=["", "pick runs above"], interactive=False, show_label=False,
                         max_height=720, elem_id="compare-table")
    figures = compare.figures([])
    plots = []
    with gr.Row():
        for i, fig in enumerate(figures[:2]):
            plots.append(gr.Plot(fig, show_label=False, elem_id=f"compare-plot-{i}"))
    with gr.Row():
        for i, fig in enumerate(figures[2:], start=2):
            plots.append(gr.Plot(fig, show_label=False, elem_id=f"compare-plot-{i}"))
    page.update(compare_pick=pick, compare_btn=button, compare_table=table, compare_plots=plots)


def wire_compare(page: Page) -> None:
    """Compare on the button; the picker's runs follow the runs table."""
    p, handler = page, page.studio.compare
    p.compare_btn.click(handler.compare, inputs=p.compare_pick, outputs=[p.compare_table, *p.compare_plots],
                        api_name="compare_runs", concurrency_limit=2)
    gr.on([p.runs_table.change, p.demo.load], handler.choices, inputs=p.compare_pick, outputs=p.compare_pick,
          api_visibility="private", show_progress="hidden")
