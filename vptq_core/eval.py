"""Perplexity (standard protocol) and agreement with the original model: mean KL and top-1 agreement."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .data import eval_windows


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

    def to_dict(self) -> dict:
        return asdict(self)

    def protocol(self) -> str:
        return (f"text={self.text!r} (evaluation split), seqlen={self.seqlen}, windows={self.windows}, "
                f"non-overlapping, {self.tokens} predicted tokens, ppl=exp(mean NLL)")


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
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
) -> EvalResult:
    """Perplexity of ``model`` on the evaluation split of ``text`` ("wiki" or a file).

    Protocol: tokenize the evaluation text once, cut it into non-overlapping windows of ``seqlen`` tokens
    (dropping the remainder, at most ``max_windows``), ``ppl = exp(mean NLL)`` over every predicted token.
    With ``reference`` (the original model), also the mean KL divergence ``KL(P_ref || P_model)`` and the
    top-1 agreement on the same windows, plus the reference's own perplexity. ``windows`` (token ids
    [n, seqlen]) replaces the text, e.g. to measure the calibration windows themselves. ``bos``: each window
    starts with the BOS token ("auto": when the tokenizer adds one itself, as Gemma's; ``data.wants_bos``).
    """
    if windows is not None:
        if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[1] < 2:
            raise ValueError(f"windows must be token ids [n, seqlen >= 2], got {getattr(windows, 'shape', windows)!r}")
        text, seqlen = "given windows", windows.shape[1]
        windows = windows[:max_windows] if max_windows else windows
    elif seqlen < 2:
        raise ValueError(f"seqlen must be >= 2, got {seqlen}")
    else:
        windows = eval_windows(tokenizer, text, seqlen, max_windows, bos=bos)
    should_stop = should_stop or (lambda: False)
    t0 = time.perf_counter()
    nll_sum = ref_nll_sum = kl_sum = 0.0
    agree = count = 0
    done = 0
    for i, ids in enumerate(windows):
        if should_stop():
            break
        ids = ids.unsqueeze(0)
        logits = _logits(model, ids)[0, :-1]
        target = ids[0, 1:]
        logp = F.log_softmax(logits, dim=-1)
        nll_sum += float(F.nll_loss(logp, target, reduction="sum"))
        if reference is not None:
            ref_logp = F.log_softmax(_logits(reference, ids)[0, :-1], dim=-1)
            ref_nll_sum += float(F.nll_loss(ref_logp, target, reduction="sum"))
            kl_sum += float(F.kl_div(logp, ref_logp, log_target=True, reduction="sum"))
            agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
        count += target.numel()
        done += 1
        if on_window:
            on_window(i + 1, windows.shape[0])
    if count == 0:
        raise ValueError("evaluation stopped before the first window")
    nll = nll_sum / count
    result = EvalResult(
        perplexity=math.exp(nll), nll=nll, seqlen=seqlen, windows=done, tokens=count, text=text,
        seconds=time.perf_counter() - t0,
    )
    if reference is not None:
        result.kl_divergence = kl_sum / count
        result.top1_agreement = agree / count
        result.reference_perplexity = math.exp(ref_nll_sum / count)
    return result
