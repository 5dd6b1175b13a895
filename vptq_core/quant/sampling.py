"""Windows the original model writes itself: ancestral sampling at temperature 1 from a start token, for the
block-by-block stage's calibration (``sampled_calibration``, ``calib_sampled_share``) and for distillation's
training windows (``distill_data`` "sampled" / "mixed"); docs/methods.md#self-written-calibration.

Text drawn from the original model covers every domain it knows, in proportion to how it predicts, not only the
calibration text's. The sampling's own logits give the teacher's top-k on the written windows for free
(``teacher.topk_of``). Under a ``time_budget`` the writing of the calibration windows is projected from its first
tokens (``WritingProjection``); when it would take too large a share of the budget, the writing goes on with as
many of the windows as fit (``windows_that_fit``), the others staying text, or is given up when fewer than
``MIN_WRITTEN_SHARE`` of them would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from .calib_windows import distill_settings, written_rows
from .device import native_bf16
from .packed_dense import packed_linears
from .repetition import MAX_REPEATED_SHARE, degenerate
from .teacher import stack_teacher, topk_of

# Windows written at once: one batched decode step serves them all (bench/sampling.py compares batch sizes).
SAMPLE_BATCH = 32
# What writing costs, in windows' worth (``window_equivalents``; seconds: ``cost.sampling_seconds``): each window its
# own, and each batched pass this many besides, whatever its rows (the weights are read once a token for the whole
# batch); fitted to SmolLM2-135M, 1.5 s a window and 50 s a pass over 511 tokens on the reference machine.
PASS_WINDOWS = 50.0 / 1.5
# The precision windows are written in. The default is one precision on every machine, so a preset gives the same
# calibration on every CPU: float32 (bf16 would be emulated, many times slower, where the CPU has no bf16
# instructions; bench/sampling.py measures both). "auto" (bf16 only where the hardware multiplies it) differs by
# machine and is kept as an explicit choice only.
SAMPLE_DTYPES = ("float32", "bfloat16", "model", "auto")
DEFAULT_SAMPLE_DTYPE = "float32"
CALIB_SAMPLE_ROWS = 1 << 20  # generator row numbers of calibration samples (distillation's own start at 0)
# Under a ``time_budget`` the windows the original writes itself may take at most this share of it, as
# ``WritingProjection`` projects it from the tokens drawn so far; over it the writing goes on with the windows that
# fit, the later ones staying text: a writing that takes much more leaves distillation too few steps to help
# (docs/methods.md#time-budget).
SAMPLING_BUDGET_SHARE = 0.2
# The fewest of the windows a writing under a budget goes on with, as a share of them; when fewer fit, every window
# stays text. A batched pass costs much the same for fewer windows (``sampling_ratio``), so a writing cut
# below this would pay most of its seconds for few windows.
MIN_WRITTEN_SHARE = 0.5
PROJECT_AFTER = 16  # polls before the first (lower-bound) projection
FIT_CHUNKS = 4  # runs of tokens whose median costs the growth is fitted to (``WritingProjection.projected``)
# The fitted projection never exceeds this multiple of the mean-cost one: the true totals of the models measured
# stay well under it (bench/sampling_projection.py), and a fit thrown off by a busy moment would otherwise give up
# a writing that fits.
GROWTH_CAP = 2.0
# A degenerate written window (``repetition``) is drawn again at most this many times; redraw a of row r seeds its
# generator as row r + a x REDRAW_ROWS, far from every row number a draw uses and within the 32 bits of a seed the
# CPU generator keeps.
REDRAWS = 2
REDRAW_ROWS = 1 << 28


def sampling_dtype(model: nn.Module, choice: str = DEFAULT_SAMPLE_DTYPE) -> torch.dtype | None:
    """The dtype ``sample_windows`` runs ``model`` in: None = its own parameters as they are; a dtype = copies of
    its floating-point parameters in that dtype (its buffers, e.g. rotary frequencies, untouched).

    ``choice``: "float32" (the default: float32 on every machine, copies only when the parameters are not float32),
    "bfloat16" (always bf16), "model" (as it is), "auto" (bf16 when the parameters are float32 on a device that
    multiplies bf16 in hardware, ``device.native_bf16``; the model's own dtype elsewhere: differs by machine)."""
    if choice not in SAMPLE_DTYPES:
        raise ValueError(f"sample_dtype must be one of {SAMPLE_DTYPES}, got {choice!r}")
    param = next(model.parameters())
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(choice)
    if choice == "model" or param.dtype == want:
        return None
    if want is not None:
        return want
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


def window_equivalents(windows: int) -> float:
    """The cost of writing ``windows`` windows in windows' worth: their own and ``PASS_WINDOWS`` per batched pass of up
    to ``SAMPLE_BATCH``."""
    return windows + PASS_WINDOWS * math.ceil(windows / SAMPLE_BATCH) if windows > 0 else 0.0


def sampling_ratio(windows: int, of: int) -> float:
    """The seconds of writing ``windows`` windows over those of writing ``of`` windows of the same length."""
    return window_equivalents(windows) / max(window_equivalents(of), 1e-30)


def fewest_written(windows: int) -> int:
    """The fewest of ``windows`` planned windows a writing under a budget goes on with (``MIN_WRITTEN_SHARE``)."""
    return max(1, math.ceil(MIN_WRITTEN_SHARE * windows))


def windows_that_fit(windows: int, seconds: Callable[[int], float], limit: float) -> int:
    """The most windows, of ``windows``, whose writing takes at most ``limit`` seconds (``seconds(n)``: the
    seconds of writing n of them), but not fewer than ``fewest_written`` of them: 0 then."""
    for n in range(windows, fewest_written(windows) - 1, -1):
        if seconds(n) <= limit:
            return n
    return 0


class WritingProjection:
    """The projected seconds of writing ``batches`` batches of ``per_batch`` tokens each, from the times of the
    polls so far (one poll before every token; ``sample_windows``' ``should_stop``).

    A token costs more the further along its window it is (attention reads every earlier position), so scaling
    the mean cost so far to every token projects too little, and re-projecting at every token would give a
    writing up only late. The growth cannot be told from the first few dozen tokens either, so the writing is
    decided on twice over. At PROJECT_AFTER polls and the doublings after: the mean cost so far (without the
    set-up and the first token), a lower bound, stops it only when even that is over. At a quarter of the first
    window (at least PROJECT_AFTER polls), once and for all: a cost per token growing linearly with the position,
    fitted to the tokens so far (``projected``; bench/sampling_projection.py replays real writings).
    """

    def __init__(self, per_batch: int, batches: int, start: float) -> None:
        self.per_batch, self.batches, self.start = per_batch, batches, start
        self.draws = per_batch * batches
        self.final = max(PROJECT_AFTER, per_batch // 4)  # the poll of the growth-aware decision
        self.times: list[float] = []  # the polls' times after ``start``, up to the final decision

    @property
    def final_decision(self) -> bool:
        """The last poll recorded was the growth-aware decision (``projected``); later polls decide nothing."""
        return len(self.times) == self.final

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
    """``calib_ids`` with the last ``sampled_count`` of the windows the block-by-block stage sees (``layerwise_count``)
    replaced by windows ``model`` writes itself (``sample_windows``, seeded by ``config.seed``, each started from
    the first token of the window it replaces, ``start_tokens``); the held-out check windows after them stay text.
    ``calib_ids`` itself when ``calib_sampled_share`` is 0; None if ``should_stop`` turned true. With ``topk`` > 0
    it returns (windows, known): ``known`` the teacher's top-k on the written windows, taken from the sampling's own
    logits, as ``distill(known_teacher=...)`` takes it ({"rows", "logp", "index", "rest"} on the CPU; None when no
    window is written). A written window stuck in a loop is drawn again (``repetition``,
    ``sample_windows(max_repeated=...)``); one still degenerate after that stays text (``info`` gets
    "degenerate_kept_text"; under a budget only redraws that fit the writing's share are drawn, "redraws_skipped"
    says when one was not). With a ``time_budget``, when the writing is projected to take more than
    ``SAMPLING_BUDGET_SHARE`` of the budget, it goes on with as many of the windows as fit (the first ones;
    ``windows_that_fit``, the seconds of fewer scaled by ``sampling_ratio``) and the others stay text, or it
    stops and every window stays text when fewer than ``MIN_WRITTEN_SHARE`` of them fit even by the mean cost so far
    (a lower bound; when only the fitted growth says so, it goes on with that share); ``info`` (a dict) then gets
    "self_written" (the windows written), "planned", the projection and the reason."""
    rows = written_rows(calib_ids.shape[0], config)
    if not rows.numel():
        return (calib_ids, None) if topk else calib_ids
    settings = distill_settings(config)
    limit = SAMPLING_BUDGET_SHARE * float(settings.time_budget or 0.0)
    batches = math.ceil(rows.numel() / SAMPLE_BATCH)
    projection = WritingProjection(calib_ids.shape[1] - 1, batches, time.perf_counter())
    going_on = [rows.numel()]  # the windows the writing goes on with
    over = {}

    def stop() -> bool:
        if should_stop is not None and should_stop():
            return True
        if limit <= 0:
            return False
        now = time.perf_counter()
        projected = projection.poll(now)
        if projected is None or projected <= limit:
            return False
        elapsed, planned = now - projection.start, rows.numel()

        def fitting(total: float) -> int:
            return windows_that_fit(planned, lambda n: elapsed + (total - elapsed) * sampling_ratio(n, planned), limit)

        fit = fitting(projected)
        if fit and not projection.final_decision:
            return False  # a lower bound: the growth-aware decision takes the windows that fit
        if not fit and projection.final_decision and fitting(projection.flat()):
            # the fitted growth says fewer than half fit, the lower bound does not: the fit extrapolates a quarter of a
            # window and a busy moment of the machine throws it off (bench/sampling_projection.py), so the writing
            # goes on with the fewest rather than throwing away what it wrote
            fit = fewest_written(planned)
        budget = limit / SAMPLING_BUDGET_SHARE
        over.update(self_written=fit, planned=planned, projected_seconds=round(projected, 1),
                    limit_seconds=round(limit, 1),
                    reason=f"writing {planned} windows was projected at {projected:.0f} s, over "
                           f"{SAMPLING_BUDGET_SHARE:.0%} of the {budget:.0f} s time budget: " + (
                               f"{fit} written, {planned - fit} stay text" if fit else
                               f"fewer than {MIN_WRITTEN_SHARE:.0%} of them fit, the calibration stays text"))
        going_on[0] = fit
        return not fit

    def redraw_fits(rows_again: int) -> bool:
        """Under a budget a redraw too must fit the writing's share: it costs about what the writing so far did, scaled
        to its rows (``sampling_ratio``)."""
        spent = time.perf_counter() - projection.start
        if limit <= 0 or spent * (1.0 + sampling_ratio(rows_again, going_on[0])) <= limit:
            return True
        over.update(redraws_skipped=rows_again)
        return False

    got = sample_windows(model, start_tokens(model, calib_ids[rows]), calib_ids.shape[1], seed=settings.seed,
                         batch=SAMPLE_BATCH, should_stop=stop, rows=rows + CALIB_SAMPLE_ROWS, topk=topk,
                         device=torch.device("cpu"), dtype=settings.sample_dtype, max_repeated=MAX_REPEATED_SHARE,
                         keep=lambda: going_on[0], redraw_fits=redraw_fits)
    if over and info is not None:
        info.update(over)
    if got is None and over and not going_on[0]:
        return (calib_ids, None) if topk else calib_ids
    if got is None:
        return None
    written, teacher = got if topk else (got, None)
    rows = rows[: written.shape[0]]  # the first ones, when the writing went on with fewer
    keep = ~degenerate(written)  # still a loop after its redraws: the text window stays
    if not bool(keep.all()) and info is not None:
        info.update(degenerate_kept_text=int((~keep).sum()))
    out = calib_ids.clone()
    out[rows[keep]] = written[keep].to(out.dtype)
    if not topk:
        return out
    return out, {"rows": rows[keep], **{key: value[keep.to(value.device)] for key, value in teacher.items()}}


def start_tokens(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """What the windows ``model`` writes in place of ``windows`` [n, seqlen] start from: each window's first token,
    or its first two when the windows begin with the model's BOS token (``data.wants_bos``), which alone would
    start every written window alike."""
    bos = getattr(getattr(model, "config", None), "bos_token_id", None)
    if isinstance(bos, int) and windows.shape[1] > 2 and bool((windows[:, 0] == bos).all()):
        return windows[:, :2]
    return windows[:, :1]


@torch.no_grad()
def sample_windows(reference: nn.Module, starts: torch.Tensor, seqlen: int, seed: int = 0, batch: int = 8,
                   temperature: float = 1.0, should_stop: Callable[[], bool] | None = None,
                   topk: int = 0, device: torch.device | None = None, rows: torch.Tensor | None = None,
                   dtype: str = "model", pack: bool = True, max_repeated: float | None = None,
                   keep: Callable[[], int] | None = None, redraw_fits: Callable[[int], bool] | None = None):
    """Windows of ``seqlen`` tokens sampled from ``reference`` itself -> [n, seqlen] int64 on the CPU.

    Row i begins with ``starts[i]`` ([n, s] token ids, 1 <= s < seqlen; e.g. the BOS token, or a calibration
    window's first token for variety) and continues by ancestral sampling at ``temperature`` (1.0 = the
    model's own distribution), ``batch`` rows at a time with the KV cache (row i's draws come from its own
    generator, so a row does not depend on the batch it was sampled in). Reproducible from ``seed``. None if
    ``should_stop`` turned true (polled before every token). With ``topk`` > 0 it returns (windows, teacher): the
    reference's top-k log-probabilities at every predicted position, as ``teacher_topk`` gives them (on
    ``device``), taken from the logits the sampling computed anyway. ``rows`` [n]: the row numbers that seed
    each row's generator (default 0..n-1), so any subset of a larger draw gets exactly that draw's rows.
    ``pack``: a float32 model on the CPU runs its linears through oneDNN with packed weights while sampling
    (``packed_dense``); False: as it is. ``max_repeated``: a row whose share of repeated 4-grams exceeds it
    (``repetition.repeated_share``, a degenerate loop) is drawn again, up to ``REDRAWS`` times, each time from its
    own generator seeded afresh (``REDRAW_ROWS`` further on), so the redraws too are reproducible and independent of
    the batch; a row still over it after the last is returned as drawn (the caller decides). ``keep``: polled
    before every token, how many rows, from the first, the writing goes on with; when it falls, the later rows are
    dropped (their batch's cache with them) and the windows returned are the first that many (never fewer than 1).
    ``redraw_fits``: asked before each redraw with the number of rows to draw again; False: no more redraws (the
    rows are returned as drawn).
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
    got = _write(reference, starts, seqlen, seed, batch, temperature, should_stop, topk, device, rows, dtype, pack,
                 keep)
    for attempt in range(1, REDRAWS + 1):
        if got is None or max_repeated is None:
            break
        windows, teacher = got if topk else (got, None)
        bad = degenerate(windows, max_repeated).nonzero()[:, 0]
        if not bad.numel() or (redraw_fits is not None and not redraw_fits(bad.numel())):
            break
        again = _write(reference, starts[bad], seqlen, seed, batch, temperature, should_stop, topk, device,
                       rows[bad] + attempt * REDRAW_ROWS, dtype, pack)
        if again is None:
            return None
        new_windows, new_teacher = again if topk else (again, None)
        windows[bad] = new_windows
        if topk:
            for key in teacher:
                teacher[key][bad.to(teacher[key].device)] = new_teacher[key]
    return got


def _write(reference: nn.Module, starts: torch.Tensor, seqlen: int, seed: int, batch: int, temperature: float,
           should_stop: Callable[[], bool] | None, topk: int, device: torch.device | None, rows: torch.Tensor,
           dtype: str, pack: bool, keep: Callable[[], int] | None = None):
    """``sample_windows`` without the checks and the redraws: every row drawn once (the first ``keep()`` of
    them)."""
    from .lean_decoder import LeanDecoder  # the decode loop, loaded only when windows are written

    ref_device = next(reference.parameters()).device
    params = _cast_params(reference, sampling_dtype(reference, dtype))  # one set of copies for either path
    forward = _runner(reference, params)
    out, teachers = [], []
    # float32 on the CPU: the linears through oneDNN with packed weights (packed_dense: faster at these few-row
    # products), for the sampling only
    with packed_linears(reference, enabled=pack and params is None, rows=min(batch, starts.shape[0])):
        for lo in range(0, starts.shape[0], batch):
            if keep is not None and lo >= keep():
                break
            ids = starts[lo : lo + batch].cpu()
            # one generator per row: a row's tokens do not depend on the batch it was sampled in
            gens = [torch.Generator().manual_seed(seed * 1_000_003 + int(r)) for r in rows[lo : lo + batch]]
            # llama-family models: the lean decoder (the same weights, far fewer ops per token, no cache growth)
            lean = LeanDecoder.for_model(reference, seqlen, batch=ids.shape[0], params=params)
            step_in, past, steps = ids, None, []
            while ids.shape[1] < seqlen:
                if should_stop is not None and should_stop():
                    return None
                rows_on = ids.shape[0] if keep is None else min(ids.shape[0], max(keep() - lo, 1))
                if rows_on < ids.shape[0]:  # the writing goes on with fewer rows: the later ones are dropped
                    first = step_in is ids
                    ids, gens = ids[:rows_on], gens[:rows_on]
                    step_in = ids if first else step_in[:rows_on]
                    steps = [{key: value[:rows_on] for key, value in s.items()} for s in steps]
                    if lean is not None:
                        lean.keep_rows(rows_on)
                    elif past is not None:
                        past.batch_select_indices(torch.arange(rows_on, device=ref_device))
                if lean is None:
                    res = forward(input_ids=step_in.to(ref_device), past_key_values=past, use_cache=True)
                    past, logits = res.past_key_values, res.logits
                elif step_in is ids:  # the first pass: the start tokens
                    logits = lean.prefill(step_in.to(ref_device), all_positions=bool(topk))
                else:
                    logits = lean.step(step_in.to(ref_device))
                logits = logits if logits.dim() == 3 else logits[:, None]
                if topk:
                    steps.append(topk_of(logits, topk, device or ref_device))  # [b, new positions, k]
                step_in = _draw(logits[:, -1], temperature, gens)
                ids = torch.cat([ids, step_in], dim=1)
            out.append(ids)
            if topk:
                teachers.append(stack_teacher(steps, dim=1, cat=True))
    windows = torch.cat(out)
    return (windows, stack_teacher(teachers, cat=True)) if topk else windows


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
