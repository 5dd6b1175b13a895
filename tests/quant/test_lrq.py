import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vptq_core.quant.act_quant import calibrate_act_scale, quantize_activations
from vptq_core.quant.config import LRQConfig
from vptq_core.quant.lrq import LRQWeightQuantizer, auto_rank, lrq_quantize_block
from vptq_core.quant.rtn import rtn_quantize


class TinyBlock(nn.Module):
    """Residual MLP block: two linears and a nonlinearity."""

    def __init__(self, hidden: int = 16, inner: int = 40, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.mlp = nn.ModuleDict({"up": nn.Linear(hidden, inner), "down": nn.Linear(inner, hidden, bias=False)})
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp["down"](F.gelu(self.mlp["up"](self.norm(x))))


NAMES = ["mlp.up", "mlp.down"]


def call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


def tiny_data(block: nn.Module, n: int = 8, seq: int = 6, hidden: int = 16, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, seq, hidden, generator=gen)
    with torch.no_grad():
        y = block(x)
    return x, y


def with_states(block: nn.Module, states) -> nn.Module:
    """Copy of block whose linears hold the dequantized weights and apply the states' activation quantizer."""
    out = copy.deepcopy(block).float()
    for name, state in states.items():
        linear = out.get_submodule(name)
        with torch.no_grad():
            linear.weight.copy_(state.dequantize())
        if state.act_bits < 16:
            scale = state.act_scale if state.act_granularity == "tensor" else None
            linear.register_forward_pre_hook(
                lambda m, args, s=state, sc=scale: (quantize_activations(args[0], s.act_bits, s.act_granularity, sc),)
            )
    return out


def mse(block, x, y) -> float:
    with torch.no_grad():
        return float(F.mse_loss(block(x), y))


def test_auto_rank_rule():
    assert auto_rank(4096, 4096) == 1024  # LLaMA-7B attention
    assert auto_rank(11008, 4096) == 1024  # LLaMA-7B MLP
    assert auto_rank(5120, 13824) == 1024  # LLaMA-13B
    assert auto_rank(8192, 28672) == 2048  # LLaMA-70B: both dims >= 8192
    assert auto_rank(1024, 8192) == 256  # 70B k/v projections: the smaller dimension rules
    assert auto_rank(576, 576) == 144  # SmolLM2-135M
    assert auto_rank(192, 576) == 48
    assert auto_rank(3, 5) == 1
    with pytest.raises(ValueError, match="out_features must be a positive integer, got 0"):
        auto_rank(0, 8)
    with pytest.raises(ValueError, match="in_features must be a positive integer"):
        auto_rank(8, 2.5)


@pytest.mark.parametrize(("bits", "group_size", "clip_search"), [(3, 0, False), (4, 0, True), (2, 16, True)])
def test_quantizer_starts_exactly_at_rtn(bits, group_size, clip_search):
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(24, 40, generator=gen)  # 40 = 16 + 16 + 8: a partial last group
    rtn = rtn_quantize(W, bits, group_size, clip_search=clip_search)
    q = LRQWeightQuantizer(W, rtn.scales, rtn.zeros, bits, rtn.group_size, rank=6, generator=gen)
    assert torch.equal(q(), rtn.dequantize())
    state = q.to_state()
    assert torch.equal(state.codes, rtn.codes) and torch.equal(state.scales, rtn.scales)
    full = LRQWeightQuantizer(W, rtn.scales, rtn.zeros, bits, rtn.group_size, rank=0, full_scale=True)
    assert torch.equal(full(), rtn.dequantize())


@pytest.mark.parametrize("full_scale", [False, True])
def test_fold_reproduces_trained_weight_exactly(full_scale):
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(24, 40, generator=gen)
    rtn = rtn_quantize(W, 3, 16)
    q = LRQWeightQuantizer(W, rtn.scales, rtn.zeros, 3, rtn.group_size, rank=4, full_scale=full_scale, generator=gen)
    with torch.no_grad():  # stand-in for trained parameters, large enough to move many codes
        for p in q.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    state = q.to_state(bias=torch.ones(24))
    assert state.method == "lrq" and state.codes.dtype == torch.uint8
    assert (state.codes != rtn.codes).float().mean() > 0.1
    assert torch.equal(state.dequantize(), q())
    assert torch.equal(state.bias, torch.ones(24))


@pytest.mark.parametrize(("group_size", "full_scale"), [(0, False), (16, False), (16, True)])
def test_hand_written_backward_matches_autograd(group_size, full_scale):
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(24, 40, generator=gen)
    rtn = rtn_quantize(W, 3, group_size, clip_search=True)  # clipping: some codes sit on the clamp bounds
    q = LRQWeightQuantizer(W, rtn.scales, rtn.zeros, 3, rtn.group_size, rank=4, full_scale=full_scale, generator=gen)
    with torch.no_grad():
        for p in q.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    upstream = torch.randn(24, 40, generator=gen)
    (q() * upstream).sum().backward()
    got = {name: p.grad.clone() for name, p in q.named_parameters()}

    def reference():  # the quantizer written with plain autograd ops and a straight-through round
        idx = torch.arange(40) // rtn.group_size
        s1 = (q.scale_init * torch.exp(q.log_scale_delta))[:, idx]
        base = q.full if full_scale else q.left @ q.right
        v = W / (s1 * torch.exp(base + q.row_bias + q.col_bias))
        rounded = v + (torch.round(v) - v).detach()
        return s1 * (torch.clamp(rounded + rtn.zeros[:, idx], 0, 7) - rtn.zeros[:, idx])

    q.zero_grad()
    w_ref = reference()
    assert torch.equal(w_ref, q())
    (w_ref * upstream).sum().backward()
    for name, p in q.named_parameters():
        assert got[name].abs().sum() > 0, name
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_training_lowers_loss_and_folds_exactly():
    block = TinyBlock()
    x, y = tiny_data(block)
    before = copy.deepcopy(block.state_dict())
    config = LRQConfig(bits=2, iters=80, lr=1e-2, batch_size=2, rank=4)
    result = lrq_quantize_block(block, NAMES, x, y, call, config, return_outputs=True)

    assert result.loss_after < 0.8 * result.loss_before and not result.kept_rtn
    assert result.iters_done == 80 and len(result.losses) == 80
    assert result.ranks == {"mlp.up": 4, "mlp.down": 4}
    # the block is untouched: same modules, same weights
    assert isinstance(block.mlp["up"], nn.Linear)
    for key, value in block.state_dict().items():
        assert torch.equal(value, before[key]), key
    # the folded states give the block output the training reached
    quantized = with_states(block, result.states)
    torch.testing.assert_close(mse(quantized, x, y), result.loss_after, rtol=1e-5, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(result.outputs, quantized(x))
    up = result.states["mlp.up"]
    assert (up.bits, up.group_size, up.method) == (2, 16, "lrq")
    assert torch.equal(up.bias, block.mlp["up"].bias.detach())
    assert result.states["mlp.down"].bias is None


def test_diverging_training_keeps_rtn_start():
    block = TinyBlock()
    x, y = tiny_data(block)
    rtn = lrq_quantize_block(block, NAMES, x, y, call, LRQConfig(bits=3, iters=0), return_outputs=True)
    result = lrq_quantize_block(block, NAMES, x, y, call, LRQConfig(bits=3, iters=20, lr=1.0), return_outputs=True)
    assert result.kept_rtn and result.iters_done == 20
    assert max(result.losses) > result.loss_before  # the training really went astray
    assert result.loss_after == result.loss_before == rtn.loss_before
    for name in NAMES:
        assert torch.equal(result.states[name].codes, rtn.states[name].codes)
    assert torch.equal(result.outputs, rtn.outputs)


def test_iters_zero_is_rtn():
    block = TinyBlock()
    x, y = tiny_data(block)
    config = LRQConfig(bits=3, group_size=8, iters=0, clip_search=True)
    result = lrq_quantize_block(block, NAMES, x, y, call, config)
    for name in NAMES:
        rtn = rtn_quantize(block.get_submodule(name).weight.detach(), 3, 8, clip_search=True)
        assert torch.equal(result.states[name].codes, rtn.codes)
        assert torch.equal(result.states[name].dequantize(), rtn.dequantize())
    assert result.loss_after == result.loss_before
    torch.testing.assert_close(mse(with_states(block, result.states), x, y), result.loss_before, rtol=1e-5, atol=0)


def test_full_scale_and_low_rank_both_train():
    block = TinyBlock()
    x, y = tiny_data(block)
    results = {}
    for full_scale in (False, True):
        config = LRQConfig(bits=2, iters=40, lr=1e-2, full_scale=full_scale)
        results[full_scale] = lrq_quantize_block(block, NAMES, x, y, call, config)
        assert results[full_scale].loss_after < results[full_scale].loss_before
    assert results[False].loss_before == results[True].loss_before  # same RTN start
    assert results[True].ranks == {"mlp.up": 0, "mlp.down": 0}
    assert results[False].ranks == {"mlp.up": auto_rank(40, 16), "mlp.down": auto_rank(16, 40)}
    assert results[True].states["mlp.up"].extra["full_scale"] is True


def test_same_seed_same_result():
    block = TinyBlock()
    x, y = tiny_data(block)
    config = LRQConfig(bits=2, iters=10, lr=1e-2, seed=3)
    a = lrq_quantize_block(block, NAMES, x, y, call, config)
    b = lrq_quantize_block(block, NAMES, x, y, call, config)
    assert a.losses == b.losses
    for name in NAMES:
        assert torch.equal(a.states[name].codes, b.states[name].codes)


def test_should_stop_ends_training_early():
    block = TinyBlock()
    x, y = tiny_data(block)
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 5

    result = lrq_quantize_block(block, NAMES, x, y, call, LRQConfig(bits=2, iters=50), should_stop=stop)
    assert result.iters_done == 5 and len(result.losses) == 5
    torch.testing.assert_close(mse(with_states(block, result.states), x, y), result.loss_after, rtol=1e-5, atol=0)


def test_bf16_block_trains_in_float32_and_stays_bf16():
    block = TinyBlock().to(torch.bfloat16)
    x, y = tiny_data(TinyBlock())
    result = lrq_quantize_block(block, NAMES, x.bfloat16(), y.bfloat16(), call, LRQConfig(bits=2, iters=30, lr=1e-2),
                                return_outputs=True)
    assert block.mlp["up"].weight.dtype == torch.bfloat16
    assert result.outputs.dtype == torch.bfloat16 and result.outputs.shape == x.shape
    assert result.states["mlp.up"].scales.dtype == torch.float32
    assert result.loss_after < result.loss_before


def test_per_token_activation_quantization():
    block = TinyBlock()
    x, y = tiny_data(block)
    weight_only = lrq_quantize_block(block, NAMES, x, y, call, LRQConfig(bits=4, iters=0))
    w4a4 = lrq_quantize_block(block, NAMES, x, y, call, LRQConfig(bits=4, iters=30, lr=1e-2, act_bits=4))
    state = w4a4.states["mlp.down"]
    assert (state.act_bits, state.act_granularity, state.act_scale) == (4, "token", None)
    assert w4a4.loss_before > weight_only.loss_before  # 4-bit activations add error on top of RTN weights
    assert w4a4.loss_after < w4a4.loss_before
    torch.testing.assert_close(mse(with_states(block, w4a4.states), x, y), w4a4.loss_after, rtol=1e-5, atol=0)


def test_asymmetric_per_token_activations_fit_skewed_inputs_better():
    """The down projection's input is a GELU output (skewed): a zero point per token halves its grid step."""
    block = TinyBlock()
    x, y = tiny_data(block)
    sym = lrq_quantize_block(block, NAMES, x, y, call, LRQConfig(bits=4, iters=0, act_bits=4))
    asym = lrq_quantize_block(block, NAMES, x, y, call, LRQConfig(bits=4, iters=30, lr=1e-2, act_bits=4,
                                                                   act_granularity="token_asym"))
    state = asym.states["mlp.down"]
    assert (state.act_bits, state.act_granularity, state.act_scale) == (4, "token_asym", None)
    assert asym.loss_before < 0.8 * sym.loss_before
    assert asym.loss_after < asym.loss_before
    torch.testing.assert_close(mse(with_states(block, asym.states), x, y), asym.loss_after, rtol=1e-5, atol=0)


def test_per_tensor_static_scales_calibrated_or_given():
    block = TinyBlock()
    x, y = tiny_data(block)
    config = LRQConfig(bits=4, iters=20, lr=1e-2, act_bits=8, act_granularity="tensor")
    result = lrq_quantize_block(block, NAMES, x, y, call, config)
    # calibration: absmax of each linear's input in the full-precision block
    up_input = block.norm(x).detach()
    down_input = F.gelu(block.mlp["up"](up_input)).detach()
    torch.testing.assert_close(result.states["mlp.up"].act_scale, calibrate_act_scale([up_input], 8))
    torch.testing.assert_close(result.states["mlp.down"].act_scale, calibrate_act_scale([down_input], 8))
    assert result.states["mlp.up"].act_granularity == "tensor"
    torch.testing.assert_close(mse(with_states(block, result.states), x, y), result.loss_after, rtol=1e-5, atol=0)

    given = {"mlp.up": torch.tensor(0.02), "mlp.down": torch.tensor(0.01)}
    fixed = lrq_quantize_block(block, NAMES, x, y, call, config, act_scales=given)
    for name in NAMES:
        assert torch.equal(fixed.states[name].act_scale, given[name])
    assert fixed.loss_before > result.loss_before  # coarse given scales clip the activations


def test_llama_decoder_layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    rotary = LlamaRotaryEmbedding(cfg)

    def forward(block, h):
        positions = torch.arange(h.shape[1]).unsqueeze(0)
        return block(h, position_embeddings=rotary(h, positions), use_cache=False)

    x = torch.randn(6, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = forward(layer, x)
    names = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    assert len(names) == 7
    result = lrq_quantize_block(layer, names, x, y, forward, LRQConfig(bits=2, iters=40, lr=1e-2))
    assert result.loss_after < 0.9 * result.loss_before
    quantized = with_states(layer, result.states)
    with torch.no_grad():
        loss = float(F.mse_loss(forward(quantized, x), y))
    torch.testing.assert_close(loss, result.loss_after, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"bits": 1}, "bits must be in 2..8, got 1"),
        ({"rank": -1}, "rank must be in 0..8192"),
        ({"lr": 0.0}, r"lr must be in \(0.0, 1.0\]"),
        ({"act_bits": 6}, "act_bits must be 4, 8 or 16"),
        ({"act_granularity": "channel"}, "act_granularity must be 'token' .*'token_asym' .*or 'tensor'"),
        ({"full_scale": 1}, "full_scale must be true or false"),
    ],
)
def test_config_validation(settings, match):
    with pytest.raises(ValueError, match=match):
        LRQConfig(**settings)


