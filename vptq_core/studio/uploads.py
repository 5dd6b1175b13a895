"""Uploading a packed checkpoint archive as a new run of the browser: checked, unpacked and loaded before it
becomes a run; a refused archive leaves nothing on disk, and the uploaded file itself is deleted either way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gradio as gr

from ..api import source_model_of
from ..storage.archive import extract_checkpoint
from ..storage.checkpoint import checkpoint_size, read_quantization_config
from . import views
from .run_models import RunModels
from .services import Shared, user_error
from .sources import shown_name
from .upload_files import UploadedFiles
from .upload_limits import check_upload


class Uploads:
    def __init__(self, shared: Shared, models: RunModels) -> None:
        self.shared = shared
        self.models = models
        self.files = UploadedFiles(shared.serve_dir)  # deleted when the last request working on one is done

    def upload_run(self, archive, request: gr.Request) -> str:
        """Check, unpack and verify an uploaded checkpoint archive into a new run of this browser; returns the
        run id.

        Checked: the zip's size, the runs per browser, the disk quotas (this browser's, everyone's), each file's
        and the total unpacked size and compression ratio while unpacking (not from the zip's headers), the
        file names and kinds (``storage.archive``), then the checkpoint is loaded as chat would load it, so every
        tensor's name, shape, dtype and index range is checked against what its config implies
        (``storage.checkpoint.load_quantized``)."""
        owner = self.shared.owner(request)
        if not archive:
            raise user_error("no archive uploaded")
        path = Path(archive if isinstance(archive, str) else archive.get("path", ""))
        s, manager = self.shared.settings, self.shared.manager
        try:
            with self.files.hold(path):
                if not path.is_file():
                    raise ValueError("the uploaded file is gone; upload it again")
                size = path.stat().st_size
                if size > s.max_upload_bytes:
                    raise ValueError(f"archive is {views.mb(size)}; at most {views.mb(s.max_upload_bytes)} allowed")
                manager.check_submit(owner)
                budget, label = self._unpack_budget(owner)
                snap = manager.import_run(owner, lambda out_dir: self._unpack(path, out_dir, budget, label),
                                          title=f"uploaded {path.name}")
        except (ValueError, OSError) as exc:
            raise self.shared.error(f"cannot load {path.name}: {exc}") from None
        return snap.id

    def upload_view(self, run_id: str, request: gr.Request):
        """After an accepted upload: the run pickers set to the new run, its description, the runs table."""
        owner = self.shared.owner(request)
        rows, fig, choices = self.shared.runs_view(owner)
        try:
            snap = self.shared.manager.get(run_id, owner, reports=False)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        title = snap.title.removeprefix("uploaded ")
        return (gr.Dropdown(choices=choices, value=snap.id), views.uploaded_md(title, snap.id,
                shown_name((snap.result or {}).get("source_model"))), rows, fig, gr.Dropdown(choices=choices), None,
                self.shared.guard(owner))

    def upload(self, archive, request: gr.Request):
        """``upload_run`` then ``upload_view`` in one call (the API's /upload)."""
        run_id = self.upload_run(archive, request)
        picker, message, rows, fig, _pick, _file, _guard = self.upload_view(run_id, request)
        return picker, message, rows, fig

    def _unpack_budget(self, owner: str) -> tuple[int, str]:
        """(bytes the archive may unpack to, what that limit is called): the unpacked-size limit, or what is
        left of the browser's or the server's disk quota when that is less."""
        s, manager = self.shared.settings, self.shared.manager
        user_left = s.user_quota_bytes - manager.disk_usage(owner)
        total_left = s.total_quota_bytes - manager.disk_usage()
        budget, label = s.max_unpacked_bytes, "the unpacked-size limit"
        if user_left < budget:
            budget, label = max(user_left, 0), f"what is left of your {views.mb(s.user_quota_bytes)} disk quota"
        if total_left < budget:
            budget, label = max(total_left, 0), (f"what is left of the server's "
                                                 f"{views.mb(s.total_quota_bytes)} disk quota")
        return budget, label

    def _unpack(self, archive: Path, out_dir: Path, budget: int, label: str) -> dict:
        """Unpack ``archive`` into ``out_dir/checkpoint`` and load it (every tensor checked against its config;
        the model stays cached for chat); the new run's result."""
        s = self.shared.settings
        check_upload(archive, s, self.shared.memory, float_bytes=2)  # the app loads in bf16 / fp16
        ckpt = extract_checkpoint(archive, out_dir / "checkpoint", max_bytes=budget, max_files=s.max_archive_files,
                                  max_entry_bytes=s.max_entry_bytes, max_ratio=s.max_ratio, total_label=label)
        _config, quantization = read_quantization_config(ckpt)
        try:
            self.models.load_quantized(ckpt)
        except BaseException:
            self.models.drop_checkpoint(ckpt)
            raise
        report: Any = {}
        if (ckpt / "quant_report.json").is_file():
            report = json.loads((ckpt / "quant_report.json").read_text(encoding="utf-8"))
        if not isinstance(report, dict):
            report = {}
        source = source_model_of(str(ckpt))  # the uploader's words: a path is kept by its last part only
        return {"checkpoint_dir": str(ckpt), "source_model": shown_name(source) if source else None,
                "summary": report.get("summary", {}),
                "method": report.get("method") or quantization.get("quant_method"),
                "config": report.get("settings", {}), "checkpoint_bytes": checkpoint_size(ckpt), "archive": None}
