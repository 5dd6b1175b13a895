"""Quantized LM head and input embedding (an option): quantize -> save -> load gives the fake-quantized model's
logits, for tied (llama, gemma3 with its scaled embedding) and untied (qwen2) weights, VQ and scalar; the
head's Hessian comes from its own inputs; the checkpoint shrinks; bad entries fail with one line."""

from __future__ import annotations

import json

import pytest
import torch

from vptq_core.models import tiny_random_model
from vptq_core.quant import methods
from vptq_core.quant.config import ScalarConfig, VPTQConfig
from vptq_core.quant.embedding import TIED, EmbeddingParts, apply_fake, head_hessian, quantize_embeddings
from vptq_core.quant.pipeline import quantize_model
from vptq_core.storage.checkpoint import load_quantized, save_quantized
from vptq_core.storage.embedding import QuantizedEmbedding
from vptq_core.storage.modules import ScalarQLinear, VQLinear

CALIB = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
TINY_VQ = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0)
TINY_RTN = ScalarConfig(bits=4, group_size=32)


def logits(model, ids=CALIB):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def head_inputs(model, ids=CALIB) -> torch.Tensor:
    seen = []
    handle = model.lm_head.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().float()))
    try:
        logits(model, ids)
    finally:
        handle.remove()
    return torch.cat(seen)


def quantize_all(family, method, config, parts, tmp_path):
    model, tok = tiny_random_model(family)
    fake, result = quantize_model(model, CALIB, method, config)
    emb = quantize_embeddings(fake, head_inputs(fake), methods.get(method), config, parts)
    apply_fake(fake, emb)
    states = dict(result.states)
    embedding = None
    for name, r in emb.results.items():
        if name == "lm_head":
            states[name] = r.state
        else:
            embedding = "lm_head" if r == TIED else r.state
    path = save_quantized(model, tok, states, tmp_path / "ckpt", dtype=torch.float32, embedding=embedding)
    return model, fake, emb, path


@pytest.mark.parametrize(("family", "method", "config"), [
    ("llama", "vptq", TINY_VQ), ("qwen2", "vptq", TINY_VQ), ("gemma3", "vptq", TINY_VQ), ("qwen2", "rtn", TINY_RTN),
])
def test_head_and_embedding_round_trip(family, method, config, tmp_path):
    model, fake, emb, path = quantize_all(family, method, config, EmbeddingParts(head=True, embedding=True), tmp_path)
    tied = family in ("llama", "gemma3")
    assert (emb.results["model.embed_tokens"] == TIED) == tied
    loaded, _ = load_quantized(path)
    kind = VQLinear if method == "vptq" else ScalarQLinear
    assert isinstance(loaded.lm_head, kind)
    embed = loaded.model.embed_tokens
    assert isinstance(embed, QuantizedEmbedding)
    assert (embed.linear is None) == tied and (embed.matrix is loaded.lm_head) == tied
    # the embedding rows are the quantized ones, not the original
    assert not torch.equal(embed.weight, model.model.embed_tokens.weight.float())
    torch.testing.assert_close(embed.weight, fake.model.embed_tokens.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits(loaded), logits(fake), rtol=1e-5, atol=1e-5)
    stored = json.loads((path / "config.json").read_text())
    assert stored["tie_word_embeddings"] is False
    assert stored["quantization_config"]["embedding"]["source"] == ("lm_head" if tied else "own")
    assert "lm_head" in stored["quantization_config"]["config_for_layers"]


