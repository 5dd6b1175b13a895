"""Evaluating a run against its original model (perplexity, KL, top-1 agreement), and the run's model card and
archive written again with the result."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from ..data import DEFAULT_EVAL_SPLIT
from ..eval import evaluate
from ..storage.archive import pack_checkpoint
from ..storage.checkpoint import checkpoint_size
from . import views
from .card import write_model_card
from .downloads import Downloads
from .queue import JobManager
from .run_models import RunModels
from .services import Shared


def refresh_card(manager: JobManager, snap, owner: str):
    """Write the run's model card again (with its evaluation) and pack its archive again; the new snapshot.
    Uploaded runs keep their card as it came."""
    result = snap.result or {}
    if snap.kind == "import" or not result.get("checkpoint_dir"):
        return snap
    ckpt = Path(result["checkpoint_dir"])
    write_model_card(ckpt, result.get("source_model"), snap.extras.get("eval"))
    archive = result.get("archive")
    if archive:
        packed = pack_checkpoint(ckpt, archive)  # atomic: copies already served keep their content
        snap = manager.update_result(snap.id, owner, archive_bytes=packed.stat().st_size,
                                     checkpoint_bytes=checkpoint_size(ckpt))
    return snap


class Evaluation:
    def __init__(self, shared: Shared, models: RunModels, downloads: Downloads) -> None:
        self.shared = shared
        self.models = models
        self.downloads = downloads

    def evaluate(self, job_id: str, windows, seqlen, request: gr.Request, progress=gr.Progress()):  # noqa: B008
        """Perplexity, KL and top-1 agreement of the quantized run against its original model; the model card
        in the run's zip gets them (a fresh download copy is returned)."""
        owner = self.shared.owner(request)
        try:
            snap = self._evaluate(job_id, windows, seqlen, owner, progress)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        rows, fig, _choices = self.shared.runs_view(owner)
        download = self.downloads.button(snap, owner) if (snap.result or {}).get("archive") else gr.skip()
        return views.eval_md(snap.extras.get("eval")), rows, fig, self.shared.job_json(snap), download

    def evaluate_run(self, run_id: str, windows, seqlen, request: gr.Request,
                     progress=gr.Progress()):  # noqa: B008
        """``evaluate`` for the run picked in the Chat tab (e.g. an uploaded checkpoint)."""
        owner = self.shared.owner(request)
        try:
            snap = self._evaluate(run_id, windows, seqlen, owner, progress)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        rows, fig, _choices = self.shared.runs_view(owner)
        return views.eval_md(snap.extras.get("eval")), rows, fig

    def picked_view(self, run_id: str, request: gr.Request) -> str:
        """The Chat tab's evaluation box for a newly picked run: that run's evaluation, or nothing yet."""
        if not run_id:
            return ""
        try:
            snap = self.shared.manager.get(run_id, self.shared.owner(request), reports=False)
        except ValueError:
            return ""
        return views.eval_md(snap.extras.get("eval"))

    def _evaluate(self, job_id: str, windows, seqlen, owner: str, progress):
        windows, seqlen = int(windows or 0), int(seqlen or 0)
        if not 1 <= windows <= 512:
            raise ValueError(f"evaluation windows must be in 1..512, got {windows}")
        if not 16 <= seqlen <= 8192:
            raise ValueError(f"evaluation window length must be in 16..8192 tokens, got {seqlen}")
        progress(0.0, desc="loading the models")
        (qmodel, tok), original, _why, _source = self.models.run_models(job_id, owner)
        # the held-out test split, as plots.RUNS_PROTOCOL says; the result records it (views.eval_protocol)
        result = evaluate(qmodel, tok, text="wiki", seqlen=seqlen, max_windows=windows, split=DEFAULT_EVAL_SPLIT,
                          reference=original[0] if original else None,
                          on_window=lambda i, n: progress(i / n, desc=f"window {i}/{n}"))
        snap = self.shared.manager.set_extra(job_id, owner, "eval", result.to_dict())
        return refresh_card(self.shared.manager, snap, owner)


MAX_TASKS = 4
TASK_LIMIT_MAX = 1000


class TaskEvaluation:
    """lm-eval tasks on a run and its original (``vptq_core.tasks``), same settings, the table side by side.
    ``include_path``: a folder of extra task configs (lm-eval YAML) offered beside the installed tasks."""

    def __init__(self, shared: Shared, models: RunModels, include_path: str | None = None) -> None:
        self.shared = shared
        self.models = models
        self.include_path = include_path

    def run(self, job_id: str, names: str, limit, request: gr.Request, progress=gr.Progress()):  # noqa: B008
        """The run's and its original's scores on the named tasks (at most ``limit`` documents each): Markdown."""
        owner = self.shared.owner(request)
        try:
            return self._run(job_id, names, limit, owner, progress)
        except ValueError as exc:
            raise self.shared.error(exc) from None

    def _run(self, job_id: str, names: str, limit, owner: str, progress) -> str:
        from ..tasks import TaskSettings, compare_models, parse_task_names, rows_markdown

        names = parse_task_names(names or "")
        if len(names) > MAX_TASKS:
            raise ValueError(f"at most {MAX_TASKS} tasks at a time, got {len(names)}")
        limit = int(limit or 0)
        if not 1 <= limit <= TASK_LIMIT_MAX:
            raise ValueError(f"documents per task must be in 1..{TASK_LIMIT_MAX}, got {limit}")
        progress(0.0, desc="loading the models")
        (qmodel, tok), original, why, _source = self.models.run_models(job_id, owner)
        progress(0.1, desc="running lm-eval (the run, then the original)")
        settings = TaskSettings(limit=limit)
        rows = compare_models(qmodel, original[0] if original else None, tok, names, settings, self.include_path)
        text = rows_markdown(rows, settings)
        return text if original else f"{text}\n\nThe original was not run: {why}"
