"""An emulated accelerator for tests on machines without one: tensors that report a non-CPU device but hold
real CPU data, so code can run end to end while the rules of a real accelerator are enforced and counted.

Inside ``EmulatedDevice()`` (a context manager) tensors created with ``device=DEVICE`` or moved there with
``.to(DEVICE)`` are ``DeviceTensor`` wrappers; every operation on them runs on the wrapped CPU tensors (the
very same CPU kernels, so results are bitwise those of a CPU run) and

- mixing them with CPU tensors of one or more dimensions raises, as CUDA does (0-dim CPU scalars and CPU
  index tensors are allowed, as on CUDA; the latter are counted as host-to-device copies);
- ``.item()``, ``float(t)``, ``bool(t)``, ``torch.equal``, ``nonzero``, boolean-mask indexing and other
  operations that make a CUDA device wait for the host are counted in ``syncs`` (by operator);
- copies to the host (``.cpu()``, ``.to("cpu")``, ``.numpy()`` refuses outright) are counted in ``to_host``
  and copies from it in ``to_device``.

The emulated device reports itself as ``meta`` (the one non-CPU device type that every PyTorch build
accepts, and that transformers' autocast helper leaves alone); real meta tensors are not used meanwhile.
"""

from __future__ import annotations

import collections
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _device as torch_device_context
from torch.utils._pytree import tree_flatten, tree_unflatten

DEVICE = torch.device("meta")
_CPU = torch.device("cpu")
aten = torch.ops.aten

