"""Files in Gradio's upload folder while a request works on them. Gradio stores an upload under the SHA-256 of
its content, so two sessions uploading the same archive get the same path: the file is deleted only when no
request holds it any more and nobody uploaded it again since the last holder began."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class UploadedFiles:
    """``hold(path)`` while working on an uploaded file; when the last holder lets go, the file (and its
    folder, when left empty) is removed if it lies in ``serve_dir`` and was not uploaded again meanwhile."""

    def __init__(self, serve_dir: Path) -> None:
        self.serve_dir = serve_dir
        self._lock = threading.Lock()
        self._holders: dict[str, int] = {}
        self._since: dict[str, float] = {}  # path -> when the latest holder began

    @contextmanager
    def hold(self, path: Path) -> Iterator[None]:
        key = os.path.abspath(path)
        with self._lock:
            self._holders[key] = self._holders.get(key, 0) + 1
            self._since[key] = time.time()
        try:
            yield
        finally:
            with self._lock:
                self._holders[key] -= 1
                if self._holders[key] == 0:
                    del self._holders[key]
                    self._remove(Path(key), self._since.pop(key))

    def _remove(self, path: Path, since: float) -> None:
        try:
            if not (path.resolve().is_relative_to(self.serve_dir.resolve()) and path.is_file()):
                return
            if path.stat().st_mtime > since:  # uploaded again after the last holder began: its request comes
                return
            path.unlink()
            if path.parent != self.serve_dir and not any(path.parent.iterdir()):
                path.parent.rmdir()
        except OSError:
            pass
