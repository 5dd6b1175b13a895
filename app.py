"""VPTQ Studio: quantize an LLM in the browser, watch where the error goes, chat with the result next to the
original, and download the packed weights.

Run ``python app.py`` (bundled SmolLM2-135M-Instruct, offline). Options: ``--tiny`` (or
``VPTQ_APP_DEFAULT_MODEL=tiny-random-llama``) makes the tiny test model the default, ``--workdir`` (or
``VPTQ_APP_WORKDIR``) sets where runs are written; host and port follow ``GRADIO_SERVER_NAME`` /
``GRADIO_SERVER_PORT`` or ``--host`` / ``--port``; the limits a public machine needs are ``AppSettings`` fields
with an environment variable each (``LIMITS``). This file is the entry point: command line, settings and
launch. The page is laid out and wired in ``vptq_core.studio.ui`` (one ``ui_*`` module per part), its handlers
are ``vptq_core.studio.handlers.Studio``, what they show is formatted by ``vptq_core.studio.views`` and the
settings form's logic is ``vptq_core.studio.form``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

import gradio as gr

from vptq_core.generation import warm_up_kernels
from vptq_core.models import BUNDLED, TINY
from vptq_core.studio.app_settings import AppSettings
from vptq_core.studio.estimate import model_info
from vptq_core.studio.handlers import Studio
from vptq_core.studio.queue import default_device
from vptq_core.studio.sources import HUB_ID
from vptq_core.studio.ui import TITLE, build_blocks

__all__ = ["AppSettings", "Studio", "build_app", "launch_options", "main", "parse_args", "settings_from"]

ASSETS = Path(__file__).resolve().parent / "assets"
# Every limit: (AppSettings field, environment variable, what it takes). Sizes are given in MB (10^6 bytes).
LIMITS = {
    "max_upload_bytes": ("VPTQ_APP_MAX_UPLOAD_MB", "MB"),
    "max_unpacked_bytes": ("VPTQ_APP_MAX_UNPACKED_MB", "MB"),
    "max_entry_bytes": ("VPTQ_APP_MAX_ENTRY_MB", "MB"),
    "max_ratio": ("VPTQ_APP_MAX_RATIO", "ratio"),
    "user_quota_bytes": ("VPTQ_APP_USER_QUOTA_MB", "MB"),
    "total_quota_bytes": ("VPTQ_APP_TOTAL_QUOTA_MB", "MB"),
    "max_runs_per_user": ("VPTQ_APP_MAX_RUNS", "int"),
    "max_jobs_per_user": ("VPTQ_APP_MAX_JOBS", "int"),
    "max_jobs_per_address": ("VPTQ_APP_MAX_JOBS_PER_ADDRESS", "int"),
    "proxy_hops": ("VPTQ_APP_PROXY_HOPS", "int"),
    "upload_ttl_hours": ("VPTQ_APP_UPLOAD_TTL_HOURS", "hours"),
    "upload_folder_bytes": ("VPTQ_APP_UPLOAD_FOLDER_MB", "MB"),
    "run_ttl_hours": ("VPTQ_APP_RUN_TTL_HOURS", "hours"),
    "max_prompt_tokens": ("VPTQ_APP_MAX_PROMPT_TOKENS", "int"),
    "chat_concurrency": ("VPTQ_APP_CHAT_CONCURRENCY", "int"),
    "max_divergence_tokens": ("VPTQ_APP_MAX_DIVERGENCE_TOKENS", "int"),
    "divergence_time_limit_s": ("VPTQ_APP_DIVERGENCE_SECONDS", "seconds"),
    "memory_limit_bytes": ("VPTQ_APP_MEMORY_LIMIT_MB", "MB"),
    "max_load_bytes": ("VPTQ_APP_MAX_LOAD_MB", "MB"),
    "max_hub_model_bytes": ("VPTQ_APP_MAX_HUB_MODEL_MB", "MB"),
    "max_estimate_hours": ("VPTQ_APP_MAX_ESTIMATE_HOURS", "hours"),
    "max_chat_messages": ("VPTQ_APP_MAX_CHAT_MESSAGES", "int"),
}
# The page warns before it is left while a job runs or a result was not taken home (the guard element's data).
# Capturing, so that an event dispatched at the document reaches it and not Gradio's own listener on the window,
# which closes the page's connection (the browser test asks it that way; a browser's event goes to both).
LEAVE_GUARD_JS = """<script>
window.addEventListener('beforeunload', function (event) {
  var guard = document.querySelector('[data-guard]');
  if (guard && (guard.dataset.busy === '1' || guard.dataset.unexported === '1')) {
    event.preventDefault();
    event.returnValue = '';
  }
}, {capture: true});
</script>"""


def _examples() -> list[list[str]]:
    path = ASSETS / "example_prompts.txt"
    if not path.is_file():
        return []
    return [[line.strip()] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def build_app(settings: AppSettings, studio: Studio | None = None) -> gr.Blocks:
    """The Gradio Blocks of the studio (launch it with ``launch_options(settings)``)."""
    return build_blocks(settings, studio or Studio(settings), examples=_examples())


def launch_options(settings: AppSettings) -> dict:
    """Keyword arguments for ``demo.launch``: theme and CSS, the leave-page warning, and no file path of the work
    directory served (it is blocked; downloads are per-request copies in Gradio's cache, see ``Studio``)."""
    return {
        "theme": gr.themes.Soft(primary_hue="indigo"),
        "css_paths": [str(ASSETS / "app.css")],
        "head": LEAVE_GUARD_JS,
        "blocked_paths": [str(settings.workdir)],
        "max_file_size": settings.max_upload_bytes,
        "show_error": True,
        "footer_links": ["api"],
    }


def _env_limit(name: str, kind: str, default):
    """One limit from its environment variable (MB for sizes), or ``default``; SystemExit naming it when bad."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"{name} must be a number, got {raw!r}") from None
    if not value > 0:
        raise SystemExit(f"{name} must be positive, got {raw!r}")
    if kind == "MB":
        return int(value * 1e6)
    if kind == "int":
        if not value.is_integer():
            raise SystemExit(f"{name} must be a whole number, got {raw!r}")
        return int(value)
    return value


def settings_from(args: argparse.Namespace) -> AppSettings:
    workdir = args.workdir or os.environ.get("VPTQ_APP_WORKDIR")
    cleanup = False
    if not workdir:
        workdir, cleanup = tempfile.mkdtemp(prefix="vptq_app_"), True
    default_model = TINY if args.tiny else (args.default_model or os.environ.get("VPTQ_APP_DEFAULT_MODEL") or BUNDLED)
    defaults = AppSettings(workdir=Path(workdir), proxy_hops=1 if os.environ.get("SPACE_ID") else 0)  # a Space's proxy
    limits = {key: _env_limit(env, kind, getattr(defaults, key)) for key, (env, kind) in LIMITS.items()}
    device = default_device()
    # Evaluating on a CPU is slow: fewer windows by default there.
    return AppSettings(workdir=Path(workdir).resolve(), default_model=default_model, device=device,
                       cleanup_workdir=cleanup, eval_windows=4 if device == "cpu" else 16,
                       browser_secret=os.environ.get("VPTQ_APP_SECRET") or None,
                       allowed_hub_models=allowed_hub_models(os.environ.get("VPTQ_APP_ALLOWED_HUB_MODELS", "")),
                       **limits)


def allowed_hub_models(raw: str) -> tuple[str, ...]:
    """Hub ids (owner/name) an uploaded checkpoint may name as its original, comma-separated; SystemExit
    naming a malformed one."""
    ids = tuple(part.strip() for part in raw.split(",") if part.strip())
    bad = [i for i in ids if not HUB_ID.fullmatch(i)]
    if bad:
        raise SystemExit(f"VPTQ_APP_ALLOWED_HUB_MODELS: {bad[0]!r} is not a hub id (owner/name)")
    return ids


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=f"{TITLE}: quantize, inspect and chat with low-bit LLMs.")
    parser.add_argument("--host", default=None,
                        help="interface to listen on (default: GRADIO_SERVER_NAME or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: GRADIO_SERVER_PORT or 7860)")
    parser.add_argument("--workdir", default=None, help="where runs are written (default: VPTQ_APP_WORKDIR or a "
                        "fresh temporary directory removed at exit)")
    parser.add_argument("--default-model", default=None, help="model selected at start (default: "
                        f"VPTQ_APP_DEFAULT_MODEL or {BUNDLED})")
    parser.add_argument("--tiny", action="store_true", help=f"make {TINY} the default model (tests, quick demos)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_from(args)
    if settings.cleanup_workdir:
        atexit.register(shutil.rmtree, settings.workdir, True)
    demo = build_app(settings)
    # Build the default model's shapes (and the bundled model's dense cache) before the first visitor asks.
    threading.Thread(target=_warm_up, args=(settings.default_model,), daemon=True).start()
    warm_up_kernels()  # build (or load the cached build of) the native CPU kernels in the background
    demo.launch(server_name=args.host, server_port=args.port, **launch_options(settings))


def _warm_up(name: str) -> None:
    try:
        model_info(name)
    except ValueError:
        pass  # the page shows the reason when the model is picked


if __name__ == "__main__":
    main()
