"""What a quantization method is, and the registry every caller asks.

A ``Method`` bundles everything the pipeline, the CLI, the app, the bits accounting and the checkpoint code
need to know about one method: its name and config class, presets named by bits, how it quantizes a block
(one linear at a time with ``quantize_linear``, or the whole block with ``quantize_block``), what runs after
each block (``after_block`` hooks: fine-tuning, activation calibration) and after the last one
(``after_model`` hooks: end-to-end distillation), how many bits a layer will take, what a run with its
config needs (``needs``: the whole model in memory, the original beside it, self-written calibration, a time
budget, the target chain), how long a run takes (``estimate_seconds``, or the stage costs it is summed from),
and how to describe its settings in one line. Nobody branches on a method's name or sniffs its config's fields.

The built-in methods register themselves in their own modules (``vptq``, ``gptq``, ``rtn``, ``lrq``); they
are imported the first time the registry is read. A new method is one module that calls ``register`` (see
docs/contributing.md#adding-a-method).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from .bits import BitsInfo

if TYPE_CHECKING:  # pragma: no cover
    from .results import LayerReport, QuantizeResult

BUILTIN_MODULES = ("vptq", "gptq", "rtn", "lrq")  # modules of this package that register the built-in methods


class Cancelled(Exception):
    """Raised inside the pipeline (or a block quantizer) when ``should_stop()`` turns true."""


@dataclass
class QuantResult:
    """What quantizing one linear produced: its state, the dequantized weight and its errors."""

    state: Any  # VQLayerState | ScalarLayerState (anything ``storage`` knows how to pack)
    weight: torch.Tensor  # Ŵ [out, in] float32, original column order
    proxy_loss: float  # tr(ΔW H ΔWᵀ)
    rel_proxy_loss: float  # tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)
    rel_weight_error: float  # ||ΔW||_F / ||W||_F
    timings: dict = field(default_factory=dict)  # seconds per phase (e.g. kmeans, inverse_hessian, sweep)


@dataclass
class BlockContext:
    """One decoder block while it is being quantized: what a block quantizer or an after-block hook sees.

    ``inputs`` [n, seq, hidden] come from the already quantized blocks; ``targets`` are the original block's
    outputs on them; ``forward(block, x)`` runs a block on [b, seq, hidden]. ``states`` / ``reports`` collect
    this block's layers by name relative to the block (``publish`` fills both).
    """

    index: int
    prefix: str  # where the blocks live, e.g. "model.layers"
    block: nn.Module  # float32, on the work device
    linears: dict[str, nn.Linear]
    hessians: dict[str, torch.Tensor]  # [in, in] per linear (shared tensors for shared inputs)
    inputs: torch.Tensor
    targets: torch.Tensor
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    config: Any
    method: Method
    result: QuantizeResult
    should_stop: Callable[[], bool]
    publish: Callable[..., LayerReport]  # publish(name, QuantResult, seconds, extra=None) -> LayerReport
    states: dict[str, Any] = field(default_factory=dict)
    reports: list[LayerReport] = field(default_factory=list)

    def full_name(self, name: str) -> str:
        return f"{self.prefix}.{self.index}.{name}"


QuantizeLinear = Callable[[torch.Tensor, torch.Tensor, Any, "torch.Tensor | None", dict], QuantResult]


class BlockHook(NamedTuple):
    """A step after a block's linears are quantized, for configs where ``applies(config)``; ``run(ctx)``
    returns metrics for the block's reports (or None). Its wall time is recorded under ``phase``."""

    phase: str
    applies: Callable[[Any], bool]
    run: Callable[[BlockContext], dict | None]


@dataclass
class ModelContext:
    """The whole quantized model after its last block: what an after-model hook (distillation) sees.

    ``model`` is the fake-quantized model (its quantized linears hold the dequantized weights, on the work
    device); ``reference`` the original; ``calib_ids`` the calibration token ids [n, seq]; ``states`` full
    module name -> layer state (hooks update them in place). ``on_step(phase, step, steps, value)`` reports
    training progress; ``should_stop()`` is polled between steps; ``teacher``: the original model's top-k on
    the calibration windows it wrote itself, taken from its sampling (``distill(known_teacher=...)``)."""

    model: nn.Module
    reference: nn.Module
    calib_ids: torch.Tensor
    states: dict[str, Any]
    config: Any
    result: QuantizeResult
    should_stop: Callable[[], bool]
    on_step: Callable[[str, int, int, float], None]
    teacher: dict | None = None  # the original's top-k on the windows it wrote itself (``sampled_calibration``)
    deadline: float | None = None  # time.perf_counter() by which the run should end (config.time_budget)
    # called by a hook once it no longer needs ``reference``: the run then lets the original go (the context's
    # ``reference`` is None after); only the last hook gets one
    release_reference: Callable[[], None] | None = None


Cost = Callable[[Any, Any], float]  # (quant.cost.RunSize, config) -> seconds on the reference machine


