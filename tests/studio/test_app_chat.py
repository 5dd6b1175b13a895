"""The app's Chat tab: both sides stream at once and stop on their own, prompts are bounded, sampled replies
stay reproducible with both sides at once."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
import torch

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from studio_helpers import STATS, as_request, make_tiny_checkpoint, serve_app, texts  # noqa: E402

from vptq_core.models import TINY, load_model  # noqa: E402
from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.studio import views  # noqa: E402
from vptq_core.studio.chat import ChatSession, GenerationStats  # noqa: E402
from vptq_core.studio.run_models import Side  # noqa: E402

served = pytest.fixture(scope="module", name="served")(serve_app)
tiny_checkpoint = pytest.fixture(scope="module", name="tiny_checkpoint")(make_tiny_checkpoint)


class FakeSide:
    """A stand-in ``ChatSession``: streams tokens one per ``release()``, so a test decides who is ahead."""

    def __init__(self, model, tokenizer):
        self.model, self.name = torch.nn.Linear(2, 2), model
        self.history: list = []
        self.steps = threading.Semaphore(0)
        self.stopped = threading.Event()
        self.started = threading.Event()
        self.last_stats = None
        self.sent = 0

    def check_prompt(self, prompt, max_new_tokens, max_prompt_tokens=None):
        return None

    def stream(self, prompt, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0, max_prompt_tokens=None,
               cpu_share=None):
        self.started.set()
        for _ in range(max_new_tokens):
            while not self.steps.acquire(timeout=0.01):
                if self.stopped.is_set():
                    break
            if self.stopped.is_set():
                break
            self.sent += 1
            yield f"{self.name}{self.sent} "
        self.last_stats = GenerationStats(tokens=self.sent, seconds=1.0, first_token_seconds=0.5, prompt_tokens=3)

    def stop(self):
        self.stopped.set()


def test_both_chat_sides_stream_at_once_and_stop_on_their_own(served, monkeypatch):
    sides: dict[str, FakeSide] = {}

    def make_chat(model, tokenizer):
        sides[model] = FakeSide(model, tokenizer)
        return sides[model]

    monkeypatch.setattr(served.studio.chat, "make_chat", make_chat)
    monkeypatch.setattr(served.studio.models, "side_models", lambda run_id, picks, owner: [
        Side("original", ("O", None), "", "original", TINY), Side("run", ("Q", None), "", "run run", TINY)])
    request = as_request(SimpleNamespace(session_hash="chat-test-session"))
    replies = served.studio.chat.reply("Hello", [], [], "run", 0.0, 1.0, 6, request)
    first = next(replies)  # the prompt on both sides, empty replies
    assert texts(first[0]) == [("user", "Hello"), ("assistant", "")] and first[4] == ""
    updates: queue.Queue = queue.Queue()
    consumer = threading.Thread(target=lambda: [updates.put(out) for out in replies] + [updates.put(None)],
                                daemon=True)
    consumer.start()
    assert sides["O"].started.wait(5) and sides["Q"].started.wait(5)  # both generate before either gave a token

    def step(side: str):
        """Let ``side`` produce one token; the page update that shows it."""
        sides[side].steps.release()
        while True:
            out = updates.get(timeout=5)
            assert out is not None, "the chat ended early"
            if views.message_text((out[0] if side == "O" else out[1])[-1]["content"]).count(side) == sides[side].sent:
                return out

    out = step("Q")  # the quantized side's first token arrives while the original has given none
    assert (texts(out[0])[-1][1], texts(out[1])[-1][1]) == ("", "Q1 ")
    out = step("O")
    assert (texts(out[0])[-1][1], texts(out[1])[-1][1]) == ("O1 ", "Q1 ")
    served.studio.chat.stop_original(request)  # Stop on one side: the other goes on
    assert sides["O"].stopped.wait(5)
    for _ in range(5):
        out = step("Q")
    assert views.message_text(out[1][-1]["content"]) == "Q1 Q2 Q3 Q4 Q5 Q6 "
    assert views.message_text(out[0][-1]["content"]) == "O1 "
    rest = []
    while (item := updates.get(timeout=5)) is not None:
        rest.append(item)
    final = rest[-1] if rest else out
    assert STATS.search(final[2]).group(1) == "1" and "stopped" in final[2]
    assert STATS.search(final[3]).group(1) == "6" and "stopped" not in final[3]


def test_prompts_are_bounded_by_tokens_and_the_model_context(served, tiny_checkpoint):
    model, tok = load_model(TINY)
    session = ChatSession(model, tok)
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=r"the message is \d+ characters; at most 320 are accepted \(prompts are "
                                         r"limited to 10 tokens\)"):
        session.check_prompt("x" * 321, 4, max_prompt_tokens=10)
    with pytest.raises(ValueError, match=r"the prompt is \d+ tokens with the conversation so far; at most 10 are "
                                         r"allowed: shorten the message or press Clear"):
        session.check_prompt("hello " * 20, 4, max_prompt_tokens=10)
    with pytest.raises(ValueError, match=rf"plus max new tokens \({context}\) is \d+ tokens, more than the model's "
                                         rf"context of {context}"):
        session.check_prompt("hello", context)
    assert session.check_prompt("hello", 4, max_prompt_tokens=100).shape[0] == 1
    # Through the app: the limit and the reason reach the user before anything is generated.
    client = Client(served.url, verbose=False)
    picked = client.predict(handle_file(str(pack_checkpoint(tiny_checkpoint, tiny_checkpoint.parent / "p.zip"))),
                            api_name="/upload")[0]["value"]
    limit = served.studio.settings.max_prompt_tokens
    with pytest.raises(AppError, match=rf"original model: the message is 240000 characters; at most {32 * limit}"):
        client.predict("y" * 240_000, [], [], picked, 0.0, 1.0, 4, api_name="/chat")
    with pytest.raises(AppError, match=rf"original model: the prompt is \d+ tokens .*at most {limit} are allowed"):
        client.predict("hello " * (limit + 10), [], [], picked, 0.0, 1.0, 4, api_name="/chat")
    client.close()


def test_sampled_replies_stay_reproducible_with_both_sides_at_once(served):
    """Two sessions sampling at once (as the chat's two sides do) each give what their seed gives alone."""
    model, tok = load_model(TINY)
    alone = "".join(ChatSession(model, tok).stream("Hello", max_new_tokens=12, temperature=1.0, seed=3))
    outs: dict[int, str] = {}

    def side(i: int) -> None:
        outs[i] = "".join(ChatSession(model, tok).stream("Hello", max_new_tokens=12, temperature=1.0, seed=3))

    threads = [threading.Thread(target=side, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert alone and outs == {0: alone, 1: alone}


def test_page_updates_gather_the_tokens_of_an_interval_and_end_with_the_last_side():
    from vptq_core.studio.chat_handlers import _batch

    events: queue.Queue = queue.Queue()
    now = [100.0]
    for k in range(3):
        events.put(("quantized", "piece", f"t{k}"))
    late = threading.Timer(0.05, lambda: events.put(("original", "piece", "o0")))
    late.start()
    # both sides still writing and time left: it waits for what comes before ``until`` (a clock that stands still)
    got = _batch(events, until=100.3, pending={"original", "quantized"}, clock=lambda: now[0])
    late.join()
    assert [e[2] for e in got] == ["t0", "t1", "t2", "o0"]
    # past ``until``: what has arrived, without waiting
    events.put(("quantized", "piece", "t3"))
    assert [e[2] for e in _batch(events, until=99.0, pending={"quantized"}, clock=lambda: now[0])] == ["t3"]
    # the last writing side's end: no wait for the rest of the interval, however long
    events.put(("quantized", "piece", "t4"))
    events.put(("quantized", "done", None))
    assert [e[1] for e in _batch(events, until=1e9, pending={"quantized"}, clock=lambda: now[0])] == ["piece", "done"]
