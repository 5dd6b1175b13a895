"""Quantizing a causal LM, stage by stage: the one driver the CLI, the app's job runner and tests share.

A run's stages, in order (docs/architecture.md#one-run-stage-by-stage); ``api.quantize_to_dir`` runs all of
them, ``quantize_model`` the ones in memory (``STAGES``):

1. load        the model and its calibration windows (``api.load_stage``: a model stored as safetensors is
               opened on the meta device and its blocks read one at a time)
2. calibrate   the original model writes a share of the block stage's calibration windows itself
               (``calibrate``; docs/methods.md#self-written-calibration)
3. plan        the method's plan hooks on the whole original model, e.g. VPTQ's bit plan by sensitivity
               (``plan``; docs/methods.md#bit-plan-by-sensitivity)
4. blocks      every decoder block in turn: Hessians and targets from the original block, the method
               quantizes its linears, its after-block hooks run (layer-wise fine-tuning, activation
               calibration), the quantized block's outputs feed the next one (quant/block_stage.py)
5. distill     the method's after-model hooks on the whole quantized model against the original (``distill_model``;
               docs/methods.md#end-to-end-distillation)
6. embeddings  the LM head and / or the input embedding (``api.embeddings_stage``)
7. save        the packed checkpoint (``api.save_stage``), then an optional evaluation

What a stage needs of the run (the whole model in memory, the original beside it, a time budget) the method
says for its config (``Method.needs``); the state the stages share is a ``run.Run``.
"""

from __future__ import annotations

import copy
import gc
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from . import methods
from .bits import BitsInfo
from .block_stage import quantize_blocks
from .blocks import check_linear_shapes, decoder_blocks, total_linear_shapes
from .calib_windows import layerwise_count, written_rows
from .device import map_large_allocations, return_freed_memory
from .distributed_once import once, shared_stop
from .methods import Cancelled, Method, ModelContext, RunNeeds
from .progress import OnProgress, Progress
from .results import BlockDone, OnLayer, OnStep, QuantizeResult, ResumePoint, ShouldStop
from .run import Run
from .run_plan import RunPlan
from .sampling import SAMPLE_BATCH, sampled_calibration
from .source import BlockWeights
from .trainable import dense_tensors


class Stage(NamedTuple):
    """One stage of ``quantize_model``: runs when ``applies(run)``, and not after a stop."""

    name: str
    applies: Callable[[Run], bool]
    run: Callable[[Run], None]


def calibrate(run: Run) -> None:
    """The original model writes the last ``needs.sampled_share`` of the block stage's windows itself
    (``sampling.sampled_calibration``); under a time budget it would take too much of, only those that fit.

    The model about to be quantized writes them, not the reference, which stays untouched (not paged in) until
    distillation; with distillation to follow, the original's top-k on those windows is kept from the
    sampling's own logits so that distillation's teacher pass skips them."""
    topk = run.needs.teacher_topk if run.needs.after_model else 0
    def write() -> tuple:
        written: dict = {}
        sampled = sampled_calibration(run.model, run.calib_ids, run.config, _counting_windows(run), topk=topk,
                                      info=written)
        return sampled, written

    with run.result.timed("sample_calibration"):
        sampled, written = once("calibrate", write, run.should_stop, run.device)  # with several ranks: rank 0's
    if written:  # too slow for the time budget here (fewer windows written, or none), or a window kept as text
        run.result.model_metrics["calibration"] = written
    if sampled is None:
        run.result.cancelled = True
        return
    if topk:
        sampled, run.teacher = sampled
    run.calib_ids = sampled  # distillation after the blocks trains and checks on these same windows


