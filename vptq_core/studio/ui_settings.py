"""The Quantize tab's settings column: model, method, preset, the advanced settings (one component per form
field, ``form``) with the calibration, the live estimate and the Start / Cancel / Resume buttons; and its
events: presets fill the fields they fix, editing a fixed field by hand switches the preset to "custom", a
model change sizes the settings for it, and every change updates the estimate."""

from __future__ import annotations

import gradio as gr

from ..models import BUNDLED, TINY
from ..quant import methods
from . import form
from .form import CUSTOM, FILE_SOURCE, WIKI_SOURCE
from .settings_panel import calibration_settings, settings_panel
from .ui_page import Page

MODEL_CHOICES = [("SmolLM2-135M-Instruct (bundled, offline)", BUNDLED), ("tiny random llama (for tests)", TINY),
                 ("a hub id or a local directory…", form.OTHER_MODEL)]


def settings_column(page: Page) -> None:
    """The left column of the Quantize tab; sets ``page.fields`` (form field -> component) and ``page.groups``
    (a group of fields -> its field keys, shown for the methods that use them)."""
    settings, studio = page.settings, page.studio
    method_list = methods.all_methods()
    initial = form.initial_values(form.DEFAULT_PRESET)
    known = settings.default_model in (BUNDLED, TINY)
    default_model = settings.default_model if known else form.OTHER_MODEL
    custom_default = "" if known else settings.default_model
    small = page.small
    initial["iters"] = 20 if small else 200  # LRQ: more steps than the library default when a user waits for it
    if small:  # the presets are sized for SmolLM2; the tiny model's 64-wide layers need tiny codebooks
        initial.update(form.SMALL_MODEL_VALUES)
    samples0, seqlen0 = form.SMALL_MODEL_CALIB if small else form.MODEL_CALIB
    labels = form.FIELD_LABELS
    fields: dict[str, gr.components.Component] = {}
    groups: dict[gr.Group, tuple[str, ...]] = {}

    with gr.Column(scale=1, min_width=340):
        model = gr.Dropdown(MODEL_CHOICES, value=default_model, label="Model", elem_id="model")
        custom_model = gr.Textbox(value=custom_default, label="hub id or local directory",
                                  placeholder="e.g. HuggingFaceTB/SmolLM2-360M-Instruct or a path",
                                  visible=default_model == form.OTHER_MODEL, elem_id="custom-model")
        model_note = gr.Markdown(studio.quantize_form.model_note(default_model, custom_default),
                                 elem_classes="vq-note")
        method = gr.Radio([(m.label, m.name) for m in method_list], value=method_list[0].name,
                          label="Method")
        preset = gr.Radio([*form.preset_names(), CUSTOM],
                          value=CUSTOM if small else form.DEFAULT_PRESET, label="Preset",
                          elem_id="preset")
        with gr.Accordion("Advanced settings", open=False):
            panel_fields, panel_groups = settings_panel(initial, method.value)
            fields.update(panel_fields)
            groups.update(panel_groups)
            gr.Markdown("**Calibration**")
            calib_source = gr.Radio([WIKI_SOURCE, FILE_SOURCE], value=WIKI_SOURCE,
                                    label="calibration text")
            calib_file = gr.File(label="calibration .txt (UTF-8)", file_types=[".txt"],
                                 visible=False, height=90)
            with gr.Row():
                calib_samples = gr.Number(samples0, precision=0, label=labels["samples"])
                calib_seqlen = gr.Number(seqlen0, precision=0, label=labels["seqlen"])
            fields.update(calibration_settings(initial))
        estimate_box = gr.Markdown(elem_id="estimate")
        with gr.Row():
            start_btn = gr.Button("Start", variant="primary", elem_id="start-btn")
            cancel_btn = gr.Button("Cancel", variant="stop", elem_id="cancel-btn")
            resume_btn = gr.Button("Resume", elem_id="resume-btn")  # a run a restart cut off
    page.update(fields=fields, groups=groups, model=model, custom_model=custom_model, model_note=model_note,
                method=method, preset=preset, calib_source=calib_source, calib_file=calib_file,
                calib_samples=calib_samples, calib_seqlen=calib_seqlen, estimate_box=estimate_box,
                start_btn=start_btn, cancel_btn=cancel_btn, resume_btn=resume_btn,
                model_inputs=[model, custom_model, method],
                calib_inputs=[calib_source, calib_file, calib_samples, calib_seqlen])


def wire_settings(page: Page) -> None:
    """Presets, groups shown per method, the model's note and sized defaults, the live estimate."""
    p, setup = page, page.studio.quantize_form
    fields, groups = p.fields, p.groups

    def apply_preset(method: str, preset: str, model: str | None = None,
                     custom_model: str | None = None) -> list:  # (the parameter names are the API's)
        return setup.preset_form(method, preset, model, custom_model)

    def show_groups(method_name: str) -> list:
        return [gr.Group(visible=form.uses(method_name, keys)) for keys in groups.values()]

    gr.on([p.method.change, p.preset.change], apply_preset, inputs=[p.method, p.preset, p.model, p.custom_model],
          outputs=list(fields.values()), api_name="preset", show_progress="hidden")
    p.method.change(show_groups, inputs=p.method, outputs=list(groups), api_visibility="private",
                    show_progress="hidden")
    fixed = {key for m in methods.all_methods() for name in m.presets
             for key in form.preset_values(m.name, name, fields)}
    for key in [k for k in fields if k in fixed]:
        fields[key].input(lambda: CUSTOM, outputs=p.preset, api_visibility="private", show_progress="hidden")
    p.calib_source.change(lambda s: gr.File(visible=s == FILE_SOURCE), inputs=p.calib_source, outputs=p.calib_file,
                          api_visibility="private", show_progress="hidden")
    p.model.change(lambda m: gr.Textbox(visible=m == form.OTHER_MODEL), inputs=p.model, outputs=p.custom_model,
                   api_visibility="private", show_progress="hidden")
    model_events = [p.model.change, p.custom_model.submit, p.custom_model.blur]
    gr.on(model_events, setup.model_note, inputs=[p.model, p.custom_model], outputs=p.model_note,
          api_name="model_note", concurrency_limit=4, show_progress="hidden")
    gr.on(model_events, setup.model_defaults, inputs=[p.model, p.custom_model, p.method, p.preset],
          outputs=[p.preset, p.calib_samples, p.calib_seqlen, *fields.values()], api_name="model_defaults",
          concurrency_limit=4, show_progress="hidden", trigger_mode="always_last")
    changes = [c.change for c in [*p.model_inputs, p.calib_samples, p.calib_seqlen, *fields.values()]]
    gr.on([p.demo.load, *changes], setup.estimate_md, inputs=[*p.model_inputs, p.calib_samples, p.calib_seqlen],
          inputs_kwargs=fields, outputs=[p.estimate_box, p.start_btn], api_name="estimate",
          trigger_mode="always_last", show_progress="hidden", concurrency_limit=4)
