"""The Quantize tab's settings before a run: the model a form names, its note, the live estimate (bits, size,
duration) with the Start button's state, and the form values a preset or a model change brings.

The settings form reaches ``estimate_md`` as keyword arguments named by the form field (``vector_len=4,
bits=2, activations=..., seed=0``; see ``form``), collected into one ``settings`` dict. Durations are
corrected by what this server's last finished run of a method took (``learn_speed``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import gradio as gr

from ..models import BUNDLED, TINY
from ..quant.config import CalibConfig
from ..quant.distill import sized_preset
from . import form, views
from .estimate import estimate, model_info, time_estimate
from .services import Shared


def model_name(model: str | None, custom_model: str | None) -> str:
    """The model a form names: the dropdown's choice, or the textbox when the dropdown says "a hub id or
    a local directory" (``form.OTHER_MODEL``; the textbox is ignored otherwise). API clients that send no
    dropdown value get the textbox."""
    custom = (custom_model or "").strip()
    if model == form.OTHER_MODEL or not model:
        if not custom:
            raise ValueError("type a hub id (owner/name) or a local model directory in the box under Model")
        return custom
    return model


def read_calibration_file(calib_file, max_bytes: int) -> str:
    """The text of an uploaded calibration .txt (ValueError when missing, too large, not UTF-8 or empty)."""
    if not calib_file:
        raise ValueError("calibration source is 'my .txt file' but no file was uploaded")
    path = Path(calib_file if isinstance(calib_file, str) else calib_file.get("path", ""))
    if not path.is_file():
        raise ValueError("the uploaded calibration file is gone; upload it again")
    return read_text_file(path, max_bytes, "calibration file")


def read_text_file(path: Path, max_bytes: int, what: str) -> str:
    """The UTF-8 text of an uploaded file ``path`` (ValueError naming ``what`` when it is over ``max_bytes``, not
    UTF-8 or empty)."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{what} is {views.mb(size)}; at most {views.mb(max_bytes)} allowed")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise ValueError(f"{what} is empty")
    return text