class ModelHook(NamedTuple):
    """A step after every block is quantized (e.g. end-to-end distillation), for configs where
    ``applies(config)``; ``run(ctx)`` returns metrics (``QuantizeResult.model_metrics[phase]``); ``cost``: its
    seconds before the run (``quant.cost``; None: not priced)."""

    phase: str
    applies: Callable[[Any], bool]
    run: Callable[[ModelContext], dict | None]
    cost: Cost | None = None


class PlanHook(NamedTuple):
    """A step before the first block, on the whole original model, for configs where ``applies(config)``:
    ``run(model, calib_ids, config, device, should_stop, progress=None)`` returns (the config the run goes on with,
    metrics for ``QuantizeResult.model_metrics[phase]``); e.g. VPTQ's per-layer bit allocation from measured
    sensitivity. ``progress(done)``, where given, counts its steps: one per decoder block, then one more.
    ``cost``: its seconds before the run; ``bits_bound(config)``: the total bits per weight the plan stays within
    (the bits are known only once it has run)."""

    phase: str
    applies: Callable[[Any], bool]
    run: Callable[..., tuple[Any, dict]]
    cost: Cost | None = None
    bits_bound: Callable[[Any], float] | None = None


@dataclass(frozen=True)
class RunNeeds:
    """What a run with one config needs beyond quantizing blocks: ``Method.needs(config)``.

    ``plan``: phases of the plan hooks that apply (on the whole original model, before the first block);
    ``after_model``: phases of the after-model hooks that apply (the whole quantized model trained against the
    original); ``sampled_share``: the share of the block stage's calibration windows the original model writes
    itself (docs/methods.md#self-written-calibration); ``time_budget``: seconds the whole run may take (0: no
    limit; docs/methods.md#time-budget); ``target_chain``: what after-block steps fit, "quantized" (the original
    block on the quantized chain's inputs) or "fp" (the original model's own block outputs); ``teacher_topk``: how
    many of the original's top next tokens on the windows it writes itself to keep from that writing for the
    after-model step (0: none)."""

    plan: tuple[str, ...] = ()
    after_model: tuple[str, ...] = ()
    sampled_share: float = 0.0
    time_budget: float = 0.0
    target_chain: str = "quantized"
    teacher_topk: int = 0

    @property
    def whole_model(self) -> bool:
        """The whole model must be in memory (no block streaming): a plan, an after-model step or self-written
        calibration works on it."""
        return bool(self.plan or self.after_model or self.sampled_share > 0)

    @property
    def reference(self) -> bool:
        """The original model is needed beside the quantized one after the last block."""
        return bool(self.after_model)

    @property
    def fp_chain(self) -> bool:
        return self.target_chain == "fp"


