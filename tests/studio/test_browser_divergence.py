"""The divergence view in a real page: Debian's Chromium driven by Playwright uploads a 4-bit round-to-nearest
checkpoint of the bundled SmolLM2, compares it with its original on a pasted text, opens a token's top-5, takes the
HTML download; screenshots go to test-artifacts/ and docs/images/divergence.png."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vptq_core.models import BUNDLED, load_model
from vptq_core.quant.blocks import block_linears, decoder_blocks
from vptq_core.quant.rtn import rtn_quantize
from vptq_core.storage.archive import pack_checkpoint
from vptq_core.storage.checkpoint import save_quantized

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
                 "--no-first-run", "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
DOC_IMAGE = ROOT / "docs" / "images" / "divergence.png"
TEXT = ("Vector quantization stores each group of weights as the index of its nearest centroid in a small "
        "codebook. At two or three bits per weight, the model still writes fluent English, but some tokens are "
        "predicted differently: rare names, numbers such as 1984 or 3.14159, and the first word after a full stop.\n"
        "def add(a, b):\n    return a + b  # <not> & \"quoted\"\n")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} missing (apt-get install -y chromium)"),
]
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright missing (pip install playwright)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """``python app.py --tiny`` in a subprocess, as a user would start it: its url."""
    port = _free_port()
    workdir = tmp_path_factory.mktemp("browser-divergence")
    env = dict(os.environ, GRADIO_SERVER_PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1",
               GRADIO_ANALYTICS_ENABLED="False", VPTQ_NATIVE=os.environ.get("VPTQ_NATIVE", "0"))
    log = open(workdir / "app.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen([sys.executable, "app.py", "--tiny", "--workdir", str(workdir / "runs")], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                raise RuntimeError(f"app did not start:\n{(workdir / 'app.log').read_text()[-3000:]}") from None
            time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def rtn4_archive(tmp_path_factory) -> Path:
    """The bundled model with every block linear rounded to 4 bits (groups of 64), as an uploadable zip."""
    model, tok = load_model(BUNDLED)
    states = {f"model.layers.{b}.{name}": rtn_quantize(m.weight.detach(), 4, 64)
              for b, block in enumerate(decoder_blocks(model)) for name, m in block_linears(block).items()}
    out = tmp_path_factory.mktemp("rtn4")
    ckpt = save_quantized(model, tok, states, out / "smollm2-rtn4", report={"model": {"source": BUNDLED},
                                                                          "method": "rtn"})
    return pack_checkpoint(ckpt, out / "smollm2-rtn4.zip")


def _small_png(source: Path, target: Path, max_bytes: int = 200_000) -> None:
    """``source`` as a palette PNG (UI colours fit in 256), scaled down until it is at most ``max_bytes``."""
    from PIL import Image

    image = Image.open(source).convert("RGB")
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(target, optimize=True)
        if target.stat().st_size <= max_bytes:
            return
        image = image.resize((int(image.width * 0.85), int(image.height * 0.85)), Image.Resampling.LANCZOS)


def test_divergence_view_colours_tokens_and_opens_their_top5(app, rtn4_archive, tmp_path):
    expect = playwright_api.expect
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(app)
        page.get_by_role("tab", name="Chat").click()
        page.locator("#archive-upload input[type=file]").set_input_files(str(rtn4_archive))
        expect(page.locator("#chat-models")).to_contain_text("Original", timeout=240_000)
        expect(page.locator("#div-view")).to_contain_text("press Compare")

        page.locator("#div-text textarea").fill(TEXT)
        page.click("#div-compare")
        expect(page.locator("#div-status")).to_contain_text("Compared", timeout=240_000)
        tokens = page.locator("#div-view .vq-t")
        count = tokens.count()
        assert count > 60
        coloured = page.locator("#div-view .vq-t[style*='background']").count()
        assert 0 < coloured <= count
        assert page.locator("#div-view .vq-x").count() > 0  # 4 bits: some top-1 predictions differ
        expect(page.locator("#div-view .vq-text")).to_contain_text('return a + b  # <not> & "quoted"',
                                                                   use_inner_text=True)
        summary = page.locator("#div-view [data-testid=divergence-summary]").inner_text()
        assert re.match(rf"{count} tokens · KL mean [\d.]+, median", summary), summary

        # Hover the token the two models disagree on most: both top-5 lists appear, with probabilities.
        kls = [float(v) for v in tokens.evaluate_all("els => els.map(e => e.dataset.kl)")]
        worst = tokens.nth(max(range(count), key=kls.__getitem__))
        worst.scroll_into_view_if_needed()
        worst.hover()
        tip = worst.locator(".vq-tip")
        expect(tip).to_be_visible()
        expect(tip).to_contain_text("original top-5")
        expect(tip).to_contain_text("quantized top-5")
        assert tip.locator("tr").count() == 6 and len(re.findall(r"\d%", tip.inner_text())) >= 10
        box, view = tip.bounding_box(), page.locator("#div-view").bounding_box()
        assert view["x"] <= box["x"] and box["x"] + box["width"] <= view["x"] + view["width"]  # inside the view
        page.locator("#div-section").screenshot(path=str(ARTIFACTS / "divergence.png"))
        _small_png(ARTIFACTS / "divergence.png", DOC_IMAGE)

        # A click keeps a token open (focus) after the mouse leaves it.
        other = tokens.nth(count // 2)
        other.click()
        page.mouse.move(0, 0)
        expect(other.locator(".vq-tip")).to_be_visible()

        with page.expect_download() as download_info:
            page.click("#div-download")
        saved = tmp_path / "divergence.html"
        download_info.value.save_as(saved)
        html = saved.read_text(encoding="utf-8")
        assert html.startswith("<!DOCTYPE html>") and "https://" not in html and "http://" not in html
        assert html.count('tabindex="0"') == count
        offline = browser.new_context(offline=True)  # the file works with no network at all
        file_page = offline.new_page()
        file_page.goto(saved.as_uri())
        file_page.locator(".vq-t").nth(3).hover()
        expect(file_page.locator(".vq-t").nth(3).locator(".vq-tip")).to_be_visible()
        offline.close()
        context.close()
        browser.close()
