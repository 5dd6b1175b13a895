"""Weighted k-means (Lloyd) with chunked distance computation, so k = 65536 fits in memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CHUNK_ELEMENTS = 1 << 24  # distance-matrix elements per chunk (64 MB in float32)


def _numba_nearest():
    """A compiled CPU nearest-centroid kernel (about 2x the torch path on 2 cores), or None without numba."""
    try:
        import numba
        import numpy as np
    except ImportError:  # pragma: no cover - numba is a declared dependency
        return None

    @numba.njit(parallel=True, fastmath=True, cache=True)
    def kernel(X, CT, csq, out):  # X [n, d], CT [d, k] (centroids transposed), csq [k], out [n]
        n, d = X.shape
        k = CT.shape[1]
        for i in numba.prange(n):
            dist = csq.copy()
            for t in range(d):
                xt = -2.0 * X[i, t]
                for c in range(k):
                    dist[c] += xt * CT[t, c]
            m = dist.min()
            for c in range(k):
                if dist[c] == m:
                    out[i] = c
                    break

    def run(X: torch.Tensor, C: torch.Tensor, C_sqnorm: torch.Tensor) -> torch.Tensor:
        out = np.empty(X.shape[0], dtype=np.int64)
        kernel(X.contiguous().numpy(), C.T.contiguous().numpy(), C_sqnorm.contiguous().numpy(), out)
        return torch.from_numpy(out)

    return run


_NUMBA_NEAREST = None
_NUMBA_TRIED = False


def nearest(X: torch.Tensor, C: torch.Tensor, C_sqnorm: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the nearest centroid for each row: X [n, d], C [k, d] -> [n] int64 (Euclidean)."""
    global _NUMBA_NEAREST, _NUMBA_TRIED
    if C_sqnorm is None:
        C_sqnorm = (C * C).sum(dim=1)
    if X.device.type == "cpu" and X.dtype == torch.float32 and X.shape[0] * C.shape[0] >= 1 << 16:
        if not _NUMBA_TRIED:
            _NUMBA_TRIED = True
            _NUMBA_NEAREST = _numba_nearest()
        if _NUMBA_NEAREST is not None:
            return _NUMBA_NEAREST(X, C.float(), C_sqnorm.float())
    chunk = max(1, _CHUNK_ELEMENTS // C.shape[0])
    out = torch.empty(X.shape[0], dtype=torch.long, device=X.device)
    for start in range(0, X.shape[0], chunk):
        x = X[start : start + chunk]
        # ||x - c||² = ||x||² - 2 x·c + ||c||²; ||x||² does not change the argmin.
        dist = torch.addmm(C_sqnorm.unsqueeze(0), x, C.T, alpha=-2.0)
        out[start : start + chunk] = dist.argmin(dim=1)
    return out


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # [k, d]
    objective: list[float]  # weighted mean squared distance after init and each iteration


def weighted_objective(X: torch.Tensor, weights: torch.Tensor, C: torch.Tensor, assign: torch.Tensor) -> float:
    """Σ w_i ||x_i - c_{a_i}||² / Σ w_i."""
    d = ((X - C[assign]) ** 2).sum(dim=1)
    return float((weights * d).sum() / weights.sum())


def weighted_kmeans(
    X: torch.Tensor, weights: torch.Tensor | None, k: int, iters: int, seed: int = 0, sample: int | None = None
) -> KMeansResult:
    """Fit ``k`` centroids minimising ``Σ w_i ||x_i − c_{a(i)}||²``.

    X [n, d] float; weights [n] >= 0 (None = uniform). Centroids are initialised by sampling points with
    probability ∝ weight; Lloyd iterations run on at most ``sample`` points (seeded subsample). Empty
    clusters are re-seeded at the points with the largest weighted error. When n <= k every point gets
    its own centroid.
    """
    if X.dim() != 2:
        raise ValueError(f"X must be [n, d], got shape {tuple(X.shape)}")
    n, d = X.shape
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    X = X.float()
    weights = torch.ones(n, device=X.device) if weights is None else weights.float().clamp(min=0)
    if weights.shape != (n,):
        raise ValueError(f"weights must have shape ({n},), got {tuple(weights.shape)}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if weights.sum() <= 0:
        weights = torch.ones_like(weights)
    if n <= k:
        reps = torch.randint(0, n, (k - n,), generator=gen).to(X.device)
        C = torch.cat([X, X[reps]], dim=0)
        return KMeansResult(C, [0.0])
    if sample is not None and n > sample:
        pick = torch.randperm(n, generator=gen)[:sample].to(X.device)
        X_fit, w_fit = X[pick], weights[pick]
    else:
        X_fit, w_fit = X, weights
    probs = (w_fit + 1e-12 * w_fit.max()).cpu()
    init = torch.multinomial(probs, k, replacement=X_fit.shape[0] < k, generator=gen).to(X.device)
    C = X_fit[init].clone()
    assign = nearest(X_fit, C)
    history = [weighted_objective(X_fit, w_fit, C, assign)]
    for _ in range(iters):
        sums = torch.zeros_like(C).index_add_(0, assign, X_fit * w_fit.unsqueeze(1))
        mass = torch.zeros(k, device=X.device).index_add_(0, assign, w_fit)
        filled = mass > 0
        C[filled] = sums[filled] / mass[filled].unsqueeze(1)
        empty = (~filled).nonzero().squeeze(1)
        if empty.numel():
            err = w_fit * ((X_fit - C[assign]) ** 2).sum(dim=1)
            worst = torch.topk(err, min(empty.numel(), err.numel())).indices
            C[empty[: worst.numel()]] = X_fit[worst]
        assign = nearest(X_fit, C)
        history.append(weighted_objective(X_fit, w_fit, C, assign))
    return KMeansResult(C, history)
