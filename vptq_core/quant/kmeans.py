"""Weighted k-means (Lloyd) with chunked distance computation, so k = 65536 fits in memory.

Device-generic: on CUDA (or any non-CPU device) the search is the chunked torch matmul path and everything
stays on the device; random draws come from a CPU generator (the same draws on every device, see
``device.py``) and only the drawn indices move.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .device import exact_float32, nearest_backend

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


def _native_search():
    """The native kernels' nearest-centroid search (kernels/csrc/search_body.h), or None where they are not
    usable (no compiler, failed build, ``VPTQ_NATIVE=0``)."""
    from vptq_core.kernels import native

    usable, _ = native.status()
    return native._ext().nearest if usable else None


def _native_wins(d: int, k: int) -> bool:
    """Where the native brute force beats scipy's k-d tree (1 thread, Gaussian points and centroids, bench/search.py):
    everywhere but short vectors with large codebooks (d <= 4 from k = 16384, d <= 6 at k = 65536), where the
    tree's pruning wins. The kernel takes vectors of up to 16 dimensions."""
    return d <= 16 and not ((d <= 4 and k >= 16384) or (d <= 6 and k >= 65536))


def cpu_auto_backend(d: int, k: int, native_usable: Callable[[], bool]) -> str:
    """The search "auto" picks for a CPU float32 codebook of k d-vectors: the native brute force where it beats the
    tree and ``native_usable()`` (asked only then), else the k-d tree or numba brute force."""
    if _native_wins(d, k) and native_usable():
        return "native"
    return "kdtree" if _use_kdtree(d, k) else "numba"


def _use_kdtree(d: int, k: int) -> bool:
    """Where a k-d tree (scipy's cKDTree) beats the brute-force kernel on CPU (1 thread, Gaussian points): short
    vectors with large codebooks. Brute force wins for small codebooks and long vectors, where the tree prunes
    little."""
    return (d <= 8 and k >= 1024) or (d <= 4 and k >= 256)


