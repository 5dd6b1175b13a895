"""Packed checkpoints: write a quantized model as a Hugging Face style directory and read it back.

Layout of a checkpoint directory::

    config.json          model config + quantization_config
    model.safetensors    every non-quantized tensor in the model dtype (1-D ones, norm weights and biases, in
                         float32) + the packed quantized tensors
    generation_config.json, tokenizer files
    quant_report.json    the caller's report + sizes (quantized linears on disk vs their bf16 size)

VPTQ checkpoints use the public schema, ``quantization_config = {"quant_method": "vptq", "config_for_layers":
{module_name: layer_config}, "shared_layer_config": {}}`` with the public tensor names, so the ``vptq``
package and ``transformers`` (through ``vptq_core.storage.hf_integration``) read them too. Scalar methods (RTN, GPTQ,
LRQ) use ``quant_method = "vptq_core_scalar"`` with per-layer bits, group size and activation settings.

Loading never unpickles: JSON and safetensors only. Every tensor is checked against the module that will
hold it (name, shape, dtype, index ranges) before anything is assigned, so a damaged or inconsistent
checkpoint fails with one ``ValueError`` naming the file, the tensor and the problem.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
import transformers
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ..quant import lean_generate
from ..quant.states import ScalarLayerState, VQLayerState
from .head import check_head_bits, quantize_head
from .modules import (
    ScalarQLinear,
    VQLinear,
    module_from_state,
    scalar_config_from_dict,
    set_submodule,
    vq_spec_from_config,
)
from .skeleton import empty_model

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
REPORT_NAME = "quant_report.json"
VQ_METHOD = "vptq"
SCALAR_METHOD = "vptq_core_scalar"
SCALAR_FORMAT_VERSION = 1
QUANT_METHODS = (VQ_METHOD, SCALAR_METHOD)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32", torch.int16: "I16",
    torch.int64: "I64", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL", torch.float64: "F64",
}
_INDEX_TENSORS = ("indices", "outlier_indices", "codes")
_INT8_CODEBOOK_SCALES = "centroids.scale"  # the end of every 8-bit codebook's scale name (res_, outlier_ too)
_CODEBOOK_TENSORS = ("centroids.weight", "res_centroids.weight", "outlier_centroids.weight",
                     "centroids.scale", "res_centroids.scale", "outlier_centroids.scale")  # scales: 8-bit ones


# ------------------------------------------------------------------------------------------------ helpers
def dtype_from_name(name: object, where: str) -> torch.dtype:
    """"bfloat16" / "torch.bfloat16" / a torch float dtype -> torch.dtype (ValueError naming ``where``)."""
    if isinstance(name, torch.dtype) and name in _DTYPE_NAMES:
        return name
    if isinstance(name, str):
        for dtype, dtype_name in _DTYPE_NAMES.items():
            if name.removeprefix("torch.") == dtype_name:
                return dtype
    raise ValueError(f"{where}: dtype must be one of {sorted(_DTYPE_NAMES.values())}, got {name!r}")


def _read_json(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None


def _model_dtype(model: nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def _tied_targets(model: nn.Module) -> set[str]:
    """State-dict keys that alias another tensor (tied embeddings): neither saved nor expected on load."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return set(tied)


QUANTIZED_TYPES = (VQLinear, ScalarQLinear)


def build_quantized_module(quant_method: str, layer_config: dict, dtype: torch.dtype | None, device=None) -> nn.Module:
    """An empty quantized module for one ``config_for_layers`` entry of ``quant_method``."""
    if quant_method == VQ_METHOD:
        return VQLinear.from_config(layer_config, dtype=dtype, device=device)
    if quant_method == SCALAR_METHOD:
        return ScalarQLinear.from_config(layer_config, dtype=dtype, device=device)
    raise ValueError(f"quant_method must be one of {QUANT_METHODS}, got {quant_method!r}")


