"""What a run will produce, known before it starts: model shapes (from the config alone where possible),
bits per weight and checkpoint size, and whether the hub can be reached."""

from __future__ import annotations

import collections
import dataclasses
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
    # VPTQ allocation "sensitivity": each layer's settings are measured at the start of the run, so the bits here
    # are the budget's bound (the plan spends up to it, never more) and the index bits are not known yet
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
    bits = methods.get(method).model_bits(config, info.linear_shapes)  # (checks the budget can be met)
    total, index = bits.total_bits_per_weight, bits.index_bits_per_weight
    planned = getattr(config, "allocation", "cap") == "sensitivity" and not config.layer_plan
    if planned:
        total = config.bits_budget
    quantized = math.ceil(total * info.linear_weights / 8) if planned else math.ceil(bits.total_bits / 8)
    other = 2 * info.other_params
    return Estimate(
        index_bits_per_weight=index, total_bits_per_weight=total,
        quantized_bytes=quantized, other_bytes=other, checkpoint_bytes=quantized + other,
        dense_bytes=2 * (info.linear_weights + info.other_params), planned=planned,
    )


# ------------------------------------------------------------------------------------------- time
# Seconds on this project's 2-core CPU machine (AMD EPYC), idle. Block forwards, per linear weight per
# calibration token (both passes: Hessians and targets, then the quantized outputs): 66-73 s for SmolLM2-135M's
# 106 M linear weights over 32 x 512 tokens (three runs of the presets, quant_report.json timings).
_REF_TOKENS = 32 * 512
_FORWARD_S = 69.0 / 106.2e6 / _REF_TOKENS
_IO_S = 9.0 / 135e6  # loading and saving, per parameter
_START_S = 5.0  # starting a job whatever its size (imports, tokenizer, calibration text), seen on the tiny model
# LRQ's training, in block forwards over the calibration (``_FORWARD_S`` units), from 12 measured runs
# (bench/results/quality*.jsonl, lrq_train): 323-375 s with 32 steps per block, 472-544 s with 64, so 2.3
# forwards per training token and 2.75 passes over the calibration whatever the steps. FP-chain targets
# (``target_chain="fp"``) took 58-106 s for the Hessians and targets instead of 37 s: half a pass more.
_LRQ_STEP = 2.3
_LRQ_FIXED = 2.75
_FP_CHAIN_FORWARDS = 1.5
_GPTQ_SWEEP_S = 0.3e-6  # per weight, a column sweep with one rounding per weight (not measured apart: rough)
_ROUND_S = 0.02e-6  # per weight, rounding to a grid

