"""With several ranks (``quant.distributed``): what training or measurement produces is computed once, by rank 0,
and sent to the others; and a stop asked on any rank reaches every rank.

Why: on CUDA, backward passes (and some reductions) are not bit-reproducible, so ranks that each trained the same
block, measured the same plan or distilled the same model would drift apart, and the checkpoint rank 0 writes would
not be the quantized model the other ranks carried on with. So the calibration the model writes itself, the bit
plan, every after-block step (layer-wise fine-tuning, activation scales), a block trained whole (LRQ) and every
after-model step (distillation) run on rank 0 alone inside ``once``; the others wait, then receive the result (the
block's or model's tensors in place, the layer states, the metrics) bit for bit, and rank 0's random generators as
its computation left them, so later draws agree on every rank as in one process.

Stops: ``shared_stop`` wraps a rank's own ``should_stop`` so that a stop asked on any rank is written to the
process group's key-value store (torchrun's rendezvous store, which every rank reaches without a collective) and
seen by every rank at its next poll. Rank 0 polls it between its training steps; a rank waiting in ``once`` polls
its own ``should_stop`` and the store every ``POLL_S`` seconds. Where ranks must take the same branch at the same
point (between blocks), they agree with a collective (``distributed.any_rank``); inside ``once`` rank 0's result
(stopped or not) is what every rank gets, so no rank goes on while another has stopped.

Without splitting (one process) everything here calls straight through.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from . import distributed
from .methods import Cancelled

T = TypeVar("T")
POLL_S = 0.05  # how often a waiting rank polls its own stop and rank 0's progress
TELL_S = 30.0  # how long rank 0 waits for the others to read that it stopped or failed
_calls = itertools.count()  # every rank makes the same calls in the same order: the n-th call's keys match
_KEY = "vptq_core/once"


def _store():
    return dist.distributed_c10d._get_default_store()


def shared_stop(should_stop: Callable[[], bool]) -> Callable[[], bool]:
    """``should_stop`` that is true on every rank once it was true on any (not a collective: call it as often as
    each rank likes). One per run: the key it shares is the run's own."""
    if not distributed.active():
        return should_stop
    key = f"{_KEY}/stop/{next(_calls)}"
    store = _store()
    seen = [False]

    def stop() -> bool:
        if seen[0]:
            return True
        if should_stop():
            store.set(key, "1")
            seen[0] = True
        elif store.check([key]):
            seen[0] = True
        return seen[0]

    return stop


def once(tag: str, compute: Callable[[], T], should_stop: Callable[[], bool], device: str | torch.device,
         modules: tuple[nn.Module, ...] = (), apply: Callable[[T], None] | None = None) -> T:
    """``compute()`` on rank 0, its value on every rank: a collective (every rank calls it at the same point).

    ``value`` may hold tensors, dataclasses, dicts, lists and numbers (``distributed.exchange``'s kinds: this
    rank's work ``device`` receives those not on the host); the
    parameters and buffers of ``modules`` (which ``compute`` changes in place on rank 0) are sent into the same
    tensors on the other ranks; ``apply(value)`` then runs on those ranks for the side effects ``compute`` had on
    rank 0 (e.g. publishing layer states). ``Cancelled`` raised on rank 0 is raised on every rank; another
    error on rank 0 raises it there and a RuntimeError naming ``tag`` on the others. ``should_stop`` (the run's
    ``shared_stop``) is polled while a rank waits, so a stop asked there reaches rank 0."""
    if not distributed.active():
        return compute()
    store = _store()
    done = f"{_KEY}/{tag}/{next(_calls)}"
    if distributed.rank() == 0:
        try:
            value = compute()
        except Cancelled:
            _tell_and_wait(store, done, "cancelled")
            raise
        except BaseException as exc:
            _tell_and_wait(store, done, f"failed: {type(exc).__name__}")
            raise
        store.set(done, "ok")
        share((value, _rng_states()), device)
        for module in modules:
            share_module(module)
        return value
    try:
        while not store.check([done]):
            should_stop()  # a stop asked here is written for rank 0 to see
            time.sleep(POLL_S)
        status = store.get(done).decode()
        if status != "ok":
            store.add(f"{done}/seen", 1)  # rank 0 may end now: its store goes with it
    except dist.DistError as exc:  # the store is rank 0's: it went away without a word
        raise RuntimeError(f"rank 0 ended during {tag} without a result ({type(exc).__name__}); its output says "
                           "why") from None
    if status == "cancelled":
        raise Cancelled
    if status != "ok":
        raise RuntimeError(f"rank 0 failed during {tag} ({status.removeprefix('failed: ')}); its output says why")
    value, rng = share(None, device)
    _set_rng_states(rng)  # rank 0's generators as its computation left them: later draws agree on every rank
    if apply is not None:
        apply(value)
    for module in modules:  # after ``apply``: the modules end exactly as rank 0 left them
        share_module(module)
    return value


def _tell_and_wait(store, key: str, status: str) -> None:
    """Rank 0 ends ``once`` without a result: say so, then wait (at most ``TELL_S``) until every other rank has read
    it, since the store lives in rank 0's process and goes when it ends."""
    store.set(key, status)
    deadline = time.monotonic() + TELL_S
    while store.add(f"{key}/seen", 0) < distributed.world_size() - 1 and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def share(value, device: str | torch.device, src: int = 0):
    """Rank ``src``'s ``value`` on every rank (a collective; the others pass anything): the structure pickled
    (our own ranks, running the same code), every tensor sent as bytes, one at a time (no second copy of a large
    result), each onto this rank's ``device`` or the host, where it was at ``src``."""
    if not distributed.active():
        return value
    comm = distributed._comm_device()
    if distributed.rank() == src:
        tensors: list[torch.Tensor] = []
        skeleton = distributed._strip(value, tensors)
        dist.broadcast_object_list([skeleton], src=src)
        for t in tensors:
            _send(t, comm, src)
        return value
    box: list = [None]
    dist.broadcast_object_list(box, src=src)
    tensors = [_receive(slot, comm, src).to("cpu" if slot.on_host else device)
               for slot in distributed._slots(box[0], [])]
    return distributed._fill(box[0], tensors)


def share_module(module: nn.Module, src: int = 0) -> None:
    """Rank ``src``'s parameters and buffers of ``module`` copied into the other ranks' (same structure), in place:
    tied tensors once."""
    if not distributed.active():
        return
    comm = distributed._comm_device()
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in module.state_dict(keep_vars=True).values():
            data = tensor.data if isinstance(tensor, nn.Parameter) else tensor
            if data.data_ptr() in seen or data.numel() == 0:
                continue
            seen.add(data.data_ptr())
            if data.device == comm and data.is_contiguous():
                dist.broadcast(data.reshape(-1).view(torch.uint8), src=src)
            else:
                staged = data.to(comm).contiguous()
                dist.broadcast(staged.reshape(-1).view(torch.uint8), src=src)
                data.copy_(staged)


def _send(tensor: torch.Tensor, comm: torch.device, src: int) -> None:
    data = tensor.detach().to(comm).contiguous().reshape(-1)
    if data.numel():
        dist.broadcast(data.view(torch.uint8), src=src)


def _receive(slot, comm: torch.device, src: int) -> torch.Tensor:
    out = torch.empty(slot.shape, dtype=slot.dtype, device=comm)
    if out.numel():
        dist.broadcast(out.reshape(-1).view(torch.uint8), src=src)
    return out
