"""kernels: VQSpec, the torch reference (against a naive loop), the fused CPU backend, dispatch and the custom ops."""

from __future__ import annotations

import math

import pytest
import torch

import vptq_core.kernels.ops  # noqa: F401 (makes kernels.ops an attribute)
from vptq_core import kernels
from vptq_core.kernels import (
    ScalarSpec,
    VQSpec,
    VQWeights,
    available_backends,
    pack_indices,
    scalar_dequantize,
    scalar_linear,
    unpack_indices,
    vq_dequantize,
    vq_linear,
)
from vptq_core.kernels.synthetic import random_scalar_layer, random_vq_layer
from vptq_core.quant.states import VQLayerState

CPU_OK, CPU_REASON = available_backends()["cpu"]
needs_cpu = pytest.mark.skipif(not CPU_OK, reason=CPU_REASON or "cpu backend unavailable")

def naive_dequantize(spec: VQSpec, layer: VQWeights) -> torch.Tensor:
    """Entry-by-entry loop over the formula in vptq_core/quant/states.py (fp64)."""
    idx, ridx = unpack_indices(layer.indices, spec.index_bits, spec.group_size, spec.res_bits)
    v, vo, out = spec.vector_len, spec.outlier_vector_len, spec.out_features
    cb = layer.centroids.double()
    stored = torch.zeros(out, spec.in_features, dtype=torch.float64)
    for r in range(spec.outlier_rows):
        for c in range(spec.outlier_size):
            i = int(layer.outlier_indices[0, r, c]) & 0xFFFF
            for t in range(vo):
                if r * vo + t < out:
                    stored[r * vo + t, c] = float(layer.outlier_centroids[0, i * vo + t])
    for g in range(spec.group_num):
        for r in range(spec.rows):
            for c in range(spec.group_size):
                for t in range(v):
                    if r * v + t >= out:
                        continue
                    value = cb[g, int(idx[g, r, c]) * v + t]
                    if spec.has_residual:
                        value = value + float(layer.res_centroids[g, int(ridx[g, r, c]) * v + t])
                    stored[r * v + t, spec.outlier_size + g * spec.group_size + c] = value
    weight = stored.clone()
    if layer.perm is not None:
        perm = layer.perm.long() & 0xFFFF
        weight = torch.empty_like(stored)
        weight[:, perm] = stored  # stored column i holds original column perm[i]
    if layer.weight_scale is not None:
        weight = weight * layer.weight_scale.double() + layer.weight_bias.double()
    return weight


SPECS = [
    VQSpec(24, 13, 6, 64),
    VQSpec(30, 17, 4, 32, num_res_centroids=8),
    VQSpec(40, 11, 3, 16, num_res_centroids=4, outlier_vector_len=4, num_outlier_centroids=8, group_num=2,
           group_size=17, outlier_size=6),
    VQSpec(20, 9, 8, 2, outlier_vector_len=2, num_outlier_centroids=4, outlier_size=3),
]


# ------------------------------------------------------------------------------------------------- spec
def test_spec_derived_fields() -> None:
    spec = VQSpec(576, 1536, 6, 4096)
    assert (spec.group_size, spec.index_bits, spec.res_bits, spec.rows) == (576, 12, 0, 256)
    assert spec.packed_words == math.ceil(576 * 12 / 32)
    res = VQSpec(100, 10, 8, 256, num_res_centroids=256, outlier_vector_len=4, num_outlier_centroids=16,
                 outlier_size=4, group_num=2)
    assert (res.group_size, res.res_bits, res.entry_bits, res.rows, res.outlier_rows) == (48, 8, 16, 2, 3)
    assert VQSpec.from_list(res.as_list()) == res