# VPTQ, layer by layer (``vptq_layer_phases``), fitted on 124 layers quantized alone on the machine with their
# real Hessians (bench/quant_cost.py: 4 SmolLM2 shapes x 31 settings, d 2-16, k 256-65536; README "Quantization
# time"). A nearest-centroid query through the k-d tree (d <= 8 with k >= 1024, or d <= 4 with k >= 256) costs
# exp(a + b d + c log2 k + e d log2 k) microseconds on one thread (fitted on 21 (d, k) pairs, each within ±30%:
# 0.21 us at d2 k256, 3.1 us at d6 k4096, 16 us at d8 k16384; ``_KD_QUERY_2T`` with k-means' two workers), by
# brute force 0.06 ns per centroid coordinate. A sweep column costs a fixed 63 us per codebook search on top, the
# error feedback 0.17 us per weight; a k-means iteration 3.7 ms on top of its queries; the rest of a layer
# (Hessian preparation, inverse Cholesky, dequantization, proxy loss) 5 ms + 23 ns per weight + 31 ps per
# in_features³. These held for a pipeline run in the same hour (102 s predicted, 102 s measured over the 210
# layers), but the machine ran 1.3-1.4x slower then than during the presets' other runs (the same 16-window
# evaluation took 22.1 s against 15.5 s), whose layers took 0.75-0.84x the prediction: ``_VPTQ_SCALE`` brings
# the estimate to the machine alone and unhurried, as the other constants are.
_VPTQ_SCALE = 0.78
# The native SIMD search (kernels/csrc/search_body.h; the default where it is usable and beats the tree): per query
# k (1.1 + d) x 0.045 ns on one thread of the AVX2 Zen 3 machine (d 2-12, k 256-16384, 256-65536 queries), where
# the tree took 1.25x the fit below (d6 k4096: 3.8-5.2 us against 3.1), so 0.036 ns in this machine's units; two
# threads split the queries.
_NATIVE_S = 0.036e-9
_NATIVE_DIM = 1.1
_KD_QUERY = (-2.124, 0.0111, -0.0192, 0.0457)
_KD_QUERY_2T = (-2.046, 0.0233, 0.0140, 0.0327)
_BRUTE_S = 0.06e-9
_SEARCH_CALL_S = 63e-6
_FEEDBACK_S = 0.17e-6
_KMEANS_ITER_S = 3.7e-3
_LAYER_S = 5e-3
_LAYER_WEIGHT_S = 23e-9
_LAYER_HESSIAN_S = 31e-12
# End-to-end distillation, per model parameter (embedding and head included) per token of a window, from the
# presets' runs on SmolLM2-135M (134.5 M parameters, 511 predicted tokens per window, 2 threads, alone on the
# machine; README "Calibrating on text the model writes itself"): a training step 3.0 s (forward,
# recomputation, backward; the progress bar's step times), a held-out check 1.5 s per window, the teacher's
# pass 1.1 s per window (37-41 s for 36 windows). Sampling (up to distill.SAMPLE_BATCH = 32 windows at once, one
# token at a time): 16 windows in 65-100 s, 24 in 73 s, so 50 s per batched pass + 1.5 s per window.
_KD_TOKENS = 134.5e6 * 511
_KD_STEP_S = 3.0 / _KD_TOKENS
# a step without activation checkpointing (distill_checkpointing "auto" where the activations fit): 0.74-0.78 of
# one with it (bench/distill_step.py, SmolLM2-135M, 512 tokens, float32, 2 threads: 7.7 vs 10.4 s, 6.4 vs 8.2 s)
_KD_NO_CHECKPOINT = 0.76
_KD_CHECK_S = 1.5 / _KD_TOKENS
_KD_TEACHER_S = 1.1 / _KD_TOKENS
_KD_SAMPLE_S = 1.5 / _KD_TOKENS
_KD_SAMPLE_PASS_S = 50.0 / _KD_TOKENS


def _search_backend(d: int, k: int) -> str:
    """The search ``kmeans.CodebookSearch`` will pick for a CPU float32 codebook of k d-vectors, without building
    or waiting for the native kernels."""
    from kernels import native

    from ..quant.device import nearest_backend
    from ..quant.kmeans import cpu_auto_backend

    choice = nearest_backend()
    return cpu_auto_backend(d, k, native.expected) if choice == "auto" else choice


def _query_seconds(d: int, k: int, threads: int = 1) -> float:
    """Seconds of one nearest-centroid query of a d-vector among k centroids (``kmeans.CodebookSearch``)."""
    backend = _search_backend(d, k)
    if backend == "native":
        return _NATIVE_S * k * (_NATIVE_DIM + d) / max(1, threads)
    if backend != "kdtree":
        return _BRUTE_S * d * k
    a, b, c, e = _KD_QUERY_2T if threads > 1 else _KD_QUERY
    bits = math.log2(k)
    return 1e-6 * math.exp(a + b * d + c * bits + e * d * bits)


def _kmeans_seconds(n: int, d: int, k: int, config, threads: int) -> float:
    """Seconds of ``weighted_kmeans`` on n d-vectors: (iters + 1) searches of the fitted sample (none when
    n <= k: every vector is its own centroid)."""
    if n <= k:
        return 0.0
    from ..quant.vptq import _fit_sample

    fit = min(n, _fit_sample(config, k))
    return (config.kmeans_iters + 1) * (fit * _query_seconds(d, k, threads) + _KMEANS_ITER_S)