def layer_configs_for_model(
    model: nn.Module, config_for_layers: dict, shared_layer_config: dict | None = None
) -> dict[str, dict]:
    """Module name -> layer config for every linear to quantize; checks each against the model's ``nn.Linear``.

    ``shared_layer_config`` (public schema: keyed by the last name component, e.g. "q_proj") applies to linears
    not listed in ``config_for_layers``; their in/out features and bias come from the model.
    """
    if not isinstance(config_for_layers, dict):
        raise ValueError(  # noqa: TRY004 - a malformed config file is a bad value
            f"config_for_layers must be a JSON object, got {type(config_for_layers).__name__}"
        )
    shared = shared_layer_config or {}
    if not isinstance(shared, dict):
        raise ValueError(f"shared_layer_config must be a JSON object, got {type(shared).__name__}")  # noqa: TRY004
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    configs: dict[str, dict] = {}
    for name, layer_config in config_for_layers.items():
        if name not in linears:
            what = "no such module" if name not in dict(model.named_modules()) else "not an nn.Linear"
            raise ValueError(f"config_for_layers names {name!r}: {what} in {type(model).__name__}")
        configs[name] = layer_config
    for name, linear in linears.items():
        tail = name.rpartition(".")[2]
        if name not in configs and tail in shared:
            entry = {"in_features": linear.in_features, "out_features": linear.out_features,
                     "bias": linear.bias is not None, **shared[tail]}
            configs[name] = entry
    for name, layer_config in configs.items():
        linear = linears[name]
        if not isinstance(layer_config, dict):
            raise ValueError(  # noqa: TRY004 - a malformed config file is a bad value
                f"layer config of {name!r} must be a JSON object, got {type(layer_config).__name__}"
            )
        dims = (layer_config.get("in_features"), layer_config.get("out_features"))
        if dims != (linear.in_features, linear.out_features):
            raise ValueError(
                f"layer config of {name!r} says in/out features {dims}, the model's linear is "
                f"({linear.in_features}, {linear.out_features})"
            )
        if bool(layer_config.get("bias", False)) != (linear.bias is not None):
            raise ValueError(
                f"layer config of {name!r} says bias={layer_config.get('bias', False)}, the model's linear "
                f"{'has' if linear.bias is not None else 'has no'} bias"
            )
    return configs


def swap_quantized_modules(
    model: nn.Module, quant_method: str, config_for_layers: dict, shared_layer_config: dict | None = None,
    dtype: torch.dtype | None = None, device=None,
) -> dict[str, nn.Module]:
    """Replace the linears named by a quantization config with empty quantized modules (on ``device``, e.g.
    "meta"; float tensors in ``dtype``, default: the replaced linear's weight dtype); returns name -> new
    module. Shared by ``load_quantized`` and the transformers integration."""
    configs = layer_configs_for_model(model, config_for_layers, shared_layer_config)
    modules = {}
    for name, layer_config in configs.items():
        module_dtype = dtype if dtype is not None else model.get_submodule(name).weight.dtype
        try:
            modules[name] = build_quantized_module(quant_method, layer_config, module_dtype, device)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"layer config of {name!r}: {exc}") from None
    for name, module in modules.items():
        set_submodule(model, name, module)
    return modules


