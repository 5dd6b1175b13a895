"""The app's divergence view: a text compared under an uploaded run, streamed window by window with the same
numbers as the library, stopped by its Stop, offered as HTML; texts from an upload or the chat; refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gradio as gr
import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from studio_helpers import as_request, make_tiny_checkpoint, serve_app  # noqa: E402

from vptq_core.divergence import compute_divergence  # noqa: E402
from vptq_core.divergence_html import summary_line  # noqa: E402
from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.studio import views  # noqa: E402

served = pytest.fixture(scope="module", name="served")(serve_app)
tiny_checkpoint = pytest.fixture(scope="module", name="tiny_checkpoint")(make_tiny_checkpoint)
TEXT = "Where does the quantized model depart from the original? " * 12  # ~700 byte tokens: two windows


@pytest.fixture(scope="module")
def run(served, tiny_checkpoint):
    """(client, run id) of the tiny checkpoint uploaded as a run."""
    client = Client(served.url, verbose=False)
    archive = pack_checkpoint(tiny_checkpoint, tiny_checkpoint.parent / "div.zip")
    picked = client.predict(handle_file(str(archive)), api_name="/upload")[0]["value"]
    yield client, picked
    client.close()


def test_a_text_streams_per_window_with_the_librarys_numbers_and_an_html_download(served, run):
    client, run_id = run
    job = client.submit(TEXT, run_id, 1024, api_name="/divergence")
    job.result(timeout=120)
    updates = job.outputs()
    assert len(updates) >= 4  # waiting, window 1, window 2, final with the download
    (quant, tok), original, _why, _source = served.studio.models.run_models(run_id, client.session_hash)
    expected = compute_divergence(original[0], quant, tok, text=TEXT, max_tokens=1024)
    assert expected.done == expected.total == len(expected.rows) > 511
    view, download, status = updates[-1]
    assert status.startswith(f"Compared {len(expected.rows) - 1} tokens in ")
    assert f">{summary_line(expected.summary)}</p>" in view
    assert view.count('tabindex="0"') == len(expected.rows) - 1  # every predicted token can be opened
    first_window = updates[1][0]
    assert 0 < first_window.count('tabindex="0"') < len(expected.rows) - 1  # the page saw the first window alone
    assert download["visible"] is True
    page = Path(download["value"]).read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "https://" not in page and "http://" not in page
    assert f"run {run_id} vs its original tiny-random-llama" in page


def test_stop_ends_the_comparison_after_the_window_in_progress_and_keeps_it(served, run):
    client, run_id = run
    request = as_request(client)
    handlers = served.studio.divergence
    updates = handlers.compute(TEXT, run_id, 1024, request)
    next(updates)  # comparing…
    view, _, progress = next(updates)
    assert progress.startswith("512 of ")  # the first token (context) and the 511 the first window predicts
    handlers.stop(request)
    *_, (view, download, status) = updates
    assert status.startswith("Compared 511 tokens") and status.endswith("(stopped after 512 of 684 tokens: stopped).")
    assert view.count('tabindex="0"') == 511 and download.visible and Path(download.value["path"]).is_file()
    folder = handlers._files[request.session_hash]
    handlers.stop_page(request.session_hash)  # the page went away: its download goes
    assert not folder.exists()


def test_texts_come_from_an_upload_or_the_last_chat_answer(served, run, tmp_path, monkeypatch):
    client, _run_id = run
    good = tmp_path / "text.txt"
    good.write_text("naïve café\n", encoding="utf-8")
    assert client.predict(handle_file(str(good)), api_name="/divergence_upload") == "naïve café\n"
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    with pytest.raises(AppError, match=r"the text file is not UTF-8 text \(unexpected end of data at byte 3\)"):
        client.predict(handle_file(str(bad)), api_name="/divergence_upload")
    settings = dataclasses.replace(served.studio.settings, max_divergence_text_bytes=5)
    monkeypatch.setattr(served.studio.shared, "settings", settings)
    with pytest.raises(AppError, match=r"the text file is .* at most .* allowed"):
        client.predict(handle_file(str(good)), api_name="/divergence_upload")
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Yo"}]},
               {"role": "user", "content": "And?"}, {"role": "assistant", "content": "Answer two"}]
    assert served.studio.divergence.last_answer(history) == "Answer two"
    with pytest.raises(gr.Error, match="no answer yet"):
        served.studio.divergence.last_answer(history[:1])


def test_bad_requests_are_refused_in_one_line(served, run, monkeypatch):
    client, run_id = run
    for args, message in (((" ", run_id, 64), "paste a text first"), ((TEXT, "", 64), "pick a finished run")):
        with pytest.raises(AppError, match=message):
            client.predict(*args, api_name="/divergence")
    for tokens in (8, 4096, "many"):  # (the page's slider keeps within the range too)
        with pytest.raises(gr.Error, match=r"max tokens must be (in|a whole number in) 16\.\.2048"):
            next(served.studio.divergence.compute(TEXT, run_id, tokens, as_request(client)))
    quant = served.studio.models.run_models(run_id, client.session_hash)[0]
    monkeypatch.setattr(served.studio.models, "run_models",
                        lambda run_id, owner: (quant, None, "the checkpoint does not say", None))
    with pytest.raises(gr.Error, match="the original model is not available: the checkpoint does not say"):
        next(served.studio.divergence.compute(TEXT, run_id, 64, as_request(client)))


def test_an_evaluation_shows_the_kl_statistics():
    ev = {"perplexity": 20.0, "reference_perplexity": 18.0, "kl_divergence": 0.05, "top1_agreement": 0.9,
          "kl_median": 0.02, "kl_p90": 0.1, "kl_p99": 0.6, "kl_max": 2.5, "delta_p_mean": -0.012,
          "delta_p_p01": -0.4, "delta_p_p99": 0.2, "windows": 4, "seqlen": 512, "text": "wiki", "tokens": 2044,
          "seconds": 3.0}
    text = views.eval_md(ev)
    assert ("KL per token: median 0.0200, p90 0.1000, p99 0.6000, max 2.5000 nats · Δp of the original's top "
            "token: mean -1.20%, p01 -40.00%, p99 +20.00%") in text
    assert "KL per token" not in views.eval_md({**ev, "kl_p99": None})  # evaluations stored before them
    # the one-line protocol names the held-out split (evaluations stored before splits: the held-out documents)
    assert ("4 windows × 512 tokens spread over the test split of the bundled Wikipedia (documents no calibration "
            "uses) (2044 predicted tokens, 3 s)") in views.eval_md({**ev, "split": "test"})
    assert "spread over the bundled Wikipedia's held-out documents" in text
    assert "spread over the uploaded evaluation text" in views.eval_md({**ev, "text": "/tmp/x.txt"})
