import copy

import pytest
import torch

from vptq_core.studio.chat import ChatSession, check_sampling, model_memory_bytes


def test_greedy_stream_matches_generate_and_keeps_history(tiny_model):
    model, tok = tiny_model
    session = ChatSession(model, tok)
    text = "".join(session.stream("hello", max_new_tokens=12))
    ids = session.prompt_ids([{"role": "user", "content": "hello"}])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    assert text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert session.history == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": text}]
    assert session.last_stats.tokens == ref.shape[1] - ids.shape[1] and session.last_stats.tokens_per_second > 0
    second = session.prompt_ids(session.history + [{"role": "user", "content": "again"}])
    assert second.shape[1] > ids.shape[1]


def test_memory_counts_tied_weights_once(tiny_model):
    model, _ = tiny_model
    expected = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert model_memory_bytes(model) == expected
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert model_memory_bytes(untied) - expected == model.lm_head.weight.numel() * 4


def test_bad_sampling_settings(tiny_model):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer in 1..4096, got 0"):
        check_sampling(0, 0.5, 0.9)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        check_sampling(10, 0.5, 1.5)
    model, tok = tiny_model
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        next(ChatSession(model, tok).stream("  "))
