"""Block weights read from disk when the pipeline reaches the block: bounded memory for any model size.

A model too large to hold is built as a skeleton on the meta device (no memory), its non-block tensors
(embeddings, LM head, final norm) are loaded, and the decoder blocks stay on meta. The pipeline asks a
``BlockWeights`` to materialise block ``b`` (fp32, on the work device) just before quantizing it and to
release it afterwards, so one block is resident at a time whatever the number of blocks.

``SafetensorsWeights`` reads a Hugging Face safetensors checkpoint, one file (``model.safetensors``) or
sharded (``model.safetensors.index.json`` + shards), one tensor at a time with ``safetensors.safe_open``.
The files are opened for one group of reads (a block) and closed right after: a file kept open keeps the
pages it has read mapped, and they would count in the process's resident memory for the rest of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class BlockWeights(Protocol):
    """What the pipeline needs from a weight source when the model's blocks live on the meta device."""

    def load_block(self, block: nn.Module, prefix: str, device: torch.device, dtype: torch.dtype) -> None:
        """Materialise every meta tensor of ``block`` (state-dict names ``prefix.<name>``) on ``device``,
        floating tensors in ``dtype``."""

    def release_block(self, block: nn.Module) -> None:
        """Free the block's tensors (back to the meta device)."""


def _module_tensors(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor, bool]]:
    """(state-dict name, owning module, attribute, tensor, is_parameter) of every parameter and persistent
    buffer, shared tensors once."""
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        non_persistent = getattr(mod, "_non_persistent_buffers_set", set())
        for attr, tensor in [*((a, p) for a, p in mod._parameters.items()),
                             *((a, b) for a, b in mod._buffers.items() if a not in non_persistent)]:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            is_param = attr in mod._parameters
            yield (f"{mod_name}.{attr}" if mod_name else attr), mod, attr, tensor, is_param


