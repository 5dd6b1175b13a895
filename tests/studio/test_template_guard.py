"""Chat templates run out of process within limits: a normal template gives exactly the ids transformers'
``apply_chat_template`` gives; a looping, huge or failing one gets a clear one-line reason; a looping one in an
uploaded checkpoint holds no chat slot past its limit or past a Stop, and other visitors' chats go on."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from studio_helpers import make_tiny_checkpoint, serve_app, texts  # noqa: E402

from vptq_core.models import BUNDLED, TINY, load_model, model_directory  # noqa: E402
from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.studio import template_guard  # noqa: E402
from vptq_core.studio.chat import ChatSession  # noqa: E402
from vptq_core.studio.template_guard import TemplateError, TemplateRenderer, chat_prompt_ids  # noqa: E402

served = pytest.fixture(scope="module", name="served")(serve_app)
tiny_checkpoint = pytest.fixture(scope="module", name="tiny_checkpoint")(make_tiny_checkpoint)

LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # CPU only, no output
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?", "name": None}]
# What chat templates on the hub use: loop controls, namespaces, tojson, raise_exception, the special tokens.
RICH = ("{%- set ns = namespace(n=0) -%}{{ bos_token }}{%- for m in messages -%}"
        "{%- if m.role not in ['system', 'user', 'assistant'] -%}{{ raise_exception('bad role') }}{%- endif -%}"
        "{%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}{%- set ns.n = ns.n + 1 -%}"
        "<{{ m.role }} {{ ns.n }}>{{ m.content | trim }}{{ {'k': m.content[:3]} | tojson }}{{ eos_token }}"
        "{%- if loop.last and add_generation_prompt %}<assistant>{% endif -%}{%- endfor -%}")


@pytest.fixture(scope="module")
def renderer():
    r = TemplateRenderer(time_limit_s=2.0)
    yield r
    r.close()


def test_normal_templates_give_the_ids_transformers_gives(renderer):
    bundled = AutoTokenizer.from_pretrained(model_directory(BUNDLED))
    _model, tiny = load_model(TINY)
    rich = AutoTokenizer.from_pretrained(model_directory(BUNDLED))
    rich.chat_template = RICH
    for tok in (bundled, tiny, rich):
        for messages, prompt in ((MESSAGES, True), (MESSAGES[1:2], True), (MESSAGES[:3], False)):
            expected = tok.apply_chat_template(messages, add_generation_prompt=prompt, return_tensors="pt",
                                               return_dict=True)["input_ids"]
            got = chat_prompt_ids(tok, messages, add_generation_prompt=prompt, renderer=renderer)
            assert torch.equal(got, expected)
    # The chat's own path (ChatSession) renders through the guard and gives the same ids.
    session = ChatSession(_model, bundled, system_prompt="Be brief.")
    expected = bundled.apply_chat_template(MESSAGES[:1] + MESSAGES[1:2], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    assert torch.equal(session.prompt_ids(MESSAGES[1:2]), expected)


def test_bad_templates_get_one_line_reasons_and_the_renderer_goes_on(renderer):
    cases = [(LOOPING, r"the chat template took longer than 2 s to render and was stopped"),
             ("{{ 'x' * 3000000000 }}", r"the chat template failed: it needs more memory than a chat template is "
                                        r"allowed"),
             ("{{ 'x' * 2000000 }}", r"the chat template failed: it wrote 2000000 characters; at most 1000000 are "
                                     r"allowed"),
             ("{{ raise_exception('no system role') }}", r"the chat template failed: TemplateError: no system role"),
             ("{{ ().__class__.__base__.__subclasses__() }}", r"SecurityError: access to attribute '__class__'"),
             ("{% for %}", r"the chat template failed: TemplateSyntaxError"),
             ("", r"the tokenizer has no chat template")]
    for template, reason in cases:
        with pytest.raises(TemplateError, match=reason):
            renderer.render(template, MESSAGES)
        assert renderer.render("{{ messages[0].content }}!", MESSAGES) == "Be brief.!"
    stop = threading.Event()
    stop.set()
    with pytest.raises(TemplateError, match="stopped while the chat template was rendering"):
        renderer.render(LOOPING, MESSAGES, stop=stop)


def test_stop_ends_a_render_in_its_scope_only(renderer, monkeypatch):
    monkeypatch.setattr(renderer, "time_limit_s", 600.0)  # only a Stop can end the render
    errors: dict[str, str] = {}

    def render(key: str) -> None:
        with template_guard.stoppable(key):
            try:
                renderer.render(LOOPING, MESSAGES)
            except TemplateError as exc:
                errors[key] = str(exc)

    thread = threading.Thread(target=render, args=("page-a",))
    thread.start()
    _wait_for(lambda: template_guard.rendering("page-a"))
    assert template_guard.stop("page-b") == 0 and thread.is_alive()
    assert template_guard.stop("page-a") == 1
    thread.join(60)
    assert not thread.is_alive() and errors == {"page-a": "stopped while the chat template was rendering"}
    assert not template_guard.rendering("page-a")


def _looping_archive(tiny_checkpoint, tmp_path):
    """The tiny checkpoint with a chat template that loops for hours, packed as an upload."""
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "looping")
    (ckpt / "chat_template.jinja").write_text(LOOPING, encoding="utf-8")
    assert AutoTokenizer.from_pretrained(ckpt).chat_template == LOOPING
    return pack_checkpoint(ckpt, tmp_path / "looping.zip")


def test_a_looping_uploaded_template_frees_the_chat_slots_on_stop_and_at_its_limit(served, tiny_checkpoint,
                                                                                   tmp_path, monkeypatch):
    looping = _looping_archive(tiny_checkpoint, tmp_path)
    normal = pack_checkpoint(tiny_checkpoint, tmp_path / "normal.zip")
    assert served.studio.settings.chat_concurrency == 2
    attackers = [Client(served.url, verbose=False) for _ in range(2)]
    visitor = Client(served.url, verbose=False)
    runs = [c.predict(handle_file(str(looping)), api_name="/upload")[0]["value"] for c in attackers]
    run = visitor.predict(handle_file(str(normal)), api_name="/upload")[0]["value"]
    assert texts(visitor.predict("Hello", [], [], run, 0.0, 1.0, 4, api_name="/chat")[1])[-1][1]
    # (so the original side's prompt, the same for everyone, is rendered: the attackers' chats go straight on to
    # their quantized side's template)
    monkeypatch.setattr(template_guard.default_renderer(), "time_limit_s", 600.0)  # only a Stop ends them
    held = [c.submit("Hello", [], [], r, 0.0, 1.0, 4, api_name="/chat") for c, r in zip(attackers, runs)]
    for client in attackers:
        _wait_for(lambda c=client: template_guard.rendering(c.session_hash))
    waiting = visitor.submit("Hello again", [], [], run, 0.0, 1.0, 4, api_name="/chat")
    time.sleep(0.5)
    assert not waiting.done()  # both chat slots are held by the looping templates
    for client, job in zip(attackers, held):
        client.predict(api_name="/chat_stop")
        with pytest.raises(AppError, match=r"run [0-9a-f]{12} model: stopped while the chat template was rendering"):
            job.result(timeout=60)
    original, quantized = waiting.result(timeout=120)[:2]
    assert texts(original)[0] == ("user", "Hello again") and texts(quantized)[0] == ("user", "Hello again")
    assert texts(quantized)[-1][0] == "assistant" and texts(quantized)[-1][1]
    # Without a Stop, the time limit ends the render with its reason, and the next chat is served.
    monkeypatch.setattr(template_guard.default_renderer(), "time_limit_s", 1.0)
    with pytest.raises(AppError, match=r"run [0-9a-f]{12} model: the chat template took longer than 1 s "
                                       r"to render and was stopped \(chat templates run with a time limit\)"):
        attackers[0].predict("Hello", [], [], runs[0], 0.0, 1.0, 4, api_name="/chat")
    assert texts(visitor.predict("Again", [], [], run, 0.0, 1.0, 4, api_name="/chat")[1])[-1][1]
    for client in (*attackers, visitor):
        client.close()


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)
