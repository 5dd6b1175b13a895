"""What a run will produce, known before it starts: model shapes (from the config alone where possible),
bits per weight and checkpoint size, and whether the hub can be reached."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import socket
import time
import urllib.parse
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..models import KNOWN_MODELS, load_model
from ..quant import methods
from ..quant.blocks import block_linears, decoder_blocks
from ..quant.pipeline import total_linear_shapes
from .queue import error_reason


@dataclass(frozen=True)
class ModelInfo:
    """What a quantization run will touch, known without running it."""

    name: str
    num_blocks: int
    modules: tuple[str, ...]  # linear names inside a block, e.g. ("self_attn.q_proj", ...)
    linear_shapes: tuple[tuple[int, int], ...]  # (out, in) of every block linear, block by block
    other_params: int  # parameters kept as they are (embeddings, norms, biases, LM head if untied)

    @property
    def linear_weights(self) -> int:
        return sum(o * i for o, i in self.linear_shapes)


@dataclass(frozen=True)
class Estimate:
    index_bits_per_weight: float
    total_bits_per_weight: float  # including codebooks, scales, permutations
    quantized_bytes: int  # the quantized linears
    other_bytes: int  # everything else at 16 bits
    checkpoint_bytes: int  # quantized_bytes + other_bytes (tokenizer and JSON files not counted)
    dense_bytes: int  # the whole model at 16 bits


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def describe_model(model) -> tuple[int, tuple[str, ...], tuple[tuple[int, int], ...], int]:
    """(blocks, linear names in a block, linear shapes, other parameter count) of a causal LM (meta is fine)."""
    blocks = decoder_blocks(model)
    shapes = tuple(total_linear_shapes(model))
    total = sum(p.numel() for p in model.parameters())
    return len(blocks), tuple(block_linears(blocks[0])), shapes, total - sum(o * i for o, i in shapes)


@functools.lru_cache(maxsize=32)
def _info_cached(name: str, stamp: float) -> ModelInfo:
    if name in KNOWN_MODELS:
        model, _ = load_model(name)
    else:
        model = _meta_model(name)
    blocks, modules, shapes, other = describe_model(model)
    return ModelInfo(name=name, num_blocks=blocks, modules=modules, linear_shapes=shapes, other_params=other)


def model_info(name: str) -> ModelInfo:
    """``ModelInfo`` of a model name (bundled / tiny), a dense local model directory, or a hub id.

    Local directories and hub ids are read from their config alone (the model is built on the meta device,
    no weights). Raises ValueError with what to do instead: an unknown name, a directory without config.json,
    an already quantized checkpoint, or a hub id while the hub cannot be reached.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model must be one of {', '.join(KNOWN_MODELS)}, a local directory or a hub id, "
                         f"got {name!r}")
    name = name.strip()
    stamp = 0.0
    if name in KNOWN_MODELS:
        pass
    elif os.path.isdir(name):
        config_path = os.path.join(name, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"directory {name!r} has no config.json; expected a Hugging Face model directory")
        _refuse_quantized(config_path, name)
        stamp = os.path.getmtime(config_path)
    elif _HUB_ID.match(name):
        reachable, why = hub_reachable()
        if not reachable:
            raise ValueError(f"cannot reach the Hugging Face hub to fetch {name!r} ({why}); offline you can use "
                             f"{', '.join(KNOWN_MODELS)} or a local model directory")
    else:
        raise ValueError(f"model {name!r} is not a built-in name ({', '.join(KNOWN_MODELS)}), an existing local "
                         "directory, or a hub id of the form owner/name")
    try:
        return _info_cached(name, stamp)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - config/hub errors of every kind become one clear message
        raise ValueError(f"cannot read model {name!r}: {error_reason(exc)[:300]}") from None


def _refuse_quantized(config_path: str, name: str) -> None:
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from None
    if isinstance(config, dict) and "quantization_config" in config:
        raise ValueError(f"{name!r} is already a quantized checkpoint; quantize a dense model, or chat with this "
                         "one in the Chat tab")


