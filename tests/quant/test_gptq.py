import pytest
import torch

from vptq_core.quant.config import ScalarConfig
from vptq_core.quant.gptq import gptq_layer
from vptq_core.quant.rtn import grid_params, rtn_layer, rtn_quantize


@pytest.mark.parametrize("bits,group", [(2, 0), (3, 16), (4, 32)])
def test_gptq_beats_rtn_on_proxy_loss(correlated_layer, bits, group):
    W, H = correlated_layer
    cfg = ScalarConfig(bits=bits, group_size=group)
    assert gptq_layer(W, H, cfg).rel_proxy_loss < rtn_layer(W, H, cfg).rel_proxy_loss


def test_gptq_codes_on_grid_and_state_consistent(correlated_layer):
    W, H = correlated_layer
    res = gptq_layer(W, H, ScalarConfig(bits=3, group_size=16, act_order=True))
    st = res.state
    assert st.codes.max() <= 7 and st.scales.shape == (96, 4)
    torch.testing.assert_close(st.dequantize(), res.weight)


def test_rtn_is_nearest_grid_point():
    W = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    st = rtn_quantize(W, bits=4, group_size=0)
    Wq = st.dequantize()
    assert float((Wq - W).abs().max()) <= float(st.scales.max()) / 2 + 1e-6


def test_clip_search_never_worse():
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    W[0, 0] = 20.0  # an outlier makes plain min/max wasteful
    plain = rtn_quantize(W, 3, 0).dequantize()
    clipped = rtn_quantize(W, 3, 0, clip_search=True).dequantize()
    assert ((clipped - W) ** 2).sum(1).le(((plain - W) ** 2).sum(1) + 1e-6).all()


def test_sym_grid_zero_is_midpoint():
    _, zero = grid_params(torch.randn(4, 8), bits=4, sym=True)
    assert torch.equal(zero, torch.full((4, 1), 8.0))
