"""Native C++ CPU kernels (torch extension built on first use from ``kernels/csrc``).

Same math as ``kernels.reference`` / ``kernels.cpu`` (see their docstrings), repacked once per layer:

* ``prepare_vq(spec, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale,
  weight_bias, bias)`` -> a ``VQLayer``: per vector row one index (the centroid's element offset) as uint16
  (uint32 only when an offset needs more than 16 bits), rows interleaved in blocks of 8, codebooks padded to 4/8/16
  lanes per centroid in fp32 and bf16 (the bf16 copy is used by the 1-token GEMV only when it is exact), the
  residual as a second index stream, perm as int32, norm and bias as fp32.
* ``vq_linear(x, layer)``: x [..., in] (bf16 or fp32; other float dtypes run in fp32) -> y [..., out] in x.dtype,
  fp32 accumulation. Up to 8 tokens: a fused lookup GEMV (W is never built; each centroid load is shared by the
  tokens; AVX-512 puts 2 or 4 tokens in one 512-bit register). More tokens (prefill): W is dequantized tile by
  tile (perm and norm folded in, so the tiles equal the reference's bf16 W) and multiplied in bf16 with fp32
  accumulation: on CPUs with oneDNN's micro-kernels (AMX) the tiles are written straight into small VNNI blocks
  fed to ``at::native::cpublas::brgemm``; elsewhere tiles of ~480 outputs go through ``torch.mm``, in fp32 for bf16
  x on CPUs without bf16 dot products (AVX2-only: torch's bf16 GEMM there widens operands on the fly, 5-13x slower
  than MKL's fp32 GEMM on the same bf16-exact values).
* Codebooks of at most 256 entries (main and residual) keep uint8 codes instead of 16-bit offsets (half the index
  bytes a GEMV streams); the GEMV prefetches its index streams a few KB ahead.
* The extension's ``vq_many(layers, x, silu_mul=False)`` / ``scalar_many(layers, x, silu_mul=False, act_mode=-1,
  act_bits=8, act_scale=0.0)``: several prepared layers on one x in one call ([y, ...], or ``[silu(y0) * y1]``),
  up to 8 tokens in one parallel region over all their rows; the outputs equal the single calls exactly.
* ``prepare_scalar(codes_packed, scales, zeros, bias, bits, group_size, in_features)`` / ``scalar_linear(x,
  layer)``: the same for scalar codes (bits 1..8, any group size; codes repacked to 4- or 8-bit containers with
  each group padded to 32 codes). GEMV up to 4 tokens where the micro-kernel path exists (8 elsewhere; measured
  crossover), then dequantize + GEMM.
* Training (``vptq_core.quant.trainable``): the extension's ``codebook_expand(codebook, codes, k, out)`` gathers a
  trainable VQ linear's stored-order weight from its codes ([G, R, group_size], int16 as uint16 patterns) and
  ``codebook_sum(grad, codes, k, v)`` sums the weight's gradient back into the codebook rows (one buffer per thread
  chunk, added in chunk order); torch's ``index_select`` / ``index_add_`` do the same where the extension is not
  built.

The kernels exist for AVX-512 (F/BW/VL/DQ/BF16), AVX2+FMA and plain C++; the best one the CPU supports is chosen
at run time (``isa()``, ``set_isa()`` to force a lower one). Big layers run on ATen's thread pool
(``torch.set_num_threads``); small ones stay on the calling thread.

Build: ``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja) into
``$VPTQ_NATIVE_CACHE`` or ``~/.cache/vptq_core/native/<hash of sources, flags, torch and python version>``; later
processes import the built module directly. The build runs in a background thread (``warm_up(background=True)``
starts it; the app and the test session do so at start). One process builds at a time: ``build.lock`` in the build
directory names its pid and host; a lock whose process is gone, or older than 20 min, is taken over, and a stale
torch ``lock`` file of a killed build is removed. The automatic backend choice waits for a build in progress at
most ``VPTQ_NATIVE_WAIT`` seconds (default 300), then reports unusable with the reason (the numba kernels run and
``kernels`` logs one line); the build goes on and layers bound after it finishes use it. ``VPTQ_NATIVE=0``
disables the native kernels (``status()`` then reports why and every entry point raises ``RuntimeError``).
Importing this module never raises.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ENV_VAR = "VPTQ_NATIVE"
CACHE_ENV_VAR = "VPTQ_NATIVE_CACHE"
_NAME = "vptq_native"
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("native.cpp", "isa_scalar.cpp", "isa_avx2.cpp", "isa_avx512.cpp")
_HEADERS = ("common.h", "kernels_body.h", "decoder_body.h", "search_body.h", "shared_input.h")
# -fopenmp: at::parallel_for is inlined from ATen's OpenMP header, so the extension must be built with OpenMP to run
# on torch's thread pool (the module then uses torch's own libgomp, already loaded by libtorch).
_CFLAGS = ("-O3", "-DNDEBUG", "-fno-math-errno", "-fno-trapping-math", "-Wno-unused-function", "-fopenmp")
_LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_module: Any = None
_failure = ""  # why building / loading failed (sticky for this process)


def _disabled() -> bool:
    return os.environ.get(ENV_VAR, "").strip() == "0"


def _build_dir() -> Path:
    digest = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        digest.update(name.encode())
        digest.update((_CSRC / name).read_bytes())
    key = "|".join((*_CFLAGS, *_LDFLAGS, torch.__version__, sys.version, platform.machine(), os.environ.get("CXX", "")))
    digest.update(key.encode())
    root = os.environ.get(CACHE_ENV_VAR, "")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", "") or Path.home() / ".cache") / "vptq_core" / "native"
    return base / digest.hexdigest()[:16]


def _import_built(so: Path) -> Any:
    spec = importlib.util.spec_from_file_location(_NAME, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_error(text: str) -> str:
    """The first compiler / linker error line of a build log."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (r":\d+(:\d+)?: (fatal )?error:", r"\berror\b"):
        for line in lines:
            if re.search(pattern, line, re.IGNORECASE) and "Error building extension" not in line:
                return line[:300]
    return lines[0][:300] if lines else "unknown error"


