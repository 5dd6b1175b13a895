"""A real restart of ``python app.py`` under a page in Chromium, with no ``VPTQ_APP_SECRET``: while the server is
gone the page says "Connection to the server was lost" (and nothing recovers it, there is nothing to reach); once
the server is back on the same work directory the page reloads itself, reads its identity back with the key kept
in the work directory, and shows its run again. A stranger's browser still sees nothing."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

pytest.importorskip("gradio_client")
from browser_app import CHROMIUM, CHROMIUM_ARGS, start_app  # noqa: E402
from studio_helpers import free_port, make_tiny_checkpoint  # noqa: E402

from vptq_core.storage.archive import pack_checkpoint  # noqa: E402
from vptq_core.studio.browser_secret import SECRET_FILE  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} missing (apt-get install -y chromium)"),
]
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright missing (pip install playwright)")
tiny_checkpoint = pytest.fixture(scope="module", name="tiny_checkpoint")(make_tiny_checkpoint)


def _start(port: int, workdir: Path, log_path: Path):
    return start_app(port, workdir, log_path, drop_env=("VPTQ_APP_SECRET",))


def test_a_page_finds_its_run_after_a_real_restart_without_a_secret(tmp_path, tiny_checkpoint):
    expect = playwright_api.expect
    port, workdir, log = free_port(), tmp_path / "runs", tmp_path / "app.log"
    archive = pack_checkpoint(tiny_checkpoint, tmp_path / "tiny.zip")
    proc = _start(port, workdir, log)
    url = f"http://127.0.0.1:{port}/"
    try:
        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(url)
            expect(page.locator("#estimate")).to_contain_text("total bits", timeout=60_000)
            page.get_by_role("tab", name="Chat").click()
            page.locator("#archive-upload input[type=file]").set_input_files(str(archive))
            expect(page.locator("#chat-models")).to_contain_text("Quantized", timeout=60_000)
            (run_id,) = [d.name for d in (workdir / "jobs").iterdir()]
            expect(page.locator("#runs-table")).to_contain_text(run_id)

            # The server dies: the next event finds no server, and the page says so.
            page.evaluate("() => { window.beforeRestart = true; }")  # gone once the page reloads
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            page.click("#chat-clear")
            expect(page.get_by_text("Connection to the server was lost").first).to_be_visible(timeout=30_000)

            # Back on the same work directory: the page reloads itself and its run is there.
            proc = _start(port, workdir, log)
            page.wait_for_function("() => window.beforeRestart === undefined", timeout=120_000)
            expect(page.locator("#estimate")).to_contain_text("total bits", timeout=60_000)
            expect(page.locator("#runs-table")).to_contain_text(run_id, timeout=60_000)
            expect(page.get_by_text("Connection to the server was lost")).to_have_count(0)
            assert (workdir / SECRET_FILE).stat().st_mode & 0o777 == 0o600

            stranger = browser.new_page()
            stranger.goto(url)
            expect(stranger.locator("#estimate")).to_contain_text("total bits", timeout=60_000)
            assert run_id not in stranger.locator("#runs-table").inner_text()
            browser.close()
    finally:
        proc.kill()
        proc.wait(30)
