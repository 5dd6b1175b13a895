"""The divergence view of the Chat tab: where the picked run departs from its original on a text, token by token
(``vptq_core.divergence``), streamed window by window as HTML, bounded by the app's token and time limits, with a
Stop; the text comes pasted, from an uploaded .txt or from the last chat answer; the result is offered as a
self-contained HTML download."""

from __future__ import annotations

import html
import secrets
import shutil
import threading
import time
from pathlib import Path

import gradio as gr

from ..divergence import Divergence, divergence_chunks
from ..divergence_html import divergence_document, divergence_fragment
from . import views
from .quantize_form import read_text_file
from .run_models import RunModels
from .services import Shared

EMPTY = ("<p class='vq-note'>Pick a run above, paste a text (or upload a .txt, or take the last chat answer) and "
         "press Compare: every token is coloured by how far the quantized model's prediction of it departs from "
         "the original's.</p>")


class DivergenceHandlers:
    def __init__(self, shared: Shared, models: RunModels) -> None:
        self.shared = shared
        self.models = models
        self._lock = threading.Lock()
        self._stops: dict[str, threading.Event] = {}  # page session -> the Stop of its running comparison
        self._files: dict[str, Path] = {}  # page session -> the folder of its latest HTML download

    def read_upload(self, file) -> str:
        """The text of an uploaded .txt for the text box (refused when too large, not UTF-8 or empty)."""
        limit = self.shared.settings.max_divergence_text_bytes
        try:
            path = Path(file if isinstance(file, str) else (file or {}).get("path", "")) if file else None
            if path is None or not path.is_file():
                raise ValueError("no text file was uploaded; upload a UTF-8 .txt file")
            text = read_text_file(path, limit, "the text file")
        except ValueError as exc:
            raise self.shared.error(exc) from None
        return text

    @staticmethod
    def last_answer(history) -> str:
        """The last answer in one side's chat (for the text box)."""
        answers = [m["content"] for m in views.normalize_history(history) if m["role"] == "assistant"]
        text = next((a for a in reversed(answers) if a.strip()), "")
        if not text:
            raise gr.Error("that side of the chat has no answer yet: send a prompt first", print_exception=False)
        return text

    def compute(self, text: str, run_id: str, max_tokens, request: gr.Request):
        """Compare the run's two models on ``text``, streaming (view HTML, download button, status line) after
        each window; the download appears when the comparison ends (also after Stop or the time limit)."""
        owner = self.shared.owner(request)
        session = request.session_hash
        settings = self.shared.settings
        try:
            max_tokens = _tokens_in_range(max_tokens, settings.max_divergence_tokens)
            if not isinstance(text, str) or not text.strip():
                raise ValueError("paste a text first (or upload a .txt, or take the last chat answer)")
            if len(text.encode("utf-8")) > settings.max_divergence_text_bytes:
                raise ValueError(f"the text is longer than {views.mb(settings.max_divergence_text_bytes)}")
            (qmodel, tok), original, why, source = self.models.run_models(run_id, owner)
            if original is None:
                raise ValueError(f"the original model is not available: {why}")
        except ValueError as exc:
            raise self.shared.error(exc) from None
        stop = threading.Event()
        with self._lock:
            previous = self._stops.get(session)
            if previous is not None:
                previous.set()  # a new comparison on the same page replaces the running one
            self._stops[session] = stop
        title = self.shared.public(f"run {run_id} vs its original {source}")
        result = Divergence()
        started = time.monotonic()
        yield _waiting(title), gr.DownloadButton(visible=False), "comparing…"
        try:
            for chunk in divergence_chunks(original[0], qmodel, tok, text=text, max_tokens=max_tokens,
                                           time_limit_s=settings.divergence_time_limit_s, should_stop=stop.is_set):
                result.add(chunk)
                progress = f"{result.done} of {result.total} tokens…"
                yield divergence_fragment(result, title), gr.skip(), progress
        except ValueError as exc:
            raise self.shared.error(exc) from None
        finally:
            with self._lock:
                if self._stops.get(session) is stop:
                    self._stops.pop(session, None)
        note = result.coverage_note()
        status = (f"Compared {result.summary['tokens']} tokens in {time.monotonic() - started:.1f} s"
                  if result.rows else "Nothing compared")
        path = self._serve(session, divergence_document(result, title)) if result.rows else None
        yield (divergence_fragment(result, title), gr.DownloadButton(value=path, visible=bool(path)),
               f"{status}{f' ({note})' if note else ''}.")

    def stop(self, request: gr.Request) -> None:
        with self._lock:
            event = self._stops.get(getattr(request, "session_hash", None))
        if event is not None:
            event.set()

    def stop_page(self, session: str) -> None:
        """The page of ``session`` went away: its comparison stops and its download goes."""
        with self._lock:
            event = self._stops.pop(session, None)
            folder = self._files.pop(session, None)
        if event is not None:
            event.set()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def _serve(self, session: str, document: str) -> str:
        """The HTML as a download for this page only, in a folder with a random name in Gradio's cache (the
        page's previous one goes)."""
        folder = self.shared.serve_dir / f"vq-{secrets.token_hex(16)}"
        folder.mkdir(parents=True)
        target = folder / "divergence.html"
        target.write_text(document, encoding="utf-8")
        with self._lock:
            previous, self._files[session] = self._files.get(session), folder
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        return str(target)


def _tokens_in_range(value, limit: int) -> int:
    try:
        tokens = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"max tokens must be a whole number in 16..{limit}, got {value!r}") from None
    if not 16 <= tokens <= limit:
        raise ValueError(f"max tokens must be in 16..{limit}, got {tokens}")
    return tokens


def _waiting(title: str) -> str:
    return f"<p class='vq-note'>Comparing {html.escape(title)}: the first window…</p>"
