"""Validated, frozen settings for the built-in quantization methods and for calibration.

The ``check_*`` helpers are for new methods' configs too (see README.md, "Adding a method").

Every bad value raises ``ValueError`` naming the field, the value and what is allowed; the CLI turns that
into exit code 2 and the app into a visible error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields

DISTILL_DATA = ("calibration", "sampled", "mixed")  # DistillSettings.distill_data


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


def _as_json(value):
    return [_as_json(v) for v in value] if isinstance(value, (tuple, list)) else value


def check_bools(config, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(config, name)!r}")


class ConfigBase:
    """``to_dict`` / ``from_dict`` for frozen config dataclasses (unknown keys are refused by name)."""

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


# Scalar methods distil log-scales: on SmolLM2 W4A8 (LRQ, 32 steps on the calibration windows) lr 2e-3 took
# pydocs from 1.42x to 1.39x bf16, 5e-4 left it at 1.42x (README, "Distilling scalar checkpoints").
SCALAR_DISTILL_LR = 2e-3
DISTILL_LR = 2.5e-3  # VPTQ codebooks: a step of this times the model's median codebook RMS


# The settings of DistillSettings every preset names (these values: off), so that picking a preset never keeps
# another preset's distillation, self-written calibration or time budget.
PRESET_OFF = {"distill_iters": 0, "calib_sampled_share": 0.0, "time_budget": 0.0}
# Every preset names its distillation step too: the app's form has one "distillation lr" field for all methods, so
# picking a preset never keeps another method's or another preset's step.
SCALAR_PRESET_OFF = {**PRESET_OFF, "distill_lr": SCALAR_DISTILL_LR}


@dataclass(frozen=True)
class DistillSettings(ConfigBase):
    """End-to-end distillation (quant/distill.py), shared by every built-in method's config: after all blocks,
    the tensors of the packed format that are cheap to move (VPTQ: codebooks; scalar methods: the per-group
    scales, as log-scales) and every 1-D tensor (norms, biases) are trained against the original model's
    next-token distributions, KL(P_orig || P_quant) on the teacher's top ``distill_topk`` tokens + one bucket
    for the rest; 0 steps = off. A subclass calls ``check_distill()`` from its ``__post_init__``."""

    # Autocast dtype of the training steps of fine-tuning and distillation (held-out checks run in float32):
    # "auto" = bf16 where the device multiplies bf16 in hardware (CUDA, AVX-512 BF16 or AMX CPUs), float32
    # elsewhere (device.compute_dtype); "bfloat16"; "float32".
    train_dtype: str = "auto"
    distill_iters: int = 0
    # distill_lr is relative: VPTQ codebooks step by distill_lr x the median RMS of the model's codebook tensors
    # (scalar methods: the lr of the log-scales, relative too). 2.5e-3 is the absolute 5e-4 measured best on
    # SmolLM2 at 2.5 bits (64 steps at 5e-4 beat 128 at 2e-4 on both held-out texts; README, "What distillation
    # trains on") over SmolLM2's median codebook RMS of 0.195; an absolute 5e-4 was 5-12x too large a step for
    # Gemma-3-270M's smaller weights.
    # distill_norm_lr: absolute, for the 1-D tensors (norms, biases).
    distill_lr: float = DISTILL_LR
    distill_norm_lr: float = 5e-4
    distill_batch: int = 1
    distill_topk: int = 64
    distill_holdout: float = 0.125
    distill_eval_every: int = 0  # steps between held-out checks; 0 = every quarter of the steps
    # Activation checkpointing of the decoder blocks during distillation: true, false, or "auto" = off when the
    # saved activations of one step fit a quarter of the free memory of the device (distill.use_checkpointing;
    # SmolLM2-135M at 512 tokens: ~1.4 GB more, steps ~25% faster), on otherwise.
    distill_checkpointing: bool | str = "auto"
    # What distillation trains on: "calibration" (the calibration windows), "sampled" (distill_samples windows
    # sampled from the original model itself, ancestral sampling at temperature 1: every domain it knows, not
    # only the calibration text's) or "mixed" (both). The held-out windows are always calibration windows.
    distill_data: str = "calibration"
    distill_samples: int = 32
    # Calibration of the block-by-block stage itself: this share of the windows it sees (the last ones,
    # round(share x windows), at least one when > 0) is written by the original model (ancestral sampling at
    # temperature 1, each window started from the first token of the text window it replaces) instead of taken
    # from the calibration text, so the Hessians and block targets cover what the model writes, not only the
    # calibration text's domain. Needs the whole model in memory (no block streaming). 0 = the text only.
    calib_sampled_share: float = 0.0
    # The dtype windows are written in (calibration and distillation samples; distill.sampling_dtype): "auto"
    # = bf16 copies of a float32 model's weights where the hardware multiplies bf16 natively (CUDA, AVX-512 BF16
    # or AMX CPUs), else the model as it is; "bfloat16"; "model" = as loaded.
    sample_dtype: str = "auto"
    # Seconds the whole run may take (0 = no limit): distillation, the last stage, runs as many of its
    # distill_iters steps as fit what is left (measured from its own first steps, held-out checks included; its
    # learning-rate schedule planned over that many); the block-by-block stage is never cut short. The presets
    # use it so that they finish on time on slower machines too.
    time_budget: float = 0.0
    seed: int = 0

    def check_distill(self) -> None:
        if self.train_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"train_dtype must be 'auto', 'bfloat16' or 'float32', got {self.train_dtype!r}")
        check_int("distill_iters", self.distill_iters, 0, 1000000)
        check_float("distill_lr", self.distill_lr, 0.0, 1.0)
        check_float("distill_norm_lr", self.distill_norm_lr, 0.0, 1.0)
        check_int("distill_batch", self.distill_batch, 1, 4096)
        check_int("distill_topk", self.distill_topk, 1, 1 << 20)
        check_float("distill_holdout", self.distill_holdout, 0.0, 0.5)
        check_int("distill_eval_every", self.distill_eval_every, 0, 1000000)
        check_int("distill_samples", self.distill_samples, 1, 1000000)
        check_float("calib_sampled_share", self.calib_sampled_share, 0.0, 1.0)
        check_float("time_budget", self.time_budget, 0.0, 1e7)
        if self.sample_dtype not in ("auto", "bfloat16", "model"):
            raise ValueError(f"sample_dtype must be 'auto', 'bfloat16' or 'model', got {self.sample_dtype!r}")
        if self.distill_data not in DISTILL_DATA:
            raise ValueError(f"distill_data must be one of {', '.join(DISTILL_DATA)}, got {self.distill_data!r}")
        check_int("seed", self.seed, 0)
        if not (isinstance(self.distill_checkpointing, bool) or self.distill_checkpointing == "auto"):
            raise ValueError(f"distill_checkpointing must be true, false or 'auto', got {self.distill_checkpointing!r}")


@dataclass(frozen=True)
class VPTQConfig(DistillSettings):
    """VPTQ settings. ``num_res_centroids=0`` disables the residual codebook, ``outlier_percent=0`` outliers.

    Index bits per weight = log2(num_centroids)/vector_len (+ log2(num_res_centroids)/vector_len).
    """

    vector_len: int = 6
    num_centroids: int = 4096
    num_res_centroids: int = 0
    # Outlier columns (largest H_jj) get their own small codebook. On SmolLM2 a few MLP inputs carry
    # 100-1400x the mean H_jj (attention-sink activations): with one shared codebook block 11's down_proj
    # kept a relative proxy loss of 0.63; with 0.5% outlier columns 0.0001.
    outlier_percent: float = 0.5
    outlier_vector_len: int = 4
    outlier_centroids: int = 256
    group_num: int = 1
    enable_norm: bool = False
    enable_perm: bool = True
    # Lloyd iterations on at most kmeans_sample vectors (and at most 64 per centroid). Measured on SmolLM2
    # block 0/5 q_proj and up_proj at v6 k4096: 5 iterations cost +0.5..1.3% relative proxy loss against 10
    # at two thirds of the time; halving the sample instead costs +3..15%.
    kmeans_iters: int = 5
    kmeans_sample: int = 65536
    # 10% of mean(diag H): on SmolLM2 the Hessians are ill-conditioned (attention-sink tokens); with 1% the
    # sweep trades large weight errors in weak directions for tiny proxy gains (block 0 q_proj: relative
    # weight error 0.94 at 1%, 0.58 at 10%, proxy loss 0.0088 vs 0.0077).
    damp_percent: float = 0.1
    block_size: int = 128
    # Block-wise centroid fine-tuning (Adam, batches of 2 windows). SmolLM2 block 3 at v6 k4096, 32 steps:
    # lr 1e-3 cut the block's output error on held-out windows by 10% (1e-4: by 4%); 96 steps by 11%.
    finetune_iters: int = 0
    finetune_lr: float = 1e-3
    # Layer-wise fine-tuning (quant/finetune.py) also trains the block's norm weights and biases at this lr
    # (0 = codebooks only), over shuffled minibatches of finetune_batch windows with a cosine schedule; the
    # last finetune_holdout of the calibration windows are never trained on and pick the best check (every
    # finetune_eval_every steps and at the end; 0 = only at the end), the untuned block included.
    finetune_norm_lr: float = 1e-3
    finetune_batch: int = 2
    finetune_holdout: float = 0.125
    finetune_eval_every: int = 0
    # What fine-tuning fits each block's outputs to: "quantized" = the original block applied to the inputs
    # coming from the already quantized blocks; "fp" = the original model's own block outputs (its inputs come
    # from the original blocks), so each block also corrects what the blocks before it got wrong.
    target_chain: str = "quantized"
    # Total bits per weight (codebooks, outliers and permutation included) no layer may exceed; 0 = off. A
    # layer over it steps down the vector length at the same index bits per weight (v6 k4096 -> v5 k1024 ->
    # v4 k256 ...: smaller codebooks) until it fits, so the model's total never exceeds it either
    # (vptq.layer_config; allocate.cap_for_budget finds the loosest cap for a model-level budget).
    layer_bits_cap: float = 0.0
    # Total bits per weight of the whole model (every block linear, codebooks, outliers and permutation
    # included); 0 = off. Before a run it becomes the loosest layer_bits_cap whose model total stays within it
    # (``for_model`` -> allocate.cap_for_budget over the model's layer shapes): the layers whose codebooks are
    # expensive next to their weights step down, the budget goes to the others. Set this or layer_bits_cap.
    bits_budget: float = 0.0
    # How a bits_budget is spent: "cap" = the same index bits everywhere, codebooks shrunk where they are
    # expensive (allocate.py; known before the run); "sensitivity" = more bits where the model's loss feels the
    # error, measured on the calibration windows before the first block (quant/sensitivity.py).
    allocation: str = "cap"
    # The per-layer settings a "sensitivity" run chose: ((full module name, vector_len, num_centroids), ...);
    # filled by the run and kept in its recorded config (a config with a plan quantizes those layers so again).
    layer_plan: tuple = ()
    # Conjugate-gradient steps refitting every codebook of a layer after the sweep (indices fixed) on
    # tr(ΔW H ΔWᵀ); 0 = off. See quant/refit.py.
    refit_iters: int = 0
    second_order: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("vector_len", self.vector_len, 1, 16)
        check_pow2("num_centroids", self.num_centroids, 2, 65536)
        if self.num_res_centroids != 0:
            check_pow2("num_res_centroids", self.num_res_centroids, 2, 65536)
        if self.num_res_centroids > self.num_centroids:
            raise ValueError(
                f"num_res_centroids ({self.num_res_centroids}) must be <= num_centroids ({self.num_centroids}): "
                "public VPTQ readers decode residual indices with the main index width"
            )
        if int(math.log2(self.num_centroids)) + self.res_bits > 32:
            raise ValueError("log2(num_centroids) + log2(num_res_centroids) must be <= 32")
        check_float("outlier_percent", self.outlier_percent, 0.0, 50.0)
        check_int("outlier_vector_len", self.outlier_vector_len, 1, 16)
        check_pow2("outlier_centroids", self.outlier_centroids, 2, 65536)
        check_int("group_num", self.group_num, 1, 64)
        check_int("kmeans_iters", self.kmeans_iters, 0, 1000)
        check_int("kmeans_sample", self.kmeans_sample, 1024)
        check_float("damp_percent", self.damp_percent, 0.0, 1.0, lo_open=True)
        check_int("block_size", self.block_size, 1, 4096)
        check_int("finetune_iters", self.finetune_iters, 0, 100000)
        check_int("refit_iters", self.refit_iters, 0, 1000)
        check_float("finetune_lr", self.finetune_lr, 0.0, 1.0, lo_open=True)
        check_float("finetune_norm_lr", self.finetune_norm_lr, 0.0, 1.0)
        check_int("finetune_batch", self.finetune_batch, 1, 4096)
        check_float("finetune_holdout", self.finetune_holdout, 0.0, 0.5)
        check_int("finetune_eval_every", self.finetune_eval_every, 0, 100000)
        check_target_chain(self.target_chain)
        check_float("layer_bits_cap", self.layer_bits_cap, 0.0, 64.0)
        check_float("bits_budget", self.bits_budget, 0.0, 64.0)
        check_allocation(self)
        check_bools(self, ("enable_norm", "enable_perm", "second_order"))
        self.check_distill()

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


ALLOCATIONS = ("cap", "sensitivity")


def layer_settings(config: VPTQConfig, vector_len: int, num_centroids: int) -> VPTQConfig:
    """``config`` for one layer of a plan: these vector settings, no cap, budget or plan of its own."""
    return dataclasses.replace(config, vector_len=vector_len, num_centroids=num_centroids, num_res_centroids=0,
                               layer_bits_cap=0.0, bits_budget=0.0, allocation="cap", layer_plan=())


def check_allocation(config) -> None:
    """``allocation`` and ``layer_plan`` of a VPTQConfig (a plan as JSON gives lists: turned into tuples)."""
    if config.allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {config.allocation!r}")
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


def check_target_chain(value) -> None:
    if value not in ("quantized", "fp"):
        raise ValueError(f"target_chain must be 'quantized' (original block on the quantized chain's inputs) or "
                         f"'fp' (the original model's own block outputs), got {value!r}")


ACT_GRANULARITIES = ("token", "token_asym", "tensor")


def check_act(act_bits, act_granularity, act_clip: str = "absmax") -> None:
    if isinstance(act_bits, bool) or act_bits not in (4, 8, 16):
        raise ValueError(f"act_bits must be 4, 8 or 16 (16 = no activation quantization), got {act_bits!r}")
    if act_granularity not in ACT_GRANULARITIES:
        raise ValueError(f"act_granularity must be 'token' (dynamic, symmetric), 'token_asym' (dynamic, scale and "
                         f"zero point per token) or 'tensor' (static), got {act_granularity!r}")
    if act_clip not in ("absmax", "mse"):
        raise ValueError(f"act_clip must be 'absmax' or 'mse' (static scales: clip by output error), got {act_clip!r}")


@dataclass(frozen=True)
class ScalarConfig(DistillSettings):
    """RTN / GPTQ settings. ``group_size=0`` means one scale per output channel.

    ``act_bits`` 16 = weight-only; 8 (or 4) fake-quantizes the inputs of the quantized linears, per token
    (dynamic) or per tensor (static absmax scale from the calibration data), as for LRQ."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    act_order: bool = True
    damp_percent: float = 0.01
    block_size: int = 128
    clip_search: bool = False
    act_bits: int = 16
    act_granularity: str = "token"
    # static per-tensor scales: "absmax" (nothing clipped) or "mse" (the clip that minimises each linear's
    # output error on the calibration inputs; act_quant.calibrate_static_scales)
    act_clip: str = "absmax"
    distill_lr: float = SCALAR_DISTILL_LR

    def __post_init__(self) -> None:
        check_int("bits", self.bits, 1, 8)
        check_int("group_size", self.group_size, 0)
        check_float("damp_percent", self.damp_percent, 0.0, 1.0, lo_open=True)
        check_int("block_size", self.block_size, 1, 4096)
        check_act(self.act_bits, self.act_granularity, self.act_clip)
        check_bools(self, ("sym", "act_order", "clip_search"))
        self.check_distill()


