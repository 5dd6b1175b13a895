import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from factories import random_vq_state

from vptq_core.quant.trainable import CodebookLinear

LAYOUTS = [
    {"vector_len": 4, "num_centroids": 16},
    {"vector_len": 6, "num_centroids": 64, "num_res_centroids": 16, "perm": True},  # 70 rows: a padded vector
    {"vector_len": 4, "num_centroids": 16, "group_num": 2, "outlier_size": 8, "outlier_vector_len": 2,
     "num_outlier_centroids": 16, "perm": True, "norm": True},
    {"vector_len": 8, "num_centroids": 32, "group_num": 4, "norm": True, "bias": True},
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_codebook_linear_matches_the_dequantized_layer_and_trains_every_float_tensor(layout):
    out = 70 if layout["vector_len"] == 6 else 96
    st = random_vq_state(64, out, **layout)
    layer = CodebookLinear(st, None if st.bias is None else torch.nn.Parameter(st.bias.clone()))
    x = torch.randn(3, 5, 64)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, st.dequantize(), st.bias), rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    for key, p in layer.params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, key
    # the codebooks' gradients (summed by a sparse row-sum product on the CPU) equal autograd's through the
    # reference dequantization
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