@dataclass(frozen=True)
class Method:
    """One quantization method. Exactly one of ``quantize_linear`` / ``quantize_block`` is given.

    quantize_linear(W [out, in], H [in, in], config, bias [out] | None, cache: dict) -> QuantResult, with
        ``cache`` shared by the linears of one block (e.g. inverse-Hessian factors of shared inputs);
    quantize_block(ctx) quantizes every linear of ``ctx.linears`` and calls ``ctx.publish`` for each;
    bits(config, out_features, in_features) -> BitsInfo of one layer of that shape;
    describe(settings dict) -> a short label of the settings (runs table, archive names);
    config_needs(config) -> RunNeeds: what the config's own settings ask of the run (self-written calibration,
        time budget, target chain); the hooks' part is added by ``needs``. None: as the registered method that
        owns the config's class says (a method reusing VPTQConfig reads its settings as VPTQ does), else nothing;
    resolve(config, shapes) -> the config a run on a model with these block-linear shapes uses (settings that
        depend on the whole model, e.g. a total-bits budget, resolved); None: ``config.for_model(shapes)``;
    cost(RunSize, config) -> seconds of the method's own block work on the reference machine, on top of the
        block forwards every method runs (``quant.cost``); None: rounding every weight once;
    estimate_seconds(RunSize, config) -> seconds of the whole run, replacing the stage-by-stage sum;
    pace(probe, config) -> (seconds measured, seconds ``cost``'s constants give them on the reference machine) of
        some of the method's own block work run on the model's first block (``quant.block_pace.ProbeBlock``), so a
        time budget's plan prices that work by its pace on the device (``block_pace.measure_block_speed``); None:
        priced by the device's matrix-multiply speed alone;
    block_steps: the setting that counts the training steps of the method's block work, which a time budget's plan
        may lower (``run_plan``); None: the plan leaves that work as it is.
    """

    name: str
    label: str
    description: str
    config_class: type
    bits: Callable[[Any, int, int], BitsInfo]
    describe: Callable[[Mapping], str]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    quantize_linear: QuantizeLinear | None = None
    quantize_block: Callable[[BlockContext], None] | None = None
    before_blocks: tuple[PlanHook, ...] = ()  # need the whole model in memory (not with streamed weights)
    after_block: tuple[BlockHook, ...] = ()
    after_model: tuple[ModelHook, ...] = ()  # need the original model (``quantize_model(reference=...)``)
    block_phase: str = "quantize"  # the timing phase of ``quantize_block``
    config_needs: Callable[[Any], RunNeeds] | None = None
    resolve: Callable[[Any, list[tuple[int, int]]], Any] | None = None
    cost: Cost | None = None
    estimate_seconds: Cost | None = None
    pace: Callable[[Any, Any], tuple[float, float]] | None = None
    block_steps: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"method name must be a lower-case identifier, got {self.name!r}")
        if (self.quantize_linear is None) == (self.quantize_block is None):
            raise ValueError(f"method {self.name!r} needs exactly one of quantize_linear / quantize_block")
        for preset, settings in self.presets.items():
            self.make_config(settings)  # a preset that does not validate is a programming error: fail early
            if not isinstance(preset, str):
                raise ValueError(f"preset names must be strings, got {preset!r}")

    @property
    def setting_names(self) -> tuple[str, ...]:
        """The config's field names: the settings a form or a command line may set for this method."""
        return tuple(f.name for f in fields(self.config_class))

    def make_config(self, settings: Mapping | None = None):
        """The validated config from plain settings (ValueError naming an unknown or bad setting)."""
        return self.config_class.from_dict(dict(settings or {}))

    def check_config(self, config) -> None:
        if not isinstance(config, self.config_class):
            raise TypeError(f"method {self.name!r} takes a {self.config_class.__name__}, got {type(config).__name__}")

    def preset(self, name: str) -> dict:
        """The settings a preset fixes (the rest keep their defaults or the user's values)."""
        if name not in self.presets:
            raise ValueError(f"method {self.name!r} has no preset {name!r}; presets: {', '.join(self.presets)}")
        return dict(self.presets[name])

    def needs(self, config) -> RunNeeds:
        """What a run with ``config`` needs: its own settings' needs and the phases of the hooks that apply."""
        return replace(self._settings_needs(config),
                       plan=tuple(hook.phase for hook in self.before_blocks if hook.applies(config)),
                       after_model=tuple(hook.phase for hook in self.after_model if hook.applies(config)))

    def _settings_needs(self, config) -> RunNeeds:
        if self.config_needs is not None:
            return self.config_needs(config)
        owner = next((m for m in all_methods() if m.config_needs is not None and type(config) is m.config_class), None)
        return owner.config_needs(config) if owner is not None else RunNeeds()

    def for_model(self, config, shapes):
        """The config a run on a model with these block-linear shapes [(out, in), ...] uses: the pipeline, the
        bits shown before a run and the time estimate all go through it."""
        return self.resolve(config, list(shapes)) if self.resolve is not None else config.for_model(shapes)

    def planned_bits(self, config) -> float | None:
        """The total bits per weight a plan that applies stays within (its layers' bits are known only once it
        has run), or None when the bits are known before the run."""
        bounds = [hook.bits_bound(config) for hook in self.before_blocks
                  if hook.bits_bound is not None and hook.applies(config)]
        return min(bounds) if bounds else None

    def model_bits(self, config, shapes) -> BitsInfo:
        """Sum of ``bits`` over linear shapes [(out, in), ...] (the config resolved for them: ``for_model``)."""
        shapes = list(shapes)
        config = self.for_model(config, shapes)
        total = BitsInfo(0, 0, 0)
        for out_features, in_features in shapes:
            total = total + self.bits(config, out_features, in_features)
        return total


_REGISTRY: dict[str, Method] = {}
_loaded = False


def register(method: Method, *, replace: bool = False) -> Method:
    """Add ``method`` to the registry (``replace=True`` to swap an existing one, e.g. in tests)."""
    if not isinstance(method, Method):
        raise TypeError(f"register() takes a Method, got {type(method).__name__}")
    if method.name in _REGISTRY and not replace and _REGISTRY[method.name] is not method:
        raise ValueError(f"a method named {method.name!r} is already registered")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(f".{module}", __package__)


def get(name: str | Method) -> Method:
    """The method registered as ``name`` (a ``Method`` is returned as is); ValueError listing the names."""
    if isinstance(name, Method):
        return name
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; allowed: {', '.join(names())}")
    return _REGISTRY[name]


def all_methods() -> list[Method]:
    """Every registered method: the built-ins in ``BUILTIN_MODULES`` order, then the others as registered."""
    _load_builtins()
    order = {name: i for i, name in enumerate(BUILTIN_MODULES)}
    return sorted(_REGISTRY.values(), key=lambda m: order.get(m.name, len(order)))


def names() -> tuple[str, ...]:
    return tuple(m.name for m in all_methods())


def make_config(method: str, settings: Mapping | None = None):
    """The validated config object for ``method`` from a plain dict (CLI, app, JSON)."""
    return get(method).make_config(settings)
