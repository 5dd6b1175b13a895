"""High-level entry points shared by the CLI and the app: quantize into a checkpoint directory, evaluate."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from . import __version__
from .data import DEFAULT_EVAL_SPLIT, EVAL_SPLITS, PYDOCS, WIKI, calibration_windows
from .eval import EvalResult, evaluate
from .models import BUNDLED, NotStreamable, cache_dir, load_model, model_directory, open_streaming
from .quant import distributed, methods
from .quant.block_pace import measure_block_speed
from .quant.blocks import blocks_prefix, decoder_blocks, lookup_params, total_linear_shapes
from .quant.calib_windows import with_heldout
from .quant.config import CalibConfig
from .quant.cost import RunSize
from .quant.device import widened_linears
from .quant.distributed_once import once
from .quant.embedding import TIED, EmbeddingParts, head_and_embedding_names, normed_block_outputs, quantize_embeddings
from .quant.pipeline import quantize_model
from .quant.progress import OnProgress, Progress
from .quant.results import BlockDone
from .quant.rotate import rotate_model_, rotated_dir, rotates
from .quant.run_plan import RunPlan, measure_speed, measure_writing_speed, plan_run
from .quant.source import SafetensorsWeights
from .resume import PartialRun, tensor_digest
from .storage.checkpoint import pack_layer, quant_method_of, save_packed

REPORT_NAME = "quant_report.json"


def versions() -> dict:
    return {"vptq_core": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def calibration_record(calib: CalibConfig) -> dict:
    """The calibration as the report keeps it: a text file by its base name and SHA-256, never where it lay."""
    data = calib.to_dict()
    text = data.get("text")
    if text not in (WIKI, PYDOCS) and Path(text).is_file():
        data["text"] = Path(text).name
        data["text_sha256"] = hashlib.sha256(Path(text).read_bytes()).hexdigest()
    return data


def build_report(model_source: str, result, calib: CalibConfig, device: str) -> dict:
    """The ``quant_report.json`` body: settings, per-layer reports, bits, timings, versions."""
    return {
        "model": {"source": model_source},
        "method": result.method,
        "settings": result.config,
        "calibration": calibration_record(calib),
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
    on_stage: Callable[[str], None] | None = None,
    on_metrics: Callable[[str, dict], None] | None = None,
    on_progress: OnProgress | None = None,
    on_plan: Callable[[RunPlan], None] | None = None,
) -> tuple[Path, dict]:
    """Load ``model_name``, quantize it with ``method``/``config`` on ``calib`` data, write the packed
    checkpoint to ``out_dir``. Returns (directory, summary). The stages, in order: load (``load_stage``), those of
    ``quantize_model`` (calibrate, plan, blocks, distill), embeddings (``embeddings_stage``), save
    (``save_stage``), evaluate (``evaluate_after``); ``on_stage(name)`` as each one starts, ``on_progress(stage,
    done, total, eta_s)`` as each one starts and advances (quant/progress.py).

    Before the calibration windows are drawn, the run is planned for this model on this device
    (``run_plan.plan_run``; ``plan_stage``): with a ``time_budget`` the plan chooses what fits it (fewer
    calibration windows, a cheaper sensitivity measurement, no self-written calibration) and says why;
    ``on_plan(plan)`` gets it before any other work, the report keeps it (``plan``).

    ``stream`` "auto" (default) quantizes a model stored as safetensors block by block from disk, so the run holds
    about one block whatever the model's size; ``True`` refuses other sources, ``False`` loads the whole model, as
    does a config that needs it (``Method.needs``: a plan, self-written calibration, after-model training).
    Every finished block is written to ``<out_dir>/.partial``: a run that is interrupted (killed, or cancelled
    through ``should_stop``: ``summary["cancelled"]``, nothing else written) continues from its last finished block
    with ``resume=True`` and writes the same checkpoint as an uninterrupted run (``open_partial``);
    ``on_step(phase, step, steps, loss)`` reports every step of after-model training, ``on_metrics(phase, metrics)``
    each plan as soon as it is made (``quantize_model``). ``head`` / ``embedding``:
    also quantize the LM head and / or the input embedding with the same method (``embeddings_stage``). Several
    ranks (``quant.distributed``, e.g. under torchrun) split each block's linears, every rank calling this with the
    same arguments (``device``: its own); rank 0 alone writes, to an ``out_dir`` every rank sees.
    """
    progress = Progress(on_progress, on_stage)
    job = _DirRun(model_name, methods.get(method), config, calib, Path(out_dir), save_dtype,
                  EmbeddingParts(head=head, embedding=embedding))
    job.check(stream)
    progress.start("load")
    job.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    load_stage(job, stream)
    plan_stage(job)
    progress.planned = dict(job.plan.stages)
    if on_plan is not None:
        on_plan(job.plan)
    calibration_stage(job)
    if on_start:
        on_start(len(total_linear_shapes(job.model)))
    open_partial(job, resume)
    _, result = quantize_model(
        job.model, job.calib_ids, job.method, job.config, on_layer=on_layer, should_stop=should_stop,
        device=job.device, inplace=True, weights=job.source.weights if job.source is not None else None,
        capture_dtype=torch.float32, on_block=job.persist, resume=job.point, keep_states=job.needs.reference,
        on_step=on_step, load_reference=(lambda: original_for(job)) if job.needs.reference else None,
        on_metrics=on_metrics, plan=job.plan, progress=progress,
    )
    summary = job.summary(result)
    if result.cancelled:
        return job.out_dir, {**summary, "partial": str(job.partial.dir)}
    if not distributed.is_main():
        distributed.barrier()  # returns once rank 0 has written the checkpoint
        return job.out_dir, summary
    report = job.report(result)
    layers = collect_layers(job, result)
    if job.parts.any:
        progress.start("embeddings")
        summary["embeddings"] = report["embeddings"] = embeddings_stage(job, layers)
    progress.start("save")
    out = save_stage(job, layers, report)
    if evaluate_after:
        progress.start("evaluate")
        summary["eval"] = evaluate_stage(out, model_name, calib.seqlen)
    return out, summary


@dataclass
class _DirRun:
    """One ``quantize_to_dir`` call while it runs: the request, what its method needs, the loaded model and its
    calibration windows, the unfinished-run directory and where to resume."""

    model_name: str
    method: methods.Method
    config: object
    calib: CalibConfig
    out_dir: Path
    save_dtype: torch.dtype
    parts: EmbeddingParts
    needs: methods.RunNeeds | None = None
    model: object = None
    tok: object = None
    source: object = None  # the streamed model (``models.open_streaming``), or None when loaded whole
    stream_note: str = "off"
    calib_ids: torch.Tensor | None = None
    device: str = "cpu"
    partial: PartialRun | None = None
    point: object = None  # the ``ResumePoint`` of an unfinished run, or None
    plan: RunPlan | None = None  # what the run chose before it started (``plan_stage``)
    load_name: str = ""  # what the run loads: ``model_name``, or its rotated copy (``rotate``); set by ``load_stage``
    rotated: bool = False  # whether the model the run quantizes is rotated (``rotate``; quant/rotate.py)

    def check(self, stream: bool | str) -> None:
        """Refuse, before loading anything, what this method and config cannot do."""
        self.method.check_config(self.config)
        self.needs = self.method.needs(self.config)
        if self.parts.any and self.method.quantize_linear is None:
            raise ValueError(f"method {self.method.name!r} quantizes whole blocks; the LM head and embedding can be "
                             "quantized with vptq, gptq or rtn")
        if stream not in ("auto", True, False):
            raise ValueError(f"stream must be 'auto', True or False, got {stream!r}")
        if stream is True and self.needs.whole_model:
            raise ValueError(f"cannot stream block by block with {self.whole_model_reason()}")

    def whole_model_reason(self, short: bool = False) -> str:
        """Why the run needs the whole model in memory ("" when it does not); ``short``: as the streaming note."""
        if self.needs.after_model:
            return f"{', '.join(self.needs.after_model)}{'' if short else ': it'} trains the whole model"
        if self.needs.plan:
            return f"{', '.join(self.needs.plan)}{'' if short else ': it'} measures the whole model"
        if self.needs.sampled_share:
            return ("calib_sampled_share samples from the whole model" if short else "calib_sampled_share: the "
                    "original model writes those calibration windows itself, which needs the whole model")
        return ""

    def persist(self, done: BlockDone) -> None:
        """``on_block``: rank 0 writes the finished block to ``.partial``."""
        if not distributed.is_main():
            return
        packed = {name: pack_layer(state, self.save_dtype) for name, state in done.states.items()}
        kinds = {quant_method_of(state) for state in done.states.values()}
        if len(kinds) != 1:
            raise ValueError(f"block {done.index} mixes quantized layer kinds {sorted(kinds)}")
        self.partial.write_block(done, packed, kinds.pop())

    def summary(self, result) -> dict:
        summary = result.summary()
        summary["resumed_from_block"] = self.point.blocks_done if self.point is not None else 0
        summary["streaming"] = self.stream_note
        summary["rotated"] = self.rotated
        if self.plan is not None:
            summary["plan"] = {"estimated_seconds": round(self.plan.seconds, 1),
                               "decisions": [d.line() for d in self.plan.decisions]}
        if distributed.active():
            summary["ranks"] = distributed.world_size()
        return summary

    def report(self, result) -> dict:
        report = build_report(self.model_name, result, self.calib, self.device)
        report["streaming"] = self.stream_note
        report["rotated"] = self.rotated
        report["resumed_from_block"] = self.point.blocks_done if self.point is not None else 0
        if self.plan is not None:
            report["plan"] = self.plan.to_dict()
        return report


def load_stage(job: _DirRun, stream: bool | str) -> None:
    """The model and its calibration windows. Streamed where it can and may be: a model stored as safetensors is
    built on the meta device and each block is read from disk when it is quantized and freed afterwards
    (``models.open_streaming``), so the run holds about one block plus the calibration activations and the
    non-block tensors; other sources (tiny models built in code, .bin checkpoints) are loaded whole in their own
    dtype."""
    job.load_name = rotation_source(job)
    if job.needs.whole_model:
        stream, job.stream_note = False, f"off: {job.whole_model_reason(short=True)}"
    if stream is not False:
        try:
            job.source = open_streaming(job.load_name)
            job.stream_note = "on"
        except NotStreamable as exc:
            if stream is True:
                raise ValueError(f"cannot stream {job.model_name!r} block by block: {exc}") from None
            job.stream_note = f"off: {exc}"
    if job.source is not None:
        job.model, job.tok = job.source.model, job.source.tokenizer
    else:
        job.model, job.tok = load_model(job.load_name, dtype="auto")
        if job.load_name == job.model_name and rotates(_rotate_mode(job), job.model.config.model_type):
            rotate_model_(job.model, job.config.seed)
            job.rotated = True


def _rotate_mode(job: _DirRun) -> bool | str:
    return getattr(job.config, "rotate", False)


def rotation_source(job: _DirRun) -> str:
    """What the run loads. With ``rotate`` (quant/rotate.py), a model stored as a dense directory is rewritten
    once into a rotated copy under the cache, which the run streams or loads like any model; a model built in code
    is rotated after loading (``load_stage``). The checkpoint still names ``model_name`` its source, so evaluation
    compares it with the model the user chose."""
    mode = _rotate_mode(job)
    directory = model_directory(job.model_name) if mode is not False else None
    if directory is None:
        return job.model_name
    family = json.loads((directory / "config.json").read_text()).get("model_type")
    if not rotates(mode, family):
        return job.model_name
    job.rotated = True
    return str(rotated_dir(directory, job.config.seed, cache_dir() / "rotated"))


def plan_stage(job: _DirRun) -> None:
    """The run's plan for this model on this device (``run_plan.plan_run``; the device's speed, and under a time
    budget the model's own pace of writing and the method's of its block work, measured by rank 0 for every rank):
    the config and the calibration windows the run goes on with. Under a budget the speed is read again after the
    paces, seconds later, and the faster reading prices the run (``run_plan.measure_speed``)."""
    shapes = tuple(total_linear_shapes(job.model))
    linear = sum(o * i for o, i in shapes)
    size = RunSize(shapes, sum(p.numel() for p in job.model.parameters()) - linear, job.calib.samples,
                   job.calib.seqlen, lookup_params=lookup_params(job.model))
    speed = once("speed", lambda: measure_speed(job.device), lambda: False, job.device)
    writing = block = None
    if job.needs.time_budget > 0:  # only a budget's choices depend on these paces
        writing = once("writing speed", lambda: measure_writing_speed(job.model, size, job.config), lambda: False,
                       job.device)
        weights = job.source.weights if job.source is not None else None
        block = once("block speed", lambda: measure_block_speed(job.model, job.method, size, job.config, job.device,
                                                                weights), lambda: False, job.device)
        again = once("speed again", lambda: measure_speed(job.device), lambda: False, job.device)
        speed = max(speed, again)
    job.plan = plan_run(job.method, size, job.config, speed, writing, block)
    job.config = job.plan.config
    job.calib = dataclasses.replace(job.calib, samples=job.plan.samples)


def calibration_stage(job: _DirRun) -> None:
    """The calibration windows (with distillation, its held-out check windows drawn on top: ``with_heldout``)."""
    calib = job.calib
    job.calib_ids = calibration_windows(job.tok, calib.text, with_heldout(calib.samples, job.config), calib.seqlen,
                                        calib.seed)


def open_partial(job: _DirRun, resume: bool) -> None:
    """The unfinished-run directory (``vptq_core.resume``): where to resume (``resume`` and a run there), else a
    fresh start. A resume with a different model, method, settings, calibration, save dtype or device is refused
    (ValueError saying what differs); ``resume=False`` discards an unfinished run. A run with a plan or
    after-model hooks starts over: both work on the whole model again (distillation against the original,
    loaded a second time)."""
    blocks_total = len(decoder_blocks(job.model))
    fingerprint = run_fingerprint(job.model_name, job.model, job.method, job.config, job.calib, job.calib_ids,
                                  job.save_dtype, job.device)
    job.partial = PartialRun(job.out_dir)
    if resume and job.partial.exists() and not job.needs.after_model and not job.needs.plan:
        job.point = job.partial.resume_point(fingerprint, blocks_total)
    distributed.barrier()  # every rank has read the unfinished run before rank 0 may replace it
    if job.point is None and distributed.is_main():  # with several ranks every rank computes, rank 0 alone writes
        job.partial.start(fingerprint, blocks_total)


@dataclass
class _Layers:
    """What the save stage writes: each layer's (in, out) dims, the packed layers (read lazily), and what
    ``save_packed`` takes for the input embedding."""

    dims: dict
    packed: Iterable
    embedding: object = None
    dense: dict | None = None  # full name -> the trained 1-D tensors (float32) that replace the model's own


def collect_layers(job: _DirRun, result) -> _Layers:
    """The packed block layers: read back from ``.partial`` block by block, or after whole-model training the
    trained states (the blocks in ``.partial`` are from before it); and, from the same place, the 1-D tensors
    (norms, biases) as training left them, which the checkpoint stores instead of the model's (a streamed
    model's are the original's, read from disk at save)."""
    dims = job.partial.layer_dims()
    if job.source is not None:
        job.source.fill_remaining(skip=tuple(dims))  # block norms for the writer; quantized linears stay on meta
    packed = job.partial.packed_layers()
    if job.needs.reference:
        packed = ((name, pack_layer(state, job.save_dtype)) for name, state in result.states.items())
    return _Layers(dims, packed, dense=result.dense if job.needs.reference else job.partial.dense_tensors())


def embeddings_stage(job: _DirRun, layers: _Layers) -> dict:
    """Quantize the LM head and / or input embedding into ``layers`` (``quant.embedding``); returns the report's
    entry. The head's Hessian comes from the final-norm outputs of the quantized blocks: the last block's outputs
    (kept in ``.partial``), or after whole-model training a forward of the trained model. With tied weights either
    one quantizes the shared matrix, and ``embedding`` makes the input embedding read its rows; such checkpoints
    load with ``load_quantized``."""
    if job.needs.reference:
        last = _last_block_outputs(job.model, job.calib_ids, job.device)
    else:
        last = job.partial.block_outputs(len(decoder_blocks(job.model)))
    extra, layers.embedding, entry = _quantize_embeddings(job.model, last, job.method, job.config, job.parts,
                                                          job.device, job.save_dtype)
    layers.dims.update({name: (layer.in_features, layer.out_features) for name, layer in extra})
    layers.packed = itertools.chain(layers.packed, extra)
    return entry


def save_stage(job: _DirRun, layers: _Layers, report: dict) -> Path:
    """Write the packed checkpoint (rank 0; it equals a single-process run's bit for bit), then remove
    ``.partial`` and let the model go."""
    quantized = tuple(f"{name}." for name in layers.dims)  # e.g. a head quantized after distillation trained it
    dense = {name: t for name, t in (layers.dense or {}).items() if not name.startswith(quantized)}
    out = save_packed(job.model, job.tok, job.partial.quant_method(), layers.dims, layers.packed, job.out_dir,
                      report=report, dtype=job.save_dtype, embedding=layers.embedding, tensors=dense)
    job.partial.remove()
    distributed.barrier()
    job.model = job.source = None
    return out


def original_for(job: _DirRun):
    """The original model for distillation, loaded again beside the run's model. On the CPU its input embedding
    and LM head are the run's model's own tensors (``student.share_outer_weights``): the same file's, which no
    stage before distillation changes, so they are in memory once."""
    from .quant.student import share_outer_weights  # the training's modules load when a run distils

    reference = load_model(job.load_name or job.model_name, dtype="auto")[0]
    if job.rotated and job.load_name == job.model_name:  # rotated in memory
        rotate_model_(reference, job.config.seed)
    if torch.device(job.device).type == "cpu":
        share_outer_weights(reference, job.model)
    return reference


def evaluate_stage(out: Path, model_name: str, seqlen: int) -> dict:
    """Evaluate the written checkpoint against the original on the test split; the result (with its protocol) is
    added to its report too."""
    result = evaluate_model(str(out), reference=model_name, seqlen=seqlen, max_windows=16, split=DEFAULT_EVAL_SPLIT)
    ev = {**result.to_dict(), "protocol": result.protocol()}  # names the held-out split the figures come from
    _merge_report(out, {"eval": ev})
    return ev


def _last_block_outputs(model, calib_ids: torch.Tensor, device, batch: int = 4) -> torch.Tensor:
    """The last decoder block's outputs on the calibration windows, from a forward of the whole model."""
    block = decoder_blocks(model)[-1]
    seen: list[torch.Tensor] = []

    def keep(module, args, output):
        seen.append((output[0] if isinstance(output, tuple) else output).detach().float().cpu())

    handle = block.register_forward_hook(keep)
    moved = model.to(device)
    try:
        with torch.no_grad(), widened_linears(moved):  # a bf16 model on a CPU without bf16 products: float32
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
    split: str = DEFAULT_EVAL_SPLIT,
) -> EvalResult:
    """Evaluate a model name or directory on ``split`` of ``text`` ("test" to report, "dev" to choose settings;
    ``eval.evaluate``); ``reference`` "auto" compares a quantized checkpoint with the model it was made from,
    "none" disables the comparison. ``head_bits``: a quantized checkpoint's LM head at run time
    (``load_quantized``)."""
    if split not in EVAL_SPLITS:
        raise ValueError(f"split must be one of {', '.join(EVAL_SPLITS)}, got {split!r}")
    qmodel, tok = load_model(model, dtype=dtype, head_bits=head_bits)
    ref_model = None
    if reference == "auto":
        reference = source_model_of(model) if Path(model).is_dir() else None
    if reference and reference != "none":
        ref_model, _ = load_model(reference, dtype=dtype or (torch.bfloat16 if reference == BUNDLED else None))
    return evaluate(qmodel, tok, text=text, seqlen=seqlen, max_windows=max_windows, reference=ref_model,
                    split=split)
