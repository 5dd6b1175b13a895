"""Public entry points: input checks, backend selection and the ``vptq_core::`` torch custom ops.

Every backend computes the same thing as ``kernels.reference`` (dequantize + ``F.linear``). The fused
backends are opaque to autograd and to ``torch.compile``, so they are registered as custom ops with
fake (meta) implementations; eager calls skip the dispatcher because per-call overhead matters for decode
(a small model runs hundreds of these linears per token).
"""

from __future__ import annotations

import torch

from . import reference
from ._cache import LayerMemo
from .backends import backend_status, check_device, requested_backend
from .packing import packed_width
from .spec import VQSpec

# Up to this many rows of x (tokens) the cpu backend runs the fused decode kernel; above it, its numba
# dequantize + one matmul is faster (bench/kernels.py prints the crossover table this comes from).
CPU_FUSED_MAX_TOKENS = 8
# Same switch for the Triton lookup GEMV versus Triton dequantize + cuBLAS: a starting value, not measured
# here (no GPU); bench/kernels_gpu.py times both paths at 1, 8 and 128 tokens.
TRITON_FUSED_MAX_TOKENS = 8

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# Layer tensors validated once per (unchanged) set of tensors: the checks cost more than a small GEMV.
_validated = LayerMemo()


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


def check_vq_inputs(
    spec: VQSpec,
    indices: torch.Tensor,
    centroids: torch.Tensor,
    res_centroids: torch.Tensor | None,
    outlier_indices: torch.Tensor | None,
    outlier_centroids: torch.Tensor | None,
    perm: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    weight_bias: torch.Tensor | None,
) -> None:
    """Raise TypeError/ValueError naming the first argument that does not fit ``spec``."""
    if not isinstance(spec, VQSpec):
        raise TypeError(f"spec must be a kernels.VQSpec, got {type(spec).__name__}")
    G, v = spec.group_num, spec.vector_len
    _check_tensor("indices", indices, (G, spec.rows, spec.packed_words), (torch.int32,))
    _check_tensor("centroids", centroids, (G, spec.num_centroids * v), _FLOAT_DTYPES)
    _check_optional("res_centroids", res_centroids, spec.has_residual, "when spec.num_res_centroids > 0")
    if res_centroids is not None:
        _check_tensor("res_centroids", res_centroids, (G, spec.num_res_centroids * v), _FLOAT_DTYPES)
    _check_optional("outlier_indices", outlier_indices, spec.has_outliers, "when spec.outlier_size > 0")
    _check_optional("outlier_centroids", outlier_centroids, spec.has_outliers, "when spec.outlier_size > 0")
    if spec.has_outliers:
        _check_tensor(
            "outlier_indices", outlier_indices, (1, spec.outlier_rows, spec.outlier_size),
            (torch.int16, torch.int32, torch.int64),
        )
        _check_tensor(
            "outlier_centroids", outlier_centroids, (1, spec.num_outlier_centroids * spec.outlier_vector_len),
            _FLOAT_DTYPES,
        )
    if perm is not None:
        _check_tensor("perm", perm, (spec.in_features,), (torch.int16, torch.int32, torch.int64))
    if (weight_scale is None) != (weight_bias is None):
        raise ValueError("weight_scale and weight_bias must be given together (norm) or both be None")
    if weight_scale is not None:
        _check_tensor("weight_scale", weight_scale, (spec.in_features,), _FLOAT_DTYPES)
        _check_tensor("weight_bias", weight_bias, (spec.in_features,), _FLOAT_DTYPES)


def _check_vq_layer(spec: VQSpec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm,
                    weight_scale, weight_bias, bias) -> VQSpec:  # noqa: ANN001
    check_vq_inputs(spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale,
                    weight_bias)
    _check_bias(bias, spec.out_features)
    return {"spec": spec}  # backends keep their prepared per-layer arrays here