class CodebookSearch:
    """Nearest-centroid search against one fixed codebook C [k, d], built once and queried many times
    (the sweep queries the same codebook once per column).

    ``backend`` (default: ``$VPTQ_NEAREST``, else "auto"): "auto" picks, for CPU float32 codebooks of d <= 16,
    the native kernels' SIMD brute force (kernels/csrc/search_body.h) where they are usable, else a k-d tree
    where it is faster (small d, large k), else a compiled numba brute force; and for every other device or dtype
    (CUDA) chunked ``||x||² - 2x·c + ||c||²`` matmuls on the codebook's device, with no host transfer.
    "torch" forces the matmul path everywhere; "native" / "kdtree" / "numba" force those CPU paths (CPU float32
    codebooks only: elsewhere an argument is refused, the environment variable ignored; "native" where the native
    kernels cannot be built raises with the reason).
    All paths return the exact Euclidean nearest centroid (ties and float rounding of near-ties aside).
    """

    def __init__(self, C: torch.Tensor, C_sqnorm: torch.Tensor | None = None, backend: str | None = None) -> None:
        self.C = C
        self.C_sqnorm = (C * C).sum(dim=1) if C_sqnorm is None else C_sqnorm
        k, d = C.shape
        choice = nearest_backend(backend)
        cpu32 = C.device.type == "cpu" and C.dtype == torch.float32
        if choice in ("native", "kdtree", "numba") and not cpu32:
            if backend is not None:
                raise ValueError(f"the {choice} search runs on CPU float32 codebooks only, got {C.dtype} on {C.device}")
            choice = "torch"  # $VPTQ_NEAREST names a CPU path: other devices keep the torch one
        if choice == "auto":
            choice = cpu_auto_backend(d, k, lambda: _native_search() is not None) if cpu32 else "torch"
        self._native = _native_search() if choice == "native" else None
        if choice == "native" and self._native is None:
            from vptq_core.kernels import native

            raise RuntimeError(f"the native search is unavailable: {native.status()[1]}")
        if choice == "numba" and _numba_kernel() is None:  # pragma: no cover - numba is a declared dependency
            choice = "torch"
        self.backend = choice
        self._tree = None
        self._CT = None
        if choice == "kdtree":
            from scipy.spatial import cKDTree

            self._tree = cKDTree(C.detach().numpy().astype(np.float64))
        elif choice == "numba":
            self._CT = C.detach().T.contiguous().numpy()
        elif choice == "native":
            kp = -(-k // 8) * 8
            self._CT = torch.zeros(d, kp)
            self._CT[:, :k] = C.detach().T
            self._csq = torch.full((kp,), float("inf"))
            self._csq[:k] = self.C_sqnorm.detach().float()
        self._torch_cache: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        """X [n, d] -> [n] int64 indices, on X's device."""
        cpu32 = X.device.type == "cpu" and X.dtype == torch.float32
        if cpu32 and self._native is not None:
            return self._native(X.detach(), self._CT, self._csq)
        if cpu32 and self._tree is not None:
            _, idx = self._tree.query(X.detach().numpy(), k=1, workers=max(1, torch.get_num_threads()))
            return torch.from_numpy(idx.astype(np.int64))
        if cpu32 and self.backend == "numba" and X.shape[0] * self.C.shape[0] >= 1 << 16:
            out = np.empty(X.shape[0], dtype=np.int64)
            _numba_kernel()(X.detach().contiguous().numpy(), self._CT, self.C_sqnorm.float().contiguous().numpy(), out)
            return torch.from_numpy(out)
        return self._torch_search(X)

    def _torch_search(self, X: torch.Tensor) -> torch.Tensor:
        cached = self._torch_cache.get(X.dtype)
        if cached is None:  # the codebook and its norms in X's dtype, once per dtype
            cached = self._torch_cache[X.dtype] = (self.C.to(X.dtype), self.C_sqnorm.to(X.dtype).unsqueeze(0))
        C, csq = cached
        CT = C.T
        chunk = max(1, _CHUNK_ELEMENTS // C.shape[0])
        with exact_float32():
            if X.shape[0] <= chunk:  # one query block (every sweep column): no output buffer to fill
                # ||x - c||² = ||x||² - 2 x·c + ||c||²; ||x||² does not change the argmin.
                return torch.addmm(csq, X, CT, alpha=-2.0).argmin(dim=1)
            out = torch.empty(X.shape[0], dtype=torch.long, device=X.device)
            for start in range(0, X.shape[0], chunk):
                dist = torch.addmm(csq, X[start : start + chunk], CT, alpha=-2.0)
                out[start : start + chunk] = dist.argmin(dim=1)
        return out


def nearest(X: torch.Tensor, C: torch.Tensor, C_sqnorm: torch.Tensor | None = None,
            backend: str | None = None) -> torch.Tensor:
    """Index of the nearest centroid for each row: X [n, d], C [k, d] -> [n] int64 (Euclidean)."""
    return CodebookSearch(C, C_sqnorm, backend)(X)


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # [k, d]
    objective: list[float]  # weighted mean squared distance after init and each iteration


def _objective(X: torch.Tensor, weights: torch.Tensor, C: torch.Tensor, assign: torch.Tensor) -> torch.Tensor:
    """Σ w_i ||x_i - c_{a_i}||² / Σ w_i as a 0-dim tensor on X's device (no host sync)."""
    d = ((X - C[assign]) ** 2).sum(dim=1)
    return (weights * d).sum() / weights.sum()


def weighted_objective(X: torch.Tensor, weights: torch.Tensor, C: torch.Tensor, assign: torch.Tensor) -> float:
    """Σ w_i ||x_i - c_{a_i}||² / Σ w_i."""
    return float(_objective(X, weights, C, assign))


def weighted_kmeans(
    X: torch.Tensor, weights: torch.Tensor | None, k: int, iters: int, seed: int = 0, sample: int | None = None,
    backend: str | None = None,
) -> KMeansResult:
    """Fit ``k`` centroids minimising ``Σ w_i ||x_i − c_{a(i)}||²``.

    X [n, d] float; weights [n] >= 0 (None = uniform). Centroids are initialised by sampling points with
    probability ∝ weight; Lloyd iterations run on at most ``sample`` points (seeded subsample). Empty
    clusters are re-seeded at the points with the largest weighted error. When n <= k every point gets
    its own centroid. Runs on X's device; the draws come from a CPU generator seeded with ``seed`` (the same
    on every device). ``backend``: the nearest-centroid search (see ``CodebookSearch``).
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
    cpu = torch.device("cpu")
    gen = torch.Generator(device=cpu).manual_seed(seed)
    if weights.sum() <= 0:
        weights = torch.ones_like(weights)
    if n <= k:
        reps = torch.randint(0, n, (k - n,), generator=gen, device=cpu).to(X.device)
        C = torch.cat([X, X[reps]], dim=0)
        return KMeansResult(C, [0.0])
    if sample is not None and n > sample:
        pick = torch.randperm(n, generator=gen, device=cpu)[:sample].to(X.device)
        X_fit, w_fit = X[pick], weights[pick]
    else:
        X_fit, w_fit = X, weights
    # Drawn on the host from the CPU generator: one copy of the weights per fit, the same draw on every device.
    probs = (w_fit + 1e-12 * w_fit.max()).to(cpu)
    init = torch.multinomial(probs, k, replacement=X_fit.shape[0] < k, generator=gen).to(X.device)
    C = X_fit[init].clone()
    search_backend = nearest_backend(backend)
    assign = nearest(X_fit, C, backend=search_backend)
    history = [_objective(X_fit, w_fit, C, assign)]
    weighted = X_fit * w_fit.unsqueeze(1)
    for _ in range(iters):
        sums = torch.zeros_like(C).index_add_(0, assign, weighted)
        mass = torch.zeros(k, device=X.device, dtype=w_fit.dtype).index_add_(0, assign, w_fit)
        filled = mass > 0
        # where() instead of C[filled] = ...: the same values, without a boolean-mask sync on CUDA
        C = torch.where(filled.unsqueeze(1), sums / torch.where(filled, mass, 1.0).unsqueeze(1), C)
        empty = (~filled).nonzero().squeeze(1)  # one sync per iteration: how many clusters ran empty
        if empty.numel():
            err = w_fit * ((X_fit - C[assign]) ** 2).sum(dim=1)
            worst = torch.topk(err, min(empty.numel(), err.numel())).indices
            C[empty[: worst.numel()]] = X_fit[worst]
        assign = nearest(X_fit, C, backend=search_backend)
        history.append(_objective(X_fit, w_fit, C, assign))
    return KMeansResult(C, torch.stack(history).tolist())
