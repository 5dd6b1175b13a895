"""Layer Hessians ``H = 2 XᵀX / n`` of the reconstruction loss, damping and the inverse Cholesky factor.

Everything stays on the device of its inputs, in full float32 (``device.exact_float32``); the only host
syncs are one per factorisation (did the Cholesky succeed) and the two numbers of ``proxy_loss``.
"""

from __future__ import annotations

import contextlib

import torch

from .device import exact_float32

_FACTORS = "inverse_hessian_cholesky"  # the key of ``inverse_hessian_cholesky``'s entries in a caller's cache


@contextlib.contextmanager
def single_thread_torch():
    """Run per-column loops with one torch thread: their small ops lose more to thread hand-offs on a
    busy few-core machine than they gain."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SharedInputs:
    """Which linears read the very same input tensor (q/k/v, gate/up), so that they share one Hessian. The inputs
    compared are held (the last ``lookback`` of them, or all with 0) until ``release``: a freed activation's
    address can never pass for another input's. A sharer found only after its input left the lookback gets a
    Hessian of its own: the same numbers, computed twice."""

    def __init__(self, lookback: int = 0):
        self.lookback = lookback
        self.owner: dict[str, str] = {}  # linear -> the first linear that read its input
        self._held: list[tuple[torch.Tensor, str]] = []

    def owner_of(self, name: str, x: torch.Tensor) -> str:
        """The linear whose Hessian ``name`` (reading ``x``) shares; decided at its first input, kept after."""
        if name not in self.owner:
            self.owner[name] = next((n for t, n in self._held if t.data_ptr() == x.data_ptr()
                                     and t.shape == x.shape and t.stride() == x.stride()), name)
            self._held.append((x, name))
            if self.lookback:
                del self._held[: -self.lookback]
        return self.owner[name]

    def release(self) -> None:
        self._held.clear()


class HessianAccumulator:
    """Accumulates ``H = 2/n · Σ xᵀx`` over batches of inputs ``x`` [..., in_features] (float32 sums).

    ``dtype``: the dtype each batch's product ``xᵀx`` is computed in. float32 (the default) is exact to float
    rounding; bfloat16 (where the hardware multiplies it: ``device.native_bf16``) is several times faster and
    rounds each batch's product to bf16 before the float32 sum: an error of about 2⁻⁹ of one batch's term, far
    below how much the term itself varies from batch to batch (the calibration's own sampling noise); the
    block stage measures it (docs/methods.md#block-stage-precision)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Hessian products are float32 or bfloat16, got {dtype}")
        self.in_features = in_features
        self.dtype = dtype
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add_batch(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, Hessian expects {self.in_features}")
        x = x.reshape(-1, self.in_features).to(self.sum.device, self.dtype)
        if self.dtype == torch.float32:
            with exact_float32():
                self.sum.addmm_(x.T, x)
        else:
            self.sum.add_(x.T @ x)  # bf16 product (float32 accumulation inside the matmul), summed in float32
        self.tokens += x.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        if self.tokens == 0:
            raise ValueError("no calibration tokens were accumulated")
        return self.sum * (2.0 / self.tokens)


def prepare_hessian(W: torch.Tensor, H: torch.Tensor, damp_percent: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dead input columns (H_jj == 0) get H_jj = 1 and zero weight; add ``damp_percent · mean(diag H)``.

    Returns (W', H') as new float32 tensors (masks, not boolean indexing: no host sync on CUDA).
    """
    W = W.float().clone()
    H = H.float().clone()
    diag = H.diagonal()
    dead = diag == 0
    diag.masked_fill_(dead, 1.0)
    W.masked_fill_(dead.unsqueeze(0), 0.0)
    damp = damp_percent * torch.mean(torch.diag(H))  # a contiguous copy: the same sum order as always
    diag.add_(damp)
    return W, H


def inverse_hessian_cholesky(H: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``H⁻¹`` (``H⁻¹ = UᵀU``), retrying with more damping if needed.

    ``cache`` (a dict owned by the caller, e.g. one per block) reuses the factor for identical matrices:
    q/k/v and gate/up share their Hessian and, without normalisation, their column order. Matrices are
    compared exactly on their own device (``torch.equal``: one sync per cached entry, no host copy).
    """
    entries = None
    if cache is not None:
        entries = cache.setdefault(_FACTORS, [])
        for seen, U in entries:
            if seen.shape == H.shape and seen.dtype == H.dtype and seen.device == H.device and torch.equal(seen, H):
                return U
    U = _inverse_cholesky(H)
    if entries is not None:
        entries.append((H.detach().clone(), U))
    return U


def _inverse_cholesky(H: torch.Tensor) -> torch.Tensor:
    """``U`` upper with ``H⁻¹ = UᵀU`` from one Cholesky factorisation and one triangular solve, never forming
    ``H⁻¹``: with ``J`` the order reversal, ``J H J = L Lᵀ`` gives ``H = V Vᵀ`` for the upper ``V = J L J``, so
    ``H⁻¹ = V⁻ᵀ V⁻¹`` and ``U = V⁻¹ = J L⁻¹ J``. The same factor as Cholesky-factoring the explicit inverse (to
    float rounding, a little closer to the float64 factor), at a fraction of the cost (LAPACK's ``potri`` is
    slow on CPU)."""
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    flipped = H.flip(0, 1)
    extra = 0.0
    with exact_float32():
        for _ in range(6):
            L, info = torch.linalg.cholesky_ex(flipped + extra * eye)
            if info == 0:
                return torch.linalg.solve_triangular(L, eye, upper=False).flip(0, 1)
            extra = max(extra * 10, 1e-4 * float(torch.mean(torch.diag(H))))
    raise ValueError("Hessian is not positive definite even after extra damping; increase damp_percent")


def proxy_loss(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> tuple[float, float]:
    """``tr(ΔW H ΔWᵀ)`` and its value relative to ``tr(W H Wᵀ)``."""
    dW = (W_hat.float() - W.float())
    with exact_float32():
        num, den = torch.stack([torch.sum((dW @ H) * dW), torch.sum((W.float() @ H) * W.float())]).tolist()
    return num, num / den if den > 0 else float("inf")
