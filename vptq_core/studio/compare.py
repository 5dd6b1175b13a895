"""Compare runs: two or more of a browser's finished runs in one view, their bits, size, perplexity, KL
statistics, top-1 agreement and decode speed as a table (one column per run, "–" where a run has no such number),
and their per-layer errors and bits overlaid, one plotly figure per metric with one trace per run.

Pure functions of job snapshots (``rows``, ``figures``) and the handler the page calls (``Compare``)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go

from . import plots, views
from .job import JobSnapshot
from .services import Shared

MISSING = "–"
MAX_RUNS = 6  # runs one view compares (every trace stays readable)


def _fixed(digits: int) -> Callable:
    return lambda v: f"{float(v):.{digits}f}"


def _percent(v) -> str:
    return f"{100 * float(v):.1f}%"


def _signed_percent(v) -> str:
    return f"{100 * float(v):+.2f}%"


# (row label, where the number is: "summary", "result", "eval" or "speed", its key, how it is shown)
METRICS = (
    ("index bits / weight", "summary", "index_bits_per_weight", _fixed(3)),
    ("total bits / weight", "summary", "total_bits_per_weight", _fixed(3)),
    ("checkpoint", "result", "checkpoint_bytes", views.mb),
    ("perplexity", "eval", "perplexity", _fixed(3)),
    ("original's perplexity", "eval", "reference_perplexity", _fixed(3)),
    ("KL mean (nats/token)", "eval", "kl_divergence", _fixed(4)),
    ("KL median", "eval", "kl_median", _fixed(4)),
    ("KL p90", "eval", "kl_p90", _fixed(4)),
    ("KL p99", "eval", "kl_p99", _fixed(4)),
    ("KL max", "eval", "kl_max", _fixed(4)),
    ("Δp mean", "eval", "delta_p_mean", _signed_percent),
    ("Δp p01", "eval", "delta_p_p01", _signed_percent),
    ("Δp p99", "eval", "delta_p_p99", _signed_percent),
    ("same top token", "eval", "top1_agreement", _percent),
    ("decode tokens/s (chat)", "speed", "decode_tokens_per_second", _fixed(1)),
)
# per-layer metrics: (report key, figure title, log axis)
LAYER_METRICS = (
    ("rel_proxy_loss", "Relative proxy error per layer", True),
    ("rel_weight_error", "Relative weight error per layer", True),
    ("rel_output_error", "Block output error", True),
    ("total_bits", "Total bits per weight of each layer", False),
)


@dataclass(frozen=True)
class RunView:
    """What the compare view shows of one run."""

    id: str
    label: str
    values: dict  # "summary" / "result" / "eval" / "speed" -> dict
    layers: list[dict]  # per-layer reports (``LayerReport.to_dict()``)


def run_view(snap: JobSnapshot) -> RunView:
    """A finished run's numbers, from its snapshot (with its reports) or, for an uploaded checkpoint, its report."""
    result = snap.result or {}
    summary = result.get("summary") or {}
    method = views.method_label((result.get("method") or summary.get("method") or "?").lower())
    bits = summary.get("total_bits_per_weight")
    label = f"{snap.id[:6]} · {method}" + (f" {bits:.2f}b" if bits else "")
    layers = [dict(r) for r in snap.reports] or _report_layers(result.get("checkpoint_dir"))
    values = {"summary": summary, "result": result, "eval": snap.extras.get("eval") or {},
              "speed": snap.extras.get("chat_speed") or {}}
    return RunView(snap.id, label, values, layers)


