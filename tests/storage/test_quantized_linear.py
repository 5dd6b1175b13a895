"""VQLinear / ScalarQLinear against an independent dequantization of the layer states (quant/states.py contract)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from factories import random_scalar_state, random_vq_state
from torch import nn

from vptq_core.quant.act_quant import quantize_activations
from vptq_core.storage.modules import ScalarQLinear, VQLinear, replace_linears


def dense_from_state(state) -> torch.Tensor:
    """W [out, in] float64 written straight from the quant/states.py formulas, one vector at a time."""
    out, v, gs = state.out_features, state.vector_len, state.group_size
    rows = math.ceil(out / v)
    main = torch.zeros(rows * v, state.group_num * gs, dtype=torch.float64)
    codebook = state.centroids.double().view(state.group_num, state.num_centroids, v)
    for g in range(state.group_num):
        for r in range(rows):
            for c in range(gs):
                vec = codebook[g, state.indices[g, r, c]]
                if state.res_centroids is not None:
                    vec = vec + state.res_centroids.double().view(state.group_num, -1, v)[g, state.res_indices[g, r, c]]
                main[r * v : (r + 1) * v, g * gs + c] = vec
    W = main[:out]
    if state.outlier_size:
        vo = state.outlier_vector_len
        orows = math.ceil(out / vo)
        outl = torch.zeros(orows * vo, state.outlier_size, dtype=torch.float64)
        table = state.outlier_centroids.double().view(-1, vo)
        for r in range(orows):
            for c in range(state.outlier_size):
                outl[r * vo : (r + 1) * vo, c] = table[state.outlier_indices[0, r, c]]
        W = torch.cat([outl[:out], W], dim=1)
    if state.perm is not None:
        original = torch.empty_like(W)
        original[:, state.perm] = W  # stored column i holds original column perm[i]
        W = original
    if state.weight_scale is not None:
        W = W * state.weight_scale.double() + state.weight_bias.double()
    return W


VQ_CASES = {
    "plain": {"in_features": 32, "out_features": 24, "vector_len": 4, "num_centroids": 16},
    "padding": {"in_features": 24, "out_features": 30, "vector_len": 4, "num_centroids": 32},
    "residual": {"in_features": 32, "out_features": 24, "vector_len": 4, "num_centroids": 16, "num_res_centroids": 8},
    "outliers": {
        "in_features": 40,
        "out_features": 24,
        "vector_len": 4,
        "num_centroids": 16,
        "outlier_size": 8,
        "outlier_vector_len": 2,
        "num_outlier_centroids": 8,
    },
    "groups": {"in_features": 48, "out_features": 24, "vector_len": 6, "num_centroids": 8, "group_num": 3},
    "norm": {"in_features": 32, "out_features": 24, "vector_len": 4, "num_centroids": 16, "norm": True},
    "perm": {"in_features": 32, "out_features": 24, "vector_len": 4, "num_centroids": 16, "perm": True},
    "bias": {"in_features": 32, "out_features": 24, "vector_len": 4, "num_centroids": 16, "bias": True},
    "everything": {
        "in_features": 52,
        "out_features": 21,
        "vector_len": 6,
        "num_centroids": 64,
        "num_res_centroids": 16,
        "group_num": 2,
        "outlier_size": 4,
        "outlier_vector_len": 4,
        "num_outlier_centroids": 16,
        "norm": True,
        "perm": True,
        "bias": True,
    },
}


@pytest.mark.parametrize("case", sorted(VQ_CASES))
def test_vq_linear_matches_dense_reference(case):
    state = random_vq_state(**VQ_CASES[case], seed=3)
    module = VQLinear.from_state(state, torch.float32)
    W = dense_from_state(state)
    torch.testing.assert_close(module.dequantize().double(), W, rtol=0, atol=1e-6)
    x = torch.randn(2, 5, state.in_features, generator=torch.Generator().manual_seed(1))
    bias = None if state.bias is None else state.bias.double()
    with torch.no_grad():
        y = module(x)
    assert y.shape == (2, 5, state.out_features) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), F.linear(x.double(), W, bias), rtol=1e-5, atol=1e-5)
    # Decode-shaped input (one token) goes through the same contract.
    with torch.no_grad():
        y1 = module(x[:1, :1])
    torch.testing.assert_close(y1.double(), F.linear(x[:1, :1].double(), W, bias), rtol=1e-5, atol=1e-5)


def test_vq_linear_bf16_close_to_reference():
    state = random_vq_state(**VQ_CASES["everything"], seed=5)
    module = VQLinear.from_state(state, torch.bfloat16)
    assert module.centroids.weight.dtype == torch.bfloat16 and module.indices.dtype == torch.int32
    x = torch.randn(3, state.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = module(x.bfloat16())
    assert y.dtype == torch.bfloat16
    ref = F.linear(x.double(), dense_from_state(state), state.bias.double())
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)


def test_vq_state_dict_uses_public_names_and_dtypes():
    module = VQLinear.from_state(random_vq_state(**VQ_CASES["everything"]), torch.bfloat16)
    sd = module.state_dict()
    assert set(sd) == {
        "centroids.weight",
        "res_centroids.weight",
        "indices",
        "outlier_centroids.weight",
        "outlier_indices",
        "perm",
        "weight_scale",
        "weight_bias",
        "bias",
    }
    assert sd["indices"].dtype == torch.int32 and sd["outlier_indices"].dtype == torch.int16
    assert sd["perm"].dtype == torch.int16 and sd["centroids.weight"].dtype == torch.bfloat16
    # ceil(group_size * (6 + 4) / 32) words per row, ceil(21 / 6) rows, 2 groups
    assert tuple(sd["indices"].shape) == (2, 4, math.ceil(24 * 10 / 32))
    assert set(VQLinear.from_state(random_vq_state(**VQ_CASES["plain"]), torch.float32).state_dict()) == {
        "centroids.weight",
        "indices",
    }


def test_vq_from_config_and_state_dict_reproduce_module():
    module = VQLinear.from_state(random_vq_state(**VQ_CASES["everything"], seed=7), torch.float32)
    empty = VQLinear.from_config(module.layer_config(), dtype=torch.float32)
    empty.load_state_dict(module.state_dict(), strict=True)
    x = torch.randn(4, module.in_features)
    with torch.no_grad():
        assert torch.equal(empty(x), module(x))
    assert "num_res_centroids=16" in repr(module) and "outliers=4" in repr(module)


def test_uint16_patterns_above_int16_range():
    # 65536 outlier centroids and in_features > 32768: stored int16 values are negative uint16 patterns.
    state = random_vq_state(
        in_features=32772,
        out_features=4,
        vector_len=4,
        num_centroids=4,
        outlier_size=4,
        outlier_vector_len=2,
        num_outlier_centroids=65536,
        perm=True,
        seed=11,
    )
    state.outlier_indices[0, 0, 0] = 65535
    module = VQLinear.from_state(state, torch.float32)
    assert int(module.outlier_indices.min()) < 0 and int(module.perm.min()) < 0
    torch.testing.assert_close(module.dequantize().double(), dense_from_state(state), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"is_indice_packed": False}, "is_indice_packed must be true"),
        ({"indices_as_float": True}, "indices_as_float must be false"),
        ({"colour": 1}, "unknown VPTQ layer config keys"),
        (
            {"vector_lens": [1, 4], "outlier_size": 8, "num_centroids": [8, 16], "group_size": 24},
            "outlier_vector_len must be in 2..64",
        ),
        ({"group_size": 30}, "must equal in_features"),
        ({"num_centroids": [-1, 12]}, "power of two"),
        ({"vector_lens": 4}, "vector_lens must be a list of two ints"),
        ({"enable_norm": "yes"}, "enable_norm must be true or false"),
    ],
)
def test_vq_from_config_rejects_bad_configs(change, match):
    config = VQLinear.from_state(random_vq_state(**VQ_CASES["plain"]), torch.float32).layer_config()
    config.update(change)
    with pytest.raises(ValueError, match=match):
        VQLinear.from_config(config, dtype=torch.float32)


def test_vq_from_config_missing_key():
    config = VQLinear.from_state(random_vq_state(**VQ_CASES["plain"]), torch.float32).layer_config()
    del config["num_res_centroids"]
    with pytest.raises(ValueError, match=r"misses keys \['num_res_centroids'\]"):
        VQLinear.from_config(config)


def test_vq_from_state_rejects_bad_perm():
    state = random_vq_state(**VQ_CASES["perm"])
    state.perm[0] = state.perm[1]
    with pytest.raises(ValueError, match="perm must be a permutation"):
        VQLinear.from_state(state, torch.float32)


# ------------------------------------------------------------------------------------------------ scalar
@pytest.mark.parametrize(("bits", "group_size", "bias"), [(4, 16, False), (3, 24, True), (2, 48, False), (8, 7, True)])
def test_scalar_linear_matches_state_dequantize(bits, group_size, bias):
    state = random_scalar_state(48, 20, bits=bits, group_size=group_size, bias=bias, seed=bits)
    module = ScalarQLinear.from_state(state, torch.float32)
    assert module.codes.dtype == torch.int32 and module.codes.shape == (20, math.ceil(48 * bits / 32))
    W = state.dequantize().double()
    torch.testing.assert_close(module.dequantize().double(), W, rtol=0, atol=1e-7)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = module(x)
    torch.testing.assert_close(
        y.double(), F.linear(x.double(), W, None if not bias else state.bias.double()), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("granularity", ["token", "token_asym", "tensor"])
def test_scalar_linear_quantizes_activations(granularity):
    state = random_scalar_state(32, 16, bits=4, group_size=16, act_bits=8, act_granularity=granularity, seed=1)
    module = ScalarQLinear.from_state(state, torch.float32)
    assert ("act_scale" in module.state_dict()) == (granularity == "tensor")
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4)) * 0.5
    scale = state.act_scale if granularity == "tensor" else None
    xq = quantize_activations(x, 8, granularity, scale)
    assert not torch.equal(xq, x)
    with torch.no_grad():
        y = module(x)
        again = module(x)  # bound now: on the native kernels the C++ fake-quant serves this call
    torch.testing.assert_close(y, F.linear(xq, state.dequantize()), rtol=1e-5, atol=1e-5)
    assert torch.equal(again, y)
    assert "act_bits=8" in repr(module)


@pytest.mark.parametrize("granularity", ["token", "token_asym", "tensor"])
def test_bound_a8_module_equals_fake_quant_then_the_bound_kernel(granularity):
    """Once bound (to the native kernels where they are built) a W4A8 / W8A8 module's call gives exactly the
    kernel applied to the fake-quantized input, at decode and prefill sizes; a new static scale loaded into the
    module is used from the next call on."""
    state = random_scalar_state(96, 40, bits=4, group_size=96, act_bits=8, act_granularity=granularity, seed=2)
    module = ScalarQLinear.from_state(state, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        module(torch.randn(1, 96).to(torch.bfloat16))  # binds
        kernel = module._kernel
        for tokens in (1, 3, 9, 130):
            x = (torch.randn(tokens, 96, generator=gen) * 2).to(torch.bfloat16)
            xq = quantize_activations(x, 8, granularity, module.act_scale)
            assert torch.equal(module(x), kernel(xq)), tokens
        if granularity == "tensor":
            x = torch.randn(2, 96, generator=gen).to(torch.bfloat16)
            before = module(x)
            module.load_state_dict({**module.state_dict(), "act_scale": module.act_scale * 4})
            after = module(x)
            assert not torch.equal(before, after)
            assert torch.equal(after, module._kernel(quantize_activations(x, 8, "tensor", module.act_scale)))


@pytest.mark.parametrize("granularity", ["token", "token_asym", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_activation_quant_equals_the_checked_one(granularity, dtype):
    """The module's no-grad fake-quant (fewer ops) gives exactly quantize_activations' values, input untouched."""
    from vptq_core.storage.modules import _fake_quant_inference

    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 4, 96, generator=gen) * torch.logspace(-3, 1, 96)).to(dtype)
    x[0, 0] = 0  # an all-zero token: the EPS floor
    scale = torch.tensor(0.01, dtype=dtype) if granularity == "tensor" else None
    before = x.clone()
    for bits in (4, 8):
        fast = _fake_quant_inference(x, bits, granularity, scale)
        assert torch.equal(fast, quantize_activations(x, bits, granularity, scale)), (bits, granularity, dtype)
    assert torch.equal(x, before)
    if granularity == "tensor":
        with pytest.raises(ValueError, match="scale must be positive, got 0.0"):
            _fake_quant_inference(x, 8, granularity, torch.tensor(0.0))


def test_scalar_from_config_rejects_bad_values():
    with pytest.raises(ValueError, match="bits must be an int in 1..8"):
        ScalarQLinear.from_config({"bits": 9, "group_size": 8, "in_features": 16, "out_features": 4})
    with pytest.raises(ValueError, match="act_granularity must be"):
        ScalarQLinear.from_config(
            {
                "bits": 4,
                "group_size": 8,
                "in_features": 16,
                "out_features": 4,
                "act_bits": 8,
                "act_granularity": "channel",
            }
        )
    with pytest.raises(ValueError, match="unknown scalar layer config keys"):
        ScalarQLinear.from_config({"bits": 4, "group_size": 8, "in_features": 16, "out_features": 4, "sym": True})


# ------------------------------------------------------------------------------------------ replace_linears
class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(32, 24, bias=False), nn.ReLU(), nn.Linear(24, 16, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_replace_linears_swaps_by_full_name():
    toy = _Toy()
    first = random_vq_state(**VQ_CASES["plain"], seed=1)
    second = random_scalar_state(24, 16, bits=4, group_size=8, bias=True, seed=2)
    replace_linears(toy, {"block.0": first, "block.2": second}, torch.float32)
    assert isinstance(toy.block[0], VQLinear) and isinstance(toy.block[2], ScalarQLinear)
    x = torch.randn(3, 32)
    h = F.relu(F.linear(x.double(), dense_from_state(first)))
    ref = F.linear(h, second.dequantize().double(), second.bias.double())
    with torch.no_grad():
        torch.testing.assert_close(toy(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_replace_linears_errors():
    state = random_vq_state(**VQ_CASES["plain"])
    with pytest.raises(ValueError, match="model has no submodule 'block.9'"):
        replace_linears(_Toy(), {"block.9": state}, torch.float32)
    with pytest.raises(TypeError, match="'block.1' is a ReLU, expected nn.Linear"):
        replace_linears(_Toy(), {"block.1": state}, torch.float32)
    with pytest.raises(ValueError, match=r"is 32->24 but the linear is 24->16"):
        replace_linears(_Toy(), {"block.2": state}, torch.float32)
    with pytest.raises(ValueError, match="lacks a bias but the linear has"):
        replace_linears(_Toy(), {"block.2": random_vq_state(24, 16, vector_len=4, num_centroids=16)}, torch.float32)
    with pytest.raises(TypeError, match="state for .block.0. must be a VQLayerState or ScalarLayerState, got dict"):
        replace_linears(_Toy(), {"block.0": {"in_features": 32}}, torch.float32)
