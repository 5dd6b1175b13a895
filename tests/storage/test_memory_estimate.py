"""The memory a checkpoint's load needs, from its header and config, before anything is read."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from factories import random_scalar_state

from vptq_core.models import tiny_random_model
from vptq_core.quant.blocks import block_linears, decoder_blocks
from vptq_core.storage.checkpoint import load_quantized, save_quantized
from vptq_core.storage.memory_estimate import PARSED_FACTOR, estimate_load, read_header


def _stream(header: dict) -> io.BytesIO:
    raw = json.dumps(header).encode()
    return io.BytesIO(struct.pack("<Q", len(raw)) + raw)


def test_the_estimate_counts_each_tensor_at_its_loaded_dtype():
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [1000, 10], "data_offsets": [0, 40_000]},
              "b": {"dtype": "I16", "shape": [500], "data_offsets": [40_000, 41_000]}}
    config = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100}
    est = estimate_load(read_header(_stream(header)), config, float_bytes=2, other_file_bytes=1000)
    assert est.tensors == 10_000 * 2 + 500 * 2  # floats at bf16, integers as stored
    assert est.transient == 40_000  # the largest tensor, read as stored before its cast
    assert est.head == 100 * 64 and est.buffers == 2 * 8 * 4 + 4 and est.files == PARSED_FACTOR * 1000
    assert est.total == est.tensors + est.transient + est.head + est.buffers + est.files


def test_headers_that_are_not_safetensors_are_refused_in_one_line():
    with pytest.raises(ValueError, match="shorter than 8 bytes"):
        read_header(io.BytesIO(b"abc"))
    with pytest.raises(ValueError, match=r"safetensors header of 999999999 bytes; at most 16000000 are read"):
        read_header(io.BytesIO(struct.pack("<Q", 999_999_999)))
    with pytest.raises(ValueError, match="header is not JSON"):
        read_header(io.BytesIO(struct.pack("<Q", 3) + b"{{{"))
    with pytest.raises(ValueError, match="tensor 'x' has a malformed shape"):
        estimate_load({"x": {"dtype": "F16", "shape": [-1]}}, {}, 2)


def test_the_estimate_covers_what_a_load_holds(tmp_path):
    model, tok = tiny_random_model("gemma3")
    linears = {f"model.layers.{b}.{name}": m for b, block in enumerate(decoder_blocks(model))
               for name, m in block_linears(block).items()}
    states = {name: random_scalar_state(m.in_features, m.out_features, bits=4, group_size=32, seed=i)
              for i, (name, m) in enumerate(linears.items())}
    ckpt = save_quantized(model.to(torch.bfloat16), tok, states, tmp_path / "ckpt")
    with open(ckpt / "model.safetensors", "rb") as f:
        header = read_header(f)
    config = json.loads((ckpt / "config.json").read_text())
    est = estimate_load(header, config, float_bytes=2)
    loaded = load_quantized(ckpt, dtype=torch.bfloat16, head_bits=0)[0]
    held = {t.data_ptr(): t.numel() * t.element_size() for t in [*loaded.parameters(), *loaded.buffers()]}
    assert sum(held.values()) <= est.tensors + est.buffers <= 1.5 * sum(held.values()), (sum(held.values()), est)