# ------------------------------------------------------------------------------------------------- saving
class SafetensorsWriter:
    """Writes a safetensors file one tensor at a time, so a checkpoint larger than memory can be written.

    ``add(name, tensor)`` appends the tensor's bytes to a spool file per element size (next to the target);
    ``close(metadata)`` writes the header and the spools, largest elements first, so every tensor stays
    aligned to its element size as ``safetensors.torch.save_file`` lays them out, then renames the file into
    place (an interrupted write leaves no partial file under the target name). Use as a context manager: on
    an exception the spools and the temporary file are removed.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._entries: dict[int, list[tuple[str, str, list[int], int]]] = {}
        self._spools: dict[int, object] = {}
        self._names: set[str] = set()

    def _spool_path(self, size: int) -> Path:
        return self.path.with_name(f".{self.path.name}.spool{size}")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} added twice")
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} cannot be stored in safetensors")
        size = tensor.element_size()
        if size not in self._spools:
            self._spools[size] = self._spool_path(size).open("wb")
            self._entries[size] = []
        data = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
        self._spools[size].write(memoryview(data))
        self._entries[size].append((name, _SAFETENSORS_DTYPES[tensor.dtype], list(tensor.shape), len(data)))
        self._names.add(name)

    def close(self, metadata: dict[str, str] | None = None) -> Path:
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        order = sorted(self._spools, reverse=True)
        for size in order:
            self._spools[size].close()
            for name, dtype, shape, nbytes in self._entries[size]:
                header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("wb") as out:
            out.write(struct.pack("<Q", len(text)))
            out.write(text)
            for size in order:
                with self._spool_path(size).open("rb") as spool:
                    shutil.copyfileobj(spool, out, 1 << 24)
                self._spool_path(size).unlink()
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        self._spools.clear()
        return self.path

    def abort(self) -> None:
        for size, spool in self._spools.items():
            spool.close()
            self._spool_path(size).unlink(missing_ok=True)
        self._spools.clear()
        self.path.with_name(self.path.name + ".tmp").unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


@dataclass
class PackedLayer:
    """One quantized linear as stored: its ``config_for_layers`` entry and its tensors (names relative to the
    module, e.g. "indices", "centroids.weight"), what ``pack_layer`` makes of a layer state."""

    layer_config: dict
    tensors: dict[str, torch.Tensor]

    @property
    def in_features(self) -> int:
        return int(self.layer_config["in_features"])

    @property
    def out_features(self) -> int:
        return int(self.layer_config["out_features"])


def quant_method_of(state: VQLayerState | ScalarLayerState) -> str:
    if isinstance(state, VQLayerState):
        return VQ_METHOD
    if isinstance(state, ScalarLayerState):
        return SCALAR_METHOD
    raise TypeError(f"state must be a VQLayerState or ScalarLayerState, got {type(state).__name__}")


def pack_layer(state: VQLayerState | ScalarLayerState, dtype: torch.dtype) -> PackedLayer:
    """The stored form of one layer state (bit-packed indices / codes, float tensors in ``dtype``)."""
    module = module_from_state(state, dtype, device="cpu")
    return PackedLayer(module.layer_config(),
                       {key: tensor.detach().contiguous() for key, tensor in module.state_dict().items()})


def save_quantized(
    model: nn.Module,
    tokenizer,
    states: Mapping[str, VQLayerState | ScalarLayerState],
    out_dir: str | os.PathLike,
    report: dict | None = None,
    dtype: torch.dtype | None = None,
    embedding: VQLayerState | ScalarLayerState | str | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write a packed checkpoint directory and return its path.

    ``model``: the model the states belong to (its quantized linears may still be dense ``nn.Linear``,
    already swapped modules, or on the meta device: the ``states`` are the source of truth). ``states``: full
    module name -> layer state, all VPTQ or all scalar. ``tokenizer`` may be None. ``dtype`` (default: the
    model's float dtype) is the storage dtype of every float tensor but the 1-D ones (norms, biases: float32).
    ``tensors`` (state-dict name -> tensor, e.g. ``QuantizeResult.dense``: the trained norms in float32) replace
    the model's own of those names. ``report`` must be JSON-serialisable; it
    is written to ``quant_report.json`` with a ``sizes`` entry added. Tensors are written one at a time
    (``SafetensorsWriter``). The LM head may be one of the ``states`` (a tied head is untied); ``embedding``
    (optional) is the input embedding's layer state, or the head's module name when it reads the head's
    quantized rows (tied weights) — see ``storage.embedding``.
    """
    if not isinstance(states, Mapping) or not states:
        raise ValueError("states must be a non-empty dict of module name -> VQLayerState/ScalarLayerState")
    kinds = {type(s) for s in states.values()}
    if kinds == {VQLayerState}:
        quant_method = VQ_METHOD
    elif kinds == {ScalarLayerState}:
        quant_method = SCALAR_METHOD
    else:
        names = sorted(k.__name__ for k in kinds)
        raise ValueError(f"states must be all VQLayerState or all ScalarLayerState, got {names}")
    dtype = dtype_from_name(dtype, "save_quantized") if dtype is not None else _model_dtype(model)
    dims = {name: (state.in_features, state.out_features) for name, state in states.items()}
    layers = ((name, pack_layer(state, dtype)) for name, state in states.items())
    if embedding is not None and not isinstance(embedding, str):
        if type(embedding) not in kinds:
            raise ValueError(f"the embedding's state is a {type(embedding).__name__}, the layers' "
                             f"{kinds.pop().__name__}: one checkpoint holds one kind")
        embedding = pack_layer(embedding, dtype)
    return save_packed(model, tokenizer, quant_method, dims, layers, out_dir, report=report, dtype=dtype,
                       embedding=embedding, tensors=tensors)


