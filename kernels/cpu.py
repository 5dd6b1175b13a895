"""Fused CPU decode kernels (numba): lookup GEMV straight from the packed index streams, never building W.

For a VPTQ layer (see ``kernels.reference``) with stored-order weight ``Wp`` the kernel computes::

    xs = x * weight_scale (norm)        xp = xs[perm] (stored column order)
    y  = Wp @ xp + dot(weight_bias, x) + bias

Outlier columns come first in the stored order, then ``group_num`` groups of ``group_size`` columns.
Each block of 4 vector rows (2 for v > 8) streams its packed index words LSB-first (one 64-bit bit buffer
per row), gathers ``v`` centroid values (+ residual) and accumulates in fp32 registers; rows blocks run in
parallel. The per-row accumulators are tuples of 8 or 16 floats that LLVM's SLP vectoriser turns into one
SIMD FMA per looked-up vector, so these functions are compiled with SLP on and loop vectorisation off
(loop vectorisation would turn the column loop into slow gathers). Compiled code is cached on disk
(``cache=True``, in ``kernels/__pycache__`` or numba's user cache dir), so only the first run on a machine
pays the compile time (30-60 s on 2 busy cores; loading from the cache takes ~2 s).

Prefill (many tokens) instead decodes tiles of output rows of ``Wp`` with a numba kernel into a reused
per-thread buffer and multiplies each tile with one matmul. Scalar-code layers have a GEMV kernel too.

Prepared per layer on first call (keyed on the tensors' identity and version): fp32 copies of the
codebooks, perm as int64 and norm vectors as fp32. The packed indices are used in place.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import numpy as np
import torch

from ._cache import LayerMemo
from .spec import ScalarSpec, ScalarWeights, VQSpec, VQWeights

# Lanes loaded past the end of a codebook row (the last centroid's 8/16-lane load), kept zero.
_PAD = 16


@contextlib.contextmanager
def _vectoriser_flags() -> Iterator[None]:
    """Compile with SLP vectorisation on and loop vectorisation off (numba reads these per compilation)."""
    from numba.core import config

    saved = config.LOOP_VECTORIZE, config.SLP_VECTORIZE
    config.LOOP_VECTORIZE, config.SLP_VECTORIZE = 0, 1
    try:
        yield
    finally:
        config.LOOP_VECTORIZE, config.SLP_VECTORIZE = saved


_compile_lock = threading.Lock()
_failure: list[str] = []  # why compiling failed, once it has


def compile_failure() -> str:
    """'' unless compiling the numba kernels failed in this process (then the reason)."""
    return _failure[0] if _failure else ""


@functools.lru_cache(maxsize=1)
def _load_kernels():  # noqa: ANN202 - returns the compiled numba module namespace
    import numba

    # Starting the threading layer first lets cached parallel code link (else "Symbol not found: allocate_sched").
    numba.get_num_threads()
    with _compile_lock:
        from . import _cpu_numba

        _cpu_numba.compile_vectorised()
        with _vectoriser_flags():
            _cpu_numba.compile_all()
    return _cpu_numba


def _kernels():  # noqa: ANN202
    """Import (and on first use compile or load from the on-disk cache) the numba kernels."""
    if _failure:
        raise RuntimeError(_failure[0])
    try:
        return _load_kernels()
    except Exception as exc:  # numba/LLVM can fail in many ways on an unusual machine; report why
        _failure.append(f"cpu backend unavailable: compiling the numba kernels failed: {type(exc).__name__}: {exc}")
        raise RuntimeError(_failure[0]) from exc


def warm_up() -> None:
    """Compile / load the numba kernels now instead of on the first call."""
    _kernels()


@functools.lru_cache(maxsize=1)
def _env_threads() -> int:
    value = os.environ.get("VPTQ_CPU_THREADS", "")
    if not value:
        return 0
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"VPTQ_CPU_THREADS must be a positive integer, got {value!r}")
    return int(value)


def num_threads() -> int:
    """Threads the fused kernels use: ``VPTQ_CPU_THREADS`` (read once) if set, else torch's intra-op threads."""
    return _env_threads() or torch.get_num_threads()


# ------------------------------------------------------------------------------------------- prepared
_memo = LayerMemo()
_stored_memo = LayerMemo()


