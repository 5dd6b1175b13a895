"""The quantize tab's settings form, without Gradio: which fields it has and how they are laid out, what each
field sets, the method config built from the form's values, what a preset fills in, and which fields a method
shows.

The fields come from the settings' declarations (quant/settings.py): every setting of a registered method's
config declared with a group is a field, in its group's row, with its label and hint (``form_groups``). Form
fields are keyed by the config setting they set (``vector_len``, ``bits``, ``rank``, ...), so a method's
config takes exactly the fields named in ``Method.setting_names``. One field stands for two settings: the
activations dropdown (``activations``) sets ``act_bits`` and ``act_granularity``. Nothing here branches on a
method's name: a new method's declared settings show as soon as it is registered, and settings without a field
keep their config defaults.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from ..quant import methods
from ..quant.config import CALIB_GROUP, GROUPS, CalibConfig
from ..quant.settings import Setting, declared, grouped

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
CALIBRATION_GROUP = CALIB_GROUP  # the group the form shows with the calibration text and windows
CALIB_FIELDS = ("samples", "seqlen")  # CalibConfig settings the form has fields of its own for (not method settings)


@dataclass(frozen=True)
class FormField:
    """One field of the form: ``key`` (the setting it sets), ``label`` (the form's words; errors use them),
    ``kind`` ("int", "float", "bool", "choice" or "text"), ``hint`` (said after the label in parentheses),
    ``choices`` (of a "choice") and ``help`` (a longer explanation)."""

    key: str
    label: str
    kind: str
    hint: str = ""
    choices: tuple = ()
    help: str = ""

    @property
    def title(self) -> str:
        """The component's label: the label and the hint."""
        return f"{self.label} ({self.hint})" if self.hint else self.label

    @property
    def precision(self) -> int | None:
        """Decimals a number field keeps: 0 for whole numbers, None (any) otherwise."""
        return 0 if self.kind == "int" else None

    @classmethod
    def of(cls, key: str, setting: Setting) -> FormField:
        kind = {"pow2": "int"}.get(setting.kind, setting.kind)
        return cls(key, setting.label, kind, setting.form_hint, setting.choices, setting.help)


@dataclass(frozen=True)
class FormGroup:
    """A group of fields shown together, row by row, for the ``methods`` whose configs have any of its
    settings (the others hide it)."""

    name: str
    rows: tuple[tuple[FormField, ...], ...]
    methods: tuple[str, ...]

    @property
    def fields(self) -> tuple[FormField, ...]:
        return tuple(f for row in self.rows for f in row)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(f.key for f in self.fields)


ACTIVATIONS_FIELD = FormField(ACT_FIELD, "activations", "choice", "W·A8 = 8-bit inputs to the linears",
                              tuple(ACTIVATIONS), "quantize the inputs of the quantized linears too")


def _field(key: str, setting: Setting) -> FormField:
    return ACTIVATIONS_FIELD if key in ACT_SETTINGS else FormField.of(key, setting)


def form_groups() -> list[FormGroup]:
    """Every group of fields the registered methods' settings declare, in the order the form shows them (the
    built-in groups in ``config.GROUPS`` order, then the others); the activations field stands where its
    settings are declared."""
    groups = []
    for name, settings in grouped((m.config_class for m in methods.all_methods()), "form", GROUPS).items():
        rows: dict[int, dict[str, FormField]] = {}
        for key, setting in settings.items():
            made = _field(key, setting)
            rows.setdefault(setting.row, {}).setdefault(made.key, made)
        keys = [k for row in rows.values() for k in row]
        users = tuple(m.name for m in methods.all_methods() if uses(m.name, keys))
        groups.append(FormGroup(name, tuple(tuple(rows[r].values()) for r in sorted(rows)), users))
    return groups


def field_labels() -> dict[str, str]:
    """What the form calls each field (error messages use these words, not the setting names): every field
    of ``form_groups`` and the calibration windows' fields."""
    labels = {f.key: f.label for group in form_groups() for f in group.fields}
    calib = declared(CalibConfig)
    return {**labels, **{key: calib[key].label for key in CALIB_FIELDS}}


class _FieldLabels(Mapping):
    """``field_labels()`` as a mapping, read when used (so that methods registered later count)."""

    def __getitem__(self, key: str) -> str:
        return field_labels()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(field_labels())

    def __len__(self) -> int:
        return len(field_labels())


FIELD_LABELS: Mapping[str, str] = _FieldLabels()

# Settings sized for a model whose linears are this narrow or narrower (the presets are sized for SmolLM2:
# on 64-wide layers their 4096-entry codebooks cost far more bits than the weights).
SMALL_MODEL_WIDTH = 256
SMALL_MODEL_VALUES = {"vector_len": 4, "num_centroids": 16, "kmeans_iters": 2, "outlier_percent": 0.0}
SMALL_MODEL_CALIB = (4, 64)  # calibration samples × tokens per sample
MODEL_CALIB = (32, 512)


def readable(message: str) -> str:
    """A config error with the form's words for its settings ("vector length must be in 1..16, got 0" for
    "vector_len must be ..."): setting names with an underscore anywhere, others only where they start it."""
    labels = field_labels()
    names = re.compile(r"\b(" + "|".join(sorted(map(re.escape, labels), key=len, reverse=True)) + r")\b")

    def swap(match: re.Match) -> str:
        name = match.group(1)
        if "_" in name or match.start() == 0:
            return labels[name]
        return name

    return names.sub(swap, str(message))


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
