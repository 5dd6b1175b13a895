"""Public entry points: input checks, backend selection, layers bound to a backend, and the ``vptq_core::``
torch custom ops.

Every backend computes the same thing as ``kernels.reference`` (dequantize + ``F.linear``). Two ways in:

- ``vq_linear(x, spec, weights, backend=None)`` / ``scalar_linear(...)``: the checked public call. The layer's
  tensors are validated once per (unchanged) set of tensors and the backend is resolved per call.
- ``bind_vq(spec, weights, device, backend=None)`` / ``bind_scalar(...)``: validate and prepare once, pick the
  backend once, and return a ``LayerKernel`` whose call does nothing but run it. The quantized modules use
  this: a small model runs hundreds of linears per token, so per-call Python work shows in tokens/s.

The fused backends are opaque to autograd and to ``torch.compile``, so they are registered as custom ops
with fake (meta) implementations; eager calls skip the dispatcher (its overhead is per call).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch

from . import reference
from ._cache import LayerMemo
from .backends import backend_status, check_device, requested_backend
from .spec import ScalarSpec, ScalarWeights, VQSpec, VQWeights

# Up to this many rows of x (tokens) the numba backend runs its fused decode kernel; above it, its dequantize
# + one matmul is faster (bench/kernels.py prints the crossover). The native backend chooses by itself.
CPU_FUSED_MAX_TOKENS = 8
# Same switch for the Triton lookup GEMV versus Triton dequantize + cuBLAS: a starting value, not measured
# here (no GPU); bench/kernels_gpu.py times both paths at 1, 8 and 128 tokens.
TRITON_FUSED_MAX_TOKENS = 8

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------- checks
def _check_tensor(name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} shape must be {shape}, got {tuple(t.shape)}")


def _check_optional(name: str, t: object, needed: bool, why: str) -> None:
    if needed and t is None:
        raise ValueError(f"{name} is required {why}")
    if not needed and t is not None:
        raise ValueError(f"{name} must be None unless {why.removeprefix('when ')}")


def check_vq_weights(spec: VQSpec, weights: VQWeights) -> None:
    """Raise TypeError/ValueError naming the first tensor of ``weights`` that does not fit ``spec``."""
    if not isinstance(spec, VQSpec):
        raise TypeError(f"spec must be a kernels.VQSpec, got {type(spec).__name__}")
    if not isinstance(weights, VQWeights):
        raise TypeError(f"weights must be a kernels.VQWeights, got {type(weights).__name__}")
    G, v = spec.group_num, spec.vector_len
    w = weights
    _check_tensor("indices", w.indices, (G, spec.rows, spec.packed_words), (torch.int32,))
    _check_tensor("centroids", w.centroids, (G, spec.num_centroids * v), _FLOAT_DTYPES)
    _check_optional("res_centroids", w.res_centroids, spec.has_residual, "when spec.num_res_centroids > 0")
    if w.res_centroids is not None:
        _check_tensor("res_centroids", w.res_centroids, (G, spec.num_res_centroids * v), _FLOAT_DTYPES)
    _check_optional("outlier_indices", w.outlier_indices, spec.has_outliers, "when spec.outlier_size > 0")
    _check_optional("outlier_centroids", w.outlier_centroids, spec.has_outliers, "when spec.outlier_size > 0")
    if spec.has_outliers:
        _check_tensor("outlier_indices", w.outlier_indices, (1, spec.outlier_rows, spec.outlier_size), _INDEX_DTYPES)
        _check_tensor("outlier_centroids", w.outlier_centroids,
                      (1, spec.num_outlier_centroids * spec.outlier_vector_len), _FLOAT_DTYPES)
    if w.perm is not None:
        _check_tensor("perm", w.perm, (spec.in_features,), _INDEX_DTYPES)
    if (w.weight_scale is None) != (w.weight_bias is None):
        raise ValueError("weight_scale and weight_bias must be given together (norm) or both be None")
    if w.weight_scale is not None:
        _check_tensor("weight_scale", w.weight_scale, (spec.in_features,), _FLOAT_DTYPES)
        _check_tensor("weight_bias", w.weight_bias, (spec.in_features,), _FLOAT_DTYPES)
    _check_bias(w.bias, spec.out_features)


def check_scalar_weights(spec: ScalarSpec, weights: ScalarWeights) -> None:
    """Raise TypeError/ValueError naming the first tensor of ``weights`` that does not fit ``spec``."""
    if not isinstance(spec, ScalarSpec):
        raise TypeError(f"spec must be a kernels.ScalarSpec, got {type(spec).__name__}")
    if not isinstance(weights, ScalarWeights):
        raise TypeError(f"weights must be a kernels.ScalarWeights, got {type(weights).__name__}")
    shape = (spec.out_features, spec.groups)
    _check_tensor("codes", weights.codes, (spec.out_features, spec.packed_words), (torch.int32,))
    _check_tensor("scales", weights.scales, shape, _FLOAT_DTYPES)
    _check_tensor("zeros", weights.zeros, shape, _FLOAT_DTYPES + (torch.int32, torch.int64, torch.uint8))
    _check_bias(weights.bias, spec.out_features)


def _check_bias(bias: object, out_features: int) -> None:
    if bias is not None:
        _check_tensor("bias", bias, (out_features,), _FLOAT_DTYPES)


def _check_x(x: object, in_features: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x dtype must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x last dimension must be in_features ({in_features}), got shape {tuple(x.shape)}")


# ------------------------------------------------------------------------------------- implementations
_MODULES = {"cpu": ".cpu", "native": ".native", "triton": ".triton_kernels"}


def backend_module(name: str):  # noqa: ANN201 - the backend's module
    """The module implementing a fused backend, imported on first use (its dependencies are optional)."""
    return importlib.import_module(_MODULES[name], __package__)


_log = logging.getLogger("kernels")
_reported: set[str] = set()


def _report_fallback(reason: str, chosen: str) -> None:
    """One line on stderr (logging's last-resort handler) per distinct reason, the first time it applies."""
    if reason and reason not in _reported:
        _reported.add(reason)
        _log.warning("%s; using the %s kernels", reason, chosen)


def _auto_backend(device: torch.device) -> str:
    """CUDA -> triton; CPU -> native (C++), else cpu (numba); else reference. A fallback is reported once."""
    if device.type == "cuda":
        usable, reason = backend_status("triton")
        if not usable:
            _report_fallback(reason, "reference")
        return "triton" if usable else "reference"
    if device.type == "cpu":
        reasons = []
        for name in ("native", "cpu"):
            usable, reason = backend_status(name)
            if usable:
                if reasons:
                    _report_fallback(reasons[0], name)
                return name
            reasons.append(reason)
        _report_fallback("; ".join(reasons), "reference")
    return "reference"


def _vq_runner(spec: VQSpec, weights: VQWeights, backend: str, auto: bool,
               prepared: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> y on ``backend`` for this layer; ``prepared`` keeps the backend's per-layer data."""
    if backend == "native":
        native = backend_module("native")
        layer = prepared.get("native")
        if layer is None:
            layer = prepared["native"] = native.prepare_vq(spec, *weights)
        return layer  # the C++ layer object is the call: x -> y (no Python frame in between)
    if backend == "cpu":
        cpu = backend_module("cpu")

        def run(x: torch.Tensor) -> torch.Tensor:
            tokens = x.numel() // spec.in_features
            try:
                return cpu.vq_linear(x, spec, weights, state=prepared, fused=tokens <= CPU_FUSED_MAX_TOKENS)
            except RuntimeError:
                if auto and cpu.compile_failure():  # the kernels could not be built here: fall back for good
                    return reference.vq_linear(x, spec, weights)
                raise

        return run
    if backend == "triton":
        triton_kernels = backend_module("triton")
        return lambda x: triton_kernels.vq_linear(
            x, spec, weights, fused=x.numel() // spec.in_features <= TRITON_FUSED_MAX_TOKENS)
    return lambda x: reference.vq_linear(x, spec, weights)


def _scalar_runner(spec: ScalarSpec, weights: ScalarWeights, backend: str, auto: bool,
                   prepared: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    if backend == "native":
        native = backend_module("native")
        layer = prepared.get("native")
        if layer is None:
            layer = prepared["native"] = native.prepare_scalar(
                weights.codes, weights.scales, weights.zeros, weights.bias, spec.bits, spec.group_size,
                spec.in_features)
        return layer
    if backend == "cpu":
        cpu = backend_module("cpu")

        def run(x: torch.Tensor) -> torch.Tensor:
            if x.numel() // spec.in_features > CPU_FUSED_MAX_TOKENS:
                return reference.scalar_linear(x, spec, weights)  # numba's scalar kernel is a GEMV only
            try:
                return cpu.scalar_linear(x, spec, weights, state=prepared)
            except RuntimeError:
                if auto and cpu.compile_failure():
                    return reference.scalar_linear(x, spec, weights)
                raise

        return run
    if backend == "triton":
        triton_kernels = backend_module("triton")
        return lambda x: triton_kernels.scalar_linear(
            x, spec, weights, fused=x.numel() // spec.in_features <= TRITON_FUSED_MAX_TOKENS)
    return lambda x: reference.scalar_linear(x, spec, weights)


def _choose(name: str, device: torch.device) -> tuple[str, bool]:
    """(backend to run, whether it was chosen automatically) for a resolved name ("auto" or a backend)."""
    if name == "auto":
        return _auto_backend(device), True
    return name, False


# ------------------------------------------------------------------------------------------ bound layers
class LayerKernel:
    """One layer bound to one backend: checked and prepared once; ``kernel(x)`` -> y [..., out] (x.dtype).

    Bound to the tensors as they were: after changing them in place, bind again (the quantized modules do
    this when they are moved or loaded).
    """

    __slots__ = ("spec", "weights", "backend", "device", "_run", "_in")

    def __init__(self, spec, weights, backend: str, device: torch.device,
                 run: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.spec, self.weights, self.backend, self.device, self._run = spec, weights, backend, device, run
        self._in = spec.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self._in:
            _check_x(x, self._in)
        return self._run(x)

    @property
    def layer(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What a call runs: for the native backend the prepared C++ layer object itself (``native.prepare_*``),
        whose ``forward_act`` (scalar layers) also fake-quantizes the input."""
        return self._run

    def __repr__(self) -> str:
        return f"LayerKernel({type(self.spec).__name__}, backend={self.backend!r}, device={self.device})"


def bind_vq(spec: VQSpec, weights: VQWeights, device: torch.device | str | None = None,
            backend: str | None = None) -> LayerKernel:
    """Check ``weights`` against ``spec``, choose the backend for ``device`` (default: the indices' device)
    and prepare it. ``backend`` as in ``vq_linear``."""
    check_vq_weights(spec, weights)
    device = torch.device(device) if device is not None else weights.indices.device
    name, auto = _choose(requested_backend(backend), device)
    check_device(name, torch.empty(0, device=device))
    return LayerKernel(spec, weights, name, device, _vq_runner(spec, weights, name, auto, {}))


def bind_scalar(spec: ScalarSpec, weights: ScalarWeights, device: torch.device | str | None = None,
                backend: str | None = None) -> LayerKernel:
    """``bind_vq`` for a scalar-code layer."""
    check_scalar_weights(spec, weights)
    device = torch.device(device) if device is not None else weights.codes.device
    name, auto = _choose(requested_backend(backend), device)
    check_device(name, torch.empty(0, device=device))
    return LayerKernel(spec, weights, name, device, _scalar_runner(spec, weights, name, auto, {}))


# ---------------------------------------------------------------------------------------- custom ops
_DEFAULT = "default"  # backend argument of the ops meaning "None": the environment override applies


def _op_backend(backend: str, x: torch.Tensor) -> tuple[str, bool]:
    name = requested_backend(None if backend == _DEFAULT else backend)
    check_device(name, x)
    return _choose(name, x.device)


@torch.library.custom_op("vptq_core::vq_linear", mutates_args=())
def _vq_linear_op(
    x: torch.Tensor, spec: list[int], indices: torch.Tensor, centroids: torch.Tensor,
    res_centroids: torch.Tensor | None, outlier_indices: torch.Tensor | None,
    outlier_centroids: torch.Tensor | None, perm: torch.Tensor | None, weight_scale: torch.Tensor | None,
    weight_bias: torch.Tensor | None, bias: torch.Tensor | None, backend: str,
) -> torch.Tensor:
    layer_spec = VQSpec.from_list(spec)
    weights = VQWeights(indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale,
                        weight_bias, bias)
    name, auto = _op_backend(backend, x)
    return _vq_runner(layer_spec, weights, name, auto, _prepared(weights))(x)


@_vq_linear_op.register_fake
def _vq_linear_fake(x, spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm,
                    weight_scale, weight_bias, bias, backend):
    return x.new_empty((*x.shape[:-1], spec[1]))


@torch.library.custom_op("vptq_core::scalar_linear", mutates_args=())
def _scalar_linear_op(
    x: torch.Tensor, spec: list[int], codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bias: torch.Tensor | None, backend: str,
) -> torch.Tensor:
    layer_spec = ScalarSpec.from_list(spec)
    weights = ScalarWeights(codes, scales, zeros, bias)
    name, auto = _op_backend(backend, x)
    return _scalar_runner(layer_spec, weights, name, auto, _prepared(weights))(x)


@_scalar_linear_op.register_fake
def _scalar_linear_fake(x, spec, codes, scales, zeros, bias, backend):
    return x.new_empty((*x.shape[:-1], spec[1]))


# -------------------------------------------------------------------------------------------- public
# Per-layer data keyed on the tensors' identity and version: validation (once per unchanged set of tensors)
# and each backend's prepared arrays.
_memo = LayerMemo()


def _prepared(weights: VQWeights | ScalarWeights) -> dict:
    return _memo.get(weights[0], tuple(weights), dict)


def _resolve(backend: str | None, x: torch.Tensor, weights: VQWeights | ScalarWeights) -> tuple[str, bool]:
    """(backend, chosen automatically) for this call; autograd needs the reference path (the fused kernels
    have no backward)."""
    name = requested_backend(backend)
    check_device(name, x)
    if torch.is_grad_enabled() and (x.requires_grad or any(
            t is not None and t.requires_grad for t in weights.float_tensors())):
        if name not in ("auto", "reference"):
            raise RuntimeError(
                f"{name} backend has no backward; use backend='reference' (or None) when inputs require grad, "
                "or call it under torch.no_grad()"
            )
        return "reference", False
    return _choose(name, x.device)


def _checked_linear(x, spec, weights, backend, check, reference_linear, op, runner) -> torch.Tensor:  # noqa: ANN001
    """The public call of either layer kind: checks (once per unchanged tensors), backend, run."""
    if torch.compiler.is_compiling():
        # Traced by dynamo: plain checks, then the opaque custom op (backend resolved when it runs).
        check(spec, weights)
        _check_x(x, spec.in_features)
        if backend == "reference":
            return reference_linear(x, spec, weights)
        return op(x, spec.as_list(), *weights, backend or _DEFAULT)
    prepared = _prepared(weights)
    if prepared.get("checked") != spec:
        check(spec, weights)
        prepared["checked"] = spec
    _check_x(x, spec.in_features)
    name, auto = _resolve(backend, x, weights)
    return runner(spec, weights, name, auto, prepared)(x)


def vq_dequantize(spec: VQSpec, weights: VQWeights) -> torch.Tensor:
    """Dense W [out, in] (dtype of centroids) of a packed VPTQ layer; differentiable in the float tensors.
    ``weights.bias`` is not part of W."""
    check_vq_weights(spec, weights)
    return reference.vq_dequantize(spec, weights)


def vq_linear(x: torch.Tensor, spec: VQSpec, weights: VQWeights, backend: str | None = None) -> torch.Tensor:
    """y [..., out] (x.dtype) = x [..., in] @ W.T + bias, W the dequantized VPTQ weight (see ``vq_dequantize``).

    ``backend``: None/"auto" (env ``VPTQ_KERNEL_BACKEND`` overrides None), "reference", "native", "cpu",
    "triton".
    """
    if not isinstance(weights, VQWeights):
        raise TypeError(f"weights must be a kernels.VQWeights, got {type(weights).__name__}")
    return _checked_linear(x, spec, weights, backend, check_vq_weights, reference.vq_linear, _vq_linear_op,
                           _vq_runner)


def scalar_dequantize(spec: ScalarSpec, weights: ScalarWeights) -> torch.Tensor:
    """W [out, in] = scales * (codes - zeros) per (row, group), dtype of ``weights.scales``."""
    check_scalar_weights(spec, weights)
    return reference.scalar_dequantize(spec, weights)


def scalar_linear(x: torch.Tensor, spec: ScalarSpec, weights: ScalarWeights,
                  backend: str | None = None) -> torch.Tensor:
    """y [..., out] (x.dtype) = x @ scalar_dequantize(spec, weights).T + bias."""
    if not isinstance(weights, ScalarWeights):
        raise TypeError(f"weights must be a kernels.ScalarWeights, got {type(weights).__name__}")
    return _checked_linear(x, spec, weights, backend, check_scalar_weights, reference.scalar_linear,
                           _scalar_linear_op, _scalar_runner)
