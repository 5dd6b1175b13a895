"""Weighted k-means (Lloyd) with chunked distance computation, so k = 65536 fits in memory."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_CHUNK_ELEMENTS = 1 << 24  # distance-matrix elements per chunk (64 MB in float32)


def _numba_nearest():
    """A compiled brute-force CPU nearest-centroid kernel, or None without numba."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a declared dependency
        return None

    @numba.njit(parallel=True, fastmath=True, cache=True)
    def kernel(X, CT, csq, out):  # X [n, d], CT [d, k] (centroids transposed), csq [k], out [n]
        n, d = X.shape
        k = CT.shape[1]
        m2 = np.float32(-2.0)  # a float32 constant keeps the inner loop in float32
        for i in numba.prange(n):
            dist = csq.copy()
            for t in range(d):
                xt = m2 * X[i, t]
                for c in range(k):
                    dist[c] += xt * CT[t, c]
            m = dist.min()
            for c in range(k):
                if dist[c] == m:
                    out[i] = c
                    break

    return kernel


_NUMBA_KERNEL = None
_NUMBA_TRIED = False


def _numba_kernel():
    global _NUMBA_KERNEL, _NUMBA_TRIED
    if not _NUMBA_TRIED:
        _NUMBA_TRIED = True
        _NUMBA_KERNEL = _numba_nearest()
    return _NUMBA_KERNEL


def _use_kdtree(d: int, k: int) -> bool:
    """Where a k-d tree (scipy's cKDTree) beats the brute-force kernel on CPU. Measured on 1 thread with
    16k Gaussian points: 3.6x faster at d=6 k=4096, 1.8x at d=8 k=4096, 1.5x at d=4 k=256. Brute force
    wins for small codebooks (k <= 64) and long vectors (d >= 12)."""
    return (d <= 8 and k >= 1024) or (d <= 4 and k >= 256)


class CodebookSearch:
    """Nearest-centroid search against one fixed codebook C [k, d], built once and queried many times
    (the sweep queries the same codebook once per column).

    CPU float32: a k-d tree where it is faster (small d, large k), else a compiled brute-force kernel;
    elsewhere (CUDA, small problems) chunked ``||x||² - 2x·c + ||c||²`` matmuls. All paths return the
    exact Euclidean nearest centroid (ties aside).
    """

    def __init__(self, C: torch.Tensor, C_sqnorm: torch.Tensor | None = None) -> None:
        self.C = C
        self.C_sqnorm = (C * C).sum(dim=1) if C_sqnorm is None else C_sqnorm
        k, d = C.shape
        self._tree = None
        self._CT = None
        if C.device.type == "cpu" and C.dtype == torch.float32:
            if _use_kdtree(d, k):
                from scipy.spatial import cKDTree

                self._tree = cKDTree(C.detach().numpy().astype(np.float64))
            else:
                self._CT = C.detach().T.contiguous().numpy()

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        """X [n, d] -> [n] int64 indices."""
        cpu32 = X.device.type == "cpu" and X.dtype == torch.float32
        if cpu32 and self._tree is not None:
            _, idx = self._tree.query(X.detach().numpy(), k=1, workers=max(1, torch.get_num_threads()))
            return torch.from_numpy(idx.astype(np.int64))
        if cpu32 and self._CT is not None and X.shape[0] * self.C.shape[0] >= 1 << 16:
            kernel = _numba_kernel()
            if kernel is not None:
                out = np.empty(X.shape[0], dtype=np.int64)
                kernel(X.detach().contiguous().numpy(), self._CT, self.C_sqnorm.float().contiguous().numpy(), out)
                return torch.from_numpy(out)
        C = self.C.to(X.dtype)
        chunk = max(1, _CHUNK_ELEMENTS // C.shape[0])
        out = torch.empty(X.shape[0], dtype=torch.long, device=X.device)
        for start in range(0, X.shape[0], chunk):
            x = X[start : start + chunk]
            # ||x - c||² = ||x||² - 2 x·c + ||c||²; ||x||² does not change the argmin.
            dist = torch.addmm(self.C_sqnorm.to(X.dtype).unsqueeze(0), x, C.T, alpha=-2.0)
            out[start : start + chunk] = dist.argmin(dim=1)
        return out


def nearest(X: torch.Tensor, C: torch.Tensor, C_sqnorm: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the nearest centroid for each row: X [n, d], C [k, d] -> [n] int64 (Euclidean)."""
    return CodebookSearch(C, C_sqnorm)(X)


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