def test_bad_arguments_raise_clear_errors():
    block = TinyBlock()
    x, y = tiny_data(block)
    config = LRQConfig(iters=1)
    with pytest.raises(ValueError, match=r"'mlp\.gate' is not an nn.Linear of the block.*\['mlp\.up', 'mlp\.down'\]"):
        lrq_quantize_block(block, ["mlp.up", "mlp.gate"], x, y, call, config)
    with pytest.raises(ValueError, match="'norm' is not an nn.Linear"):
        lrq_quantize_block(block, ["norm"], x, y, call, config)
    with pytest.raises(ValueError, match="non-empty list"):
        lrq_quantize_block(block, [], x, y, call, config)
    with pytest.raises(ValueError, match="must not repeat"):
        lrq_quantize_block(block, ["mlp.up", "mlp.up"], x, y, call, config)
    with pytest.raises(ValueError, match=r"inputs \(8, 6, 16\) and targets \(8, 5, 16\) must have the same shape"):
        lrq_quantize_block(block, NAMES, x, y[:, :5], call, config)
    with pytest.raises(ValueError, match=r"inputs must have shape \[samples, seq, hidden\]"):
        lrq_quantize_block(block, NAMES, x[0], y[0], call, config)
    with pytest.raises(TypeError, match="config must be an LRQConfig"):
        lrq_quantize_block(block, NAMES, x, y, call, {"bits": 4})
    with pytest.raises(ValueError, match="forward.* must return hidden states of shape"):
        lrq_quantize_block(block, NAMES, x, y, lambda b, h: (b(h),), config)
    with pytest.raises(ValueError, match="act_scales only apply to static per-tensor"):
        lrq_quantize_block(block, NAMES, x, y, call, config, act_scales={"mlp.up": torch.tensor(1.0)})
    static = LRQConfig(iters=1, act_bits=8, act_granularity="tensor")
    with pytest.raises(ValueError, match=r"act_scales lacks a scale for \['mlp\.down'\]"):
        lrq_quantize_block(block, NAMES, x, y, call, static, act_scales={"mlp.up": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=r"act_scales\['mlp\.down'\] must be a positive"):
        lrq_quantize_block(block, NAMES, x, y, call, static,
                           act_scales={"mlp.up": torch.tensor(1.0), "mlp.down": torch.tensor(-1.0)})