def test_tied_head_alone_unties_and_keeps_the_embedding(tmp_path):
    model, fake, emb, path = quantize_all("llama", "vptq", TINY_VQ, EmbeddingParts(head=True), tmp_path)
    assert set(emb.results) == {"lm_head"}
    loaded, _ = load_quantized(path)
    assert isinstance(loaded.lm_head, VQLinear) and type(loaded.model.embed_tokens) is torch.nn.Embedding
    torch.testing.assert_close(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(logits(loaded), logits(fake), rtol=1e-5, atol=1e-5)


def test_quantized_head_shrinks_the_checkpoint_and_uses_its_hessian(tmp_path):
    model, tok = tiny_random_model("qwen2")
    fake, result = quantize_model(model, CALIB, "rtn", TINY_RTN)
    plain = save_quantized(model, tok, result.states, tmp_path / "plain", dtype=torch.bfloat16)
    x = head_inputs(fake)
    emb = quantize_embeddings(fake, x, methods.get("gptq"), ScalarConfig(bits=4, group_size=32),
                              EmbeddingParts(head=True, embedding=True))
    small = save_quantized(model, tok, {**result.states, "lm_head": emb.results["lm_head"].state},
                           tmp_path / "small", dtype=torch.bfloat16, embedding=emb.results["model.embed_tokens"].state)
    a, b = ((p / "model.safetensors").stat().st_size for p in (plain, small))
    vocab_rows = 2 * 259 * 64 * 2  # embedding + head in bf16
    assert a - b > 0.6 * vocab_rows  # 4-bit codes + scales replace 16-bit weights
    # GPTQ with the head's Hessian beats the same grid without it (identity) on the proxy loss of those inputs
    H = head_hessian(x, "cpu")
    W = fake.lm_head.weight  # unchanged until apply_fake
    blind = methods.get("gptq").quantize_linear(W.float(), torch.eye(64), ScalarConfig(bits=4, group_size=32), None, {})
    ours = emb.results["lm_head"]
    err = [torch.sum(((r.weight - W.float()) @ H) * (r.weight - W.float())).item() for r in (ours, blind)]
    assert err[0] < err[1]


def test_bad_embedding_entries(tmp_path):
    model, fake, emb, path = quantize_all("llama", "rtn", TINY_RTN, EmbeddingParts(embedding=True), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["embedding"]["source"] = "model.layers.9.mlp"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"embedding.source must be 'own' or a quantized layer's name, got "
                                         r"'model.layers.9.mlp'"):
        load_quantized(path)
    with pytest.raises(ValueError, match="quantizes whole blocks"):
        quantize_embeddings(fake, None, methods.get("lrq"), None, EmbeddingParts(head=True))
    with pytest.raises(ValueError, match="head must be True or False"):
        EmbeddingParts(head="yes")


def test_cli_quantizes_head_and_embedding_of_a_streamed_model(tmp_path, capsys):
    """The CLI path: a streamed untied model, --quantize-head --quantize-embedding; the checkpoint loads and
    its logits equal a model with the stored layers dequantized in place."""
    from vptq_core.cli import main

    model, tok = tiny_random_model("qwen2")
    model.save_pretrained(str(tmp_path / "qwen2"))
    tok.save_pretrained(str(tmp_path / "qwen2"))
    text = tmp_path / "calib.txt"
    text.write_text("Plain words for a small calibration text, repeated. " * 40, encoding="utf-8")
    rc = main(["quantize", "--model", str(tmp_path / "qwen2"), "--method", "gptq", "--bits", "4", "--group-size",
               "32", "--calib-text", str(text), "--calib-samples", "4", "--seqlen", "32", "--quiet", "--out",
               str(tmp_path / "out"), "--quantize-head", "--quantize-embedding"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["streaming"] == "on" and summary["embeddings"]["embedding_source"] == "own"
    assert 0 < summary["embeddings"]["lm_head"]["rel_proxy_loss"] < 0.05
    loaded, _ = load_quantized(tmp_path / "out", dtype=torch.float32)
    assert isinstance(loaded.lm_head, ScalarQLinear) and isinstance(loaded.model.embed_tokens, QuantizedEmbedding)
    dense, _ = tiny_random_model("qwen2")
    for name, module in loaded.named_modules():
        if isinstance(module, ScalarQLinear) and not name.startswith("model.embed_tokens"):
            dense.get_submodule(name).weight.data = module.dequantize().float()
    dense.model.embed_tokens.weight.data = loaded.model.embed_tokens.weight.float()
    for name, tensor in loaded.state_dict().items():  # norms and biases as stored (bf16)
        if name in dense.state_dict() and tensor.is_floating_point():
            dense.state_dict()[name].copy_(tensor)
    torch.testing.assert_close(logits(loaded), logits(dense), rtol=1e-4, atol=1e-4)
