import re
from dataclasses import dataclass

import pytest

from vptq_core.quant import methods
from vptq_core.quant.config import (
    ALLOCATIONS,
    DISTILL_DATA,
    DISTILL_LR,
    SCALAR_DISTILL_LR,
    CalibConfig,
    ConfigBase,
    LRQConfig,
    ScalarConfig,
    VPTQConfig,
)
from vptq_core.quant.methods import make_config
from vptq_core.quant.settings import declared, grouped, setting, undeclared
from vptq_core.studio import form


def test_defaults_valid_and_bits():
    cfg = VPTQConfig()
    assert cfg.index_bits == 12 and cfg.bits_per_index_weight == 2.0
    assert VPTQConfig(vector_len=8, num_centroids=256, num_res_centroids=256).bits_per_index_weight == 2.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_centroids": 100}, "num_centroids must be a power of two in 2..65536, got 100"),
        ({"vector_len": 0}, "vector_len must be in 1..16, got 0"),
        ({"num_res_centroids": 3}, "num_res_centroids must be a power of two"),
        ({"outlier_percent": 75.0}, r"outlier_percent must be in \[0.0, 50.0\], got 75.0"),
        ({"damp_percent": 0.0}, r"damp_percent must be in \(0.0, 1.0\]"),
        ({"enable_norm": "yes"}, "enable_norm must be true or false"),
        ({"group_num": 1.5}, "group_num must be an integer"),
    ],
)
def test_vptq_config_errors_name_field_value_and_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VPTQConfig(**kwargs)


def test_scalar_lrq_calib_errors():
    with pytest.raises(ValueError, match="bits must be in 1..8, got 9"):
        ScalarConfig(bits=9)
    with pytest.raises(ValueError, match="act_granularity must be 'token'.*'token_asym'.*got 'channel'"):
        LRQConfig(act_granularity="channel")
    with pytest.raises(ValueError, match="seqlen must be in 8..131072, got 4"):
        CalibConfig(seqlen=4)


def test_method_config_from_dict():
    assert make_config("gptq", {"bits": 3}).bits == 3
    assert make_config("vptq", {"vector_len": 4}).vector_len == 4
    with pytest.raises(ValueError, match="unknown method 'awq'; allowed: vptq, gptq, rtn, lrq"):
        make_config("awq")
    with pytest.raises(ValueError, match=r"unknown VPTQConfig settings \['centroidz'\]"):
        make_config("vptq", {"centroidz": 4})


# ------------------------------------------------------------------- settings declared once (quant/settings.py)
BUILTIN_CONFIGS = (VPTQConfig, ScalarConfig, LRQConfig, CalibConfig)


def test_every_builtin_setting_is_declared():
    """Nobody adds a setting without its declaration (range, label, where it shows) or an explicit internal()."""
    configs = {*BUILTIN_CONFIGS, *(m.config_class for m in methods.all_methods())}
    assert {c.__name__: undeclared(c) for c in configs} == {c.__name__: [] for c in configs}
    assert declared(VPTQConfig)["layer_plan"].kind == "internal"
    assert not declared(VPTQConfig)["layer_plan"].shown_in("cli") and not declared(VPTQConfig)["layer_plan"].shown_in(
        "form")


def _out_of_range(meta):
    """A value just outside a declared range, and the message the checks give for it."""
    if meta.kind in ("int", "pow2"):
        allowed = f">= {meta.lo}" if meta.hi is None else f"in {meta.lo}..{meta.hi}"
        return meta.lo - 1, f"must be {allowed}, got {meta.lo - 1}"
    bracket = "(" if meta.lo_open else "["
    bad = meta.lo if meta.lo_open else meta.lo - 1.0
    return bad, f"must be in {bracket}{meta.lo}, {meta.hi}], got {bad}"


