"""The GPTQ-style error-feedback sweep shared by VPTQ and GPTQ (IST-DASLab/gptq ``fasterquant``'s loop).

Columns of ``W`` [out, in] are quantized one at a time in stored order; what differs between methods is only
how one column is quantized, passed in as ``quantize_column``. After column ``j`` the error
``e = (w_j - q_j) / U[j, j]`` is spread onto the columns not yet quantized with ``U``, the upper Cholesky factor
of ``H⁻¹``: inside a block of ``block_size`` columns at once, to the rest lazily when the block ends.

Device-generic and free of host syncs: the loop only queues tensor operations on ``W``'s device (a CUDA sweep
never waits for the host between columns, as long as ``quantize_column`` does not either: keep its indices on
the device too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .device import exact_float32
from .hessian import single_thread_torch

# quantize_column(j, w) -> q: column j (stored order) of the working weight, w [out] -> its quantized value [out].
QuantizeColumn = Callable[[int, torch.Tensor], torch.Tensor]


def error_feedback_sweep(
    W: torch.Tensor, inverse_hessian_chol: torch.Tensor | None, quantize_column: QuantizeColumn,
    block_size: int = 128, second_order: bool = True,
) -> None:
    """Quantize ``W`` [out, in] column by column; ``W`` is updated in place with the spread errors.

    ``inverse_hessian_chol`` [in, in] (upper, ``H⁻¹ = UᵀU``) may be None when ``second_order`` is False
    (plain nearest assignment, for ablations). Runs with one torch thread (the per-column ops are small) and
    full float32 matmuls.
    """
    out_features, columns = W.shape
    if second_order and inverse_hessian_chol is None:
        raise ValueError("second_order needs the inverse Hessian's Cholesky factor")
    U = inverse_hessian_chol
    with single_thread_torch(), exact_float32():
        for b0 in range(0, columns, block_size):
            b1 = min(b0 + block_size, columns)
            W1 = W[:, b0:b1]  # a view: the updates below write through to W
            Err = torch.zeros(out_features, b1 - b0, dtype=W.dtype, device=W.device)
            for i in range(b1 - b0):
                j = b0 + i
                w = W1[:, i]
                q = quantize_column(j, w)
                if second_order:
                    e = (w - q) / U[j, j]
                    W1[:, i + 1 :].addr_(e, U[j, j + 1 : b1], alpha=-1.0)
                    Err[:, i] = e
            if second_order and b1 < columns:
                W[:, b1:].addmm_(Err, U[b0:b1, b1:], alpha=-1.0)
