"""What every group of the app's handlers shares (``Shared``): the settings, the job manager, the model cache,
which browser each page session acts for (``Identities``), and the ways a handler shows a user something
without server paths, session ids or identities.

Who owns what: each browser gets a random, unguessable identity kept in its local storage (a
``gr.BrowserState`` the page sends to ``Pages.attach`` when it loads; never shown). ``attach`` maps the page's
session to that identity, so runs survive a reload and come back in every tab of the same browser; API clients
that never attach own their runs by their session id, and lose them when they disconnect.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import gradio as gr
from gradio.utils import get_upload_folder

from . import form, plots, views
from .app_settings import AppSettings
from .client_address import client_address
from .memory_guard import MemoryGuard
from .model_cache import ModelCache
from .queue import JobManager
from .upload_folder import UploadFolder


def user_error(message) -> gr.Error:
    """A message for the user (shown in the page), not a server fault: no traceback in the log."""
    return gr.Error(str(message), print_exception=False)


def make_manager(settings: AppSettings) -> JobManager:
    """The job manager the settings ask for: one quantization at a time per device."""
    limits = {"cpu": 1, **({settings.device: 1} if settings.device != "cpu" else {})}
    return JobManager(settings.workdir, limits=limits, max_active_per_owner=settings.max_jobs_per_user,
                      max_runs_per_owner=settings.max_runs_per_user, max_age_s=settings.run_ttl_hours * 3600,
                      max_active_per_client=settings.max_jobs_per_address)


class Identities:
    """Which browser identity each page session acts for, and when a page was last seen unloading."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._identities: dict[str, str] = {}  # page session -> browser identity
        self._unloaded: dict[str, float] = {}  # page session -> when its page was last seen unloading

    def owner(self, request: gr.Request | None) -> str:
        """Who the request acts for: the browser identity its page attached, else its session id."""
        session = getattr(request, "session_hash", None) if request is not None else None
        if not session:
            raise user_error("this action needs a browser session (no session id in the request)")
        with self._lock:
            return self._identities.get(session, session)

    def hidden(self) -> list[str]:
        """Every page session id and browser identity known now (never shown to anyone)."""
        with self._lock:
            return [*self._identities, *self._identities.values()]

    def bind(self, session: str, identity: str) -> None:
        with self._lock:
            self._identities[session] = identity
            self._unloaded.pop(session, None)

    def unload(self, session: str) -> str | None:
        """The page of ``session`` went away: its identity (the link stays for now), or None when it had none."""
        with self._lock:
            identity = self._identities.get(session)
            if identity is not None:
                self._unloaded[session] = time.time()
        return identity

    def forget_pages(self, older_than_s: float) -> int:
        """Drop the identity of page sessions that unloaded more than ``older_than_s`` seconds ago (their browser
        comes back through a new session; the runs stay with the identity). Returns how many."""
        cutoff = time.time() - older_than_s
        with self._lock:
            gone = [session for session, when in self._unloaded.items() if when <= cutoff]
            for session in gone:
                self._unloaded.pop(session, None)
                self._identities.pop(session, None)
        return len(gone)


class Shared:
    """The services the handler groups share. Downloads are copies inside Gradio's cache (``serve_dir``); the
    work directory must lie outside it, since files there are served to anyone who knows their path."""

    def __init__(self, settings: AppSettings, manager: JobManager, cache: ModelCache) -> None:
        self.settings = settings
        self.manager = manager
        self.cache = cache
        self.memory = MemoryGuard(settings.memory_limit_bytes)  # the app's memory ceiling, for loads and jobs
        if manager.memory_check is None:
            manager.memory_check = self.memory.over
        self.identities = Identities()
        self.serve_dir = Path(get_upload_folder())
        if Path(settings.workdir).resolve().is_relative_to(self.serve_dir.resolve()):
            raise ValueError(f"the work directory must not be inside Gradio's cache ({self.serve_dir}): files there "
                             "are served to anyone who knows their path")
        # Files clients sent to Gradio count in the disk quota of all users; what an earlier process left goes.
        self.upload_folder = UploadFolder(self.serve_dir, settings.upload_ttl_hours * 3600,
                                          settings.upload_folder_bytes)
        self.upload_folder.clean()
        self.roots = tuple(str(Path(r).resolve()) for r in (settings.workdir, self.serve_dir, tempfile.gettempdir()))
        # fp16 matmuls are very slow on CPU; bf16 is not
        self.dtype = "float16" if settings.device == "cuda" else "bfloat16"

    def owner(self, request: gr.Request | None) -> str:
        return self.identities.owner(request)

    def client(self, request: gr.Request | None) -> str | None:
        """The network address the request came from (``client_address``; for limits only, never shown)."""
        return client_address(request, self.settings.proxy_hops)

    # ------------------------------------------------------------------------------ what users are shown
    def public(self, text) -> str:
        """``text`` without server paths, session ids or identities (for messages shown to users)."""
        return views.scrub(str(text), self.roots, self.identities.hidden())

    def error(self, exc) -> gr.Error:
        """A refusal for the user: the form's words for settings, no server paths or session ids."""
        return user_error(self.public(form.readable(exc)))

    def progress(self, snap, message: str = "") -> str:
        return views.progress_html(snap, message, roots=self.roots, hidden=self.identities.hidden())

    def job_json(self, snap, reports: bool = False) -> dict:
        return views.public_job(snap, reports=reports, roots=self.roots, hidden=self.identities.hidden())

    def guard(self, owner: str) -> str:
        """The leave-page guard: warn while a job runs or a finished run was not taken home."""
        snaps = self.manager.jobs(owner)
        busy = any(s.active for s in snaps)
        unexported = any(s.status == "done" and s.kind != "import" and not s.extras.get("exported") for s in snaps)
        return views.guard_html(busy, unexported)

    def runs_view(self, owner: str):
        """(rows of the runs table, bits-vs-perplexity figure, choices of the run pickers)."""
        rows, points, choices = views.runs_view(self.manager.jobs(owner, statuses=("done",)))
        return rows, plots.runs_figure(points), choices

    # ------------------------------------------------------------------------------------ disk quotas
    def check_disk(self, owner: str, need: int, what: str) -> None:
        """ValueError unless ``need`` more bytes fit in the owner's quota and in the total one."""
        s = self.settings
        used = self.manager.disk_usage(owner)
        if used + need > s.user_quota_bytes:
            raise ValueError(f"{what} needs about {views.mb(need)}; your runs use {views.mb(used)} of your "
                             f"{views.mb(s.user_quota_bytes)} disk quota: delete a run under 'Your runs' first")
        total = self.manager.disk_usage() + self.upload_folder.usage()
        if total + need > s.total_quota_bytes:
            raise ValueError(f"{what} needs about {views.mb(need)}; the server's runs and uploads use "
                             f"{views.mb(total)} of {views.mb(s.total_quota_bytes)} (the disk quota of all users): "
                             "try again later")
