"""Perplexity (standard protocol) and agreement with the original model: KL statistics (mean, median, tail),
the probability shift of the original's top token and top-1 agreement, from one per-position function
(``token_divergence``) that the per-token view (``divergence.py``) uses too."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .data import DEFAULT_EVAL_SPLIT, eval_windows


@dataclass
class EvalResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    seqlen: int
    windows: int
    tokens: int  # predicted tokens
    text: str
    seconds: float
    kl_divergence: float | None = None  # mean KL(P_reference || P_model) per token (nats)
    top1_agreement: float | None = None  # fraction of positions where both argmax tokens agree
    reference_perplexity: float | None = None
    # llama.cpp-style statistics over the per-token KL (nats) and Delta p = p_model - p_reference of the
    # reference's top token (a fraction; negative: the model gives the original's favourite less weight)
    kl_median: float | None = None
    kl_p90: float | None = None
    kl_p99: float | None = None
    kl_max: float | None = None
    delta_p_mean: float | None = None
    delta_p_p01: float | None = None
    delta_p_p99: float | None = None
    split: str | None = None  # the held-out split of ``text`` ("dev", "test", "eval"); None: given windows

    def to_dict(self) -> dict:
        return asdict(self)

    def protocol(self) -> str:
        where = f"{self.split} split" if self.split else "given windows"
        return (f"text={self.text!r} ({where}), seqlen={self.seqlen}, windows={self.windows}, "
                f"non-overlapping, spread over the text, {self.tokens} predicted tokens, ppl=exp(mean NLL)")


@dataclass
class TokenDivergence:
    """Per position of one window: ``kl`` KL(P_ref || P_model) in nats, ``delta_p`` p_model - p_ref of the
    reference's top token, ``agree`` whether both top-1 tokens are the same; with ``target``, each side's
    probability of the actual next token; with ``k``, each side's top-k ids and probabilities. All on the CPU."""

    kl: torch.Tensor  # [T] float32
    delta_p: torch.Tensor  # [T] float32
    agree: torch.Tensor  # [T] bool
    p_model_target: torch.Tensor | None = None  # [T]
    p_ref_target: torch.Tensor | None = None  # [T]
    model_top_ids: torch.Tensor | None = None  # [T, k]
    model_top_p: torch.Tensor | None = None  # [T, k]
    ref_top_ids: torch.Tensor | None = None  # [T, k]
    ref_top_p: torch.Tensor | None = None  # [T, k]


def token_divergence(logp_model: torch.Tensor, logp_ref: torch.Tensor, target: torch.Tensor | None = None,
                     k: int = 0) -> TokenDivergence:
    """Per-position divergence of two [T, vocab] log-probability tensors (``log_softmax`` of each model's
    logits at the same positions): what ``evaluate`` averages and the per-token view shows."""
    if logp_model.shape != logp_ref.shape or logp_model.dim() != 2:
        raise ValueError(f"log-probabilities must both be [positions, vocab], got {tuple(logp_model.shape)} and "
                         f"{tuple(logp_ref.shape)}")
    logp_model, logp_ref = logp_model.float(), logp_ref.float()
    kl = F.kl_div(logp_model, logp_ref, log_target=True, reduction="none").sum(-1)
    ref_top = logp_ref.argmax(-1, keepdim=True)
    delta_p = (logp_model.gather(-1, ref_top).exp() - logp_ref.gather(-1, ref_top).exp()).squeeze(-1)
    out = TokenDivergence(kl=kl.cpu(), delta_p=delta_p.cpu(), agree=(logp_model.argmax(-1) == ref_top[:, 0]).cpu())
    if target is not None:
        index = target.to(logp_model.device).view(-1, 1)
        out.p_model_target = logp_model.gather(-1, index).exp().squeeze(-1).cpu()
        out.p_ref_target = logp_ref.gather(-1, index).exp().squeeze(-1).cpu()
    if k > 0:
        k = min(k, logp_model.shape[-1])
        top_model, top_ref = logp_model.topk(k, dim=-1), logp_ref.topk(k, dim=-1)
        out.model_top_ids, out.model_top_p = top_model.indices.cpu(), top_model.values.exp().cpu()
        out.ref_top_ids, out.ref_top_p = top_ref.indices.cpu(), top_ref.values.exp().cpu()
    return out


