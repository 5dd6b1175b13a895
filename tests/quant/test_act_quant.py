import pytest
import torch

from vptq_core.quant.act_quant import calibrate_act_scale, quantize_activations


def _activations(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 32, generator=gen)
    x[0, 1, 7] = 40.0  # an outlier channel, as in real LLM activations
    x[2, 4, :] = 0.0  # an all-zero token must not divide by zero
    return x


@pytest.mark.parametrize("bits", [8, 4])
def test_per_token_within_half_step_and_on_grid(bits):
    x = _activations()
    qmax = 2 ** (bits - 1) - 1
    q = quantize_activations(x, bits, "token")
    assert q.shape == x.shape and q.dtype == x.dtype
    step = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-8)
    assert torch.all((q - x).abs() <= step / 2 * (1 + 1e-5))
    levels = q / step
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)
    assert levels.abs().max() <= qmax + 1e-4
    torch.testing.assert_close(q[2, 4], torch.zeros(32))
    # the absmax of every token is representable: it maps to +-qmax exactly
    torch.testing.assert_close(q.abs().amax(dim=-1), x.abs().amax(dim=-1))


@pytest.mark.parametrize("bits", [8, 4])
def test_asymmetric_per_token_grid(bits):
    """Levels 0 .. 2^b - 1 with a zero point per token: within half a step (plus the zero point's rounding at the
    ends), 0 exact, and on skewed (post-SiLU-like) tokens about half the symmetric grid's error."""
    x = _activations()
    top = 2**bits - 1
    q = quantize_activations(x, bits, "token_asym")
    assert q.shape == x.shape and q.dtype == x.dtype
    lo, hi = x.amin(dim=-1, keepdim=True).clamp(max=0), x.amax(dim=-1, keepdim=True).clamp(min=0)
    step = ((hi - lo) / top).clamp(min=1e-8)
    zero = torch.round(-lo / step)
    levels = q / step + zero
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-3)
    assert levels.min() >= -1e-3 and levels.max() <= top + 1e-3
    raw = torch.round(x / step) + zero
    inside = (raw >= 0) & (raw <= top)  # not clipped
    assert inside.float().mean() > 0.95
    assert torch.all((q - x).abs()[inside] <= step.expand_as(x)[inside] / 2 * (1 + 1e-4))
    assert torch.all((q - x).abs() <= step)  # at the ends the shifted grid clips by at most half a step more
    torch.testing.assert_close(q[2, 4], torch.zeros(32))
    torch.testing.assert_close(quantize_activations(torch.zeros(2, 8), bits, "token_asym"), torch.zeros(2, 8))
    # skewed inputs: SiLU outputs live in [-0.28, inf), so the symmetric grid wastes its negative half
    gen = torch.Generator().manual_seed(3)
    s = torch.nn.functional.silu(torch.randn(64, 256, generator=gen) * 2)
    err_asym = (quantize_activations(s, bits, "token_asym") - s).pow(2).mean()
    err_sym = (quantize_activations(s, bits, "token") - s).pow(2).mean()
    assert err_asym < 0.45 * err_sym
    # straight-through gradient: 1 inside the grid, 0 where a value clipped
    xg = x.clone().requires_grad_(True)
    quantize_activations(xg, bits, "token_asym").sum().backward()
    torch.testing.assert_close(xg.grad, inside.float())


def test_per_token_outlier_only_hurts_its_own_token():
    x = _activations()
    q = quantize_activations(x, 8, "token")
    err = (q - x).abs().amax(dim=-1)
    assert err[0, 1] > 0.1  # the outlier token's step is 40/127
    assert err[1].max() < 0.03  # other tokens keep a fine step


def test_per_tensor_uses_given_scale_and_clips():
    x = _activations()
    scale = torch.tensor(0.05)
    q = quantize_activations(x, 8, "tensor", scale)
    inside = x.abs() <= 127 * 0.05
    assert torch.all((q - x).abs()[inside] <= 0.025 * (1 + 1e-5))
    levels = q / 0.05
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)
    # the 40.0 outlier is clipped to the top of the grid
    torch.testing.assert_close(q[0, 1, 7], torch.tensor(127 * 0.05))
    # a different scale gives a different grid
    assert not torch.equal(q, quantize_activations(x, 8, "tensor", torch.tensor(0.07)))


def test_bf16_input_keeps_dtype():
    x = _activations().to(torch.bfloat16)
    q = quantize_activations(x, 8, "token")
    assert q.dtype == torch.bfloat16
    step = (x.float().abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-8)
    # float32 grid error plus one bf16 rounding of the result
    assert torch.all((q.float() - x.float()).abs() <= step / 2 + x.float().abs() * 2**-8 + 1e-6)