@pytest.mark.parametrize("config_class", BUILTIN_CONFIGS, ids=lambda c: c.__name__)
def test_every_declared_setting_is_checked(config_class):
    """Each config runs the checks of every setting it declares: a value outside each range, choice or type
    is refused with the message made from the declaration."""
    for name, meta in declared(config_class).items():
        if meta.kind in ("int", "pow2", "float"):
            bad, message = _out_of_range(meta)
            with pytest.raises(ValueError, match=re.escape(f"{name} {message}")):
                config_class(**{name: bad})
        elif meta.kind == "choice":
            with pytest.raises(ValueError, match=re.escape(f"{name} must be {meta.allowed()}, got 'bogus'")):
                config_class(**{name: "bogus"})
        elif meta.kind == "bool":
            with pytest.raises(ValueError, match=f"{name} must be true or false, got 'yes'"):
                config_class(**{name: "yes"})


def test_choice_and_power_of_two_messages():
    with pytest.raises(ValueError, match=r"^distill_data must be one of calibration, sampled, mixed, got 'x'$"):
        VPTQConfig(distill_data="x")
    with pytest.raises(ValueError, match=r"^allocation must be one of cap, sensitivity, got 'x'$"):
        VPTQConfig(allocation="x")
    with pytest.raises(ValueError, match=r"^target_chain must be 'quantized' \(original block on the quantized "
                                         r"chain's inputs\) or 'fp' \(the original model's own block outputs\)"):
        LRQConfig(target_chain="x")
    with pytest.raises(ValueError, match=r"^act_bits must be 4, 8 or 16 \(16 = no activation quantization\), got 6$"):
        ScalarConfig(act_bits=6)
    with pytest.raises(ValueError, match=r"^act_bits must be 4, 8 or 16 .*, got True$"):
        ScalarConfig(act_bits=True)
    with pytest.raises(ValueError, match=r"^distill_checkpointing must be true, false or 'auto', got 1$"):
        VPTQConfig(distill_checkpointing=1)  # 1 == True, but not a bool
    assert VPTQConfig(distill_checkpointing=False).distill_checkpointing is False
    assert VPTQConfig(num_res_centroids=0).res_bits == 0  # "0 = none": a power-of-two setting that allows 0
    with pytest.raises(ValueError, match=r"^num_res_centroids must be in 2\.\.65536, got 1$"):
        VPTQConfig(num_res_centroids=1)
    with pytest.raises(ValueError, match=r"^outlier_centroids must be in 2\.\.65536, got 0$"):
        VPTQConfig(outlier_centroids=0)  # no meaning for 0: refused
    with pytest.raises(ValueError, match=r"num_res_centroids \(64\) must be <= num_centroids \(16\)"):
        VPTQConfig(num_centroids=16, num_res_centroids=64)  # a rule between settings, in the config's own check
    with pytest.raises(ValueError, match="calibration text must be 'wiki', 'pydocs' or a file path"):
        CalibConfig(text="")


def test_shared_settings_show_the_same_everywhere():
    """A setting several configs declare is one flag and one form field: its words and place agree."""
    seen = {}
    for config_class in (*BUILTIN_CONFIGS[:3], *(m.config_class for m in methods.all_methods())):
        for name, meta in declared(config_class).items():
            shown = (meta.label, meta.help, meta.group, meta.row, meta.hint, meta.zero, meta.flag, meta.kind,
                     meta.switch, meta.cli, meta.form)
            assert seen.setdefault(name, shown) == shown, (config_class.__name__, name)
    assert declared(ScalarConfig)["distill_lr"] == declared(VPTQConfig)["distill_lr"]  # redeclared: new default only
    assert ScalarConfig().distill_lr == SCALAR_DISTILL_LR and VPTQConfig().distill_lr == DISTILL_LR


def test_declaration_mistakes_fail_at_once():
    cases = [
        (dict(default=0), "a int setting needs lo="),
        (dict(default=1.0, lo=0.0), "a float setting needs hi="),
        (dict(default=4, lo=1, hi=3), "the default must be in 1..3, got 4"),
        (dict(default="a", choices=("a",)), "at least two choices"),
        (dict(default="c", choices=("a", "b")), "the default must be 'a' or 'b', got 'c'"),
        (dict(default=1, lo=0, switch=True), "switch= is for bool settings"),
        (dict(default=True, flag="x"), "flag must start with '--'"),
        (dict(default=1, kind="big", lo=0), "setting kind must be one of"),
        (dict(default=[1]), "cannot tell the kind"),
    ]
    for kwargs, message in cases:
        default = kwargs.pop("default")
        with pytest.raises((ValueError, TypeError), match=re.escape(message)):
            setting(default, **kwargs)
    with pytest.raises(ValueError, match="where must be 'cli' or 'form'"):
        declared(VPTQConfig)["vector_len"].shown_in("gui")


