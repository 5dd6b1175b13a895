"""Two runs of the tiny model in a real page (Debian's Chromium driven by Playwright): the first plans its bits by
sensitivity and shows the plan while it runs, the second is RTN; then the two side by side in the chat (run vs run)
and in the compare view. Screenshots go to test-artifacts/, small copies to docs/images/."""

from __future__ import annotations

import re
import time

import pytest
from browser_app import ARTIFACTS, CHROMIUM, doc_png
from test_browser import app, browser, page  # noqa: F401 - the same app, browser, page

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not __import__("pathlib").Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} missing"),
]
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright missing (pip install playwright)")


def _job_id(tab) -> str:
    return tab.locator("#job-id textarea, #job-id input").first.input_value()


def _run(tab, before: str) -> str:
    """Start a run with the form as it is; wait until it is done, evaluate it; its id."""
    tab.click("#start-btn")
    deadline = time.monotonic() + 120
    while _job_id(tab) in ("", before) and time.monotonic() < deadline:
        tab.wait_for_timeout(200)
    progress = tab.locator("#job-progress [data-status]")
    playwright_api.expect(progress).to_have_attribute("data-status", re.compile("done|failed"), timeout=120_000)
    assert progress.get_attribute("data-status") == "done", tab.locator("#job-progress").inner_text()
    tab.click("#eval-btn")
    playwright_api.expect(tab.locator("#eval-result")).to_contain_text("Perplexity", timeout=120_000)
    return _job_id(tab)


def _pick(tab, picker: str, run_id: str) -> None:
    tab.locator(f"{picker} input").click()
    tab.get_by_role("option", name=re.compile(run_id)).filter(visible=True).first.click()


def _shot(tab, name: str, selector: str | None = None) -> None:
    """A screenshot in test-artifacts/ (of ``selector``, else the tab) and a copy of at most 200 KB in docs/."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    if selector:
        tab.locator(selector).screenshot(path=str(path))
    else:
        tab.screenshot(path=str(path), full_page=True)
    doc_png(path, name)


def test_run_vs_run_chat_and_compare_in_the_browser(page):  # noqa: F811 - test_browser's fixture
    expect = playwright_api.expect
    expect(page.locator("#estimate")).to_contain_text("chosen by measured sensitivity", timeout=60_000)
    # The first run plans its bits by sensitivity: the plan's plot is shown in the job view.
    first = _run(page, "")
    expect(page.locator("#plot-bit-plan")).to_be_visible()
    expect(page.locator("#plot-bit-plan .hm, #plot-bit-plan .heatmaplayer")).not_to_have_count(0)
    expect(page.locator("#plot-bit-plan")).to_contain_text("Bit plan by sensitivity")
    _shot(page, "bit-plan", "#plot-bit-plan")
    # The second: RTN (no plan, so no plan plot).
    page.get_by_role("radio", name="RTN").check()
    expect(page.locator("#estimate")).to_contain_text("index bits")
    second = _run(page, first)
    expect(page.locator("#plot-bit-plan")).to_be_hidden()

    # Run vs run in the chat: the RTN run on the right (it follows the picked run), the VPTQ run on the left.
    page.get_by_role("tab", name="Chat").click()
    _pick(page, "#chat-run", second)
    expect(page.locator("#chat-models")).to_contain_text(f"Right · Quantized run {second}", timeout=60_000)
    _pick(page, "#chat-left", first)
    expect(page.locator("#chat-models")).to_contain_text(f"Left · Quantized run {first}", timeout=60_000)
    # seeded sampling: the random tiny model then prints visible text, the same on both sides at each seed
    page.get_by_text("Sampling", exact=True).click()
    page.locator("#chat-temperature input[type=number]").fill("1")
    page.locator("#chat-temperature input[type=number]").press("Tab")
    page.locator("#chat-prompt textarea").fill("Hello there")
    page.click("#chat-send")
    expect(page.locator("#stats-original")).to_contain_text("tokens/s", timeout=120_000)
    expect(page.locator("#stats-quantized")).to_contain_text("tokens/s", timeout=120_000)
    expect(page.locator("#chat-original")).to_contain_text("Hello there")
    expect(page.locator("#chat-quantized")).to_contain_text("Hello there")
    page.locator("#chat-models").scroll_into_view_if_needed()
    _shot(page, "run-vs-run-chat")

    # Compare: both runs, one column each in the table, one trace per run in every per-layer figure.
    page.get_by_role("tab", name="Compare runs").click()
    for run_id in (first, second):
        _pick(page, "#compare-pick", run_id)
    page.keyboard.press("Escape")
    page.click("#compare-btn")
    expect(page.locator("#compare-table")).to_contain_text(first[:6], timeout=60_000)
    expect(page.locator("#compare-table")).to_contain_text(second[:6])
    expect(page.locator("#compare-table")).to_contain_text("decode tokens/s (chat)")
    expect(page.locator("#compare-table")).to_contain_text("perplexity")
    for i in range(4):
        expect(page.locator(f"#compare-plot-{i} .scatterlayer .trace")).to_have_count(2)
    _shot(page, "compare-runs")
