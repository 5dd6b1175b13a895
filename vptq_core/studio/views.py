"""What the app shows, as text: the progress bar's HTML, the Markdown of estimates, summaries, evaluations,
model descriptions and chat statistics, the runs table's rows, and chat messages as plain text.

Pure functions of snapshots and numbers (no Gradio), so they are tested without a server.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Iterable, Mapping

from ..eval import kl_stats_text
from ..models import BUNDLED, TINY
from ..quant import methods
from .estimate import Estimate, ModelInfo
from .job import JobSnapshot

SMOLLM2_NOTE = ("The bundled SmolLM2-135M-Instruct was shipped as 4-bit **Q4_1** weights (groups of 32), so 4-bit "
                "results on it are flattered: a 4-bit group-32 grid nearly reproduces them. Judge methods at 2–3 bits.")
TINY_NOTE = "A tiny random llama (2 blocks, hidden 64): seconds to quantize, its chat output is noise."
NO_RUN = "Pick a finished run or upload a packed checkpoint."
CHAT_SPEED_NOTE = ("Both models answer the same prompt with the same settings. Greedy (temperature 0): at the same "
                   "time, in two threads, each side's tokens/s measured while the other side generates too; on the "
                   "CPU each side has its own half of the cores (one core each on two). Sampling (temperature > 0): "
                   "one after the other, so each side's seeded reply is reproducible, each measured alone. Tokens/s "
                   "is the decode rate: tokens after the first, per second after the first.")


# ------------------------------------------------------------------------------------ what users see
def scrub_paths(text: str, roots: Iterable[str | os.PathLike]) -> str:
    """``text`` with every absolute path under one of ``roots`` (the work directory, Gradio's cache) replaced by
    its last component: messages shown to users name files, never where the server keeps them."""
    for root in sorted({str(r).rstrip("/") for r in roots if r}, key=len, reverse=True):
        if not root:
            continue
        pattern = re.escape(root) + r"(?![\w.-])(?:/[^\s'\"`,:;()\[\]{}<>]*)?"
        text = re.sub(pattern, lambda m: os.path.basename(m.group(0).rstrip("/")) or "(file)", text)
    return text


# An absolute path of two or more parts (``/etc/passwd``, ``~/.cache/x``), not inside a URL or a word.
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])(?:~|[A-Za-z]:)?/[^\s'\"`,;()\[\]{}<>|/]+(?:/[^\s'\"`,;()\[\]{}<>|/]+)+/?")


def scrub_absolute(text: str) -> str:
    """``text`` with every absolute path, wherever it points, replaced by its last component."""
    return _ABSOLUTE_PATH.sub(lambda m: os.path.basename(m.group(0).rstrip("/")) or "(file)", text)


def scrub_tree(value):
    """``value`` (JSON-like) with ``scrub_absolute`` applied to every string inside it."""
    if isinstance(value, str):
        return scrub_absolute(value)
    if isinstance(value, list | tuple):
        return [scrub_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: scrub_tree(v) for k, v in value.items()}
    return value


def scrub(text: str, roots: Iterable[str | os.PathLike] = (), hidden: Iterable[str] = ()) -> str:
    """``scrub_paths``, then any other absolute path by its last component, and every string of ``hidden``
    (session ids, browser identities) replaced."""
    text = scrub_absolute(scrub_paths(str(text), roots))
    for secret in hidden:
        if secret:
            text = text.replace(secret, "(hidden)")
    return text


def public_job(snap: JobSnapshot, reports: bool = False, roots: Iterable[str | os.PathLike] = (),
               hidden: Iterable[str] = ()) -> dict:
    """A job as its owner sees it (the raw JSON view and the API): no owner id, no server paths; the archive
    by file name only."""
    data = snap.to_dict(reports=reports)
    data.pop("owner", None)
    result = data.get("result")
    if result:
        result = dict(result)
        for key in ("checkpoint_dir", "archive"):
            value = result.pop(key, None)
            if key == "archive":
                result["archive_name"] = os.path.basename(value) if value else None
        data["result"] = result
    if data.get("error"):
        data["error"] = scrub(data["error"], roots, [snap.owner, *hidden])
    return scrub_tree(data)  # notes quoting a path (a model directory, a calibration file) keep its last part


def guard_html(busy: bool, unexported: bool) -> str:
    """The hidden element the page's beforeunload handler reads (a job queued or running; a finished run that
    was neither downloaded nor pushed)."""
    return (f'<div data-guard="1" data-busy="{int(bool(busy))}" data-unexported="{int(bool(unexported))}"></div>')


def retention_md(ttl_hours: float, max_runs: int, user_quota_bytes: int) -> str:
    return (f"Runs stay with this browser, also after a reload, for **{ttl_hours:g} h after they finish**, then "
            f"they are deleted with their files (at most {max_runs} runs and {mb(user_quota_bytes)} per browser). "
            "Download the zip, or push it to your hub repo, to keep one longer; the page asks before you leave while "
            "a job runs or a result was not taken home yet.")


# ------------------------------------------------------------------------------------------- numbers
def mb(n: float | None) -> str:
    """Every size the app shows, in MB (10^6 bytes): one decimal, three below 0.1 MB."""
    if n is None:
        return "?"
    return f"{n / 1e6:.3f} MB" if abs(n) < 100_000 else f"{n / 1e6:.1f} MB"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _round(value, digits: int):
    return None if value is None else round(float(value), digits)


def method_label(method: str) -> str:
    """The registered method's label ("VPTQ"); an unknown one (e.g. an uploaded checkpoint's quant_method)
    upper-cased."""
    return methods.get(method).label if method in methods.names() else method.upper()


def describe_settings(method: str, settings: Mapping) -> str:
    """The method's one-line label of a run's settings ("" for an unknown method or no settings)."""
    if not settings or method not in methods.names():
        return ""
    return methods.get(method).describe(settings)


# ------------------------------------------------------------------------------------- quantize tab
def model_note(name: str, info: ModelInfo | None = None, error: str | None = None) -> str:
    """The line under the model picker."""
    if name == BUNDLED:
        return SMOLLM2_NOTE
    if name == TINY:
        return TINY_NOTE
    if error is not None:
        return f"⚠️ {error}"
    return f"`{name}`: {info.num_blocks} blocks, {len(info.linear_shapes)} linears to quantize."


def estimate_md(info: ModelInfo, est: Estimate, seconds: float | None = None, basis: str = "") -> str:
    """Bits per weight, checkpoint size and (``seconds``, with what it rests on) the duration expected for the
    current settings."""
    warning = ""
    if not est.planned and est.total_bits_per_weight > 1.5 * est.index_bits_per_weight:
        warning = ("  \n⚠️ Codebooks and scales outweigh the indices on this model's small layers: use fewer "
                   "centroids or longer vectors.")
    bits = (f"**≤ {est.total_bits_per_weight:.3f} total bits** per weight (with codebooks, scales, permutations): "
            f"each layer's vector length and codebook are chosen by measured sensitivity at the start of the run  \n"
            if est.planned else
            f"**{est.index_bits_per_weight:.3f} index bits** per weight · **{est.total_bits_per_weight:.3f} "
            f"total bits** (with codebooks, scales, permutations)  \n")
    return (bits +
            f"Checkpoint ≈ **{mb(est.checkpoint_bytes)}** + tokenizer files: quantized linears "
            f"{mb(est.quantized_bytes)} + "
            f"embeddings, norms and the rest {mb(est.other_bytes)} at 16 bits · the 16-bit model is "
            f"{mb(est.dense_bytes)}  \n{len(info.linear_shapes)} linears in {info.num_blocks} blocks, "
            f"{info.linear_weights / 1e6:.1f} M weights quantized  \n"
            + (f"Takes ≈ **{duration(seconds)}** <span class='vq-note'>({basis})</span>" if seconds is not None
               else f"Duration: {basis}")
            + warning)


def job_title(name: str, method: str, est: Estimate) -> str:
    return f"{name} · {method_label(method)} · {est.total_bits_per_weight:.2f} bits"


def progress_html(snap: JobSnapshot | None, message: str = "", roots: Iterable[str | os.PathLike] = (),
                  hidden: Iterable[str] = ()) -> str:
    """The progress bar and its line of text for one job snapshot."""
    if snap is None:
        text = html.escape(message or "No job yet: pick the settings and press Start.")
        return (f'<div class="vq-progress-wrap"><div class="vq-progress"><div class="vq-progress-bar" '
                f'style="width:0%"></div></div><div class="vq-progress-text">{text}</div></div>')
    total, done = snap.total_layers, snap.layers_done
    fraction = (done / total) if total else 0.0
    if snap.status == "done":
        fraction = 1.0
    cut = snap.extras.get("interrupted") or {}
    if snap.status == "interrupted" and cut.get("blocks_total"):
        fraction = cut["blocks_done"] / cut["blocks_total"]
    parts = []
    if snap.status == "queued":
        parts.append(f"position {snap.position} in the {snap.device} queue ({snap.running_ahead} job(s) running "
                     f"ahead)")
    elif snap.status == "running":
        parts.append(snap.phase)
        if total:
            parts.append(f"{done}/{total} layers")
        if snap.current:
            parts.append(f"last: {snap.current}")
        if snap.eta_seconds is not None:
            parts.append(f"ETA {duration(snap.eta_seconds)}")
        parts.append(f"elapsed {duration(snap.elapsed)}")
    elif snap.status == "done":
        parts.append(f"{done} layers in {duration(snap.elapsed)} on {snap.device}")
    elif snap.status == "cancelled":
        parts.append(f"stopped after {done} layer(s); nothing was saved")
    elif snap.status == "interrupted":
        parts.append(f"{cut.get('blocks_done', '?')} of {cut.get('blocks_total', '?')} blocks done when the app "
                     "restarted; press Resume to continue from the last finished block")
    text = " · ".join(html.escape(p) for p in parts)
    if snap.status == "running":  # what the run's plan chose for its time budget, one line per decision
        lines = (snap.extras.get("plan") or {}).get("lines", [])[1:]
        text += "".join(f"<br>plan: {html.escape(line)}" for line in lines)
    error = (f'<div class="vq-error">{html.escape(scrub(snap.error, roots, [snap.owner, *hidden]))}</div>'
             if snap.error else "")
    return (f'<div class="vq-progress-wrap" data-status="{snap.status}"><div class="vq-progress">'
            f'<div class="vq-progress-bar {snap.status}" style="width:{100 * fraction:.1f}%"></div></div>'
            f'<div class="vq-progress-text"><span class="vq-status">{snap.status}</span> '
            f'<code>{html.escape(snap.id)}</code> {html.escape(snap.title)}<br>{text}</div>{error}</div>')


def summary_md(snap: JobSnapshot) -> str:
    """The summary of a finished quantization ("" until it is done)."""
    if snap.status != "done" or not snap.result:
        return ""
    s = snap.result.get("summary", {})
    bits = (f"**{s['index_bits_per_weight']:.3f}** index / **{s['total_bits_per_weight']:.3f}** total bits per "
            f"weight" if s.get("total_bits_per_weight") else "bits unknown")
    size = mb(snap.result.get("checkpoint_bytes"))
    return (f"### Done: {html.escape(snap.title)}\n{bits} · checkpoint **{size}**"
            f" · quantized in **{duration(s.get('seconds'))}** ({duration(snap.elapsed)} with loading and "
            f"saving) on {snap.device} · {s.get('layers', '?')} layers")


def download_label(archive_bytes: int | None) -> str:
    return f"Download the packed checkpoint ({mb(archive_bytes)} zip)"


def eval_md(ev: Mapping | None) -> str:
    """An evaluation (``EvalResult.to_dict()``) in one paragraph ("" for none)."""
    if not ev:
        return ""
    text = f"**Perplexity {ev['perplexity']:.3f}**"
    if ev.get("reference_perplexity") is not None:
        text += (f" (original {ev['reference_perplexity']:.3f}) · KL to the original **{ev['kl_divergence']:.4f}**"
                 f" nats/token · top-1 agreement **{100 * ev['top1_agreement']:.1f}%**")
    if ev.get("kl_p99") is not None:
        text += f"  \n{kl_stats_text(ev)}"
    return (f"{text}  \n<span class='vq-note'>{eval_protocol(ev)} ({ev['tokens']} predicted tokens, "
            f"{ev['seconds']:.0f} s)</span>")


def eval_protocol(ev: Mapping) -> str:
    """Where an evaluation's figures come from, in one line: its windows and the text and held-out split they
    were spread over (docs/methods.md#evaluation-protocol)."""
    names = {"wiki": "the bundled Wikipedia", "pydocs": "the bundled Python documentation"}
    split = ev.get("split")
    if ev.get("text") in names:
        where = (f"the {split} split of {names[ev['text']]} (documents no calibration uses)" if split
                 else f"{names[ev['text']]}'s held-out documents")
    else:
        where = "the uploaded evaluation text"
    return f"{ev.get('windows', '?')} windows × {ev.get('seqlen', '?')} tokens spread over {where}"


def runs_view(snaps: Iterable[JobSnapshot]) -> tuple[list[list], list[dict], list[tuple[str, str]]]:
    """(rows of the runs table (``plots.RUN_COLUMNS``), points of the bits-vs-perplexity figure, choices of the
    chat run picker) for finished runs."""
    rows, points, choices = [], [], []
    for snap in snaps:
        result = snap.result or {}
        s = result.get("summary") or {}
        ev = snap.extras.get("eval") or {}
        method = (result.get("method") or s.get("method") or "?").lower()
        name = method_label(method)
        label = f"{name} {s['total_bits_per_weight']:.2f}b" if s.get("total_bits_per_weight") else method
        rows.append([
            snap.id, scrub_absolute(result.get("source_model") or "?"), name,
            describe_settings(method, result.get("config") or s.get("config") or {}),
            _round(s.get("index_bits_per_weight"), 3), _round(s.get("total_bits_per_weight"), 3),
            _round((result.get("checkpoint_bytes") or 0) / 1e6, 1),
            _round(s["seconds"] / 60, 2) if s.get("seconds") is not None else None,
            _round(ev.get("perplexity"), 3), _round(ev.get("reference_perplexity"), 3),
            _round(ev.get("kl_divergence"), 4),
            _round(100 * ev["top1_agreement"], 1) if ev.get("top1_agreement") is not None else None,
        ])
        points.append({"label": f"{label} ({snap.id[:4]})", "method": method, "model": result.get("source_model"),
                       "total_bits": s.get("total_bits_per_weight"), "perplexity": ev.get("perplexity"),
                       "reference_perplexity": ev.get("reference_perplexity")})
        kind = "uploaded" if snap.kind == "import" else scrub_absolute(result.get("source_model") or "")
        choices.append((f"{snap.id} · {label} · {kind}", snap.id))
    return rows, points, choices


# ----------------------------------------------------------------------------------------- chat tab
def models_md(source: str | None, original_bytes: int | None, why: str, quantized_bytes: int, dtype: str,
              device: str, head_bits: int = 0) -> str:
    """Both sides of a run: the original model (``original_bytes`` None: not available, ``why``) and the
    quantized one (``head_bits``: its LM head's bits at run time, ``storage.head``; 0 = as stored)."""
    left = (f"**Original** `{scrub_absolute(source or '')}` ({dtype}, {device}): weights {mb(original_bytes)}"
            if original_bytes is not None else f"**Original** not available: {why}")
    head = f", LM head {head_bits}-bit" if head_bits else ""
    right = f"**Quantized** ({dtype} activations, lookup kernels{head}, {device}): weights {mb(quantized_bytes)}"
    return f"{left}  \n{right}"


def sides_md(sides: list[dict], dtype: str, device: str) -> str:
    """The chat's two sides, left then right: each the original (``original``, ``source``; ``bytes`` None: not
    available, ``why``) or a run (``label``, made from ``source``; ``head_bits``: its LM head's bits at run time)."""
    lines = []
    for where, side in zip(("Left", "Right"), sides, strict=False):
        if side["original"]:
            text = (f"**Original** `{side['source']}` ({dtype}, {device}): weights {mb(side['bytes'])}"
                    if side["bytes"] is not None else f"**Original** not available: {side['why']}")
        else:
            head = f", LM head {side['head_bits']}-bit" if side["head_bits"] else ""
            text = (f"**Quantized** {side['label']} of `{side['source'] or 'unknown'}` ({dtype} activations, lookup "
                    f"kernels{head}, {device}): weights {mb(side['bytes'])}")
        lines.append(f"{where} · {text}")
    return "  \n".join(lines)


def uploaded_md(file_name: str, run_id: str, source: str | None) -> str:
    return f"Loaded `{file_name}` as run `{run_id}` (made from `{source or 'unknown'}`)."


def chat_stats_md(stats, weight_bytes: int, stopped: bool) -> str:
    """One side's reply: tokens, decode tokens/s, time to the first token, prompt tokens, weights
    (``stats``: a ``chat.GenerationStats``)."""
    first = (f" · first token after {stats.first_token_seconds:.2f} s" if stats.first_token_seconds is not None
             else "")
    return (f"{stats.tokens} tokens · **{stats.decode_tokens_per_second:.1f} tokens/s**{first} · prompt "
            f"{stats.prompt_tokens} tokens · weights {mb(weight_bytes)}" + (" · stopped" if stopped else ""))


def message_text(content) -> str:
    """Text of one chat message's content: a string, a list of blocks ({"type": "text", "text": ...}), one
    block, or a (path, alt) tuple. Non-text blocks contribute nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        if content.get("type", "text") == "text" and isinstance(content.get("text"), str):
            return content["text"]
        return ""
    if isinstance(content, list):
        return "".join(message_text(c) for c in content)
    return ""  # a (file path, alt text) tuple or a component: no text


def normalize_history(history) -> list[dict]:
    """Chatbot value -> [{"role", "content": str}] with text-only contents (Gradio 6 may send blocks)."""
    messages = []
    for m in history or []:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if role in ("user", "assistant"):
            messages.append({"role": role, "content": message_text(content)})
    return messages
