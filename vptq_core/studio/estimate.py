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

from transformers import AutoConfig

from ..models import KNOWN_MODELS, load_model
from ..quant import methods
from ..quant.blocks import block_linears, decoder_blocks, lookup_params, total_linear_shapes
from ..quant.cost import RunSize, estimate_seconds, sampling_seconds
from ..quant.distill_hook import distill_seconds
from ..quant.run_plan import RunPlan, plan_run
from ..quant.vptq_cost import allocation_seconds, vptq_layer_phases  # noqa: F401 - callers import it from here
from ..storage.skeleton import empty_model
from .queue import error_reason


@dataclass(frozen=True)
class ModelInfo:
    """What a quantization run will touch, known without running it."""

    name: str
    num_blocks: int
    modules: tuple[str, ...]  # linear names inside a block, e.g. ("self_attn.q_proj", ...)
    linear_shapes: tuple[tuple[int, int], ...]  # (out, in) of every block linear, block by block
    other_params: int  # parameters kept as they are (embeddings, norms, biases, LM head if untied)
    lookup_params: int = 0  # an untied input embedding's parameters (``blocks.lookup_params``): no pass multiplies

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
    # a plan made at the start of the run (VPTQ allocation "sensitivity": each layer's settings measured): the bits
    # here are the plan's bound (it spends up to it, never more) and the index bits are not known yet
    planned: bool = False


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
    return ModelInfo(name=name, num_blocks=blocks, modules=modules, linear_shapes=shapes, other_params=other,
                     lookup_params=lookup_params(model))


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
    """The model's skeleton for its shapes, built without changing torch's default dtype (``storage.skeleton``):
    a config that names a dtype would otherwise make it every thread's default while the model is built."""
    return empty_model(AutoConfig.from_pretrained(source), buffers=False)


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
    method = methods.get(method)
    bits = method.model_bits(config, info.linear_shapes)  # (checks the budget can be met)
    total, index = bits.total_bits_per_weight, bits.index_bits_per_weight
    bound = method.planned_bits(config)
    planned = bound is not None
    if planned:
        total = bound
    quantized = math.ceil(total * info.linear_weights / 8) if planned else math.ceil(bits.total_bits / 8)
    other = 2 * info.other_params
    return Estimate(
        index_bits_per_weight=index, total_bits_per_weight=total,
        quantized_bytes=quantized, other_bytes=other, checkpoint_bytes=quantized + other,
        dense_bytes=2 * (info.linear_weights + info.other_params), planned=planned,
    )


# ------------------------------------------------------------------------------------------- time
# The cost models live beside the methods (quant/cost.py, quant/vptq_cost.py, quant/distill_hook.py); each method
# says which are its own (``Method.cost``, its hooks' ``cost``, or a whole ``Method.estimate_seconds``).


def run_size(info: ModelInfo, samples: int, seqlen: int) -> RunSize:
    """What the cost models know of a run of ``info`` on ``samples`` windows of ``seqlen`` tokens."""
    return RunSize(info.linear_shapes, info.other_params, int(samples), int(seqlen),
                   lookup_params=info.lookup_params)


def method_for(config) -> methods.Method:
    """The method a config is priced as when the caller does not name one: the first registered method that
    takes its config class (ScalarConfig: gptq). Callers that know the method pass it to ``time_estimate``."""
    for method in methods.all_methods():
        if type(config) is method.config_class:
            return method
    raise ValueError(f"no registered method takes a {type(config).__name__}; name the method")


def time_estimate(info: ModelInfo, config, samples: int, seqlen: int,
                  method: str | methods.Method | None = None) -> float:
    """Rough seconds a run takes on a 2-core CPU like this project's (idle), as ``method`` prices it
    (``quant.cost.estimate_seconds``: the method's own estimate, or its stages' costs summed); under a time budget,
    the seconds of what the run's plan keeps (``plan_estimate``)."""
    method = methods.get(method) if method is not None else method_for(config)
    if method.estimate_seconds is None and method.needs(config).time_budget > 0:
        return plan_estimate(info, config, samples, seqlen, method).seconds
    return estimate_seconds(method, run_size(info, samples, seqlen), config)


def plan_estimate(info: ModelInfo, config, samples: int, seqlen: int, method: str | methods.Method | None = None,
                  speed: float = 1.0) -> RunPlan:
    """The plan a run of ``info`` would make on a device ``speed`` times the reference machine
    (``quant.run_plan.plan_run``): its seconds per stage and, under a time budget, what it gives up and why."""
    method = methods.get(method) if method is not None else method_for(config)
    return plan_run(method, run_size(info, samples, seqlen), config, speed)


def allocation_estimate(info: ModelInfo, config, seqlen: int) -> float:
    """Rough seconds of measuring a VPTQ per-layer plan before the first block (``vptq_cost.allocation_seconds``):
    0 unless ``config.allocation`` is "sensitivity" and the config has no plan yet."""
    return allocation_seconds(run_size(info, 0, seqlen), config)


def sampling_estimate(params: int, windows: int, seqlen: int) -> float:
    """Rough seconds for the original model of ``params`` parameters to write ``windows`` windows of ``seqlen``
    tokens (``quant.cost.sampling_seconds``)."""
    return sampling_seconds(params, windows, seqlen)


def distill_estimate(params: int, config, samples: int, seqlen: int, linear_outputs: int | None = None) -> float:
    """Rough seconds of a config's end-to-end distillation (``distill_hook.distill_seconds``)."""
    return distill_seconds(params, config, samples, seqlen, linear_outputs)
