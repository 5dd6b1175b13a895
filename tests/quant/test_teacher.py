import pytest
import torch

from vptq_core.quant.teacher import bucket_kl, teacher_topk


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))


def test_bucket_kl_is_the_full_kl_when_k_covers_the_vocabulary():
    gen = torch.Generator().manual_seed(0)
    t, s = torch.randn(5, 40, generator=gen), torch.randn(5, 40, generator=gen)
    p, q = torch.log_softmax(t, -1), torch.log_softmax(s, -1)
    full = float((p.exp() * (p - q)).sum())
    top, index = p.topk(40, -1)
    rest = torch.full((5,), float("-inf"))
    assert float(bucket_kl(s, top, index, rest)) == pytest.approx(full, rel=1e-5)
    # with k < V the bucket KL is a lower bound (data processing) and positive
    top, index = p.topk(8, -1)
    rest = p.scatter(-1, index, float("-inf")).logsumexp(-1)
    assert 0 < float(bucket_kl(s, top, index, rest)) <= full + 1e-6


def _bucket_kl_by_autograd(logits, t_logp, t_index, t_rest):  # the plain formulation, differentiated by autograd
    lse = logits.logsumexp(-1)
    q_top = logits.gather(-1, t_index) - lse[:, None]
    q_rest = logits.scatter(-1, t_index, float("-inf")).logsumexp(-1) - lse
    p_rest = t_rest.exp()
    kl_top = (t_logp.exp() * (t_logp - q_top)).sum(-1)
    return (kl_top + torch.where(p_rest > 0, p_rest * (t_rest - q_rest), torch.zeros_like(p_rest))).sum()


@pytest.mark.parametrize("k,spread", [(8, 1.0), (64, 1.0), (8, 12.0), (300, 1.0)])
def test_bucket_kl_value_and_gradient_match_the_autograd_formulation(k, spread):
    """The hand-written gradient of bucket_kl against autograd through logsumexp; spread 12: peaked teachers and
    students (the rest bucket holds ~1e-30 of the mass), k 300 of 300: no rest at all."""
    gen = torch.Generator().manual_seed(k)
    vocab = 300
    t = torch.randn(7, vocab, generator=gen, dtype=torch.float64) * spread
    p = torch.log_softmax(t, -1)
    top, index = p.topk(k, -1)
    rest = p.scatter(-1, index, float("-inf")).logsumexp(-1) if k < vocab else torch.full((7,), float("-inf"),
                                                                                             dtype=torch.float64)
    s = (torch.randn(7, vocab, generator=gen, dtype=torch.float64) * spread + t).requires_grad_()
    want = _bucket_kl_by_autograd(s, top, index, rest)
    (want_grad,) = torch.autograd.grad(want, s)
    s32 = s.detach().float().requires_grad_()
    got = bucket_kl(s32 * 1.0, top.float(), index, rest.float())
    got.backward(torch.tensor(2.0))
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s32.grad.double(), 2 * want_grad, rtol=1e-4, atol=1e-6)
    assert torch.isfinite(s32.grad).all()


def test_teacher_topk_shapes_and_mass(tiny_model, windows):
    model, _ = tiny_model
    t = teacher_topk(model, windows[:2], 16, torch.device("cpu"))
    assert t["logp"].shape == t["index"].shape == (2, 63, 16) and t["rest"].shape == (2, 63)
    total = torch.logaddexp(t["logp"].logsumexp(-1), t["rest"])
    torch.testing.assert_close(total, torch.zeros_like(total), atol=1e-5, rtol=0)



def test_the_top_k_is_taken_a_few_positions_at_a_time_with_the_same_values(monkeypatch):
    from vptq_core.quant import teacher

    logits = torch.randn(2, 7, 50, dtype=torch.bfloat16)
    whole = teacher.topk_of(logits, 5, "cpu")
    monkeypatch.setattr(teacher, "TOPK_CHUNK_BYTES", 3 * 4 * 50)  # 3 positions at a time, the last one short
    chunked = teacher.topk_of(logits, 5, "cpu")
    logp = torch.log_softmax(logits.float(), -1)
    top, index = logp.topk(5, -1)
    assert chunked["logp"].shape == (2, 7, 5) and chunked["rest"].shape == (2, 7)
    for got in (whole, chunked):
        assert torch.equal(got["logp"], top) and torch.equal(got["index"], index)
        assert torch.equal(got["rest"], logp.scatter(-1, index, float("-inf")).logsumexp(-1))


def _bf16_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def test_a_bf16_original_on_a_cpu_without_bf16_products_multiplies_in_float32(monkeypatch):
    from vptq_core.quant import device

    model = _bf16_llama()
    head = model.lm_head
    x = torch.randn(3, 5, 32).to(torch.bfloat16)
    monkeypatch.setattr(device, "WIDEN_CHUNK", 7 * 32)  # the head in row chunks of 7 (300 rows: 43 chunks)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not device.native_bf16("cpu")
    with device.widened_linears(model):
        assert "forward" in vars(head)  # widened (bf16 products on AMX round like these, so the values alone agree)
        out = head(x)
        q = model.model.layers[0].self_attn.q_proj
        with_bias = q(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.nn.functional.linear(x.float(), head.weight.float()).to(torch.bfloat16))
    torch.testing.assert_close(with_bias, torch.nn.functional.linear(x.float(), q.weight.float(),
                                                                    q.bias.float()).to(torch.bfloat16))
    assert "forward" not in vars(head) and "forward" not in vars(q)  # the layers' own forward again after
    # the teacher's top-k of the widened pass: the float32 model's, to bf16 rounding of the activations
    windows = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    widened = teacher_topk(model, windows, 8, torch.device("cpu"))
    reference = teacher_topk(model.float(), windows, 8, torch.device("cpu"))
    torch.testing.assert_close(widened["logp"], reference["logp"], atol=0.1, rtol=0.05)


@pytest.mark.parametrize("isa, native", [("", True), ("ALL", True), ("AVX512_CORE_AMX", True), ("AVX2", False),
                                         ("avx512_core", False)])
def test_bf16_counts_as_native_only_where_onednn_may_use_it(monkeypatch, isa, native):
    from vptq_core.quant import device

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert device.native_bf16("cpu") is native
    model = _bf16_llama()
    with device.widened_linears(model):
        assert ("forward" in vars(model.lm_head)) is not native
