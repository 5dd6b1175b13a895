import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from factories import random_vq_state

from vptq_core.quant import trainable
from vptq_core.quant.trainable import CodebookLinear, expand_codes, sum_into_codes
from vptq_core.quant.vptq import compact_indices

LAYOUTS = [
    {"vector_len": 4, "num_centroids": 16},
    {"vector_len": 6, "num_centroids": 64, "num_res_centroids": 16, "perm": True},  # 70 rows: a padded vector
    {"vector_len": 4, "num_centroids": 16, "group_num": 2, "outlier_size": 8, "outlier_vector_len": 2,
     "num_outlier_centroids": 16, "perm": True, "norm": True},
    {"vector_len": 8, "num_centroids": 32, "group_num": 4, "norm": True, "bias": True},
]


@pytest.fixture(params=["native", "torch"])
def gather_path(request, monkeypatch):
    """The trainable layers' codebook gather and sum: the native kernels', or torch's (index_select / index_add_:
    no compiler, another device)."""
    if request.param == "native":
        from vptq_core.kernels import native

        usable, why = native.status()
        if not usable:
            pytest.skip(why)
    else:
        monkeypatch.setattr(trainable, "_native_codebooks", lambda *tensors: None)
    return request.param


@pytest.mark.parametrize("codes", ["int64", "int16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_codebook_linear_matches_the_dequantized_layer_and_trains_every_float_tensor(layout, codes, gather_path):
    out = 70 if layout["vector_len"] == 6 else 96
    st = random_vq_state(64, out, **layout)
    if codes == "int16":  # as the pipeline keeps them
        st = dataclasses.replace(st, indices=compact_indices(st.indices, st.num_centroids), res_indices=None
                                 if st.res_indices is None else compact_indices(st.res_indices, st.num_res_centroids))
    layer = CodebookLinear(st, None if st.bias is None else torch.nn.Parameter(st.bias.clone()))
    x = torch.randn(3, 5, 64)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, st.dequantize(), st.bias), rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    for key, p in layer.params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, key
    # the codebooks' gradients (summed from the codes by the native kernel or index_add_) equal autograd's through
    # the reference dequantization
    leaves = {key: getattr(st, key).detach().clone().requires_grad_() for key in layer.params}
    F.linear(x, dataclasses.replace(st, **leaves).dequantize(), st.bias).square().sum().backward()
    for key, p in layer.params.items():
        torch.testing.assert_close(p.grad, leaves[key].grad, rtol=1e-4, atol=1e-4, msg=key)
    # trained_state() is a copy with the current tensors; the given state is untouched
    with torch.no_grad():
        layer.params["centroids"].add_(0.5)
    moved = layer.trained_state()
    torch.testing.assert_close(moved.centroids, st.centroids + 0.5)
    torch.testing.assert_close(F.linear(x, moved.dequantize(), st.bias), layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_codebook_gather_and_sum_read_every_code_of_a_full_16_bit_codebook(dtype, gather_path):
    """Codes past 32767 (int16 holds them as uint16 patterns), two groups, a partial last row of vectors: the
    gathered weight is the codebook rows at the codes, and the sum puts every weight gradient back on its row."""
    gen = torch.Generator().manual_seed(3)
    k, v, G, R, gs, out = 1 << 16, 2, 2, 5, 3, 9
    codebook = torch.randn(G * k, v, generator=gen)
    values = torch.randint(k - 40, k, (G, R, gs), generator=gen)  # near the top: all >= 32768
    values[0, 0, 0] = 0
    codes = values.to(dtype)  # int16: wrapped to negative patterns
    want = torch.stack([codebook[g * k + values[g, r, c], j] for r in range(R) for j in range(v)
                        for g in range(G) for c in range(gs)]).view(R * v, G * gs)[:out]
    assert torch.equal(expand_codes(codebook, codes, k, out), want)
    grad = torch.randn(out, G * gs, generator=gen)
    summed = sum_into_codes(grad, codes, k, v)
    manual = torch.zeros(G * k, v)
    for r in range(R):
        for j in range(v):
            if r * v + j < out:
                for g in range(G):
                    for c in range(gs):
                        manual[g * k + values[g, r, c], j] += grad[r * v + j, g * gs + c]
    torch.testing.assert_close(summed, manual)


@pytest.mark.parametrize("bad", [16, -1])
def test_the_native_gather_and_sum_refuse_a_code_outside_the_codebook(bad):
    """The native kernels check every code against k before they touch memory (torch's index ops check rows
    against the whole codebook themselves)."""
    from vptq_core.kernels import native

    usable, why = native.status()
    if not usable:
        pytest.skip(why)
    codebook, grad = torch.randn(2 * 16, 4), torch.randn(8, 2 * 3)
    codes = torch.randint(0, 16, (2, 2, 3))
    codes[1, 1, 2] = bad  # -1 would alias the last row of group 0, 16 the first of a group past the codebook
    with pytest.raises(RuntimeError, match=r"codes must lie in 0\.\.15 .* a code is out of range"):
        expand_codes(codebook, codes, 16, 8)
    with pytest.raises(RuntimeError, match=r"codes must lie in 0\.\.15 .* a code is out of range"):
        sum_into_codes(grad, codes, 16, 4)


def test_the_native_gather_and_sum_refuse_an_empty_codebook_and_a_codebook_of_another_size():
    from vptq_core.kernels import native

    usable, why = native.status()
    if not usable:
        pytest.skip(why)
    ext = native._ext()
    codes = torch.zeros(2, 2, 3, dtype=torch.int16)
    with pytest.raises(RuntimeError, match="the codebook size k must be positive, got 0"):
        ext.codebook_sum(torch.randn(8, 6), codes, 0, 4)
    with pytest.raises(RuntimeError, match="the codebook size k must be positive, got 0"):
        ext.codebook_expand(torch.randn(0, 4), codes, 0, 8)
    with pytest.raises(RuntimeError, match=r"the codebook must hold G \* k = 2 \* 16 rows, got 31"):
        ext.codebook_expand(torch.randn(31, 4), codes, 16, 8)


def test_scale_linear_is_the_scalar_layer_with_its_activation_quantizer():
    from tests.factories import random_scalar_state
    from vptq_core.quant.act_quant import quantize_activations
    from vptq_core.quant.trainable import ScaleLinear, trainable_linear

    st = random_scalar_state(40, 24, bits=3, group_size=16, act_bits=8, act_granularity="token", seed=1)
    layer = trainable_linear(st)
    assert isinstance(layer, ScaleLinear) and list(dict(layer.named_parameters())) == ["params.log_scale"]
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.linear(quantize_activations(x, 8, "token"), st.dequantize().float())
    torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(layer.trained()["scales"], st.scales)
    with torch.no_grad():
        layer.params["log_scale"].fill_(math.log(2.0))  # a log-scale moves every scale by the same factor
    torch.testing.assert_close(layer.trained_state().dequantize(), 2 * st.dequantize())
    with pytest.raises(TypeError, match="no trainable form for dict"):
        trainable_linear({})
