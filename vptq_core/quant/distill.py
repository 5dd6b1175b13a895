"""End-to-end distillation of a quantized model against the original model's next-token distributions.

After every block is quantized (and maybe fine-tuned layer by layer), the tensors that stay in the packed
format and are cheap to move are trained together: every VPTQ layer's codebooks (main, residual, outlier;
``weight_scale`` / ``weight_bias`` when normalisation is on) or every scalar layer's per-group scales (RTN,
GPTQ, LRQ: as log-scales, codes and zero points fixed, activations fake-quantized as at run time for W4A8 /
W8A8), and every 1-D tensor of the model (the norms inside the blocks, the final norm, linear biases).
Indices, codes, embeddings and the LM head stay fixed. Objective, per predicted token: KL(P_orig || P_quant).

- **Teacher**: the reference model runs once per window, before training, and only its top ``distill_topk``
  log-probabilities (+ the log of the mass of all the others) are kept: n x seq x k values, never
  full-vocabulary logits for all windows. The KL is taken over those k tokens plus one bucket for the rest,
  the KL of the two distributions coarsened the same way (<= the full KL, equal when k covers the vocab).
- **Data** (``distill_data``): the calibration windows, ``distill_samples`` windows the reference writes itself
  (``sample_windows``: ancestral sampling at temperature 1, the teacher's top-k taken from the sampling's own
  logits), or both. The held-out windows are always calibration windows.
- **Student**: the quantized model with its quantized linears replaced by ``finetune.trainable_linear``
  (the weight gathered from the codebooks, or scaled codes, in each forward), each decoder block under activation
  checkpointing (``distill_checkpointing``; "auto": only when one step's saved activations would not fit a
  quarter of the free memory, ``use_checkpointing``) and the LM head + loss in checkpointed chunks of tokens, so
  memory holds one block's activations and one chunk's logits; bf16 autocast for the training steps where the
  device multiplies bf16 in hardware (``train_dtype``), float32 parameters and Adam state.
- **Held-out**: ``distill_holdout`` of the windows are never trained on; the KL on them is checked every
  ``distill_eval_every`` steps (0: every quarter of the steps) and at the end (float32), and the best check
  wins, the starting point
  included: distillation never leaves the model worse on those windows.

The result is written back in place: the states' codebooks or scales (and biases), the fake-quant model's
linear weights (dequantized) and its norm weights, so ``save_quantized(qmodel, ...)`` writes the distilled model.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .blocks import decoder_blocks
from .config import DistillSettings
from .device import compute_dtype, native_bf16
from .finetune import (
    CodebookLinear,
    Snapshot,
    autocast,
    cosine_factor,
    dense_parameters,
    holdout_count,
    layerwise_count,
    minibatches,
    only_trainable,
    swapped_in,
    trainable_linear,
    write_back,
)
from .lean_decoder import LeanDecoder
from .methods import ModelHook
from .packed_dense import packed_linears
from .states import ScalarLayerState, VQLayerState

OnStep = Callable[[int, float], None]
HEAD_CHUNK = 1024  # tokens per LM-head chunk: one chunk's full-vocabulary logits live at a time
WARMUP_FRACTION = 0.05  # of the steps, linear learning-rate warm-up before the cosine decay
# windows sampled at once: on SmolLM2 (2 threads) 32 windows of 256 tokens took 56-59 s at batch 32 and 76-78 s
# at 16, 16 windows 60-62 s at 8; 32 windows of 512 tokens 138.6 s at 32 (274-289 s at 8 in the bench runs)
SAMPLE_BATCH = 32
SAMPLE_DTYPES = ("auto", "bfloat16", "model")


def sampling_dtype(model: nn.Module, choice: str = "auto") -> torch.dtype | None:
    """The dtype ``sample_windows`` runs ``model`` in: None = its own parameters as they are; bfloat16 = bf16
    copies of its floating-point parameters (its buffers, e.g. rotary frequencies, untouched).

    ``choice``: "model" (as it is), "bfloat16" (always bf16), "auto" (bf16 when the parameters are float32 on a
    device that multiplies bf16 in hardware, ``device.native_bf16``; the model's own dtype elsewhere, where bf16
    arithmetic would be emulated and slower)."""
    if choice not in SAMPLE_DTYPES:
        raise ValueError(f"sample_dtype must be one of {SAMPLE_DTYPES}, got {choice!r}")
    param = next(model.parameters())
    if choice == "model" or param.dtype == torch.bfloat16:
        return None
    if choice == "bfloat16":
        return torch.bfloat16
    if param.dtype != torch.float32:
        return None
    return torch.bfloat16 if native_bf16(param.device) else None


def _cast_params(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor] | None:
    """Copies of ``model``'s floating-point parameters in ``dtype`` (None: no copies)."""
    if dtype is None:
        return None
    return {name: p.detach().to(dtype) for name, p in model.named_parameters() if p.is_floating_point()}


def _runner(model: nn.Module, params: dict[str, torch.Tensor] | None) -> Callable:
    """``model``'s forward, or the same forward through ``params`` (copies of its floating-point parameters,
    ``_cast_params``; ``torch.func.functional_call``, the module itself is left as it is)."""
    if params is None:
        return model

    def forward(**kwargs):
        return torch.func.functional_call(model, params, (), kwargs, tie_weights=True)
    return forward