class SafetensorsWeights:
    """The tensors of a safetensors checkpoint directory (single file or sharded), read lazily.

    ``keys()`` lists every stored tensor; ``reading()`` opens the files for a group of reads; ``fill(module,
    ...)`` materialises a module's meta tensors from the file; ``fingerprint()`` identifies the files (name,
    size, modification time) so a resumed run can tell the model changed.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        root = Path(path)
        if root.is_file():
            self.root, files = root.parent, {root.name: None}
            self._weight_map = self._read_keys([root])
        elif (root / INDEX_NAME).is_file():
            self.root = root
            try:
                index = json.loads((root / INDEX_NAME).read_text(encoding="utf-8"))
                weight_map = index["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{root / INDEX_NAME}: cannot read the shard index ({exc})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{root / INDEX_NAME}: weight_map must map tensor names to file names")
            files = dict.fromkeys(sorted(set(weight_map.values())))
            missing = [f for f in files if not (root / f).is_file()]
            if missing:
                raise ValueError(f"{root / INDEX_NAME}: shard files missing: {missing[:4]}")
            stored = self._read_keys([root / f for f in files])
            absent = sorted(k for k, f in weight_map.items() if stored.get(k) != f)
            if absent:
                raise ValueError(f"{root / INDEX_NAME}: tensors not in the shards the index names: {absent[:4]}")
            self._weight_map = stored
        elif (root / SINGLE_NAME).is_file():
            self.root, files = root, {SINGLE_NAME: None}
            self._weight_map = self._read_keys([root / SINGLE_NAME])
        else:
            raise ValueError(f"{root}: no {SINGLE_NAME} and no {INDEX_NAME}")
        self.files = list(files)
        self._open: dict[str, object] | None = None

    @staticmethod
    def _read_keys(paths: Iterable[Path]) -> dict[str, str]:
        weight_map: dict[str, str] = {}
        for path in paths:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                        weight_map[key] = path.name
            except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
                raise ValueError(f"{path}: not a valid safetensors file ({exc})") from None
        return weight_map

    def keys(self) -> set[str]:
        return set(self._weight_map)

    def fingerprint(self) -> list[dict]:
        out = []
        for name in self.files:
            st = (self.root / name).stat()
            out.append({"file": name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
        return out

    def stored_dtype(self, name: str) -> str:
        with self.reading():
            return self._handle(name).get_slice(name).get_dtype()

    @contextlib.contextmanager
    def reading(self) -> Iterator[SafetensorsWeights]:
        """Keep the files open for the reads inside the ``with`` (nested uses share one opening)."""
        if self._open is not None:
            yield self
            return
        self._open = {}
        try:
            yield self
        finally:
            handles, self._open = self._open, None
            for handle in handles.values():
                handle.__exit__(None, None, None)

    def _handle(self, name: str):
        if name not in self._weight_map:
            raise KeyError(name)
        file = self._weight_map[name]
        if self._open is None:
            raise RuntimeError("SafetensorsWeights reads happen inside `with weights.reading():`")
        if file not in self._open:
            handle = safe_open(str(self.root / file), framework="pt", device="cpu")
            self._open[file] = handle.__enter__()
        return self._open[file]

    def get(self, name: str) -> torch.Tensor:
        """One tensor as stored (CPU, stored dtype)."""
        with self.reading():
            try:
                return self._handle(name).get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise ValueError(f"{self.root / self._weight_map[name]}: cannot read tensor {name!r} ({exc})") from None

    def fill(self, module: nn.Module, prefix: str, device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None, skip: Iterable[str] = ()) -> int:
        """Materialise the meta tensors of ``module`` (names ``prefix.<name>``; ``prefix`` "" for a whole model)
        from the file, floating ones cast to ``dtype`` (default: as stored), on ``device``. Names starting with
        one of ``skip`` stay on meta. Returns the number of tensors read; ValueError for a missing tensor or a
        shape that differs from the module's."""
        skip = tuple(skip)
        count = 0
        with self.reading():
            for name, mod, attr, tensor, is_param in list(_module_tensors(module)):
                if not tensor.is_meta:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                if skip and full.startswith(skip):
                    continue
                if full not in self._weight_map:
                    raise ValueError(f"{self.root}: no tensor {full!r} in the checkpoint")
                value = self.get(full)
                if tuple(value.shape) != tuple(tensor.shape):
                    raise ValueError(f"{self.root}: tensor {full!r} has shape {tuple(value.shape)}, the model "
                                     f"expects {tuple(tensor.shape)}")
                target = dtype if (dtype is not None and value.is_floating_point()) else value.dtype
                value = value.to(device=device, dtype=target)
                if is_param:
                    mod._parameters[attr] = nn.Parameter(value, requires_grad=tensor.requires_grad)
                else:
                    mod._buffers[attr] = value
                count += 1
        return count

    # BlockWeights
    def load_block(self, block: nn.Module, prefix: str, device: torch.device, dtype: torch.dtype) -> None:
        self.fill(block, prefix, device, dtype)

    def release_block(self, block: nn.Module) -> None:
        release(block)


def release(module: nn.Module, names: Iterable[str] | None = None) -> None:
    """Put the parameters and persistent buffers of ``module`` (or only of its submodules ``names``) on the
    meta device, freeing their memory."""
    targets = [module] if names is None else [module.get_submodule(n) for n in names]
    for target in targets:
        for _name, mod, attr, tensor, is_param in list(_module_tensors(target)):
            if tensor.is_meta:
                continue
            empty = torch.empty_like(tensor, device="meta")
            if is_param:
                mod._parameters[attr] = nn.Parameter(empty, requires_grad=tensor.requires_grad)
            else:
                mod._buffers[attr] = empty


def meta_tensors(module: nn.Module) -> list[str]:
    """State-dict names of the tensors of ``module`` still on the meta device."""
    return [name for name, _m, _a, tensor, _p in _module_tensors(module) if tensor.is_meta]
