"""Chat templates are code (an uploaded checkpoint brings its own ``chat_template.jinja``), so the app never runs
one in its own process: ``chat_prompt_ids`` renders it in a worker process (``template_worker``: transformers'
own sandboxed renderer, so the text is exactly what ``apply_chat_template`` gives) with a time limit, an output
limit and a memory limit, and tokenizes the text here as ``apply_chat_template`` does. A worker that runs past
its time, or whose render is stopped, is killed; the caller gets a ``TemplateError`` naming the limit at once.

Stopping: a caller wraps the work that renders in ``stoppable(key)`` (the chat: the page's session); ``stop(key)``
kills whatever renders under that key, so a Stop frees the chat slot even while a template is still rendering.
Renders are cached by their inputs (template, messages, variables), since the chat renders the same prompt once to
check it and once to generate.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

TIME_LIMIT_S = 5.0  # one render
MAX_OUTPUT_CHARS = 1_000_000  # one rendered prompt
MEMORY_BYTES = 512 * 2**20  # a render's memory on top of the renderer's own
WORKER_CPU_S = 3600  # a worker's whole life: it ends even if the app that started it is gone
START_TIMEOUT_S = 120.0  # loading the renderer in a new worker (not counted in the render's limit)
WORKER = Path(__file__).with_name("template_worker.py")
_POLL_S = 0.02


class TemplateError(ValueError):
    """A chat template that failed, ran past a limit, or whose render was stopped."""


class _Worker:
    """One renderer process and the thread that reads its replies."""

    def __init__(self, memory_bytes: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", str(WORKER), str(memory_bytes), str(WORKER_CPU_S)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, encoding="utf-8")
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="template-worker-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                self.lines.put(line)
        except (OSError, ValueError):
            pass
        self.lines.put(None)

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                pipe.close()


class TemplateRenderer:
    """Renders chat templates in worker processes, each render within ``time_limit_s`` seconds,
    ``max_output_chars`` characters and ``memory_bytes`` of memory; idle workers are kept for the next render
    (at most ``max_idle``)."""

    def __init__(self, time_limit_s: float = TIME_LIMIT_S, max_output_chars: int = MAX_OUTPUT_CHARS,
                 memory_bytes: int = MEMORY_BYTES, max_idle: int = 2, cache_size: int = 64) -> None:
        self.time_limit_s = time_limit_s
        self.max_output_chars = max_output_chars
        self.memory_bytes = memory_bytes
        self.max_idle = max_idle
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._cache: OrderedDict[str, str] = OrderedDict()

    def render(self, template: str, messages: list[dict], add_generation_prompt: bool = True,
               variables: dict | None = None, stop: threading.Event | None = None) -> str:
        """The text of ``template`` for ``messages`` (``variables``: what else the template sees, e.g. the
        special tokens). TemplateError when the template fails, runs past a limit, or ``stop`` (default: the
        current ``stoppable`` scope's) is set meanwhile."""
        if not isinstance(template, str) or not template:
            raise TemplateError("the tokenizer has no chat template")
        request = {"template": template, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "variables": variables or {}, "max_chars": self.max_output_chars}
        key = json.dumps(request, sort_keys=True, default=str)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        stop = stop if stop is not None else _scope.get()
        worker = self._take(stop)
        try:
            worker.send(json.loads(key))
            line = self._wait(worker, time.monotonic() + self.time_limit_s, stop, "rendering")
        except BaseException:
            worker.kill()
            raise
        self._give_back(worker)
        reply = json.loads(line)
        if "error" in reply:
            raise TemplateError(f"the chat template failed: {reply['error']}")
        text = reply["text"]
        with self._lock:
            self._cache[key] = text
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return text

    def close(self) -> None:
        """End the idle workers (a render in progress ends its own)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _take(self, stop: threading.Event | None) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.poll() is None:
                    return worker
                worker.kill()
        worker = _Worker(self.memory_bytes)
        try:
            self._wait(worker, time.monotonic() + START_TIMEOUT_S, stop, "starting")
        except BaseException:
            worker.kill()
            raise
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(worker)
                return
        worker.kill()

    def _wait(self, worker: _Worker, deadline: float, stop: threading.Event | None, what: str) -> str:
        """The worker's next line; TemplateError when it does not come before ``deadline``, ``stop`` is set, or
        the worker ends (the caller kills the worker)."""
        while True:
            try:
                line = worker.lines.get(timeout=_POLL_S)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    raise TemplateError("stopped while the chat template was rendering") from None
                if time.monotonic() > deadline:
                    if what == "starting":
                        raise TemplateError("the chat template renderer did not start in time") from None
                    raise TemplateError(f"the chat template took longer than {self.time_limit_s:g} s to render and "
                                        "was stopped (chat templates run with a time limit)") from None
                continue
            if line is None:
                raise TemplateError(f"the chat template renderer ended while {what} (a template may use at most "
                                    f"{self.memory_bytes // 2**20} MB of memory)")
            return line


# ------------------------------------------------------------------------------------------ stopping
_scope: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("template_stop", default=None)
_scopes_lock = threading.Lock()
_scopes: dict[str, set[threading.Event]] = {}


@contextlib.contextmanager
def stoppable(key: str | None) -> Iterator[threading.Event]:
    """Renders inside this block (in this thread) stop when ``stop(key)`` is called."""
    event = threading.Event()
    with _scopes_lock:
        _scopes.setdefault(str(key), set()).add(event)
    token = _scope.set(event)
    try:
        yield event
    finally:
        _scope.reset(token)
        with _scopes_lock:
            events = _scopes.get(str(key), set())
            events.discard(event)
            if not events:
                _scopes.pop(str(key), None)


def stop(key: str | None) -> int:
    """Stop every render under ``stoppable(key)`` now; returns how many scopes were stopped."""
    with _scopes_lock:
        events = list(_scopes.get(str(key), ()))
    for event in events:
        event.set()
    return len(events)


def rendering(key: str | None) -> bool:
    """Whether anything is in a ``stoppable(key)`` block now."""
    with _scopes_lock:
        return bool(_scopes.get(str(key)))


# ------------------------------------------------------------------------------------------ tokenizers
_default: TemplateRenderer | None = None
_default_lock = threading.Lock()


def default_renderer() -> TemplateRenderer:
    """The renderer the chat uses (made on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TemplateRenderer()
        return _default


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    renderer: TemplateRenderer | None = None):
    """The prompt's token ids ([1, n] tensor) as ``tokenizer.apply_chat_template(messages, add_generation_prompt=...,
    return_tensors="pt")`` gives them, with the template rendered by ``renderer`` (default: ``default_renderer()``)
    within its limits."""
    get = getattr(tokenizer, "get_chat_template", None)
    template = get(None, None) if callable(get) else tokenizer.chat_template
    # What apply_chat_template does before rendering: keys whose value is None are dropped, and the template
    # sees the special tokens.
    plain = [{k: v for k, v in message.items() if v is not None} for message in messages]
    variables = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
    text = (renderer or default_renderer()).render(template, plain, add_generation_prompt, variables)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