def _meta_model(source: str):
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


_HUB_CHECK: dict[str, tuple[float, bool, str]] = {}


def hub_reachable(timeout: float = 3.0, ttl: float = 60.0) -> tuple[bool, str]:
    """(whether the hub endpoint accepts a TCP connection, why not), cached for ``ttl`` seconds. A quick
    check that replaces the hub client's long retry loop when the machine is offline."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False, "HF_HUB_OFFLINE is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    cached = _HUB_CHECK.get(endpoint)
    if cached and time.monotonic() - cached[0] < ttl:
        return cached[1], cached[2]
    parsed = urllib.parse.urlparse(endpoint)
    host, port = parsed.hostname or "huggingface.co", parsed.port or (443 if parsed.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            ok, why = True, ""
    except OSError as exc:
        ok, why = False, f"{host}: {exc.strerror or exc}"
    _HUB_CHECK[endpoint] = (time.monotonic(), ok, why)
    return ok, why


def estimate(info: ModelInfo, method: str, config) -> Estimate:
    """Bits per weight and checkpoint size of quantizing ``info``'s block linears with ``method``/``config``."""
    bits = methods.get(method).model_bits(config, info.linear_shapes)
    quantized = math.ceil(bits.total_bits / 8)
    other = 2 * info.other_params
    return Estimate(
        index_bits_per_weight=bits.index_bits_per_weight, total_bits_per_weight=bits.total_bits_per_weight,
        quantized_bytes=quantized, other_bytes=other, checkpoint_bytes=quantized + other,
        dense_bytes=2 * (info.linear_weights + info.other_params),
    )


# ------------------------------------------------------------------------------------------- time
# Seconds per quantized weight on this project's 2-core CPU machine, idle, from one measured run
# (README "Quantization time": SmolLM2-135M, 106 M linear weights, VPTQ v6 k4096, 5 k-means iterations, 32 × 512
# calibration tokens: k-means 160.7 s, sweep 122.5 s, block forwards 60.1 s, load and save 9 s).
_REF_TOKENS = 32 * 512
_FORWARD_S = 60.1 / 106.2e6 / _REF_TOKENS  # per weight per calibration token (both passes)
_KMEANS_S = 160.7 / 106.2e6  # per weight at v6 k4096, 5 iterations
_SWEEP_S = 122.5 / 106.2e6  # per weight at v6 k4096
_IO_S = 9.0 / 135e6  # loading and saving, per parameter
_START_S = 5.0  # starting a job whatever its size (imports, tokenizer, calibration text), seen on the tiny model
_GPTQ_SWEEP_S = 0.3e-6  # per weight, a column sweep with one rounding per weight (not measured apart: rough)
_ROUND_S = 0.02e-6  # per weight, rounding to a grid
# End-to-end distillation, per model parameter (embedding and head included) per token of a window, from two
# measured runs on SmolLM2-135M (134.5 M parameters, 511 predicted tokens per window, 2 threads, alone on the
# machine; bench/distill_variants.py, 64 and 128 steps; the "2.5 bits" preset's 16): a training step 4.14 s
# (forward, recomputation, backward), a held-out check 1.65-3.6 s per window (2.6 taken), the teacher's pass
# 1.15-1.31 s per window. Sampling (up to distill.SAMPLE_BATCH = 32 windows at once, one token at a time):
# 32 windows of 512 tokens in 138.6 s, 16 in 87.9 s, so 37.4 s per batched pass + 3.16 s per window.
_KD_TOKENS = 134.5e6 * 511
_KD_STEP_S = 4.14 / _KD_TOKENS
_KD_CHECK_S = 2.6 / _KD_TOKENS
_KD_TEACHER_S = 1.31 / _KD_TOKENS
_KD_SAMPLE_S = 3.16 / _KD_TOKENS
_KD_SAMPLE_PASS_S = 37.4 / _KD_TOKENS