# Operators that make a CUDA device synchronise with the host (their result's size or value is needed there).
_SYNC_OPS = {
    aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default, aten.masked_select.default,
    aten.is_nonzero.default, aten.unique_dim.default, aten._unique2.default, aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
# CPU tensors allowed as arguments beside device tensors (CUDA moves the indices itself).
_INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class DeviceTensor(torch.Tensor):
    """A tensor on the emulated device; ``inner`` is the CPU tensor holding its data."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=DEVICE, requires_grad=inner.requires_grad,
        )
        out.inner = inner
        return out

    def __repr__(self, *, tensor_contents=None):  # noqa: D105 - printing must not count as a host copy
        return f"DeviceTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    def data_ptr(self) -> int:  # the wrapped data's address (callers compare addresses to find shared inputs)
        return self.inner.data_ptr()

    @property
    def data(self):  # noqa: D102 - what torch.Tensor.data gives: an alias outside autograd
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:  # ``param.data = t`` swaps the storage: the wrapped tensor too
        torch._C.TensorBase.data.__set__(self, value)
        self.inner = value.inner if isinstance(value, DeviceTensor) else value

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert an (emulated) device tensor to numpy; copy it to the host first")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _active().dispatch(func, args, kwargs or {})


def _building_on_meta() -> bool:
    """Called from ``with torch.device("meta")`` (a model built for its shapes): the emulated device shares the meta
    type, so a factory call there must stay a real meta tensor, as it would beside a real device. The context's mode
    (``DeviceContext``) calls into this one; its frame is a few Python frames up."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code is _DEVICE_CONTEXT_CODE:
            return torch.device(frame.f_locals["self"].device).type == "meta"
    return False


_DEVICE_CONTEXT_CODE = torch_device_context.DeviceContext.__torch_function__.__code__


def _is_device(device) -> bool:
    if device is None:
        return False
    try:
        return torch.device(device) == DEVICE
    except (TypeError, RuntimeError):
        return False


_STACK: list[EmulatedDevice] = []


def _caller() -> str:
    """The innermost frame in the package's own code (vptq_core/ or kernels/), as "path:line"."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        for root in ("/vptq_core/", "/kernels/"):
            if root in name:
                return name[name.rindex(root) + 1 :] + f":{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _active() -> EmulatedDevice:
    if not _STACK:
        raise RuntimeError("a DeviceTensor was used outside its EmulatedDevice() context")
    return _STACK[-1]


class EmulatedDevice(TorchFunctionMode):
    """``with EmulatedDevice() as emu: ...`` -> ``emu.syncs`` (Counter by operator), ``emu.to_host``,
    ``emu.to_device`` (counts of copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: collections.Counter = collections.Counter()
        self.to_host = 0
        self.to_device = 0
        self.where: collections.Counter = collections.Counter()  # (what, "file:line" in vptq_core/kernels) -> count

    def _count(self, what: str) -> None:
        setattr(self, what, getattr(self, what) + 1)
        self.where[(what, _caller())] += 1

    def _count_sync(self, op: str) -> None:
        self.syncs[op] += 1
        self.where[(f"sync:{op}", _caller())] += 1

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    def __enter__(self):
        _STACK.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _STACK.pop()

    # ---------------------------------------------------------------------------------- torch functions
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda) and args and not isinstance(args[0], DeviceTensor):
            if func is torch.Tensor.to:
                device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            else:
                device, dtype, memory_format = DEVICE, None, torch.preserve_format
            if _is_device(device) and not _building_on_meta():
                self._count("to_device")
                moved = args[0].to(dtype=dtype or args[0].dtype, copy=True,
                                   memory_format=memory_format or torch.preserve_format)
                return DeviceTensor(moved.detach().requires_grad_(args[0].requires_grad))
        if func is torch.Tensor.tolist and isinstance(args[0], DeviceTensor):  # C++ refuses subclasses here
            self._count("to_host")
            self._count_sync("tolist")
            return args[0].inner.tolist()
        on_device = any(isinstance(a, DeviceTensor) for a in tree_flatten((args, kwargs))[0])
        if func is torch.where and len(args) == 3 and on_device:
            # where(c, t, 1.0) wraps the number into a tensor on the (real) meta device in C++: give it a CPU one
            args = tuple(torch.tensor(a) if isinstance(a, (int, float, bool)) else a for a in args)
        if func is torch.Tensor.__setitem__ and isinstance(args[0], DeviceTensor) and isinstance(
                args[2], (int, float, bool)):  # t[i] = 1.0: the same
            args = (args[0], args[1], torch.tensor(args[2], dtype=args[0].dtype))
        if not on_device and _is_device(kwargs.get("device")) and _building_on_meta():
            return func(*args, **kwargs)  # ``with torch.device("meta")``: shapes only, as under a real device
        if not on_device and _is_device(kwargs.get("device")):  # a factory function asked for the device
            kwargs["device"] = _CPU
            return self._wrap(func(*args, **kwargs), {})
        return func(*args, **kwargs)

    # ---------------------------------------------------------------------------------- aten operators
    def dispatch(self, func, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        inner_of: dict[int, DeviceTensor] = {}
        unwrapped = []
        for a in flat:
            if isinstance(a, DeviceTensor):
                inner_of[id(a.inner)] = a
                unwrapped.append(a.inner)
            elif _is_device(a):
                unwrapped.append(_CPU)
            else:
                unwrapped.append(a)
        plain = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, DeviceTensor)]
        if any(t.device.type == "meta" for t in plain):
            raise RuntimeError(f"{func}: a real meta tensor (a number that C++ wrapped on the emulated device's type?) "
                               "reached the emulated device; its value is lost")
        if func in _SYNC_OPS or (func is aten.index.Tensor and any(
                t is not None and t.dtype == torch.bool for t in args[1])):
            self._count_sync(str(func.overloadpacket.__name__))
        to_host = False
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == "cpu":
                to_host = True
                self._count("to_host")
        elif func in (aten.copy_.default, aten.copy.default):  # copies between devices are allowed (and counted)
            dst, src = args[0], args[1]
            if isinstance(dst, DeviceTensor) and not isinstance(src, DeviceTensor) and src.dim() > 0:
                self._count("to_device")
                plain = []
            elif not isinstance(dst, DeviceTensor) and isinstance(src, DeviceTensor):
                self._count("to_host")
                self._count_sync("copy_to_host")
                plain = []
        elif func in _INDEX_OPS and plain and isinstance(args[0], DeviceTensor):
            indices = [t for t in args[1] if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor)]
            if indices:
                self._count("to_device")
            plain = [t for t in plain if all(t is not i for i in indices)]
        bad = [t for t in plain if t.dim() > 0]
        if inner_of and bad:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE} (emulated) "
                f"and cpu! ({func}, CPU tensor of shape {tuple(bad[0].shape)})"
            )
        a2, k2 = tree_unflatten(unwrapped, spec)
        with torch._C.DisableTorchFunction():  # the CPU kernels (and Python decompositions) run on plain tensors
            out = func(*a2, **k2)
        if to_host:
            return out
        return self._wrap(out, inner_of)

    def _wrap(self, out, inner_of: dict[int, DeviceTensor]):
        flat, spec = tree_flatten(out)
        wrapped = []
        # Wrappers made under inference mode would be inference tensors, and a view of a normal tensor (e.g.
        # ``buffer[:, i] = token`` into a buffer made before inference mode) then fails where CUDA does not.
        with torch.inference_mode(False):
            for o in flat:
                if isinstance(o, torch.Tensor) and not isinstance(o, DeviceTensor):
                    same = inner_of.get(id(o))
                    o = DeviceTensor(o) if same is None else same
                wrapped.append(o)
        return tree_unflatten(wrapped, spec)


def to_host(t):
    """The CPU tensor of a device tensor (not counted: for the test's own checks); others unchanged."""
    return t.inner.clone() if isinstance(t, DeviceTensor) else t
