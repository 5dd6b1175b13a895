"""Pages coming and going: ``attach`` binds a page to its browser's identity and shows its runs again,
``on_unload`` stops its chats (and ends an API session's runs), and a janitor thread deletes expired runs and
forgets pages that left long ago. Finished runs are deleted ``AppSettings.run_ttl_hours`` after they finish."""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Callable

import gradio as gr

from . import views
from .services import Shared, user_error

IDENTITY = re.compile(r"^[A-Za-z0-9_-]{43}$")  # secrets.token_urlsafe(32)


class Pages:
    """Page load and unload. ``stop_chats(session)`` stops the chats of a page that went away."""

    def __init__(self, shared: Shared, stop_chats: Callable[[str], None], janitor_interval_s: float = 60.0):
        self.shared = shared
        self.stop_chats = stop_chats
        self._closed = threading.Event()
        threading.Thread(target=self._janitor, args=(janitor_interval_s,), name="studio-janitor", daemon=True).start()

    def attach(self, identity, request: gr.Request):
        """Page load: bind this page's session to the browser's identity (a new random one the first time) and
        show its runs again. Returns the identity to keep in the browser, the job to watch (the newest active
        one, else the newest) with a poll state that makes the next tick fill the page in, its evaluation, the
        runs table, plot and pickers, and the leave-page guard."""
        session = getattr(request, "session_hash", None)
        if not session:
            raise user_error("this page has no session id")
        if not isinstance(identity, str) or not IDENTITY.match(identity):
            identity = secrets.token_urlsafe(32)
        self.shared.identities.bind(session, identity)
        manager = self.shared.manager
        manager.reassign(session, identity)  # jobs started before the page attached
        snaps = manager.jobs(identity)
        interrupted = [s for s in snaps if s.status == "interrupted"]  # cut off by a restart: shown to resume
        watched = ([s for s in snaps if s.active] or interrupted or snaps or [None])[-1]
        rows, fig, choices = self.shared.runs_view(identity)
        job = watched.id if watched else ""
        ev = views.eval_md(watched.extras.get("eval")) if watched else ""
        return (identity, job, {"job": job} if watched else {}, gr.Timer(active=bool(watched)), ev, rows, fig,
                gr.Dropdown(choices=choices), gr.Dropdown(choices=choices, value=None), self.shared.guard(identity))

    def on_unload(self, request: gr.Request) -> None:
        """A page went away (closed or reloaded): its chats stop. A browser's runs stay (they expire
        ``run_ttl_hours`` after they finish), and so does the page's link to its identity for as long: the page
        may still be there (Gradio's client disconnects on ``beforeunload``, before it is known whether the page
        is left). An API session's jobs are cancelled and its runs deleted, since nobody can come back
        to them."""
        session = getattr(request, "session_hash", None)
        if not session:
            return
        identity = self.shared.identities.unload(session)
        self.stop_chats(session)
        if identity is None:
            self.shared.manager.forget_owner(session)

    def forget_pages(self, older_than_s: float) -> int:
        """Forget pages that unloaded more than ``older_than_s`` seconds ago (``Identities.forget_pages``)."""
        return self.shared.identities.forget_pages(older_than_s)

    def close(self) -> None:
        """Stop the janitor."""
        self._closed.set()

    def _janitor(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                self.shared.manager.prune()
                self.forget_pages(self.shared.settings.run_ttl_hours * 3600)
                self.shared.upload_folder.clean()
            except Exception:  # noqa: BLE001 - the janitor must keep running
                pass
