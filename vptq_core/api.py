"""High-level entry points shared by the CLI and the app: quantize into a checkpoint directory, evaluate."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from . import __version__
from .data import calibration_windows
from .eval import EvalResult, evaluate
from .models import BUNDLED, load_model
from .quant.config import CalibConfig
from .quant.pipeline import quantize_model, total_linear_shapes
from .storage.checkpoint import save_quantized

REPORT_NAME = "quant_report.json"


def versions() -> dict:
    return {"vptq_core": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def build_report(model_source: str, result, calib: CalibConfig, device: str) -> dict:
    """The ``quant_report.json`` body: settings, per-layer reports, bits, timings, versions."""
    return {
        "model": {"source": model_source},
        "method": result.method,
        "settings": result.config,
        "calibration": calib.to_dict(),
        "device": device,
        "threads": torch.get_num_threads(),
        "summary": result.summary(),
        "layers": [r.to_dict() for r in result.reports],
        "versions": versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def quantize_to_dir(
    model_name: str,
    method: str,
    config,
    calib: CalibConfig,
    out_dir: str | Path,
    device: str | None = None,
    on_layer: Callable | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_start: Callable[[int], None] | None = None,
    evaluate_after: bool = False,
    save_dtype: torch.dtype = torch.bfloat16,
) -> tuple[Path, dict]:
    """Load ``model_name``, quantize it with ``method``/``config`` on ``calib`` data, write the packed
    checkpoint to ``out_dir``. Returns (directory, summary). A cancelled run writes nothing and returns
    ``summary["cancelled"] = True``."""
    model, tok = load_model(model_name, dtype=torch.float32)
    calib_ids = calibration_windows(tok, calib.text, calib.samples, calib.seqlen, calib.seed)
    if on_start:
        on_start(len(total_linear_shapes(model)))
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _, result = quantize_model(model, calib_ids, method, config, on_layer=on_layer, should_stop=should_stop,
                               device=dev, inplace=False)
    summary = result.summary()
    if result.cancelled:
        return Path(out_dir), summary
    report = build_report(model_name, result, calib, dev)
    out = save_quantized(model, tok, result.states, out_dir, report=report, dtype=save_dtype)
    if evaluate_after:
        ev = evaluate_model(str(out), reference=model_name, seqlen=calib.seqlen, max_windows=16)
        report["eval"] = ev.to_dict()
        summary["eval"] = ev.to_dict()
        _merge_report(out, {"eval": report["eval"]})
    return out, summary


def _merge_report(out: Path, extra: dict) -> None:
    path = Path(out) / REPORT_NAME
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    data.update(extra)
    path.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")


def source_model_of(path: str) -> str | None:
    """The original model a quantized checkpoint directory was made from (from its report)."""
    report = Path(path) / REPORT_NAME
    if not report.is_file():
        return None
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    source = data.get("model", {}).get("source") if isinstance(data, dict) else None
    return source if isinstance(source, str) else None


def evaluate_model(
    model: str, reference: str | None = "auto", text: str = "wiki", seqlen: int = 512,
    max_windows: int | None = None, dtype: str | None = None,
) -> EvalResult:
    """Evaluate a model name or directory; ``reference`` "auto" compares a quantized checkpoint with the
    model it was made from, "none" disables the comparison."""
    qmodel, tok = load_model(model, dtype=dtype)
    ref_model = None
    if reference == "auto":
        reference = source_model_of(model) if Path(model).is_dir() else None
    if reference and reference != "none":
        ref_model, _ = load_model(reference, dtype=dtype or (torch.bfloat16 if reference == BUNDLED else None))
    return evaluate(qmodel, tok, text=text, seqlen=seqlen, max_windows=max_windows, reference=ref_model)