def test_spec_validation_messages() -> None:
    with pytest.raises(ValueError, match="num_centroids must be in 2..65536, got 131072"):
        VQSpec(8, 8, 2, 131072)
    with pytest.raises(ValueError, match="num_centroids must be a power of two in 2..65536, got 100"):
        VQSpec(8, 8, 2, 100)
    with pytest.raises(ValueError, match="num_res_centroids must be a power of two"):
        VQSpec(8, 8, 2, 16, num_res_centroids=3)
    with pytest.raises(ValueError, match=r"outlier_size \(2\) \+ group_num\*group_size \(1\*5\) must equal"):
        VQSpec(8, 8, 2, 16, group_size=5, outlier_size=2, outlier_vector_len=2, num_outlier_centroids=4)
    with pytest.raises(ValueError, match="outlier_vector_len must be in 2..64, got -1"):
        VQSpec(8, 8, 2, 16, outlier_size=2)
    with pytest.raises(ValueError, match="must be divisible by group_num"):
        VQSpec(9, 8, 2, 16, group_num=2)
    with pytest.raises(TypeError, match="vector_len must be an int"):
        VQSpec(8, 8, 2.0, 16)  # type: ignore[arg-type]


def test_spec_from_state_and_layer_config() -> None:
    spec = SPECS[2]
    layer = random_vq_layer(spec, seed=3, perm=True, norm=True, bias=True)
    idx, ridx = unpack_indices(layer.indices, spec.index_bits, spec.group_size, spec.res_bits)
    state = VQLayerState(
        in_features=spec.in_features, out_features=spec.out_features, vector_len=spec.vector_len,
        num_centroids=spec.num_centroids, group_num=spec.group_num, group_size=spec.group_size,
        centroids=layer.centroids, indices=idx, num_res_centroids=spec.num_res_centroids,
        res_centroids=layer.res_centroids, res_indices=ridx, outlier_vector_len=spec.outlier_vector_len,
        num_outlier_centroids=spec.num_outlier_centroids, outlier_size=spec.outlier_size,
        outlier_centroids=layer.outlier_centroids, outlier_indices=layer.outlier_indices.long() & 0xFFFF,
        perm=layer.perm.long(), weight_scale=layer.weight_scale, weight_bias=layer.weight_bias,
        bias=layer.bias,
    )
    assert VQSpec.from_state(state) == spec
    assert spec.layer_config(bias=True, enable_norm=True, enable_perm=True) == state.layer_config()
    packed = pack_indices(state.indices, spec.index_bits, state.res_indices, spec.res_bits)
    assert torch.equal(packed, layer.indices)


# -------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"v{s.vector_len}k{s.num_centroids}")
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "perm+norm"])
def test_reference_dequantize_matches_naive_loop(spec: VQSpec, extras: bool) -> None:
    layer = random_vq_layer(spec, seed=1, perm=extras, norm=extras, dtype=torch.float64)
    got = vq_dequantize(spec, layer)
    assert got.dtype == torch.float64 and got.shape == (spec.out_features, spec.in_features)
    torch.testing.assert_close(got, naive_dequantize(spec, layer), rtol=1e-12, atol=1e-12)


def test_reference_reads_int16_perm_and_outliers_as_uint16() -> None:
    spec = VQSpec(20, 9, 8, 2, outlier_vector_len=2, num_outlier_centroids=65536, outlier_size=3)
    layer = random_vq_layer(spec, seed=2, perm=True, dtype=torch.float64)
    oidx = torch.full((1, spec.outlier_rows, 3), 40000, dtype=torch.int32).to(torch.int16)  # negative as int16
    layer = layer._replace(outlier_indices=oidx)
    got = vq_dequantize(spec, layer)
    perm = layer.perm.long()
    stored = got[:, perm]
    expected = layer.outlier_centroids[0, 40000 * 2: 40000 * 2 + 2]
    torch.testing.assert_close(stored[0:2, 0], expected, rtol=0, atol=0)


