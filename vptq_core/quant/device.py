"""Where quantization runs: device choice, exact float32 matmuls, the nearest-centroid search backend, and
moving layer states between devices.

Every phase of the pipeline follows the device of its inputs (Hessians, inverse Hessians, k-means, the
nearest-centroid search, the error-feedback sweep, fine-tuning, LRQ): nothing is moved to the host per column.
Random draws (k-means initialisation and subsamples, fine-tuning and LRQ batches) come from CPU generators
and only the drawn indices are moved, so a CUDA run draws exactly what a CPU run draws and the two agree up
to float rounding.

``VPTQ_NEAREST=torch`` makes the nearest-centroid search use the chunked torch matmul path on the CPU too
(the path CUDA always takes), instead of scipy's k-d tree or the numba kernel: for tests and comparisons.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch

NEAREST_ENV = "VPTQ_NEAREST"
NEAREST_BACKENDS = ("auto", "torch", "native", "kdtree", "numba")


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None`` / "auto" -> "cuda" when available, else "cpu"; anything else as a ``torch.device``."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` multiplies bf16 in hardware: CUDA with bf16 support, or a CPU with AVX-512 BF16 or AMX.
    Elsewhere (AVX2-only CPUs, e.g. most laptops) torch emulates bf16 matmuls by widening every operand, and
    float32 is much the faster dtype (``bench/distill_step.py`` compares them)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) and _onednn_allows_bf16()


# oneDNN's ISA names (``$ONEDNN_MAX_CPU_ISA``) that include bf16 products; a lower limit makes bf16 emulated
_ONEDNN_BF16_ISAS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10_1_512")


def _onednn_allows_bf16() -> bool:
    """False when ``$ONEDNN_MAX_CPU_ISA`` holds oneDNN (torch's CPU bf16 products) below bf16 instructions."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return not isa or isa.startswith(_ONEDNN_BF16_ISAS)


WIDEN_CHUNK = 16 << 20  # weight elements widened to float32 at a time by ``widened_linears`` (an LM head in rows)


@contextlib.contextmanager
def widened_linears(model: torch.nn.Module):
    """Inside, the bf16 / fp16 ``nn.Linear`` layers of ``model`` multiply in float32 when its device does not multiply
    bf16 in hardware (``native_bf16``): torch there widens every operand of a bf16 product on the fly, several times
    slower than float32 products (the teacher pass of a bf16 SmolLM2 with oneDNN held to AVX2: 4.42 s a window
    against 0.82 s widened, bench/results/pass_cost_spr.txt). Each output comes back in its input's dtype; a
    weight's float32 copy lives only for its own product, ``WIDEN_CHUNK`` elements at a time (an LM head in row
    chunks). Elsewhere, and for float32 layers, nothing changes."""
    param = next(model.parameters(), None)
    if param is None or native_bf16(param.device):
        yield
        return
    patched = [m for m in model.modules() if type(m) is torch.nn.Linear
               and m.weight.dtype in (torch.bfloat16, torch.float16)]
    for module in patched:
        module.forward = functools.partial(_widened_linear, module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _widened_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    x32 = x.float()
    rows = max(1, WIDEN_CHUNK // max(weight.shape[1], 1))
    parts = [torch.nn.functional.linear(x32, weight[i : i + rows].float(),
                                        None if bias is None else bias[i : i + rows].float())
             for i in range(0, weight.shape[0], rows)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(x.dtype)


def compute_dtype(choice: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype a setting names: "bfloat16", "float32", or "auto" = bf16 where ``device`` multiplies it in
    hardware (``native_bf16``), else float32."""
    if choice == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if choice == "bfloat16":
        return torch.bfloat16
    if choice == "float32":
        return torch.float32
    raise ValueError(f"dtype must be 'auto', 'bfloat16' or 'float32', got {choice!r}")


def nearest_backend(requested: str | None = None) -> str:
    """The search backend asked for: ``requested``, else ``$VPTQ_NEAREST``, else "auto" (ValueError otherwise)."""
    value = requested if requested is not None else (os.environ.get(NEAREST_ENV) or "auto")
    value = value.strip().lower()
    if value not in NEAREST_BACKENDS:
        source = "backend" if requested is not None else f"${NEAREST_ENV}"
        raise ValueError(f"{source} must be one of {', '.join(NEAREST_BACKENDS)}, got {value!r}")
    return value


@contextlib.contextmanager
def exact_float32():
    """Full float32 matmuls inside (no TF32 / bf16 shortcuts, whatever the caller enabled globally), restored
    after. The Hessians, distances and error updates need full precision: with TF32 a nearest-centroid search
    picks other centroids than on the CPU, and ``H`` loses the small eigenvalues its inverse depends on."""
    before = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    if before == "highest" and not cudnn:
        yield
        return
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = cudnn


def tensors_to(obj, device: str | torch.device, non_blocking: bool = False):
    """A copy of ``obj`` (a layer state or any dataclass, dict, list, tuple) with every tensor on ``device``
    (tensors already there are kept, not copied). Dataclasses are rebuilt without running ``__init__``."""
    device = torch.device(device)
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = object.__new__(type(obj))
        out.__dict__.update(obj.__dict__)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, tensors_to(getattr(obj, f.name), device, non_blocking))
        return out
    if isinstance(obj, dict):
        return {k: tensors_to(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(tensors_to(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors_to(v, device, non_blocking) for v in obj)
    return obj


_LIBC = None


def _libc():
    """glibc through ctypes, or False where there is none (another C library, another system)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def return_freed_memory() -> bool:
    """Give the heap pages freed since the last call back to the operating system (glibc ``malloc_trim``).

    The pipeline frees a block's float32 weights, Hessians and activations after every block; glibc keeps much of
    that memory in its arenas (allocations under its mmap threshold come from the heap: 16 MB in a run,
    ``map_large_allocations``; glibc's own rises up to 32 MB), so a streamed run's resident set would creep up
    block after block. Returns False where there is no glibc."""
    libc = _libc()
    if not libc:
        return False
    libc.malloc_trim(0)
    return True


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
# Allocations from this size on get mappings of their own while a run quantizes (``map_large_allocations``).
LARGE_ALLOCATION_BYTES = 16 << 20


def map_large_allocations(nbytes: int = LARGE_ALLOCATION_BYTES) -> bool:
    """Serve every allocation of at least ``nbytes`` with a memory mapping of its own (glibc
    ``mallopt(M_MMAP_THRESHOLD)``), which goes back to the system the moment it is freed.

    glibc's threshold starts at 128 KB and rises with every larger block freed, up to 32 MB, after which a run's
    float32 weights, gradients and activations below 32 MB all come from the heap, where the freed space is
    fragmented by what stays and remains resident (``malloc_trim`` can only give back whole free pages). Fixing
    the threshold trades that for page faults on every large allocation: measured on the 0.5B shape in
    bench/results/stage_memory_spr.txt. Process-wide and lasting; False where there is no glibc."""
    libc = _libc()
    if not libc:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)))


MADV_DONTNEED = 4  # Linux madvise advice: the pages' contents may go (a private file mapping reads the file again)


def drop_pages(storage: torch.UntypedStorage) -> int:
    """Give the whole memory pages inside a CPU ``storage`` back to the system now (``madvise(MADV_DONTNEED)``);
    returns the bytes given back (0 where there is no libc, or nothing to give).

    For a storage about to be let go whose memory would otherwise stay: a model loaded from safetensors holds its
    tensors in one private mapping of the file, which stays while any of them lives, so a weight written over (its
    pages copied on write) or read (its file pages mapped) keeps its pages in the resident set after the tensor is
    gone. Only for a storage nothing else uses: its contents are lost (a file mapping's pages read the file again,
    anonymous ones read zeros). The pages it shares with its neighbours at either end are left alone."""
    if storage.device.type != "cpu" or storage.nbytes() == 0:
        return 0
    libc = _libc()
    if not libc or not hasattr(libc, "madvise"):
        return 0
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = -(-storage.data_ptr() // page) * page
    end = (storage.data_ptr() + storage.nbytes()) // page * page
    if end <= start:
        return 0
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) != 0:
        return 0
    return end - start


def held_alone(storage: torch.UntypedStorage) -> bool:
    """``storage`` is held by this reference alone: no tensor reads its memory (False when torch cannot say)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(storage._cdata) == 1


def drop_unheld(storages: list[torch.UntypedStorage]) -> int:
    """``drop_pages`` for each of ``storages`` that no tensor holds any more (each held by this list alone), then
    the list emptied: for the storages a module's tensors had before a move (``module.to``) replaced them. A model
    loaded from safetensors keeps every tensor's pages in the file's mapping while any tensor of the file lives, so a
    replaced weight would otherwise stay in the resident set. Returns the bytes given back."""
    freed = 0
    while storages:
        storage = storages.pop()
        if held_alone(storage):
            freed += drop_pages(storage)
        del storage
    return freed