def _report_layers(ckpt: str | None) -> list[dict]:
    if not ckpt:
        return []
    try:
        report = json.loads((Path(ckpt) / "quant_report.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []
    layers = report.get("layers") if isinstance(report, dict) else None
    return [r for r in layers if isinstance(r, dict) and "block" in r and "module" in r] if isinstance(layers,
                                                                                                        list) else []


def table(runs: Sequence[RunView]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): one row per metric, one column per run; a number a run does not have is ``MISSING``."""
    headers = ["", *[r.label for r in runs]]
    rows = [["model", *[str(r.values["result"].get("source_model") or MISSING) for r in runs]]]
    for label, where, key, shown in METRICS:
        row = [label]
        for r in runs:
            value = r.values[where].get(key)
            row.append(shown(value) if _number(value) else MISSING)
        rows.append(row)
    speeds = [r.values["speed"] for r in runs]
    if any(s.get("alongside") for s in speeds):
        rows.append(["decode measured", *[("beside another model" if s.get("alongside") else "alone")
                                          if s else MISSING for s in speeds]])
    return headers, rows


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def layer_x(layers: Sequence[dict]) -> list[float]:
    """Where each layer sits on the block axis: block + its module's place in the block (so runs of the same model
    line up layer by layer)."""
    modules = plots.module_types(layers)
    return [r["block"] + modules.index(r["module"]) / len(modules) for r in layers]


def figures(runs: Sequence[RunView]) -> list[go.Figure]:
    """One figure per ``LAYER_METRICS`` entry, one trace per run (a run without per-layer reports: an empty
    trace, so the legend still names it)."""
    out = []
    blocks = max((r["block"] + 1 for run in runs for r in run.layers), default=0)
    for key, title, log in LAYER_METRICS:
        fig = go.Figure()
        for run in runs:
            layers = [r for r in run.layers if _number(r.get(key))]
            if key == "rel_output_error":  # one value per block
                layers = list({r["block"]: r for r in layers}.values())
                xs = [r["block"] for r in layers]
            else:
                xs = layer_x(layers) if layers else []
            ys = [max(float(r[key]), 1e-12) if log else r[key] for r in layers]  # a log axis cannot show 0
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines+markers", name=run.label, marker=dict(size=5),
                text=[f"block {r['block']} · {r['module']}" for r in layers],
                hovertemplate="%{text}<br>%{y:.4g}<extra>" + run.label + "</extra>"))
        fig.update_layout(title=title + (" (log scale)" if log else ""), height=340,
                          margin=dict(l=60, r=20, t=75, b=45), xaxis_title="block", template="plotly_white",
                          legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0, font=dict(size=11)))
        fig.update_xaxes(tickmode="linear", tick0=0, dtick=1 if blocks <= 32 else 4)
        if log:
            fig.update_yaxes(type="log", exponentformat="power")
        if not any(run.layers for run in runs):
            fig.add_annotation(text="pick two or more runs", showarrow=False, xref="paper", yref="paper", x=0.5,
                               y=0.5, font=dict(size=14, color="gray"))
        out.append(fig)
    return out


class Compare:
    """The compare view's handler."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def compare(self, run_ids, request: gr.Request):
        """(table, then one figure per ``LAYER_METRICS`` entry) of the picked runs of the browser."""
        owner = self.shared.owner(request)
        run_ids = [r for r in dict.fromkeys(run_ids or []) if r]
        try:
            if len(run_ids) > MAX_RUNS:
                raise ValueError(f"pick at most {MAX_RUNS} runs to compare, got {len(run_ids)}")
            snaps = [self.shared.manager.get(r, owner) for r in run_ids]
            not_done = [s.id for s in snaps if s.status != "done"]
            if not_done:
                raise ValueError(f"run {not_done[0]} has not finished: only finished runs can be compared")
        except ValueError as exc:
            raise self.shared.error(exc) from None
        runs = [run_view(s) for s in snaps]
        headers, rows = table(runs)
        return (gr.Dataframe(value=rows, headers=headers), *figures(runs))

    def choices(self, picked, request: gr.Request):
        """The picker with the browser's finished runs now (picks that are gone dropped)."""
        _rows, _fig, choices = self.shared.runs_view(self.shared.owner(request))
        ids = {value for _label, value in choices}
        return gr.Dropdown(choices=choices, value=[p for p in (picked or []) if p in ids], multiselect=True)
