"""The quantize tab's settings form, without Gradio: what each form field sets, the method config built from
the form's values, what a preset fills in, and which fields a method shows.

Form fields are keyed by the config setting they set (``vector_len``, ``bits``, ``rank``, ...), so a method's
config takes exactly the fields named in ``Method.setting_names``. One field stands for two settings: the
activations dropdown (``activations``) sets ``act_bits`` and ``act_granularity``. Nothing here branches on a
method's name: a new method's settings show as soon as the form has fields for them, and settings without
a field keep their config defaults.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, fields
from typing import Any

from ..quant import methods

CUSTOM = "custom"  # the preset shown once a field is edited by hand
WIKI_SOURCE = "bundled Wikipedia text"
FILE_SOURCE = "my .txt file"
WEIGHT_ONLY = "16-bit (weight-only)"
ACTIVATIONS = {  # dropdown label -> (act_bits, act_granularity)
    WEIGHT_ONLY: (16, "token"),
    "8-bit per token (dynamic)": (8, "token"),
    "8-bit per token, asymmetric (dynamic)": (8, "token_asym"),
    "8-bit per tensor (static, calibrated)": (8, "tensor"),
}
ACT_FIELD = "activations"
ACT_SETTINGS = ("act_bits", "act_granularity")
SEED_FIELD = "seed"
OTHER_MODEL = "other"  # the model dropdown's choice that takes the hub id / directory textbox
# What the form calls each field (error messages use these words, not the setting names). Fields a newly
# registered method brings without a label here keep their setting name.
FIELD_LABELS = {
    "vector_len": "vector length", "num_centroids": "centroids", "num_res_centroids": "residual centroids",
    "outlier_percent": "outlier columns %", "group_num": "groups", "kmeans_iters": "k-means iterations",
    "enable_norm": "normalize columns", "enable_perm": "permute columns", "finetune_iters": "fine-tune iterations",
    "layer_bits_cap": "max total bits per layer", "bits_budget": "total bits budget",
    "allocation": "bits allocation",
    "distill_iters": "distillation steps",
    "distill_data": "distillation data", "distill_samples": "sampled windows",
    "distill_eval_every": "held-out check every", "distill_lr": "distillation lr",
    "calib_sampled_share": "self-written calibration share", "refit_iters": "codebook refit steps",
    "time_budget": "time budget",
    "bits": "bits", "group_size": "group size", "activations": "activations", "act_order": "act order",
    "rank": "LRQ rank", "iters": "LRQ iterations per block", "seed": "seed", "samples": "calibration samples",
    "seqlen": "tokens per sample",
}
# Settings sized for a model whose linears are this narrow or narrower (the presets are sized for SmolLM2:
# on 64-wide layers their 4096-entry codebooks cost ~80 bits per weight).
SMALL_MODEL_WIDTH = 256
SMALL_MODEL_VALUES = {"vector_len": 4, "num_centroids": 16, "kmeans_iters": 2, "outlier_percent": 0.0}
SMALL_MODEL_CALIB = (4, 64)  # calibration samples × tokens per sample
MODEL_CALIB = (32, 512)
_SETTING_NAME = re.compile(r"\b(" + "|".join(sorted(map(re.escape, FIELD_LABELS), key=len, reverse=True)) + r")\b")


def readable(message: str) -> str:
    """A config error with the form's words for its settings ("vector length must be in 1..16, got 0" for
    "vector_len must be ..."): setting names with an underscore anywhere, others only where they start it."""
    message = str(message)

    def swap(match: re.Match) -> str:
        name = match.group(1)
        if "_" in name or match.start() == 0:
            return FIELD_LABELS[name]
        return name

    return _SETTING_NAME.sub(swap, message)


SEED_MAX = 2**64 - 1  # torch.manual_seed takes at most 64 bits


def check_seed(value) -> int:
    """The seed field's value as an int in 0..2**64-1 (ValueError naming the field otherwise)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"seed must be an integer in 0..{SEED_MAX}, got {value!r}")
    if not 0 <= value <= SEED_MAX:
        raise ValueError(f"seed must be in 0..{SEED_MAX} (2**64 - 1), got {value}")
    return value


