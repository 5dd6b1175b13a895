"""The quantize tab's "Advanced settings" components, made from the form's description (``form.form_groups``):
a number field for a number (whole numbers for integer settings), a checkbox for a bool, a dropdown for a
choice. The layout (groups, rows) and the labels are the form's; nothing here names a setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gradio as gr

from ..quant.settings import flag_word
from . import form


def field_component(field: form.FormField, value: Any) -> gr.components.Component:
    """The Gradio component of one form field, showing ``value``."""
    if field.kind == "bool":
        return gr.Checkbox(value, label=field.title)
    if field.kind == "choice" and any(isinstance(c, bool) for c in field.choices):  # shown as the CLI writes them
        return gr.Dropdown([(flag_word(c), c) for c in field.choices],
                           value=value, label=field.title)
    if field.kind == "choice":
        return gr.Dropdown(list(field.choices), value=value, label=field.title)
    if field.kind == "text":
        return gr.Textbox(value, label=field.title)
    return gr.Number(value, precision=field.precision, label=field.title)


def _rows(group: form.FormGroup, initial: Mapping[str, Any]) -> dict[str, gr.components.Component]:
    components = {}
    for row in group.rows:
        with gr.Row():
            for field in row:
                components[field.key] = field_component(field, initial.get(field.key))
    return components


def settings_panel(initial: Mapping[str, Any], method: str
                   ) -> tuple[dict[str, gr.components.Component], dict[gr.Group, tuple[str, ...]]]:
    """Every group of method settings but the calibration group, each in a ``gr.Group`` visible when
    ``method`` uses it. Returns (field key -> component, group -> its field keys), the components showing
    ``initial`` (field key -> value, ``form.initial_values``)."""
    fields: dict[str, gr.components.Component] = {}
    groups: dict[gr.Group, tuple[str, ...]] = {}
    for group in form.form_groups():
        if group.name == form.CALIBRATION_GROUP:
            continue
        with gr.Group(visible=form.uses(method, group.keys)) as box:
            fields.update(_rows(group, initial))
        groups[box] = group.keys
    return fields, groups


def calibration_settings(initial: Mapping[str, Any]) -> dict[str, gr.components.Component]:
    """The calibration group's fields (the self-written share, the seed), row by row, for every method: the
    page shows them under the calibration text and windows. Field key -> component."""
    group = next((g for g in form.form_groups() if g.name == form.CALIBRATION_GROUP), None)
    return _rows(group, initial) if group else {}
