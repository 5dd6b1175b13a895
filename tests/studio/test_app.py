"""The app's page and its settings form: components that follow the method registry, presets, the live
estimate and the refusals of bad settings, settings that follow the model; through the API (gradio_client, on
the tiny model) where the page would call them."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from transformers import LlamaConfig

gradio_client = pytest.importorskip("gradio_client")
import gradio as gr  # noqa: E402
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from studio_helpers import estimate_kwargs, gate_jobs, job_kwargs, serve_app  # noqa: E402

import app as studio_app  # noqa: E402
from vptq_core.models import TINY  # noqa: E402
from vptq_core.quant import methods  # noqa: E402
from vptq_core.quant.bits import scalar_bits  # noqa: E402
from vptq_core.quant.config import ConfigBase, check_int  # noqa: E402
from vptq_core.quant.methods import Method  # noqa: E402
from vptq_core.studio import form, views  # noqa: E402
from vptq_core.studio.estimate import estimate, model_info  # noqa: E402

served = pytest.fixture(scope="module", name="served")(serve_app)
gated = pytest.fixture(name="gated")(gate_jobs)


# ------------------------------------------------------------------------------------- without a server
def test_message_content_in_both_formats():
    assert views.message_text("plain") == "plain"
    assert views.message_text([{"type": "text", "text": "a"}, {"type": "file", "file": {"path": "x"}},
                               {"type": "text", "text": "b"}]) == "ab"
    assert views.message_text({"type": "text", "text": "one block"}) == "one block"
    assert views.message_text(("/tmp/image.png", "alt")) == ""
    history = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"role": "assistant", "content": "hello"}, {"role": "system", "content": "ignored"}]
    assert views.normalize_history(history) == [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]


def test_settings_form_follows_the_method_registry(tmp_path):
    demo = studio_app.build_app(studio_app.AppSettings(workdir=tmp_path, default_model=TINY))
    fields = demo.settings_form
    every_setting = {s for m in methods.all_methods() for s in m.setting_names}
    assert all(set(form.field_settings(key)) <= every_setting for key in fields), sorted(fields)
    values = {k: c.value for k, c in fields.items()}
    for m in methods.all_methods():
        # A method's config takes exactly the form fields that are its settings.
        config = form.config_from(m.name, values)
        mine = {s for key in fields for s in form.field_settings(key) if s in m.setting_names}
        assert {k: v for k, v in config.to_dict().items() if k in mine} == form.method_settings(m.name, values)
        assert {k: v for k, v in config.to_dict().items() if k not in mine} == {
            k: v for k, v in m.make_config().to_dict().items() if k not in mine}
        # A preset sets exactly what it fixes, through fields the form has.
        for name, fixed in m.presets.items():
            shown = {k: v for k, v in fixed.items() if k not in form.ACT_SETTINGS}
            if any(k in fixed for k in form.ACT_SETTINGS):  # one "activations" field holds both settings
                shown[form.ACT_FIELD] = form.act_label(*(fixed[k] for k in form.ACT_SETTINGS))
            assert form.preset_values(m.name, name, fields) == shown
            assert form.config_from(m.name, {**values, **fixed}).to_dict().items() >= fixed.items()
        assert form.preset_values(m.name, form.CUSTOM, fields) == {}
    assert form.method_settings("rtn", {"activations": "8-bit per tensor (static, calibrated)", "rank": 3,
                                        "vector_len": 4, "act_order": 0}) == {
        "act_bits": 8, "act_granularity": "tensor", "act_order": False}
    assert form.uses("lrq", ["rank"]) and not form.uses("gptq", ["rank", "vector_len"])
    assert form.uses("vptq", ["vector_len"]) and not form.uses("vptq", ["bits", "activations"])
    with pytest.raises(ValueError, match=r"method must be one of vptq, gptq, rtn, lrq, got 'awq'"):
        form.config_from("awq", values)
    for method, bad, message in (("vptq", {"vector_len": 0}, r"vector_len must be in 1\.\.16, got 0"),
                                 ("rtn", {"bits": 9}, r"bits must be in 1\.\.8, got 9"),
                                 ("lrq", {"iters": -1}, r"iters must be in 0\.\.100000, got -1"),
                                 ("gptq", {"activations": "4-bit"}, r"activations must be one of '16-bit")):
        with pytest.raises(ValueError, match=message):
            form.config_from(method, {**values, **bad})


def test_settings_groups_and_presets_in_the_page_config(tmp_path):
    """The page starts with the default method's groups shown and its 2-bit preset applied."""
    demo = studio_app.build_app(studio_app.AppSettings(workdir=tmp_path))
    fields = demo.settings_form
    default = methods.all_methods()[0]
    assert {k: fields[k].value for k in default.preset("2.5 bits")} == default.preset("2.5 bits")
    shown = {k for k, c in fields.items() if _visible(c)}
    assert shown == {k for k in fields if form.uses(default.name, [k])}


@dataclass(frozen=True)
class ToyConfig(ConfigBase):
    bits: int = 3
    flavour: str = "plain"  # a setting the form has no field for

    def __post_init__(self) -> None:
        check_int("bits", self.bits, 1, 8)


