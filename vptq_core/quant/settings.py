"""A config setting declared once, on its dataclass field: its default, the values it allows and how the
command line and the app's form show it.

    vector_len: int = setting(6, lo=1, hi=16, label="vector length", help="weights per vector", group="VPTQ")

The checks (``check_settings``), the CLI flags (cli.py) and the app's form (studio/form.py) are generated from
these declarations, so adding a setting is one line in its config (see docs/contributing.md, "Adding a
setting"). This module imports nothing else from the project.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any

METADATA_KEY = "setting"  # where a dataclass field's metadata holds its ``Setting``
KINDS = ("int", "pow2", "float", "bool", "choice", "text", "internal")


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def check_pow2(name: str, value, lo: int, hi: int) -> None:
    check_int(name, value, lo, hi)
    if not _is_pow2(value):
        raise ValueError(f"{name} must be a power of two in {lo}..{hi}, got {value}")


def check_float(name: str, value, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value}")


def _word(choice) -> str:
    """A choice as an error message names it: JSON's true/false for bools, the repr otherwise."""
    return flag_word(choice) if isinstance(choice, bool) else repr(choice)


def flag_word(choice) -> str:
    """A choice as the command line and the form's dropdown write it: JSON's true/false for bools, else str."""
    if isinstance(choice, bool):
        return "true" if choice else "false"
    return str(choice)


@dataclass(frozen=True)
class Setting:
    """What one config field is (the metadata ``setting()`` puts on it).

    kind: "int", "pow2" (a power of two), "float", "bool", "choice", "text" (checked by its config) or
        "internal" (filled by a run, never shown: no checks, no flag, no form field);
    lo / hi / lo_open: the allowed range of a number (hi None: no upper bound; lo_open: lo itself refused);
    choices / notes: the allowed values of a choice and a note per value ("" for none) the error message
        gives in parentheses; one_of: the message says "one of a, b, c" instead of "'a', 'b' or 'c'";
    zero: what 0 means ("off", "none", ...): said in the help and the form; a pow2 setting with one allows 0;
    label: the form's words (error messages in the app use them); hint: said after it in parentheses;
    help: the CLI's --help text; flag: the CLI flag; switch: for a bool, the value a one-way flag sets
        (``--no-act-order`` sets False), None for a ``--x/--no-x`` pair;
    group / row: where the form and --help show it (no group: neither, only ``--set NAME=VALUE`` and the API);
    cli / form: whether a setting with a group is shown there.
    """

    kind: str
    label: str = ""
    help: str = ""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple = ()
    notes: tuple[str, ...] = ()
    one_of: bool = False
    zero: str = ""
    group: str | None = None
    row: int = 0
    hint: str = ""
    flag: str = ""
    switch: bool | None = None
    cli: bool = True
    form: bool = True

    def shown_in(self, where: str) -> bool:
        """Whether the command line (``"cli"``) or the app's form (``"form"``) shows this setting."""
        if where not in ("cli", "form"):
            raise ValueError(f"where must be 'cli' or 'form', got {where!r}")
        return self.group is not None and self.kind != "internal" and getattr(self, where)

    @property
    def form_hint(self) -> str:
        """What the form says after the label: the hint and what 0 means."""
        return "; ".join(part for part in (self.hint, self.zero and f"0 = {self.zero}") if part)

    @property
    def cli_help(self) -> str:
        return "; ".join(part for part in (self.help, self.zero and f"0 = {self.zero}") if part)

    def allowed(self) -> str:
        """The words after "must be" in the error message of a choice."""
        if self.one_of:
            return "one of " + ", ".join(str(c) for c in self.choices)
        words = [_word(c) + (f" ({note})" if note else "") for c, note in zip(self.choices, self.notes)]
        return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"

    def check(self, name: str, value) -> None:
        """ValueError naming ``name``, ``value`` and what is allowed when ``value`` is not."""
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        elif self.kind == "int":
            check_int(name, value, self.lo, self.hi)
        elif self.kind == "pow2":
            if not (self.zero and value == 0):
                check_pow2(name, value, self.lo, self.hi)
        elif self.kind == "float":
            check_float(name, value, self.lo, self.hi, self.lo_open)
        elif self.kind == "choice":
            # a bool is only ever one of the bool choices (True == 1 must not pass for 1)
            same_sort = [c for c in self.choices if isinstance(c, bool) == isinstance(value, bool)]
            if value not in same_sort:
                raise ValueError(f"{name} must be {self.allowed()}, got {value!r}")


def _kind_of(default, choices) -> str:
    if choices:
        return "choice"
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    if isinstance(default, str):
        return "text"
    raise TypeError(f"cannot tell the kind of a setting with default {default!r}: pass kind=")


