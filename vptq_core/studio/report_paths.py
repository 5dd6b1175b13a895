"""A run's files as they leave the server (download, hub push) name no server path: every string of its
``quant_report.json`` that holds an absolute path keeps the path's last part only (the calibration file, a
local model directory, notes that quote them), so neither the work directory nor a job id ships."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .views import scrub_tree

REPORT_NAME = "quant_report.json"


def public_report(ckpt: str | os.PathLike) -> None:
    """Rewrite ``ckpt/quant_report.json`` (atomically) without server paths; nothing when there is none."""
    path = Path(ckpt) / REPORT_NAME
    if not path.is_file():
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    cleaned = scrub_tree(data)
    if cleaned == data:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(cleaned, indent=2), encoding="utf-8")
    tmp.replace(path)
