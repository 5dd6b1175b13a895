"""The divergence view in a real page: Debian's Chromium driven by Playwright uploads a 4-bit round-to-nearest
checkpoint of the bundled SmolLM2, compares it with its original on a pasted text, opens a token's top-5, takes the
HTML download; screenshots go to test-artifacts/ and docs/images/divergence.png."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from browser_app import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, doc_png, start_app, stop_app
from studio_helpers import free_port

from vptq_core.models import BUNDLED, load_model
from vptq_core.quant.blocks import block_linears, decoder_blocks
from vptq_core.quant.rtn import rtn_quantize
from vptq_core.storage.archive import pack_checkpoint
from vptq_core.storage.checkpoint import save_quantized

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


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """``python app.py --tiny`` in a subprocess, as a user would start it: its url."""
    port, workdir = free_port(), tmp_path_factory.mktemp("browser-divergence")
    proc = start_app(port, workdir / "runs", workdir / "app.log")
    yield f"http://127.0.0.1:{port}/"
    stop_app(proc)


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
        doc_png(ARTIFACTS / "divergence.png", "divergence")

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
