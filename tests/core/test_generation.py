"""vptq_core.generation: the lean decode loop gives what model.generate gives, streams and stops the same way."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from vptq_core import generation


@pytest.fixture(scope="module")
def model_and_prompt(tiny_model):
    model = copy.deepcopy(tiny_model[0] if isinstance(tiny_model, tuple) else tiny_model).eval()
    model.generation_config.eos_token_id = None  # random weights: keep every run at full length
    prompt = torch.randint(3, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    return model, prompt


def _reference(model, prompt, n):  # noqa: ANN001
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                             do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("cache", ["auto", "lean", "dynamic", "static"])
def test_greedy_equals_generate(model_and_prompt, cache):
    model, prompt = model_and_prompt
    assert generation.decode_loop(model, prompt, 12, cache=cache) == _reference(model, prompt, 12)


def test_generate_streams_and_stops(model_and_prompt):
    model, prompt = model_and_prompt
    pieces: list[list[int]] = []

    class Streamer:
        def put(self, value):  # noqa: ANN001
            pieces.append(value.reshape(-1).tolist())

        def end(self):
            pieces.append(["end"])

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):  # noqa: ANN001
            return input_ids.shape[1] - prompt.shape[1] >= 3

    out = generation.generate(model, input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                              streamer=Streamer(), stopping_criteria=StoppingCriteriaList([StopAfter()]),
                              pad_token_id=0, do_sample=False, temperature=None, top_p=None, top_k=None)
    expected = _reference(model, prompt, 3)
    assert out[0, :prompt.shape[1]].tolist() == prompt[0].tolist() and out[0, prompt.shape[1]:].tolist() == expected
    assert pieces[0] == prompt[0].tolist()  # the prompt first, as generate() does (skip_prompt drops it)
    assert [p[0] for p in pieces[1:-1]] == expected and pieces[-1] == ["end"]


def test_stops_at_end_of_sequence(model_and_prompt):
    model, prompt = model_and_prompt
    full = _reference(model, prompt, 8)
    new = generation.decode_loop(model, prompt, 8, eos_ids=[full[4]])
    assert new == full[: full.index(full[4]) + 1]


def test_sampling_is_seeded_and_top_k_1_is_greedy(model_and_prompt):
    model, prompt = model_and_prompt
    torch.manual_seed(3)
    a = generation.decode_loop(model, prompt, 8, temperature=1.3, top_p=0.9)
    torch.manual_seed(3)
    b = generation.decode_loop(model, prompt, 8, temperature=1.3, top_p=0.9)
    assert a == b
    assert generation.decode_loop(model, prompt, 8, temperature=0.7, top_k=1) == _reference(model, prompt, 8)


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.manual_seed(0)
    drawn = {int(generation._sample(logits, 1.0, None, 0.75)) for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 + 0.3 >= 0.75: tokens 2 and 3 are cut


def test_other_settings_go_to_model_generate(model_and_prompt):
    model, prompt = model_and_prompt
    kwargs = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, num_beams=2,
                  do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(generation.generate(model, **kwargs), model.generate(**kwargs))


def test_bad_arguments(model_and_prompt):
    model, prompt = model_and_prompt
    with pytest.raises(ValueError, match=r"cache must be one of \['auto', 'lean', 'dynamic', 'static'\], got 'paged'"):
        generation.decode_loop(model, prompt, 2, cache="paged")
    with pytest.raises(ValueError, match=r"input_ids must be \[1, tokens\], got shape \(2, 11\)"):
        generation.decode_loop(model, prompt.repeat(2, 1), 2)


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_cpu_share_gives_a_thread_its_own_cores():
    import os
    import threading

    before_threads, before_cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    cpus = sorted(before_cpus)
    seen: dict = {}
    inside = threading.Barrier(2)

    def side(i: int) -> None:
        with generation.cpu_share(i, 2) as mine:
            inside.wait(timeout=30)  # both shares held at once
            seen[i] = (mine, torch.get_num_threads(), os.sched_getaffinity(0))
            inside.wait(timeout=30)

    threads = [threading.Thread(target=side, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    half = len(cpus) // 2
    assert seen[0] == (cpus[:half], half, set(cpus[:half]))
    assert seen[1] == (cpus[half:], len(cpus) - half, set(cpus[half:]))
    assert torch.get_num_threads() == before_threads and os.sched_getaffinity(0) == before_cpus
    late: list = []
    t = threading.Thread(target=lambda: late.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert late == [before_threads]  # the default for new threads is the process's again
    with pytest.raises(ValueError, match=r"share index must be in 0\.\.1, got 2"):
        with generation.cpu_share(2, 2):
            pass
