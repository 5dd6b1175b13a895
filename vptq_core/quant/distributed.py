"""Quantizing on several processes (one per GPU, or CPU processes) with ``torch.distributed``.

Every rank runs the same block loop on the same calibration data, so every rank holds the same block inputs,
Hessians and targets (the pipeline is deterministic for a fixed seed and thread count). Inside a block the
linears are split across the ranks (``assign``: balanced by weight count); each rank quantizes its share;
then ``exchange`` gives every rank every linear's result (layer state, dequantized weight, metrics) before
the block's outputs are computed, so all ranks go on with identical quantized blocks and end with identical
states. Rank 0 alone should write the checkpoint (``is_main``). What depends on training or measurement (the
self-written calibration, the bit plan, block training, fine-tuning, distillation), which CUDA does not reproduce bit
for bit, is computed by rank 0 alone and sent to the others, and a stop on any rank reaches all of them
(``distributed_once``).

Launch with torchrun, which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``::

    torchrun --nproc-per-node 4 -m vptq_core quantize ...      # (needs the CLI to call init_from_env)

``init_from_env`` joins that process group (gloo for CPU, nccl for CUDA, where each rank takes
``cuda:LOCAL_RANK``) and enables splitting; without those variables, or with ``WORLD_SIZE=1``, it does
nothing and everything here is a no-op. A process group created by someone else is only used for
quantization after ``enable()``: a program that uses torch.distributed for other things and calls
``quantize_model`` on one rank must not find it waiting for the others.

The exchange sends tensors as one byte buffer per rank and block (``broadcast`` from its owner) and the
small metadata (names, shapes, dtypes, floats, dataclass skeletons) with ``all_gather_object``, which
pickles: that is fine between our own ranks, which run the same code; nothing read from a file goes that way.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .device import resolve_device

_enabled = False
_initialised_here = False


def init_from_env(device: str | torch.device | None = None, backend: str | None = None,
                  timeout_s: float = 1800.0) -> torch.device:
    """Join the process group described by torchrun's environment variables and enable splitting; returns
    this rank's work device (``cuda:LOCAL_RANK`` when ``device`` resolves to CUDA). Without
    ``WORLD_SIZE > 1`` it only resolves ``device`` (None / "auto": CUDA when available)."""
    global _initialised_here
    dev = resolve_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return dev
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if dev.type == "cuda" else "gloo"),
                                timeout=timedelta(seconds=timeout_s))
        _initialised_here = True
    enable()
    return dev


def enable() -> None:
    """Split the linears of each block across the ranks of the default process group (already initialised)."""
    global _enabled
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_from_env() or init_process_group()")
    _enabled = True


def disable() -> None:
    global _enabled
    _enabled = False


def shutdown() -> None:
    """Stop splitting; destroy the process group if ``init_from_env`` created it."""
    global _initialised_here
    disable()
    if _initialised_here and dist.is_initialized():
        dist.destroy_process_group()
    _initialised_here = False


def active() -> bool:
    """Quantization is split across more than one rank."""
    return _enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """Rank 0, or the only process: the one that writes files and prints."""
    return rank() == 0


def barrier() -> None:
    if active():
        dist.barrier()


def assign(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Owner rank of each name: the largest first, each to the least loaded rank so far (ties: the lower
    rank, then the earlier name), so the ranks' loads in weights stay within one layer of each other."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    names = list(sizes)
    load = [0] * world
    owner: dict[str, int] = {}
    for name in sorted(names, key=lambda n: -sizes[n]):  # stable: equal sizes keep their order
        r = min(range(world), key=lambda j: (load[j], j))
        owner[name] = r
        load[r] += sizes[name]
    return {name: owner[name] for name in names}


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


OK, STOPPED, FAILED = 0, 1, 2


def agree(status: int) -> int:
    """The largest ``status`` over the ranks (``OK`` < ``STOPPED`` < ``FAILED``): every rank calls it at the same
    point, so a rank that was asked to stop, or failed, stops all of them instead of leaving them waiting."""
    if not active():
        return status
    flag = torch.tensor([status], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any (a collective: every rank must call it)."""
    return agree(STOPPED if flag else OK) != OK


# ----------------------------------------------------------------------------------------------------------
# Exchanging results


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor was: its index in the byte buffer's tensor list, shape, dtype, and whether it was on
    the host (kept there) or on the work device."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_host: bool


def _strip(obj, tensors: list[torch.Tensor]):
    """``obj`` with every tensor replaced by a ``_Slot`` (appended to ``tensors``); dataclasses are copied
    without running ``__init__`` (their checks would refuse the slots)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = object.__new__(type(obj))
        out.__dict__.update(obj.__dict__)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _strip(getattr(obj, f.name), tensors))
        return out
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_strip(v, tensors) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj, tensors: list[torch.Tensor]):
    """The inverse of ``_strip`` (the skeleton is a private copy: it is filled in place)."""
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            object.__setattr__(obj, f.name, _fill(getattr(obj, f.name), tensors))
        return obj
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_fill(v, tensors) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _slots(skeleton, found: list[_Slot]) -> list[_Slot]:
    if isinstance(skeleton, _Slot):
        found.append(skeleton)
    elif dataclasses.is_dataclass(skeleton) and not isinstance(skeleton, type):
        for f in dataclasses.fields(skeleton):
            _slots(getattr(skeleton, f.name), found)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _slots(v, found)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _slots(v, found)
    return found


def _to_bytes(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    parts = [t.contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _from_bytes(buffer: torch.Tensor, slots: list[_Slot], device: torch.device) -> list[torch.Tensor]:
    out, offset = [], 0
    for slot in slots:
        count = 1
        for n in slot.shape:
            count *= n
        nbytes = count * torch.empty(0, dtype=slot.dtype).element_size()
        # clone: a fresh, aligned storage for the dtype view
        tensor = buffer[offset : offset + nbytes].clone().view(slot.dtype).reshape(slot.shape)
        out.append(tensor.to("cpu" if slot.on_host else device))
        offset += nbytes
    return out


def exchange(mine: dict[str, object], device: str | torch.device) -> dict[str, object]:
    """Every rank's ``mine`` (name -> any object of tensors, dataclasses, dicts, lists, numbers), merged on
    every rank, tensors bit for bit on ``device`` (those that were on the host stay there). A collective:
    every rank calls it once per block, with its own share. Without splitting it returns ``mine``."""
    if not active():
        return dict(mine)
    device = torch.device(device)
    comm = _comm_device()
    tensors: list[torch.Tensor] = []
    skeletons = {name: _strip(obj, tensors) for name, obj in mine.items()}
    buffer = _to_bytes(tensors, comm)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (skeletons, buffer.numel()))
    merged: dict[str, object] = {}
    for src, (theirs, nbytes) in enumerate(gathered):
        received = buffer if src == dist.get_rank() else torch.empty(nbytes, dtype=torch.uint8, device=comm)
        if nbytes:
            dist.broadcast(received, src=src)
        if src == dist.get_rank():
            merged.update(mine)  # our own objects as they are (the very tensors, not copies)
            continue
        values = _from_bytes(received, _slots(theirs, []), device)  # slots in the order _strip made them
        for name, skeleton in theirs.items():
            merged[name] = _fill(skeleton, values)
    return merged
