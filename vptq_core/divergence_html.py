"""The per-token divergence (``divergence.Divergence``) as HTML: the text's tokens coloured by KL(original ||
quantized) on a legible scale with its legend, the tokens whose top-1 prediction differs underlined, and on hover
or click (focus) both models' top-5 next tokens with their probabilities. Self-contained: inline CSS, and a few
lines of inline script that only keep a token's details inside the window; nothing is fetched. Every text the
tokenizer or the user gave is HTML-escaped."""

from __future__ import annotations

import html
import math

from .divergence import Divergence, TokenRow

# KL bins (nats): a token whose KL is at least BINS[i] and below BINS[i + 1] gets COLORS[i] (ColorBrewer YlOrRd,
# sequential, legible under dark text on the light end and white text on the dark end).
BINS = (0.001, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
COLORS = ("#fff7bc", "#fee391", "#fec44f", "#fe9929", "#ec7014", "#cc4c02", "#8c2d04")
DARK_FROM = 4  # bins from here on take white text
DIFFERS = "#3949ab"  # the underline of a token whose top-1 prediction differs

CSS = """
.vq-div { font: 14px/1.9 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; }
.vq-div .vq-sum { font-weight: 600; margin: 0 0 4px; }
.vq-div .vq-note { color: #59636e; font-size: 12px; margin: 0 0 6px; }
.vq-div .vq-legend { display: flex; flex-wrap: wrap; gap: 4px 10px; align-items: center; font-size: 12px;
  margin: 0 0 10px; color: #59636e; }
.vq-div .vq-sw { display: inline-block; padding: 0 6px; border-radius: 3px; border: 1px solid #d0d7de; }
.vq-div .vq-text { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, SFMono-Regular,
  Menlo, Consolas, monospace; font-size: 13.5px; padding: 10px 12px; border: 1px solid #d0d7de;
  border-radius: 6px; background: #fff; }
.vq-div .vq-t { position: relative; border-radius: 2px; cursor: pointer; outline: none; }
.vq-div .vq-t:hover, .vq-div .vq-t:focus { box-shadow: 0 0 0 2px #1f2328; }
.vq-div .vq-x { border-bottom: 3px solid """ + DIFFERS + """; }
.vq-div .vq-ctx { color: #8c959f; }
.vq-div .vq-part { display: inline-block; min-width: 3px; height: 1em; vertical-align: middle; }
.vq-div .vq-ws { color: #8c959f; }
.vq-div .vq-tip { display: none; position: absolute; left: 0; top: 100%; z-index: 50; margin-top: 4px;
  width: max-content; max-width: 440px; white-space: normal; user-select: none; pointer-events: none;
  font: 12px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; background: #fff;
  border: 1px solid #8c959f; border-radius: 6px; padding: 8px 10px; box-shadow: 0 4px 14px rgba(0,0,0,.18); }
.vq-div .vq-t:hover .vq-tip, .vq-div .vq-t:focus .vq-tip { display: block; }
.vq-div .vq-tip table { border-collapse: collapse; margin-top: 4px; }
.vq-div .vq-tip th, .vq-div .vq-tip td { padding: 1px 8px 1px 0; text-align: left; border: 0; background: none;
  font-size: 12px; }
.vq-div .vq-tip td.p { text-align: right; font-variant-numeric: tabular-nums; color: #59636e; }
.vq-div .vq-tip .tk { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  background: #f6f8fa; padding: 0 3px; border-radius: 3px; }
.vq-div .vq-tip .hit { font-weight: 700; }
"""

# Keeps an open token's details inside the view and the window (shifted left or flipped above near the edges);
# the CSS shows them without it. ``element`` is the root the page gives (Gradio's js_on_load), else the document.
PLACE_JS = """
(function (root) {
  function place(event) {
    var t = event.target.closest ? event.target.closest('.vq-t') : null;
    var tip = t ? t.querySelector('.vq-tip') : null;
    if (!tip) return;
    tip.style.left = '0px'; tip.style.top = '100%'; tip.style.bottom = 'auto';
    var r = tip.getBoundingClientRect(), width = document.documentElement.clientWidth;
    var box = root.getBoundingClientRect ? root.getBoundingClientRect() : {left: 0, right: width};
    var left = Math.max(0, box.left) + 4, right = Math.min(width, box.right) - 4;
    if (r.right > right) tip.style.left = (-Math.max(0, Math.min(r.right - right, r.left - left))) + 'px';
    if (r.bottom > window.innerHeight - 8 && r.top - r.height > 8) {
      tip.style.top = 'auto'; tip.style.bottom = '100%';
    }
  }
  root.addEventListener('mouseover', place);
  root.addEventListener('focusin', place);
})(typeof element !== 'undefined' ? element : document);
"""


def kl_color(kl: float) -> tuple[str, str] | None:
    """(background, text colour) of a token with this KL, or None below the first bin (left uncoloured)."""
    if kl is None or not kl >= BINS[0]:  # also NaN
        return None
    i = sum(1 for edge in BINS[1:] if kl >= edge)
    return COLORS[i], "#ffffff" if i >= DARK_FROM else "#1f2328"


def summary_line(summary: dict) -> str:
    """The whole text's numbers in one line (plain text)."""
    if not summary:
        return "no token compared yet"
    return (f"{summary['tokens']} tokens · KL mean {summary['kl_divergence']:.4f}, median {summary['kl_median']:.4f}, "
            f"p99 {summary['kl_p99']:.4f}, max {summary['kl_max']:.4f} nats · same top-1 "
            f"{100 * summary['top1_agreement']:.1f}% · perplexity original {_num(summary['perplexity_original'])}"
            f" → quantized {_num(summary['perplexity_quantized'])}")


def _num(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) and x < 1e6 else f"{x:.3g}"


def visible(text: str) -> str:
    """A token on its own, escaped, with its whitespace shown (␣ space, ↵ newline, ⇥ tab, ∅ nothing)."""
    if text == "":
        return "∅"
    return html.escape(text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍"))


def _in_text(text: str) -> str:
    """A token inside the running text, escaped: spaces as they are, line breaks marked and kept."""
    out = html.escape(text).replace("\r", "")
    out = out.replace("\n", '<span class="vq-ws">↵</span>\n')
    return out.replace("\t", '<span class="vq-ws">⇥</span>\t')


def _pct(p: float | None) -> str:
    if p is None:
        return "–"
    return f"{100 * p:.1f}%" if p >= 0.001 else f"{100 * p:.2g}%"


def _tip(row: TokenRow) -> str:
    def side(entries: list[tuple[int, str, float]], i: int) -> str:
        if i >= len(entries):
            return "<td></td><td></td>"
        token_id, name, p = entries[i]
        hit = ' class="hit"' if token_id == row.token_id else ""  # the text's actual next token
        return f'<td{hit}><span class="tk">{visible(name)}</span></td><td class="p">{_pct(p)}</td>'

    differs = " · <b>top-1 differs</b>" if row.top1_differs else ""
    rows = "".join(f"<tr>{side(row.top_original, i)}{side(row.top_quantized, i)}</tr>"
                   for i in range(max(len(row.top_original), len(row.top_quantized))))
    return (f'<span class="vq-tip"><span class="tk">{visible(row.text)}</span> · KL <b>{row.kl:.4f}</b> nats'
            f"{differs}<br>p(this token): original {_pct(row.p_original)}, quantized {_pct(row.p_quantized)}"
            f" · Δp of the original's top token {100 * row.delta_p:+.2f}%"
            f'<table><tr><th colspan="2">original top-5</th><th colspan="2">quantized top-5</th></tr>{rows}'
            "</table></span>")


def token_html(row: TokenRow) -> str:
    """One token: coloured by its KL, underlined when the top-1 differs, its details on hover or focus."""
    shown = _in_text(row.text) if row.text else ""
    if not row.predicted:
        return (f'<span class="vq-ctx" title="context: the first token is not predicted">{shown}</span>')
    classes = ["vq-t"] + (["vq-x"] if row.top1_differs else []) + ([] if row.text else ["vq-part"])
    color = kl_color(row.kl)
    style = f' style="background:{color[0]};color:{color[1]}"' if color else ""
    return (f'<span class="{" ".join(classes)}" tabindex="0" data-kl="{row.kl:.6g}"{style}>{shown}'
            f"{_tip(row)}</span>")


def legend_html() -> str:
    edges = [f"{e:g}" for e in BINS]
    labels = [f"< {edges[0]}"] + [f"{a}–{b}" for a, b in zip(edges, edges[1:])] + [f"≥ {edges[-1]}"]
    swatches = ['<span class="vq-sw" style="background:#fff">' + labels[0] + "</span>"]
    for i, color in enumerate(COLORS):
        text = "#ffffff" if i >= DARK_FROM else "#1f2328"
        swatches.append(f'<span class="vq-sw" style="background:{color};color:{text}">{labels[i + 1]}</span>')
    return ('<div class="vq-legend"><span>KL(original ‖ quantized), nats:</span>' + "".join(swatches)
            + f'<span><span class="vq-x" style="border-bottom:3px solid {DIFFERS}">underlined</span>: the top-1 '
            "next token differs</span><span>hover or click a token for both models' top-5</span></div>")


def divergence_fragment(div: Divergence, title: str = "", note: str = "") -> str:
    """The view as an HTML fragment (its style included) for a page that has its own ``<html>``."""
    notes = [n for n in (div.coverage_note(), note) if n]
    parts = [f"<style>{CSS}</style>", '<div class="vq-div">']
    if title:
        parts.append(f'<div class="vq-note">{html.escape(title)}</div>')
    parts.append(f'<p class="vq-sum" data-testid="divergence-summary">{html.escape(summary_line(div.summary))}</p>')
    if notes:
        parts.append(f'<p class="vq-note">{html.escape(" · ".join(notes))}</p>')
    parts.append(legend_html())
    parts.append('<div class="vq-text">' + "".join(token_html(row) for row in div.rows) + "</div></div>")
    return "".join(parts)


def divergence_document(div: Divergence, title: str = "Per-token divergence", note: str = "") -> str:
    """A whole self-contained HTML page of the view."""
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title></head>"
            '<body style="margin:16px 24px;background:#f6f8fa">'
            f"{divergence_fragment(div, title, note)}<script>{PLACE_JS}</script></body></html>\n")