def vptq_layer_phases(out_features: int, in_features: int, config, threads: int = 2) -> dict[str, float]:
    """Seconds the phases of ``vptq_quantize`` take for one [out, in] layer under ``config`` (its per-layer
    settings, ``vptq.layer_config``): k-means per codebook segment (outliers, groups, residual), the sweep (one
    search call per column and codebook; with a residual codebook a first sweep, then one with both), and the
    rest (Hessian preparation, inverse Cholesky, dequantization and proxy loss). Keys kmeans, sweep, other,
    whole."""
    from ..quant.vptq import layer_config, outlier_columns

    lc = layer_config(config, out_features, in_features)
    outliers = outlier_columns(in_features, lc.outlier_percent, lc.group_num)
    segments = [(outliers, lc.outlier_vector_len, lc.outlier_centroids, 0)] if outliers else []
    group = (in_features - outliers) // lc.group_num
    segments += [(group, lc.vector_len, lc.num_centroids, lc.num_res_centroids)] * lc.group_num
    kmeans = sweep = 0.0
    for columns, d, k, k_res in segments:
        rows = math.ceil(out_features / d)
        kmeans += _kmeans_seconds(rows * columns, d, k, lc, threads)
        call = _SEARCH_CALL_S + rows * _query_seconds(d, k)
        if k_res:
            kmeans += _kmeans_seconds(rows * columns, d, k_res, lc, threads)
            call = 2 * call + _SEARCH_CALL_S + rows * _query_seconds(d, k_res)
        sweep += columns * call
    sweep += _FEEDBACK_S * out_features * in_features * (2 if lc.num_res_centroids else 1)
    other = _LAYER_S + _LAYER_WEIGHT_S * out_features * in_features + _LAYER_HESSIAN_S * in_features ** 3
    phases = {"kmeans": kmeans, "sweep": sweep, "other": other}
    phases = {name: _VPTQ_SCALE * seconds for name, seconds in phases.items()}
    return {**phases, "whole": sum(phases.values())}


# VPTQ's allocation "sensitivity": one forward and backward pass (no weight gradients) per measured window, 26 s for
# 4 windows of SmolLM2-135M on the AVX2 machine where a distillation step took ~6 s: about one step per window; and
# k-means over the ladder for each distinct layer shape (7.4 s there for 4 shapes).
_SENS_WINDOW_S = _KD_STEP_S


def allocation_estimate(info: ModelInfo, config, seqlen: int) -> float:
    """Rough seconds of measuring a VPTQ per-layer plan (``quant.sensitivity.plan_config``) before the first
    block: 0 unless ``config.allocation`` is "sensitivity" and the config has no plan yet."""
    if getattr(config, "allocation", "cap") != "sensitivity" or config.layer_plan:
        return 0.0
    from ..quant.sensitivity import DISTORTION_ITERS, SENSITIVITY_WINDOWS, ladder

    params = info.linear_weights + info.other_params
    seconds = SENSITIVITY_WINDOWS * _SENS_WINDOW_S * params * max(int(seqlen) - 1, 1)
    fit = dataclasses.replace(config, kmeans_iters=DISTORTION_ITERS)
    for out_features, in_features in set(info.linear_shapes):
        for v, k in ladder(config):
            n = math.ceil(out_features / v) * in_features
            seconds += _kmeans_seconds(n, v, k, fit, 2) + n * _query_seconds(v, k, 2)
    return _VPTQ_SCALE * seconds


def sampling_estimate(params: int, windows: int, seqlen: int) -> float:
    """Rough seconds for the original model of ``params`` parameters to write ``windows`` windows of ``seqlen``
    tokens (``distill.sample_windows``, up to ``SAMPLE_BATCH`` at once)."""
    if windows <= 0:
        return 0.0
    from ..quant.distill import SAMPLE_BATCH

    passes = math.ceil(windows / SAMPLE_BATCH)
    return params * max(int(seqlen) - 1, 1) * (_KD_SAMPLE_S * windows + _KD_SAMPLE_PASS_S * passes)


