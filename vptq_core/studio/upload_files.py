"""Files in Gradio's upload folder while a request works on them. Gradio stores an upload under the SHA-256 of
its content, so two sessions uploading the same archive get the same path, and one session's request may still
be on its way when the other's is done. A file is deleted when no request holds it any more; one uploaded in
the last ``grace_s`` seconds is deleted that long after its upload instead, unless a request holds it then."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

GRACE_S = 20.0  # between a client's upload and its request, under load


class UploadedFiles:
    """``hold(path)`` while working on an uploaded file (in ``serve_dir``); see the module's note."""

    def __init__(self, serve_dir: Path, grace_s: float = GRACE_S) -> None:
        self.serve_dir = serve_dir
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._holders: dict[str, int] = {}

    @contextmanager
    def hold(self, path: Path) -> Iterator[None]:
        key = os.path.abspath(path)
        with self._lock:
            self._holders[key] = self._holders.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._holders[key] -= 1
                if self._holders[key] == 0:
                    del self._holders[key]
            self._release(Path(key))

    def _release(self, path: Path) -> None:
        """Delete ``path`` now, or schedule it when it was uploaded less than ``grace_s`` ago."""
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            return
        if age >= self.grace_s:
            self._remove(path)
            return
        timer = threading.Timer(self.grace_s - age, self._remove, args=(path,))
        timer.daemon = True
        timer.start()

    def _remove(self, path: Path) -> None:
        with self._lock:
            if os.path.abspath(path) in self._holders:
                return  # a request holds it again; it deletes the file when it lets go
            try:
                if not (path.resolve().is_relative_to(self.serve_dir.resolve()) and path.is_file()):
                    return
                if time.time() - path.stat().st_mtime < self.grace_s:  # uploaded again meanwhile
                    again = threading.Timer(self.grace_s, self._remove, args=(path,))
                    again.daemon = True
                    again.start()
                    return
                path.unlink()
                if path.parent != self.serve_dir and not any(path.parent.iterdir()):
                    path.parent.rmdir()
            except OSError:
                pass