def _f32(t: torch.Tensor | None, pad: int = 0) -> np.ndarray:
    if t is None:
        return np.zeros(1, np.float32)
    flat = t.detach().to(torch.float32).reshape(t.shape[0], -1) if t.dim() > 1 else t.detach().float()
    out = np.zeros((*flat.shape[:-1], flat.shape[-1] + pad), np.float32)
    out[..., : flat.shape[-1]] = flat.numpy()
    return out


def _prepare_vq(weights: VQWeights) -> dict:
    indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale, weight_bias, bias = (
        weights)
    words = indices.detach()
    if not words.is_contiguous():
        words = words.contiguous()
    return {
        "words": words.numpy().view(np.uint32),
        "keep": words,  # keeps a contiguous copy alive while the view is in use
        "cb": _f32(centroids, _PAD),
        "rcb": _f32(res_centroids, _PAD) if res_centroids is not None else np.zeros((1, 1), np.float32),
        "ocb": _f32(outlier_centroids, _PAD)[0] if outlier_centroids is not None else np.zeros(1, np.float32),
        "oidx": (outlier_indices[0].detach().to(torch.int32).numpy().astype(np.uint16)
                 if outlier_indices is not None else np.zeros((1, 1), np.uint16)),
        "perm": (perm.detach().to(torch.int64).numpy() & (0xFFFF if perm.dtype == torch.int16 else -1)
                 if perm is not None else np.zeros(1, np.int64)),
        "scale": _f32(weight_scale),
        "wbias": _f32(weight_bias),
        "bias": _f32(bias),
    }


