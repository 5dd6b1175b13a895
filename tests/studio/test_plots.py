"""Plot builders: every trace, cell and row shows exactly the reported numbers."""

from __future__ import annotations

import math

import pytest

from vptq_core.quant.results import LayerReport
from vptq_core.studio.plots import (
    MODULE_ORDER,
    REPORT_COLUMNS,
    error_heatmap_figure,
    module_types,
    proxy_error_figure,
    report_rows,
    runs_figure,
)


def _reports(blocks: int = 3, finished_blocks: int = 2) -> list[LayerReport]:
    """Deterministic reports: block b, module i has proxy error (i + 1) * 10^-(b + 1)."""
    out = []
    for b in range(blocks):
        for i, module in enumerate(MODULE_ORDER):
            out.append(LayerReport(
                block=b, name=f"model.layers.{b}.{module}", module=module, out_features=64 * (i + 1),
                in_features=64, method="vptq", rel_proxy_loss=(i + 1) * 10.0 ** -(b + 1),
                rel_weight_error=0.5 / (b + 1), index_bits=2.0, total_bits=2.25 + 0.01 * i, seconds=0.1 * i,
                rel_output_error=0.001 * (b + 1) if b < finished_blocks else None,
            ))
    return out


def test_module_types_follow_block_order():
    reports = list(reversed(_reports()))  # arrival order must not matter
    assert module_types(reports) == list(MODULE_ORDER)
    extra = _reports(1)[:1] + [LayerReport(0, "model.layers.0.mlp.extra", "mlp.extra", 4, 4, "rtn", 0.1, 0.1, 4, 5,
                                           0.0)]
    assert module_types(extra) == ["self_attn.q_proj", "mlp.extra"]


def test_proxy_error_lines_match_reports():
    reports = _reports()
    fig = proxy_error_figure(reports, num_blocks=30)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name) == [m.rpartition(".")[2] for m in MODULE_ORDER] + ["block output"]
    for i, module in enumerate(MODULE_ORDER):
        trace = by_name[module.rpartition(".")[2]]
        assert list(trace.x) == [0, 1, 2]
        assert list(trace.y) == pytest.approx([(i + 1) * 10.0 ** -(b + 1) for b in range(3)], rel=1e-12)
    # Only finished blocks have an output error.
    assert list(by_name["block output"].x) == [0, 1]
    assert list(by_name["block output"].y) == pytest.approx([0.001, 0.002])
    assert fig.layout.yaxis.type == "log"
    assert tuple(fig.layout.xaxis.range) == (-0.5, 29.5)
    # The same figure from dicts (the app's snapshots) is identical.
    assert proxy_error_figure([r.to_dict() for r in reports], num_blocks=30) == fig


def test_zero_error_is_kept_visible_on_a_log_axis():
    report = _reports(1)[0]
    report.rel_proxy_loss = 0.0
    fig = proxy_error_figure([report])
    assert fig.data[0].y[0] == 1e-12


def test_heatmap_cells_match_reports_and_pending_cells_are_blank():
    reports = _reports()[:10]  # block 0 complete, block 1 has q/k/v only
    fig = error_heatmap_figure(reports, num_blocks=4, modules=MODULE_ORDER)
    heat = fig.data[0]
    assert list(heat.y) == [m.rpartition(".")[2] for m in MODULE_ORDER]
    assert list(heat.x) == [0, 1, 2, 3]
    z = [list(row) for row in heat.z]
    for r in reports:
        i = MODULE_ORDER.index(r.module)
        assert z[i][r.block] == pytest.approx(math.log10(r.rel_proxy_loss))
        assert heat.text[i][r.block] == f"{r.rel_proxy_loss:.3g}"
    done = {(MODULE_ORDER.index(r.module), r.block) for r in reports}
    blanks = [(i, b) for i in range(7) for b in range(4) if (i, b) not in done]
    assert len(blanks) == 28 - 10
    assert all(z[i][b] is None for i, b in blanks)


def test_runs_figure_plots_each_run_against_its_own_original():
    runs = [
        {"label": "VPTQ 2.3b", "method": "vptq", "total_bits": 2.3, "perplexity": 30.5, "reference_perplexity": 21.4},
        {"label": "GPTQ 2.5b", "method": "gptq", "total_bits": 2.5, "perplexity": 80.25, "reference_perplexity": 21.4},
        {"label": "VPTQ 3.2b", "method": "vptq", "total_bits": 3.2, "perplexity": 23.0, "reference_perplexity": 21.4},
        # Another model with a far higher original perplexity: on a shared perplexity axis it would look worst.
        {"label": "VPTQ 2.0b", "method": "vptq", "total_bits": 2.0, "perplexity": 2400.0,
         "reference_perplexity": 2000.0, "model": "tiny"},
        {"label": "not evaluated", "method": "rtn", "total_bits": 4.5, "perplexity": None},
        {"label": "no original", "method": "rtn", "total_bits": 4.5, "perplexity": 9.0, "reference_perplexity": None},
    ]
    fig = runs_figure(runs)
    traces = {t.name: t for t in fig.data}
    assert list(traces) == ["VPTQ", "GPTQ"]
    assert list(traces["VPTQ"].x) == [2.3, 3.2, 2.0]
    assert list(traces["VPTQ"].y) == pytest.approx([30.5 / 21.4, 23.0 / 21.4, 1.2])
    assert list(traces["VPTQ"].text) == ["VPTQ 2.3b", "VPTQ 3.2b", "VPTQ 2.0b"]
    assert list(traces["GPTQ"].x) == [2.5] and list(traces["GPTQ"].y) == pytest.approx([80.25 / 21.4])
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert len(lines) == 1 and lines[0].y0 == 1.0 == lines[0].y1
    assert "1 run(s) evaluated without their original" in fig.layout.annotations[-1].text
    empty = runs_figure(runs[4:5])
    assert len(empty.data) == 0 and "evaluate a finished run" in empty.layout.annotations[0].text


def test_report_rows_newest_first_with_every_column():
    reports = _reports()
    rows = report_rows(reports)
    assert len(rows) == len(reports) and all(len(r) == len(REPORT_COLUMNS) for r in rows)
    last = reports[-1]  # block 2 down_proj, block not finished
    assert rows[0] == [2, "mlp.down_proj", "448×64", float(f"{last.rel_proxy_loss:.4g}"), 0.1667, "",
                       2.0, 2.31, 0.6]
    first = reports[0]
    assert rows[-1] == [0, "self_attn.q_proj", "64×64", 0.1, 0.5, 0.001, 2.0, 2.25, 0.0]
    assert rows[-1][3] == first.rel_proxy_loss
