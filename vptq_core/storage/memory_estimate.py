"""How much memory loading a checkpoint takes, from its safetensors header and its config, before anything is
allocated: every stored tensor at the dtype it is loaded in (``load_quantized`` casts floating tensors to the
target dtype), the largest one once more (it is read as stored before the cast), what the architecture builds
beside the stored tensors (rotary frequency tables), the LM head quantized at load, and the JSON files parsed
(a tokenizer takes about ten times its ``tokenizer.json`` once loaded)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import BinaryIO

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
MAX_HEADER_BYTES = 16_000_000  # a header this long lists far more tensors than any model the app serves
PARSED_FACTOR = 10  # memory of a parsed JSON file (a loaded tokenizer) per byte of its text


@dataclass(frozen=True)
class LoadEstimate:
    """Bytes a load needs: ``tensors`` (all stored tensors at their loaded dtype), ``transient`` (the largest
    one read as stored), ``buffers`` (built by the architecture), ``head`` (the LM head quantized at load),
    ``files`` (the tokenizer and the other JSON files, parsed)."""

    tensors: int
    transient: int
    buffers: int
    head: int
    files: int = 0

    @property
    def total(self) -> int:
        return self.tensors + self.transient + self.buffers + self.head + self.files


def read_header(stream: BinaryIO, limit: int = MAX_HEADER_BYTES) -> dict:
    """The JSON header at the start of a safetensors stream (a file or a zip entry), read without the data;
    ValueError when it is not one or longer than ``limit`` bytes."""
    head = stream.read(8)
    if len(head) < 8:
        raise ValueError("not a safetensors file (shorter than 8 bytes)")
    (length,) = struct.unpack("<Q", head)
    if length > limit:
        raise ValueError(f"safetensors header of {length} bytes; at most {limit} are read")
    raw = stream.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not a safetensors file (header is not JSON: {type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (header is not a JSON object)")
    return header


def tensor_sizes(header: dict, float_bytes: int | None = None) -> list[int]:
    """Bytes of each tensor the header lists, floating ones at ``float_bytes`` per element when given."""
    sizes = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r} has no valid dtype")
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise ValueError(f"tensor {name!r} has a malformed shape")
        dtype = info["dtype"]
        per = float_bytes if float_bytes is not None and dtype in FLOAT_DTYPES else DTYPE_BYTES[dtype]
        sizes.append(math.prod(shape) * per)
    return sizes


def architecture_buffer_bytes(config: dict) -> int:
    """What a decoder the app serves builds beside its stored tensors: float32 rotary frequency tables (two per
    attention kind) and an embedding scale. Position tables that grow with the context are not built by these
    architectures; the config check refuses the architectures that build them."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                          and heads > 0 else 0)
    kinds = max(len(set(config.get("layer_types") or [])), 1)
    return 2 * kinds * (int(head_dim) // 2) * 4 + 4


def estimate_load(header: dict, config: dict, float_bytes: int, other_file_bytes: int = 0) -> LoadEstimate:
    """Bytes loading a checkpoint takes (``LoadEstimate``), from its safetensors header and config.json, with
    floating tensors loaded at ``float_bytes`` per element; ``other_file_bytes``: the size of its other files
    (tokenizer, JSON), parsed at ``PARSED_FACTOR`` times that."""
    loaded = tensor_sizes(header, float_bytes)
    stored = tensor_sizes(header)
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    head = vocab * hidden if isinstance(vocab, int) and isinstance(hidden, int) else 0  # 8 bits a weight
    return LoadEstimate(tensors=sum(loaded), transient=max(stored, default=0),
                        buffers=architecture_buffer_bytes(config), head=max(head, 0),
                        files=PARSED_FACTOR * other_file_bytes)
