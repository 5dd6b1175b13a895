"""The bit plan of a run whose bits per layer were planned by measured sensitivity (VPTQ ``allocation
"sensitivity"``, the "2.5 bits" / "3.5 bits" presets): where it is (the job while it runs, the run's report after),
its plot (projection × block, coloured by total bits per weight) and its lines in the model card.

The plan reaches the job as soon as it is measured, before the first block (``api.quantize_to_dir(on_metrics=)`` →
``JobContext.on_metrics`` → ``extras["model_metrics"]["allocation"]``), and the report keeps it in
``summary.model_metrics.allocation.layers`` as ``[module name, vector_len, num_centroids, total bits]``."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import gradio as gr
import plotly.graph_objects as go

from . import plots
from .services import Shared

PHASE = "allocation"  # the plan hook's phase (quant/vptq.py)
_BLOCK = re.compile(r"\.(\d+)\.(.+)$")


def plan_of(metrics: Mapping | None) -> list[dict]:
    """The plan in ``model_metrics`` (a run's ``summary["model_metrics"]`` or the job's extras): per layer
    {"block", "module", "vector_len", "num_centroids", "index_bits", "total_bits"}; [] when there is none."""
    allocation = (metrics or {}).get(PHASE) or {}
    layers = []
    for entry in allocation.get("layers") or []:
        if not (isinstance(entry, list | tuple) and len(entry) == 4):
            continue
        name, v, k, bits = entry
        found = _BLOCK.search(str(name))
        if not found or not v or not k:
            continue
        layers.append({"block": int(found.group(1)), "module": found.group(2), "vector_len": int(v),
                       "num_centroids": int(k), "index_bits": math.log2(k) / v, "total_bits": float(bits)})
    return layers


def snapshot_metrics(snap) -> Mapping:
    """The model metrics of a job holding its plan: its result's once it is done, its extras while it runs."""
    if snap is None:
        return {}
    done = ((snap.result or {}).get("summary") or {}).get("model_metrics") or {}
    return done if plan_of(done) else snap.extras.get("model_metrics") or {}


def report_plan(report: Mapping) -> list[dict]:
    """The plan kept in a ``quant_report.json``."""
    return plan_of(((report or {}).get("summary") or {}).get("model_metrics"))


def bit_plan_figure(layers: list[dict], total_bits: float | None = None, title: str | None = None) -> go.Figure:
    """Total bits per weight the plan gives each layer: projection (rows) × block (columns), each cell labelled
    with its vector length and codebook size (on the cells while they are wide enough, else on hover);
    ``total_bits``: the plan's bits per weight over the whole model, for the title."""
    modules = plots.module_types(layers)
    blocks = max((r["block"] for r in layers), default=-1) + 1
    z = [[None] * blocks for _ in modules]
    text = [[""] * blocks for _ in modules]
    for r in layers:
        i = modules.index(r["module"])
        z[i][r["block"]] = r["total_bits"]
        text[i][r["block"]] = f"v{r['vector_len']} k{r['num_centroids']}"
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(blocks)), y=[plots.short_module(m) for m in modules], text=text, colorscale="Cividis",
        texttemplate="%{z:.2f} · %{text}" if blocks <= 8 else None, textfont=dict(size=11),
        hovertemplate="block %{x} · %{y}<br>%{z:.3f} bits/weight · %{text}<extra></extra>", hoverongaps=False,
        colorbar=dict(title=dict(text="bits", side="right"), thickness=12),
    ))
    whole = f" ({total_bits:.3f} over the model)" if total_bits else ""
    fig.update_layout(title=title or f"Bit plan by sensitivity: total bits per weight of each layer{whole}",
                      height=300, margin=dict(l=60, r=20, t=50, b=45), xaxis_title="block", template="plotly_white")
    fig.update_xaxes(tickmode="linear", dtick=1 if blocks <= 32 else 4)
    fig.update_yaxes(autorange="reversed")
    return fig


def plan_total_bits(metrics: Mapping | None) -> float | None:
    """The plan's total bits per weight over the whole model (weighted by each layer's size)."""
    value = ((metrics or {}).get(PHASE) or {}).get("total_bits")
    return float(value) if isinstance(value, int | float) else None


def card_lines(report: Mapping) -> list[str]:
    """The model card's "Bit plan" section: one row per block, total bits per weight (vector length / codebook
    size) per projection; [] for a run without a plan."""
    layers = report_plan(report)
    if not layers:
        return []
    modules = plots.module_types(layers)
    by = {(r["block"], r["module"]): r for r in layers}
    lines = ["## Bit plan", "",
             "Bits per layer planned from measured sensitivity: total bits per weight (vector length v, codebook "
             "size k) of each projection.", "",
             "| block | " + " | ".join(plots.short_module(m) for m in modules) + " |",
             "|---|" + "---|" * len(modules)]
    for block in sorted({r["block"] for r in layers}):
        cells = [f"{r['total_bits']:.2f} (v{r['vector_len']} k{r['num_centroids']})" if (r := by.get((block, m)))
                 else "–" for m in modules]
        lines.append(f"| {block} | " + " | ".join(cells) + " |")
    return [*lines, ""]


class BitPlanView:
    """The job view's plot of the watched job's plan: shown once the plan is measured, hidden for runs without."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def show(self, job_id: str, shown: str | None, request: gr.Request):
        """(plot update, what it shows now); ``gr.skip()`` while the same plan (or none) is already shown."""
        snap = None
        if job_id:
            try:
                snap = self.shared.manager.get(job_id, self.shared.owner(request), reports=False)
            except ValueError:
                snap = None
        metrics = snapshot_metrics(snap)
        layers = plan_of(metrics)
        key = f"{job_id}:{len(layers)}" if layers else ""
        if key == (shown or ""):
            return gr.skip(), shown
        if not layers:
            return gr.Plot(visible=False), ""
        return gr.Plot(bit_plan_figure(layers, plan_total_bits(metrics)), visible=True), key