def _compile(build_dir: Path) -> Any:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise _BuildError(f"no C++ compiler found ({cxx!r} is not on PATH)")
    if not cpp_extension.is_ninja_available():
        raise _BuildError("ninja is not installed (pip install ninja)")
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(
            name=_NAME,
            sources=[str(_CSRC / s) for s in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            extra_include_paths=[str(_CSRC)],
            build_directory=str(build_dir),
            with_cuda=False,
            verbose=False,
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError with the build log
        raise _BuildError(f"build failed: {_first_error(str(exc))}") from exc
    return module


class _BuildError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------- build lock
# One builder per build directory across processes: ``build.lock`` (created with O_EXCL) holds the builder's pid,
# host and start time. A lock whose process is gone (same host), or older than ``_STALE_S``, is stale and taken
# over. torch's own ``lock`` file (cpp_extension waits on it forever) is only ever created by a process holding
# ``build.lock``, so a ``lock`` found while holding it is left over from a killed build and removed.
_LOCK_NAME = "build.lock"
_STALE_S = 20 * 60.0  # no build takes this long (measured 50-180 s on 2 cores)
WAIT_ENV_VAR = "VPTQ_NATIVE_WAIT"
_DEFAULT_WAIT_S = 300.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def _lock_is_stale(path: Path) -> bool:
    try:
        text = path.read_text()
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False  # released meanwhile (or unreadable): look again
    if age > _STALE_S:
        return True
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    try:
        pid = int(fields["pid"])
    except (KeyError, ValueError):
        return age > 30.0  # being written, or garbage: stale once it has stayed unreadable for a while
    return fields.get("host") == socket.gethostname() and not _pid_alive(pid)


def _acquire_build_lock(build_dir: Path, deadline: float) -> Path:
    """Create ``build_dir/build.lock`` (taking over a stale one); raise TimeoutError at ``deadline``."""
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / _LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _lock_is_stale(path):
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                continue
            if time.monotonic() >= deadline:
                raise TimeoutError(f"another process is building the native kernels ({path})") from None
            time.sleep(0.25)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"pid={os.getpid()} host={socket.gethostname()} started={time.time():.0f}\n")
        return path


def _build_or_import(deadline: float) -> Any:
    """The extension module: the cached build if there is one, else built here under the build lock."""
    build_dir = _build_dir()
    so = build_dir / f"{_NAME}.so"
    if so.exists():
        try:
            return _import_built(so)
        except Exception:  # stale or partial build: rebuild below
            pass
    lock = _acquire_build_lock(build_dir, deadline)
    try:
        if so.exists():  # built by another process while this one waited
            try:
                return _import_built(so)
            except Exception:
                pass
        torch_lock = build_dir / "lock"
        if torch_lock.exists():  # left by a killed build (only holders of build.lock create it)
            torch_lock.unlink()
        return _compile(build_dir)
    finally:
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


# ----------------------------------------------------------------------------------------- loading
# The build runs in one daemon thread per process; callers wait for it with a bound (``VPTQ_NATIVE_WAIT``
# seconds for the automatic backend choice, default 300). A caller that gives up gets the fallback and a reason;
# once one has given up, later ones do not wait again, and the build goes on: when it finishes, layers bound
# from then on use the native kernels.
_done = threading.Event()
_thread: threading.Thread | None = None
_waited_out: float | None = None  # the wait that ran out, once one has


def _wait_seconds() -> float:
    text = os.environ.get(WAIT_ENV_VAR, "").strip()
    if not text:
        return _DEFAULT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{WAIT_ENV_VAR} must be a number of seconds, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{WAIT_ENV_VAR} must be >= 0 seconds, got {text!r}")
    return value


def _build_thread_main() -> None:
    global _module, _failure
    try:
        _module = _build_or_import(time.monotonic() + _STALE_S)
    except _BuildError as exc:
        _failure = f"native kernels unavailable: {exc}"
    except TimeoutError as exc:
        _failure = f"native kernels unavailable: {exc} for over {_STALE_S / 60:.0f} min"
    except Exception as exc:  # anything else (permissions, import errors, ...): report, never raise
        _failure = f"native kernels unavailable: {type(exc).__name__}: {exc}"
    finally:
        _done.set()


def _start() -> None:
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_build_thread_main, name="vptq-native-build", daemon=True)
            _thread.start()