def test_reference_linear_and_scalar_formula() -> None:
    spec = SPECS[1]
    layer = random_vq_layer(spec, seed=4, bias=True)
    x = torch.randn(2, 3, spec.in_features, generator=torch.Generator().manual_seed(0))
    weight = vq_dequantize(spec, layer)
    y = vq_linear(x, spec, layer, backend="reference")
    torch.testing.assert_close(y, x @ weight.T + layer.bias)
    s_spec, s = random_scalar_layer(6, 10, 3, 4)
    codes = kernels.unpack_codes(s.codes, 3, 10)
    w = scalar_dequantize(s_spec, s)
    group = torch.arange(10) // 4
    torch.testing.assert_close(w, s.scales[:, group] * (codes.float() - s.zeros[:, group]))


# ------------------------------------------------------------------------------------------- cpu backend
CPU_SPECS = SPECS + [
    VQSpec(64, 48, 6, 4096),
    VQSpec(64, 40, 4, 4096),
    VQSpec(64, 40, 8, 256, num_res_centroids=256),
    VQSpec(64, 40, 4, 256, num_res_centroids=256),
    VQSpec(48, 37, 12, 16, num_res_centroids=4),
    VQSpec(48, 37, 16, 65536, num_res_centroids=65536),
    VQSpec(48, 37, 20, 8, num_res_centroids=2),
    VQSpec(33, 20, 5, 8192, group_num=3, group_size=9, outlier_size=6, outlier_vector_len=3,
           num_outlier_centroids=32),
]