def _io(x: torch.Tensor, in_features: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(contiguous 2-D input, output buffer, bf16?) for the kernels, which read and write raw buffers."""
    x2 = x if x.dim() == 2 else x.reshape(-1, in_features)
    bf16 = x2.dtype == torch.bfloat16
    if not bf16 and x2.dtype != torch.float32:
        x2 = x2.to(torch.float32)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return x2, torch.empty((x2.shape[0], out_features), dtype=x2.dtype), bf16


def _result(y: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], out_features)


def vq_linear(x: torch.Tensor, spec: VQSpec, weights: VQWeights, state: dict | None = None,
              fused: bool = True) -> torch.Tensor:
    """x [..., in] -> y [..., out] (x.dtype) on CPU; inputs validated by ``kernels.ops``.

    ``fused``: the lookup GEMV (decode: cost grows with every token); else the numba dequantize kernel
    writes the stored-order weight once and one matmul follows (prefill).
    ``state``: the per-layer dict ``kernels.ops`` keeps for these exact tensors (prepared arrays go there);
    without it, a module-level memo keyed on the tensors is used.
    """
    k = _kernels()
    a = state.get("cpu") if state is not None else None
    if a is None:
        a = _memo.get(weights.indices, tuple(weights), lambda: _prepare_vq(weights))
        if state is not None:
            state["cpu"] = a
    perm, weight_scale, bias = weights.perm, weights.weight_scale, weights.bias
    if not fused:
        return _dequant_matmul(k, a, x, spec, weights)
    x2, y, bf16 = _io(x, spec.in_features, spec.out_features)
    k.vq_gemv(
        x2.data_ptr(), y.data_ptr(), x2.shape[0], spec.in_features, spec.out_features, bf16, a["words"], a["cb"],
        a["rcb"], a["oidx"], a["ocb"], a["perm"], a["scale"], a["wbias"], a["bias"], spec.vector_len,
        spec.index_bits, spec.res_bits, spec.outlier_size, spec.outlier_vector_len, perm is not None,
        weight_scale is not None, bias is not None, num_threads(),
    )
    return _result(y, x, spec.out_features)


_workspace = threading.local()
# Prefill dequantizes this many bytes of weight rows at a time (about half an L2) and multiplies them at once.
_TILE_BYTES = 1 << 20


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread reusable flat buffer (fresh large allocations cost page faults on every call)."""
    buffers = getattr(_workspace, "buffers", None)
    if buffers is None:
        buffers = _workspace.buffers = {}
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _dequantize_into(k, a: dict, spec: VQSpec, weight: torch.Tensor, r_begin: int, r_end: int) -> None:  # noqa: ANN001
    k.vq_dequant(weight.data_ptr(), r_begin, r_end, spec.out_features, spec.in_features,
                 weight.dtype == torch.bfloat16, a["words"], a["cb"], a["rcb"], a["oidx"], a["ocb"],
                 spec.vector_len, spec.index_bits, spec.res_bits, spec.outlier_size, spec.outlier_vector_len,
                 num_threads())


def _dequant_matmul(k, a: dict, x: torch.Tensor, spec: VQSpec, weights: VQWeights) -> torch.Tensor:  # noqa: ANN001
    """Prefill: y = (x * scale)[:, perm] @ Wp.T + x @ weight_bias + bias.

    Wp is decoded by numba in tiles of output rows that stay in cache, each followed by its matmul.
    """
    perm, weight_scale, weight_bias, bias = weights.perm, weights.weight_scale, weights.weight_bias, weights.bias
    compute = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    x2 = x.reshape(-1, spec.in_features)
    xp = x2.float()
    if weight_scale is not None:
        xp = xp * torch.from_numpy(a["scale"])
    if perm is not None:
        xp = xp[:, torch.from_numpy(a["perm"])]
    xp = xp.to(compute)
    v, out = spec.vector_len, spec.out_features
    element = 2 if compute == torch.bfloat16 else 4
    tile_rows = max(1, _TILE_BYTES // (element * spec.in_features * v))  # vector rows per tile
    y = torch.empty(x2.shape[0], out, dtype=compute)
    buf = _scratch(min(out, tile_rows * v) * spec.in_features, compute)
    for r_begin in range(0, spec.rows, tile_rows):
        r_end = min(spec.rows, r_begin + tile_rows)
        o_begin, o_end = r_begin * v, min(out, r_end * v)
        weight = buf[: (o_end - o_begin) * spec.in_features].view(o_end - o_begin, spec.in_features)
        _dequantize_into(k, a, spec, weight, r_begin, r_end)
        torch.matmul(xp, weight.T, out=y[:, o_begin:o_end])
    if weight_bias is not None or bias is not None:
        y = y.float()
        if weight_bias is not None:
            y += (x2.float() @ torch.from_numpy(a["wbias"]))[:, None]
        if bias is not None:
            y += torch.from_numpy(a["bias"])
    return y.to(x.dtype).reshape(*x.shape[:-1], out)


def vq_dequantize_stored(spec: VQSpec, weights: VQWeights, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored-order weight Wp [out, in] (outlier columns first, no perm/norm) in fp32 or bf16."""
    k = _kernels()
    stored = weights._replace(perm=None, weight_scale=None, weight_bias=None, bias=None)
    a = _stored_memo.get(stored.indices, tuple(stored), lambda: _prepare_vq(stored))
    weight = torch.empty(spec.out_features, spec.in_features,
                         dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    _dequantize_into(k, a, spec, weight, 0, spec.rows)
    return weight


def scalar_linear(x: torch.Tensor, spec: ScalarSpec, weights: ScalarWeights, state: dict | None = None) -> torch.Tensor:
    """Fused scalar-code GEMV on CPU: x [..., in] -> y [..., out] (x.dtype); inputs validated by ``kernels.ops``."""
    k = _kernels()
    codes_packed, scales, zeros, bias = weights
    bits, group_size, in_features = spec.bits, spec.group_size, spec.in_features

    def build() -> dict:
        codes = codes_packed.detach().contiguous()
        s = scales.detach().float()
        return {
            "codes": codes.numpy().view(np.uint32),
            "keep": codes,
            "scales": np.ascontiguousarray(s.numpy()),
            # y = sum_g s * (sum_j q*x) - s*z * (sum_j x)
            "zs": np.ascontiguousarray((s * zeros.detach().float()).numpy()),
            "bias": _f32(bias),
        }

    a = state.get("cpu") if state is not None else None
    if a is None:
        a = _memo.get(codes_packed, (codes_packed, scales, zeros, bias), build)
        if state is not None:
            state["cpu"] = a
    out_features = codes_packed.shape[0]
    x2, y, bf16 = _io(x, in_features, out_features)
    groups = a["scales"].shape[1]
    # Word-aligned 4/8-bit codes: contiguous loops that vectorise (measured faster; 1/2-bit loops are too short).
    aligned = bits in (4, 8) and (groups == 1 or group_size % (32 // bits) == 0)
    kernel = k.scalar_gemv_aligned if aligned else k.scalar_gemv
    kernel(x2.data_ptr(), y.data_ptr(), x2.shape[0], in_features, bf16, a["codes"], a["scales"], a["zs"],
           a["bias"], bits, group_size, bias is not None, num_threads())
    return _result(y, x, out_features)