def test_sixteen_bits_is_identity():
    x = _activations()
    assert quantize_activations(x, 16, "token") is x
    assert quantize_activations(x, 16, "tensor", torch.tensor(1.0)) is x
    assert quantize_activations(x, 16, "tensor") is x  # no scale needed when nothing is quantized


def test_straight_through_gradient():
    x = _activations().requires_grad_(True)
    quantize_activations(x, 8, "tensor", torch.tensor(0.05)).sum().backward()
    inside = (x.detach().abs() <= 127 * 0.05).float()
    torch.testing.assert_close(x.grad, inside)
    x.grad = None
    quantize_activations(x, 4, "token").sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_calibrate_absmax_and_percentile():
    samples = [torch.tensor([[1.0, -3.0], [0.5, 2.0]]), torch.tensor([-6.0, 1.0, 2.0, 0.0])]
    torch.testing.assert_close(calibrate_act_scale(samples, 8), torch.tensor(6.0 / 127))
    torch.testing.assert_close(calibrate_act_scale(samples, 4), torch.tensor(6.0 / 7))
    # percentile 0.5 -> per-sample median of |x| (k = 2 of 4 sorted values), then the max over samples
    torch.testing.assert_close(calibrate_act_scale(iter(samples), 8, percentile=0.5), torch.tensor(1.0 / 127))
    # a calibrated scale never clips its own calibration data
    x = _activations()
    scale = calibrate_act_scale(list(x), 8)
    q = quantize_activations(x, 8, "tensor", scale)
    assert torch.all((q - x).abs() <= scale / 2 * (1 + 1e-5))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 1, "granularity": "token"}, "bits must be an integer >= 2"),
        ({"bits": 8.0, "granularity": "token"}, "bits must be an integer"),
        ({"bits": 8, "granularity": "channel"}, "granularity must be one of"),
        ({"bits": 8, "granularity": "tensor"}, "needs a static scale"),
        ({"bits": 8, "granularity": "token", "scale": torch.tensor(1.0)}, "scale must be None"),
        ({"bits": 8, "granularity": "tensor", "scale": torch.ones(2)}, "one element"),
        ({"bits": 8, "granularity": "tensor", "scale": torch.tensor(0.0)}, "scale must be positive"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_activations(torch.ones(2, 4), **kwargs)


def test_bad_input_type_and_calibration_arguments():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize_activations([1.0, 2.0], 8, "token")
    with pytest.raises(ValueError, match="percentile must be a number in"):
        calibrate_act_scale([torch.ones(3)], 8, percentile=0.0)
    with pytest.raises(ValueError, match="percentile must be a number in"):
        calibrate_act_scale([torch.ones(3)], 8, percentile=99.0)
    with pytest.raises(ValueError, match="at least one non-empty tensor"):
        calibrate_act_scale([], 8)
    with pytest.raises(TypeError, match="samples must yield torch.Tensor"):
        calibrate_act_scale([[1.0]], 8)


def test_mse_clip_lowers_output_error_on_heavy_tails_and_never_raises_it():
    from torch import nn

    from vptq_core.quant.act_quant import calibrate_static_scales

    gen = torch.Generator().manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 16))
    with torch.no_grad():
        block[0].weight.copy_(torch.randn(16, 32, generator=gen))
    inputs = torch.tan((torch.rand(16, 256, 32, generator=gen) - 0.5) * 3.1)  # Cauchy-like tails, max ~48
    forward = lambda blk, x: blk(x)  # noqa: E731

    def out_error(scale, bits):
        x = inputs.reshape(-1, 32)
        return float(((quantize_activations(x, bits, "tensor", scale) - x) @ block[0].weight.T).pow(2).sum())

    for bits in (4, 8):
        absmax = calibrate_static_scales(forward, block, ["0"], inputs, bits)["0"]
        mse = calibrate_static_scales(forward, block, ["0"], inputs, bits, clip="mse")["0"]
        assert float(absmax) == pytest.approx(float(inputs.abs().max()) / (2 ** (bits - 1) - 1))
        assert out_error(mse, bits) <= out_error(absmax, bits)
        if bits == 4:  # measured: clip 0.7 of the absmax, 24% less output error
            assert float(mse) < 0.9 * float(absmax)
            assert out_error(mse, bits) < 0.85 * out_error(absmax, bits)
