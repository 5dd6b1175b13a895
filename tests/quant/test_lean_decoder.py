"""vptq_core.quant.lean_decoder: the lean llama-family forward gives the model's own logits (fp32 to rounding, bf16 to
bf16 rounding), with the native decoder operations and with their torch fallback, for dense and quantized
linears; unsupported models are named and fall back."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from vptq_core import generation
from vptq_core.kernels import VQSpec, native
from vptq_core.kernels.synthetic import random_vq_layer
from vptq_core.models import tiny_random_model
from vptq_core.quant.blocks import block_linears, decoder_blocks
from vptq_core.quant.lean_decoder import LeanDecoder, _TorchOps, unsupported_reason
from vptq_core.storage.modules import VQLinear, set_submodule

native_ok = native.status(wait=None)[0]
OPS = ["torch", pytest.param("native", marks=pytest.mark.skipif(not native_ok, reason="native kernels unavailable"))]


def _model(family: str, dtype: torch.dtype, **kw):  # noqa: ANN202
    model, _ = tiny_random_model(family, seed=1, **kw)
    return model.to(dtype).eval()


def _steps(model, dec: LeanDecoder, n: int = 13, steps: int = 5):  # noqa: ANN001, ANN202
    """(lean logits, reference logits) at the prefill and after each of ``steps`` greedy tokens."""
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(2))
    out = []
    with torch.inference_mode():
        kv = DynamicCache(config=model.config)
        ref = model(input_ids=ids, past_key_values=kv, use_cache=True).logits[:, -1]
        out.append((dec.prefill(ids), ref))
        for _ in range(steps):
            token = ref.argmax(-1, keepdim=True)
            ref = model(input_ids=token, past_key_values=kv, use_cache=True).logits[:, -1]
            out.append((dec.step(token), ref))
    return out


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fp32_logits_equal_the_models_forward(family, ops):
    model = _model(family, torch.float32)
    dec = LeanDecoder(model, 16, ops=ops)  # the tiny mistral's sliding window is 16 tokens
    assert dec.ops_name == ops
    for lean, ref in _steps(model, dec, n=10):
        torch.testing.assert_close(lean, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ops", OPS)
def test_bf16_logits_match_to_bf16_rounding(ops):
    model = _model("llama", torch.bfloat16, hidden=128, intermediate=256)
    dec = LeanDecoder(model, 20, ops=ops)
    for lean, ref in _steps(model, dec):
        assert lean.dtype == torch.bfloat16
        err = (lean.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err < 2e-2, float(err)


@pytest.mark.skipif(not native_ok, reason="native kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_ops_equal_torch_ops(dtype):
    ops = native.decoder_ops()
    gen = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(1, 3, 96, generator=gen).to(dtype) for _ in range(2))
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    (y,), (y_ref,) = ops.rms_norm(x, None, w, 1e-6), _TorchOps.rms_norm(x, None, w, 1e-6)
    torch.testing.assert_close(y, y_ref, rtol=2e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    h, y = ops.rms_norm(x, delta, w, 1e-6)
    h_ref, y_ref = _TorchOps.rms_norm(x, delta, w, 1e-6)
    torch.testing.assert_close(h, h_ref, **exact)  # the residual add rounds exactly as torch's
    torch.testing.assert_close(y, y_ref, rtol=2e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    g, u = torch.randn(2, 300, generator=gen).to(dtype) * 4, torch.randn(2, 300, generator=gen).to(dtype)
    torch.testing.assert_close(ops.silu_mul(g, u), _TorchOps.silu_mul(g, u),
                               rtol=3e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    # attention, 2 sequences: 2 KV heads x 3 query heads each, head_dim 16; 5 tokens, then 1 and 3 new tokens
    nh, kvh, hd, lmax = 6, 2, 16, 12
    batch = 2
    caches = {name: [torch.zeros(batch, kvh, lmax, hd, dtype=dtype) for _ in range(2)] for name in ("native", "torch")}
    cos, sin = torch.rand(lmax, hd, generator=gen).to(dtype), torch.rand(lmax, hd, generator=gen).to(dtype)
    pos = 0
    for t in (5, 1, 3):
        q = torch.randn(batch, t, nh * hd, generator=gen).to(dtype)
        k, v = (torch.randn(batch, t, kvh * hd, generator=gen).to(dtype) for _ in range(2))
        args = (q, k, v, cos[pos:pos + t], sin[pos:pos + t])
        out = ops.attend(*args, *caches["native"], pos, nh, 0.25)
        ref = _TorchOps.attend(*args, *caches["torch"], pos, nh, 0.25)
        torch.testing.assert_close(caches["native"][0], caches["torch"][0], **exact)  # rotated keys
        torch.testing.assert_close(caches["native"][1], caches["torch"][1], rtol=0, atol=0)  # values as given
        torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                   atol=1e-5 if dtype == torch.float32 else 2e-2)
        pos += t


@pytest.mark.parametrize("ops", OPS)
def test_quantized_linears_run_through_the_lean_decoder(ops):
    model = _model("llama", torch.bfloat16, hidden=64, intermediate=128)
    for b, block in enumerate(decoder_blocks(model)):
        for i, (name, linear) in enumerate(block_linears(block).items()):
            spec = VQSpec(linear.in_features, linear.out_features, 4, 64)
            w = random_vq_layer(spec, seed=b * 8 + i, dtype=torch.bfloat16)
            module = VQLinear.from_config(spec.layer_config(), dtype=torch.bfloat16)
            module.load_state_dict({"indices": w.indices, "centroids.weight": w.centroids})
            set_submodule(block, name, module)
    dec = LeanDecoder(model, 20, ops=ops)
    for lean, ref in _steps(model, dec):
        err = (lean.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err < 2e-2, float(err)


def test_unsupported_models_are_named_and_fall_back():
    gemma = _model("gemma3", torch.float32)
    assert "gemma3" in unsupported_reason(gemma)
    assert LeanDecoder.for_model(gemma, 8) is None
    with pytest.raises(ValueError, match="cannot run this model: model type 'gemma3_text' is not one of"):
        LeanDecoder(gemma, 8)
    prompt = torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="model type 'gemma3_text'"):
        generation.decode_loop(gemma, prompt, 3, cache="lean")
    gemma.generation_config.eos_token_id = None
    assert generation.decode_loop(gemma, prompt, 4) == generation.decode_loop(gemma, prompt, 4, cache="dynamic")

    mistral = _model("mistral", torch.float32)
    assert unsupported_reason(mistral, 16) == ""
    assert unsupported_reason(mistral, 17) == "sliding-window attention (16 tokens) over a longer sequence (17)"
    llama = _model("llama", torch.float32)
    handle = llama.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    try:
        assert unsupported_reason(llama) == "layer 1: a forward hook on LlamaMLP"
    finally:
        handle.remove()
    assert unsupported_reason(llama) == ""
    llama.train()
    assert unsupported_reason(llama) == "the model is in training mode"


def test_bad_input_and_a_full_cache():
    model = _model("llama", torch.float32)
    with pytest.raises(ValueError, match="ops must be 'auto', 'native' or 'torch', got 'gpu'"):
        LeanDecoder(model, 8, ops="gpu")
    dec = LeanDecoder(model, 4)
    with pytest.raises(ValueError, match=r"ids must be \[1, tokens\]"):
        dec.prefill(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="5 tokens do not fit the cache of 4"):
        dec.prefill(torch.zeros(1, 5, dtype=torch.long))
    dec.prefill(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="5 tokens do not fit the cache of 4"):
        dec.step(torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.parametrize("ops", OPS)
def test_a_batch_gives_each_rows_own_logits(ops):
    model = _model("llama", torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(4))
    dec = LeanDecoder(model, 12, ops=ops, batch=3)
    with torch.inference_mode():
        every = dec.prefill(ids, all_positions=True)
        nxt = dec.step(every[:, -1].argmax(-1, keepdim=True))
        for r in range(3):
            ref = model(input_ids=ids[r:r + 1]).logits
            torch.testing.assert_close(every[r:r + 1], ref, rtol=1e-5, atol=1e-5)
            step_ref = model(input_ids=torch.cat([ids[r:r + 1], ref[:, -1:].argmax(-1)], 1)).logits[:, -1]
            torch.testing.assert_close(nxt[r:r + 1], step_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"ids must be \[3, tokens\]"):
        dec.prefill(ids[:1])


@pytest.mark.parametrize("ops", OPS)
def test_params_replace_the_weights_like_functional_call(ops):
    model = _model("llama", torch.float32)  # tied embeddings: one override serves the LM head too
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        lean = LeanDecoder(model, 8, ops=ops, params=params).prefill(ids)
        ref = torch.func.functional_call(model, params, (), {"input_ids": ids}, tie_weights=True).logits[:, -1]
    assert lean.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    err = (lean.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < 2e-2, float(err)
