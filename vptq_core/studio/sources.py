"""Which original model an uploaded run may load. An upload's ``quant_report.json`` names the model it was made
from, and that name is the uploader's text: it is shown, and loaded only when it is a built-in model, the
model of one of the browser's own quantization runs, or a hub id the operator allows (its size checked on the
hub before anything is downloaded). A path, whatever it points at, is never opened."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable

from ..models import KNOWN_MODELS
from . import views

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def shown_name(source: str | None) -> str:
    """How a recorded source model is shown: a hub id or a name as it is, a path by its last part only."""
    if not source:
        return "unknown"
    text = str(source).strip()[:200]
    if HUB_ID.fullmatch(text) or ("/" not in text and "\\" not in text and text not in (".", "..")):
        return text
    return f"{os.path.basename(text.replace(chr(92), '/').rstrip('/')) or 'a path'} (a path)"


def hub_model_bytes(repo_id: str) -> int:
    """Bytes of the weight files of a hub model, from the hub's listing (nothing downloaded); ValueError when
    the hub cannot say."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ValueError("the hub is switched off here (HF_HUB_OFFLINE)")
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo_id, files_metadata=True)
    except Exception as exc:  # noqa: BLE001 - no network, no such repo, gated: the hub cannot say
        raise ValueError(f"the hub cannot list it ({type(exc).__name__})") from None
    return sum(int(s.size or 0) for s in info.siblings or [] if s.rfilename.endswith(WEIGHT_SUFFIXES))


def loadable_source(source: str | None, own_sources: Iterable[str], allowed_hub: Iterable[str],
                    max_hub_bytes: int, hub_size: Callable[[str], int] | None = None) -> tuple[str | None, str]:
    """(the name to load, "") when an upload's recorded source may be loaded, else (None, why not)."""
    if not source or not isinstance(source, str):
        return None, "the checkpoint does not say which model it was made from"
    name = source.strip()
    if name in KNOWN_MODELS or name in set(own_sources):
        return name, ""
    shown = shown_name(name)
    if HUB_ID.fullmatch(name) and name in set(allowed_hub):
        try:
            size = (hub_size or hub_model_bytes)(name)
        except ValueError as exc:
            return None, f"hub model `{shown}` is allowed, but its size cannot be checked: {exc}"
        if size > max_hub_bytes:
            return None, (f"hub model `{shown}` holds {views.mb(size)} of weights; at most "
                          f"{views.mb(max_hub_bytes)} are loaded here")
        return name, ""
    return None, (f"the checkpoint names `{shown}` as its original; it is shown, not loaded: only the built-in "
                  "models, the models of your own runs and hub models the operator allows are loaded")
