"""The key the page encrypts the browser's identity with in its local storage (``gr.BrowserState``): the
operator's ``VPTQ_APP_SECRET`` when set, else one made once and kept in the work directory (``.browser_secret``,
created with mode 0600), so an identity a browser stored is read back after the app restarts (a Space that slept or
was rebuilt) and the browser finds its runs again. A random key per process would make every stored identity
unreadable at each restart.

The page needs the key to read the identity back, so the key is part of the page; what keeps a browser's runs its
own is the identity (32 random bytes), never shown and never stored on the server except as a SHA-256 hash.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

SECRET_FILE = ".browser_secret"
_VALID = re.compile(r"^[A-Za-z0-9_-]{32,256}$")


def stored_secret(workdir: str | os.PathLike) -> str:
    """The key kept in ``workdir`` (made on first use, mode 0600; a damaged one is replaced). Two processes
    starting at once on the same work directory get the same key."""
    path = Path(workdir) / SECRET_FILE
    for _ in range(3):
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            text = None
        except (OSError, UnicodeDecodeError):
            text = ""
        if text and _VALID.match(text):
            return text
        if text is not None:  # damaged: replaced by a new key
            with contextlib.suppress(OSError):
                path.unlink()
        created = _create(path)
        if created is not None:
            return created
    raise OSError(f"cannot keep the browser key in the work directory ({SECRET_FILE})")


def _create(path: Path) -> str | None:
    """Write a new key to ``path`` unless it exists (None then): written under a temporary name with mode 0600,
    then linked to its name, which fails when another process was first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    tmp = path.with_name(f"{SECRET_FILE}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        return key
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
