"""The app's chat as a user sees it, measured in a real browser: both sides' decode tokens/s and a screenshot.

``python app.py`` starts on the bundled SmolLM2 (its own work directory, native kernels on); Chromium (Playwright)
uploads a packed checkpoint as a zip on the Chat tab, so the right side is that run and the left side its
original in bf16; then, for ``--replies`` prompts, it sends the prompt greedily (temperature 0: both sides
generate at the same time, one core each on a 2-core machine, each side's rate measured while the other runs)
and reads both sides' "N tokens · X tokens/s" lines. It prints each reply's rates and their ratio, the median
ratio, and writes the last page to ``--screenshot`` (a palette PNG, at most 200 kB).

    python bench/chat_screenshot.py --checkpoint DIR [--screenshot assets/screenshot_chat.png] [--replies 3]
    python bench/chat_screenshot.py --tiny --checkpoint DIR_OF_A_TINY_RUN --replies 1 --tokens 4   # runs at all
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from browser_app import CHROMIUM, CHROMIUM_ARGS, start_app, stop_app  # noqa: E402

PROMPTS = ["Explain in a few sentences why the sky is blue.",
           "Write a short paragraph about the history of the printing press.",
           "What are three good habits for writing clear Python code?"]
RATE = re.compile(r"(\d+) tokens · \*?\*?([\d.]+) tokens/s")


def rates(page) -> tuple[tuple[int, float], tuple[int, float]]:
    """(tokens, tokens/s) of the original's and the quantized side's last reply."""
    got = []
    for side in ("#stats-original", "#stats-quantized"):
        match = RATE.search(page.locator(side).inner_text())
        if match is None:
            raise SystemExit(f"no rate in {side}: {page.locator(side).inner_text()!r}")
        got.append((int(match.group(1)), float(match.group(2))))
    return got[0], got[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a packed checkpoint directory of the bundled model")
    parser.add_argument("--screenshot", default=str(ROOT / "test-artifacts" / "chat_measured.png"))
    parser.add_argument("--replies", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=0, help="max new tokens per reply (0: the page's default)")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--tiny", action="store_true", help="the app on the tiny test model (a checkpoint of it)")
    args = parser.parse_args()

    from playwright.sync_api import expect, sync_playwright

    from vptq_core.storage.archive import pack_checkpoint

    if not args.port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    work = Path(tempfile.mkdtemp(prefix="chat-shot-"))
    archive = pack_checkpoint(args.checkpoint, work / f"{Path(args.checkpoint).name}.zip")
    proc = start_app(args.port, work / "runs", work / "app.log", timeout_s=300, tiny=args.tiny, native="1")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_context(viewport={"width": 1440, "height": 1000}).new_page()
            page.set_default_timeout(120_000)
            page.goto(f"http://127.0.0.1:{args.port}/")
            page.get_by_role("tab", name="Chat").click()
            page.locator("#archive-upload input[type=file]").set_input_files(str(archive))
            expect(page.locator("#chat-models")).to_contain_text("Quantized", timeout=180_000)
            if args.tokens:
                page.get_by_text("Sampling", exact=True).click()
                field = page.locator("#chat-max-tokens input[type=number]")
                field.fill(str(args.tokens))
                field.press("Tab")
            ratios = []
            for i in range(args.replies):
                page.click("#chat-clear")
                expect(page.locator("#stats-quantized")).to_have_text("")
                page.locator("#chat-prompt textarea").fill(PROMPTS[i % len(PROMPTS)])
                page.click("#chat-send")
                expect(page.locator("#stats-quantized")).to_contain_text("tokens/s", timeout=300_000)
                expect(page.locator("#stats-original")).to_contain_text("tokens/s", timeout=300_000)
                (n_o, r_o), (n_q, r_q) = rates(page)
                ratios.append(r_q / r_o)
                print(f"reply {i + 1}: original {n_o} tokens at {r_o:.1f} tok/s, quantized {n_q} tokens at "
                      f"{r_q:.1f} tok/s: {r_q / r_o:.2f}x", flush=True)
            print(f"median quantized / original: {statistics.median(ratios):.2f}x over {len(ratios)} replies "
                  f"(greedy, both sides at once, one core each; load average {os.getloadavg()[0]:.1f})")
            raw = work / "chat.png"
            page.screenshot(path=str(raw), full_page=True)
            browser.close()
        from PIL import Image

        image = Image.open(raw).convert("RGB")
        out = Path(args.screenshot)
        out.parent.mkdir(parents=True, exist_ok=True)
        width = min(image.width, 1400)
        while True:
            small = image.resize((width, round(image.height * width / image.width)), Image.LANCZOS)
            small.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
            if out.stat().st_size <= 200_000 or width < 600:
                break
            width = int(width * 0.9)
        print(f"screenshot: {out} ({out.stat().st_size // 1000} kB)")
    finally:
        stop_app(proc)


if __name__ == "__main__":
    main()