def _load(timeout: float | None = None) -> tuple[Any, str]:
    """(module or None, reason when None), waiting at most ``timeout`` s (None: until the build is done)."""
    global _waited_out
    if _module is not None or _failure:
        return _module, _failure
    _start()
    if timeout is not None and _waited_out is not None:
        timeout, waited = 0.0, _waited_out
    else:
        waited = timeout
    if not _done.wait(timeout):
        _waited_out = waited
        return None, (f"native kernels unavailable: build not finished after {waited:.0f} s "
                      f"({_build_dir()}; {WAIT_ENV_VAR} sets the wait)")
    return _module, _failure


def building() -> bool:
    """True while this process builds the extension (or waits for another process's build)."""
    return _thread is not None and not _done.is_set()


def status(wait: float | None = -1.0) -> tuple[bool, str]:
    """(usable, one-line reason when not). Loads the cached build, or builds the extension, on first call.

    ``wait``: seconds to wait for a build in progress; -1 (default) = ``VPTQ_NATIVE_WAIT`` (300), None = until
    done. Giving up is reported as unusable; the build goes on in the background."""
    if _disabled():
        return False, f"native kernels disabled by {ENV_VAR}=0"
    module, reason = _load(_wait_seconds() if wait == -1.0 else wait)
    return module is not None, reason


def expected() -> bool:
    """Whether the native kernels are, or will be, usable here without waiting for anything: not disabled and no
    failed build (a build still running counts as usable). For estimates made before a run starts."""
    return not _disabled() and not _failure


def _ext() -> Any:
    if _disabled():
        raise RuntimeError(f"native kernels disabled by {ENV_VAR}=0")
    module, reason = _load(None)
    if module is None:
        raise RuntimeError(reason)
    return module


def warm_up(background: bool = False) -> tuple[bool, str]:
    """Build / load the extension now instead of on the first call; never raises.

    ``background=True`` starts the build and returns at once: (False, "... building in the background") unless
    it is already done (the app calls this at start-up). Otherwise waits for it and returns ``status()``."""
    if _disabled():
        return False, f"native kernels disabled by {ENV_VAR}=0"
    if background:
        _start()
        if not _done.is_set():
            return False, "native kernels building in the background"
    module, reason = _load(None)
    return module is not None, reason


def isa() -> str:
    """Instruction set of the kernels in use: 'avx512', 'avx2' or 'scalar'."""
    return _ext().isa()


def cpu_isa() -> str:
    """Best instruction set this CPU supports."""
    return _ext().cpu_isa()


def set_isa(name: str = "auto") -> str:
    """Force 'avx512' / 'avx2' / 'scalar' kernels (for tests and benchmarks; 'auto' = best). Returns the active one."""
    return _ext().set_isa(name)