def _check_x(x: object, in_features: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x dtype must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x last dimension must be in_features ({in_features}), got shape {tuple(x.shape)}")


def _check_bias(bias: object, out_features: int) -> None:
    if bias is not None:
        _check_tensor("bias", bias, (out_features,), _FLOAT_DTYPES)


def check_scalar_inputs(
    codes_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
    in_features: int,
) -> None:
    for name, value, lo, hi in (("bits", bits, 1, 8), ("group_size", group_size, 1, None),
                                ("in_features", in_features, 1, None)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < lo or (hi is not None and value > hi):
            allowed = f"in {lo}..{hi}" if hi else f">= {lo}"
            raise ValueError(f"{name} must be {allowed}, got {value}")
    if not isinstance(codes_packed, torch.Tensor) or codes_packed.dim() != 2:
        raise ValueError(f"codes_packed must be a 2-D int32 tensor [out, words], got {codes_packed!r:.80}")
    out = codes_packed.shape[0]
    groups = -(-in_features // group_size)
    _check_tensor("codes_packed", codes_packed, (out, packed_width(in_features, bits)), (torch.int32,))
    _check_tensor("scales", scales, (out, groups), _FLOAT_DTYPES)
    _check_tensor("zeros", zeros, (out, groups), _FLOAT_DTYPES + (torch.int32, torch.int64, torch.uint8))


def _check_scalar_layer(codes_packed, scales, zeros, bias, bits, group_size, in_features) -> dict:  # noqa: ANN001
    check_scalar_inputs(codes_packed, scales, zeros, bits, group_size, in_features)
    _check_bias(bias, codes_packed.shape[0])
    return {"args": (bits, group_size, in_features)}


# ------------------------------------------------------------------------------------- implementations
_modules: dict = {}


def _backend_module(name: str):  # noqa: ANN202
    """The module implementing a fused backend, imported on first use."""
    module = _modules.get(name)
    if module is None:
        import importlib

        module = _modules[name] = importlib.import_module(f".{'cpu' if name == 'cpu' else 'triton_kernels'}",
                                                          __package__)
    return module


def _vq_impl(
    x: torch.Tensor, spec: VQSpec, indices: torch.Tensor, centroids: torch.Tensor,
    res_centroids: torch.Tensor | None, outlier_indices: torch.Tensor | None,
    outlier_centroids: torch.Tensor | None, perm: torch.Tensor | None, weight_scale: torch.Tensor | None,
    weight_bias: torch.Tensor | None, bias: torch.Tensor | None, backend: str, state: dict | None = None,
) -> torch.Tensor:
    args = (x, spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm,
            weight_scale, weight_bias, bias)
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    auto = backend == "auto"
    if auto:
        backend = _auto_backend(x, tokens)
    if backend == "cpu":
        cpu = _backend_module("cpu")
        if auto and cpu.compile_failure():
            return reference.vq_linear(*args)
        try:
            return cpu.vq_linear(*args, state=state, fused=tokens <= CPU_FUSED_MAX_TOKENS)
        except RuntimeError:
            if auto and cpu.compile_failure():  # the kernels could not be built here: fall back for good
                return reference.vq_linear(*args)
            raise
    if backend == "triton":
        return _backend_module("triton").vq_linear(*args, fused=tokens <= TRITON_FUSED_MAX_TOKENS)
    return reference.vq_linear(*args)


def _scalar_impl(
    x: torch.Tensor, codes_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bias: torch.Tensor | None, bits: int, group_size: int, in_features: int, backend: str, state: dict | None = None,
) -> torch.Tensor:
    args = (x, codes_packed, scales, zeros, bias, bits, group_size, in_features)
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    auto = backend == "auto"
    if auto:
        backend = _auto_backend(x, tokens)
        if backend == "cpu" and tokens > CPU_FUSED_MAX_TOKENS:
            backend = "reference"  # the scalar cpu kernel is a GEMV only; prefill dequantizes + one matmul
    if backend == "cpu":
        cpu = _backend_module("cpu")
        if auto and cpu.compile_failure():
            return reference.scalar_linear(*args)
        try:
            return cpu.scalar_linear(*args, state=state)
        except RuntimeError:
            if auto and cpu.compile_failure():
                return reference.scalar_linear(*args)
            raise
    if backend == "triton":
        return _backend_module("triton").scalar_linear(*args, fused=tokens <= TRITON_FUSED_MAX_TOKENS)
    return reference.scalar_linear(*args)


def _auto_backend(x: torch.Tensor, tokens: int) -> str:
    """CUDA -> triton, CPU -> cpu (each picks its fused GEMV or dequantize + matmul by tokens), else reference."""
    if x.device.type == "cuda":
        return "triton" if backend_status("triton")[0] else "reference"
    if x.device.type == "cpu" and backend_status("cpu")[0]:
        return "cpu"
    return "reference"


# ---------------------------------------------------------------------------------------- custom ops
_DEFAULT = "default"  # backend argument of the ops meaning "None": the environment override applies


def _op_backend(backend: str, x: torch.Tensor) -> str:
    name = requested_backend(None if backend == _DEFAULT else backend)
    check_device(name, x)
    return name


@torch.library.custom_op("vptq_core::vq_linear", mutates_args=())
def _vq_linear_op(
    x: torch.Tensor, spec: list[int], indices: torch.Tensor, centroids: torch.Tensor,
    res_centroids: torch.Tensor | None, outlier_indices: torch.Tensor | None,
    outlier_centroids: torch.Tensor | None, perm: torch.Tensor | None, weight_scale: torch.Tensor | None,
    weight_bias: torch.Tensor | None, bias: torch.Tensor | None, backend: str,
) -> torch.Tensor:
    return _vq_impl(
        x, VQSpec.from_list(spec), indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm,
        weight_scale, weight_bias, bias, _op_backend(backend, x),
    )


@_vq_linear_op.register_fake
def _vq_linear_fake(
    x, spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale,
    weight_bias, bias, backend,
):
    return x.new_empty((*x.shape[:-1], spec[1]))


@torch.library.custom_op("vptq_core::scalar_linear", mutates_args=())
def _scalar_linear_op(
    x: torch.Tensor, codes_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bias: torch.Tensor | None, bits: int, group_size: int, in_features: int, backend: str,
) -> torch.Tensor:
    return _scalar_impl(x, codes_packed, scales, zeros, bias, bits, group_size, in_features, _op_backend(backend, x))


@_scalar_linear_op.register_fake
def _scalar_linear_fake(x, codes_packed, scales, zeros, bias, bits, group_size, in_features, backend):
    return x.new_empty((*x.shape[:-1], codes_packed.shape[0]))


# -------------------------------------------------------------------------------------------- public
def _resolve(backend: str | None, x: torch.Tensor, float_args: tuple[torch.Tensor | None, ...]) -> str:
    """Backend name for this call; autograd needs the reference path (the fused kernels have no backward)."""
    name = requested_backend(backend)
    check_device(name, x)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in float_args):
        if name == "auto":
            return "reference"
        if name != "reference":
            raise RuntimeError(
                f"{name} backend has no backward; use backend='reference' (or None) when inputs require grad, "
                "or call it under torch.no_grad()"
            )
    return name


def vq_dequantize(
    spec: VQSpec,
    indices: torch.Tensor,
    centroids: torch.Tensor,
    res_centroids: torch.Tensor | None = None,
    outlier_indices: torch.Tensor | None = None,
    outlier_centroids: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense W [out, in] (dtype of centroids) of a packed VPTQ layer; differentiable in the float tensors.

    indices int32 [G, R, packed_words]; centroids [G, k*v]; res_centroids [G, k_res*v];
    outlier_indices int16 [1, ceil(out/vo), outlier_size] (uint16 patterns); outlier_centroids [1, k_o*vo];
    perm [in] (stored column i holds original column perm[i]); weight_scale, weight_bias [in].
    """
    check_vq_inputs(spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm,
                    weight_scale, weight_bias)
    return reference.vq_dequantize(
        spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale, weight_bias
    )


def vq_linear(
    x: torch.Tensor,
    spec: VQSpec,
    indices: torch.Tensor,
    centroids: torch.Tensor,
    res_centroids: torch.Tensor | None = None,
    outlier_indices: torch.Tensor | None = None,
    outlier_centroids: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_bias: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y [..., out] (x.dtype) = x [..., in] @ W.T + bias, W the dequantized VPTQ weight (see ``vq_dequantize``).

    ``backend``: None/"auto" (env ``VPTQ_KERNEL_BACKEND`` overrides None), "reference", "cpu", "triton".
    """
    if torch.compiler.is_compiling():
        # Traced by dynamo: plain checks, then the opaque custom op (backend resolved when it runs).
        _check_vq_layer(spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm,
                        weight_scale, weight_bias, bias)
        _check_x(x, spec.in_features)
        if backend == "reference":
            return reference.vq_linear(x, spec, indices, centroids, res_centroids, outlier_indices,
                                       outlier_centroids, perm, weight_scale, weight_bias, bias)
        return _vq_linear_op(x, spec.as_list(), indices, centroids, res_centroids, outlier_indices,
                             outlier_centroids, perm, weight_scale, weight_bias, bias, backend or _DEFAULT)
    layer = (indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale, weight_bias,
             bias)
    state = _validated.get(indices, layer, lambda: _check_vq_layer(spec, *layer))
    if state["spec"] is not spec and state["spec"] != spec:
        state = _check_vq_layer(spec, *layer)
    _check_x(x, spec.in_features)
    name = _resolve(backend, x, (x, centroids, res_centroids, outlier_centroids, weight_scale, weight_bias, bias))
    if name == "reference":
        # Plain torch ops: autograd and torch.compile see through them.
        return reference.vq_linear(x, spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids,
                                   perm, weight_scale, weight_bias, bias)
    return _vq_impl(x, spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm,
                    weight_scale, weight_bias, bias, name, state)


def scalar_dequantize(
    codes_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
    in_features: int,
) -> torch.Tensor:
    """W [out, in] = scales * (codes - zeros) per (row, group); codes_packed int32 [out, ceil(in*bits/32)],
    scales/zeros [out, ceil(in/group_size)]. Dtype of ``scales``."""
    check_scalar_inputs(codes_packed, scales, zeros, bits, group_size, in_features)
    return reference.scalar_dequantize(codes_packed, scales, zeros, bits, group_size, in_features)


def scalar_linear(
    x: torch.Tensor,
    codes_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
    in_features: int,
    backend: str | None = None,
) -> torch.Tensor:
    """y [..., out] (x.dtype) = x @ scalar_dequantize(...).T + bias."""
    if torch.compiler.is_compiling():
        _check_scalar_layer(codes_packed, scales, zeros, bias, bits, group_size, in_features)
        _check_x(x, in_features)
        if backend == "reference":
            return reference.scalar_linear(x, codes_packed, scales, zeros, bias, bits, group_size, in_features)
        return _scalar_linear_op(x, codes_packed, scales, zeros, bias, bits, group_size, in_features,
                                 backend or _DEFAULT)
    layer = (codes_packed, scales, zeros, bias)
    args = (bits, group_size, in_features)
    state = _validated.get(codes_packed, layer, lambda: _check_scalar_layer(*layer, *args))
    if state["args"] != args:
        state = _check_scalar_layer(*layer, *args)
    _check_x(x, in_features)
    name = _resolve(backend, x, (x, scales, zeros, bias))
    if name == "reference":
        return reference.scalar_linear(x, codes_packed, scales, zeros, bias, bits, group_size, in_features)
    return _scalar_impl(x, codes_packed, scales, zeros, bias, bits, group_size, in_features, name, state)
