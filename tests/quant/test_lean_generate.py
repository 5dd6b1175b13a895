"""model.generate on models the project loads runs the lean token loop, with transformers' own results."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from vptq_core import generation
from vptq_core.models import load_model
from vptq_core.quant import lean_decoder, lean_generate


@pytest.fixture(scope="module")
def pair(tiny_model):
    """(model whose generate is the lean one, the same weights with transformers' generate, prompt)."""
    reference = copy.deepcopy(tiny_model[0] if isinstance(tiny_model, tuple) else tiny_model).eval()
    reference.generation_config.eos_token_id = None  # random weights: every run goes to full length
    lean = lean_generate.enable(copy.deepcopy(reference))
    prompt = torch.randint(3, reference.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    return lean, reference, prompt


@pytest.fixture
def steps(monkeypatch):
    """How many lean decoder steps ran during the test."""
    count = {"n": 0}
    original = lean_decoder.LeanDecoder.step

    def counted(self, tokens):  # noqa: ANN001
        count["n"] += 1
        return original(self, tokens)

    monkeypatch.setattr(lean_decoder.LeanDecoder, "step", counted)
    return count


def test_enable_sets_an_instance_generate_only(pair):
    lean, reference, _ = pair
    assert lean_generate.enabled(lean) and not lean_generate.enabled(reference)
    assert lean_generate.enable(lean).generate is lean.generate  # twice is harmless
    assert type(lean) is type(reference)  # the class (and what save_pretrained records) is unchanged


def test_greedy_equals_transformers(pair, steps):
    lean, reference, prompt = pair
    kw = dict(input_ids=prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(lean.generate(**kw), reference.generate(**kw))
    assert steps["n"] == 11  # the prompt's forward, then one step per token but the last
    assert torch.equal(lean.generate(prompt, max_new_tokens=5), reference.generate(prompt, max_new_tokens=5))


@pytest.mark.parametrize("settings", [dict(temperature=1.3, top_k=50, top_p=0.9), dict(temperature=0.8),
                                      dict(top_k=5, repetition_penalty=1.3, min_new_tokens=4)])
def test_sampling_draws_the_same_tokens_as_transformers(pair, steps, settings):
    lean, reference, prompt = pair
    kw = dict(input_ids=prompt, max_new_tokens=10, do_sample=True, pad_token_id=0, **settings)
    for seed in range(6):
        torch.manual_seed(seed)
        ours = lean.generate(**kw)
        torch.manual_seed(seed)
        assert torch.equal(ours, reference.generate(**kw)), seed
    assert steps["n"] == 6 * 9


def test_sampled_token_frequencies_match(pair):
    """Beyond equal seeds: many draws of the first new tokens follow the same distribution (chi-square bound)."""
    lean, reference, prompt = pair
    kw = dict(input_ids=prompt, max_new_tokens=1, do_sample=True, temperature=2.0, pad_token_id=0)
    torch.manual_seed(0)
    ours = torch.cat([lean.generate(**kw)[:, -1] for _ in range(300)])
    torch.manual_seed(12345)
    theirs = torch.cat([reference.generate(**kw)[:, -1] for _ in range(300)])
    tokens = torch.unique(torch.cat([ours, theirs]))
    a = torch.stack([(ours == t).sum() for t in tokens]).float()
    b = torch.stack([(theirs == t).sum() for t in tokens]).float()
    keep = (a + b) >= 10  # pool the rare tokens into one bin
    a = torch.cat([a[keep], a[~keep].sum(0, keepdim=True)])
    b = torch.cat([b[keep], b[~keep].sum(0, keepdim=True)])
    used = (a + b) > 0
    chi2 = float((((a - b) ** 2) / (a + b))[used].sum())
    dof = int(used.sum()) - 1
    assert dof >= 3
    assert chi2 < dof + 5 * (2 * dof) ** 0.5  # far beyond the 99.9th percentile of chi-square(dof)


def test_streamer_and_stopping_criteria_see_what_transformers_shows(pair):
    lean, reference, prompt = pair

    def run(model):  # noqa: ANN001, ANN202
        pieces: list = []

        class Streamer:
            def put(self, value):  # noqa: ANN001
                pieces.append(value.reshape(-1).tolist())

            def end(self):
                pieces.append("end")

        class StopAfter(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):  # noqa: ANN001
                return torch.full((input_ids.shape[0],), input_ids.shape[1] - prompt.shape[1] >= 4)

        out = model.generate(input_ids=prompt, max_new_tokens=10, streamer=Streamer(), do_sample=False,
                             stopping_criteria=StoppingCriteriaList([StopAfter()]), pad_token_id=0)
        return out.tolist(), pieces

    ours, theirs = run(lean), run(reference)
    assert ours == theirs and len(ours[0][0]) == prompt.shape[1] + 4 and theirs[1][-1] == "end"


def test_end_of_sequence_stops_like_transformers(pair):
    lean, reference, prompt = pair
    full = reference.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    eos = int(full[0, prompt.shape[1] + 3])
    kw = dict(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=eos)
    assert torch.equal(lean.generate(**kw), reference.generate(**kw))


@pytest.mark.parametrize("settings", [dict(num_beams=2), dict(output_scores=True, return_dict_in_generate=True),
                                      dict(num_beams=2, do_sample=True)])
def test_other_settings_run_transformers_loop(pair, steps, settings):
    lean, reference, prompt = pair
    kw = dict(input_ids=prompt, max_new_tokens=4, pad_token_id=0, **settings)
    torch.manual_seed(0)
    ours = lean.generate(**kw)
    torch.manual_seed(0)
    theirs = reference.generate(**kw)
    if isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs)
    else:
        assert torch.equal(ours.sequences, theirs.sequences)
        assert all(torch.equal(x, y) for x, y in zip(ours.scores, theirs.scores, strict=True))
    assert steps["n"] == 0


def test_a_padded_batch_runs_transformers_loop(pair, steps):
    lean, reference, prompt = pair
    ids = torch.cat([prompt, prompt.roll(1, 1)])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(lean.generate(**kw), reference.generate(**kw))
    one = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    one["attention_mask"][0, 0] = 0  # a left-padded single prompt: transformers' loop
    assert torch.equal(lean.generate(**one, pad_token_id=0), reference.generate(**one, pad_token_id=0))
    assert steps["n"] == 0


def test_the_chat_helper_and_the_loaders_share_the_path(pair, steps):
    _, reference, prompt = pair
    kw = dict(input_ids=prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(generation.generate(reference, **kw), reference.generate(**kw))  # not enabled: still lean
    assert steps["n"] == 4
    model, _ = load_model("tiny-random-llama")
    assert lean_generate.enabled(model)


def test_stop_strings_with_a_tokenizer_run_transformers_loop(pair, steps):
    from vptq_core.models import byte_tokenizer

    lean, reference, prompt = pair
    tok = byte_tokenizer()
    kw = dict(input_ids=prompt % 200 + 3, max_new_tokens=6, do_sample=False, pad_token_id=0, stop_strings=["e"],
              tokenizer=tok)
    assert torch.equal(lean.generate(**kw), reference.generate(**kw))
    assert steps["n"] == 0