def field_settings(key: str) -> tuple[str, ...]:
    """The config settings the form field ``key`` sets."""
    return ACT_SETTINGS if key == ACT_FIELD else (key,)


def act_settings(label) -> dict:
    """The activations dropdown's label -> {"act_bits", "act_granularity"} (empty: weight-only)."""
    if label in (None, ""):
        label = WEIGHT_ONLY
    if label not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(repr(a) for a in ACTIVATIONS)}, got {label!r}")
    return dict(zip(ACT_SETTINGS, ACTIVATIONS[label]))


def act_label(act_bits, act_granularity) -> str:
    for label, pair in ACTIVATIONS.items():
        if pair == (act_bits, act_granularity):
            return label
    raise ValueError(f"the form has no activations choice for act_bits={act_bits!r}, "
                     f"act_granularity={act_granularity!r}")


def uses(method: str, keys: Iterable[str]) -> bool:
    """Whether any of the form fields ``keys`` sets a setting of ``method``'s config (the field group shows)."""
    names = methods.get(method).setting_names
    return any(s in names for key in keys for s in field_settings(key))


def method_settings(method: str, values: Mapping[str, Any]) -> dict:
    """The form's values (keyed by field) that belong to ``method``'s config, as config settings."""
    m = methods.get(method)
    names = m.setting_names
    defaults = {f.name: f.default for f in fields(m.config_class) if f.default is not MISSING}
    settings: dict[str, Any] = {}
    for key, value in values.items():
        if not any(s in names for s in field_settings(key)):
            continue  # another method's field
        if key == ACT_FIELD:
            settings.update({k: v for k, v in act_settings(value).items() if k in names})
        elif isinstance(defaults.get(key), bool) and value is not None:
            settings[key] = bool(value)  # checkboxes; API clients may send 0/1
        else:
            settings[key] = value
    return settings


def config_from(method: str, values: Mapping[str, Any]):
    """The validated config of ``method`` from the form's values (ValueError naming the setting)."""
    if method not in methods.names():
        raise ValueError(f"method must be one of {', '.join(methods.names())}, got {method!r}")
    if SEED_FIELD in values:
        values = {**values, SEED_FIELD: check_seed(values[SEED_FIELD])}
    return methods.make_config(method, method_settings(method, values))


def initial_values(preset: str | None = None) -> dict[str, Any]:
    """A starting value for every form field a registered method has (keyed by field): the first method (in
    registry order) whose config has the setting gives its default, with ``preset`` applied where it has it."""
    values: dict[str, Any] = {}
    for m in methods.all_methods():
        settings = {**m.make_config().to_dict(), **(m.preset(preset) if preset in m.presets else {})}
        if all(s in settings for s in ACT_SETTINGS):
            values.setdefault(ACT_FIELD, act_label(*(settings[s] for s in ACT_SETTINGS)))
        for name, value in settings.items():
            if name not in ACT_SETTINGS:
                values.setdefault(name, value)
    return values


DEFAULT_PRESET = "2.5 bits"  # the preset the page starts with (presets are named by total bits per weight)


def preset_names() -> list[str]:
    """Every preset name of the registered methods, first-seen order ("2.5 bits", "3.5 bits", "4.5 bits")."""
    return list(dict.fromkeys(p for m in methods.all_methods() for p in m.presets))


def preset_values(method: str, preset: str, keys: Iterable[str]) -> dict[str, Any]:
    """The form values (keyed by field, among ``keys``) that ``preset`` of ``method`` fixes; {} for a preset
    the method does not have (e.g. "custom"). A fixed setting the form has no field for is left out: the
    form cannot show it, and the config gets the setting's default (``config_from``)."""
    m = methods.get(method)
    if preset not in m.presets:
        return {}
    fixed = m.preset(preset)
    keys = set(keys)
    values = {name: value for name, value in fixed.items() if name in keys and name not in ACT_SETTINGS}
    if ACT_FIELD in keys and any(s in fixed for s in ACT_SETTINGS):
        defaults = m.make_config().to_dict()
        pair = tuple(fixed.get(s, defaults.get(s)) for s in ACT_SETTINGS)
        if pair in ACTIVATIONS.values():
            values[ACT_FIELD] = act_label(*pair)
    return values
