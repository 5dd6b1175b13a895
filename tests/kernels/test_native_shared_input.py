"""Native kernels: several layers on one input in one call (``vq_many`` / ``scalar_many``), the uint8 index streams
of codebooks with at most 256 entries, and the index-stream prefetch; against single-layer calls (exactly) and the
torch reference (within the usual tolerances), on every instruction set this CPU has, at 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch

from vptq_core.kernels import VQSpec, native, reference, synthetic

LEVELS = ["scalar", "avx2", "avx512"]


@pytest.fixture(scope="module")
def ext():
    usable, reason = native.status()
    if not usable:
        pytest.skip(reason)
    module = native._ext()
    yield module
    module.set_isa("auto")
    module.set_index8(1)
    module.set_index_prefetch(2048)


@pytest.fixture
def threads():
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


def _isas() -> list[str]:
    best = native.cpu_isa()
    return LEVELS[:LEVELS.index(best) + 1]


def _spec(in_f, out_f, v, k, kr=-1, group_num=1, outliers=None) -> VQSpec:  # noqa: ANN001
    osz, vo, ko = outliers if outliers else (0, -1, -1)
    return VQSpec(in_f, out_f, v, k, num_res_centroids=kr, outlier_vector_len=vo, num_outlier_centroids=ko,
                  group_num=group_num, outlier_size=osz)


def _close(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = max(ref.float().abs().max().item(), 1e-3)
    if ref.dtype == torch.bfloat16:
        torch.testing.assert_close(y.float(), ref.float(), rtol=1.6e-2, atol=1e-2 * scale, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * scale, msg=lambda m: f"{what}: {m}")


# Layers sharing in = 96 (q/k/v-like: different outputs, vector lengths, codebooks, residual, outliers, perm, norm,
# bias; tails in every dimension) and in = 515 (big enough for two threads).
SMALL = [
    (_spec(96, 64, 4, 256, group_num=3), True, True, False),
    (_spec(96, 29, 3, 16, 16, 1, (3, 2, 16)), False, True, True),
    (_spec(96, 33, 6, 4096, outliers=(5, 4, 256)), True, False, False),
    (_spec(96, 17, 2, 256, 256), True, False, True),
]
BIG = [
    (_spec(515, 576, 6, 4096, outliers=(3, 4, 256)), True, False, False),
    (_spec(515, 190, 4, 256), True, True, True),
    (_spec(515, 200, 3, 1024, outliers=(8, 4, 256)), True, False, False),
]


def _vq_layers(specs, dtype):  # noqa: ANN001, ANN202
    made = []
    for i, (spec, perm, norm, bias) in enumerate(specs):
        w = synthetic.random_vq_layer(spec, seed=10 + i, dtype=dtype, perm=perm, norm=norm, bias=bias)
        made.append((spec, w, native.prepare_vq(spec, w)))
    return made


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("group", ["small", "big"])
def test_vq_many_equals_single_calls(ext, threads, num_threads, group):
    threads(num_threads)
    specs = SMALL if group == "small" else BIG
    for isa in _isas():
        ext.set_isa(isa)
        for dtype in (torch.float32, torch.bfloat16):
            layers = _vq_layers(specs, dtype)
            prepared = [p for _, _, p in layers]
            for n in (1, 2, 3, 8, 9):
                x = torch.randn(n, specs[0][0].in_features).to(dtype)
                many = ext.vq_many(prepared, x)
                assert len(many) == len(layers)
                for (spec, w, p), y in zip(layers, many):
                    what = f"{isa} {dtype} tokens={n} {spec.out_features}x{spec.in_features} v{spec.vector_len}"
                    assert torch.equal(y, p(x)), what
                    _close(y, reference.vq_linear(x, spec, w), what)
    ext.set_isa("auto")


def test_vq_many_silu_mul_leading_dims_and_errors(ext, threads):
    threads(1)
    gate, up = _vq_layers([(_spec(96, 40, 4, 256), True, False, False), (_spec(96, 40, 5, 1024), False, True, True)],
                          torch.bfloat16)
    x = torch.randn(1, 1, 96).bfloat16()
    (h,) = ext.vq_many([gate[2], up[2]], x, silu_mul=True)
    assert h.shape == (1, 1, 40)
    assert torch.equal(h, ext.silu_mul(gate[2](x), up[2](x)))
    xs = torch.randn(1, 12, 96).bfloat16()  # prefill: one layer after the other
    (hs,) = ext.vq_many([gate[2], up[2]], xs, silu_mul=True)
    assert torch.equal(hs, ext.silu_mul(gate[2](xs), up[2](xs)))
    other = _vq_layers([(_spec(64, 8, 4, 16), False, False, False)], torch.bfloat16)[0][2]
    with pytest.raises(RuntimeError, match="share in_features"):
        ext.vq_many([gate[2], other], x)
    with pytest.raises(RuntimeError, match="at least one layer"):
        ext.vq_many([], x)
    with pytest.raises(RuntimeError, match="exactly two layers"):
        ext.vq_many([gate[2]], x, silu_mul=True)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_scalar_many_equals_single_calls(ext, threads, num_threads):
    threads(num_threads)
    shapes = [(576, 4, 128), (190, 4, 128), (37, 3, 48)]
    for isa in _isas():
        ext.set_isa(isa)
        for dtype in (torch.float32, torch.bfloat16):
            layers = []
            for i, (out_f, bits, gs) in enumerate(shapes):
                spec, w = synthetic.random_scalar_layer(out_f, 515, bits, gs, seed=i, dtype=dtype, bias=i == 1)
                layers.append((spec, w, native.prepare_scalar(spec, w)))
            prepared = [p for _, _, p in layers]
            for n in (1, 3, 8, 9):
                x = torch.randn(n, 515).to(dtype)
                for (spec, w, p), y in zip(layers, ext.scalar_many(prepared, x)):
                    what = f"{isa} {dtype} tokens={n} {spec.out_features} {spec.bits}-bit"
                    assert torch.equal(y, p(x)), what
                    _close(y, reference.scalar_linear(x, spec, w), what)
                for mode, step in ((0, 0.0), (1, 0.0), (2, 0.05)):  # input fake-quantized once for all
                    many = ext.scalar_many(prepared, x, act_mode=mode, act_bits=8, act_scale=step)
                    for (_, _, p), y in zip(layers, many):
                        assert torch.equal(y, p.forward_act(x, mode, 8, step)), f"{isa} act mode {mode}"
    ext.set_isa("auto")


def test_uint8_index_streams(ext, threads):
    """Codebooks of at most 256 entries (main and residual) store uint8 codes, wider ones uint16 / uint32 offsets;
    the results are exactly those of the uint16 layout on every path (GEMV, 2-8 tokens, prefill)."""
    threads(1)
    cases = [(_spec(96, 64, 4, 256, group_num=3), True, True, False, 1),
             (_spec(43, 29, 3, 16, 16, 1, (3, 2, 16)), False, True, True, 1),
             (_spec(64, 64, 8, 256, 256), True, True, True, 1),
             (_spec(40, 31, 2, 2), True, False, False, 1),
             (_spec(50, 33, 5, 4096, 256), False, False, True, 2),
             (_spec(37, 17, 2, 65536, 65536), True, True, True, 4)]
    for spec, perm, norm, bias, width in cases:
        w = synthetic.random_vq_layer(spec, seed=1, dtype=torch.bfloat16, perm=perm, norm=norm, bias=bias)
        ext.set_index8(1)
        small = native.prepare_vq(spec, w)
        ext.set_index8(0)
        wide = native.prepare_vq(spec, w)
        ext.set_index8(1)
        assert small.index_bytes == width, spec
        assert wide.index_bytes == (2 if width == 1 else width), spec
        for isa in _isas():
            ext.set_isa(isa)
            for n in (1, 2, 5, 8, 9, 40):
                x = torch.randn(n, spec.in_features).bfloat16()
                what = f"{isa} tokens={n} v{spec.vector_len} k{spec.num_centroids}"
                assert torch.equal(small(x), wide(x)), what
                _close(small(x), reference.vq_linear(x, spec, w), what)
        ext.set_isa("auto")
    if "brgemm" == native.set_prefill("auto"):  # the micro-kernel path reads the streams in both column orders
        spec, perm, norm, bias, _ = cases[0]
        w = synthetic.random_vq_layer(spec, seed=2, dtype=torch.bfloat16, perm=perm, norm=norm, bias=bias)
        layer = native.prepare_vq(spec, w)
        try:
            for gather in (1, 2):
                ext.set_gather(gather)
                x = torch.randn(33, spec.in_features).bfloat16()
                _close(layer(x), reference.vq_linear(x, spec, w), f"brgemm gather={gather}")
        finally:
            ext.set_gather(0)


def test_index_prefetch_distance_changes_no_result(ext, threads):
    threads(1)
    spec = _spec(515, 576, 2, 256)
    w = synthetic.random_vq_layer(spec, seed=4, dtype=torch.bfloat16, perm=True)
    layer = native.prepare_vq(spec, w)
    x = torch.randn(1, 515).bfloat16()
    ext.set_index_prefetch(0)
    want = layer(x)
    for distance in (64, 2048, 1 << 20):
        ext.set_index_prefetch(distance)
        assert torch.equal(layer(x), want), distance
    ext.set_index_prefetch(2048)
    _close(want, reference.vq_linear(x, spec, w), "prefetch")
