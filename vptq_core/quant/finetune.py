"""Layer-wise fine-tuning of a VPTQ block, a VPTQ after-block hook (docs/methods.md#layer-wise-fine-tuning).

After a block's linears are quantized, its float tensors that stay in the packed format are trained with
the indices fixed: every codebook (main, residual, outlier; the per-column ``weight_scale`` /
``weight_bias`` when normalisation is on; ``trainable.CodebookLinear``) and the block's dense 1-D tensors
(RMSNorm / LayerNorm weights, linear biases). Objective: MSE between the quantized block's outputs and the
original block's outputs on the calibration inputs. Adam with a cosine learning-rate schedule over shuffled
minibatches of the training windows (``train.train_holdout``); ``finetune_holdout`` of the calibration windows
are never trained on and decide: the block keeps the parameters of the best held-out check (the initial ones
included), so fine-tuning never leaves a block worse on held-out windows than it found it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .calib_windows import holdout_count
from .config import VPTQConfig
from .device import compute_dtype
from .methods import Cancelled
from .states import VQLayerState
from .train import constant_factor, cosine_factor, minibatches, train_holdout
from .trainable import CodebookLinear, dense_parameters, only_trainable, swapped_in, write_back

EVAL_BATCH = 8  # windows per no-grad forward when measuring held-out error
LR_SCHEDULES = {"cosine": cosine_factor, "constant": constant_factor}


def finetune_block_centroids(
    block: nn.Module,
    states: dict[str, VQLayerState],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    config: VPTQConfig,
    batch_size: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    lr_schedule: str = "cosine",
) -> dict:
    """Train the codebooks of ``states`` (names relative to ``block``) and the block's norm weights / biases
    for ``config.finetune_iters`` Adam steps on MSE(block(inputs), targets), keeping the best held-out check.

    inputs, targets: [n, seq, hidden] (float32). The last ``holdout_count(n, config.finetune_holdout)``
    windows are held out (none when n == 1: then the training windows decide). Updates ``states`` in place,
    the block's linear weights (dequantized) and its dense 1-D parameters. ``should_stop`` is polled between
    steps: ``Cancelled`` is raised with the block as it was before fine-tuning. ``lr_schedule`` "cosine" or
    "constant" (for comparisons).

    Returns metrics for the block's reports: ``finetune_loss_before`` / ``finetune_loss_after`` (held-out
    MSE; after <= before), ``finetune_rel_before`` / ``finetune_rel_after`` (held-out relative output
    error), ``finetune_best_step`` (0 = rejected), ``finetune_heldout`` (windows held out), ``finetune_curve``
    (the training minibatch loss of every step, for the live plots).
    """
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {sorted(LR_SCHEDULES)}, got {lr_schedule!r}")
    n = inputs.shape[0]
    n_val = holdout_count(n, config.finetune_holdout)
    n_train = n - n_val
    val = torch.arange(n_train, n) if n_val else torch.arange(n)
    device = inputs.device
    names = list(states)
    linears = {name: block.get_submodule(name) for name in names}
    dense = dense_parameters(block) if config.finetune_norm_lr > 0 else []
    rel_errors: list[float] = []  # of every check, in order

    def heldout() -> float:
        err = ref = 0.0
        with torch.no_grad():
            for i in range(0, val.numel(), EVAL_BATCH):
                rows = val[i : i + EVAL_BATCH].to(device)
                out = forward(block, inputs[rows]).float()
                tgt = targets[rows].float()
                err += float(((out - tgt) ** 2).sum())
                ref += float((tgt**2).sum())
        rel_errors.append(err / max(ref, 1e-20))
        return err / (val.numel() * targets[0].numel())

    batches = minibatches(n_train, batch_size or config.finetune_batch, config.seed)

    def step_loss() -> torch.Tensor:
        rows = next(batches).to(device)
        out = forward(block, inputs[rows])
        return torch.mean((out.float() - targets[rows].float()) ** 2)

    def make(name: str, linear: nn.Module) -> CodebookLinear:
        return CodebookLinear(states[name], linear.bias, device)

    with swapped_in(block, names, make) as trainables:
        codebooks = [p for layer in trainables.values() for p in layer.params.values()]
        groups = [{"params": codebooks, "lr": config.finetune_lr}]
        if dense:
            groups.append({"params": dense, "lr": config.finetune_norm_lr})
        iters = config.finetune_iters
        with only_trainable(block, codebooks + dense):
            result = train_holdout(
                groups, step_loss, heldout, iters, eval_every=max(1, config.finetune_eval_every or iters),
                lr_factor=LR_SCHEDULES[lr_schedule], device=device, dtype=compute_dtype(config.train_dtype, device),
                should_stop=should_stop, stop_restores_start=True)
        if result.cancelled:
            raise Cancelled
        write_back(linears, trainables, states)
    return {"finetune_loss_before": result.before, "finetune_loss_after": result.best,
            "finetune_rel_before": rel_errors[0], "finetune_rel_after": rel_errors[result.best_index],
            "finetune_best_step": result.best_step, "finetune_heldout": n_val, "finetune_curve": result.step_losses}