@dataclass(frozen=True)
class LRQConfig(DistillSettings):
    """LRQ settings (METHODS.md section 2).

    ``rank=0`` picks the rank from the layer size (``auto_rank``); ``full_scale=True`` learns one scale per
    weight instead of the low-rank matrix (FlexRound-style, for comparison). ``act_bits`` 16 = weight-only;
    8 with ``act_granularity`` "token" (dynamic per token) or "tensor" (static, from calibration).

    Defaults are sized for small models on a CPU: 32 steps of one 512-token window (one epoch of 32
    calibration windows) at lr 1e-2 remove ~60-70% of the RTN block-output error on SmolLM2-135M at 4 bits;
    lr 2e-2 is already worse and 5e-2 diverges. The paper's runs (~5000 steps, batch 2, lr 4e-4..9e-4) suit
    large models with a GPU.
    """

    bits: int = 4
    group_size: int = 0
    rank: int = 0
    iters: int = 32
    lr: float = 1e-2
    batch_size: int = 1
    clip_search: bool = True
    full_scale: bool = False
    act_bits: int = 16
    act_granularity: str = "token"
    # static per-tensor scales: "absmax" (nothing clipped) or "mse" (the clip that minimises each linear's
    # output error on the calibration inputs; act_quant.calibrate_static_scales)
    act_clip: str = "absmax"
    # the block outputs the training fits: "quantized" chain or "fp" chain (see VPTQConfig.target_chain). "fp"
    # measured better on SmolLM2 W4A8: wiki 1.54x -> 1.30x bf16, pydocs 1.52x -> 1.42x (README, "LRQ W4A8")
    target_chain: str = "fp"
    seed: int = 0
    distill_lr: float = SCALAR_DISTILL_LR

    def __post_init__(self) -> None:
        check_int("bits", self.bits, 2, 8)
        check_int("group_size", self.group_size, 0)
        check_int("rank", self.rank, 0, 8192)
        check_target_chain(self.target_chain)
        check_int("iters", self.iters, 0, 100000)
        check_float("lr", self.lr, 0.0, 1.0, lo_open=True)
        check_int("batch_size", self.batch_size, 1, 1024)
        check_act(self.act_bits, self.act_granularity, self.act_clip)
        check_bools(self, ("clip_search", "full_scale"))
        self.check_distill()


@dataclass(frozen=True)
class CalibConfig(ConfigBase):
    """Calibration data: ``text`` is "wiki" (bundled Wikipedia, even articles), "pydocs" (Python's
    documentation, even topics) or a path to a UTF-8 file."""

    text: str = "wiki"
    samples: int = 64
    seqlen: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ValueError(f"calibration text must be 'wiki', 'pydocs' or a file path, got {self.text!r}")
        check_int("samples", self.samples, 1, 100000)
        check_int("seqlen", self.seqlen, 8, 131072)
        check_int("seed", self.seed, 0)
