"""A scalar-quantized checkpoint (GPTQ, RTN, or any layer on the same grid) as a GGUF file llama.cpp loads.

A GGUF block type holds 32 weights of one row with an fp16 scale: Q4_0 is ``d * (q - 8)``, Q4_1 is ``d * q + m``,
Q8_0 is ``d * q`` with a signed q. A checkpoint layer ``W = scale * (code - zero)`` in groups of 32 is therefore
written without re-quantizing: the same codes, the stored scale as ``d`` (checked exact in fp16), and for a grid
with a zero point ``m = -scale * zero`` rounded once to fp16 (the only rounding of the export). Any other setting
(vector quantization, other bit widths or group sizes, activation quantization, biases) has no GGUF twin and is
refused with one line naming the reason and what is allowed.

Tensor names, the q/k row order and the metadata are those llama.cpp's ``convert_hf_to_gguf.py`` writes for the
llama family; the tokenizer metadata is copied from the GGUF file the run was made from (the bundled model is
one), or from ``tokenizer_gguf``.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from .kernels import unpack_codes
from .storage.checkpoint import SCALAR_METHOD, WEIGHTS_NAME, read_quantization_config

BLOCK = 32
Q = gguf.GGMLQuantizationType
ALLOWED = ("allowed: GPTQ / RTN checkpoints of a llama-family model with group size 32, weight-only, at 4 bits "
           "(Q4_0 symmetric, Q4_1 with a zero point) or 8 bits symmetric (Q8_0)")
_FILE_TYPES = {Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
               Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
_LAYER_NAMES = {  # Hugging Face llama module -> llama.cpp tensor (convert_hf_to_gguf.py's names)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


class ExportRefused(ValueError):
    """The checkpoint has no exact GGUF form; the message says why and what is allowed."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}; {ALLOWED}")


# ------------------------------------------------------------------------------------------------ blocks
def block_type(bits: int, group_size: int, zeros: torch.Tensor, where: str) -> Q:
    """The GGUF block type that holds a layer of ``bits`` in groups of ``group_size`` with these zero points."""
    if group_size != BLOCK:
        raise ExportRefused(f"{where} uses group size {group_size}, GGUF blocks hold {BLOCK} weights")
    if bits == 4:
        return Q.Q4_0 if bool((zeros == 8).all()) else Q.Q4_1
    if bits == 8:
        if not bool((zeros == 128).all()):
            raise ExportRefused(f"{where} is 8-bit with a zero point; Q8_0 is symmetric (quantize with --sym)")
        return Q.Q8_0
    raise ExportRefused(f"{where} has {bits}-bit codes")


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[rows, groups] -> uint8 [rows, groups, 2], the little-endian fp16 of each value."""
    rows, groups = values.shape
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(rows, groups, 2)


def check_scales_exact(scales: torch.Tensor, codes: torch.Tensor, zeros: torch.Tensor, where: str) -> None:
    """Every scale that multiplies a nonzero step must be a float16 value (a bf16 or fp16 checkpoint's are,
    down to 2^-17); groups whose codes all sit on the zero point dequantize to 0 whatever the scale."""
    rows, groups = scales.shape
    steps = codes.reshape(rows, groups, BLOCK) != zeros.unsqueeze(-1)
    used = steps.any(dim=-1)
    inexact = used & (scales.to(torch.float16).float() != scales.float())
    if bool(inexact.any()):
        raise ExportRefused(f"{where}: {int(inexact.sum())} scale(s) are not exact in float16 (a float32 "
                            "checkpoint?); the CLI and the app store bfloat16, whose scales are")


def pack_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, qtype: Q) -> np.ndarray:
    """A scalar layer's codes [rows, in] (integers in [0, 2**bits)), scales and zeros [rows, in/32] as the raw
    bytes of ``qtype`` blocks: uint8 [rows, in/32 * bytes per block], llama.cpp's row-major layout."""
    rows, cols = codes.shape
    groups = cols // BLOCK
    q = codes.reshape(rows, groups, BLOCK)
    d = _fp16_bytes(scales.float())
    if qtype == Q.Q8_0:
        parts = [d, (q - 128).to(torch.int8).view(torch.uint8)]
    else:
        q = q.to(torch.uint8)
        nibbles = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)  # weight j and j + 16 share byte j
        if qtype == Q.Q4_0:
            parts = [d, nibbles]
        else:  # Q4_1: m = -scale * zero (exact in float32, rounded once to fp16)
            parts = [d, _fp16_bytes(-(scales.float() * zeros.float())), nibbles]
    return torch.cat(parts, dim=-1).reshape(rows, -1).numpy()


