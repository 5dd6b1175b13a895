"""Plotly figures and tables for the app: where the quantization error goes, and how runs compare.

Inputs are ``LayerReport`` objects or their ``to_dict()`` form; nothing here computes metrics, it only lays
out what the pipeline reported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import plotly.graph_objects as go

# Usual order of the projections inside a llama-style block; unknown names follow in first-seen order.
MODULE_ORDER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
REPORT_COLUMNS = ["block", "module", "shape (out×in)", "rel. proxy error", "rel. weight error",
                  "block output error", "index bits", "total bits", "seconds"]
RUN_COLUMNS = ["run", "model", "method", "settings", "index bits", "total bits", "checkpoint MB", "minutes",
               "perplexity", "original ppl", "KL", "top-1 agree %"]
# The protocol of the table's perplexity, KL and top-1 columns (the app's "Evaluate vs the original").
RUNS_PROTOCOL = ("perplexity, KL and top-1: the run against its original on the test split of the bundled Wikipedia "
                 "(documents no calibration uses), windows spread over it")
_HEIGHT = 340
_MARGIN = dict(l=60, r=20, t=50, b=45)


def _as_dict(report) -> dict:
    return report if isinstance(report, dict) else report.to_dict()


def module_types(reports: Iterable) -> list[str]:
    """Module names inside a block (e.g. "mlp.down_proj") present in ``reports``, in block order."""
    seen = []
    for r in map(_as_dict, reports):
        if r["module"] not in seen:
            seen.append(r["module"])
    known = [m for m in MODULE_ORDER if m in seen]
    return known + [m for m in seen if m not in known]


def short_module(name: str) -> str:
    """"self_attn.q_proj" -> "q_proj" (the legend and heatmap label)."""
    return name.rpartition(".")[2]


def proxy_error_figure(reports: Sequence, num_blocks: int | None = None, title: str | None = None) -> go.Figure:
    """Relative proxy error tr(ΔW H ΔWᵀ)/tr(W H Wᵀ) per block, one line per module type (log scale), plus
    the relative output error of each finished block (dashed)."""
    rows = [_as_dict(r) for r in reports]
    fig = go.Figure()
    for module in module_types(rows):
        points = sorted((r["block"], r["rel_proxy_loss"]) for r in rows if r["module"] == module)
        fig.add_trace(go.Scatter(
            x=[b for b, _ in points], y=[_positive(v) for _, v in points], mode="lines+markers",
            name=short_module(module), hovertemplate="block %{x}<br>" + module + "<br>%{y:.3g}<extra></extra>",
        ))
    block_err: dict[int, float] = {}
    for r in rows:
        if r.get("rel_output_error") is not None:
            block_err[r["block"]] = r["rel_output_error"]
    if block_err:
        blocks = sorted(block_err)
        fig.add_trace(go.Scatter(
            x=blocks, y=[_positive(block_err[b]) for b in blocks], mode="lines", name="block output",
            line=dict(dash="dash", color="black", width=1.5),
            hovertemplate="block %{x}<br>block output error %{y:.3g}<extra></extra>",
        ))
    fig.update_layout(
        title=title or "Relative proxy error per module (log scale)", height=_HEIGHT, margin=_MARGIN,
        legend=dict(orientation="v", yanchor="top", y=1.0, xanchor="left", x=1.01, font=dict(size=11)),
        xaxis_title="block", yaxis_title="relative error", template="plotly_white",
    )
    fig.update_yaxes(type="log", exponentformat="power")
    if num_blocks:
        fig.update_xaxes(range=[-0.5, num_blocks - 0.5])
    if not rows:
        _placeholder(fig, "waiting for the first layer…")
    return fig


def error_heatmap_figure(reports: Sequence, num_blocks: int | None = None, modules: Sequence[str] | None = None,
                         title: str | None = None) -> go.Figure:
    """Heatmap of log10 relative proxy error: module (rows) × block (columns); cells not done yet are blank."""
    rows = [_as_dict(r) for r in reports]
    modules = list(modules) if modules else module_types(rows)
    blocks = num_blocks if num_blocks else (max((r["block"] for r in rows), default=-1) + 1)
    z = [[None] * blocks for _ in modules]
    text = [[""] * blocks for _ in modules]
    index = {m: i for i, m in enumerate(modules)}
    for r in rows:
        if r["module"] in index and 0 <= r["block"] < blocks:
            i, b = index[r["module"]], r["block"]
            z[i][b] = math.log10(_positive(r["rel_proxy_loss"]))
            text[i][b] = f"{r['rel_proxy_loss']:.3g}"
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(blocks)), y=[short_module(m) for m in modules], text=text, colorscale="Viridis",
        hovertemplate="block %{x} · %{y}<br>rel. proxy error %{text}<extra></extra>", hoverongaps=False,
        colorbar=dict(title=dict(text="log10", side="right"), thickness=12),
    ))
    fig.update_layout(title=title or "Where the error goes: log10 relative proxy error", height=_HEIGHT,
                      margin=_MARGIN, xaxis_title="block", template="plotly_white")
    fig.update_yaxes(autorange="reversed")
    if not rows:
        _placeholder(fig, "waiting for the first layer…")
    return fig


def runs_figure(runs: Sequence[dict], title: str | None = None) -> go.Figure:
    """Each evaluated run's perplexity as a ratio to its own original model's (1 = the original; runs of
    different models share the axis fairly) against total bits per weight, one marker per run, grouped by
    method. ``runs``: dicts with "label", "method", "total_bits", "perplexity", "reference_perplexity" and
    optionally "model". Runs evaluated without their original (no reference) are left out, and counted in a
    note."""
    evaluated = [r for r in runs if r.get("perplexity") is not None and r.get("total_bits") is not None]
    plotted = [r for r in evaluated if r.get("reference_perplexity")]
    fig = go.Figure()
    for method in dict.fromkeys(r["method"] for r in plotted):
        group = [r for r in plotted if r["method"] == method]
        fig.add_trace(go.Scatter(
            x=[r["total_bits"] for r in group], y=[r["perplexity"] / r["reference_perplexity"] for r in group],
            mode="markers+text", text=[r["label"] for r in group], textposition="top center",
            name=method.upper(), marker=dict(size=11), cliponaxis=False,
            customdata=[[r.get("model") or "?", r["perplexity"], r["reference_perplexity"]] for r in group],
            hovertemplate=("%{text} · %{customdata[0]}<br>%{x:.3f} bits/weight<br>ppl %{customdata[1]:.3f} / "
                           "original %{customdata[2]:.3f} = %{y:.3f}<extra></extra>"),
        ))
    if plotted:
        fig.add_hline(y=1.0, line_dash="dash", line_color="gray", annotation_text="original model",
                      annotation_position="bottom right")
    fig.update_layout(title=title or "Runs: perplexity ÷ its original model's, vs bits per weight", height=_HEIGHT,
                      margin=_MARGIN, xaxis_title="total bits per weight (incl. codebooks)",
                      yaxis_title="perplexity ratio to the original", template="plotly_white")
    if not plotted:
        _placeholder(fig, "evaluate a finished run to add it here")
    elif len(plotted) < len(evaluated):
        fig.add_annotation(text=f"{len(evaluated) - len(plotted)} run(s) evaluated without their original: not "
                                "shown", showarrow=False, xref="paper", yref="paper", x=0, y=1.08, xanchor="left",
                           font=dict(size=11, color="gray"))
    return fig


def report_rows(reports: Sequence) -> list[list]:
    """Rows for the per-layer table (columns ``REPORT_COLUMNS``), newest first."""
    rows = []
    for r in map(_as_dict, reversed(list(reports))):
        out_err = r.get("rel_output_error")
        rows.append([
            r["block"], r["module"], f"{r['out_features']}×{r['in_features']}", _sig(r["rel_proxy_loss"]),
            _sig(r["rel_weight_error"]), "" if out_err is None else _sig(out_err), round(r["index_bits"], 3),
            round(r["total_bits"], 3), round(r["seconds"], 2),
        ])
    return rows


def _sig(value: float) -> float:
    return float(f"{value:.4g}")


def _positive(value: float) -> float:
    # Log axes cannot show 0 (an exactly representable layer); clamp far below any real error.
    return max(float(value), 1e-12)


def _placeholder(fig: go.Figure, message: str) -> None:
    fig.add_annotation(text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(size=14, color="gray"))
