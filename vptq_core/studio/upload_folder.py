"""Gradio's upload folder (``GRADIO_TEMP_DIR``, else ``<temp dir>/gradio``): every file a client sends to
``/gradio_api/upload`` lands there before any handler sees it, whether or not it is ever used, and the download
copies of runs are made there too. Gradio forgets what it stored when the process ends, so files would outlive a
restart and every quota. ``UploadFolder`` measures what the folder holds (hard links to a run's archive are
counted with the run, not twice) for the disk quota of all users, and cleans it: at start and on the janitor's
schedule, files older than ``max_age_s`` go, and while the folder holds more than ``max_bytes`` the oldest files
go first (files younger than ``min_age_s`` are never touched: a handler may be reading them).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _File:
    path: Path
    size: int
    mtime: float  # when it arrived
    linked: bool  # another name (a run's archive) holds the same data


class UploadFolder:
    def __init__(self, folder: str | os.PathLike, max_age_s: float, max_bytes: int | None = None,
                 min_age_s: float = 300.0) -> None:
        self.folder = Path(folder)
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.min_age_s = min(min_age_s, max_age_s)

    def usage(self) -> int:
        """Bytes the folder's files take beyond what runs already count (hard links to them are left out)."""
        return sum(f.size for f in self._files() if not f.linked)

    def clean(self, now: float | None = None) -> int:
        """Delete files older than ``max_age_s``, then the oldest while over ``max_bytes``, then folders left
        empty; returns how many files were deleted."""
        now = time.time() if now is None else now
        files = sorted(self._files(), key=lambda f: f.mtime)
        doomed = [f for f in files if now - f.mtime > self.max_age_s]
        if self.max_bytes is not None:
            kept = files[len(doomed):]  # (oldest first: the expired ones lead)
            used = sum(f.size for f in kept if not f.linked)
            for f in kept:
                if used <= self.max_bytes or now - f.mtime < self.min_age_s:
                    break
                doomed.append(f)
                used -= 0 if f.linked else f.size
        removed, emptied = 0, set()
        for f in doomed:
            with contextlib.suppress(OSError):
                f.path.unlink()
                removed += 1
                emptied.add(f.path.parent)
        self._remove_empty_dirs(now, emptied)
        return removed

    def _files(self) -> list[_File]:
        found: list[_File] = []
        for root, _dirs, names in os.walk(self.folder):
            for name in names:
                path = Path(root) / name
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if path.is_symlink() or not path.is_file():
                    continue
                linked = st.st_nlink > 1
                # A hard link to a run's archive carries the archive's mtime; when the link was made shows in its ctime.
                found.append(_File(path, st.st_size, st.st_ctime if linked else st.st_mtime, linked))
        return found

    def _remove_empty_dirs(self, now: float, emptied: set[Path]) -> None:
        """Empty folders whose files were just deleted, or that have been empty a while (a new one may be about to
        receive its file)."""
        for root, dirs, _names in os.walk(self.folder, topdown=False):
            for name in dirs:
                path = Path(root) / name
                with contextlib.suppress(OSError):
                    if not any(path.iterdir()) and (path in emptied or now - path.stat().st_mtime > self.min_age_s):
                        path.rmdir()