@pytest.fixture
def toy_method():
    """A method the app has never heard of, registered for one test."""
    toy = methods.register(Method(
        name="toy", label="Toy", description="a test method", config_class=ToyConfig,
        bits=lambda config, out_f, in_f: scalar_bits(out_f, in_f, config.bits, 0),
        describe=lambda settings: f"toy {settings.get('bits')}", presets={"2 bits": {"bits": 2, "flavour": "hot"}},
        quantize_linear=lambda W, H, config, bias, cache: None,
    ))
    yield toy
    methods.unregister(toy.name)


def test_a_newly_registered_method_gets_its_fields(tmp_path, toy_method):
    demo = studio_app.build_app(studio_app.AppSettings(workdir=tmp_path, default_model=TINY))
    fields = demo.settings_form
    method_radio = next(b for b in demo.blocks.values() if isinstance(b, gr.Radio) and b.label == "Method")
    assert ("Toy", "toy") in method_radio.choices
    values = {k: c.value for k, c in fields.items()}
    assert form.config_from("toy", values) == ToyConfig(bits=values["bits"])  # flavour keeps its default
    assert form.preset_values("toy", "2 bits", fields) == {"bits": 2}
    shown = {k for k in fields if form.uses("toy", [k])}
    assert shown == {"bits"}
    estimate, start = demo.studio.quantize_form.estimate_md(TINY, "", "toy", **{**values, "bits": 2})
    assert "**2.000 index bits**" in estimate and start.interactive


def _visible(component) -> bool:
    parent = component.parent
    while parent is not None:
        if getattr(parent, "visible", True) is False:
            return False
        parent = parent.parent
    return component.visible is not False


# ------------------------------------------------------------------------------------ through the API
def test_bad_settings_give_clear_errors(served, gated, monkeypatch):
    client = Client(served.url, verbose=False)
    cases = [
        # The form's words for its fields, not the settings' code names.
        (dict(num_centroids=1000), r"^centroids must be a power of two in 2\.\.65536, got 1000"),
        (dict(vector_len=0), r"^vector length must be in 1\.\.16, got 0"),
        (dict(method="lrq", rank=-1), r"^LRQ rank must be in 0\.\.8192, got -1"),
        (dict(calib_samples=0), r"^calibration samples must be in 1\.\.100000, got 0"),
        (dict(seed=2**64), r"^seed must be in 0\.\.18446744073709551615 \(2\*\*64 - 1\), got 18446744073709551616"),
        (dict(seed=-1), r"^seed must be in 0\.\.18446744073709551615"),
        (dict(method="awq"), r"'awq' .* is not in the list of choices: \['vptq', 'gptq', 'rtn', 'lrq'\]"),
        (dict(calib_source=form.FILE_SOURCE), r"no file was uploaded"),
        (dict(model=form.OTHER_MODEL, custom_model="no such model"), r"'no such model' is not a built-in name"),
        (dict(model=form.OTHER_MODEL, custom_model=""), r"type a hub id \(owner/name\) or a local model directory"),
        (dict(method="rtn", activations="4-bit"), r"4-bit is not in the list of choices: \['16-bit \(weight-only\)'"),
    ]
    for overrides, message in cases:
        with pytest.raises(AppError, match=message):
            client.predict(**job_kwargs(**overrides), api_name="/start")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AppError, match=r"cannot reach the Hugging Face hub to fetch 'someone/model'"):
        client.predict(**job_kwargs(model=form.OTHER_MODEL, custom_model="someone/model"), api_name="/start")
    assert served.studio.manager.jobs(client.session_hash) == [] and gated.runs == []
    # A hub id typed in the box counts only when the dropdown says so.
    assert client.predict(**job_kwargs(custom_model="someone/model"), api_name="/start")[0]
    assert [s.meta["model"] for s in served.studio.manager.jobs(client.session_hash)] == [TINY]
    # The live estimate explains instead of raising, and Start is disabled until the settings are accepted.
    # (the API returns the text; the page also gets the Start button's state)
    assert client.predict(**estimate_kwargs(num_centroids=1000), api_name="/estimate").startswith(
        "⚠️ centroids must be a power of two")
    setup = served.studio.quantize_form
    for bad in (dict(num_centroids=1000), dict(seed=2**64), dict(calib_samples=0)):
        text, start = setup.estimate_md(**estimate_kwargs(**bad))
        assert text.startswith("⚠️") and start.interactive is False, bad
    assert "seed must be in 0..18446744073709551615" in setup.estimate_md(**estimate_kwargs(seed=2**64))[0]
    # A setting that this model's layers cannot meet is refused the same way (no error mark, Start disabled).
    text, start = setup.estimate_md(**estimate_kwargs(layer_bits_cap=0.5))
    assert text.startswith("⚠️ max total bits per layer 0.5: no vector length fits a ") and not start.interactive
    with pytest.raises(AppError, match=r"^max total bits per layer 0\.5: no vector length fits"):
        client.predict(**job_kwargs(layer_bits_cap=0.5), api_name="/start")
    good = client.predict(**estimate_kwargs(), api_name="/estimate")
    assert "**1.000 index bits**" in good and "14 linears in 2 blocks" in good
    assert setup.estimate_md(**estimate_kwargs())[1].interactive is True
    # The duration is shown before Start, with what it rests on.
    assert re.search(r"Takes ≈ \*\*\d+ s\*\*.*rough: from runs measured on 2 idle CPU cores", good), good
    assert "**3.000 index bits**" in client.predict(**estimate_kwargs(method="gptq", bits=3), api_name="/estimate")
    with pytest.raises(AppError, match=r"evaluation windows must be in 1\.\.512, got 0"):
        client.predict("anything", 0, 64, api_name="/evaluate")
    client.close()


