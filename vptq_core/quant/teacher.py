"""The teacher of end-to-end distillation: the original model's top-k next-token log-probabilities on each
window (plus the log of the mass of all the other tokens), and the KL of a student's logits to them on those k
tokens plus one bucket for the rest (docs/methods.md#end-to-end-distillation).

Keeping only the top k never holds full-vocabulary logits for all windows; the bucket KL is the KL of the two
distributions coarsened the same way, <= the full KL and equal to it when k covers the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .device import widened_linears

TEACHER_KEYS = ("logp", "index", "rest")


@torch.no_grad()
def teacher_topk(reference: nn.Module, windows: torch.Tensor, k: int, device: torch.device,
                 should_stop: Callable[[], bool] | None = None) -> dict[str, torch.Tensor] | None:
    """The reference's top-``k`` next-token log-probabilities on every window, computed one window at a time.

    Returns {"logp": [n, seq-1, k] float32, "index": [n, seq-1, k] int64, "rest": [n, seq-1] float32 (log of
    the mass outside the top k; -inf when there is none)} on ``device``; None if ``should_stop`` turned true.
    """
    ref_device = next(reference.parameters()).device
    rows = []
    with widened_linears(reference):  # a bf16 original on a CPU without bf16 products: float32 products
        for row in windows:
            if should_stop is not None and should_stop():
                return None
            logits = reference(row.unsqueeze(0).to(ref_device), use_cache=False).logits[0, :-1]
            rows.append(topk_of(logits, k, device))
    return stack_teacher(rows)


TOPK_CHUNK_BYTES = 64 << 20  # float32 log-probabilities ``topk_of`` holds at a time (a few positions' worth)


def topk_of(logits: torch.Tensor, k: int, device) -> dict[str, torch.Tensor]:
    """{"logp", "index", "rest"} of logits [..., V]: the top-k log-probabilities, their tokens and the log of
    the mass of all the others. Taken a few positions at a time (``TOPK_CHUNK_BYTES`` of float32 at once): a
    window's full-vocabulary float32 log-probabilities, and their copies, would take several times that."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    step = max(1, TOPK_CHUNK_BYTES // (4 * vocab))
    kk = min(k, vocab)
    out = {"logp": torch.empty(flat.shape[0], kk, device=device),
           "index": torch.empty(flat.shape[0], kk, dtype=torch.long, device=device),
           "rest": torch.empty(flat.shape[0], device=device)}
    for i in range(0, flat.shape[0], step):
        logp = F.log_softmax(flat[i : i + step].float(), dim=-1)
        top, index = logp.topk(kk, dim=-1)
        rest = logp.scatter_(-1, index, float("-inf")).logsumexp(-1)
        out["logp"][i : i + step], out["index"][i : i + step], out["rest"][i : i + step] = top, index, rest
    return {key: value.reshape(*lead, -1) if key != "rest" else value.reshape(lead) for key, value in out.items()}


def stack_teacher(rows: list[dict[str, torch.Tensor]], dim: int = 0, cat: bool = False) -> dict[str, torch.Tensor]:
    """The teachers of ``rows`` (each {"logp", "index", "rest"}) joined along ``dim``: stacked, or ``cat``."""
    join = torch.cat if cat else torch.stack
    return {key: join([r[key] for r in rows], dim=dim) for key in TEACHER_KEYS}


def teacher_for(reference: nn.Module, windows: torch.Tensor, rows: torch.Tensor, k: int, device: torch.device,
                should_stop: Callable[[], bool] | None, known: dict[str, torch.Tensor] | None):
    """(the teacher's top-k on ``windows[rows]``, in that order, on ``device``; how many windows needed a pass):
    the windows ``known`` covers take it from there, the others from ``teacher_topk``. (None, n) if cancelled."""
    keys = TEACHER_KEYS
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
    pool = stack_teacher(parts, cat=True)
    return {key: value[source.to(value.device)] for key, value in pool.items()}, int(need.numel())


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
    Autograd through logsumexp and a scattered copy makes more passes over that matrix, a large share of a
    distillation step at a full vocabulary (tests: the value and the gradient equal that formulation's)."""

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