def _counting_windows(run: Run) -> Callable[[], bool]:
    """``run.should_stop`` for the writing, which polls it before every token of each batch of ``SAMPLE_BATCH``
    windows: the share of the tokens written so far moves the stage on, counted in windows."""
    windows = written_rows(run.calib_ids.shape[0], run.config).numel()
    steps = max(math.ceil(windows / SAMPLE_BATCH) * (run.calib_ids.shape[1] - 1), 1)
    polls = [0]

    def stop() -> bool:
        polls[0] += 1
        if run.progress is not None and windows * polls[0] // steps > windows * (polls[0] - 1) // steps:
            run.progress.advance(windows * polls[0] // steps)
        return run.should_stop()

    return stop


def plan(run: Run) -> None:
    """The method's plan hooks on the whole original model: each returns the config the run goes on with."""
    windows = run.calib_ids[: layerwise_count(run.calib_ids.shape[0], run.config)]  # the block stage's windows
    if run.plan_windows and run.plan_windows < windows.shape[0]:  # a time budget's plan measures on fewer
        windows = windows[torch.linspace(0, windows.shape[0] - 1, run.plan_windows).round().long().unique()]
    for hook in [hook for hook in run.method.before_blocks if hook.phase in run.needs.plan]:
        with run.result.timed(hook.phase):
            try:
                run.config, metrics = once(hook.phase, lambda: hook.run(run.model, windows, run.config, run.device,
                                                                        run.should_stop, progress=_advance(run)),
                                           run.should_stop, run.device)
            except Cancelled:
                run.result.cancelled = True
                return
        run.result.model_metrics[hook.phase] = metrics
        if run.on_metrics is not None:
            run.on_metrics(hook.phase, metrics)
    run.result.config = run.config.to_dict()


def distill_model(run: Run) -> None:
    """The method's after-model hooks on the whole fake-quantized model (float32 on the work device but for its
    large frozen tensors, ``student.to_training_dtype``; put back after), by the deadline a time budget sets for the
    whole run. The last hook may let the original go once it no longer needs it (``release_reference``): nothing
    after distillation uses it."""
    from .student import to_training_dtype  # the training is loaded when a run distils

    budget = run.needs.time_budget
    deadline = run.start - run.earlier_seconds + budget if budget > 0 else None
    if run.reference is None and run.load_reference is not None:  # before the model's dtype changes: the loader
        run.reference, run.load_reference = run.load_reference(), None  # may share its embedding and head
    model = run.model
    orig_device, orig_dtype = next(model.parameters()).device, next(model.parameters()).dtype
    to_training_dtype(model, run.device, run.result.states)  # float32 but the large frozen tensors (student.py)
    try:
        hooks = [hook for hook in run.method.after_model if hook.phase in run.needs.after_model]
        for i, hook in enumerate(hooks):
            ctx = ModelContext(model=model, reference=run.reference, calib_ids=run.calib_ids,
                               states=run.result.states, config=run.config, result=run.result,
                               should_stop=run.should_stop,
                               on_step=run.on_step or (lambda _phase, _step, _steps, _loss: None),
                               teacher=run.teacher, deadline=deadline)
            if i == len(hooks) - 1:
                ctx.release_reference = _releaser(run, ctx)
            with run.result.timed(hook.phase):  # with several ranks: rank 0 trains, the others take its result
                metrics, _ = once(hook.phase, lambda: (hook.run(ctx) or {}, run.result.states), run.should_stop,
                                  run.device, modules=(model,), apply=lambda value: run.result.states.update(value[1]))
            run.result.model_metrics[hook.phase] = metrics
            if metrics.get("cancelled"):
                run.result.cancelled = True
                break
        # what distillation trained, in float32 before the model goes back to its dtype (the checkpoint stores it)
        run.result.dense.update(dense_tensors(model, packed=run.result.states))
    finally:
        model.to(orig_device, orig_dtype)


def _releaser(run: Run, ctx: ModelContext) -> Callable[[], None]:
    """What ``ctx.release_reference`` does: the run and the context drop the original (and ``run.teacher``,
    made from it), so it is freed unless the caller holds it too. A Hugging Face model's modules refer to each
    other in cycles, which only the cycle collector frees: it runs here, not at some later allocation; then the
    freed heap pages go back to the system (``return_freed_memory``)."""
    def release() -> None:
        run.reference = ctx.reference = None
        run.teacher = ctx.teacher = None
        gc.collect()
        return_freed_memory()

    return release


STAGES = (
    Stage("calibrate", lambda run: run.needs.sampled_share > 0 and (bool(run.needs.after_model) or not run.resumed),
          calibrate),
    Stage("plan", lambda run: bool(run.needs.plan) and not run.resumed, plan),
    Stage("blocks", lambda run: True, quantize_blocks),
    Stage("distill", lambda run: bool(run.needs.after_model), distill_model),
)


def quantize_model(
    model: nn.Module,
    calib_ids: torch.Tensor,
    method: str | Method,
    config,
    on_layer: OnLayer | None = None,
    should_stop: ShouldStop | None = None,
    device: str | torch.device | None = None,
    inplace: bool = False,
    skip: Callable[[str], bool] | None = None,
    *,
    weights: BlockWeights | None = None,
    capture_dtype: torch.dtype | None = None,
    on_block: Callable[[BlockDone], None] | None = None,
    resume: ResumePoint | None = None,
    keep_states: bool = True,
    reference: nn.Module | None = None,
    load_reference: Callable[[], nn.Module] | None = None,
    on_step: OnStep | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_metrics: Callable[[str, dict], None] | None = None,
    on_progress: OnProgress | None = None,
    plan: RunPlan | None = None,
    progress: Progress | None = None,
) -> tuple[nn.Module, QuantizeResult]:
    """Quantize every linear of every decoder block of ``model`` (a Hugging Face causal LM) on ``calib_ids``
    [n, seq] with ``method`` (a registered name or a ``Method``) and ``config`` (an instance of its config class),
    through ``STAGES``.

    ``on_layer(LayerReport)`` as each linear finishes; ``should_stop()`` polled between linears (the result then
    has ``cancelled=True`` with the layers done so far; with several ranks, a stop on any stops all:
    ``distributed_once``); ``device``: where blocks are processed ("cuda" when
    available); ``inplace``: quantize ``model`` itself instead of a copy; ``skip(full name)``: leave a linear as it
    is; ``on_stage(name)`` as each stage starts; ``on_metrics(phase, metrics)`` as each plan hook ends (e.g. the bit
    plan by sensitivity, before the first block); ``on_progress(stage, done, total, eta_s)`` as each stage starts and
    advances (quant/progress.py: blocks done, distillation steps done, the seconds the run has left).

    For long runs and models larger than memory (``api.quantize_to_dir``): ``weights`` materialises each block of a
    model kept on the meta device when it is reached and releases it after (implies ``inplace``; the quantized
    layers are in ``result.states``); ``capture_dtype``: the dtype of the block-0 activations, masks and rotary
    embeddings (captured from ``inputs_embeds`` with stubbed blocks); ``on_block(BlockDone)`` after each block;
    ``resume``: a ``ResumePoint`` to continue from (its reports replayed through ``on_layer``); ``keep_states=False``
    drops each block's states once ``on_block`` has them. ``reference``: the original model for the after-model
    hooks (by default ``model`` itself when it is not quantized in place); they run on the whole model on
    ``device`` in float32 (not with ``weights``, a resume or ``keep_states=False``), report their steps through
    ``on_step(phase, step, steps, loss)``, and keep their best check when stopped. ``load_reference``: instead of
    ``reference``, what loads the original as those hooks start, so that it is not in memory before them and is
    freed once they let it go (a ``reference`` passed in stays alive in the caller's arguments). The windows
    distillation holds out are held out of the block stage as well (``layerwise_count``).

    ``plan``: a ``run_plan.RunPlan`` for this run (``api.quantize_to_dir`` makes one): its config is the one to
    pass, its stage seconds give the ETA and its ``plan_windows`` the windows of the plan hooks' measurement;
    ``progress``: a ``Progress`` the caller shares with stages of its own around this call (then ``on_stage`` and
    ``on_progress`` are its).

    Returns (fake-quantized model whose linears hold the dequantized weights, ``QuantizeResult`` with the
    per-layer states to pack and save). Embeddings, norms and the LM head stay as they are.
    """
    progress = progress or Progress(on_progress, on_stage, plan.stages if plan is not None else None)
    map_large_allocations()  # the stages' large temporaries leave the resident set when freed (device.py)
    # no_grad as a block, not as a decorator, whose wrapper would hold the arguments (the original among them)
    # until the run ends
    with torch.no_grad():
        run = start_run(model, calib_ids, method, config, device, inplace, weights=weights, resume=resume,
                        keep_states=keep_states, reference=reference, load_reference=load_reference,
                        on_layer=on_layer or (lambda _r: None),
                        should_stop=shared_stop(should_stop or (lambda: False)), on_step=on_step, on_block=on_block,
                        skip=skip, capture_dtype=capture_dtype, on_metrics=on_metrics,
                        plan_windows=plan.plan_windows if plan is not None else 0, progress=progress)
        del reference  # the run holds the original alone: distillation lets it go once it no longer needs it
        _report_progress(run, progress)
        for stage in STAGES:
            if run.result.cancelled:
                break
            if stage.applies(run):
                progress.start(stage.name, *_stage_steps(run, stage.name))
                stage.run(run)
                # what the stage freed (e.g. the sampling's float32 copies, 0.9 GB on SmolLM2-135M) goes back to
                # the system, not kept in glibc's heap through the stages after it
                return_freed_memory()
        run.result.seconds = run.seconds()
    return run.model, run.result


def _advance(run: Run) -> Callable[[int], None]:
    """``done`` steps of the stage under way (a plan hook's measured blocks), for its progress events."""
    return lambda done: run.progress.advance(done) if run.progress is not None else None


def _stage_steps(run: Run, name: str) -> tuple[int, int]:
    """(total, done) of a stage as its progress counts it: windows written, blocks, distillation steps."""
    if name == "calibrate":
        return max(written_rows(run.calib_ids.shape[0], run.config).numel(), 1), 0
    if name == "blocks":
        return len(decoder_blocks(run.model)), run.resume.blocks_done if run.resume is not None else 0
    if name == "plan":  # the measurement block by block, then the distortion table
        return len(decoder_blocks(run.model)) + 1, 0
    if name == "distill":
        return max(int(getattr(run.config, "distill_iters", 1) or 1), 1), 0
    return 1, 0


def _report_progress(run: Run, progress: Progress) -> None:
    """The run's own callbacks move ``progress`` on: a finished block, a training step of the stage under way."""
    on_block, on_step = run.on_block, run.on_step

    def block_done(done: BlockDone) -> None:
        if on_block is not None:
            on_block(done)
        progress.advance(done.index + 1)

    def step_done(phase: str, step: int, steps: int, loss: float) -> None:
        if on_step is not None:
            on_step(phase, step, steps, loss)
        if phase == progress.stage:
            progress.advance(step, steps)

    run.on_block, run.on_step = block_done, step_done


def start_run(model: nn.Module, calib_ids: torch.Tensor, method: str | Method, config,
              device: str | torch.device | None, inplace: bool, **options) -> Run:
    """Check the request before any work and set up its ``Run`` (the model copied unless ``inplace``);
    ``options``: the ``Run`` fields given by the caller (weights, resume, callbacks, ...)."""
    method = methods.get(method)
    method.check_config(config)
    config = method.for_model(config, total_linear_shapes(model))  # e.g. a total-bits budget -> its per-layer cap
    if calib_ids.dim() != 2 or calib_ids.shape[0] < 1:
        raise ValueError(f"calib_ids must be [samples, seqlen], got shape {tuple(calib_ids.shape)}")
    check_linear_shapes(model, lambda out_f, in_f: method.bits(config, out_f, in_f),
                        f"method {method.name!r} ({method.describe(config.to_dict())})", options.get("skip"))
    needs = method.needs(config)
    streamed = options.get("weights") is not None
    if needs.reference and options.get("reference") is None and not inplace and not streamed:
        options["reference"] = model
    _refuse_impossible(needs, options)
    if not inplace and not streamed:
        model = copy.deepcopy(model)
    model.eval()
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = QuantizeResult(method.name, config.to_dict(), {}, [], BitsInfo(0, 0, 0), 0.0)
    return Run(model=model, calib_ids=calib_ids, method=method, config=config, needs=needs, device=dev,
               result=result, **options)


def _refuse_impossible(needs: RunNeeds, options: dict) -> None:
    """ValueError when what the config needs cannot be had in this run (e.g. the whole model, streamed)."""
    weights, resume = options.get("weights"), options.get("resume")
    resumed = resume is not None and resume.blocks_done > 0
    if needs.after_model:
        why = ("streamed weights" if weights is not None else "a resume" if resumed
               else "keep_states=False" if not options.get("keep_states", True)
               else "no reference model" if options.get("reference") is None and options.get("load_reference") is None
               else None)
        if why:
            raise ValueError(f"{', '.join(needs.after_model)} runs on the whole quantized model against the "
                             f"original; not possible with {why}")
    if needs.sampled_share and weights is not None:
        raise ValueError("calib_sampled_share: the original model writes those calibration windows itself, which "
                         "needs the whole model in memory; not possible with streamed weights")
    if needs.plan and not resumed and weights is not None:
        raise ValueError(f"{', '.join(needs.plan)} runs on the whole original model; not possible with streamed "
                         "weights")