def sampling_estimate(params: int, windows: int, seqlen: int) -> float:
    """Rough seconds for the original model of ``params`` parameters to write ``windows`` windows of ``seqlen``
    tokens (``distill.sample_windows``, up to ``SAMPLE_BATCH`` at once)."""
    if windows <= 0:
        return 0.0
    from ..quant.distill import SAMPLE_BATCH

    passes = math.ceil(windows / SAMPLE_BATCH)
    return params * max(int(seqlen) - 1, 1) * (_KD_SAMPLE_S * windows + _KD_SAMPLE_PASS_S * passes)


def distill_estimate(params: int, config, samples: int, seqlen: int) -> float:
    """Rough seconds of a config's end-to-end distillation (any method; 0 when off) for a model of ``params``
    parameters calibrated on ``samples`` windows of ``seqlen`` tokens (and the held-out windows drawn on top,
    ``with_heldout``): the teacher's pass over the windows it uses, the sampled windows, the training steps and
    the held-out checks."""
    settings = config.to_dict()
    steps = settings.get("distill_iters", 0)
    if not steps:
        return 0.0
    from ..quant.distill import drawn_windows, eval_every
    from ..quant.finetune import holdout_count, with_heldout

    samples = with_heldout(max(int(samples), 1), config)  # the held-out windows come on top of the calibration
    per_window = params * max(int(seqlen) - 1, 1)
    n_val = holdout_count(samples, settings.get("distill_holdout", 0.125)) or samples
    # exactly the windows distillation prepares: the teacher pass and the sampling run only for drawn windows
    drawn = drawn_windows(samples, config)
    teacher, sampled = drawn.calib_rows.numel(), drawn.sample_rows.numel()
    checks = 1 + math.ceil(steps / eval_every(config))
    return sampling_estimate(params, sampled, seqlen) + per_window * (
        _KD_TEACHER_S * teacher + _KD_STEP_S * steps * settings.get("distill_batch", 1) + _KD_CHECK_S * checks * n_val)


def time_estimate(info: ModelInfo, config, samples: int, seqlen: int) -> float:
    """Rough seconds a run takes on a 2-core CPU like this project's (idle): block forwards over the
    calibration tokens, plus the method's own work scaled from one measured VPTQ run (k-means and sweep cost
    grow with the index bits per vector element, k-means with its iterations; LRQ trains ``iters`` steps of
    ``batch_size`` windows per block, about three forwards each; a config with ``act_order`` sweeps columns as
    GPTQ does; the ``calib_sampled_share`` windows the original writes: ``sampling_estimate``; distillation:
    ``distill_estimate``). Layer-wise fine-tuning steps are not counted."""
    weights, params = info.linear_weights, info.linear_weights + info.other_params
    tokens = max(int(samples), 1) * max(int(seqlen), 1)
    seconds = _START_S + _FORWARD_S * weights * tokens + _IO_S * params
    settings = config.to_dict()
    if "num_centroids" in settings and "vector_len" in settings:
        bits = math.log2(max(settings["num_centroids"], 2))
        if settings.get("num_res_centroids"):
            bits += math.log2(settings["num_res_centroids"])
        scale = (bits / 12.0) * (6.0 / max(settings["vector_len"], 1))
        seconds += weights * scale * (_KMEANS_S * settings.get("kmeans_iters", 5) / 5.0 + _SWEEP_S)
    elif "rank" in settings and "iters" in settings:
        steps = settings["iters"] * settings.get("batch_size", 1) * max(int(seqlen), 1)
        seconds += 3 * _FORWARD_S * weights * steps
    else:
        seconds += (_GPTQ_SWEEP_S if "act_order" in settings else _ROUND_S) * weights
    from ..quant.distill import sampled_count

    # the block stage sees exactly ``samples`` windows (distillation's check windows are drawn on top)
    seconds += sampling_estimate(params, sampled_count(max(int(samples), 1), config), seqlen)
    return seconds + distill_estimate(params, config, samples, seqlen)
