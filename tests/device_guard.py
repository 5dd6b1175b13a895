"""A device-mismatch guard for tests: every aten operator's tensor arguments are checked to lie on one device,
the rule CUDA enforces, whatever the operator's CPU kernel would accept.

``with DeviceGuard() as guard: ...`` raises ``RuntimeError`` naming the operator and the devices at the first
operator that mixes devices; ``guard.checked`` counts the operators it saw (a test asserts it saw some). As on
CUDA, 0-dim CPU tensors (scalars), CPU index tensors of indexing operators and copies between devices are allowed.
Under ``emulated_device.EmulatedDevice`` the emulated tensors report the ``meta`` device, so a CPU-only machine
checks the same rule on every operator (the guard runs before the emulated device unwraps them, and also sees the
operators that composite C++ functions issue).
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
_COPIES = {aten._to_copy.default, aten.copy_.default, aten.copy.default, aten.to.device, aten.to.dtype_layout,
           aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.detach.default, aten.alias.default}
_INDEX = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class DeviceGuard(TorchDispatchMode):
    """Raise at any operator whose tensor arguments lie on more than one device (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = 0
        self.by_device: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _COPIES:
            self.checked += 1
            skip = {id(t) for t in args[1] if isinstance(t, torch.Tensor)} if func in _INDEX else set()
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and id(t) not in skip]
            devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
            if len(devices) > 1:
                raise RuntimeError(f"{func}: tensors on {sorted(str(d) for d in devices)} in one operation")
            for d in devices:
                self.by_device[d.type] += 1
        return func(*args, **kwargs)