def test_presets_fill_exactly_what_they_fix(served, tmp_path):
    client = Client(served.url, verbose=False)
    keys = list(served.demo.settings_form)
    for method, name in (("vptq", "3.5 bits"), ("lrq", "3.5 bits"), ("lrq", "w4a8"), ("gptq", form.CUSTOM)):
        fixed = methods.get(method).presets.get(name, {})
        shown = {k: v for k, v in fixed.items() if k not in form.ACT_SETTINGS}
        if any(k in fixed for k in form.ACT_SETTINGS):  # one "activations" field holds both settings
            shown[form.ACT_FIELD] = form.act_label(*(fixed[k] for k in form.ACT_SETTINGS))
        values = client.predict(method, name, "smollm2-135m-instruct", "", api_name="/preset")
        assert dict(zip(keys, values)) == {k: shown.get(k, gr.skip()) for k in keys}, (method, name)
    client.close()
    # picking a preset sizes it for the chosen model as picking the model does (no distillation for 7B)
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000).save_pretrained(tmp_path / "big")
    setup = served.studio.quantize_form
    got = dict(zip(keys, setup.preset_form("vptq", "2.5 bits", form.OTHER_MODEL, str(tmp_path / "big"))))
    assert got["distill_iters"] == 0 and got["vector_len"] == methods.get("vptq").presets["2.5 bits"]["vector_len"]
    small = dict(zip(keys, setup.preset_form("vptq", "2.5 bits", "smollm2-135m-instruct", "")))
    assert small["distill_iters"] == methods.get("vptq").presets["2.5 bits"]["distill_iters"] > 0
    unreadable = dict(zip(keys, setup.preset_form("vptq", "2.5 bits", form.OTHER_MODEL, "no such")))
    assert unreadable == small


def test_settings_follow_the_model(served, tmp_path):
    setup = served.studio.quantize_form
    keys = list(setup.field_keys)
    preset, samples, seqlen, *values = setup.model_defaults(TINY, "", "vptq", "2.5 bits")
    assert (preset, (samples, seqlen)) == (form.CUSTOM, form.SMALL_MODEL_CALIB)
    small = {k: v for k, v in zip(keys, values) if v != gr.skip()}
    assert small == form.SMALL_MODEL_VALUES
    info = model_info(TINY)
    two_bits = form.initial_values("2.5 bits")
    # SmolLM2-sized: the 2.5-bit budget cannot be met on 64-wide layers by capping the preset's codebook (the
    # codebook alone costs more); the preset's own per-layer plan is bounded by its budget.
    with pytest.raises(ValueError, match="bits_budget 2.5 cannot be met on this model with vector_len 6, "
                                         "num_centroids 4096: the least it reaches is"):
        estimate(info, "vptq", form.config_from("vptq", {**two_bits, "allocation": "cap"}))
    planned = estimate(info, "vptq", form.config_from("vptq", two_bits))
    assert planned.planned and planned.total_bits_per_weight == 2.5
    assert estimate(info, "vptq", form.config_from("vptq", {**two_bits, **small, "allocation": "cap"})
                    ).total_bits_per_weight < 2
    # A wider model (read from its config alone) gets the chosen preset back, or the 2-bit one after "custom".
    LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=8, vocab_size=1000).save_pretrained(tmp_path / "wide")
    for chosen, expected in (("3.5 bits", "3.5 bits"), (form.CUSTOM, "2.5 bits")):
        preset, samples, seqlen, *values = setup.model_defaults(form.OTHER_MODEL, str(tmp_path / "wide"), "vptq",
                                                                chosen)
        assert (preset, (samples, seqlen)) == (expected, form.MODEL_CALIB)
        assert {k: v for k, v in zip(keys, values) if v != gr.skip()} == form.preset_values("vptq", expected, keys)
    # A 7B-shaped model keeps the preset but not its distillation (whole model + original in memory)
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000).save_pretrained(tmp_path / "big")
    preset, _, _, *values = setup.model_defaults(form.OTHER_MODEL, str(tmp_path / "big"), "vptq", "2.5 bits")
    got = {k: v for k, v in zip(keys, values) if v != gr.skip()}
    assert preset == "2.5 bits" and got == {**form.preset_values("vptq", "2.5 bits", keys), "distill_iters": 0,
                                            "calib_sampled_share": 0.0}
    # A model that cannot be read changes nothing (its note says why).
    assert all(v == gr.skip() for v in setup.model_defaults(form.OTHER_MODEL, "no such", "vptq", "2.5 bits"))
