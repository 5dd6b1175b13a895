"""The app in a real page: Debian's Chromium driven by Playwright clicks through quantize (with a cancel and
bad settings), live plots, evaluate, download, a reload that keeps the runs, side-by-side chat, a refused and
an accepted upload, and a stranger's browser that reaches none of it. Screenshots go to test-artifacts/."""

from __future__ import annotations

import re
import shutil
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
from browser_app import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, start_app, stop_app
from studio_helpers import free_port

from vptq_core.quant.config import DISTILL_LR

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} missing (apt-get install -y chromium)"),
]
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright missing (pip install playwright)")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """``python app.py --tiny`` in a subprocess, as a user would start it: (url, work directory)."""
    port, workdir = free_port(), tmp_path_factory.mktemp("browser-app")
    proc = start_app(port, workdir / "runs", workdir / "app.log")
    yield f"http://127.0.0.1:{port}/", (workdir / "runs").resolve()
    stop_app(proc)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(app, browser, request):
    context = browser.new_context(viewport={"width": 1440, "height": 1000}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.events = []  # what the page went through, for a failure's message: loads, console errors, failed requests
    page.on("load", lambda _: page.events.append(f"{time.strftime('%X')} load"))
    page.on("console", lambda m: m.type in ("error", "warning") and page.events.append(
        f"{time.strftime('%X')} console {m.type}: {m.text[:300]}"))
    page.on("requestfailed", lambda r: page.events.append(
        f"{time.strftime('%X')} request failed: {r.url[-80:]} {r.failure}"))
    page.goto(app[0])
    yield page
    ARTIFACTS.mkdir(exist_ok=True)
    name = request.module.__name__.rpartition(".")[2]  # one file per module that uses this page fixture
    (ARTIFACTS / f"page-events-{name}.txt").write_text("\n".join(page.events) + "\n")
    context.close()


def _status(page) -> str:
    return page.locator("#job-progress [data-status]").get_attribute("data-status")


def _wait_status(page, statuses: tuple[str, ...], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if page.locator("#job-progress [data-status]").count():
            status = _status(page)
            if status in statuses:
                return status
        page.wait_for_timeout(200)
    raise AssertionError(f"job never reached {statuses}; progress: {page.locator('#job-progress').inner_text()}")


def _set_number(page, label: str, value: str) -> None:
    field = page.get_by_label(label, exact=True)
    field.fill(value)
    field.press("Tab")


def _error_badges(page) -> int:
    """Red "Error" marks on output components (not the toast that explains a refusal)."""
    return page.locator('[data-testid="status-tracker"] .error:visible').count()


def _guard(page) -> tuple[str, str]:
    guard = page.locator("[data-guard]")
    return guard.get_attribute("data-busy"), guard.get_attribute("data-unexported")


def _leaving_asks(page) -> bool:
    """Whether the page's beforeunload handler would ask before leaving now. The event goes to the document, not
    the window: the page's handler listens in the capture phase and hears it; Gradio's own listener on the
    window would close the page's connection (as a browser's real event does), and the page would reload itself
    at its next event, losing the form (see ``_loads``)."""
    return page.evaluate("() => { const e = new Event('beforeunload', {cancelable: true}); "
                         "document.dispatchEvent(e); return e.defaultPrevented; }")


def _loads(page) -> int:
    """How many times the page has loaded (Gradio reloads it by itself after it lost its connection)."""
    return sum(event.endswith(" load") for event in page.events)


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_quantize_evaluate_download_reload_chat_in_the_browser(app, browser, page, tmp_path):
    url, workdir = app
    expect = playwright_api.expect
    ARTIFACTS.mkdir(exist_ok=True)
    # The 2.5-bit preset plans each layer's bits at the start of the run: the estimate gives its bound.
    expect(page.locator("#estimate")).to_contain_text("≤ 2.500 total bits", timeout=60_000)
    expect(page.locator("#estimate")).to_contain_text("chosen by measured sensitivity")
    expect(page.locator("#estimate")).to_contain_text("14 linears in 2 blocks")
    expect(page.locator("#estimate")).to_contain_text("Takes ≈")  # the duration, before Start
    expect(page.locator("#vq-header")).to_contain_text("12 h after they finish")

    # A bad setting: the estimate says why in the form's words, and Start is disabled until it is fixed.
    page.get_by_text("Advanced settings").click()
    _set_number(page, "centroids (power of 2)", "1000")
    expect(page.locator("#estimate")).to_contain_text("centroids must be a power of two in 2..65536, got 1000")
    expect(page.locator("#start-btn")).to_be_disabled()
    _set_number(page, "centroids (power of 2)", "16")
    expect(page.locator("#start-btn")).to_be_enabled()
    # A seed beyond 64 bits names the field, no overflow.
    _set_number(page, "seed (0..2^64 - 1)", str(2**64))
    expect(page.locator("#estimate")).to_contain_text("seed must be in 0..18446744073709551615")
    expect(page.locator("#start-btn")).to_be_disabled()
    _set_number(page, "seed (0..2^64 - 1)", "0")
    expect(page.locator("#start-btn")).to_be_enabled()
    # The distillation step is a field the preset fills in, refused out of range in the form's words.
    lr_label = "distillation lr (VPTQ: × the codebooks' RMS)"
    assert float(page.get_by_label(lr_label, exact=True).input_value()) == DISTILL_LR
    _set_number(page, lr_label, "2")
    expect(page.locator("#estimate")).to_contain_text("distillation lr must be in [0.0, 1.0], got 2")
    expect(page.locator("#start-btn")).to_be_disabled()
    _set_number(page, lr_label, str(DISTILL_LR))
    expect(page.locator("#start-btn")).to_be_enabled()
    expect(page.get_by_label("codebook refit steps (after the sweep; 0 = off)", exact=True)).to_have_value("0")
    assert _error_badges(page) == 0  # the refused settings marked no component with an error

    # A slower job (v2 k64, the preset's total-bits budget and per-layer bits cap off so the vectors stay that
    # short), cancelled while it runs: the page reports it and stays usable. A budget of 0 leaves the
    # sensitivity allocation nothing to spend: the estimate says so until the allocation is "cap".
    _set_number(page, "total bits budget (0 = off)", "0")
    expect(page.locator("#estimate")).to_contain_text("bits allocation 'sensitivity' spends a total bits budget")
    expect(page.locator("#start-btn")).to_be_disabled()
    page.get_by_label("bits allocation (sensitivity = measured per layer)").click()
    page.get_by_role("option", name="cap", exact=True).click()
    expect(page.locator("#estimate")).to_contain_text("index bits")
    _set_number(page, "max total bits per layer (0 = off)", "0")
    _set_number(page, "centroids (power of 2)", "64")
    _set_number(page, "vector length", "2")
    _set_number(page, "k-means iterations", "30")
    # many more distillation steps than the few seconds the rest takes (a minute or two on the tiny model): the job
    # is surely still running when the cancel lands
    preset_steps = page.get_by_label("distillation steps", exact=True).input_value()
    _set_number(page, "distillation steps", "3000")
    page.click("#start-btn")
    _wait_status(page, ("running",))
    assert _guard(page)[0] == "1" and _leaving_asks(page)  # leaving the page now asks first
    page.click("#cancel-btn")
    try:
        status = _wait_status(page, ("cancelled", "done"), timeout=30)
    except AssertionError:  # under heavy load a click has gone missing in the page before reaching the server
        page.click("#cancel-btn")
        status = _wait_status(page, ("cancelled", "done"))
    assert status == "cancelled"
    expect(page.locator("#job-progress")).to_contain_text("nothing was saved")
    assert _loads(page) == 1, page.events[-20:]  # the page kept its connection: it never reloaded by itself

    # The real run: live plots and the layer table fill in, then the summary and the download appear.
    try:
        _set_number(page, "centroids (power of 2)", "16")
    except Exception as exc:  # a page that stopped answering after a cancel: kept for whoever looks next
        page.screenshot(path=str(ARTIFACTS / "after-cancel-failure.png"), full_page=True)
        raise AssertionError(f"the form did not answer after the cancel: {str(exc)[:1000]}; "
                             f"page events: {page.events[-30:]}") from None
    _set_number(page, "vector length", "4")
    _set_number(page, "k-means iterations", "2")
    _set_number(page, "distillation steps", preset_steps)
    page.click("#start-btn")
    assert _wait_status(page, ("done", "failed")) == "done", page.locator("#job-progress").inner_text()
    job_id = page.locator("#job-id textarea, #job-id input").first.input_value()
    assert len(job_id) == 12
    expect(page.locator("#plot-lines .legendtext", has_text="down_proj")).to_have_count(1)
    expect(page.locator("#plot-heatmap .hm, #plot-heatmap .heatmaplayer")).not_to_have_count(0)
    expect(page.locator("#layer-table")).to_contain_text("mlp.down_proj")
    expect(page.locator("#job-summary")).to_contain_text("Done:")
    assert _guard(page) == ("0", "1") and _leaving_asks(page)  # a result not taken home yet
    page.click("#eval-btn")
    expect(page.locator("#eval-result")).to_contain_text("Perplexity", timeout=120_000)
    expect(page.locator("#eval-result")).to_contain_text("top-1 agreement")
    expect(page.locator("#runs-table")).to_contain_text(job_id)
    expect(page.locator("#runs-plot .scatterlayer .point")).to_have_count(1)
    page.locator("#job-progress").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "quantize.png"), full_page=True)
    with page.expect_download() as download_info:
        page.click("#download-btn")
    archive = tmp_path / "run.zip"
    download_info.value.save_as(archive)
    assert job_id not in download_info.value.suggested_filename
    with zipfile.ZipFile(archive) as zf:
        names = {Path(n).name for n in zf.namelist()}
    assert {"config.json", "model.safetensors", "quant_report.json", "tokenizer.json", "README.md"} <= names
    expect(page.locator("[data-guard]")).to_have_attribute("data-unexported", "0")
    assert _loads(page) == 1, page.events[-20:]

    # Nothing on the page names the work directory; the raw job JSON has no owner and no server path.
    page.get_by_text("Raw job status (JSON)").click()
    expect(page.locator("#job-json")).to_contain_text("archive_name")
    body = page.locator("body").inner_text()
    assert str(workdir) not in body and '"owner"' not in body and "checkpoint_dir" not in body

    # Leaving now does not ask; a reload brings back the runs, the finished job and its download.
    assert not _leaving_asks(page)
    page.reload()
    expect(page.locator("#runs-table")).to_contain_text(job_id, timeout=60_000)
    expect(page.locator("#job-summary")).to_contain_text("Done:")
    expect(page.locator("#download-btn")).to_be_visible()
    expect(page.locator("#eval-result")).to_contain_text("Perplexity")

    # Chat: the finished run can be picked; both panes answer and show their speed and memory.
    page.get_by_role("tab", name="Chat").click()
    page.locator("#chat-run input").click()
    page.get_by_role("option", name=re.compile(job_id)).click()
    expect(page.locator("#chat-models")).to_contain_text("Quantized", timeout=60_000)
    expect(page.locator("#chat-models")).to_contain_text("Original")
    expect(page.locator("#chat-speed-note")).to_contain_text("Greedy (temperature 0): at the same time")
    page.locator("#chat-prompt textarea").fill("Hello there")
    page.click("#chat-send")
    expect(page.locator("#stats-quantized")).to_contain_text("tokens/s", timeout=120_000)
    expect(page.locator("#stats-original")).to_contain_text("tokens/s")
    expect(page.locator("#chat-original")).to_contain_text("Hello there")
    expect(page.locator("#chat-quantized")).to_contain_text("Hello there")
    page.screenshot(path=str(ARTIFACTS / "chat.png"), full_page=True)

    # A refused upload explains itself in a toast and leaves no red marks on the outputs.
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("../model.safetensors", b"x")
    page.locator("#archive-upload input[type=file]").set_input_files(str(bad))
    expect(page.get_by_text("path traversal").first).to_be_visible(timeout=30_000)
    page.wait_for_timeout(500)
    assert _error_badges(page) == 0

    # Load the downloaded archive back and chat with it; Clear empties both panes.
    page.locator("#archive-upload input[type=file]").set_input_files(str(archive))
    expect(page.locator("#chat-models")).to_contain_text("Quantized", timeout=60_000)
    expect(page.locator("#chat-run input")).not_to_have_value(re.compile(job_id), timeout=30_000)
    page.click("#chat-eval-btn")
    expect(page.locator("#chat-eval-result")).to_contain_text("Perplexity", timeout=120_000)
    page.click("#chat-clear")
    expect(page.locator("#stats-quantized")).to_have_text("")
    page.locator("#chat-prompt textarea").fill("Hi again")
    page.click("#chat-send")
    expect(page.locator("#stats-quantized")).to_contain_text("tokens/s", timeout=120_000)
    expect(page.locator("#chat-quantized")).to_contain_text("Hi again")
    shutil.copyfile(archive, ARTIFACTS / "downloaded_run.zip")

    # A stranger's browser: no runs, and no file of the work directory by path, knowing it and the job id.
    stranger = browser.new_context(viewport={"width": 1200, "height": 900})
    other = stranger.new_page()
    other.goto(url)
    expect(other.locator("#estimate")).to_contain_text("total bits", timeout=60_000)
    assert job_id not in other.locator("#runs-table").inner_text()
    files = [p for p in (workdir / "jobs" / job_id).rglob("*") if p.is_file()]
    assert files
    for path in files[:5]:
        response = other.request.get(f"{url}gradio_api/file={path}")
        assert response.status == 403, path
    stranger.close()