def eval_every(config: DistillSettings) -> int:
    """Steps between held-out checks: ``distill_eval_every``, or a quarter of the steps when it is 0."""
    return config.distill_eval_every or max(1, config.distill_iters // 4)


# ------------------------------------------------------------------------------------------- teacher
@torch.no_grad()
def teacher_topk(reference: nn.Module, windows: torch.Tensor, k: int, device: torch.device,
                 should_stop: Callable[[], bool] | None = None) -> dict[str, torch.Tensor] | None:
    """The reference's top-``k`` next-token log-probabilities on every window, computed one window at a time.

    Returns {"logp": [n, seq-1, k] float32, "index": [n, seq-1, k] int64, "rest": [n, seq-1] float32 (log of
    the mass outside the top k; -inf when there is none)} on ``device``; None if ``should_stop`` turned true.
    """
    ref_device = next(reference.parameters()).device
    rows = []
    for row in windows:
        if should_stop is not None and should_stop():
            return None
        logits = reference(row.unsqueeze(0).to(ref_device), use_cache=False).logits[0, :-1]
        rows.append(_topk_of(logits, k, device))
    return _stack_teacher(rows)


def _topk_of(logits: torch.Tensor, k: int, device) -> dict[str, torch.Tensor]:
    """{"logp", "index", "rest"} of logits [..., V]: the top-k log-probabilities, their tokens and the log of
    the mass of all the others."""
    logp = F.log_softmax(logits.float(), dim=-1)
    top, index = logp.topk(min(k, logp.shape[-1]), dim=-1)
    rest = logp.scatter(-1, index, float("-inf")).logsumexp(-1)
    return {"logp": top.to(device), "index": index.to(device), "rest": rest.to(device)}


CALIB_SAMPLE_ROWS = 1 << 20  # generator row numbers of calibration samples (distillation's own start at 0)


def sampled_count(windows: int, config) -> int:
    """How many of the ``windows`` the block-by-block stage sees are written by the original model:
    round(``config.calib_sampled_share`` x windows), at least 1 when the share is > 0."""
    share = getattr(config, "calib_sampled_share", 0.0)
    if share <= 0 or windows < 1:
        return 0
    return min(windows, max(1, math.floor(share * windows + 0.5)))


def written_rows(n: int, config) -> torch.Tensor:
    """The rows of ``n`` calibration windows (held-out check windows included) that ``sampled_calibration``
    has the original model write: the last ``sampled_count`` of the ``layerwise_count`` the blocks see."""
    stage = layerwise_count(n, config)
    return torch.arange(stage - sampled_count(stage, config), stage)


# Under a ``time_budget`` the windows the original writes itself may take at most this share of it, as
# ``WritingProjection`` projects it from the tokens drawn so far; over it they stay text. On the AVX2-only Zen 3
# machine Gemma-3-270M's 24 windows (a 262 144-token vocabulary) took 165 s of the "2.5 bits" preset's 570 and left
# 8 distillation steps that did not help: wiki / pydocs 6.26x / 4.17x bf16, against 1.70x / 1.93x with text windows
# and 19 steps; SmolLM2's took 69 s there (README, "On a slower machine").
SAMPLING_BUDGET_SHARE = 0.2
PROJECT_AFTER = 16
FIT_CHUNKS = 4  # runs of tokens whose median costs the growth is fitted to (``WritingProjection.projected``)
# The fitted projection never exceeds this multiple of the mean-cost one. At the quarter of the window the true
# totals were 1.23x (SmolLM2) and 1.48x (Gemma-3-270M) the mean-cost projection (replayed poll times); a fit thrown
# off by a busy moment projected SmolLM2's 3.6-bit writing at 120 s (its mean-cost projection: about 44 s) and
# dropped it; that run, calibrated on text alone, scored 1.316x on pydocs (README, "Projecting the writing").
GROWTH_CAP = 2.0


class WritingProjection:
    """The projected seconds of writing ``batches`` batches of ``per_batch`` tokens each, from the times of the
    polls so far (one poll before every token; ``sample_windows``' ``should_stop``).

    A token costs more the further along its window it is (attention reads every earlier position): on this
    project's Zen 4 machine, 2 threads, from the first 64 tokens of a window to the last 64 SmolLM2's cost per
    token rose 1.55x and Gemma-3-270M's 2.3x. Scaling the mean cost so far to every token therefore projects too
    little, and re-projecting at every token crossed the limit late: a Gemma writing was given up after 58 s of
    work. The growth cannot be told from the first few dozen tokens (a least-squares fit of it projected 80-240%
    of the true total at the 16th, 32nd and 64th token), so the writing is decided on twice over. At
    PROJECT_AFTER polls and the doublings after: the mean cost so far (without the set-up and the first token), a
    lower bound, stops it only when even that is over. At a quarter of the first window (at least PROJECT_AFTER
    polls), once and for all: a cost per token growing linearly with the position, fitted to the tokens so far
    (``projected``; within 5% of the true totals of both models at the 127th of 511, ``bench/sampling_projection.py``).
    """

    def __init__(self, per_batch: int, batches: int, start: float) -> None:
        self.per_batch, self.batches, self.start = per_batch, batches, start
        self.draws = per_batch * batches
        self.final = max(PROJECT_AFTER, per_batch // 4)  # the poll of the growth-aware decision
        self.times: list[float] = []  # the polls' times after ``start``, up to the final decision

    def poll(self, now: float) -> float | None:
        """Record one poll at ``now``; the projected total seconds at a decision point, else None."""
        k = len(self.times) + 1
        if k > self.final:
            return None
        self.times.append(now - self.start)
        if k == self.final:
            return self.projected()
        if k >= PROJECT_AFTER and not k & (k - 1):
            return self.flat()
        return None

    def projected(self) -> float:
        """Elapsed + the fitted cost of the tokens left, at most GROWTH_CAP x what the mean cost so far projects.

        The fit is a line through the median cost of each of FIT_CHUNKS runs of consecutive tokens (the first
        token, which pays the first forward's warm-up, left out), so a few seconds of a busy machine move it little.
        """
        t = self.times
        cost = torch.tensor([t[i + 1] - t[i] for i in range(1, len(t) - 1)], dtype=torch.float64)  # tokens 1..k-2
        pos = torch.tensor([i % self.per_batch for i in range(1, len(t) - 1)], dtype=torch.float64)
        chunks = [c for c in torch.arange(cost.numel()).tensor_split(FIT_CHUNKS) if c.numel()]
        x = torch.stack([pos[c].mean() for c in chunks])
        y = torch.stack([cost[c].median() for c in chunks])
        centred = x - x.mean()
        spread = float(centred.pow(2).sum())
        b = max(0.0, float((centred * (y - y.mean())).sum()) / spread) if spread > 0 else 0.0
        a = max(0.0, float(y.mean() - b * x.mean()))

        def tokens(frm: int, upto: int) -> float:  # positions frm .. upto - 1 of a window
            return a * (upto - frm) + b * (upto * upto - frm * frm) / 2

        batches_done, at = divmod(len(t) - 1, self.per_batch)  # tokens drawn so far: len(t) - 1
        whole = max(0, self.batches - batches_done - 1)
        fitted = t[-1] + tokens(at, self.per_batch) + whole * tokens(0, self.per_batch)
        return min(fitted, GROWTH_CAP * self.flat())

    def flat(self) -> float:
        """Elapsed + the tokens left at the mean cost so far (the set-up and the first token left out)."""
        t = self.times
        return t[-1] + (self.draws - len(t) + 1) * (t[-1] - t[1]) / (len(t) - 2)


def sampled_calibration(model: nn.Module, calib_ids: torch.Tensor, config,
                        should_stop: Callable[[], bool] | None = None, topk: int = 0,
                        info: dict | None = None):
    """``calib_ids`` with the last ``sampled_count`` of the windows the block-by-block stage sees
    (``layerwise_count``) replaced by windows ``model`` writes itself (``sample_windows``, seeded by
    ``config.seed``, each started from the first token of the window it replaces); the held-out check windows
    after them stay text. ``calib_ids`` itself when ``calib_sampled_share`` is 0; None if ``should_stop`` turned
    true. With ``topk`` > 0 it returns (windows, known): ``known`` the teacher's top-k on the written windows,
    taken from the sampling's own logits, as ``distill(known_teacher=...)`` takes it ({"rows", "logp", "index",
    "rest"} on the CPU; None when no window is written). With a ``time_budget`` the writing stops early and every
    window stays text when it is projected to take more than ``SAMPLING_BUDGET_SHARE`` of the budget; ``info``
    (a dict) then gets "self_written": 0 and the projection."""
    rows = written_rows(calib_ids.shape[0], config)
    if not rows.numel():
        return (calib_ids, None) if topk else calib_ids
    limit = SAMPLING_BUDGET_SHARE * float(getattr(config, "time_budget", 0.0) or 0.0)
    batches = math.ceil(rows.numel() / SAMPLE_BATCH)
    projection = WritingProjection(calib_ids.shape[1] - 1, batches, time.perf_counter())
    over = {}

    def stop() -> bool:
        if should_stop is not None and should_stop():
            return True
        if limit <= 0:
            return False
        projected = projection.poll(time.perf_counter())
        if projected is not None and projected > limit:
            over.update(self_written=0, projected_seconds=round(projected, 1), limit_seconds=round(limit, 1),
                        reason=f"writing {rows.numel()} windows was projected at {projected:.0f} s, over "
                               f"{SAMPLING_BUDGET_SHARE:.0%} of the {limit / SAMPLING_BUDGET_SHARE:.0f} s "
                               "time budget: the calibration stays text")
            return True
        return False

    got = sample_windows(model, calib_ids[rows, :1], calib_ids.shape[1], seed=config.seed, batch=SAMPLE_BATCH,
                         should_stop=stop, rows=rows + CALIB_SAMPLE_ROWS, topk=topk,
                         device=torch.device("cpu"), dtype=getattr(config, "sample_dtype", "auto"))
    if got is None and over:
        if info is not None:
            info.update(over)
        return (calib_ids, None) if topk else calib_ids
    if got is None:
        return None
    written, teacher = got if topk else (got, None)
    out = calib_ids.clone()
    out[rows] = written.to(out.dtype)
    return (out, {"rows": rows, **teacher}) if topk else out


def _stack_teacher(rows: list[dict[str, torch.Tensor]], dim: int = 0, cat: bool = False) -> dict[str, torch.Tensor]:
    join = torch.cat if cat else torch.stack
    return {key: join([r[key] for r in rows], dim=dim) for key in ("logp", "index", "rest")}


@torch.no_grad()
def sample_windows(reference: nn.Module, starts: torch.Tensor, seqlen: int, seed: int = 0, batch: int = 8,
                   temperature: float = 1.0, should_stop: Callable[[], bool] | None = None,
                   topk: int = 0, device: torch.device | None = None, rows: torch.Tensor | None = None,
                   dtype: str = "model", pack: bool = True):
    """Windows of ``seqlen`` tokens sampled from ``reference`` itself -> [n, seqlen] int64 on the CPU.

    Row i begins with ``starts[i]`` ([n, s] token ids, 1 <= s < seqlen; e.g. the BOS token, or a calibration
    window's first token for variety) and continues by ancestral sampling at ``temperature`` (1.0 = the
    model's own distribution), ``batch`` rows at a time with the KV cache (row i's draws come from its own
    generator, so a row does not depend on the batch it was sampled in). Text drawn from the original model
    covers every domain it knows, in proportion to how it predicts, not only the calibration text's: what a
    distillation towards it should match. Reproducible from ``seed``. None if ``should_stop`` turned true
    (polled before every token). With ``topk`` > 0 it returns (windows, teacher): the reference's top-k
    log-probabilities at every predicted position, as ``teacher_topk`` gives them (on ``device``), taken from
    the logits the sampling computed anyway. ``rows`` [n]: the row numbers that seed each row's generator
    (default 0..n-1), so any subset of a larger draw gets exactly that draw's rows. ``pack``: a float32 model on
    the CPU runs its linears through oneDNN with packed weights while sampling (``packed_dense``); False: as it is.
    """
    starts = torch.as_tensor(starts, dtype=torch.long)
    if starts.dim() != 2 or starts.shape[0] < 1 or not 1 <= starts.shape[1] < seqlen:
        raise ValueError(f"starts must be token ids [n >= 1, 1..{seqlen - 1}], got shape {tuple(starts.shape)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = torch.arange(starts.shape[0]) if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
    if tuple(rows.shape) != (starts.shape[0],):
        raise ValueError(f"rows must name one row number per start, got shape {tuple(rows.shape)} for "
                         f"{starts.shape[0]} starts")
    ref_device = next(reference.parameters()).device
    params = _cast_params(reference, sampling_dtype(reference, dtype))  # one set of copies for either path
    forward = _runner(reference, params)
    out, teachers = [], []
    # float32 on the CPU: the linears through oneDNN with packed weights (packed_dense; up to 2.3x faster at
    # these few-row products on an AVX2 EPYC), for the sampling only
    with packed_linears(reference, enabled=pack and params is None, rows=min(batch, starts.shape[0])):
        for lo in range(0, starts.shape[0], batch):
            ids = starts[lo : lo + batch].cpu()
            # one generator per row: a row's tokens do not depend on the batch it was sampled in
            gens = [torch.Generator().manual_seed(seed * 1_000_003 + int(r)) for r in rows[lo : lo + batch]]
            # llama-family models: the lean decoder (the same weights, far fewer ops per token, no cache growth)
            lean = LeanDecoder.for_model(reference, seqlen, batch=ids.shape[0], params=params)
            step_in, past, steps = ids, None, []
            while ids.shape[1] < seqlen:
                if should_stop is not None and should_stop():
                    return None
                if lean is None:
                    res = forward(input_ids=step_in.to(ref_device), past_key_values=past, use_cache=True)
                    past, logits = res.past_key_values, res.logits
                elif step_in is ids:  # the first pass: the start tokens
                    logits = lean.prefill(step_in.to(ref_device), all_positions=bool(topk))
                else:
                    logits = lean.step(step_in.to(ref_device))
                logits = logits if logits.dim() == 3 else logits[:, None]
                if topk:
                    steps.append(_topk_of(logits, topk, device or ref_device))  # [b, new positions, k]
                step_in = _draw(logits[:, -1], temperature, gens)
                ids = torch.cat([ids, step_in], dim=1)
            out.append(ids)
            if topk:
                teachers.append(_stack_teacher(steps, dim=1, cat=True))
    windows = torch.cat(out)
    return (windows, _stack_teacher(teachers, cat=True)) if topk else windows


def _draw(logits: torch.Tensor, temperature: float, gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logits`` [b, V] from softmax(logits / temperature), row i by inverse transform
    of one uniform draw of ``gens[i]`` -> [b, 1] int64 on the CPU. Never a token of probability 0."""
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    cdf = probs.cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g) for g in gens]) * cdf[:, -1]
    # the first token whose cumulative probability passes u has probability > 0; only rounding at the top end
    # (u at the total) can point past the last token, then the last one with probability > 0 is taken
    index = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=probs.shape[-1] - 1)
    zero = probs.gather(1, index)[:, 0] <= 0
    if bool(zero.any()):
        index[zero] = (probs[zero] > 0).long().cumsum(-1).argmax(-1, keepdim=True)
    return index


def bucket_kl(logits: torch.Tensor, t_logp: torch.Tensor, t_index: torch.Tensor, t_rest: torch.Tensor,
              cap: float | None = None) -> torch.Tensor:
    """Sum over tokens of KL(P || Q) on the teacher's top-k tokens + one bucket for the rest.

    logits [t, V] (student, any float dtype; ``cap``: final logit soft-capping); t_logp, t_index [t, k];
    t_rest [t] (log of the teacher's mass outside its top k).
    """
    logits = logits.float()
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return _BucketKL.apply(logits, t_logp.float(), t_index, t_rest.float())


class _BucketKL(torch.autograd.Function):
    """``bucket_kl`` on float32 logits in a few passes over the [t, V] matrix, with its gradient written out.

    Per token, with E = exp(l - max l) and the teacher's top-k tokens T: S = sum of E over all tokens, R = sum of
    E outside T (summed with T zeroed, so no cancellation when T holds nearly all the mass), log Q_i = l_i - max
    l - log S on T, log Q_rest = log R - log S, and KL = sum_T p_i (log p_i - log Q_i) + p_rest (log p_rest - log
    Q_rest). d KL / d l_j = E_j ((P_T + p_rest) / S - p_rest / R) outside T, E_j (P_T + p_rest) / S - p_j on T.
    Autograd through logsumexp and a scattered copy took ~1.7 s of a ~8 s SmolLM2 step at 511 tokens x 49152
    (tests: the value and the gradient equal that formulation's)."""

    @staticmethod
    def forward(ctx, logits, t_logp, t_index, t_rest):
        m = logits.amax(-1, keepdim=True)
        e = torch.sub(logits, m).exp_()
        e_top = e.gather(-1, t_index)
        e.scatter_(-1, t_index, 0.0)
        s_rest = e.sum(-1)
        s_all = s_rest + e_top.sum(-1)
        p_top, p_rest = t_logp.exp(), t_rest.exp()
        log_s = s_all.log()
        q_top = logits.gather(-1, t_index) - m - log_s[:, None]
        kl_top = (p_top * (t_logp - q_top)).sum(-1)
        # the rest bucket: 0 * log(0 / q) = 0 when the teacher's top k hold all the mass
        has_rest = p_rest > 0
        kl_rest = torch.where(has_rest, p_rest * (t_rest - (s_rest.log() - log_s)), torch.zeros_like(p_rest))
        ctx.save_for_backward(e, e_top, t_index, p_top, p_rest, s_all, s_rest, has_rest)
        return (kl_top + kl_rest).sum()

    @staticmethod
    def backward(ctx, grad):
        e, e_top, t_index, p_top, p_rest, s_all, s_rest, has_rest = ctx.saved_tensors
        a = (p_top.sum(-1) + torch.where(has_rest, p_rest, torch.zeros_like(p_rest))) / s_all
        b = torch.where(has_rest, p_rest / s_rest, torch.zeros_like(p_rest))
        g = e * ((a - b) * grad)[:, None]  # outside T (e is 0 on T)
        g.scatter_add_(-1, t_index, (e_top * a[:, None] - p_top) * grad)
        return g, None, None, None


# ------------------------------------------------------------------------------------------- student
# Bytes of saved activations per token and per output element of the block linears when the blocks are not
# checkpointed: SmolLM2-135M (30 blocks x 5184 outputs), one 512-token window, float32: peak RSS 4366 MB without
# checkpointing against 2924 MB with it (bench/distill_step.py) = 18.1 bytes; 20 leaves a margin.
ACT_BYTES = 20
ACT_MEMORY_SHARE = 0.25  # of the device's free memory the saved activations may take


def free_memory(device: torch.device) -> int | None:
    """Free bytes of ``device`` (host RAM available for the CPU), None when unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            import psutil

            return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - unknown means: be careful
        return None
    return None


def use_checkpointing(setting: bool | str, linear_outputs: int, tokens: int, device: torch.device) -> bool:
    """``distill_checkpointing`` resolved: true / false as given; "auto" = checkpoint unless one step's saved
    activations (``ACT_BYTES`` x ``linear_outputs`` (sum of out_features of the quantized linears) x ``tokens``
    per step) fit ``ACT_MEMORY_SHARE`` of the device's free memory."""
    if setting != "auto":
        return bool(setting)
    free = free_memory(torch.device(device))
    return free is None or ACT_BYTES * linear_outputs * tokens > ACT_MEMORY_SHARE * free


@contextlib.contextmanager
def _checkpointed_blocks(model: nn.Module, enabled: bool):
    """Every decoder block's forward under activation checkpointing (instance attributes, removed after)."""
    blocks = list(decoder_blocks(model)) if enabled else []
    for block in blocks:
        cls_forward = type(block).forward

        def forward(*args, _block=block, _fwd=cls_forward, **kwargs):
            if not torch.is_grad_enabled():
                return _fwd(_block, *args, **kwargs)
            return checkpoint(functools.partial(_fwd, _block, **kwargs), *args, use_reentrant=False)

        block.forward = forward
    try:
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)


class _Student:
    """Runs the quantized model to its final hidden states and the LM head + KL in chunks of tokens."""

    def __init__(self, model: nn.Module, checkpointing: bool) -> None:
        self.model = model
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head); cannot distill it")
        self.cap = getattr(model.config, "final_logit_softcapping", None)
        self.checkpointing = checkpointing

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.base(input_ids=ids, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        return torch.tanh(logits.float() / self.cap) * self.cap if self.cap else logits

    def kl_sum(self, ids: torch.Tensor, teacher: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """Sum of the bucket KL over every predicted token of ``ids`` [b, seq] (teacher rows ``rows``)."""
        h = self.hidden(ids)[:, :-1].reshape(-1, self.head.in_features)
        t_logp = teacher["logp"][rows].reshape(h.shape[0], -1)
        t_index = teacher["index"][rows].reshape(h.shape[0], -1)
        t_rest = teacher["rest"][rows].reshape(-1)
        total = h.new_zeros((), dtype=torch.float32)

        def chunk(h_c, lp, ix, rs):
            return bucket_kl(self.head(h_c), lp, ix, rs, self.cap)

        for i in range(0, h.shape[0], HEAD_CHUNK):
            part = (h[i : i + HEAD_CHUNK], t_logp[i : i + HEAD_CHUNK], t_index[i : i + HEAD_CHUNK],
                    t_rest[i : i + HEAD_CHUNK])
            if self.checkpointing and torch.is_grad_enabled():
                total = total + checkpoint(chunk, *part, use_reentrant=False)
            else:
                total = total + chunk(*part)
        return total


def _check_head(student: _Student, model: nn.Module, ids: torch.Tensor) -> None:
    """The student's hidden-state + head path must give the model's own logits (soft-capping, scaling...)."""
    with torch.no_grad():
        ids = ids[:1, : min(ids.shape[1], 16)]
        ours = student.logits(student.hidden(ids)).float()
        theirs = model(input_ids=ids, use_cache=False).logits.float()
    if not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3 * max(1.0, float(theirs.abs().max()))):
        raise ValueError(f"{type(model).__name__}: its logits are not lm_head(base_model(ids)) (max difference "
                         f"{float((ours - theirs).abs().max()):.3g}); distillation does not support this model")


@contextlib.contextmanager
def _restore_on_error(snapshot: Snapshot):
    try:
        yield
    except BaseException:
        snapshot.restore()
        raise


def _teacher_for(reference: nn.Module, windows: torch.Tensor, rows: torch.Tensor, k: int, device: torch.device,
                 should_stop: Callable[[], bool] | None, known: dict[str, torch.Tensor] | None):
    """(the teacher's top-k on ``windows[rows]``, in that order, on ``device``; how many windows needed a pass):
    the windows ``known`` covers take it from there, the others from ``teacher_topk``. (None, n) if cancelled."""
    keys = ("logp", "index", "rest")
    have = torch.full((windows.shape[0],), -1, dtype=torch.long)  # window -> its row of ``known`` (-1: none)
    if known is not None:
        known_rows = torch.as_tensor(known["rows"], dtype=torch.long).cpu()
        want = (known_rows.numel(), windows.shape[1] - 1)
        k_want = min(k, reference.get_output_embeddings().out_features)
        if (known_rows.dim() != 1 or any(tuple(known[key].shape[:2]) != want for key in keys)
                or known["logp"].shape[-1] != k_want
                or not bool(((known_rows >= 0) & (known_rows < windows.shape[0])).all())):
            raise ValueError(f"known_teacher must cover rows of the {windows.shape[0]} windows with [rows, "
                             f"{windows.shape[1] - 1}, {k_want}] top-k tensors, got rows {tuple(known_rows.shape)} "
                             f"and logp {tuple(known['logp'].shape)}")
        have[known_rows] = torch.arange(known_rows.numel())
    source = have[rows]
    need = rows[source < 0]
    if need.numel() == rows.numel():  # nothing known: the plain teacher pass
        return teacher_topk(reference, windows[rows], k, device, should_stop), int(need.numel())
    parts = [{key: known[key].to(device) for key in keys}]
    if need.numel():
        computed = teacher_topk(reference, windows[need], k, device, should_stop)
        if computed is None:
            return None, int(need.numel())
        parts.append(computed)
        source[source < 0] = known["logp"].shape[0] + torch.arange(need.numel())  # after the known rows
    pool = _stack_teacher(parts, cat=True)
    return {key: value[source.to(value.device)] for key, value in pool.items()}, int(need.numel())


class Drawn(NamedTuple):
    pool: int  # training pool size: calibration windows 0..calib_pool-1, then the sampled windows
    calib_pool: int
    drawn: torch.Tensor  # pool indices the steps draw
    calib_rows: torch.Tensor  # calibration rows that need a teacher pass (drawn + held out)
    sample_rows: torch.Tensor  # sampled rows to draw


def drawn_windows(n: int, config: DistillSettings) -> Drawn:
    """What distillation of ``n`` calibration windows under ``config`` prepares, before any work.

    The training pool is the calibration windows 0..n_train-1 (calibration modes), then ``distill_samples``
    sampled windows (sampled modes). Which pool windows the steps draw depends on the seed alone, so only those
    (and the held-out windows) get a teacher pass or are sampled: 16 steps of a 44-window pool need 16, not 44.
    """
    n_val = holdout_count(n, config.distill_holdout)
    n_train = n - n_val
    val_rows = torch.arange(n_train, n) if n_val else torch.arange(n)
    n_calib_pool = n_train if config.distill_data != "sampled" else 0
    pool = n_calib_pool + (config.distill_samples if config.distill_data != "calibration" else 0)
    seen = torch.zeros(pool, dtype=torch.bool)
    for rows in itertools.islice(minibatches(pool, config.distill_batch, config.seed), config.distill_iters):
        seen[rows] = True
        if bool(seen.all()):  # every pool window drawn: the remaining steps add none
            break
    drawn = seen.nonzero().flatten()
    calib_rows = torch.unique(torch.cat([drawn[drawn < n_calib_pool], val_rows]))
    return Drawn(pool, n_calib_pool, drawn, calib_rows, drawn[drawn >= n_calib_pool] - n_calib_pool)


def lr_groups(trainables: dict[str, nn.Module], lr: float) -> tuple[list[dict], list[float]]:
    """Adam groups of the trainable layers' tensors, and the RMS of each VPTQ codebook tensor.

    The VPTQ codebooks step by ``lr`` times the median RMS of the model's codebook tensors, so ``lr`` is a step
    relative to the model's weight scale (SmolLM2-135M's median codebook RMS is 0.195, Gemma-3-270M's 0.036); the
    scalar layers' log-scales are relative already and take ``lr`` as it is.
    """
    vq, plain, rms = [], [], []
    for layer in trainables.values():
        for p in layer.params.values():
            if isinstance(layer, CodebookLinear):
                vq.append(p)
                rms.append(float(p.detach().float().pow(2).mean().sqrt()))
            else:
                plain.append(p)
    groups = []
    if vq:
        groups.append({"params": vq, "lr": lr * max(statistics.median(rms), 1e-8)})
    if plain:
        groups.append({"params": plain, "lr": lr})
    return groups, rms


def plan_steps(seconds_left: float, step_times: list[float], check_s: float, every: int) -> int:
    """How many more training steps fit ``seconds_left``: each costs the typical step so far (the median of the
    steps after the first, which pays one-time costs; the first alone when it is the only one) plus its share of
    the held-out checks (one every ``every`` steps, ``check_s`` each), and one last check is kept for the end."""
    typical = statistics.median(step_times[1:] or step_times)
    per_step = typical + check_s / max(every, 1)
    return max(0, int((seconds_left - check_s) // per_step)) if per_step > 0 else 0


# ------------------------------------------------------------------------------------------------ api
def distill(
    qmodel: nn.Module,
    reference: nn.Module,
    states: dict[str, VQLayerState | ScalarLayerState],
    windows: torch.Tensor,
    config: DistillSettings,
    on_step: OnStep | None = None,
    should_stop: Callable[[], bool] | None = None,
    known_teacher: dict[str, torch.Tensor] | None = None,
    deadline: float | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> dict:
    """Distil ``qmodel`` (the fake-quantized model ``quantize_model`` returns) towards ``reference``.

    Args:
        qmodel: its linears named in ``states`` hold the dequantized weights; trained on its own device.
        reference: the original model (any dtype/device, e.g. bf16), same vocabulary.
        states: full module name -> ``VQLayerState`` / ``ScalarLayerState`` of ``qmodel``'s quantized linears
            (updated in place).
        windows: token ids [n, seq]; the last ``holdout_count(n, config.distill_holdout)`` are held out.
        config: any method's config (``DistillSettings``): ``distill_iters`` steps of ``distill_batch`` windows,
            ``distill_lr`` (relative: codebooks step by it times the model's median codebook RMS, ``lr_groups``;
            log-scales of scalar layers), ``distill_norm_lr`` (1-D tensors, absolute),
            ``distill_topk``, ``distill_eval_every``,
            ``distill_checkpointing``, ``train_dtype``, ``seed``.
        on_step: called after every step with (step, training KL per token of that step's windows).
        should_stop: polled before every step; when true the run stops there and keeps the best check so far.
        known_teacher: the original model's top-k on some of ``windows``, already computed ({"rows" [m]
            window numbers, "logp" / "index" [m, seq-1, distill_topk], "rest" [m, seq-1]}; e.g. what
            ``sampled_calibration(topk=...)`` kept of the windows the original wrote): those get no teacher pass.
        deadline: a ``time.perf_counter()`` value the steps must end by (the run's ``time_budget``): before each
            step the run plans how many of ``distill_iters`` steps still fit (``plan_steps``, from the steps and
            checks so far) and its schedule runs over that many (never more); when none fits it stops like a
            cancel (keeping the best check). No time left at the start: nothing is trained.
        on_plan: hears the new step count each time the deadline shrinks the plan.

    Returns metrics: ``steps`` done, ``planned_steps`` (< ``distill_iters`` when the deadline cut them),
    ``cancelled``, ``heldout_windows``, ``kl_before`` / ``kl_after`` (held-out
    bucket KL per token; after <= before), ``best_step`` (0 = nothing kept), ``train_kl_first`` /
    ``train_kl_last``, ``teacher_seconds``, ``seconds``, ``codebook_rms`` (VPTQ: min, median, max).
    """
    t_start = time.perf_counter()
    if not states:
        raise ValueError("states must name the quantized linears of qmodel")
    bad = [name for name, st in states.items() if not isinstance(st, (VQLayerState, ScalarLayerState))]
    if bad:
        raise TypeError(f"distill trains VPTQ codebooks or scalar scales; {bad[0]!r} is a "
                        f"{type(states[bad[0]]).__name__}, not a VQLayerState or ScalarLayerState")
    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"windows must be token ids [n, seq >= 2], got shape {tuple(windows.shape)}")
    ref_vocab = reference.get_output_embeddings().out_features
    if ref_vocab != qmodel.get_output_embeddings().out_features:
        raise ValueError(f"reference has a vocabulary of {ref_vocab}, the quantized model "
                         f"{qmodel.get_output_embeddings().out_features}")
    should_stop = should_stop or (lambda: False)
    on_step = on_step or (lambda _step, _loss: None)
    device = next(qmodel.parameters()).device
    n = windows.shape[0]
    n_val = holdout_count(n, config.distill_holdout)
    n_train = n - n_val
    dtype = compute_dtype(config.train_dtype, device)
    data = config.distill_data
    metrics = {"steps": 0, "cancelled": False, "heldout_windows": n_val, "data": data}

    def cancelled() -> dict:
        metrics.update(cancelled=True, seconds=time.perf_counter() - t_start)
        return metrics

    if deadline is not None and time.perf_counter() >= deadline:
        metrics.update(planned_steps=0, out_of_time=True, best_step=0, seconds=time.perf_counter() - t_start)
        return metrics

    # The windows trained on and checked, and the teacher's top-k on each: calibration windows need a
    # teacher pass; sampled windows get theirs from the sampling. Held-out: the last n_val calibration
    # windows (all of them when n_val is 0, then also trained on in the calibration modes). Only the windows
    # the steps draw are prepared (``drawn_windows``).
    val_rows = torch.arange(n_train, n) if n_val else torch.arange(n)
    pool, n_calib_pool, drawn, calib_rows, sample_rows = drawn_windows(n, config)
    t0 = time.perf_counter()
    teacher, passes = _teacher_for(reference, windows, calib_rows, config.distill_topk, device, should_stop,
                                   known_teacher)
    metrics["teacher_seconds"] = time.perf_counter() - t0
    if teacher is None:
        return cancelled()
    used = windows[calib_rows].to(device)
    # where[i]: the row of ``used`` (and of the teacher) holding pool window i (-1: never drawn)
    where = torch.full((pool,), -1, dtype=torch.long)
    position = torch.full((n,), -1, dtype=torch.long)
    position[calib_rows] = torch.arange(calib_rows.numel())
    where[:n_calib_pool] = position[:n_calib_pool]
    val = position[val_rows]
    if sample_rows.numel():
        # windows sampled from the original model, each started from a training window's first token
        t0 = time.perf_counter()
        starts = windows[sample_rows % n_train, :1]
        got = sample_windows(reference, starts, windows.shape[1], seed=config.seed, batch=SAMPLE_BATCH,
                             should_stop=should_stop, topk=config.distill_topk, device=device, rows=sample_rows,
                             dtype=config.sample_dtype)
        metrics["sample_seconds"] = time.perf_counter() - t0
        if got is None:
            return cancelled()
        sampled, sampled_teacher = got
        where[n_calib_pool + sample_rows] = torch.arange(used.shape[0], used.shape[0] + sampled.shape[0])
        used = torch.cat([used, sampled.to(device)])
        teacher = _stack_teacher([teacher, sampled_teacher], cat=True)
    metrics["sampled_windows"] = int(sample_rows.numel())
    windows = used
    metrics.update(train_windows=pool, drawn_windows=int(drawn.numel()), teacher_windows=passes,
                   known_teacher_windows=int(calib_rows.numel()) - passes)

    linears = {name: qmodel.get_submodule(name) for name in states}
    dense = dense_parameters(qmodel) if config.distill_norm_lr > 0 else []
    dense_dtypes = [p.dtype for p in dense]
    was_training = qmodel.training
    qmodel.eval()
    checkpointing = use_checkpointing(config.distill_checkpointing, sum(st.out_features for st in states.values()),
                                      windows.shape[1] * config.distill_batch, device)
    metrics["checkpointing"] = checkpointing
    student = _Student(qmodel, checkpointing)
    _check_head(student, qmodel, windows)
    tokens_per_window = windows.shape[1] - 1

    def heldout_kl() -> float:
        with torch.no_grad():
            total = 0.0
            for i in val.tolist():
                total += float(student.kl_sum(windows[i : i + 1], teacher, torch.tensor([i], device=device)))
        return total / (val.numel() * tokens_per_window)

    def make(name: str, linear: nn.Module) -> nn.Module:
        return trainable_linear(states[name], linear.bias, device)

    try:
        for p in dense:  # train 1-D tensors in float32 (put back in their dtype after)
            p.data = p.data.float()
        with swapped_in(qmodel, list(states), make) as trainables, _checkpointed_blocks(
            qmodel, checkpointing
        ):
            codebooks = [p for layer in trainables.values() for p in layer.params.values()]
            codebooks_trained = codebooks if config.distill_lr > 0 else []
            trained = codebooks_trained + dense
            if not trained:
                raise ValueError("distill_lr and distill_norm_lr are both 0: nothing to train")
            start = Snapshot(codebooks + dense)
            best = start
            groups = []
            if codebooks_trained:
                groups, rms = lr_groups(trainables, config.distill_lr)
                if rms:  # min, median, max
                    metrics["codebook_rms"] = [min(rms), statistics.median(rms), max(rms)]
            if dense:
                groups.append({"params": dense, "lr": config.distill_norm_lr})
            base_lrs = [g["lr"] for g in groups]
            optimizer = torch.optim.Adam(groups)
            iters = config.distill_iters
            every = eval_every(config)
            warmup = int(iters * WARMUP_FRACTION)
            batches = (where[rows] for rows in minibatches(pool, config.distill_batch, config.seed))
            with only_trainable(qmodel, trained), torch.enable_grad(), _restore_on_error(start):
                t0 = time.perf_counter()
                before = heldout_kl()
                check_s = time.perf_counter() - t0
                best_kl, best_step = before, 0
                metrics["kl_before"] = before
                step_times: list[float] = []
                for step in range(config.distill_iters):
                    if should_stop():
                        metrics["cancelled"] = True
                        break
                    if deadline is not None:  # the first step runs while any time is left; then they are planned
                        now = time.perf_counter()
                        left = (plan_steps(deadline - now, step_times, check_s, every) if step_times
                                else int(now < deadline))
                        # the plan follows what fits, both ways (the first step pays one-time costs, so an early
                        # plan is often short), never past distill_iters; the schedule stretches with it, and no
                        # step runs past the plan (where the schedule's learning rate is 0)
                        fit = min(config.distill_iters, step + left)
                        if step_times and left > 0 and fit != iters:
                            iters, warmup = fit, int(fit * WARMUP_FRACTION)
                            if on_plan is not None:
                                on_plan(iters)
                        if left <= 0:
                            iters = step  # the plan ends here
                            metrics["out_of_time"] = True
                            break
                    t_step = time.perf_counter()
                    for g, lr in zip(optimizer.param_groups, base_lrs, strict=True):
                        g["lr"] = lr * cosine_factor(step, iters, warmup)
                    rows = next(batches)
                    with autocast(device, dtype):
                        loss = student.kl_sum(windows[rows], teacher, rows) / (rows.numel() * tokens_per_window)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    value = float(loss.detach())
                    if not math.isfinite(value):
                        raise FloatingPointError(f"distillation loss is {value} at step {step + 1}")
                    metrics.setdefault("train_kl_first", value)
                    metrics["train_kl_last"] = value
                    metrics["steps"] = step + 1
                    step_times.append(time.perf_counter() - t_step)
                    on_step(step + 1, value)
                    if (step + 1) % every == 0 or step + 1 == iters:
                        t0 = time.perf_counter()
                        kl_now = heldout_kl()
                        check_s = time.perf_counter() - t0
                        if kl_now < best_kl:
                            best_kl, best_step = kl_now, step + 1
                            best = Snapshot(codebooks + dense)
                metrics["planned_steps"] = iters
                stopped = metrics["cancelled"] or metrics.get("out_of_time")
                if stopped and metrics["steps"] and best_step < metrics["steps"] and metrics["steps"] % every:
                    kl_now = heldout_kl()  # the steps since the last check may still be the best
                    if kl_now < best_kl:
                        best_kl, best_step = kl_now, metrics["steps"]
                        best = Snapshot(codebooks + dense)
            best.restore()
            write_back(linears, trainables, states)
    finally:
        for p, dt in zip(dense, dense_dtypes, strict=True):
            p.data = p.data.to(dt)
        qmodel.train(was_training)
    metrics.update(kl_after=best_kl, best_step=best_step, seconds=time.perf_counter() - t_start)
    return metrics


def distill_label(settings) -> str:
    """The run label's distillation part (every method's): `` kd16``, `` kd64-mixed``, or "" when off."""
    if not settings.get("distill_iters"):
        return ""
    data = settings.get("distill_data", "calibration")
    return f" kd{settings['distill_iters']}" + ("" if data == "calibration" else f"-{data}")


# Distillation trains the whole model in memory next to the original (no block streaming): the presets that
# include it keep it for models up to this many parameters and leave it out above (``sized_preset``).
PRESET_DISTILL_MAX_PARAMS = 1_500_000_000


def sized_preset(settings: dict, params: int) -> tuple[dict, str]:
    """A preset's ``settings`` for a model of ``params`` parameters, and a note when something was left out:
    above ``PRESET_DISTILL_MAX_PARAMS`` its distillation steps and its self-written calibration windows (both
    hold the whole model in memory, distillation the original too)."""
    if params <= PRESET_DISTILL_MAX_PARAMS:
        return settings, ""
    parts, kept = [], dict(settings)
    if settings.get("distill_iters"):
        parts.append(f"{settings['distill_iters']} distillation steps")
        kept["distill_iters"] = 0
    if settings.get("calib_sampled_share"):
        parts.append(f"{'its ' if parts else ''}self-written calibration windows "
                     f"({settings['calib_sampled_share']:g} of them)")
        kept["calib_sampled_share"] = 0.0
    if not parts:
        return settings, ""
    note = (f"the preset's {' and '.join(parts)} are left out for a model of {params / 1e9:.1f}B parameters "
            f"(presets do these for models up to {PRESET_DISTILL_MAX_PARAMS / 1e9:g}B: they hold the whole model in "
            "memory); set them to have them anyway")
    return kept, note


def _distill_hook(ctx) -> dict | None:
    plan = [ctx.config.distill_iters]  # the progress shows the planned total (a time budget may shrink it)
    return distill(ctx.model, ctx.reference, ctx.states, ctx.calib_ids, ctx.config,
                   on_step=lambda step, kl: ctx.on_step("distill", step, plan[0], kl), should_stop=ctx.should_stop,
                   known_teacher=ctx.teacher, deadline=ctx.deadline, on_plan=lambda n: plan.__setitem__(0, n))


# Every built-in method's after-model step (its config's ``distill_iters`` > 0).
DISTILL_HOOK = ModelHook("distill", lambda config: config.distill_iters > 0, _distill_hook)
