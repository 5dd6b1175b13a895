"""Scalar baselines in the same pipeline: RTN and GPTQ (Hessian error feedback, groups, act-order)."""

from __future__ import annotations

import torch

from .config import ScalarConfig
from .hessian import inverse_hessian_cholesky, prepare_hessian, proxy_loss, single_thread_torch
from .rtn import effective_group_size, grid_params, rtn_quantize
from .states import ScalarLayerState
from .vptq import QuantResult


def _result(state: ScalarLayerState, W: torch.Tensor, H: torch.Tensor) -> QuantResult:
    W_hat = state.dequantize().float()
    loss, rel = proxy_loss(W, W_hat, H.float())
    rel_w = float(torch.linalg.norm(W_hat - W) / torch.linalg.norm(W).clamp(min=1e-12))
    return QuantResult(state=state, weight=W_hat, proxy_loss=loss, rel_proxy_loss=rel, rel_weight_error=rel_w)


def rtn_layer(
    W: torch.Tensor, H: torch.Tensor, config: ScalarConfig, bias: torch.Tensor | None = None,
    hessian_cache: dict | None = None,
) -> QuantResult:
    """Round-to-nearest (H is only used to report the proxy loss)."""
    W = W.detach().float()
    state = rtn_quantize(W, config.bits, config.group_size, sym=config.sym, clip_search=config.clip_search, bias=bias)
    return _result(state, W, H)


def gptq_layer(
    W: torch.Tensor, H: torch.Tensor, config: ScalarConfig, bias: torch.Tensor | None = None,
    hessian_cache: dict | None = None,
) -> QuantResult:
    """GPTQ: quantize columns in (act-)order, spreading each column's error with the inverse Hessian.

    Group grids are fixed up front on the original column order ("static groups"), so act-order and
    groups combine without a per-column group map: the state is stored exactly like RTN's.
    """
    W_orig = W.detach().float()
    out_features, in_features = W_orig.shape
    gs = effective_group_size(config.group_size, in_features)
    Wd, Hd = prepare_hessian(W_orig, H.detach(), config.damp_percent)
    maxq = 2**config.bits - 1
    scales, zeros = [], []
    for start in range(0, in_features, gs):
        s, z = grid_params(Wd[:, start : start + gs], config.bits, sym=config.sym, clip_search=config.clip_search)
        scales.append(s)
        zeros.append(z)
    scales_t, zeros_t = torch.cat(scales, 1), torch.cat(zeros, 1)  # [out, n_groups]
    col_group = torch.arange(in_features) // gs

    perm = torch.argsort(torch.diag(Hd), descending=True) if config.act_order else torch.arange(in_features)
    Wp, Hp = Wd[:, perm], Hd[perm][:, perm]
    col_scale = scales_t[:, col_group[perm]]  # [out, in] in permuted order
    col_zero = zeros_t[:, col_group[perm]]
    U = inverse_hessian_cholesky(Hp, hessian_cache)
    codes_p = torch.zeros_like(Wp)
    with single_thread_torch():
        _gptq_sweep(Wp, U, col_scale, col_zero, codes_p, maxq, config.block_size)
    codes = torch.empty_like(codes_p)
    codes[:, perm] = codes_p
    state = ScalarLayerState(
        in_features=in_features, out_features=out_features, bits=config.bits, group_size=gs,
        codes=codes.to(torch.uint8), scales=scales_t, zeros=zeros_t,
        bias=None if bias is None else bias.detach().clone(), method="gptq",
    )
    return _result(state, W_orig, H)


def _gptq_sweep(Wp, U, col_scale, col_zero, codes_p, maxq, bs) -> None:
    out_features, in_features = Wp.shape
    for b0 in range(0, in_features, bs):
        b1 = min(b0 + bs, in_features)
        W1 = Wp[:, b0:b1]
        Err = torch.zeros(out_features, b1 - b0)
        for i in range(b1 - b0):
            j = b0 + i
            w = W1[:, i]
            c = torch.clamp(torch.round(w / col_scale[:, j]) + col_zero[:, j], 0, maxq)
            q = col_scale[:, j] * (c - col_zero[:, j])
            codes_p[:, j] = c
            e = (w - q) / U[j, j]
            W1[:, i + 1 :].addr_(e, U[j, j + 1 : b1], alpha=-1.0)
            Err[:, i] = e
        if b1 < in_features:
            Wp[:, b1:].addmm_(Err, U[b0:b1, b1:], alpha=-1.0)
