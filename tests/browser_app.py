"""What the browser tests share: Debian's Chromium and its flags, ``python app.py --tiny`` started in a subprocess
as a user would start it (and stopped), and screenshots copied small into docs/images/."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps dialling out, and this machine's closed network refuses it.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
                 "--no-first-run", "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
DOCS_IMAGES = ROOT / "docs" / "images"
MAX_DOC_BYTES = 200_000  # a screenshot's copy in docs/


def start_app(port: int, workdir: Path, log_path: Path, drop_env: tuple[str, ...] = (),
              timeout_s: float = 180, tiny: bool = True, native: str = "0") -> subprocess.Popen:
    """``python app.py --tiny --workdir WORKDIR`` on 127.0.0.1:``port``, its output appended to ``log_path``,
    returned once the page answers (RuntimeError with the log's end when it does not). ``drop_env``: variables the
    app must not see (e.g. ``VPTQ_APP_SECRET``); ``tiny`` False: on the bundled model; ``native``: ``VPTQ_NATIVE``
    unless the environment sets it ("1": the native kernels, as a user's app runs)."""
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env.update(GRADIO_SERVER_PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1", GRADIO_ANALYTICS_ENABLED="False",
               VPTQ_NATIVE=os.environ.get("VPTQ_NATIVE", native))
    command = [sys.executable, "app.py", *(["--tiny"] if tiny else []), "--workdir", str(workdir)]
    with open(log_path, "a") as log:  # the child keeps its own handle
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"app did not start:\n{log_path.read_text()[-3000:]}") from None
            time.sleep(0.5)


def stop_app(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def doc_png(source: Path, name: str, max_width: int = 1200) -> Path:
    """A copy of the screenshot ``source`` in docs/images/NAME.png: a palette PNG (UI colours fit in 128), scaled
    down until it is at most MAX_DOC_BYTES."""
    from PIL import Image

    image = Image.open(source).convert("RGB")
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    small = DOCS_IMAGES / f"{name}.png"
    width = min(image.width, max_width)
    while True:
        copy = image.resize((width, round(image.height * width / image.width)), Image.LANCZOS)
        copy.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(small, optimize=True)
        if small.stat().st_size <= MAX_DOC_BYTES or width < 500:
            break
        width = int(width * 0.85)
    assert small.stat().st_size <= MAX_DOC_BYTES, f"{small.name} is {small.stat().st_size} bytes"
    return small