def save_packed(
    model: nn.Module,
    tokenizer,
    quant_method: str,
    dims: Mapping[str, tuple[int, int]],
    layers: Iterable[tuple[str, PackedLayer]],
    out_dir: str | os.PathLike,
    report: dict | None = None,
    dtype: torch.dtype | None = None,
    embedding: PackedLayer | str | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """``save_quantized`` for layers already packed: ``dims`` names every quantized linear with its (in, out)
    features (checked against ``model`` before anything is written), ``layers`` yields ``(name, PackedLayer)``
    for each of them, e.g. one block at a time from disk. Every other tensor of ``model`` is stored in
    ``dtype`` (1-D float ones in float32: ``plain_tensor_dtype``) and must be materialised (not on the meta device);
    ``tensors`` (state-dict name -> tensor) replace the model's own of those names, e.g. the norms a run
    trained while the model kept the original's."""
    if quant_method not in QUANT_METHODS:
        raise ValueError(f"quant_method must be one of {QUANT_METHODS}, got {quant_method!r}")
    if not dims:
        raise ValueError("no quantized layers to save")
    if report is not None and not isinstance(report, dict):
        raise TypeError(f"report must be a dict or None, got {type(report).__name__}")
    try:
        report_out = json.loads(json.dumps(report or {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"report is not JSON-serialisable: {exc}") from None
    dtype = dtype_from_name(dtype, "save_quantized") if dtype is not None else _model_dtype(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"model must be a transformers PreTrainedModel with a config, got {type(model).__name__}")

    tied = _tied_targets(model)
    untied = {f"{name}.weight" for name in dims} & tied  # a quantized tied head: stored untied
    tied -= untied
    _check_layers(model, dims, tied)
    embedding_entry, embedding_prefix = _embedding_entry(model, embedding, dims, quant_method)
    prefixes = tuple(f"{name}." for name in dims) + embedding_prefix
    plain = [(key, tensor) for key, tensor in model.state_dict().items()
             if key not in tied and not key.startswith(prefixes)]
    plain = _replaced(plain, tensors or {})
    on_meta = [key for key, tensor in plain if tensor.is_meta]
    if on_meta:
        raise ValueError(f"model tensors {on_meta[:4]} are on the meta device (not loaded); load them before saving")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = _new_sizes()
    layer_configs = {}
    with SafetensorsWriter(out / WEIGHTS_NAME) as writer:
        for key, tensor in plain:
            tensor = tensor.detach().to("cpu", plain_tensor_dtype(tensor, dtype))
            sizes["other_tensor_bytes"] += tensor.numel() * tensor.element_size()
            writer.add(key, tensor)
        for name, layer in layers:
            if name not in dims or name in layer_configs:
                raise ValueError(f"packed layer {name!r} is not one of the layers to save, or comes twice")
            if (layer.in_features, layer.out_features) != tuple(dims[name]):
                raise ValueError(f"packed layer {name!r} is {(layer.in_features, layer.out_features)} (in, out), "
                                 f"expected {tuple(dims[name])}")
            layer_configs[name] = layer.layer_config
            _count_layer(sizes, layer)
            for key, tensor in layer.tensors.items():
                writer.add(f"{name}.{key}", tensor)
        missing = sorted(set(dims) - set(layer_configs))
        if missing:
            raise ValueError(f"no packed tensors for {missing[:4]}")
        if isinstance(embedding, PackedLayer):
            sizes["quantized_embedding_bytes"] = 0
            for key, tensor in embedding.tensors.items():
                sizes["quantized_embedding_bytes"] += tensor.numel() * tensor.element_size()
                writer.add(f"{embedding_entry['module']}.linear.{key}", tensor)
        writer.close(metadata={"format": "pt"})
    _finish_sizes(sizes)

    if quant_method == VQ_METHOD:
        quantization_config = {"quant_method": VQ_METHOD, "config_for_layers": layer_configs,
                               "shared_layer_config": {}}
    else:
        quantization_config = {"quant_method": SCALAR_METHOD, "format_version": SCALAR_FORMAT_VERSION,
                               "config_for_layers": layer_configs}
    if embedding_entry is not None:
        quantization_config["embedding"] = embedding_entry
    config_dict = config.to_dict()
    if untied or embedding_entry is not None:
        config_dict["tie_word_embeddings"] = False  # our loader rebuilds any sharing (``embedding.source``)
    config_dict["quantization_config"] = quantization_config
    config_dict["dtype"] = _DTYPE_NAMES[dtype]
    config_dict.pop("torch_dtype", None)

    sizes["safetensors_file_bytes"] = (out / WEIGHTS_NAME).stat().st_size
    (out / CONFIG_NAME).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    report_out["sizes"] = sizes
    report_out["checkpoint"] = {"quant_method": quant_method, "dtype": _DTYPE_NAMES[dtype], "versions": _versions()}
    (out / REPORT_NAME).write_text(json.dumps(report_out, indent=2) + "\n", encoding="utf-8")
    return out


def plain_tensor_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a non-quantized tensor is written in: a 1-D float tensor (norm weight, bias) in float32, so
    trained values keep every bit (the bytes are negligible); any other float tensor in the checkpoint's
    ``dtype``; an integer one as it is."""
    if not tensor.is_floating_point():
        return tensor.dtype
    return torch.float32 if tensor.dim() == 1 else dtype


def _replaced(plain: list[tuple[str, torch.Tensor]],
              tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``plain`` with the entries named in ``tensors`` replaced (same shape); ValueError for a name that is not
    one of the tensors to store, or a shape that differs."""
    names = dict(plain)
    for name, tensor in tensors.items():
        if name not in names:
            raise ValueError(f"replacement tensor {name!r} is not one of the model's non-quantized tensors")
        if tuple(tensor.shape) != tuple(names[name].shape):
            raise ValueError(f"replacement tensor {name!r} has shape {tuple(tensor.shape)}, the model's "
                             f"{tuple(names[name].shape)}")
    return [(key, tensors.get(key, tensor)) for key, tensor in plain]


def _embedding_entry(model: nn.Module, embedding, dims: Mapping, quant_method: str) -> tuple[dict | None, tuple]:
    """The ``quantization_config["embedding"]`` entry and the state-dict prefix it replaces (or None, ())."""
    if embedding is None:
        return None, ()
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    name = next((n for n, m in model.named_modules() if m is embed), None)
    if not isinstance(embed, nn.Module) or name is None:
        raise ValueError(f"{type(model).__name__} has no input embedding to store quantized")
    rows = (embed.weight.shape[1], embed.weight.shape[0])  # (in, out) of the [vocab, hidden] matrix
    if isinstance(embedding, str):
        if embedding not in dims:
            raise ValueError(f"the embedding reads the rows of {embedding!r}, which is not a quantized layer here")
        if tuple(dims[embedding]) != rows:
            raise ValueError(f"{embedding!r} is {tuple(dims[embedding])} (in, out), the embedding {rows}")
        return {"module": name, "source": embedding}, (f"{name}.",)
    if not isinstance(embedding, PackedLayer):
        raise TypeError(f"embedding must be a PackedLayer, a layer name or None, got {type(embedding).__name__}")
    if (embedding.in_features, embedding.out_features) != rows:
        raise ValueError(f"quantized embedding is {(embedding.in_features, embedding.out_features)} (in, out), the "
                         f"model's embedding {rows}")
    return {"module": name, "source": "own", "layer_config": embedding.layer_config}, (f"{name}.",)


def _check_layers(model: nn.Module, dims: Mapping[str, tuple[int, int]], tied: set[str]) -> None:
    """Every layer to save is a linear of ``model`` with the same (in, out) features and its own weight."""
    for name, (in_features, out_features) in dims.items():
        if not _has_submodule(model, name):
            raise ValueError(f"states names {name!r}: no such module in {type(model).__name__}")
        current = model.get_submodule(name)
        if not isinstance(current, (nn.Linear, *QUANTIZED_TYPES)):
            raise TypeError(f"states names {name!r}: it is a {type(current).__name__}, not a linear layer")
        have = (current.in_features, current.out_features)
        if (in_features, out_features) != have:
            raise ValueError(f"state of {name!r} is {(in_features, out_features)} (in, out) but the module is {have}")
        if f"{name}.weight" in tied:
            raise ValueError(f"{name!r} shares its weight with the input embeddings (tied); cannot quantize it")


def _new_sizes() -> dict:
    return {"quantized_linears": 0, "quantized_weights": 0, "quantized_linear_bytes": 0, "index_bytes": 0,
            "codebook_bytes": 0, "other_quantized_bytes": 0, "bf16_linear_bytes": 0, "other_tensor_bytes": 0}


def _count_layer(sizes: dict, layer: PackedLayer) -> None:
    """Bytes of one quantized linear as stored (by kind) and the same linear in bf16."""
    sizes["quantized_linears"] += 1
    sizes["quantized_weights"] += layer.in_features * layer.out_features
    sizes["bf16_linear_bytes"] += 2 * layer.in_features * layer.out_features
    if "bias" in layer.tensors:
        sizes["bf16_linear_bytes"] += 2 * layer.out_features
    for key, tensor in layer.tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        kind = ("index_bytes" if key in _INDEX_TENSORS else
                "codebook_bytes" if key in _CODEBOOK_TENSORS else "other_quantized_bytes")
        sizes[kind] += nbytes
        sizes["quantized_linear_bytes"] += nbytes


def _finish_sizes(sizes: dict) -> None:
    sizes["ratio_to_bf16"] = sizes["quantized_linear_bytes"] / max(sizes["bf16_linear_bytes"], 1)
    sizes["bits_per_weight"] = 8 * sizes["quantized_linear_bytes"] / max(sizes["quantized_weights"], 1)


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _versions() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__}


def checkpoint_size(path: str | os.PathLike) -> int:
    """Total bytes of the files in a checkpoint directory (recursively)."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint path {str(root)!r} is not a directory")
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------------ loading
def read_quantization_config(path: str | os.PathLike) -> tuple[dict, dict]:
    """(config.json dict, validated quantization_config dict) of a checkpoint directory."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint path {str(root)!r} is not a directory")
    config_path = root / CONFIG_NAME
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")  # noqa: TRY004
    quantization_config = config.get("quantization_config")
    if not isinstance(quantization_config, dict):
        raise ValueError(f"{config_path}: 'quantization_config' is missing or not an object")  # noqa: TRY004
    method = quantization_config.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(f"{config_path}: quant_method must be one of {QUANT_METHODS}, got {method!r}")
    layers = quantization_config.get("config_for_layers")
    if not isinstance(layers, dict):
        raise ValueError(f"{config_path}: quantization_config.config_for_layers must be an object")  # noqa: TRY004
    if method == SCALAR_METHOD and quantization_config.get("format_version") != SCALAR_FORMAT_VERSION:
        raise ValueError(f"{config_path}: unsupported scalar format_version "
                         f"{quantization_config.get('format_version')!r} (expected {SCALAR_FORMAT_VERSION})")
    for name, layer_config in layers.items():
        _check_layer_config(layer_config, method, f"{config_path}: layer {name!r}")
    embedding = quantization_config.get("embedding")
    if embedding is not None:
        _check_embedding_entry(embedding, layers, method, config_path)
    return config, quantization_config


def _check_layer_config(layer_config: object, method: str, where: str) -> None:
    """One layer's entry of ``config_for_layers`` must parse for the checkpoint's method."""
    try:
        if method == VQ_METHOD:
            vq_spec_from_config(layer_config)
        else:
            scalar_config_from_dict(layer_config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _check_embedding_entry(entry: object, layers: dict, method: str, config_path: Path) -> None:
    where = f"{config_path}: quantization_config.embedding"
    if not isinstance(entry, dict) or not isinstance(entry.get("module"), str):
        raise ValueError(f"{where} must be an object naming its 'module'")
    source = entry.get("source")
    if source == "own":
        layer_config = entry.get("layer_config")
        if not isinstance(layer_config, dict):
            raise ValueError(f"{where}.layer_config must be an object")
        _check_layer_config(layer_config, method, where)
    elif source not in layers:
        raise ValueError(f"{where}.source must be 'own' or a quantized layer's name, got {source!r}")


def _open_safetensors(path: Path):
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{path}: not a valid safetensors file ({exc})") from None


def _check_tensor_values(name: str, tensor: torch.Tensor, module: nn.Module, what: str) -> None:
    """Index ranges a lookup would otherwise trip over deep inside a kernel."""
    if isinstance(module, VQLinear):
        spec = module.spec
        if what == "outlier_indices":
            values = tensor.to(torch.int64) & 0xFFFF
            if values.numel() and int(values.max()) >= spec.num_outlier_centroids:
                raise ValueError(f"tensor {name!r}: outlier index {int(values.max())} >= num_outlier_centroids "
                                 f"({spec.num_outlier_centroids})")
        elif what == "scale" and (not bool(torch.isfinite(tensor).all()) or bool((tensor <= 0).any())):
            raise ValueError(f"tensor {name!r}: an 8-bit codebook's scales must be positive and finite")
        elif what == "perm":
            values = tensor.to(torch.int64) & 0xFFFF
            if not torch.equal(torch.sort(values).values, torch.arange(spec.in_features)):
                raise ValueError(f"tensor {name!r}: not a permutation of range({spec.in_features})")
    elif isinstance(module, ScalarQLinear) and what == "act_scale" and (
        not bool(torch.isfinite(tensor).all()) or float(tensor) <= 0
    ):
        raise ValueError(f"tensor {name!r}: activation scale must be positive and finite, got {float(tensor)}")


def load_quantized(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
    head_bits: int | str = "auto",
):
    """Read a checkpoint written by ``save_quantized`` (or a public VPTQ checkpoint with one safetensors file).

    Returns ``(model, tokenizer)``, the model in eval mode on ``device`` with float tensors in ``dtype``
    (default: the stored dtype; the 1-D ones stored in float32 are cast to it too, since a norm weight in float32
    would turn a bf16 model's activations float32 for the next layer: ``dtype=torch.float32`` reads them exactly);
    ``tokenizer`` is None when the directory holds none. Raises ValueError
    naming the file/tensor for anything missing, damaged or inconsistent.

    ``head_bits``: an LM head stored in the model dtype runs at 8 or 4 bits (round-to-nearest at load,
    ``storage.head``): "auto" = 8 bits for a large head on the CPU with the native kernels, 0 = as stored.
    """
    check_head_bits(head_bits)
    root = Path(path)
    config_dict, quantization_config = read_quantization_config(root)
    config_path = root / CONFIG_NAME
    stored_dtype = dtype_from_name(config_dict.get("dtype", config_dict.get("torch_dtype")), str(config_path))
    target_dtype = stored_dtype if dtype is None else dtype_from_name(dtype, "load_quantized dtype")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        value = config_dict.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{config_path}: {key} must be a positive whole number, got {value!r}")
    try:
        model_config = AutoConfig.from_pretrained(str(root))
    except Exception as exc:  # noqa: BLE001 - transformers' config checks raise their own classes too
        first = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else ""
        raise ValueError(f"{config_path}: cannot build the model config ({type(exc).__name__}: {first})") from None

    try:
        model = empty_model(model_config, target_dtype)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, ZeroDivisionError) as exc:
        raise ValueError(f"{config_path}: cannot build the model ({type(exc).__name__}: {exc})") from None
    try:
        modules = swap_quantized_modules(
            model, quantization_config["quant_method"], quantization_config["config_for_layers"],
            quantization_config.get("shared_layer_config"), dtype=target_dtype, device="meta",
        )
    except ValueError as exc:
        raise ValueError(f"{config_path}: {exc}") from None
    if quantization_config.get("embedding") is not None:
        modules.update(_swap_embedding(model, quantization_config, modules, target_dtype, config_path))

    tied = _tied_targets(model)
    expected = {k: t for k, t in model.state_dict().items() if k not in tied}
    weights_path = root / WEIGHTS_NAME
    tensors = _read_checked_tensors(weights_path, expected, modules, stored_dtype, target_dtype)
    result = model.load_state_dict(tensors, strict=False, assign=True)
    assert not result.unexpected_keys and set(result.missing_keys) <= tied, result
    model.tie_weights()
    left_on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left_on_meta:
        raise ValueError(f"{weights_path}: no data for {left_on_meta[:5]}")
    model.config.quantization_config = quantization_config
    model.config.dtype = target_dtype
    if (root / "generation_config.json").is_file():
        try:
            model.generation_config = GenerationConfig.from_pretrained(str(root))
        except (ValueError, OSError, TypeError) as exc:
            raise ValueError(f"{root / 'generation_config.json'}: cannot read ({exc})") from None
    model = model.to(device).eval()
    quantize_head(model, head_bits)
    lean_generate.enable(model)  # model.generate runs the lean token loop where it gives the same result
    return model, _load_tokenizer(root)


def _swap_embedding(model: nn.Module, quantization_config: dict, modules: dict, dtype: torch.dtype,
                    config_path: Path) -> dict[str, nn.Module]:
    """Replace the input embedding by a ``QuantizedEmbedding`` (its own quantized matrix, on meta until the
    tensors are assigned, or the quantized head's); returns the new quantized module by name, for the checks."""
    from .embedding import quantized_embedding_for

    entry = quantization_config["embedding"]
    name = entry["module"]
    try:
        original = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{config_path}: quantization_config.embedding names {name!r}: no such module") from None
    if not isinstance(original, nn.Embedding):
        raise ValueError(f"{config_path}: quantization_config.embedding names {name!r}, a "
                         f"{type(original).__name__}, not an nn.Embedding")
    try:
        if entry["source"] == "own":
            linear = build_quantized_module(quantization_config["quant_method"], entry["layer_config"], dtype, "meta")
            replacement = quantized_embedding_for(original, linear=linear)
            new = {f"{name}.linear": linear}
        else:
            replacement = quantized_embedding_for(original, source=modules[entry["source"]])
            new = {}
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{config_path}: quantization_config.embedding: {exc}") from None
    set_submodule(model, name, replacement)
    return new


def _read_checked_tensors(
    weights_path: Path, expected: dict[str, torch.Tensor], modules: dict[str, nn.Module],
    stored_dtype: torch.dtype, target_dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Every expected tensor from the file, after checking names, shapes, dtypes and index ranges."""
    handle = _open_safetensors(weights_path)
    with handle as f:
        present = set(f.keys())
        missing = sorted(set(expected) - present)
        if missing:
            raise ValueError(f"{weights_path}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        unexpected = sorted(present - set(expected))
        if unexpected:
            raise ValueError(f"{weights_path}: unexpected tensors {unexpected[:8]}"
                             f"{' ...' if len(unexpected) > 8 else ''}")
        tensors = {}
        for name, like in expected.items():
            slice_ = f.get_slice(name)
            shape, stored = tuple(slice_.get_shape()), slice_.get_dtype()
            # an 8-bit codebook's scales are float32 whatever the model's dtype, and stay so
            float32 = name.endswith(_INT8_CODEBOOK_SCALES)
            want = _SAFETENSORS_DTYPES[torch.float32 if float32 else
                                       stored_dtype if like.is_floating_point() else like.dtype]
            if shape != tuple(like.shape):
                raise ValueError(f"{weights_path}: tensor {name!r} has shape {shape}, expected {tuple(like.shape)}")
            # 1-D float tensors (norms, biases) may be float32 beside the stored dtype (``plain_tensor_dtype``)
            allowed = (want, "F32") if like.is_floating_point() and like.dim() == 1 else (want,)
            if stored not in allowed:
                raise ValueError(f"{weights_path}: tensor {name!r} has dtype {stored}, expected {' or '.join(allowed)}")
            try:
                tensor = f.get_tensor(name)
            except (SafetensorError, RuntimeError, OSError) as exc:
                raise ValueError(f"{weights_path}: cannot read tensor {name!r} ({exc})") from None
            owner, _, what = name.rpartition(".")
            module = modules.get(owner) or modules.get(owner.rpartition(".")[0])
            if module is not None:
                _check_tensor_values(name, tensor, module, what)
            tensors[name] = tensor.to(target_dtype) if tensor.is_floating_point() and not float32 else tensor
    return tensors


def _load_tokenizer(root: Path):
    if not any((root / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises bare Exception for damaged files
        raise ValueError(f"{root}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
