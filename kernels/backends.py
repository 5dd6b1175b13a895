"""Which kernel backends can run here, and which one a call uses.

Names: ``"reference"`` (torch dequantize + ``F.linear``, always usable), ``"native"`` (the C++ kernels for CPU
tensors, built on first use; unusable without a compiler or with ``VPTQ_NATIVE=0``), ``"cpu"`` (fused numba
kernels for CPU tensors), ``"triton"`` (CUDA tensors; CPU tensors only under ``TRITON_INTERPRET=1``).
``backend=None`` (or ``"auto"``) picks per call; the environment variable ``VPTQ_KERNEL_BACKEND`` overrides
``None``. Asking for a backend that cannot run raises ``RuntimeError`` with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("reference", "native", "cpu", "triton")
ENV_VAR = "VPTQ_KERNEL_BACKEND"


@functools.cache
def _module_reason(module: str) -> str:
    """'' when ``module`` imports, otherwise why not."""
    if importlib.util.find_spec(module) is None:
        return f"the '{module}' package is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # an optional dependency may fail in many ways; report it, do not crash
        return f"importing '{module}' failed: {type(exc).__name__}: {exc}"
    return ""


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _static_status(name: str, interpret: bool) -> tuple[bool, str]:
    return _status(name, interpret)


def backend_status(name: str) -> tuple[bool, str]:
    """(usable, reason when not) for one backend name (cached; TRITON_INTERPRET is re-read each call; the
    native kernels answer for themselves: a build may finish, or be disabled, while the process runs)."""
    if name == "native":
        return _status(name, False)
    status = _static_status(name, name == "triton" and triton_interpret())
    if name == "cpu" and status[0]:
        import sys

        cpu = sys.modules.get(__package__ + ".cpu")
        failure = cpu.compile_failure() if cpu is not None else ""
        if failure:
            return False, failure
    return status


def _status(name: str, interpret: bool) -> tuple[bool, str]:
    """(usable, reason when not) for one backend name."""
    if name == "reference":
        return True, ""
    if name == "native":
        reason = _module_reason(__package__ + ".native")
        if reason:
            return False, f"native backend unavailable: {reason}"
        return importlib.import_module(__package__ + ".native").status()
    if name == "cpu":
        reason = _module_reason("numba")
        return (not reason), (f"cpu backend unavailable: {reason}" if reason else "")
    if name == "triton":
        reason = _module_reason("triton")
        if reason:
            return False, f"triton backend unavailable: {reason}"
        if not torch.cuda.is_available() and not interpret:
            return False, "triton backend unavailable: no CUDA device and TRITON_INTERPRET is not set"
        return True, ""
    raise ValueError(f"backend must be one of {BACKENDS} or None/'auto', got {name!r}")


def available_backends() -> dict[str, tuple[bool, str]]:
    """name -> (usable, reason if not usable)."""
    return {name: backend_status(name) for name in BACKENDS}


def requested_backend(backend: str | None) -> str:
    """Resolve the argument / environment override to 'auto' or a usable backend name (raises otherwise)."""
    if backend is None:
        backend = os.environ.get(ENV_VAR, "") or "auto"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    backend = backend.strip().lower()
    if backend == "auto":
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None/'auto', got {backend!r}")
    usable, reason = backend_status(backend)
    if not usable:
        raise RuntimeError(reason)
    return backend


def check_device(backend: str, x: torch.Tensor) -> None:
    """Explicit backends refuse tensors on a device they cannot serve."""
    if backend in ("cpu", "native") and x.device.type != "cpu":
        raise RuntimeError(f"{backend} backend needs CPU tensors, got x on {x.device}")
    if backend == "triton" and x.device.type != "cuda" and not triton_interpret():
        raise RuntimeError(f"triton backend needs CUDA tensors (or TRITON_INTERPRET=1), got x on {x.device}")