class QuantizeForm:
    """Handlers of the settings form. ``field_keys``: the form's fields in page order (the layout sets them)."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.field_keys: tuple[str, ...] = ()
        self._lock = threading.Lock()
        self._speed: dict[tuple[str, str], float] = {}  # (device, method) -> measured / rough seconds, last run

    def model_note(self, model: str, custom_model: str) -> str:
        try:
            name = model_name(model, custom_model)
        except ValueError as exc:
            return views.model_note("", error=str(exc))
        if name in (BUNDLED, TINY):
            return views.model_note(name)
        try:
            return views.model_note(name, model_info(name))
        except ValueError as exc:
            return views.model_note(name, error=self.shared.public(exc))


    def estimate_md(self, model, custom_model, method, calib_samples=None, calib_seqlen=None, **settings):
        """Live bits per weight, checkpoint size and a rough duration for the current settings (warnings inline,
        no popup), and the Start button: disabled while the settings are refused."""
        try:
            name = model_name(model, custom_model)
            config = form.config_from(method, settings)
            samples, seqlen = _calib_size(calib_samples, calib_seqlen)
            info = model_info(name)
            est = estimate(info, method, config)  # (a setting may not fit this model's layers)
            seconds, basis = self.predicted_seconds(info, method, config, samples, seqlen)
        except ValueError as exc:
            return f"⚠️ {self.shared.public(form.readable(exc))}", gr.Button(interactive=False)
        shown = views.estimate_md(info, est, seconds, basis)
        too_long = self.duration_refusal(seconds)
        if too_long:
            return f"{shown}\n\n⚠️ {too_long}", gr.Button(interactive=False)
        return shown, gr.Button(interactive=True)

    def duration_refusal(self, seconds: float | None) -> str | None:
        """Why a run estimated at ``seconds`` may not start here (longer than ``max_estimate_hours``), or None."""
        limit = self.shared.settings.max_estimate_hours
        if seconds is None or seconds <= limit * 3600:
            return None
        return (f"this run would take about {seconds / 3600:,.0f} h; a run may take at most {limit:g} h here: "
                "fewer calibration samples, fewer k-means or training iterations, or a smaller model")

    def check_duration(self, info, method: str, config, samples: int, seqlen: int) -> None:
        """ValueError when a run's estimate is longer than a run may take here (``duration_refusal``)."""
        refusal = self.duration_refusal(self.predicted_seconds(info, method, config, samples, seqlen)[0])
        if refusal:
            raise ValueError(refusal)

    def predicted_seconds(self, info, method: str, config, samples: int, seqlen: int) -> tuple[float | None, str]:
        """(seconds a run should take here, what that rests on): ``estimate.time_estimate`` (a 2-core CPU) times
        what this server's last finished run of the method took against its own estimate; None on another
        device until a run there has finished."""
        rough = time_estimate(info, config, samples, seqlen, method)
        with self._lock:
            factor = self._speed.get((self.shared.settings.device, method))
        if factor is not None:
            return rough * factor, (f"from this server's last {views.method_label(method)} run, which took "
                                    f"{factor:.2g}× the rough estimate")
        if self.shared.settings.device != "cpu":
            return None, f"no estimate on {self.shared.settings.device} until a run has finished here"
        return rough, ("rough: from runs measured on 2 idle CPU cores (VPTQ layer by layer, with each layer's own "
                       "settings); a busy server is slower, layer-wise fine-tuning is not counted")

    @staticmethod
    def _sized(values: dict, info) -> dict:
        """A preset's form values for the model ``info`` describes (distillation only up to the size limit)."""
        return sized_preset(values, info.linear_weights + info.other_params)[0]

    def preset_form(self, method, preset, model=None, custom_model=None) -> list:
        """The preset changed (or the method): one value per form field in ``form`` order, ``gr.skip()`` where
        the preset fixes nothing, sized for the chosen model when it can be read (as ``model_defaults``)."""
        keys = list(self.field_keys)
        values = form.preset_values(method, preset, keys)
        if model is not None:
            try:
                values = self._sized(values, model_info(model_name(model, custom_model)))
            except ValueError:
                pass  # an unreadable model keeps the preset as it is (its note says why)
        return [values.get(k, gr.skip()) for k in keys]

    def model_defaults(self, model, custom_model, method, preset):
        """The model changed: settings sized for it. Narrow models (the tiny test model) get small codebooks
        and calibration (the presets are sized for SmolLM2); others get the chosen preset back (the 2-bit one
        when it was "custom") and the usual calibration. Returns (preset, calibration samples, tokens per sample,
        then one value per form field in ``form`` order, ``gr.skip()`` where unchanged)."""
        keys = list(self.field_keys)
        skip = [gr.skip()] * (3 + len(keys))
        try:
            info = model_info(model_name(model, custom_model))
        except ValueError:
            return skip
        width = max((max(shape) for shape in info.linear_shapes), default=0)
        if width <= form.SMALL_MODEL_WIDTH:
            samples, seqlen = form.SMALL_MODEL_CALIB
            return [form.CUSTOM, samples, seqlen, *(form.SMALL_MODEL_VALUES.get(k, gr.skip()) for k in keys)]
        chosen = preset if preset in form.preset_names() else form.DEFAULT_PRESET
        values = self._sized(form.preset_values(method, chosen, keys), info)
        samples, seqlen = form.MODEL_CALIB
        return [chosen, samples, seqlen, *(values.get(k, gr.skip()) for k in keys)]

    def learn_speed(self, snap) -> None:
        """A run finished: how long it took against its rough estimate corrects the next estimates."""
        rough, seconds = snap.meta.get("rough_seconds"), (snap.result or {}).get("summary", {}).get("seconds")
        if snap.status == "done" and snap.kind == "quantize" and rough and seconds:
            with self._lock:
                self._speed[(snap.device, snap.meta.get("method"))] = float(seconds) / float(rough)


def _calib_size(samples, seqlen) -> tuple[int, int]:
    """The calibration size fields as ints (ValueError naming the field, as ``CalibConfig`` checks them); a field
    not given (a caller without them) takes the usual size."""
    samples = form.MODEL_CALIB[0] if samples is None else samples
    seqlen = form.MODEL_CALIB[1] if seqlen is None else seqlen
    calib = CalibConfig(samples=_as_int(samples, "samples"), seqlen=_as_int(seqlen, "seqlen"))
    return calib.samples, calib.seqlen


def _as_int(value, name: str):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
