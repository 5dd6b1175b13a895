"""The Chat tab: load a run's two models, answer a prompt with both at once (streaming both replies), stop
either side or both, clear."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import gradio as gr

from . import views
from .chat import ChatSession, check_sampling, model_memory_bytes
from .run_models import RunModels
from .services import Shared

SIDES = ("original", "quantized")


class ChatHandlers:
    """``make_chat(model, tokenizer)`` makes one side's ``ChatSession`` (tests pass stand-ins)."""

    def __init__(self, shared: Shared, models: RunModels,
                 make_chat: Callable[..., ChatSession] = ChatSession) -> None:
        self.shared = shared
        self.models = models
        self.make_chat = make_chat
        self._lock = threading.Lock()
        self._chats: dict[str, dict[str, tuple[ChatSession, threading.Event]]] = {}  # page session -> side -> ...

    def load(self, run_id: str, request: gr.Request):
        """Load both models of a run (cached) and describe them; clears both conversations."""
        owner = self.shared.owner(request)
        if not run_id:
            return views.NO_RUN, [], [], "", ""
        try:
            (qmodel, _), original, why, source = self.models.run_models(run_id, owner)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        original_bytes = model_memory_bytes(original[0]) if original else None
        return (views.models_md(source, original_bytes, why, model_memory_bytes(qmodel), self.shared.dtype,
                                self.shared.settings.device, getattr(qmodel, "vptq_head_bits", 0)), [], [], "", "")

    def reply(self, prompt: str, history_original, history_quantized, run_id: str, temperature, top_p,
              max_new_tokens, request: gr.Request):
        """Answer ``prompt`` with the original and the quantized model at the same time (one thread each, the
        same prompt and sampling settings), streaming both replies; each side's speed is its decode rate
        measured while the other side runs too. A side stops on its own Stop button or on Stop both."""
        owner = self.shared.owner(request)
        session_id = request.session_hash
        max_prompt_tokens = self.shared.settings.max_prompt_tokens
        histories = {"original": views.normalize_history(history_original),
                     "quantized": views.normalize_history(history_quantized)}
        try:
            max_new_tokens = int(max_new_tokens)
            check_sampling(max_new_tokens, float(temperature), float(top_p))
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError("type a message first")
            quant, original, why, _source = self.models.run_models(run_id, owner)
            sessions = self._open(dict(zip(SIDES, (original, quant))), histories, prompt, max_new_tokens)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        stats = {"original": "", "quantized": ""}
        for side in SIDES:
            histories[side].append({"role": "user", "content": prompt})
            text = "" if side in sessions else f"(original model not available: {why})"
            histories[side].append({"role": "assistant", "content": text})

        def shown(clear_prompt=False):
            return (histories["original"], histories["quantized"], stats["original"], stats["quantized"],
                    "" if clear_prompt else gr.skip())

        yield shown(clear_prompt=True)
        stops = {side: threading.Event() for side in sessions}
        with self._lock:
            self._chats[session_id] = {side: (sessions[side], stops[side]) for side in sessions}
        events: queue.Queue = queue.Queue()

        def run(side: str, session: ChatSession) -> None:
            try:
                share = (list(sessions).index(side), len(sessions))  # each side on its own core(s)
                for piece in session.stream(prompt, max_new_tokens=max_new_tokens, temperature=float(temperature),
                                            top_p=float(top_p), max_prompt_tokens=max_prompt_tokens,
                                            cpu_share=share):
                    events.put((side, "piece", piece))
                    if stops[side].is_set():
                        session.stop()  # (a Stop pressed before generation began)
                events.put((side, "done", session.last_stats))
            except Exception as exc:  # noqa: BLE001 - shown in that side's pane; the other side goes on
                events.put((side, "error", self.shared.public(exc)))

        for side, session in sessions.items():
            threading.Thread(target=run, args=(side, session), name=f"chat-{side}", daemon=True).start()
        pending = set(sessions)
        try:
            while pending:
                for side, kind, payload in _batch(events):  # one page update per batch
                    message = histories[side][-1]
                    if kind == "piece":
                        message["content"] += payload
                    elif kind == "done":
                        pending.discard(side)
                        stats[side] = views.chat_stats_md(payload, model_memory_bytes(sessions[side].model),
                                                          stops[side].is_set())
                    else:
                        pending.discard(side)
                        message["content"] += f"\n(generation failed: {payload})"
                yield shown()
        finally:  # the page went away or the event was cancelled: stop both generations
            for side, session in sessions.items():
                stops[side].set()
                session.stop()
            with self._lock:
                if self._chats.get(session_id, {}).keys() == sessions.keys():
                    self._chats.pop(session_id, None)
        yield shown()

    def _open(self, pairs: dict, histories: dict, prompt: str, max_new_tokens: int) -> dict[str, ChatSession]:
        """One session per side whose model is there, its history so far, the prompt checked against the limit
        and the model's context (ValueError naming the side)."""
        sessions: dict[str, ChatSession] = {}
        for side, pair in pairs.items():
            if pair is None:
                continue
            session = self.make_chat(*pair)
            session.history = [m for m in histories[side] if m["content"]]
            try:
                session.check_prompt(prompt, max_new_tokens, self.shared.settings.max_prompt_tokens)
            except ValueError as exc:
                raise ValueError(f"{side} model: {exc}") from None
            sessions[side] = session
        return sessions

    # ------------------------------------------------------------------------------------------ stop
    def stop_both(self, request: gr.Request) -> None:
        """Stop both sides."""
        self._stop_sides(getattr(request, "session_hash", None), SIDES)

    def stop_original(self, request: gr.Request) -> None:
        self._stop_sides(getattr(request, "session_hash", None), ("original",))

    def stop_quantized(self, request: gr.Request) -> None:
        self._stop_sides(getattr(request, "session_hash", None), ("quantized",))

    def stop_page(self, session: str) -> None:
        """The page of ``session`` went away: its chats stop and are forgotten."""
        with self._lock:
            chats = self._chats.pop(session, {})
        for chat_session, event in chats.values():
            event.set()
            chat_session.stop()

    def _stop_sides(self, session: str | None, sides: tuple[str, ...]) -> None:
        with self._lock:
            active = dict(self._chats.get(session, {}))
        for side in sides:
            if side in active:
                chat_session, event = active[side]
                event.set()
                chat_session.stop()

    @staticmethod
    def clear():
        return [], [], "", ""


def _batch(events: queue.Queue) -> list:
    """The next event (waiting for it) and whatever else has arrived by then."""
    batch = [events.get()]
    while True:
        try:
            batch.append(events.get_nowait())
        except queue.Empty:
            return batch