def _check_declaration(meta: Setting, default) -> None:
    """Mistakes in a declaration fail when its class is defined, not when a user first meets them."""
    if meta.kind not in KINDS:
        raise ValueError(f"setting kind must be one of {', '.join(KINDS)}, got {meta.kind!r}")
    if meta.kind in ("int", "pow2", "float") and meta.lo is None:
        raise ValueError(f"a {meta.kind} setting needs lo= (and hi= for pow2 and float)")
    if meta.kind in ("pow2", "float") and meta.hi is None:
        raise ValueError(f"a {meta.kind} setting needs hi=")
    if meta.kind == "choice" and len(meta.choices) < 2:
        raise ValueError(f"a choice setting needs at least two choices, got {meta.choices!r}")
    if meta.switch is not None and meta.kind != "bool":
        raise ValueError(f"switch= is for bool settings, not {meta.kind}")
    if meta.flag and not meta.flag.startswith("--"):
        raise ValueError(f"flag must start with '--', got {meta.flag!r}")
    meta.check("the default", default)


def setting(default, *, label: str = "", help: str = "", kind: str | None = None, lo: float | None = None,
            hi: float | None = None, lo_open: bool = False, choices: Sequence | Mapping = (), one_of: bool = False,
            zero: str = "", group: str | None = None, row: int = 0, hint: str = "", flag: str = "",
            switch: bool | None = None, cli: bool = True, form: bool = True) -> Any:
    """A dataclass field with ``default`` and its ``Setting`` (see there for each argument). ``kind`` is taken
    from the default ("bool", "int", "float", "text") or "choice" when ``choices`` are given; pass "pow2"
    explicitly. ``choices`` may map each value to a note for the error message. ``label`` defaults to the
    field's name with spaces, ``flag`` to ``--`` + the name with dashes."""
    notes = tuple(choices.values()) if isinstance(choices, Mapping) else ("",) * len(choices)
    meta = Setting(kind=kind or _kind_of(default, choices), label=label, help=help, lo=lo, hi=hi, lo_open=lo_open,
                   choices=tuple(choices), notes=notes, one_of=one_of, zero=zero, group=group, row=row, hint=hint,
                   flag=flag, switch=switch, cli=cli, form=form)
    _check_declaration(meta, default)
    return field(default=default, metadata={METADATA_KEY: meta})


def internal(default) -> Any:
    """A field a run fills in and records (e.g. VPTQ's per-layer plan): no checks, no flag, no form field."""
    return field(default=default, metadata={METADATA_KEY: Setting(kind="internal")})


def redeclare(config_class: type, name: str, default) -> Any:
    """``name`` of ``config_class`` declared again with another default (a subclass's own default)."""
    return field(default=default, metadata=config_class.__dataclass_fields__[name].metadata)


def declaration(f: Field) -> Setting | None:
    """The ``Setting`` of a dataclass field, its label and flag filled in from the name; None if undeclared."""
    meta = f.metadata.get(METADATA_KEY)
    if meta is None:
        return None
    return replace(meta, label=meta.label or f.name.replace("_", " "),
                   flag=meta.flag or "--" + f.name.replace("_", "-"))


@functools.cache
def _declarations(config_class: type) -> tuple[tuple[str, Setting], ...]:
    """Read once per class: every config built checks them (``check_settings``)."""
    return tuple((f.name, meta) for f in fields(config_class) if (meta := declaration(f)) is not None)


def declared(config_class: type) -> dict[str, Setting]:
    """Every declared setting of a config dataclass, name -> Setting, in field order."""
    return dict(_declarations(config_class))


def undeclared(config_class: type) -> list[str]:
    """The fields of a config dataclass declared without ``setting()`` / ``internal()``."""
    return [f.name for f in fields(config_class) if declaration(f) is None]


def check_settings(config) -> None:
    """Check every declared setting of a config object (a dataclass instance) against its declaration."""
    for name, meta in _declarations(type(config)):
        meta.check(name, getattr(config, name))


def grouped(config_classes: Iterable[type], where: str, order: Sequence[str] = ()) -> dict[str, dict[str, Setting]]:
    """The settings ``where`` ("cli" or "form") shows, over ``config_classes`` (a name's first declaration
    counts), by group: the groups named in ``order`` first, in that order, then the others as first met;
    within a group as first met."""
    found: dict[str, Setting] = {}
    for config_class in config_classes:
        for name, meta in declared(config_class).items():
            if meta.shown_in(where):
                found.setdefault(name, meta)
    groups = [g for g in order if any(m.group == g for m in found.values())]
    groups += [g for g in dict.fromkeys(m.group for m in found.values()) if g not in groups]
    return {group: {name: meta for name, meta in found.items() if meta.group == group} for group in groups}


def parse_assignment(item: str, what: str = "a setting") -> tuple[str, Any]:
    """"NAME=VALUE" -> (NAME, VALUE read as JSON, else the bare word as a string); ValueError naming ``item``."""
    name, sep, text = item.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"{what} takes NAME=VALUE, got {item!r}")
    try:
        return name.strip(), json.loads(text)
    except json.JSONDecodeError:
        return name.strip(), text  # a bare word: a string setting