def set_prefill(mode: str = "auto") -> str:
    """Prefill (more than 8 tokens) path: 'auto', 'brgemm' (oneDNN micro-kernel, bf16 x, AMX CPUs), 'mm' (tiles +
    torch.mm in x's dtype, always possible) or 'fp32' (tiles + fp32 torch.mm for bf16 x: what 'auto' takes on CPUs
    without bf16 dot products). Returns the path bf16 prefill now takes. For tests and benchmarks."""
    return _ext().set_prefill(mode)


_VQ_FIELDS = ("indices", "centroids", "res_centroids", "outlier_indices", "outlier_centroids", "perm",
              "weight_scale", "weight_bias", "bias")


def prepare_vq(spec, indices, centroids=None, res_centroids=None, outlier_indices=None,  # noqa: ANN001, ANN201
               outlier_centroids=None, perm=None, weight_scale=None, weight_bias=None, bias=None):
    """Repack one VPTQ layer (public tensors, see ``kernels.reference``) for ``vq_linear``.

    ``spec`` is a ``VQSpec`` (or its ``as_list()``); the tensors come one by one, or as one ``VQWeights`` (or a
    dict with those field names) in place of ``indices``.
    """
    if centroids is None and not isinstance(indices, torch.Tensor):
        fields = indices._asdict() if hasattr(indices, "_asdict") else dict(indices)
        indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm, weight_scale, weight_bias, \
            bias = (fields.get(name) for name in _VQ_FIELDS)
    values = spec.as_list() if hasattr(spec, "as_list") else [int(s) for s in spec]
    return _ext().prepare_vq(values, indices, centroids, res_centroids, outlier_indices, outlier_centroids, perm,
                             weight_scale, weight_bias, bias)


def vq_linear(x: torch.Tensor, prepared) -> torch.Tensor:  # noqa: ANN001
    """x [..., in] -> y [..., out] (x.dtype) for a layer from ``prepare_vq``."""
    return prepared(x)


def prepare_scalar(codes_packed, scales=None, zeros=None, bias=None, bits: int | None = None,  # noqa: ANN001, ANN201
                   group_size: int | None = None, in_features: int | None = None):
    """Repack a scalar-code layer for ``scalar_linear``.

    Arguments: the packed codes int32 [out, ceil(in*bits/32)], scales and zeros [out, groups], bias [out] or None,
    bits, group_size, in_features; or ``prepare_scalar(spec, weights)`` with a ``ScalarSpec`` and ``ScalarWeights``.
    """
    if hasattr(codes_packed, "bits") and hasattr(codes_packed, "group_size"):  # (ScalarSpec, ScalarWeights)
        spec, weights = codes_packed, scales
        codes_packed, scales, zeros, bias = weights.codes, weights.scales, weights.zeros, weights.bias
        bits, group_size, in_features = spec.bits, spec.group_size, spec.in_features
    if bits is None or group_size is None or in_features is None:
        raise TypeError("prepare_scalar needs bits, group_size and in_features")
    return _ext().prepare_scalar(codes_packed, scales, zeros, bias, int(bits), int(group_size), int(in_features))


def scalar_linear(x: torch.Tensor, prepared) -> torch.Tensor:  # noqa: ANN001
    """x [..., in] -> y [..., out] (x.dtype) for a layer from ``prepare_scalar``."""
    return prepared(x)


ACT_MODES = {"token": 0, "token_asym": 1, "tensor": 2}


def act_quant(x: torch.Tensor, granularity: str, bits: int, scale: float = 0.0) -> torch.Tensor:
    """Fake-quantize ``x`` [..., features] (CPU, bf16 or fp32; other float dtypes via fp32) in one C++ pass:
    the values ``vptq_core.quant.act_quant.quantize_activations`` gives, without autograd. ``granularity``
    "token" / "token_asym" (per row of the last dimension) or "tensor" (the static step ``scale`` > 0)."""
    if granularity not in ACT_MODES:
        raise ValueError(f"granularity must be one of {sorted(ACT_MODES)}, got {granularity!r}")
    return _ext().act_quant(x, ACT_MODES[granularity], int(bits), float(scale))


def decoder_ops() -> Any:
    """The extension module's decoder-step operations (``rms_norm``, ``silu_mul``, ``attend``; see
    ``vptq_core.quant.lean_decoder``), or raise RuntimeError with the reason. A build in progress is waited for as
    the layers wait for it (``status``: at most ``VPTQ_NATIVE_WAIT`` seconds)."""
    usable, reason = status()
    if not usable:
        raise RuntimeError(reason)
    return _ext()