@needs_cpu
@pytest.mark.parametrize("spec", CPU_SPECS, ids=lambda s: f"v{s.vector_len}k{s.num_centroids}r{s.num_res_centroids}")
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "perm+norm+bias"])
def test_cpu_matches_reference_fp32(spec: VQSpec, extras: bool) -> None:
    layer = random_vq_layer(spec, seed=5, perm=extras, norm=extras, bias=extras, perm_dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    for shape in [(1, spec.in_features), (3, spec.in_features), (2, 2, spec.in_features)]:
        x = torch.randn(*shape, generator=gen)
        expected = vq_linear(x, spec, layer, backend="reference")
        got = vq_linear(x, spec, layer, backend="cpu")
        assert got.shape == expected.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_cpu
@pytest.mark.parametrize("spec", CPU_SPECS, ids=lambda s: f"v{s.vector_len}k{s.num_centroids}r{s.num_res_centroids}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_dequantize_matmul_path(spec: VQSpec, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    import vptq_core.kernels.cpu as cpu

    monkeypatch.setattr(cpu, "_TILE_BYTES", 64 * spec.in_features)  # several tiles even for tiny layers
    layer = random_vq_layer(spec, seed=15, dtype=dtype, perm=True, norm=True, bias=True)
    stored = cpu.vq_dequantize_stored(spec, layer, dtype=torch.float32)
    layer32 = VQWeights(*[t.float() if t is not None and t.is_floating_point() else t for t in layer])
    reference_stored = vq_dequantize(spec, layer32._replace(perm=None, weight_scale=None, weight_bias=None))
    torch.testing.assert_close(stored, reference_stored, rtol=0, atol=0)
    x = torch.randn(kernels.ops.CPU_FUSED_MAX_TOKENS + 3, spec.in_features, generator=torch.Generator().manual_seed(4))
    x = x.to(dtype)
    got = vq_linear(x, spec, layer, backend="cpu")  # many tokens: dequantize + matmul
    assert got.dtype == dtype
    expected = vq_linear(x.float(), spec, layer32, backend="reference")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


@needs_cpu
@pytest.mark.parametrize("v", list(range(2, 17)))
def test_cpu_every_vector_length(v: int) -> None:
    spec = VQSpec(26, 2 * v + 1, v, 32, num_res_centroids=4 if v % 2 else -1)
    layer = random_vq_layer(spec, seed=v, perm=True, norm=True)
    x = torch.randn(2, 26, generator=torch.Generator().manual_seed(v))
    torch.testing.assert_close(vq_linear(x, spec, layer, backend="cpu"),
                               vq_linear(x, spec, layer, backend="reference"), rtol=1e-5, atol=1e-5)


@needs_cpu
@pytest.mark.parametrize("index_bits", range(1, 17))
def test_cpu_every_index_width(index_bits: int) -> None:
    spec = VQSpec(37, 12, 4, 2**index_bits, num_res_centroids=2 ** max(1, 17 - index_bits) if index_bits > 8 else -1)
    layer = random_vq_layer(spec, seed=index_bits)
    x = torch.randn(1, 37, generator=torch.Generator().manual_seed(index_bits))
    torch.testing.assert_close(vq_linear(x, spec, layer, backend="cpu"),
                               vq_linear(x, spec, layer, backend="reference"), rtol=1e-5, atol=1e-5)


@needs_cpu
def test_cpu_bf16_inputs_and_outputs() -> None:
    spec = VQSpec(64, 40, 6, 256, outlier_vector_len=4, num_outlier_centroids=16, outlier_size=4, group_size=60)
    layer = random_vq_layer(spec, seed=6, dtype=torch.bfloat16, perm=True, norm=True, bias=True)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = vq_linear(x, spec, layer, backend="cpu")
    assert got.dtype == torch.bfloat16
    layer32 = VQWeights(*[t.float() if t is not None and t.is_floating_point() else t for t in layer])
    expected = vq_linear(x.float(), spec, layer32, backend="reference")  # fp32 accumulation, then one rounding
    torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=1e-2)


@needs_cpu
def test_cpu_sees_in_place_codebook_updates() -> None:
    spec = CPU_SPECS[4]
    layer = random_vq_layer(spec, seed=7)
    x = torch.randn(1, spec.in_features, generator=torch.Generator().manual_seed(3))
    first = vq_linear(x, spec, layer, backend="cpu")
    with torch.no_grad():
        layer.centroids.mul_(2.0)
    torch.testing.assert_close(vq_linear(x, spec, layer, backend="cpu"), 2 * first, rtol=1e-5, atol=1e-5)


@needs_cpu
def test_cpu_under_inference_mode_with_inference_tensors() -> None:
    spec = CPU_SPECS[5]
    with torch.inference_mode():  # layer tensors created here have no version counter
        layer = random_vq_layer(spec, seed=17, perm=True, bias=True)
        x = torch.randn(2, spec.in_features)
        got = vq_linear(x, spec, layer)
        expected = vq_linear(x, spec, layer, backend="reference")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_cpu
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("group_size", [16, 45, 70])
def test_cpu_scalar_matches_reference(bits: int, group_size: int) -> None:
    s = random_scalar_layer(19, 70, bits, group_size, seed=bits, bias=bits % 2 == 0)  # (spec, weights)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 70, generator=torch.Generator().manual_seed(bits)).to(dtype)
        got = scalar_linear(x, *s, backend="cpu")
        expected = scalar_linear(x.float(), *s, backend="reference")
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------- dispatch
def test_available_backends_reports_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    status = available_backends()
    assert set(status) == {"reference", "native", "cpu", "triton"}
    assert status["reference"] == (True, "")
    if not torch.cuda.is_available():
        usable, reason = status["triton"]
        assert not usable and reason.startswith("triton backend unavailable")
        with pytest.raises(RuntimeError, match="triton backend unavailable"):
            vq_linear(torch.zeros(1, 24), SPECS[0], random_vq_layer(SPECS[0]), backend="triton")


def test_backend_argument_and_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SPECS[0]
    layer = random_vq_layer(spec, seed=8)
    x = torch.randn(1, spec.in_features)
    with pytest.raises(ValueError, match="backend must be one of"):
        vq_linear(x, spec, layer, backend="gpu")
    monkeypatch.setenv("VPTQ_KERNEL_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="'nonsense'"):
        vq_linear(x, spec, layer)
    calls: list[str] = []
    import vptq_core.kernels.ops as ops

    real = ops.reference.vq_linear
    monkeypatch.setattr(ops.reference, "vq_linear", lambda *a, **k: calls.append("reference") or real(*a, **k))
    monkeypatch.setenv("VPTQ_KERNEL_BACKEND", "reference")
    vq_linear(x, spec, layer)
    assert calls == ["reference"]
    if CPU_OK:
        vq_linear(x, spec, layer, backend="cpu")  # the argument wins over the environment
        assert calls == ["reference"]


@needs_cpu
def test_auto_without_native_uses_numba_gemv_for_decode_and_matmul_for_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    import vptq_core.kernels.cpu as cpu
    import vptq_core.kernels.ops as ops

    monkeypatch.delenv("VPTQ_KERNEL_BACKEND", raising=False)
    real_status = ops.backend_status
    monkeypatch.setattr(ops, "backend_status", lambda name: (False, "off") if name == "native" else real_status(name))
    spec = SPECS[0]
    layer = random_vq_layer(spec, seed=9)
    calls: list[tuple[str, bool]] = []
    real_cpu, real_ref = cpu.vq_linear, ops.reference.vq_linear

    def spy_cpu(*args, **kwargs):
        calls.append(("cpu", kwargs["fused"]))
        return real_cpu(*args, **kwargs)

    monkeypatch.setattr(cpu, "vq_linear", spy_cpu)
    monkeypatch.setattr(ops.reference, "vq_linear",
                        lambda *a, **k: calls.append(("reference", False)) or real_ref(*a, **k))
    with torch.no_grad():
        vq_linear(torch.randn(1, spec.in_features), spec, layer)
        vq_linear(torch.randn(ops.CPU_FUSED_MAX_TOKENS, spec.in_features), spec, layer)
        vq_linear(torch.randn(ops.CPU_FUSED_MAX_TOKENS + 1, spec.in_features), spec, layer)
    assert calls == [("cpu", True), ("cpu", True), ("cpu", False)]
    x = torch.randn(1, spec.in_features, requires_grad=True)
    calls.clear()
    vq_linear(x, spec, layer).sum().backward()  # autograd needs the reference path
    assert calls == [("reference", False)] and x.grad is not None


def test_cpu_compile_failure_is_reported_and_auto_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import vptq_core.kernels.cpu as cpu

    monkeypatch.delenv("VPTQ_KERNEL_BACKEND", raising=False)
    reason = "cpu backend unavailable: compiling the numba kernels failed: LoweringError: test"
    monkeypatch.setattr(cpu, "_failure", [reason])
    assert available_backends()["cpu"] == (False, reason)
    spec = SPECS[0]
    layer = random_vq_layer(spec, seed=16)
    x = torch.randn(1, spec.in_features)
    with torch.no_grad():
        torch.testing.assert_close(vq_linear(x, spec, layer), vq_linear(x, spec, layer, backend="reference"))
        with pytest.raises(RuntimeError, match="compiling the numba kernels failed"):
            vq_linear(x, spec, layer, backend="cpu")


def test_reference_backward_reaches_centroids() -> None:
    spec = SPECS[1]
    layer = random_vq_layer(spec, seed=10)
    layer.centroids.requires_grad_(True)
    x = torch.randn(2, spec.in_features)
    vq_linear(x, spec, layer).pow(2).sum().backward()
    assert layer.centroids.grad is not None and layer.centroids.grad.abs().sum() > 0
    if CPU_OK:
        with pytest.raises(RuntimeError, match="cpu backend has no backward"):
            vq_linear(x, spec, layer, backend="cpu")


def test_bad_inputs_raise_clear_errors() -> None:
    spec = SPECS[2]
    layer = random_vq_layer(spec, seed=11)
    x = torch.randn(1, spec.in_features)
    bad = layer._replace(indices=layer.indices.long())
    with pytest.raises(TypeError, match=r"indices dtype must be one of \['torch.int32'\], got torch.int64"):
        vq_linear(x, spec, bad)
    bad = layer._replace(indices=layer.indices[:, :-1])
    with pytest.raises(ValueError, match=r"indices shape must be \(2, 4, 4\), got \(2, 3, 4\)"):
        vq_linear(x, spec, bad)
    with pytest.raises(ValueError, match="res_centroids is required when spec.num_res_centroids > 0"):
        vq_linear(x, spec, layer._replace(res_centroids=None))
    with pytest.raises(ValueError, match=r"x last dimension must be in_features \(40\)"):
        vq_linear(torch.randn(1, 39), spec, layer)
    with pytest.raises(TypeError, match="x dtype must be float32, bfloat16, float16 or float64"):
        vq_linear(x.long(), spec, layer)
    with pytest.raises(ValueError, match="weight_scale and weight_bias must be given together"):
        vq_linear(x, spec, layer._replace(weight_scale=torch.ones(spec.in_features)))
    with pytest.raises(ValueError, match=r"bias shape must be \(11,\)"):
        vq_linear(x, spec, layer._replace(bias=torch.zeros(12)))
    with pytest.raises(TypeError, match="spec must be a kernels.VQSpec"):
        vq_linear(x, spec.as_list(), layer)  # type: ignore[arg-type]
    s_spec, s = random_scalar_layer(4, 10, 4, 5)
    with pytest.raises(ValueError, match="bits must be in 1..8, got 9"):
        scalar_linear(torch.randn(1, 10), ScalarSpec(10, 4, 9, 5), s)
    with pytest.raises(ValueError, match=r"scales shape must be \(4, 2\)"):
        scalar_linear(torch.randn(1, 10), s_spec, s._replace(scales=s.scales[:, :1]))


def test_validation_is_redone_when_a_layer_tensor_changes() -> None:
    spec = SPECS[0]
    layer = random_vq_layer(spec, seed=12)
    x = torch.randn(1, spec.in_features)
    vq_linear(x, spec, layer, backend="reference")
    layer.centroids.data = torch.zeros(1, 3)  # same Parameter-style object, new (wrong) storage
    with pytest.raises(ValueError, match="centroids shape must be"):
        vq_linear(x, spec, layer, backend="reference")


# ------------------------------------------------------------------------------------------- custom ops
@needs_cpu
def test_custom_ops_pass_opcheck() -> None:
    spec = SPECS[2]
    layer = random_vq_layer(spec, seed=13, perm=True, norm=True, bias=True)
    x = torch.randn(3, spec.in_features)
    args = (x, spec.as_list(), *layer, "cpu")
    torch.library.opcheck(torch.ops.vptq_core.vq_linear.default, args)
    s_spec, s = random_scalar_layer(7, 30, 3, 8, bias=True)
    torch.library.opcheck(
        torch.ops.vptq_core.scalar_linear.default,
        (torch.randn(2, 30), s_spec.as_list(), *s, "cpu"),
    )


def test_fake_tensor_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = SPECS[3]
    layer = random_vq_layer(spec, seed=14)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(2, 5, spec.in_features))
        args = [mode.from_tensor(t) if t is not None else None for t in layer]
        y = torch.ops.vptq_core.vq_linear(x, spec.as_list(), *args, "reference")
    assert tuple(y.shape) == (2, 5, spec.out_features)


def test_auto_prefers_native_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import vptq_core.kernels.ops as ops

    monkeypatch.delenv("VPTQ_KERNEL_BACKEND", raising=False)
    native_ok = available_backends()["native"][0]
    expected = "native" if native_ok else ("cpu" if CPU_OK else "reference")
    spec = SPECS[2]
    assert ops.bind_vq(spec, random_vq_layer(spec, seed=1)).backend == expected
