"""What an uploaded checkpoint may be, checked from the archive before anything is unpacked or allocated: its
config names an architecture the app serves with sizes in range, and loading it fits the memory limits (the
tensors its safetensors header lists, at the dtype they are loaded in, plus what the architecture builds)."""

from __future__ import annotations

import json
import os
import zipfile

from ..storage.archive import SAFETENSORS_SUFFIX, inspect_archive
from ..storage.memory_estimate import LoadEstimate, estimate_load, read_header
from . import views
from .app_settings import AppSettings
from .memory_guard import MemoryGuard

# The decoder families the app builds, quantizes and chats with (``models.FAMILIES`` and the built-in models).
SERVED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma3_text", "phi3")
# Whole numbers a served config must hold, each from 1 to its bound.
CONFIG_BOUNDS = {
    "hidden_size": 16_384,
    "num_hidden_layers": 256,
    "num_attention_heads": 256,
    "intermediate_size": 131_072,
    "vocab_size": 300_000,
    "max_position_embeddings": 1_048_576,
}
# Whole numbers a served config may hold, from 1 to their bound when present.
OPTIONAL_BOUNDS = {"num_key_value_heads": 256, "head_dim": 1024, "sliding_window": 1_048_576}
MAX_CONFIG_BYTES = 4_000_000


def check_config(config: object) -> None:
    """ValueError with one line naming the field and what is allowed, unless ``config`` (config.json's object)
    is an architecture the app serves with every size in range."""
    if not isinstance(config, dict):
        raise ValueError("config.json must hold a JSON object")
    model_type = config.get("model_type")
    if model_type not in SERVED_MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not served here; allowed: "
                         f"{', '.join(SERVED_MODEL_TYPES)}")
    for key, bound in (*CONFIG_BOUNDS.items(), *OPTIONAL_BOUNDS.items()):
        if key not in config or (key in OPTIONAL_BOUNDS and config[key] is None):
            if key in CONFIG_BOUNDS:
                raise ValueError(f"config.json: {key} is missing; a whole number from 1 to {bound} is expected")
            continue
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ValueError(f"config.json: {key} must be a whole number from 1 to {bound}, got {value!r}")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                         f"({kv_heads})")
    if config["hidden_size"] % heads:
        raise ValueError(f"config.json: hidden_size ({config['hidden_size']}) must be a multiple of "
                         f"num_attention_heads ({heads})")


def check_upload(archive: str | os.PathLike, settings: AppSettings, memory: MemoryGuard,
                 float_bytes: int) -> LoadEstimate:
    """Refuse, from the archive's listing, its config.json and its safetensors headers (nothing unpacked, no
    tensor read), an upload whose config the app does not serve or whose load would not fit: more than
    ``settings.max_load_bytes``, or more than the memory the app has left under its ceiling. Returns the
    estimate."""
    entries = inspect_archive(archive, max_bytes=settings.max_unpacked_bytes, max_files=settings.max_archive_files,
                              max_entry_bytes=settings.max_entry_bytes, max_ratio=settings.max_ratio)
    members = {entry.name: entry.member for entry in entries}
    header: dict = {}
    with zipfile.ZipFile(archive) as zf:
        config_info = zf.getinfo(members["config.json"])
        if config_info.file_size > MAX_CONFIG_BYTES:
            raise ValueError(f"config.json unpacks to {views.mb(config_info.file_size)}; at most "
                             f"{views.mb(MAX_CONFIG_BYTES)}")
        with zf.open(config_info) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        try:
            config = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"config.json: not valid JSON ({exc})") from None
        except RecursionError:
            raise ValueError("config.json: JSON nested too deeply") from None
        check_config(config)
        for name, member in members.items():
            if name.endswith(SAFETENSORS_SUFFIX):
                with zf.open(member) as f:
                    try:
                        part = read_header(f)
                    except ValueError as exc:
                        raise ValueError(f"{name}: {exc}") from None
                overlap = (set(header) & set(part)) - {"__metadata__"}
                if overlap:
                    raise ValueError(f"{name}: tensor {sorted(overlap)[0]!r} is stored twice")
                header.update(part)
    try:
        other = sum(e.size for e in entries if not e.name.endswith(SAFETENSORS_SUFFIX))
        estimate = estimate_load(header, config, float_bytes, other_file_bytes=other)
    except ValueError as exc:
        raise ValueError(f"model.safetensors: {exc}") from None
    if estimate.total > settings.max_load_bytes:
        raise ValueError(f"loading this checkpoint needs about {views.mb(estimate.total)} of memory "
                         f"({views.mb(estimate.tensors)} of tensors); at most {views.mb(settings.max_load_bytes)} "
                         "per upload")
    memory.check_room(estimate.total, "loading this checkpoint")
    return estimate