def test_a_config_declares_its_settings_on_its_fields():
    @dataclass(frozen=True)
    class Small(ConfigBase):
        steps: int = setting(3, lo=0, hi=9, zero="off", group="small", help="steps")
        name_only: int = setting(1, lo=1)  # no group: only --set and the API
        plain: str = "x"  # undeclared: no checks, no flag, no field

    meta = declared(Small)
    assert list(meta) == ["steps", "name_only"] and undeclared(Small) == ["plain"]
    assert (meta["steps"].label, meta["steps"].flag, meta["steps"].form_hint, meta["steps"].cli_help) == (
        "steps", "--steps", "0 = off", "steps; 0 = off")
    assert meta["steps"].shown_in("cli") and meta["steps"].shown_in("form")
    assert not meta["name_only"].shown_in("cli") and meta["name_only"].label == "name only"
    assert grouped([Small], "cli") == {"small": {"steps": meta["steps"]}}
    with pytest.raises(ValueError, match=r"^steps must be in 0\.\.9, got 10$"):
        Small(steps=10)
    with pytest.raises(ValueError, match=r"^name_only must be >= 1, got 0$"):
        Small(name_only=0)
    assert Small(plain=5).plain == 5


def test_builtin_form_layout_comes_from_the_declarations():
    """The app's form, as the declarations lay it out: groups in order, rows, labels (with hints) and kinds."""
    layout = {g.name: ([[f.title for f in row] for row in g.rows], g.methods) for g in form.form_groups()}
    assert layout == {
        "VPTQ": ([["vector length", "centroids (power of 2)", "residual centroids (0 = none)"],
                  ["outlier columns %", "groups", "k-means iterations"],
                  ["normalize columns", "permute columns (Hessian order)", "codebook bits"],
                  ["fine-tune iterations", "codebook refit steps (after the sweep; 0 = off)"],
                  ["total bits budget (0 = off)", "max total bits per layer (0 = off)",
                   "bits allocation (sensitivity = measured per layer)"]], ("vptq",)),
        "scalar grid (GPTQ / RTN / LRQ)": (
            [["bits", "group size (0 = per channel)", "activations (W·A8 = 8-bit inputs to the linears)"]],
            ("gptq", "rtn", "lrq")),
        "column order (GPTQ)": ([["act order (GPTQ)"]], ("gptq", "rtn")),
        "LRQ": ([["LRQ rank (0 = auto)", "LRQ iterations per block", "LRQ learning rate"]], ("lrq",)),
        "distillation (every method)": (
            [["distillation steps", "distillation data (sampled = text the original writes)",
              "sampled windows (sampled / mixed data)", "held-out check every (steps; 0 = quarter)",
              "distillation lr (VPTQ: × the codebooks' RMS)",
              "time budget (s for the whole run, distillation fits in; 0 = none)", "time budget scale"]],
             ("vptq", "gptq", "rtn", "lrq")),
        "calibration": ([["self-written calibration share (0..1, written by the model)",
                             "rotate the residual stream (auto = where the family allows)", "seed (0..2^64 - 1)"]],
                        ("vptq", "gptq", "rtn", "lrq")),
    }
    fields = {f.key: f for g in form.form_groups() for f in g.fields}
    kinds = {key: (f.kind, f.precision) for key, f in fields.items()}
    assert kinds["num_centroids"] == ("int", 0) and kinds["outlier_percent"] == ("float", None)
    assert kinds["enable_norm"][0] == "bool" and fields["allocation"].choices == ALLOCATIONS
    assert fields["distill_data"].choices == DISTILL_DATA
    assert fields["activations"].choices == tuple(form.ACTIVATIONS)
    assert dict(form.FIELD_LABELS) == {**{key: f.label for key, f in fields.items()},
                                       "samples": "calibration samples", "seqlen": "tokens per sample"}
    assert form.readable("vector_len must be in 1..16, got 0") == "vector length must be in 1..16, got 0"
