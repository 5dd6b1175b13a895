"""Codebook refit after the sweep: with the indices fixed, ``tr(ΔW H ΔWᵀ)`` is a convex quadratic in the
centroids, so it is minimised over every codebook of a layer at once (main, residual and outlier codebooks)
by preconditioned conjugate gradients.

The sweep fits each column's vectors to codebooks that k-means chose before any error feedback; afterwards
the assignments are known and the centroids can move to where the second-order objective wants them. Each
CG step costs one gather (Ŵ from the codebooks), one ``[out, in] @ [in, in]`` matmul and one scatter-add, and
CG never increases the objective, so the refit can only lower the proxy loss.

Notation: a codebook ``C`` [k, v] serves stored columns [start, end) through ``indices`` [rows, end - start];
weight row ``r*v + t`` of column ``start + c`` is ``C[indices[r, c], t]`` (rows past ``out`` are padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CodebookUse:
    """One codebook and the stored columns whose vectors index it."""

    centroids: torch.Tensor  # [k, v] float32, refitted in place
    indices: torch.Tensor  # [rows, columns] int64
    start: int  # first stored column

    @property
    def vector_len(self) -> int:
        return self.centroids.shape[1]


def _gather(use: CodebookUse, codebook: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight block [out, columns] that ``codebook`` (shaped like ``use.centroids``) gives ``use``'s columns."""
    rows, columns = use.indices.shape
    vectors = codebook[use.indices]  # [rows, columns, v]
    return vectors.permute(0, 2, 1).reshape(rows * use.vector_len, columns)[:out_features]


def _scatter(use: CodebookUse, grad_block: torch.Tensor) -> torch.Tensor:
    """Adjoint of ``_gather``: a block [out, columns] -> its sum into codebook entries [k, v]."""
    rows, columns = use.indices.shape
    v = use.vector_len
    padded = torch.zeros(rows * v, columns, dtype=grad_block.dtype, device=grad_block.device)
    padded[: grad_block.shape[0]] = grad_block
    per_vector = padded.view(rows, v, columns).permute(0, 2, 1).reshape(-1, v)  # [rows*columns, v]
    return torch.zeros_like(use.centroids).index_add_(0, use.indices.reshape(-1), per_vector)


def _weight(uses: list[CodebookUse], codebooks: list[torch.Tensor], out_features: int, in_features: int):
    W = torch.zeros(out_features, in_features, dtype=codebooks[0].dtype, device=codebooks[0].device)
    for use, codebook in zip(uses, codebooks):
        columns = use.indices.shape[1]
        W[:, use.start : use.start + columns] += _gather(use, codebook, out_features)
    return W


def proxy(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """tr((Ŵ - W) H (Ŵ - W)ᵀ)."""
    D = W_hat - W
    return float(((D @ H) * D).sum())


def refit_codebooks(W: torch.Tensor, H: torch.Tensor, uses: list[CodebookUse], iters: int) -> tuple[float, float]:
    """Move the centroids of ``uses`` to lower ``tr((Ŵ - W) H (Ŵ - W)ᵀ)`` with the indices fixed.

    W [out, in] and H [in, in] in stored column order (H positive definite, e.g. damped). Up to ``iters``
    Jacobi-preconditioned CG steps. Returns (objective before, after); the centroids are updated in place,
    and left as they were if CG did not improve the objective.
    """
    out_features, in_features = W.shape
    W, H = W.float(), H.float()

    def apply_A(codebooks: list[torch.Tensor]) -> list[torch.Tensor]:
        G = _weight(uses, codebooks, out_features, in_features) @ H  # Hessian of f is 2 Sᵀ(· H)S; 1/2 f used
        return [_scatter(use, G[:, use.start : use.start + use.indices.shape[1]]) for use in uses]

    x = [use.centroids.float().clone() for use in uses]
    Ax = apply_A(x)
    WH = W @ H
    b = [_scatter(use, WH[:, use.start : use.start + use.indices.shape[1]]) for use in uses]
    r = [bi - ai for bi, ai in zip(b, Ax)]
    # Jacobi preconditioner: diag of SᵀHS = Σ H_jj over the weights an entry serves (>= 0; 1 where unused).
    diag = H.diagonal()
    precond = []
    for use in uses:
        columns = use.indices.shape[1]
        block = diag[use.start : use.start + columns].expand(out_features, columns)
        d = _scatter(use, block.contiguous())
        precond.append(torch.where(d > 0, 1.0 / d.clamp(min=1e-30), torch.ones_like(d)))
    before = proxy(W, _weight(uses, x, out_features, in_features), H)
    z = [ri * mi for ri, mi in zip(r, precond)]
    p = [zi.clone() for zi in z]
    rz = sum(float((ri * zi).sum()) for ri, zi in zip(r, z))
    for _ in range(iters):
        if rz <= 0:
            break
        Ap = apply_A(p)
        pAp = sum(float((pi * api).sum()) for pi, api in zip(p, Ap))
        if pAp <= 0:
            break
        alpha = rz / pAp
        x = [xi + alpha * pi for xi, pi in zip(x, p)]
        r = [ri - alpha * api for ri, api in zip(r, Ap)]
        z = [ri * mi for ri, mi in zip(r, precond)]
        rz_new = sum(float((ri * zi).sum()) for ri, zi in zip(r, z))
        p = [zi + (rz_new / rz) * pi for zi, pi in zip(z, p)]
        rz = rz_new
    after = proxy(W, _weight(uses, x, out_features, in_features), H)
    if after < before:
        for use, xi in zip(uses, x):
            use.centroids.copy_(xi.to(use.centroids.dtype))
        return before, after
    return before, before
