"""Unfinished runs on disk: every finished block is written as it finishes, so an interrupted job resumes.

``<out>/.partial/`` (safetensors + JSON only, never pickle; every file written to a temporary name and
renamed into place, so a kill leaves either the old or the new file)::

    run.json                   the run's fingerprint (model, method, settings, calibration, ...), the number of
                               finished blocks, timings, seconds and bits so far: written last, the commit point
    block-00003.safetensors    block 3's quantized layers, packed as the checkpoint stores them, and its other
                               1-D float tensors (norm weights, biases) as training left them, float32, under
                               ``dense::<full tensor name>``
    block-00003.json           their config_for_layers entries and LayerReports
    inputs-00004.safetensors   the calibration activations entering block 4 (float32), the CPU random state and,
                               with target_chain "fp", the original model's activations there ("fp_hidden")

``run.json`` names ``blocks_done = k``; blocks 0..k-1 and ``inputs-k`` are then complete. A block written
after the last commit is simply written again. When the run finishes, the checkpoint writer reads the
packed layers block by block from here (the layers never all sit in memory) and the directory is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .quant.bits import BitsInfo
from .quant.results import BlockDone, LayerReport, ResumePoint
from .storage.checkpoint import PackedLayer

PARTIAL_DIR = ".partial"
RUN_NAME = "run.json"
FORMAT = 2  # 2: blocks keep their trained 1-D tensors (an older run would come back with the original norms)
_SEP = "::"  # safetensors key = f"{module name}{_SEP}{tensor name}"
_DENSE = "dense"  # safetensors key = f"{_DENSE}{_SEP}{full tensor name}" for a block's trained 1-D tensors


def partial_dir(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / PARTIAL_DIR


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA1 of a tensor's bytes (e.g. the calibration token ids)."""
    data = tensor.detach().cpu().contiguous()
    return hashlib.sha1(data.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _plain(value):
    """JSON for report extras that are tensors or numpy scalars."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _describe_difference(old: Mapping, new: Mapping) -> str:
    """What differs between two fingerprints, in words."""
    parts = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if key == "model" and isinstance(a, dict) and isinstance(b, dict):
            if a.get("source") != b.get("source"):
                parts.append(f"model ({a.get('source')!r} -> {b.get('source')!r})")
            elif a.get("files") != b.get("files"):
                parts.append(f"model (the files of {a.get('source')!r} changed since)")
            else:
                parts.append(f"model (the config of {a.get('source')!r} changed since)")
        elif isinstance(a, dict) and isinstance(b, dict):
            changed = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            parts.append(f"{key} ({'; '.join(changed[:4])}{' ...' if len(changed) > 4 else ''})")
        elif key == "calibration_ids":
            parts.append("calibration data (the token ids differ)")
        else:
            parts.append(f"{key} ({a!r} -> {b!r})")
    return ", ".join(parts) or "nothing"


class PartialRun:
    """The unfinished-run directory of one output directory (see the module docstring)."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.dir = partial_dir(out_dir)

    # ------------------------------------------------------------------------------------------- reading
    def exists(self) -> bool:
        return (self.dir / RUN_NAME).is_file()

    def manifest(self) -> dict:
        path = self.dir / RUN_NAME
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{self.dir}: no unfinished run here") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read ({exc}); remove {self.dir} to start over") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path}: not an unfinished run of this version; remove {self.dir} to start over")
        return data

    def status(self) -> dict | None:
        """{"blocks_done", "blocks_total"} of an unfinished run here, or None."""
        if not self.exists():
            return None
        data = self.manifest()
        return {"blocks_done": data["blocks_done"], "blocks_total": data["blocks_total"]}

    def resume_point(self, fingerprint: dict, blocks_total: int) -> ResumePoint | None:
        """The point to continue from (None when no block was finished); ValueError when the run here was
        started with anything different or its files are damaged."""
        data = self.manifest()
        fingerprint = json.loads(json.dumps(fingerprint))
        if data["fingerprint"] != fingerprint or data["blocks_total"] != blocks_total:
            what = _describe_difference(data["fingerprint"], fingerprint)
            raise ValueError(f"cannot resume the unfinished run in {self.dir}: it was started with a different "
                             f"{what}; rerun with the same model, method, settings and calibration to resume it, or "
                             "without resume to start over")
        done = data["blocks_done"]
        if done == 0:
            return None
        reports: list[LayerReport] = []
        for b in range(done):
            reports.extend(LayerReport(**r) for r in self._block_json(b)["reports"])
        inputs_path = self._inputs_path(done)
        try:
            with safe_open(str(inputs_path), framework="pt", device="cpu") as f:
                inputs = f.get_tensor("hidden")
                rng_state = f.get_tensor("rng_state") if "rng_state" in f.keys() else None  # noqa: SIM118
                fp_inputs = f.get_tensor("fp_hidden") if "fp_hidden" in f.keys() else None  # noqa: SIM118
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"{inputs_path}: cannot read the activations of block {done} ({exc}); remove "
                             f"{self.dir} to start over") from None
        bits = BitsInfo(**data["bits"])
        return ResumePoint(done, inputs, reports, dict(data["timings"]), float(data["seconds"]), bits, rng_state,
                           fp_inputs, self.dense_tensors(done))

    def _block_json(self, b: int) -> dict:
        path = self.dir / f"block-{b:05d}.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read ({exc}); remove {self.dir} to start over") from None

    def layer_dims(self) -> dict[str, tuple[int, int]]:
        """Full module name -> (in, out) features of every finished layer, in order."""
        dims = {}
        for b in range(self.manifest()["blocks_done"]):
            for name, layer_config in self._block_json(b)["layers"].items():
                dims[name] = (int(layer_config["in_features"]), int(layer_config["out_features"]))
        return dims

    def packed_layers(self) -> Iterator[tuple[str, PackedLayer]]:
        """(name, PackedLayer) of every finished layer, read one block at a time."""
        for b in range(self.manifest()["blocks_done"]):
            layers = self._block_json(b)["layers"]
            tensors: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layers}
            for name, tensor_name, tensor in self._block_tensors(b, lambda name: name != _DENSE):
                tensors.setdefault(name, {})[tensor_name] = tensor
            for name, layer_config in layers.items():
                yield name, PackedLayer(layer_config, tensors[name])

    def dense_tensors(self, blocks_done: int | None = None) -> dict[str, torch.Tensor]:
        """Full tensor name -> the trained 1-D tensors (float32) of the first ``blocks_done`` blocks (default:
        every finished block)."""
        done = self.manifest()["blocks_done"] if blocks_done is None else blocks_done
        return {tensor_name: tensor for b in range(done)
                for _name, tensor_name, tensor in self._block_tensors(b, lambda name: name == _DENSE)}

    def _block_tensors(self, b: int, wanted) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(module name or ``_DENSE``, tensor name, tensor) of block ``b``'s file, for the names ``wanted(name)``."""
        path = self.dir / f"block-{b:05d}.safetensors"
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                found = [(*key.partition(_SEP)[::2], key) for key in f.keys()]  # noqa: SIM118
                found = [(name, tensor_name, f.get_tensor(key)) for name, tensor_name, key in found if wanted(name)]
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"{path}: cannot read ({exc}); remove {self.dir} to start over") from None
        yield from found

    def block_outputs(self, b: int) -> torch.Tensor:
        """The calibration activations leaving block ``b - 1`` (entering block ``b``; ``b`` = the number of
        blocks: the last block's outputs, kept until the checkpoint is written)."""
        path = self._inputs_path(b)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return f.get_tensor("hidden")
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"{path}: cannot read the activations entering block {b} ({exc}); remove "
                             f"{self.dir} to start over") from None

    def quant_method(self) -> str:
        return self.manifest()["quant_method"]

    # ------------------------------------------------------------------------------------------- writing
    def start(self, fingerprint: dict, blocks_total: int) -> None:
        """A new run: whatever was here is removed."""
        self.remove()
        self.dir.mkdir(parents=True)
        self._write_manifest({"format": FORMAT, "fingerprint": json.loads(json.dumps(fingerprint)),
                              "blocks_total": blocks_total, "blocks_done": 0, "quant_method": None,
                              "timings": {}, "seconds": 0.0, "bits": {"weights": 0, "index_bits": 0, "total_bits": 0}})

    def write_block(self, done: BlockDone, packed: dict[str, PackedLayer], quant_method: str) -> None:
        """Persist one finished block, then commit it in run.json (see the module docstring)."""
        data = self.manifest()
        if done.index != data["blocks_done"]:
            raise ValueError(f"block {done.index} finished but {data['blocks_done']} blocks are committed")
        if data.get("quant_method") not in (None, quant_method):
            raise ValueError(f"block {done.index} holds {quant_method} layers, the blocks before it "
                             f"{data['quant_method']} layers; one checkpoint holds one kind")
        data["quant_method"] = quant_method
        b = done.index
        tensors = {f"{name}{_SEP}{key}": t.detach().cpu().contiguous().clone()
                   for name, layer in packed.items() for key, t in layer.tensors.items()}
        tensors.update({f"{_DENSE}{_SEP}{name}": t.detach().to("cpu", torch.float32).contiguous().clone()
                        for name, t in done.dense.items()})
        _atomic_save(tensors, self.dir / f"block-{b:05d}.safetensors")
        _atomic_write_text(self.dir / f"block-{b:05d}.json", json.dumps({
            "layers": {name: layer.layer_config for name, layer in packed.items()},
            "reports": [r.to_dict() for r in done.reports],
        }, default=_plain) + "\n")
        tensors = {"hidden": done.outputs.detach().to("cpu", torch.float32).contiguous(),
                   "rng_state": done.rng_state.contiguous()}
        if done.fp_outputs is not None:  # target_chain "fp": the original model's activations too
            tensors["fp_hidden"] = done.fp_outputs.detach().to("cpu", torch.float32).contiguous()
        _atomic_save(tensors, self._inputs_path(b + 1))
        bits = done.result.bits
        data.update(blocks_done=b + 1, timings=dict(done.result.timings), seconds=done.seconds,
                    bits={"weights": bits.weights, "index_bits": bits.index_bits, "total_bits": bits.total_bits})
        self._write_manifest(data)
        with contextlib.suppress(FileNotFoundError):
            self._inputs_path(b).unlink()

    def _write_manifest(self, data: dict) -> None:
        _atomic_write_text(self.dir / RUN_NAME, json.dumps(data, indent=1) + "\n")

    def _inputs_path(self, b: int) -> Path:
        return self.dir / f"inputs-{b:05d}.safetensors"

    def remove(self) -> None:
        if self.dir.exists():
            shutil.rmtree(self.dir)
