"""Layer-wise fine-tuning of VPTQ centroids: after a block is quantized, train its codebooks (indices
fixed) so the quantized block's outputs match the original block's outputs on calibration data."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from .config import VPTQConfig
from .states import VQLayerState

_CODEBOOKS = ("centroids", "res_centroids", "outlier_centroids")


def _swap_weight(linear: nn.Linear, weight: torch.Tensor | None, saved: nn.Parameter | None = None) -> None:
    """Replace the ``weight`` parameter by a plain tensor (``weight``), or restore ``saved``."""
    if saved is not None:
        del linear.weight
        linear.weight = saved
        return
    if isinstance(linear._parameters.get("weight"), nn.Parameter):
        del linear._parameters["weight"]
    linear.weight = weight


def finetune_block_centroids(
    block: nn.Module,
    states: dict[str, VQLayerState],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    config: VPTQConfig,
    batch_size: int = 2,
) -> dict:
    """Train the codebooks of ``states`` (names relative to ``block``) for ``config.finetune_iters`` Adam
    steps on MSE(block(inputs), targets). Updates ``states`` in place and the block's linear weights.

    inputs, targets: [n, seq, hidden]. Returns {"finetune_loss_before", "finetune_loss_after"} measured on
    the same fixed batch.
    """
    linears = {name: block.get_submodule(name) for name in states}
    params: dict[str, dict[str, nn.Parameter]] = {}
    for name, st in states.items():
        params[name] = {k: nn.Parameter(getattr(st, k).detach().float().clone())
                        for k in _CODEBOOKS if getattr(st, k) is not None}
    optimizer = torch.optim.Adam([p for d in params.values() for p in d.values()], lr=config.finetune_lr)
    gen = torch.Generator().manual_seed(config.seed)
    probe = torch.arange(min(batch_size, inputs.shape[0]))
    saved = {name: lin.weight for name, lin in linears.items()}

    def current(name: str) -> VQLayerState:
        return dataclasses.replace(states[name], **params[name])

    def loss_on(idx: torch.Tensor) -> torch.Tensor:
        for name, lin in linears.items():
            _swap_weight(lin, current(name).dequantize().to(saved[name].dtype))
        out = forward(block, inputs[idx])
        return torch.mean((out.float() - targets[idx].float()) ** 2)

    try:
        with torch.enable_grad():
            with torch.no_grad():
                before = float(loss_on(probe))
            for _ in range(config.finetune_iters):
                idx = torch.randint(0, inputs.shape[0], (min(batch_size, inputs.shape[0]),), generator=gen)
                optimizer.zero_grad(set_to_none=True)
                loss = loss_on(idx)
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                after = float(loss_on(probe))
    finally:
        for name, lin in linears.items():
            _swap_weight(lin, None, saved=saved[name])
    with torch.no_grad():
        for name, lin in linears.items():
            if after <= before:
                for key, p in params[name].items():
                    setattr(states[name], key, p.detach().clone())
            lin.weight.data.copy_(states[name].dequantize().to(lin.weight.dtype))
    return {"finetune_loss_before": before, "finetune_loss_after": min(after, before)}
