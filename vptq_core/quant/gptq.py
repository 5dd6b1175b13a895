"""GPTQ: scalar grids with Hessian error feedback (the shared sweep), groups and act-order."""

from __future__ import annotations

import torch

from .act_quant import ACTIVATION_HOOK
from .config import ScalarConfig
from .cost import sweep_seconds
from .distill_hook import DISTILL_HOOK, settings_needs
from .hessian import inverse_hessian_cholesky, prepare_hessian
from .methods import Method, QuantResult, register
from .rtn import SCALAR_PRESETS, describe_scalar, effective_group_size, grid_params, scalar_config_bits, scalar_result
from .states import ScalarLayerState
from .sweep import error_feedback_sweep


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
    col_group = torch.arange(in_features, device=Wd.device) // gs

    if config.act_order:
        perm = torch.argsort(torch.diag(Hd), descending=True)
    else:
        perm = torch.arange(in_features, device=Wd.device)
    Wp, Hp = Wd[:, perm], Hd[perm][:, perm]
    col_scale = scales_t[:, col_group[perm]]  # [out, in] in permuted order
    col_zero = zeros_t[:, col_group[perm]]
    codes_p = torch.zeros_like(Wp)

    def quantize_column(j: int, w: torch.Tensor) -> torch.Tensor:
        c = torch.clamp(torch.round(w / col_scale[:, j]) + col_zero[:, j], 0, maxq)
        codes_p[:, j] = c
        return col_scale[:, j] * (c - col_zero[:, j])

    error_feedback_sweep(Wp, inverse_hessian_cholesky(Hp, hessian_cache), quantize_column, config.block_size)
    codes = torch.empty_like(codes_p)
    codes[:, perm] = codes_p
    state = ScalarLayerState(
        in_features=in_features, out_features=out_features, bits=config.bits, group_size=gs,
        codes=codes.to(torch.uint8), scales=scales_t, zeros=zeros_t,
        bias=None if bias is None else bias.detach().clone(), method="gptq",
    )
    return scalar_result(state, W_orig, H)


METHOD = register(Method(
    name="gptq", label="GPTQ", config_class=ScalarConfig, bits=scalar_config_bits, describe=describe_scalar,
    presets=SCALAR_PRESETS, description="scalar grids with GPTQ's second-order error feedback",
    quantize_linear=lambda W, H, config, bias, cache: gptq_layer(W, H, config, bias, hessian_cache=cache),
    after_block=(ACTIVATION_HOOK,), after_model=(DISTILL_HOOK,), config_needs=settings_needs, cost=sweep_seconds,
))