def distill_estimate(params: int, config, samples: int, seqlen: int, linear_outputs: int | None = None) -> float:
    """Rough seconds of a config's end-to-end distillation (any method; 0 when off) for a model of ``params``
    parameters calibrated on ``samples`` windows of ``seqlen`` tokens (and the held-out windows drawn on top,
    ``with_heldout``): the teacher's pass over the windows it uses (not the self-written calibration windows:
    their top-k comes from the sampling), the sampled windows, the training steps and the held-out checks.
    ``linear_outputs`` (the quantized linears' out_features, summed) resolves "auto" checkpointing as the run will
    (``distill.use_checkpointing``); without it the steps are priced as checkpointed ones."""
    settings = config.to_dict()
    steps = settings.get("distill_iters", 0)
    if not steps:
        return 0.0
    from ..quant.distill import drawn_windows, eval_every, use_checkpointing, written_rows
    from ..quant.finetune import holdout_count, with_heldout

    samples = with_heldout(max(int(samples), 1), config)  # the held-out windows come on top of the calibration
    per_window = params * max(int(seqlen) - 1, 1)
    n_val = holdout_count(samples, settings.get("distill_holdout", 0.125)) or samples
    # exactly the windows distillation prepares: the teacher pass and the sampling run only for drawn windows
    drawn = drawn_windows(samples, config)
    teacher, sampled = drawn.calib_rows.numel(), drawn.sample_rows.numel()
    # the calibration windows the original wrote itself bring their teacher top-k from the sampling
    if settings.get("distill_data") != "sampled":
        teacher -= int(torch.isin(drawn.calib_rows, written_rows(samples, config)).sum())
    checks = 1 + math.ceil(steps / eval_every(config))
    batch = settings.get("distill_batch", 1)
    step_s = _KD_STEP_S
    if linear_outputs and not use_checkpointing(settings.get("distill_checkpointing", True), linear_outputs,
                                                int(seqlen) * batch, torch.device("cpu")):
        step_s *= _KD_NO_CHECKPOINT
    return sampling_estimate(params, sampled, seqlen) + per_window * (
        _KD_TEACHER_S * teacher + step_s * steps * batch + _KD_CHECK_S * checks * n_val)


def time_estimate(info: ModelInfo, config, samples: int, seqlen: int) -> float:
    """Rough seconds a run takes on a 2-core CPU like this project's (idle): block forwards over the
    calibration tokens, plus the method's own work (VPTQ: ``vptq_layer_phases`` of every block linear, with its
    per-layer settings; LRQ trains ``iters`` steps of ``batch_size`` windows per block, ``_LRQ_STEP`` forwards
    each, plus ``_LRQ_FIXED`` passes over the calibration; FP-chain targets add half a pass of block forwards;
    a config with ``act_order`` sweeps columns as GPTQ does; the ``calib_sampled_share`` windows the original
    writes: ``sampling_estimate``, left out as the run leaves them out when over ``SAMPLING_BUDGET_SHARE`` of a
    ``time_budget``; distillation: ``distill_estimate``). Layer-wise fine-tuning steps are not counted. A
    ``time_budget`` caps distillation at what the rest leaves of it."""
    weights, params = info.linear_weights, info.linear_weights + info.other_params
    tokens = max(int(samples), 1) * max(int(seqlen), 1)
    config = config.for_model(info.linear_shapes)
    settings = config.to_dict()
    # FP-chain targets: the original block runs on the original chain's inputs too
    forwards = _FP_CHAIN_FORWARDS if settings.get("target_chain") == "fp" else 1.0
    seconds = _START_S + forwards * _FORWARD_S * weights * tokens + _IO_S * params
    if "num_centroids" in settings and "vector_len" in settings:
        shapes = collections.Counter(info.linear_shapes)  # each distinct shape priced once
        # (a per-layer plan is priced as the cap allocation of the same budget: it is not known before the run)
        seconds += sum(count * vptq_layer_phases(*shape, config)["whole"] for shape, count in shapes.items())
        seconds += allocation_estimate(info, config, seqlen)
    elif "rank" in settings and "iters" in settings:
        steps = settings["iters"] * settings.get("batch_size", 1) * max(int(seqlen), 1)
        seconds += _FORWARD_S * weights * (_LRQ_STEP * steps + _LRQ_FIXED * tokens)
    else:
        seconds += (_GPTQ_SWEEP_S if "act_order" in settings else _ROUND_S) * weights
    from ..quant.distill import SAMPLING_BUDGET_SHARE, sampled_count

    # the block stage sees exactly ``samples`` windows (distillation's check windows are drawn on top)
    writing = sampling_estimate(params, sampled_count(max(int(samples), 1), config), seqlen)
    budget = settings.get("time_budget", 0.0) or 0.0
    if budget > 0 and writing > SAMPLING_BUDGET_SHARE * budget:  # as the run decides: the windows stay text
        writing, config = 0.0, dataclasses.replace(config, calib_sampled_share=0.0)
    seconds += writing
    outputs = sum(o for o, _ in info.linear_shapes)
    distilling = distill_estimate(params, config, samples, seqlen, outputs or None)
    if budget > 0:  # distillation gets what the block stage leaves of the budget (the block stage is never cut)
        distilling = min(distilling, max(0.0, budget - seconds))
    return seconds + distilling
