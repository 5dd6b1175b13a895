"""High-level entry points shared by the CLI and the app: quantize into a checkpoint directory, evaluate."""

from __future__ import annotations

import hashlib
import itertools
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from . import __version__
from .data import calibration_windows
from .eval import EvalResult, evaluate
from .models import BUNDLED, NotStreamable, load_model, model_directory, open_streaming
from .quant import distributed, methods
from .quant.blocks import blocks_prefix, decoder_blocks
from .quant.config import CalibConfig
from .quant.embedding import TIED, EmbeddingParts, head_and_embedding_names, normed_block_outputs, quantize_embeddings
from .quant.finetune import with_heldout
from .quant.pipeline import BlockDone, quantize_model, total_linear_shapes
from .quant.source import SafetensorsWeights
from .resume import PartialRun, tensor_digest
from .storage.checkpoint import pack_layer, quant_method_of, save_packed

REPORT_NAME = "quant_report.json"


def versions() -> dict:
    return {"vptq_core": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def build_report(model_source: str, result, calib: CalibConfig, device: str) -> dict:
    """The ``quant_report.json`` body: settings, per-layer reports, bits, timings, versions."""
    return {
        "model": {"source": model_source},
        "method": result.method,
        "settings": result.config,
        "calibration": calib.to_dict(),
        "device": device,
        "threads": torch.get_num_threads(),
        "summary": result.summary(),
        "layers": [r.to_dict() for r in result.reports],
        "versions": versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def quantize_to_dir(
    model_name: str,
    method: str,
    config,
    calib: CalibConfig,
    out_dir: str | Path,
    device: str | None = None,
    on_layer: Callable | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_start: Callable[[int], None] | None = None,
    evaluate_after: bool = False,
    save_dtype: torch.dtype = torch.bfloat16,
    resume: bool = False,
    stream: bool | str = "auto",
    on_step: Callable[[str, int, int, float], None] | None = None,
    head: bool = False,
    embedding: bool = False,
) -> tuple[Path, dict]:
    """Load ``model_name``, quantize it with ``method``/``config`` on ``calib`` data, write the packed
    checkpoint to ``out_dir``. Returns (directory, summary).

    Memory: with ``stream`` "auto" (default) a model stored as safetensors is built on the meta device and
    each block is read from disk when it is quantized and freed afterwards (``models.open_streaming``), so
    the run holds about one block plus the calibration activations and the non-block tensors, whatever the
    model's size; other sources (tiny models built in code, .bin checkpoints) are loaded whole in their own
    dtype. ``stream=True`` refuses those, ``False`` always loads the whole model.

    Every finished block is written to ``<out_dir>/.partial`` (``vptq_core.resume``). A run that is
    interrupted (killed, or cancelled through ``should_stop``: ``summary["cancelled"] = True``, nothing else
    is written) continues from its last finished block with ``resume=True`` and writes the same checkpoint as
    an uninterrupted run; a resume with a different model, method, settings, calibration, save dtype or
    device is refused (ValueError saying what differs). ``resume=False`` starts over, discarding an
    unfinished run. The partial directory is removed once the checkpoint is written.

    ``calib_sampled_share`` (any method) has the original model write a share of the calibration windows itself
    before the blocks are quantized: the model is then loaded whole too.

    End-to-end distillation (VPTQ ``distill_iters``; any method's after-model hooks) trains the whole
    quantized model against the original (loaded a second time): the model is then loaded whole (no
    streaming), a resume starts over (the finished blocks are quantized again), and ``on_step(phase, step,
    steps, loss)`` reports every training step; a cancel during it writes nothing, like any other. VPTQ's
    ``allocation="sensitivity"`` (a per-layer plan measured on the whole original model before the first block)
    loads the model whole as well, and a resume starts over.

    ``head`` / ``embedding``: also quantize the LM head (its Hessian from the final-norm outputs of the
    quantized blocks) and / or the input embedding, with the same method and settings
    (``quant.embedding``); with tied weights either one quantizes the shared matrix, and ``embedding`` makes
    the input embedding read its rows. Such checkpoints load with ``load_quantized``.

    Several ranks (``quant.distributed`` active, e.g. ``torchrun ... -m vptq_core quantize``): every rank calls
    this with the same arguments (``device``: its own, from ``distributed.init_from_env``); the linears of each
    block are split across the ranks, and rank 0 alone writes ``.partial`` and the checkpoint, which equals a
    single-process run's bit for bit. ``out_dir`` must be on a file system every rank sees (resume reads it).
    """
    method_obj = methods.get(method)
    method_obj.check_config(config)
    parts = EmbeddingParts(head=head, embedding=embedding)
    if parts.any and method_obj.quantize_linear is None:
        raise ValueError(f"method {method!r} quantizes whole blocks; the LM head and embedding can be quantized "
                         "with vptq, gptq or rtn")
    if stream not in ("auto", True, False):
        raise ValueError(f"stream must be 'auto', True or False, got {stream!r}")
    whole = [hook.phase for hook in method_obj.after_model if hook.applies(config)]
    if whole and stream is True:
        raise ValueError(f"cannot stream block by block with {', '.join(whole)}: it trains the whole model")
    planned = [hook.phase for hook in method_obj.before_blocks if hook.applies(config)]
    if planned and stream is True:
        raise ValueError(f"cannot stream block by block with {', '.join(planned)}: it measures the whole model")
    source, stream_note = None, "off"
    if whole:
        stream, stream_note = False, f"off: {', '.join(whole)} trains the whole model"
    elif planned:
        stream, stream_note = False, f"off: {', '.join(planned)} measures the whole model"
    elif getattr(config, "calib_sampled_share", 0):
        if stream is True:
            raise ValueError("cannot stream block by block with calib_sampled_share: the original model writes those "
                             "calibration windows itself, which needs the whole model")
        stream, stream_note = False, "off: calib_sampled_share samples from the whole model"
    if stream is not False:
        try:
            source = open_streaming(model_name)
            stream_note = "on"
        except NotStreamable as exc:
            if stream is True:
                raise ValueError(f"cannot stream {model_name!r} block by block: {exc}") from None
            stream_note = f"off: {exc}"
    if source is not None:
        model, tok = source.model, source.tokenizer
    else:
        model, tok = load_model(model_name, dtype="auto")
    # with distillation, its held-out check windows are drawn on top of the calibration windows (``with_heldout``)
    calib_ids = calibration_windows(tok, calib.text, with_heldout(calib.samples, config), calib.seqlen, calib.seed)
    if on_start:
        on_start(len(total_linear_shapes(model)))
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    blocks_total = len(decoder_blocks(model))
    fingerprint = run_fingerprint(model_name, model, method_obj, config, calib, calib_ids, save_dtype, dev)
    partial = PartialRun(out_dir)
    main = distributed.is_main()  # with several ranks (torchrun) every rank computes, rank 0 alone writes
    point = None
    if resume and partial.exists() and not whole and not planned:  # a plan is measured on the whole model, again
        point = partial.resume_point(fingerprint, blocks_total)
    distributed.barrier()  # every rank has read the unfinished run before rank 0 may replace it
    if point is None and main:
        partial.start(fingerprint, blocks_total)

    def persist(done: BlockDone) -> None:
        if not main:
            return
        packed = {name: pack_layer(state, save_dtype) for name, state in done.states.items()}
        kinds = {quant_method_of(state) for state in done.states.values()}
        if len(kinds) != 1:
            raise ValueError(f"block {done.index} mixes quantized layer kinds {sorted(kinds)}")
        partial.write_block(done, packed, kinds.pop())

    _, result = quantize_model(
        model, calib_ids, method_obj, config, on_layer=on_layer, should_stop=should_stop, device=dev, inplace=True,
        weights=source.weights if source is not None else None, capture_dtype=torch.float32, on_block=persist,
        resume=point, keep_states=bool(whole), on_step=on_step,
        reference=load_model(model_name, dtype="auto")[0] if whole else None,
    )
    summary = result.summary()
    summary["resumed_from_block"] = point.blocks_done if point is not None else 0
    summary["streaming"] = stream_note
    if distributed.active():
        summary["ranks"] = distributed.world_size()
    if result.cancelled:
        summary["partial"] = str(partial.dir)
        return Path(out_dir), summary
    if not main:
        distributed.barrier()  # returns once rank 0 has written the checkpoint
        return Path(out_dir), summary
    report = build_report(model_name, result, calib, dev)
    report["streaming"] = stream_note
    report["resumed_from_block"] = summary["resumed_from_block"]
    dims = partial.layer_dims()
    if source is not None:
        source.fill_remaining(skip=tuple(dims))  # block norms (small) for the writer; quantized linears stay on meta
    layers = partial.packed_layers()
    if whole:  # the blocks in .partial are from before the whole-model training: write the trained states
        layers = ((name, pack_layer(state, save_dtype)) for name, state in result.states.items())
    stored_embedding = None
    if parts.any:
        # the head's inputs: the last block's outputs (kept in .partial), or after whole-model training a
        # forward of the trained model
        last = _last_block_outputs(model, calib_ids, dev) if whole else partial.block_outputs(blocks_total)
        extra, stored_embedding, report["embeddings"] = _quantize_embeddings(
            model, last, method_obj, config, parts, dev, save_dtype)
        dims.update({name: (layer.in_features, layer.out_features) for name, layer in extra})
        layers = itertools.chain(layers, extra)
        summary["embeddings"] = report["embeddings"]
    out = save_packed(model, tok, partial.quant_method(), dims, layers, out_dir, report=report,
                      dtype=save_dtype, embedding=stored_embedding)
    partial.remove()
    distributed.barrier()
    del model, source
    if evaluate_after:
        ev = evaluate_model(str(out), reference=model_name, seqlen=calib.seqlen, max_windows=16)
        report["eval"] = ev.to_dict()
        summary["eval"] = ev.to_dict()
        _merge_report(out, {"eval": report["eval"]})
    return out, summary


def _last_block_outputs(model, calib_ids: torch.Tensor, device, batch: int = 4) -> torch.Tensor:
    """The last decoder block's outputs on the calibration windows, from a forward of the whole model."""
    block = decoder_blocks(model)[-1]
    seen: list[torch.Tensor] = []

    def keep(module, args, output):
        seen.append((output[0] if isinstance(output, tuple) else output).detach().float().cpu())

    handle = block.register_forward_hook(keep)
    moved = model.to(device)
    try:
        with torch.no_grad():
            for i in range(0, calib_ids.shape[0], batch):
                moved(calib_ids[i : i + batch].to(device), use_cache=False)
    finally:
        handle.remove()
        model.to("cpu")
    return torch.cat(seen)


def _quantize_embeddings(model, last_outputs, method, config, parts, device, save_dtype):
    """The packed LM head / input embedding (``quant.embedding``), what ``save_packed`` takes for the
    embedding (a packed layer, the head's name, or None) and a report entry."""
    head_name, embed_name, _ = head_and_embedding_names(model)
    head_inputs = normed_block_outputs(model, blocks_prefix(model), last_outputs, device)
    done = quantize_embeddings(model, head_inputs, method, config, parts, device)
    extra, stored, entry = [], None, {**parts.to_dict(), "seconds": round(done.seconds, 2)}
    for name, r in done.results.items():
        if r == TIED:
            stored, entry["embedding_source"] = head_name, head_name
            continue
        packed = pack_layer(r.state, save_dtype)
        entry[name] = {"rel_proxy_loss": r.rel_proxy_loss, "rel_weight_error": r.rel_weight_error}
        if name == embed_name:
            stored, entry["embedding_source"] = packed, "own"
        else:
            extra.append((name, packed))
    return extra, stored, entry


_VOLATILE_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype", "name_or_path")


def run_fingerprint(model_name: str, model, method, config, calib: CalibConfig, calib_ids: torch.Tensor,
                    save_dtype: torch.dtype, device: str) -> dict:
    """What must match for a run to resume another: the model (name, its files, its config), the method
    and settings, the calibration (settings and the token ids themselves), the save dtype and the device."""
    directory = None
    try:
        directory = model_directory(model_name)
    except ValueError:
        pass
    files = None
    if directory is not None:
        try:
            files = SafetensorsWeights(directory).fingerprint()
        except ValueError:
            files = None
    model_config = {k: v for k, v in model.config.to_dict().items()
                    if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    config_digest = hashlib.sha1(json.dumps(model_config, sort_keys=True, default=str).encode()).hexdigest()
    return {
        "model": {"source": model_name, "files": files, "config_sha1": config_digest},
        "method": method.name, "settings": config.to_dict(), "calibration": calib.to_dict(),
        "calibration_ids": tensor_digest(calib_ids), "save_dtype": str(save_dtype).removeprefix("torch."),
        "device": torch.device(device).type,
    }


def partial_status(out_dir: str | Path) -> dict | None:
    """{"blocks_done", "blocks_total", "dir"} of an unfinished run in ``out_dir``, or None."""
    partial = PartialRun(out_dir)
    status = partial.status()
    return None if status is None else {**status, "dir": str(partial.dir)}


def _merge_report(out: Path, extra: dict) -> None:
    path = Path(out) / REPORT_NAME
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    data.update(extra)
    path.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")


def source_model_of(path: str) -> str | None:
    """The original model a quantized checkpoint directory was made from (from its report)."""
    report = Path(path) / REPORT_NAME
    if not report.is_file():
        return None
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    source = data.get("model", {}).get("source") if isinstance(data, dict) else None
    return source if isinstance(source, str) else None


def evaluate_model(
    model: str, reference: str | None = "auto", text: str = "wiki", seqlen: int = 512,
    max_windows: int | None = None, dtype: str | None = None, head_bits: int | str = "auto",
) -> EvalResult:
    """Evaluate a model name or directory; ``reference`` "auto" compares a quantized checkpoint with the
    model it was made from, "none" disables the comparison. ``head_bits``: a quantized checkpoint's LM head
    at run time (``load_quantized``)."""
    qmodel, tok = load_model(model, dtype=dtype, head_bits=head_bits)
    ref_model = None
    if reference == "auto":
        reference = source_model_of(model) if Path(model).is_dir() else None
    if reference and reference != "none":
        ref_model, _ = load_model(reference, dtype=dtype or (torch.bfloat16 if reference == BUNDLED else None))
    return evaluate(qmodel, tok, text=text, seqlen=seqlen, max_windows=max_windows, reference=ref_model)