def divergence_stats(kl: torch.Tensor, delta_p: torch.Tensor, agree: torch.Tensor) -> dict[str, float]:
    """The ``EvalResult`` statistics of per-token values: ``kl_divergence`` (mean), ``kl_median``, ``kl_p90``,
    ``kl_p99``, ``kl_max``, ``delta_p_mean``, ``delta_p_p01``, ``delta_p_p99``, ``top1_agreement`` (quantiles
    interpolated linearly, numpy's default)."""
    if kl.numel() == 0:
        raise ValueError("no predicted tokens to summarize")
    kl_np = kl.double().numpy()
    dp_np = delta_p.double().numpy()
    kl_q = np.quantile(kl_np, [0.5, 0.9, 0.99])
    dp_q = np.quantile(dp_np, [0.01, 0.99])
    return {"kl_divergence": float(kl_np.mean()), "kl_median": float(kl_q[0]), "kl_p90": float(kl_q[1]),
            "kl_p99": float(kl_q[2]), "kl_max": float(kl_np.max()), "delta_p_mean": float(dp_np.mean()),
            "delta_p_p01": float(dp_q[0]), "delta_p_p99": float(dp_q[1]),
            "top1_agreement": float(agree.double().mean())}


def kl_stats_text(stats: Mapping) -> str:
    """The per-token KL and Delta p statistics (``EvalResult`` fields, or ``divergence_stats``) in one line."""
    return (f"KL per token: median {stats['kl_median']:.4f}, p90 {stats['kl_p90']:.4f}, "
            f"p99 {stats['kl_p99']:.4f}, max {stats['kl_max']:.4f} nats · Δp of the original's top token: "
            f"mean {100 * stats['delta_p_mean']:+.2f}%, p01 {100 * stats['delta_p_p01']:+.2f}%, "
            f"p99 {100 * stats['delta_p_p99']:+.2f}%")


def model_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits of ``ids`` [batch, T] on the CPU, the ids moved to the model's device."""
    device = next(model.parameters()).device
    return model(ids.to(device), use_cache=False).logits.float().cpu()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokenizer,
    text: str = "wiki",
    seqlen: int = 512,
    max_windows: int | None = None,
    reference: nn.Module | None = None,
    on_window: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    windows: torch.Tensor | None = None,
    bos: bool | str = "auto",
    split: str = DEFAULT_EVAL_SPLIT,
) -> EvalResult:
    """Perplexity of ``model`` on ``split`` ("test", "dev" or "eval" = both) of ``text`` ("wiki", "pydocs" or a
    file, used whole).

    Protocol: tokenize the split once, cut it into non-overlapping windows of ``seqlen`` tokens (dropping the
    remainder; at most ``max_windows``, spread evenly over the whole split), ``ppl = exp(mean NLL)`` over every
    predicted token.
    With ``reference`` (the original model), also the KL divergence ``KL(P_ref || P_model)`` per token (mean,
    median, 90th and 99th percentiles, max), Delta p of the reference's top token (mean, 1st and 99th
    percentiles) and the top-1 agreement on the same windows, plus the reference's own perplexity. ``windows``
    (token ids [n, seqlen]) replaces the text, e.g. to measure the calibration windows themselves. ``bos``: each
    window starts with the BOS token ("auto": when the tokenizer adds one itself, as Gemma's; ``data.wants_bos``).
    """
    if windows is not None:
        if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[1] < 2:
            raise ValueError(f"windows must be token ids [n, seqlen >= 2], got {getattr(windows, 'shape', windows)!r}")
        text, seqlen, split = "given windows", windows.shape[1], None
        windows = windows[:max_windows] if max_windows else windows
    elif seqlen < 2:
        raise ValueError(f"seqlen must be >= 2, got {seqlen}")
    else:
        windows = eval_windows(tokenizer, text, seqlen, max_windows, bos=bos, split=split)
    should_stop = should_stop or (lambda: False)
    t0 = time.perf_counter()
    nll_sum = ref_nll_sum = 0.0
    count = done = 0
    per_token: dict[str, list[torch.Tensor]] = {"kl": [], "delta_p": [], "agree": []}  # one value per token
    for i, ids in enumerate(windows):
        if should_stop():
            break
        ids = ids.unsqueeze(0)
        logits = model_logits(model, ids)[0, :-1]
        target = ids[0, 1:]
        logp = F.log_softmax(logits, dim=-1)
        nll_sum += float(F.nll_loss(logp, target, reduction="sum"))
        if reference is not None:
            ref_logp = F.log_softmax(model_logits(reference, ids)[0, :-1], dim=-1)
            ref_nll_sum += float(F.nll_loss(ref_logp, target, reduction="sum"))
            div = token_divergence(logp, ref_logp)
            for name in per_token:
                per_token[name].append(getattr(div, name))
        count += target.numel()
        done += 1
        if on_window:
            on_window(i + 1, windows.shape[0])
    if count == 0:
        raise ValueError("evaluation stopped before the first window")
    nll = nll_sum / count
    result = EvalResult(
        perplexity=math.exp(nll), nll=nll, seqlen=seqlen, windows=done, tokens=count, text=text,
        seconds=time.perf_counter() - t0, split=split,
    )
    if reference is not None:
        stats = divergence_stats(*(torch.cat(per_token[name]) for name in ("kl", "delta_p", "agree")))
        for name, value in stats.items():
            setattr(result, name, value)
        result.reference_perplexity = math.exp(ref_nll_sum / count)
    return result
