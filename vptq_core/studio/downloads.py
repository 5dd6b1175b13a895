"""Taking a run home. The work directory is never served: a download is a fresh copy (a hard link where
possible) of the run's archive in a directory with a random name inside Gradio's cache, made for the request
that asked; those copies are deleted with their run (``run_deleted``)."""

from __future__ import annotations

import os
import secrets
import shutil
import threading
from pathlib import Path

import gradio as gr

from . import views
from .services import Shared


class Downloads:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self._lock = threading.Lock()
        self._served: dict[str, list[Path]] = {}  # job id -> download copies in Gradio's cache

    def serve(self, snap, owner: str) -> str | None:
        """A copy of the run's archive for this request only: a hard link (else a copy) in a new directory with
        a random name in Gradio's cache, deleted with the run. None when the run has no archive."""
        archive = (snap.result or {}).get("archive")
        if snap.status != "done" or not archive or not Path(archive).is_file():
            return None
        folder = self.shared.serve_dir / f"vq-{secrets.token_hex(16)}"
        folder.mkdir(parents=True)
        target = folder / Path(archive).name
        try:
            os.link(archive, target)
        except OSError:
            shutil.copyfile(archive, target)
        with self._lock:
            self._served.setdefault(snap.id, []).append(target)
        # The run may have been deleted meanwhile: then this copy goes too.
        if snap.id not in {s.id for s in self.shared.manager.jobs(owner)}:
            self.run_deleted(snap.id, owner)
            return None
        return str(target)

    def copies(self, job_id: str) -> list[Path]:
        """The download copies made of a run so far."""
        with self._lock:
            return list(self._served.get(job_id, []))

    def button(self, snap, owner: str) -> gr.DownloadButton:
        """The page's download button with a fresh copy of the run's archive (hidden when there is none)."""
        path = self.serve(snap, owner)
        return gr.DownloadButton(label=views.download_label((snap.result or {}).get("archive_bytes")), value=path,
                                 visible=bool(path))

    def download(self, job_id: str, request: gr.Request):
        """The packed checkpoint archive of a finished job (for API clients; the page's button gets it when the
        job finishes). A fresh copy for this request; counts as taken home."""
        owner = self.shared.owner(request)
        manager = self.shared.manager
        try:
            snap = manager.get(job_id, owner, reports=False)
            path = self.serve(snap, owner)
            if path is None:
                raise ValueError(f"job {job_id} has no archive to download (status: {snap.status})")
            manager.set_extra(job_id, owner, "exported", True)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        return path

    def mark_exported(self, job_id: str, request: gr.Request) -> str:
        """The page's download button was clicked: the run is taken home (no more leave-page warning for it)."""
        owner = self.shared.owner(request)
        try:
            self.shared.manager.set_extra(job_id, owner, "exported", True)
        except ValueError:
            pass
        return self.shared.guard(owner)

    def run_deleted(self, job_id: str, owner: str) -> None:
        """A run was deleted (by its owner, expiry or a closed API session): its download copies go."""
        with self._lock:
            copies = self._served.pop(job_id, [])
        for path in copies:
            shutil.rmtree(path.parent, ignore_errors=True)
