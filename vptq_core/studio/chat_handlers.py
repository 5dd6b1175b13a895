"""The Chat tab: two sides, each the original model or any finished run of the browser (original vs run, run vs
run), answering the same prompt with the same sampling settings and seed at once (streaming both replies); stop
either side or both, clear."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import gradio as gr

from . import template_guard, views
from .chat import ChatSession, check_sampling, model_memory_bytes
from .run_models import ORIGINAL, RunModels, Side
from .services import Shared

SIDES = ("original", "quantized")  # the left and the right pane (by default the original and the picked run)


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
        return self.load_sides(run_id, ORIGINAL, "", request)

    def load_sides(self, run_id: str, left: str = ORIGINAL, right: str = "", request: gr.Request = None):
        """Load the models of both sides (``left`` / ``right``: ``"original"``, a run id, or empty for ``run_id``)
        and describe them; clears both conversations."""
        owner = self.shared.owner(request)
        if not run_id and not _runs(left, right):
            return views.NO_RUN, [], [], "", ""
        try:
            sides = self.models.side_models(run_id, (left or "", right or ""), owner)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        return (views.sides_md([_described(s) for s in sides], self.shared.dtype, self.shared.settings.device),
                [], [], "", "")

    def reply(self, prompt: str, history_original, history_quantized, run_id: str, temperature, top_p,
              max_new_tokens, request: gr.Request):
        """``reply_sides`` with the original on the left and ``run_id`` on the right, seed 0."""
        yield from self.reply_sides(prompt, history_original, history_quantized, run_id, temperature, top_p,
                                    max_new_tokens, ORIGINAL, "", 0, request)

    def reply_sides(self, prompt: str, history_left, history_right, run_id: str, temperature, top_p,
                    max_new_tokens, left: str = ORIGINAL, right: str = "", seed=0, request: gr.Request = None):
        """Answer ``prompt`` on both sides at the same time (one thread each, the same prompt, sampling settings
        and seed), streaming both replies; each side's speed is its decode rate measured while the other side runs
        too. A side stops on its own Stop button or on Stop both. ``left`` / ``right``: ``"original"``, a run id, or
        empty for ``run_id``."""
        owner = self.shared.owner(request)
        session_id = request.session_hash
        max_prompt_tokens = self.shared.settings.max_prompt_tokens
        histories = {"original": views.normalize_history(history_left),
                     "quantized": views.normalize_history(history_right)}
        try:
            max_new_tokens = int(max_new_tokens)
            check_sampling(max_new_tokens, float(temperature), float(top_p))
            seed = _seed(seed)
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError("type a message first")
            picked = dict(zip(SIDES, self.models.side_models(run_id, (left or "", right or ""), owner), strict=True))
            with template_guard.stoppable(session_id):  # Stop both ends a template that is still rendering
                sessions = self._open(picked, histories, prompt, max_new_tokens)
        except ValueError as exc:
            raise self.shared.error(exc) from None
        stats = {"original": "", "quantized": ""}
        for side in SIDES:
            histories[side].append({"role": "user", "content": prompt})
            text = "" if side in sessions else f"(original model not available: {picked[side].why})"
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
                                            top_p=float(top_p), seed=seed, max_prompt_tokens=max_prompt_tokens,
                                            cpu_share=share):
                    events.put((side, "piece", piece))
                    if stops[side].is_set():
                        session.stop()  # (a Stop pressed before generation began)
                events.put((side, "done", session.last_stats))
            except Exception as exc:  # noqa: BLE001 - shown in that side's pane; the other side goes on
                events.put((side, "error", self.shared.public(exc)))

        for side, session in sessions.items():
            threading.Thread(target=run, args=(side, session), name=f"chat-{side}", daemon=True).start()
        pending, shown_at = set(sessions), time.monotonic()
        try:
            while pending:
                batch = _batch(events, shown_at + UPDATE_INTERVAL_S, pending)
                for side, kind, payload in batch:  # one page update per batch
                    message = histories[side][-1]
                    if kind == "piece":
                        message["content"] += payload
                    elif kind == "done":
                        pending.discard(side)
                        stats[side] = views.chat_stats_md(payload, model_memory_bytes(sessions[side].model),
                                                          stops[side].is_set())
                        # sampled replies take turns (chat.ChatSession.stream): each measured alone
                        self._record_speed(picked[side], payload, owner, stopped=stops[side].is_set(),
                                           alongside=len(sessions) > 1 and float(temperature) == 0)
                    else:
                        pending.discard(side)
                        message["content"] += f"\n(generation failed: {payload})"
                shown_at = time.monotonic()
                yield shown()
        finally:  # the page went away or the event was cancelled: stop both generations
            for side, session in sessions.items():
                stops[side].set()
                session.stop()
            with self._lock:
                if self._chats.get(session_id, {}).keys() == sessions.keys():
                    self._chats.pop(session_id, None)
        yield shown()

    def _open(self, picked: dict[str, Side], histories: dict, prompt: str, max_new_tokens: int) -> dict:
        """One session per side whose model is there, its history so far, the prompt checked against the limit
        and the model's context (ValueError naming the side)."""
        sessions: dict[str, ChatSession] = {}
        for side, chosen in picked.items():
            if chosen.pair is None:
                continue
            session = self.make_chat(*chosen.pair)
            session.history = [m for m in histories[side] if m["content"]]
            try:
                session.check_prompt(prompt, max_new_tokens, self.shared.settings.max_prompt_tokens)
            except ValueError as exc:
                raise ValueError(f"{chosen.label} model: {exc}") from None
            sessions[side] = session
        return sessions

    def _record_speed(self, side: Side, stats, owner: str, alongside: bool, stopped: bool) -> None:
        """A run's decode rate in its last full chat reply, kept with the run (``extras["chat_speed"]``) for the
        compare view."""
        if side.pick == ORIGINAL or stopped or stats is None or stats.tokens < 2:
            return
        try:
            self.shared.manager.set_extra(side.pick, owner, "chat_speed", {
                "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2), "tokens": stats.tokens,
                "device": self.shared.settings.device, "alongside": alongside})
        except ValueError:
            pass  # the run was deleted meanwhile

    # ------------------------------------------------------------------------------------------ stop
    def stop_both(self, request: gr.Request) -> None:
        """Stop both sides."""
        self._stop_sides(getattr(request, "session_hash", None), SIDES)
        template_guard.stop(getattr(request, "session_hash", None))

    def stop_original(self, request: gr.Request) -> None:
        self._stop_sides(getattr(request, "session_hash", None), ("original",))

    def stop_quantized(self, request: gr.Request) -> None:
        self._stop_sides(getattr(request, "session_hash", None), ("quantized",))

    def stop_page(self, session: str) -> None:
        """The page of ``session`` went away: its chats stop and are forgotten."""
        with self._lock:
            chats = self._chats.pop(session, {})
        template_guard.stop(session)
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

    # --------------------------------------------------------------------------------- the side pickers
    def follow_run(self, run_id: str, left: str, right: str, request: gr.Request):
        """The run picked above goes to the right side (fresh choices on both)."""
        return self._pickers(self.shared.owner(request), left, run_id or right)

    def refresh_sides(self, left: str, right: str, request: gr.Request):
        """Both side pickers with the browser's finished runs now; a pick that is gone falls back."""
        return self._pickers(self.shared.owner(request), left, right)

    def _pickers(self, owner: str, left: str, right: str):
        _rows, _fig, choices = self.shared.runs_view(owner)
        choices = [("Original model (of the run picked above)", ORIGINAL), *choices]
        ids = {value for _label, value in choices}
        return (gr.Dropdown(choices=choices, value=left if left in ids else ORIGINAL),
                gr.Dropdown(choices=choices, value=right if right in ids else ""))

    @staticmethod
    def clear():
        return [], [], "", ""


