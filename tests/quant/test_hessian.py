"""The block stage's precision and its inverse-Hessian factor: bf16 Hessian products and bf16 autocast forwards
against float32 within stated bounds, the reversed-Cholesky factor against the explicit inverse's, and the dtype
the block stage picks."""

import pytest
import torch

from vptq_core.quant.blocks import block_linears, decoder_blocks
from vptq_core.quant.config import ScalarConfig
from vptq_core.quant.device import native_bf16
from vptq_core.quant.forward import (
    BLOCK_DTYPE_ENV,
    block_dtype,
    capture_block_inputs,
    hessians_and_targets,
    run_batched,
)
from vptq_core.quant.hessian import HessianAccumulator, inverse_hessian_cholesky
from vptq_core.quant.pipeline import quantize_model

# bf16 keeps 8 significant bits: one rounding of an input or a product is at most 2^-9 relative; sums of many
# such roundings stay near that in relative Frobenius terms (measured on these tiny shapes: 2e-3 .. 6e-3)
BF16_BOUND = 2e-2


def _spd(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(3 * n, n, generator=gen) * torch.linspace(0.1, 3.0, n)
    H = X.T @ X / X.shape[0]
    H.diagonal().add_(0.01 * H.diagonal().mean())
    return H


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("n", [1, 7, 64, 200])
def test_inverse_factor_equals_the_explicit_inverses_factor(n):
    H = _spd(n)
    U = inverse_hessian_cholesky(H)
    assert U.dtype == torch.float32 and torch.equal(U, U.triu())  # upper
    assert bool((U.diagonal() > 0).all())
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H.double())), upper=True)
    assert _rel(U, ref) < 1e-5  # float32 rounding of a well-conditioned factor
    torch.testing.assert_close((U.double().T @ U.double()) @ H.double(), torch.eye(n, dtype=torch.float64),
                               rtol=0, atol=1e-4)


def test_inverse_factor_adds_damping_to_a_singular_hessian_and_refuses_a_hopeless_one():
    x = torch.randn(1, 16)
    U = inverse_hessian_cholesky(x.T @ x)  # rank 1: factorisable only with the extra damping
    assert torch.isfinite(U).all() and bool((U.diagonal() > 0).all())
    with pytest.raises(ValueError, match="not positive definite"):
        inverse_hessian_cholesky(-torch.eye(4))


def test_bf16_hessian_products_stay_within_bf16_rounding_of_float32():
    gen = torch.Generator().manual_seed(1)
    exact, fast = HessianAccumulator(48), HessianAccumulator(48, dtype=torch.bfloat16)
    for _ in range(4):
        x = torch.randn(2, 64, 48, generator=gen) * torch.linspace(0.1, 5.0, 48)
        exact.add_batch(x)
        fast.add_batch(x)
    assert fast.sum.dtype == torch.float32 and fast.tokens == exact.tokens == 512
    assert 0 < _rel(fast.hessian, exact.hessian) < BF16_BOUND
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        HessianAccumulator(4, dtype=torch.float16)


def test_bf16_block_pass_stays_within_bf16_rounding_of_float32(tiny_model, calib_ids):
    model, _ = tiny_model
    with torch.no_grad():
        hidden, kwargs = capture_block_inputs(model, calib_ids)
        block = decoder_blocks(model)[0]
        linears = block_linears(block)
        H32, T32 = hessians_and_targets(block, linears, hidden, kwargs.at(0))
        H16, T16 = hessians_and_targets(block, linears, hidden, kwargs.at(0), torch.bfloat16)
        outs = run_batched(block, hidden, kwargs.at(0), torch.bfloat16)
    assert T16.dtype == torch.float32 and 0 < _rel(T16, T32) < BF16_BOUND
    assert torch.equal(outs, T16)  # the same pass: the targets are exactly the block outputs
    assert H16["self_attn.q_proj"] is H16["self_attn.v_proj"] and H16["mlp.gate_proj"] is H16["mlp.up_proj"]
    for name in linears:
        assert H16[name].dtype == torch.float32 and _rel(H16[name], H32[name]) < BF16_BOUND, name


def test_block_dtype_follows_the_environment(monkeypatch):
    monkeypatch.delenv(BLOCK_DTYPE_ENV, raising=False)
    assert block_dtype("cpu") == torch.float32  # the same checkpoint on every machine unless told otherwise
    monkeypatch.setenv(BLOCK_DTYPE_ENV, "auto")
    assert block_dtype("cpu") == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    assert block_dtype("meta") == torch.float32  # devices other than the CPU stay float32 unless told
    monkeypatch.setenv(BLOCK_DTYPE_ENV, "float32")
    assert block_dtype("cpu") == torch.float32
    monkeypatch.setenv(BLOCK_DTYPE_ENV, "bfloat16")
    assert block_dtype("cpu") == torch.bfloat16
    monkeypatch.setenv(BLOCK_DTYPE_ENV, "half")
    with pytest.raises(ValueError, match="VPTQ_BLOCK_DTYPE must be auto, bfloat16 or float32, got 'half'"):
        block_dtype("cpu")


def test_a_bf16_run_quantizes_like_a_float32_run(monkeypatch, tiny_model, calib_ids):
    """GPTQ's codes are a deterministic function of the Hessian: the bf16 path flips a code near a rounding
    boundary now and then (the error feedback carries the flip on: measured 82-99% of the codes equal per layer),
    and moves the proxy and output errors by little."""
    model, _ = tiny_model
    runs = {}
    for dtype in ("float32", "bfloat16"):
        monkeypatch.setenv(BLOCK_DTYPE_ENV, dtype)
        runs[dtype] = quantize_model(model, calib_ids, "gptq", ScalarConfig(bits=4, group_size=32))[1]
    a, b = runs["float32"], runs["bfloat16"]
    assert list(a.states) == list(b.states)
    same = [float((a.states[n].codes == b.states[n].codes).float().mean()) for n in a.states]
    assert min(same) > 0.7 and sum(same) / len(same) > 0.9
    for ra, rb in zip(a.reports, b.reports, strict=True):
        assert rb.rel_proxy_loss == pytest.approx(ra.rel_proxy_loss, rel=0.1)
        assert rb.rel_output_error == pytest.approx(ra.rel_output_error, rel=0.1)
