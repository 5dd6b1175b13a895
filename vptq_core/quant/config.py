"""Validated, frozen settings for the built-in quantization methods and for calibration.

Each setting is declared once, on its field, with ``setting()`` (quant/settings.py): its range or choices,
the form's label and the CLI's flag. ``ConfigBase.__post_init__`` checks every declared setting; a config's own
``__post_init__`` adds only the rules that tie settings together. The CLI's flags and the app's form are
generated from the same declarations (docs/contributing.md, "Adding a setting").

Every bad value raises ``ValueError`` naming the field, the value and what is allowed; the CLI turns that
into exit code 2 and the app into a visible error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields

from .settings import check_float, check_int, check_pow2, check_settings, internal, redeclare, setting

__all__ = [
    "ACT_GRANULARITIES", "ALLOCATIONS", "DISTILL_DATA", "GROUPS", "CalibConfig", "ConfigBase", "DistillSettings",
    "LRQConfig", "ScalarConfig", "VPTQConfig", "check_float", "check_int", "check_pow2",
]

DISTILL_DATA = ("calibration", "sampled", "mixed")  # DistillSettings.distill_data
ALLOCATIONS = ("cap", "sensitivity")  # VPTQConfig.allocation
# VPTQConfig.codebook_bits: how a codebook entry is stored (quant/codebook_grid.py)
CODEBOOK_BITS = {16: "the model's float dtype, the public format", 8: "int8, a float32 scale per dimension"}
ACT_GRANULARITIES = ("token", "token_asym", "tensor")  # act_granularity of the scalar methods

# The groups the settings are shown in, in the order the app's form and --help show them (a new method's own
# group comes after these). The form shows the calibration group with the calibration text and windows.
VPTQ_GROUP = "VPTQ"
SCALAR_GROUP = "scalar grid (GPTQ / RTN / LRQ)"
ORDER_GROUP = "column order (GPTQ)"
LRQ_GROUP = "LRQ"
DISTILL_GROUP = "distillation (every method)"
CALIB_GROUP = "calibration"
GROUPS = (VPTQ_GROUP, SCALAR_GROUP, ORDER_GROUP, LRQ_GROUP, DISTILL_GROUP, CALIB_GROUP)


def _as_json(value):
    return [_as_json(v) for v in value] if isinstance(value, (tuple, list)) else value


class ConfigBase:
    """``to_dict`` / ``from_dict`` for frozen config dataclasses (unknown keys are refused by name), and the
    checks of every declared setting (a subclass's ``__post_init__`` calls ``super().__post_init__()`` first)."""

    def __post_init__(self) -> None:
        check_settings(self)

    def to_dict(self) -> dict:
        """The settings as JSON holds them (tuples as lists), so a dict read back from job.json compares equal."""
        return {name: _as_json(value) for name, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict):
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown {cls.__name__} settings {sorted(unknown)}; allowed: {sorted(names)}")
        return cls(**data)

    def for_model(self, shapes) -> ConfigBase:
        """The config a run on a model with these block linear shapes [(out, in), ...] uses: settings that
        depend on the whole model (a total-bits budget) resolved; itself when there are none. The pipeline,
        the bits shown before a run and the time estimate all go through it."""
        return self

    def for_layer(self, name: str) -> ConfigBase:
        """The config the linear ``name`` (full module name) is quantized with: itself unless the config plans
        layers one by one (VPTQ's ``layer_plan``)."""
        return self


# The measured best distillation steps (docs/methods.md, "End-to-end distillation"), relative to what they
# train: scalar methods' log-scales; VPTQ codebooks step by DISTILL_LR times the model's median codebook RMS.
SCALAR_DISTILL_LR = 2e-3
DISTILL_LR = 2.5e-3


# The settings of DistillSettings every preset names (these values: off), so that picking a preset never keeps
# another preset's distillation, self-written calibration or time budget.
PRESET_OFF = {"distill_iters": 0, "calib_sampled_share": 0.0, "time_budget": 0.0, "time_budget_scale": "fixed"}
# The presets made to end within 10 minutes must end within this many seconds (loading and writing the checkpoint
# take a little more): on a slower machine distillation runs fewer steps instead of running late
# (docs/methods.md#time-budget). The "-best" presets have no time budget.
PRESET_TIME_BUDGET = 570.0
# ... for a model of the bundled model's size: a larger one gets the budget times sqrt(its parameters / these), at
# most BUDGET_SCALE_MAX times, so that a preset stays the same quality tier on it (calibration and distillation
# are not cut to nothing) and still ends in a bounded time (run_plan.scaled_budget).
BUDGET_REF_PARAMS = 135e6
BUDGET_SCALE_MAX = 2.0
PRESET_BUDGET = {"time_budget": PRESET_TIME_BUDGET, "time_budget_scale": "model"}
# Every preset names its distillation step too: the app's form has one "distillation lr" field for all methods, so
# picking a preset never keeps another method's or another preset's step.
SCALAR_PRESET_OFF = {**PRESET_OFF, "distill_lr": SCALAR_DISTILL_LR}

_TARGET_CHAIN = {"quantized": "original block on the quantized chain's inputs",
                 "fp": "the original model's own block outputs"}


@dataclass(frozen=True)
class DistillSettings(ConfigBase):
    """End-to-end distillation (quant/distill.py), shared by every built-in method's config: after all blocks,
    the tensors of the packed format that are cheap to move (VPTQ: codebooks; scalar methods: the per-group
    scales, as log-scales) and every 1-D tensor (norms, biases) are trained against the original model's
    next-token distributions, KL(P_orig || P_quant) on the teacher's top ``distill_topk`` tokens + one bucket
    for the rest; 0 steps = off. See docs/methods.md, "End-to-end distillation"."""

    # Autocast dtype of the training steps of fine-tuning and distillation (held-out checks run in float32).
    train_dtype: str = setting("auto", choices=("auto", "bfloat16", "float32"),
                               help="training dtype: auto = bf16 where the device multiplies bf16 in hardware "
                               "(CUDA, AVX-512 BF16 or AMX CPUs), float32 elsewhere (device.compute_dtype)")
    distill_iters: int = setting(0, lo=0, hi=1000000, label="distillation steps", group=DISTILL_GROUP,
                                 help="end-to-end distillation steps on the whole model (KL to the original's "
                                 "next-token distributions; trains VPTQ codebooks or scalar scales, and norms)")
    # "sampled": windows the original model writes itself (ancestral sampling at temperature 1), so every domain
    # it knows, not only the calibration text's. The held-out windows are always calibration windows.
    distill_data: str = setting("calibration", choices=DISTILL_DATA, one_of=True, label="distillation data",
                                hint="sampled = text the original writes", group=DISTILL_GROUP,
                                help="what distillation trains on: the calibration windows, windows sampled from "
                                "the original model (every domain it knows), or both")
    distill_samples: int = setting(32, lo=1, hi=1000000, label="sampled windows", hint="sampled / mixed data",
                                   group=DISTILL_GROUP,
                                   help="windows sampled from the original model for sampled or mixed data")
    distill_eval_every: int = setting(0, lo=0, hi=1000000, label="held-out check every", hint="steps",
                                      zero="quarter", group=DISTILL_GROUP,
                                      help="distillation steps between held-out checks")
    # Relative to the median RMS of the model's codebooks, so that models with smaller weights take a
    # proportionally smaller step.
    distill_lr: float = setting(DISTILL_LR, lo=0.0, hi=1.0, label="distillation lr",
                                hint="VPTQ: × the codebooks' RMS", group=DISTILL_GROUP,
                                help="distillation learning rate, relative: VPTQ codebooks step by this times the "
                                "model's median codebook RMS; scalar methods: the lr of the log-scales")
    distill_norm_lr: float = setting(5e-4, lo=0.0, hi=1.0, help="distillation lr of the 1-D tensors (norms, "
                                     "biases), absolute")
    distill_batch: int = setting(1, lo=1, hi=4096, help="windows per distillation step")
    distill_topk: int = setting(64, lo=1, hi=1 << 20, help="the teacher's top tokens per position the KL keeps "
                                "(the rest: one bucket)")
    distill_holdout: float = setting(0.125, lo=0.0, hi=0.5, help="share of the calibration windows held out")
    # Discrete updates of the VPTQ main codes during distillation (quant/code_update.py): every this many steps,
    # each vector's nearest centroid to its weight moved against its gradient is found, and the vectors that gain
    # most move to it. 0 = the codes stay fixed.
    distill_code_every: int = setting(0, lo=0, hi=1000000, zero="off",
                                      help="VPTQ: distillation steps between discrete code updates (0: codes fixed)")
    distill_code_share: float = setting(0.02, lo=0.0, hi=1.0, lo_open=True,
                                        help="VPTQ: share of each layer's vectors a code update may re-assign "
                                        "(those that gain most)")
    # Relative, as distill_lr: the proposed move of a layer's vectors is this times its codebook's RMS (in RMS
    # over the vectors), along the negative gradient.
    distill_code_step: float = setting(0.25, lo=0.0, hi=100.0, lo_open=True,
                                       help="VPTQ: the code update's proposed move along the negative gradient, "
                                       "relative to the codebook's RMS")
    # Activation checkpointing of the decoder blocks during distillation: "auto" = the blocks whose saved
    # activations of one step pass an activation budget are checkpointed, the others not (student.kept_blocks).
    distill_checkpointing: bool | str = setting("auto", choices=(True, False, "auto"),
                                                help="activation checkpointing during distillation")
    # Calibration of the block-by-block stage itself: this share of the windows it sees (the last ones,
    # round(share x windows), at least one when > 0) is written by the original model (ancestral sampling at
    # temperature 1, each window started from the first token of the text window it replaces) instead of taken
    # from the calibration text, so the Hessians and block targets cover what the model writes, not only the
    # calibration text's domain. Needs the whole model in memory (no block streaming). 0 = the text only.
    calib_sampled_share: float = setting(0.0, lo=0.0, hi=1.0, label="self-written calibration share",
                                         hint="0..1, written by the model", group=CALIB_GROUP,
                                         help="share (0..1) of the calibration windows the blocks see that the "
                                         "original model writes itself (sampled at temperature 1) instead of the "
                                         "calibration text")
    # The dtype windows are written in (calibration and distillation samples; sampling.sampling_dtype).
    sample_dtype: str = setting("float32", choices=("float32", "bfloat16", "model", "auto"),
                                help="dtype the windows are written in: float32 on every machine (the default: the "
                                "same calibration everywhere), bfloat16, model = as loaded, auto = bf16 where the "
                                "hardware multiplies bf16 natively, else the model as it is (differs by machine)")
    # Distillation runs as many of its steps as fit what is left (measured from its own first steps, its
    # learning-rate schedule planned over that many); the block-by-block stage is never cut short. The presets
    # use it so that they finish on time on slower machines too (docs/methods.md, "Time budget").
    time_budget: float = setting(0.0, lo=0.0, hi=1e7, label="time budget", zero="none", group=DISTILL_GROUP,
                                 hint="s for the whole run, distillation fits in",
                                 help="seconds the whole run may take: distillation, the last stage, runs as many "
                                 "of its steps as fit what the block stage leaves")
    time_budget_scale: str = setting("fixed", choices=("fixed", "model"), label="time budget scale",
                                     group=DISTILL_GROUP,
                                     help="fixed = time_budget seconds whatever the model; model = time_budget for "
                                     "a 135M-parameter model, times sqrt(parameters / 135M), at most 2x, for a "
                                     "larger one (the presets)")
    # The residual stream turned by a random orthogonal matrix (seeded by ``seed``) before anything else, every norm
    # folded into the linears it feeds (quant/rotate.py): the same function, a plain checkpoint with its own head.
    # "auto" rotates the families it can and leaves the others as they are (the presets' choice: a preset holds on
    # any model); True refuses a family it cannot rotate.
    rotate: bool | str = setting(False, choices=(False, True, "auto"), label="rotate the residual stream",
                                 hint="auto = where the family allows", group=CALIB_GROUP,
                                 help="turn the residual stream by a random orthogonal matrix before quantizing "
                                 "(norms folded into the linears; the model computes the same, its channels no "
                                 "longer carry outliers; the LM head is then stored apart from the embedding): "
                                 "true (llama, mistral, qwen2, qwen3), false, or auto = where the family allows")
    # The CLI's --seed seeds the calibration windows too: it is a flag of its own, not this setting's.
    seed: int = setting(0, lo=0, label="seed", hint="0..2^64 - 1", group=CALIB_GROUP, cli=False,
                        help="random seed of the method")


@dataclass(frozen=True)
class VPTQConfig(DistillSettings):
    """VPTQ settings. ``num_res_centroids=0`` disables the residual codebook, ``outlier_percent=0`` outliers.

    Index bits per weight = log2(num_centroids)/vector_len (+ log2(num_res_centroids)/vector_len).
    See docs/methods.md, "VPTQ".
    """

    vector_len: int = setting(6, lo=1, hi=16, label="vector length", help="weights per vector", group=VPTQ_GROUP)
    num_centroids: int = setting(4096, kind="pow2", lo=2, hi=65536, label="centroids", hint="power of 2",
                                 flag="--centroids", help="codebook size, a power of two", group=VPTQ_GROUP)
    num_res_centroids: int = setting(0, kind="pow2", lo=2, hi=65536, zero="none", label="residual centroids",
                                     flag="--res-centroids", help="residual codebook size", group=VPTQ_GROUP)
    # Outlier columns (largest H_jj) get their own small codebook: a few MLP inputs carry Hessian diagonals
    # hundreds of times the mean (attention-sink activations), which one shared codebook serves badly.
    outlier_percent: float = setting(0.5, lo=0.0, hi=50.0, label="outlier columns %", row=1, group=VPTQ_GROUP,
                                     help="percent of input columns (largest Hessian diagonal) with their own "
                                     "codebook")
    outlier_vector_len: int = setting(4, lo=1, hi=16, help="vector length of the outlier codebook",
                                      group=VPTQ_GROUP, form=False)
    outlier_centroids: int = setting(256, kind="pow2", lo=2, hi=65536, help="outlier codebook size",
                                     group=VPTQ_GROUP, form=False)
    group_num: int = setting(1, lo=1, hi=64, label="groups", flag="--groups", row=1, group=VPTQ_GROUP,
                             help="codebooks per layer for the non-outlier columns")
    enable_norm: bool = setting(False, label="normalize columns", flag="--norm", row=2, group=VPTQ_GROUP,
                                help="per-input-column normalisation")
    enable_perm: bool = setting(True, label="permute columns", hint="Hessian order", flag="--perm", row=2,
                                group=VPTQ_GROUP, help="process columns by decreasing Hessian diagonal")
    # 8: every codebook stored as int8 entries with a float32 scale per dimension (quant/codebook_grid.py), half
    # the codebook bits, which a bits budget spends on index bits; 16: the model's float dtype, the public format.
    codebook_bits: int = setting(16, choices=CODEBOOK_BITS, label="codebook bits", row=2, group=VPTQ_GROUP,
                                 help="bits per stored codebook entry: 16 (public format) or 8")
    # Lloyd iterations on at most kmeans_sample vectors (and at most 64 per centroid): 5 iterations lose little
    # proxy loss against 10 at two thirds of the time, while a smaller sample loses more.
    kmeans_iters: int = setting(5, lo=0, hi=1000, label="k-means iterations", row=1, group=VPTQ_GROUP,
                                help="k-means iterations")
    kmeans_sample: int = setting(65536, lo=1024, help="at most this many vectors per k-means fit")
    # 10% of mean(diag H): the Hessians are ill-conditioned (attention-sink tokens); with much less damping the
    # sweep trades large weight errors in weak directions for tiny proxy gains.
    damp_percent: float = setting(0.1, lo=0.0, hi=1.0, lo_open=True, help="Hessian damping, a share of mean(diag H)")
    block_size: int = setting(128, lo=1, hi=4096, help="columns per block of the error-feedback sweep")
    # Block-wise centroid fine-tuning (Adam, docs/methods.md, "Layer-wise fine-tuning"), which also trains the
    # block's norm weights and biases at finetune_norm_lr, over shuffled minibatches of finetune_batch windows
    # with a cosine schedule; the last finetune_holdout of the calibration windows are never trained on and
    # pick the best check (every finetune_eval_every steps and at the end), the untuned block included.
    finetune_iters: int = setting(0, lo=0, hi=100000, label="fine-tune iterations", row=3, group=VPTQ_GROUP,
                                  help="layer-wise fine-tuning steps per block (codebooks + norms)")
    finetune_lr: float = setting(1e-3, lo=0.0, hi=1.0, lo_open=True, help="fine-tuning lr of the codebooks")
    finetune_norm_lr: float = setting(1e-3, lo=0.0, hi=1.0, zero="codebooks only",
                                      help="fine-tuning lr of the norms and biases")
    finetune_batch: int = setting(2, lo=1, hi=4096, help="windows per fine-tuning step")
    finetune_holdout: float = setting(0.125, lo=0.0, hi=0.5, help="share of the windows held out")
    finetune_eval_every: int = setting(0, lo=0, hi=100000, zero="only at the end",
                                       help="fine-tuning steps between held-out checks")
    # What fine-tuning fits each block's outputs to: "quantized" = the original block applied to the inputs
    # coming from the already quantized blocks; "fp" = the original model's own block outputs (its inputs come
    # from the original blocks), so each block also corrects what the blocks before it got wrong.
    target_chain: str = setting("quantized", choices=_TARGET_CHAIN, help="the block outputs training fits")
    # Total bits per weight of the whole model (every block linear, codebooks, outliers and permutation
    # included). Before a run it becomes the loosest layer_bits_cap whose model total stays within it
    # (``for_model`` -> allocate.cap_for_budget over the model's layer shapes): the layers whose codebooks are
    # expensive next to their weights step down, the budget goes to the others. Set this or layer_bits_cap.
    bits_budget: float = setting(0.0, lo=0.0, hi=64.0, zero="off", label="total bits budget", row=4,
                                 group=VPTQ_GROUP,
                                 help="total bits per weight of the whole model: becomes the loosest "
                                 "--layer-bits-cap that meets it for this model (set one of the two)")
    # Total bits per weight (codebooks, outliers and permutation included) no layer may exceed. A layer over it
    # steps down the vector length at the same index bits per weight (v6 k4096 -> v5 k1024 -> v4 k256 ...:
    # smaller codebooks) until it fits, so the model's total never exceeds it either (vptq.layer_config).
    layer_bits_cap: float = setting(0.0, lo=0.0, hi=64.0, zero="off", label="max total bits per layer", row=4,
                                    group=VPTQ_GROUP,
                                    help="total bits per weight no layer may exceed (shorter vectors, same index "
                                    "bits, where codebooks are expensive)")
    # How a bits_budget is spent: "cap" = the same index bits everywhere, codebooks shrunk where they are
    # expensive (allocate.py; known before the run); "sensitivity" = more bits where the model's loss feels the
    # error, measured on the calibration windows before the first block (quant/sensitivity.py; docs/methods.md,
    # "Bit plan by sensitivity").
    allocation: str = setting("cap", choices=ALLOCATIONS, one_of=True, label="bits allocation", row=4,
                              hint="sensitivity = measured per layer", group=VPTQ_GROUP,
                              help="how --bits-budget is spent: cap = the same index bits in every layer; "
                              "sensitivity = each layer's own vector length and codebook size, more bits where "
                              "the model's loss feels the error (measured before the first block)")
    # Calibration windows (spread over the block stage's) the sensitivity measurement runs forward and backward
    # on: its cost grows with them, while the layers' ranking that decides the plan settles with a few.
    sensitivity_windows: int = setting(4, lo=1, hi=4096, label="sensitivity windows", group=VPTQ_GROUP, form=False,
                                       help="calibration windows the bit plan by sensitivity measures on "
                                       "(allocation sensitivity)")
    # The per-layer settings a "sensitivity" run chose: ((full module name, vector_len, num_centroids), ...);
    # filled by the run and kept in its recorded config (a config with a plan quantizes those layers so again).
    layer_plan: tuple = internal(())
    # Conjugate-gradient steps refitting every codebook of a layer after the sweep (indices fixed) on
    # tr(ΔW H ΔWᵀ). See quant/refit.py.
    refit_iters: int = setting(0, lo=0, hi=1000, zero="off", label="codebook refit steps", hint="after the sweep",
                               row=3, group=VPTQ_GROUP,
                               help="conjugate-gradient steps refitting every codebook of a layer after the sweep")
    second_order: bool = setting(True, flag="--no-second-order", switch=False, group=VPTQ_GROUP, form=False,
                                 help="ablation: plain nearest-centroid assignment")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_res_centroids > self.num_centroids:
            raise ValueError(
                f"num_res_centroids ({self.num_res_centroids}) must be <= num_centroids ({self.num_centroids}): "
                "public VPTQ readers decode residual indices with the main index width"
            )
        if int(math.log2(self.num_centroids)) + self.res_bits > 32:
            raise ValueError("log2(num_centroids) + log2(num_res_centroids) must be <= 32")
        check_allocation(self)

    @property
    def index_bits(self) -> int:
        return int(math.log2(self.num_centroids))

    def for_model(self, shapes) -> VPTQConfig:
        """With ``bits_budget``: the same config with the ``layer_bits_cap`` that budget means for these shapes
        (the VPTQ method resolves it: ``Method.for_model``, allocate.budget_for_model)."""
        from .methods import get

        return get("vptq").for_model(self, shapes)

    def for_layer(self, name: str) -> VPTQConfig:
        """The settings layer ``name`` (full module name) is quantized with: its entry of ``layer_plan``, or
        this config (its cap applies by shape, ``vptq.layer_config``)."""
        plan = {entry: (v, k) for entry, v, k in self.layer_plan}
        return layer_settings(self, *plan[name]) if name in plan else self

    @property
    def res_bits(self) -> int:
        return int(math.log2(self.num_res_centroids)) if self.num_res_centroids else 0

    @property
    def bits_per_index_weight(self) -> float:
        return (self.index_bits + self.res_bits) / self.vector_len


def layer_settings(config: VPTQConfig, vector_len: int, num_centroids: int) -> VPTQConfig:
    """``config`` for one layer of a plan: these vector settings, no cap, budget or plan of its own."""
    return dataclasses.replace(config, vector_len=vector_len, num_centroids=num_centroids, num_res_centroids=0,
                               layer_bits_cap=0.0, bits_budget=0.0, allocation="cap", layer_plan=())


def check_allocation(config) -> None:
    """``allocation`` and ``layer_plan`` of a VPTQConfig (a plan as JSON gives lists: turned into tuples)."""
    if config.allocation == "sensitivity" and not config.bits_budget:
        raise ValueError("allocation 'sensitivity' spends a bits_budget: set bits_budget (total bits per weight)")
    if config.allocation == "sensitivity" and config.num_res_centroids:
        raise ValueError("allocation 'sensitivity' plans single codebooks: set num_res_centroids 0 or allocation 'cap'")
    plan = config.layer_plan
    if not isinstance(plan, (tuple, list)):
        raise ValueError(f"layer_plan must be a list of [module name, vector_len, num_centroids], got {plan!r}")
    entries = []
    for entry in plan:
        if (not isinstance(entry, (tuple, list)) or len(entry) != 3 or not isinstance(entry[0], str)):
            raise ValueError(f"layer_plan entries must be [module name, vector_len, num_centroids], got {entry!r}")
        check_int(f"layer_plan vector_len of {entry[0]!r}", entry[1], 1, 16)
        check_pow2(f"layer_plan num_centroids of {entry[0]!r}", entry[2], 2, 65536)
        entries.append(tuple(entry))
    object.__setattr__(config, "layer_plan", tuple(entries))


# Settings the scalar configs share (their ranges and defaults differ).
_BITS = dict(label="bits", help="bits per weight", group=SCALAR_GROUP)
_GROUP_SIZE = dict(label="group size", zero="per channel", help="weights per scale", group=SCALAR_GROUP)
_CLIP_SEARCH = dict(help="search each group's clipping range for the least output error")
_ACT_BITS = dict(choices={4: "", 8: "", 16: "16 = no activation quantization"}, group=SCALAR_GROUP,
                 help="activation bits: 16 = weight-only, 8 = W?A8")
_ACT_GRANULARITY = dict(choices=dict(zip(ACT_GRANULARITIES, ("dynamic, symmetric",
                                                             "dynamic, scale and zero point per token", "static"))),
                        group=SCALAR_GROUP,
                        help="activation quantizer: token = dynamic per token, token_asym = dynamic per token with "
                        "a zero point, tensor = static per tensor")
# Static per-tensor scales: "absmax" (nothing clipped) or "mse" (the clip that minimises each linear's output
# error on the calibration inputs; act_quant.calibrate_static_scales).
_ACT_CLIP = dict(choices={"absmax": "", "mse": "static scales: clip by output error"}, group=SCALAR_GROUP,
                 form=False, help="static activation scales: absmax, or the clip with the least output error")


@dataclass(frozen=True)
class ScalarConfig(DistillSettings):
    """RTN / GPTQ settings. ``group_size=0`` means one scale per output channel.

    ``act_bits`` 16 = weight-only; 8 (or 4) fake-quantizes the inputs of the quantized linears, per token
    (dynamic) or per tensor (static absmax scale from the calibration data), as for LRQ."""

    bits: int = setting(4, lo=1, hi=8, **_BITS)
    group_size: int = setting(128, lo=0, **_GROUP_SIZE)
    sym: bool = setting(False, help="a symmetric grid (no zero point)")
    act_order: bool = setting(True, label="act order", hint="GPTQ", flag="--no-act-order", switch=False,
                              group=ORDER_GROUP, help="GPTQ: natural column order")
    damp_percent: float = setting(0.01, lo=0.0, hi=1.0, lo_open=True, help="Hessian damping, a share of mean(diag H)")
    block_size: int = setting(128, lo=1, hi=4096, help="columns per block of the error-feedback sweep")
    clip_search: bool = setting(False, **_CLIP_SEARCH)
    act_bits: int = setting(16, **_ACT_BITS)
    act_granularity: str = setting("token", **_ACT_GRANULARITY)
    act_clip: str = setting("absmax", **_ACT_CLIP)
    distill_lr: float = redeclare(DistillSettings, "distill_lr", SCALAR_DISTILL_LR)


@dataclass(frozen=True)
class LRQConfig(DistillSettings):
    """LRQ settings (docs/methods.md, "LRQ").

    ``rank=0`` picks the rank from the layer size (``auto_rank``); ``full_scale=True`` learns one scale per
    weight instead of the low-rank matrix (FlexRound-style, for comparison). ``act_bits`` 16 = weight-only;
    8 with ``act_granularity`` "token" (dynamic per token) or "tensor" (static, from calibration).

    Defaults are sized for small models on a CPU: 32 steps of one 512-token window (one epoch of 32
    calibration windows) at lr 1e-2; a larger lr soon diverges. The paper's runs (~5000 steps, batch 2,
    lr 4e-4..9e-4) suit large models with a GPU.
    """

    bits: int = setting(4, lo=2, hi=8, **_BITS)
    group_size: int = setting(0, lo=0, **_GROUP_SIZE)
    rank: int = setting(0, lo=0, hi=8192, zero="auto", label="LRQ rank", group=LRQ_GROUP,
                        help="rank of LRQ's low-rank weight scaling (auto picks it from the layer size)")
    iters: int = setting(32, lo=0, hi=100000, label="LRQ iterations per block", group=LRQ_GROUP,
                         help="LRQ training iterations per block")
    lr: float = setting(1e-2, lo=0.0, hi=1.0, lo_open=True, label="LRQ learning rate", group=LRQ_GROUP,
                        help="LRQ learning rate (Adam, cosine to 0 over the steps)")
    batch_size: int = setting(1, lo=1, hi=1024, help="windows per LRQ step")
    clip_search: bool = setting(True, **_CLIP_SEARCH)
    full_scale: bool = setting(False, switch=True, group=LRQ_GROUP, form=False,
                               help="LRQ: learn a full per-weight scale (FlexRound-style)")
    act_bits: int = setting(16, **_ACT_BITS)
    act_granularity: str = setting("token", **_ACT_GRANULARITY)
    act_clip: str = setting("absmax", **_ACT_CLIP)
    # "fp" (the original model's own block outputs) fits LRQ better at W4A8 (docs/methods.md, "LRQ").
    target_chain: str = setting("fp", choices=_TARGET_CHAIN, help="the block outputs training fits")
    distill_lr: float = redeclare(DistillSettings, "distill_lr", SCALAR_DISTILL_LR)


@dataclass(frozen=True)
class CalibConfig(ConfigBase):
    """Calibration data: ``text`` is "wiki" (bundled Wikipedia, even articles), "pydocs" (Python's
    documentation, even topics) or a path to a UTF-8 file. The CLI and the form have flags and fields of
    their own for these (the CLI's --calib-text, --calib-samples, --seqlen, --seed)."""

    text: str = setting("wiki", label="calibration text", help="'wiki', 'pydocs' or a UTF-8 file")
    samples: int = setting(64, lo=1, hi=100000, label="calibration samples", help="calibration windows")
    seqlen: int = setting(512, lo=8, hi=131072, label="tokens per sample", help="tokens per calibration window")
    seed: int = setting(0, lo=0, label="seed", help="seed of the windows' choice")

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ValueError(f"calibration text must be 'wiki', 'pydocs' or a file path, got {self.text!r}")
        super().__post_init__()