# The page is updated at most this often while replies stream: every update sends both conversations and makes
# the browser render them again, work that shares the CPU with the two generations (bench/chat_screenshot.py).
UPDATE_INTERVAL_S = 0.25


def _batch(events: queue.Queue, until: float, pending: set[str], clock=time.monotonic) -> list:
    """The next event (waiting for it) and whatever else arrives before ``until`` (a ``clock`` time) or until no
    side in ``pending`` is left writing, whichever comes first."""
    batch = [events.get()]
    left = set(pending)
    while True:
        side, kind, _ = batch[-1]
        if kind != "piece":
            left.discard(side)
        wait = until - clock()
        try:
            batch.append(events.get(timeout=wait) if wait > 0 and left else events.get_nowait())
        except queue.Empty:
            return batch


def _runs(*picks: str) -> list[str]:
    return [p for p in picks if p and p != ORIGINAL]


def _seed(value) -> int:
    try:
        seed = int(value if value not in (None, "") else 0)
    except (TypeError, ValueError):
        raise ValueError(f"seed must be an integer in 0..2**31-1, got {value!r}") from None
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be an integer in 0..2**31-1, got {seed}")
    return seed


def _described(side: Side) -> dict:
    """What ``views.sides_md`` shows of one side."""
    model = side.pair[0] if side.pair else None
    return {"label": side.label, "source": side.source, "why": side.why, "original": side.pick == ORIGINAL,
            "bytes": model_memory_bytes(model) if model is not None else None,
            "head_bits": getattr(model, "vptq_head_bits", 0) if model is not None else 0}
