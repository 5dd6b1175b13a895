"""Empty models to load weights into, built without touching anything another thread can see.

A served process loads checkpoints while other requests run jobs and chats, so a load must not change what
they see. The usual tools do: ``accelerate.init_empty_weights`` patches ``nn.Module.register_parameter`` for
the whole process (a thread building its own model meanwhile gets parameters on meta, and two overlapping
patches can leave it in place for good), transformers' ``no_init_weights`` patches ``torch.nn.init``, and
``from_config(dtype=...)`` / ``from_pretrained(dtype=...)`` call ``torch.set_default_dtype``, which is
process-wide: a job creating a tensor meanwhile gets the other model's dtype.

``empty_model`` builds under ``torch.device("meta")``, a torch function mode, which is thread-local; the
model is built in float32 (transformers leaves the default dtype alone when the config names none) and its
parameters are cast on meta, which costs nothing. The non-persistent buffers (rotary frequencies, embedding
scales), which no checkpoint stores, are then computed on the CPU by the model's own ``_init_weights``.

``pretrained_lock`` serialises the remaining calls of transformers' ``from_pretrained`` (a GGUF conversion, a
hub model, directories whose names differ from the model's): it patches ``torch.linspace`` while it builds,
and two overlapping patches could leave it patched. Those calls always pass ``dtype=torch.float32``, the
default already, so the default dtype never changes.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn
from transformers import AutoModelForCausalLM

pretrained_lock = threading.Lock()


def empty_model(config, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
                buffers: bool = True) -> nn.Module:
    """A causal LM for ``config`` with its parameters on the meta device in ``dtype`` and its non-persistent
    buffers computed on the CPU (left on meta too with ``buffers=False``: shapes only); nothing process-wide
    changes while it is built. Raises ValueError when a buffer cannot be computed (an architecture whose buffers
    ``_init_weights`` does not rebuild)."""
    config = copy.deepcopy(config)
    _clear_dtype(config)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    if buffers:
        _compute_buffers(model)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                module._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
    model.config.dtype = dtype
    return model


def _clear_dtype(config) -> None:
    """No dtype on the config (and its sub-configs): ``from_config`` would make it torch's default dtype."""
    config.dtype = None
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            sub.dtype = None


def _compute_buffers(model: nn.Module) -> None:
    """Fill the non-persistent buffers left on meta by the model's own initialisation (on the CPU)."""
    owners = []
    for module_name, module in model.named_modules():
        names = [n for n in getattr(module, "_non_persistent_buffers_set", ()) if
                 module._buffers.get(n) is not None and module._buffers[n].is_meta]
        for name in names:
            buffer = module._buffers[name]
            where = f"{module_name}.{name}" if module_name else name
            if not buffer.is_floating_point():
                raise ValueError(f"cannot build buffer {where!r} ({buffer.dtype}, shape {tuple(buffer.shape)}) "
                                 "outside the model's own constructor")
            module._buffers[name] = torch.full_like(buffer, float("nan"), device="cpu")
        if names:
            owners.append((module_name, module, names))
    init = getattr(model, "_init_weights", None)
    for module_name, module, names in owners:
        if init is not None:
            init(module)
        for name in names:
            if bool(torch.isnan(module._buffers[name]).any()):
                where = f"{module_name}.{name}" if module_name else name
                raise ValueError(f"cannot build buffer {where!r}: the model's initialisation does not compute it")
