"""The student's memory: the large frozen tensors stay in their stored dtype and compute as float32 ones; the LM
head's chunks are bounded in bytes."""

import copy
import dataclasses

import pytest
import torch

from vptq_core.quant import student
from vptq_core.quant.config import VPTQConfig
from vptq_core.quant.distill import distill
from vptq_core.quant.pipeline import quantize_model

TINY = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=3, outlier_percent=0.0)


def test_a_stored_dtype_head_computes_as_a_float32_one_forward_and_backward(monkeypatch):
    monkeypatch.setattr(student, "HEAD_ROWS", 7)  # several slices of rows, the last one short
    head = torch.nn.Linear(16, 30, bias=True).to(torch.bfloat16).requires_grad_(False)
    ref = copy.deepcopy(head).float()
    x = torch.randn(5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    wrapped = student.StoredHead(head)
    out = wrapped(x)
    assert out.dtype == torch.float32 and (wrapped.in_features, wrapped.out_features) == (16, 30)
    torch.testing.assert_close(out, ref(x_ref), rtol=1e-6, atol=1e-6)
    g = torch.randn(5, 30)
    out.backward(g)
    ref(x_ref).backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast: the head as it is
        assert torch.equal(wrapped(x), head(x))


def test_a_stored_dtype_embedding_gives_the_float32_lookup_and_scaling():
    class Scaled(torch.nn.Embedding):  # as Gemma's: the scale applied in the weight's dtype
        def forward(self, ids):
            return super().forward(ids) * torch.tensor(7.3).to(self.weight.dtype)

    emb = Scaled(50, 8, padding_idx=40).to(torch.bfloat16)
    ref = copy.deepcopy(emb).float()
    ids = torch.tensor([[3, 9, 3, 41], [0, 49, 9, 9]])
    wrapped = student.StoredEmbedding(emb)
    assert torch.equal(wrapped(ids), ref(ids))  # exactly: bf16 -> float32 is exact, the scaling in float32
    assert wrapped.weight is emb.weight


def test_the_head_chunk_is_bounded_in_bytes():
    assert student.head_chunk(49152) * 49152 * 4 <= student.HEAD_CHUNK_BYTES
    assert student.head_chunk(151936) < student.head_chunk(49152) <= student.HEAD_CHUNK
    assert student.head_chunk(256) == student.HEAD_CHUNK and student.head_chunk(1 << 40) == 1


@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_distilling_a_bf16_model_in_its_stored_dtype_trains_as_the_float32_model(train_dtype):
    """The pipeline's distillation leaves the input embedding, the head and the fake-quant weights in bf16
    (``to_training_dtype``): the same held-out KL, training losses and codebooks as the whole model in float32."""
    from vptq_core.models import tiny_random_llama

    model, _ = tiny_random_llama()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)  # untied, distinct
    model = model.to(torch.bfloat16)
    windows = torch.randint(0, 256, (6, 48), generator=torch.Generator().manual_seed(4))
    cfg = dataclasses.replace(TINY, distill_iters=3, distill_lr=0.17, distill_holdout=0.25, distill_topk=32,
                              train_dtype=train_dtype)
    runs = []
    for whole_float32 in (True, False):
        qmodel, result = quantize_model(model, windows, "vptq", TINY)
        if whole_float32:
            qmodel.to(torch.float32)
        else:
            student.to_training_dtype(qmodel, torch.device("cpu"), result.states)
            assert qmodel.lm_head.weight.dtype == torch.bfloat16
            assert qmodel.model.embed_tokens.weight.dtype == torch.bfloat16
            assert all(qmodel.get_submodule(n).weight.dtype == torch.bfloat16 for n in result.states)
            assert qmodel.model.norm.weight.dtype == torch.float32
        metrics = distill(qmodel, model, result.states, windows, cfg)
        assert qmodel.lm_head.weight.dtype == (torch.float32 if whole_float32 else torch.bfloat16)
        runs.append((metrics, {n: st.centroids.clone() for n, st in result.states.items()},
                     qmodel.model.norm.weight.detach().float().clone()))
    (full, full_cb, full_norm), (ours, ours_cb, ours_norm) = runs
    assert ours["kl_before"] == pytest.approx(full["kl_before"], rel=1e-5)
    assert ours["kl_after"] == pytest.approx(full["kl_after"], rel=1e-4)
    assert ours["train_kl_last"] == pytest.approx(full["train_kl_last"], rel=1e-4)
    for name, centroids in full_cb.items():
        torch.testing.assert_close(ours_cb[name], centroids, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_norm, full_norm, rtol=1e-5, atol=1e-6)
