"""Standard task evaluation through lm-eval (the optional extra ``tasks``): any installed task run on a quantized
checkpoint and on its original with the same settings (few-shot count, limit, batch size, seeds), accuracy ±
stderr side by side.

Scoring is lm-eval's own: each model, as loaded by the project (a quantized checkpoint is a transformers model
with quantized linears), is wrapped in lm-eval's ``HFLM``, so the numbers are those ``lm_eval --model hf`` gives
for that model. Task data comes from the Hugging Face hub through ``datasets``; where it cannot be fetched
(offline) the run stops before any model runs, with one line naming the task.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

INSTALL = "pip install 'lm-eval==0.4.13' (the project's 'tasks' extra)"


@dataclass(frozen=True)
class TaskSettings:
    """What both models are evaluated with. ``limit``: at most this many documents per task (a fraction < 1:
    that share), None = all; ``num_fewshot`` None = each task's default."""

    num_fewshot: int | None = None
    limit: int | float | None = None
    batch_size: int = 8
    seed: int = 0

    def describe(self) -> str:
        shots = "task default" if self.num_fewshot is None else str(self.num_fewshot)
        limit = "all" if self.limit is None else str(self.limit)
        return f"num_fewshot {shots}, limit {limit}, batch size {self.batch_size}, seed {self.seed}"


@dataclass(frozen=True)
class TaskRow:
    """One metric of one task for both models (None where a side was not run)."""

    task: str
    metric: str
    original: float | None
    original_stderr: float | None
    quantized: float | None
    quantized_stderr: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ValueError(f"standard tasks need lm-eval: {INSTALL}") from None
    return lm_eval, HFLM, TaskManager


def task_manager(include_path: str | Path | None = None):
    """lm-eval's index of its installed tasks, plus the task configs (YAML) under ``include_path``."""
    _, _, TaskManager = _lm_eval()
    return TaskManager(include_path=str(include_path) if include_path else None, verbosity="ERROR")


def parse_task_names(text: str | list[str]) -> list[str]:
    """"a, b c" or a list -> ["a", "b", "c"]; at least one name."""
    names = text.replace(",", " ").split() if isinstance(text, str) else [n.strip() for n in text if n.strip()]
    if not names:
        raise ValueError("name at least one lm-eval task (e.g. arc_easy, hellaswag, or a task of --include-path)")
    return names


def check_tasks(names: list[str], manager) -> None:
    """Every task is known and its data can be read, before any model runs (one line otherwise)."""
    from lm_eval.tasks import get_task_dict

    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task {unknown[0]!r} (not among its {len(manager.all_tasks)} installed "
                         "tasks and groups; list them with: lm-eval ls tasks)")
    for name in names:
        try:
            get_task_dict([name], manager)
        except OSError:  # datasets' connection, offline-mode and not-found errors are all OSErrors
            raise ValueError(f"task data cannot be fetched for {name!r}: the Hugging Face hub is offline or "
                             "unreachable here, and the data is not in the local datasets cache") from None
        except Exception as exc:  # noqa: BLE001 - a task config lm-eval cannot build, in whatever way
            raise ValueError(f"lm-eval cannot build task {name!r}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def task_scores(model, tokenizer, names: list[str], settings: TaskSettings = TaskSettings(),  # noqa: B008
                manager=None) -> dict[tuple[str, str], tuple[float, float | None]]:
    """(task, metric) -> (value, stderr) of ``model`` on the tasks ``names``, scored by lm-eval's ``HFLM``."""
    lm_eval, HFLM, _ = _lm_eval()
    manager = task_manager() if manager is None else manager
    device = str(next(model.parameters()).device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size, device=device)
    with torch.no_grad():
        out = lm_eval.simple_evaluate(
            model=lm, tasks=names, num_fewshot=settings.num_fewshot, limit=settings.limit, task_manager=manager,
            log_samples=False, verbosity="ERROR", random_seed=settings.seed, numpy_random_seed=settings.seed,
            torch_random_seed=settings.seed, fewshot_random_seed=settings.seed, bootstrap_iters=1000,
        )
    return _metrics(out["results"])


def _metrics(results: dict) -> dict[tuple[str, str], tuple[float, float | None]]:
    scores = {}
    for task, entries in results.items():
        for key, value in entries.items():
            metric, sep, kind = key.partition(",")
            if not sep or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = entries.get(f"{metric}_stderr,{kind}")
            label = metric if kind == "none" else f"{metric} ({kind})"
            ok = isinstance(stderr, (int, float)) and math.isfinite(stderr)
            scores[(task, label)] = (float(value), float(stderr) if ok else None)
    return scores


def compare_models(quantized, original, tokenizer, names: list[str], settings: TaskSettings = TaskSettings(),  # noqa: B008
                   include_path: str | Path | None = None) -> list[TaskRow]:
    """The tasks on ``original`` (None: skipped) and ``quantized`` with the same settings, one row per metric."""
    names = parse_task_names(names)
    manager = task_manager(include_path)
    check_tasks(names, manager)
    return _both(quantized, original, tokenizer, names, settings, manager)


def compare_checkpoint(model: str, names: list[str], settings: TaskSettings = TaskSettings(),  # noqa: B008
                       reference: str | None = "auto", include_path: str | Path | None = None,
                       head_bits: int | str = "auto") -> list[TaskRow]:
    """``compare_models`` for a checkpoint directory (or model name) and its original, loaded as ``eval`` loads
    them: ``reference`` "auto" = the model the checkpoint was made from, "none" = the checkpoint alone."""
    from .api import source_model_of
    from .models import BUNDLED, load_model

    names = parse_task_names(names)
    manager = task_manager(include_path)
    check_tasks(names, manager)  # before loading anything: a missing task costs no model load
    qmodel, tok = load_model(model, head_bits=head_bits)
    if reference == "auto":
        reference = source_model_of(model) if Path(model).is_dir() else None
    original = None
    if reference and reference != "none":
        original, _ = load_model(reference, dtype=torch.bfloat16 if reference == BUNDLED else None)
    return _both(qmodel, original, tok, names, settings, manager)


def _both(quantized, original, tokenizer, names, settings, manager) -> list[TaskRow]:
    ours = task_scores(quantized, tokenizer, names, settings, manager)
    ref = task_scores(original, tokenizer, names, settings, manager) if original is not None else {}
    return [TaskRow(k[0], k[1], *ref.get(k, (None, None)), *ours.get(k, (None, None)))
            for k in sorted(set(ours) | set(ref))]


def _cell(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.4f}" + ("" if stderr is None else f" ± {stderr:.4f}")


def rows_table(rows: list[TaskRow]) -> list[list[str]]:
    """The rows as text cells: task, metric, original, quantized, quantized − original."""
    out = []
    for r in rows:
        delta = "—" if r.original is None or r.quantized is None else f"{r.quantized - r.original:+.4f}"
        out.append([r.task, r.metric, _cell(r.original, r.original_stderr), _cell(r.quantized, r.quantized_stderr),
                    delta])
    return out


TABLE_HEADERS = ["task", "metric", "original", "quantized", "Δ"]


def rows_markdown(rows: list[TaskRow], settings: TaskSettings) -> str:
    lines = ["| " + " | ".join(TABLE_HEADERS) + " |", "|" + "---|" * len(TABLE_HEADERS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows_table(rows)]
    return "\n".join(lines) + f"\n\nlm-eval, {settings.describe()}; ± is lm-eval's standard error"