def plain_tensor(tensor: torch.Tensor) -> tuple[np.ndarray, Q]:
    """A dense tensor in the type it is stored in: float32 -> F32, bfloat16 -> BF16, float16 -> F16 (exact)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint8), Q.BF16
    if tensor.dtype == torch.float16:
        return tensor.numpy(), Q.F16
    return tensor.float().numpy(), Q.F32


# ------------------------------------------------------------------------------------------------ names
def gguf_name(module: str) -> str:
    """llama.cpp's name of a Hugging Face llama module (``model.layers.3.mlp.up_proj`` -> ``blk.3.ffn_up``)."""
    if module in _TOP_NAMES:
        return _TOP_NAMES[module]
    parts = module.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise ExportRefused(f"tensor {module!r} has no llama.cpp counterpart")


def row_order(module: str, rows: int, config) -> torch.Tensor | None:
    """llama.cpp's q/k row order (``LlamaModel.permute``: the rotary halves interleaved), else None."""
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    n_head = next((n for tail, n in heads.items() if module.endswith(tail)), None)
    if n_head is None:
        return None
    return torch.arange(rows).reshape(n_head, 2, rows // n_head // 2).transpose(1, 2).reshape(rows)


# ------------------------------------------------------------------------------------------------ reading
def _llama_config(path: Path):
    config = AutoConfig.from_pretrained(str(path))
    if config.model_type != "llama":
        raise ExportRefused(f"the model is a {config.model_type!r} model")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ExportRefused(f"rope scaling {rope.get('rope_type')!r} is not exported")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ExportRefused("the model's linears have biases")
    return config


def _scalar_layers(path: Path, quantization_config: dict, tensors) -> dict[str, tuple]:
    """Module -> (codes [out, in], scales, zeros, GGUF type) of every quantized layer, checked."""
    if quantization_config["quant_method"] != SCALAR_METHOD:
        raise ExportRefused(f"{path.name} is a vector-quantized ({quantization_config['quant_method']}) checkpoint")
    layers = dict(quantization_config["config_for_layers"])
    embedding = quantization_config.get("embedding")
    if embedding and embedding.get("source") == "own":
        layers[f"{embedding['module']}.linear"] = embedding["layer_config"]
    out = {}
    for module, config in layers.items():
        if (config.get("act_bits") or 16) < 16:
            raise ExportRefused(f"{module} quantizes its activations to {config['act_bits']} bits")
        if config.get("bias"):
            raise ExportRefused(f"{module} has a bias")
        zeros = tensors.get_tensor(f"{module}.zeros")
        qtype = block_type(config["bits"], config["group_size"], zeros, module)
        if config["in_features"] % BLOCK:
            raise ExportRefused(f"{module} has {config['in_features']} inputs, not a multiple of {BLOCK}")
        codes = unpack_codes(tensors.get_tensor(f"{module}.codes"), config["bits"], config["in_features"])
        scales = tensors.get_tensor(f"{module}.scales")
        check_scales_exact(scales, codes, zeros, module)
        out[module.removesuffix(".linear")] = (codes, scales, zeros, qtype)
    return out


def gguf_tensors(path: str | os.PathLike) -> tuple[object, list[tuple[str, np.ndarray, Q]]]:
    """(the model config, [(GGUF name, raw data, type)]) of a checkpoint directory, in llama.cpp's order."""
    root = Path(path)
    try:
        _, quantization_config = read_quantization_config(root)
    except ValueError as exc:
        raise ExportRefused(f"{root} is not a quantized checkpoint ({exc})") from None
    config = _llama_config(root)
    try:
        opened = safe_open(str(root / WEIGHTS_NAME), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ExportRefused(f"cannot read {root / WEIGHTS_NAME} ({exc})") from None
    with opened as tensors:
        layers = _scalar_layers(root, quantization_config, tensors)
        quantized_prefixes = tuple(f"{m}." for m in layers) + tuple(f"{m}.linear." for m in layers)
        plain = {k: tensors.get_tensor(k) for k in tensors.keys() if not k.startswith(quantized_prefixes)}
    embedding = quantization_config.get("embedding") or {}
    if embedding.get("source") not in (None, "own"):  # the embedding reads the quantized head: llama.cpp's tie
        layers["model.embed_tokens"] = layers.pop(embedding["source"])
    entries = {}
    for module, (codes, scales, zeros, qtype) in layers.items():
        order = row_order(module, codes.shape[0], config)
        if order is not None:
            codes, scales, zeros = codes[order], scales[order], zeros[order]
        entries[module] = (pack_blocks(codes, scales, zeros, qtype), qtype)
    for key, tensor in plain.items():
        module, _, kind = key.rpartition(".")
        if kind != "weight":
            raise ExportRefused(f"tensor {key!r} has no llama.cpp counterpart")
        order = row_order(module, tensor.shape[0], config)
        entries[module] = plain_tensor(tensor if order is None else tensor[order])
    norms = {m for m in entries if m.endswith(("norm", "layernorm"))}
    for module in norms:  # llama.cpp computes norms in float32
        data, qtype = entries[module]
        entries[module] = (data, qtype) if qtype == Q.F32 else (gguf.quants.dequantize(data, qtype), Q.F32)
    ordered = sorted(entries, key=lambda m: (m.startswith("model.layers."), _block_index(m), m))
    return config, [(f"{gguf_name(m)}.weight", *entries[m]) for m in ordered]


def _block_index(module: str) -> int:
    parts = module.split(".")
    return int(parts[2]) if module.startswith("model.layers.") else -1


# ------------------------------------------------------------------------------------------------ writing
def _copy_tokenizer(source: Path, writer: gguf.GGUFWriter) -> int:
    """Every ``tokenizer.*`` key of ``source`` into ``writer``; returns the vocabulary size."""
    try:
        reader = gguf.GGUFReader(str(source))
    except (OSError, ValueError) as exc:
        raise ExportRefused(f"cannot read the tokenizer GGUF {source.name} ({exc})") from None
    tokens = 0
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
        if field.name == gguf.Keys.Tokenizer.LIST:
            tokens = len(field.data)
    if not tokens:
        raise ExportRefused(f"{source.name} holds no tokenizer ({gguf.Keys.Tokenizer.LIST} is missing)")
    return tokens


def _write_model_keys(writer: gguf.GGUFWriter, config, name: str, file_type: int) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def source_gguf(checkpoint: Path) -> Path | None:
    """The GGUF file the checkpoint was quantized from (the bundled model, a local .gguf), if any."""
    from .api import source_model_of
    from .models import gguf_file_of

    source = source_model_of(str(checkpoint))
    return None if source is None else gguf_file_of(source)


def export_gguf(checkpoint: str | os.PathLike, out: str | os.PathLike,
                tokenizer_gguf: str | os.PathLike | None = None) -> dict:
    """Write ``checkpoint`` (a scalar-quantized llama checkpoint directory) to ``out`` as a GGUF file.

    The tokenizer metadata comes from ``tokenizer_gguf``, else from the GGUF file the run was made from; a
    refusal (``ExportRefused``, a ValueError) is one line and leaves no file. Returns a summary: the path, its
    size, and how many tensors of each GGUF type it holds.
    """
    root, target = Path(checkpoint), Path(out)
    if target.suffix.lower() != ".gguf":
        raise ValueError(f"--out must name a .gguf file, got {str(target)!r}")
    config, tensors = gguf_tensors(root)
    tokenizer = Path(tokenizer_gguf) if tokenizer_gguf else source_gguf(root)
    if tokenizer is None or not tokenizer.is_file():
        raise ExportRefused("the run was not made from a GGUF file, whose tokenizer metadata the export copies; "
                            "pass --tokenizer-gguf FILE.gguf (a GGUF of the same model)")
    kinds = Counter(q.name for _, _, q in tensors)
    quantized = [q for _, _, q in tensors if q in _FILE_TYPES]
    file_type = _FILE_TYPES[Counter(quantized).most_common(1)[0][0]] if quantized else gguf.LlamaFileType.ALL_F32
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        writer = gguf.GGUFWriter(str(tmp), "llama")
        _write_model_keys(writer, config, root.name, int(file_type))
        vocab = _copy_tokenizer(tokenizer, writer)
        if vocab != config.vocab_size:
            raise ExportRefused(f"the tokenizer in {tokenizer.name} has {vocab} tokens, the model {config.vocab_size}")
        for name, data, qtype in tensors:
            writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return {"out": str(target), "size_bytes": target.stat().st_size, "tensors": dict(sorted(kinds.items())),
            "file_type": file_type.name}
