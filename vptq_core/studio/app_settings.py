"""The app's settings (``AppSettings``): where runs are written, the device, and every limit a public machine
needs. ``app.py`` fills them from the command line and the environment (``app.LIMITS``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..models import BUNDLED
from ..storage.archive import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRY_BYTES, DEFAULT_MAX_FILES, DEFAULT_MAX_RATIO


@dataclass(frozen=True)
class AppSettings:
    """The app's settings; every limit also has a command-line flag and an environment variable
    (``app.LIMITS``). Sizes are bytes (the flags and variables take MB = 10^6 bytes)."""

    workdir: Path
    default_model: str = BUNDLED
    device: str = "cpu"
    chat_concurrency: int = 2  # chat events served at once (each runs both models)
    max_upload_bytes: int = DEFAULT_MAX_BYTES  # an uploaded archive (zip) as sent
    max_unpacked_bytes: int = DEFAULT_MAX_BYTES  # an uploaded archive unpacked, all files together
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES  # one file of an uploaded archive, unpacked
    max_ratio: float = DEFAULT_MAX_RATIO  # unpacked / compressed bytes, per file and for the whole archive
    max_archive_files: int = DEFAULT_MAX_FILES
    user_quota_bytes: int = 5_000_000_000  # disk for one browser's runs (checkpoints, archives, uploads)
    total_quota_bytes: int = 20_000_000_000  # disk for every run of every browser
    max_runs_per_user: int = 6  # runs kept + jobs queued or running, per browser
    max_jobs_per_user: int = 2  # jobs queued or running, per browser
    max_jobs_per_address: int = 4  # jobs queued or running from one network address, every browser there together
    proxy_hops: int = 0  # trusted proxies in front of the app (a Space: 1); the client's address is then read
    # from X-Forwarded-For (``client_address``)
    upload_ttl_hours: float = 1.0  # files in Gradio's upload folder are deleted this long after they arrive
    upload_folder_bytes: int = 4_000_000_000  # Gradio's upload folder is kept under this, oldest files first
    run_ttl_hours: float = 12.0  # finished runs are deleted this long after they finish
    max_prompt_tokens: int = 1024  # a chat prompt with the conversation so far
    max_calib_bytes: int = 32_000_000  # an uploaded calibration .txt
    max_divergence_tokens: int = 2048  # tokens of a text the divergence view compares
    divergence_time_limit_s: float = 120.0  # one comparison of the divergence view stops after this long
    max_divergence_text_bytes: int = 1_000_000  # a text (pasted or an uploaded .txt) for the divergence view
    eval_windows: int = 4
    eval_seqlen: int = 512
    cleanup_workdir: bool = False  # remove the work dir at exit (it was a fresh temporary one)
    browser_secret: str | None = None  # encrypts the identity in the browser (None: one kept in the workdir)
    memory_limit_bytes: int = 12_000_000_000  # resident memory of the whole app (a 16 GB Space, with headroom)
    max_load_bytes: int = 2_000_000_000  # memory loading one uploaded checkpoint may need
    allowed_hub_models: tuple[str, ...] = ()  # hub ids an upload may name as its original model
    max_hub_model_bytes: int = 2_000_000_000  # an allowed hub model's weights, checked before any download
    max_estimate_hours: float = 48.0  # Start stays disabled when a run's estimate is longer
    max_chat_messages: int = 200  # messages of one chat side's history a request may send


