import math

import pytest
import torch
import torch.nn.functional as F

from vptq_core.eval import evaluate
from vptq_core.quant.config import ScalarConfig
from vptq_core.quant.pipeline import quantize_model


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    return str(path)


def test_perplexity_matches_manual_nll(tiny_model, text_file):
    model, tok = tiny_model
    res = evaluate(model, tok, text=text_file, seqlen=64, max_windows=3)
    ids = tok(open(text_file).read(), add_special_tokens=False)["input_ids"]
    every = torch.tensor(ids[: len(ids) // 64 * 64]).view(-1, 64)
    n = every.shape[0]
    windows = every[[int((i + 0.5) * n / 3) for i in range(3)]]  # three windows spread over the whole text
    with torch.no_grad():
        logits = model(windows, use_cache=False).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert res.perplexity == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert (res.windows, res.tokens, res.seqlen) == (3, 3 * 63, 64)
    assert "seqlen=64, windows=3" in res.protocol()
    given = evaluate(model, tok, windows=windows)  # explicit token windows give the same number
    assert given.perplexity == pytest.approx(res.perplexity, rel=1e-6) and given.tokens == 3 * 63
    assert evaluate(model, tok, windows=windows, max_windows=1).windows == 1


def test_kl_and_agreement_against_reference(tiny_model, text_file, calib_ids):
    model, tok = tiny_model
    same = evaluate(model, tok, text=text_file, seqlen=64, max_windows=2, reference=model)
    assert same.kl_divergence == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    qmodel, _ = quantize_model(model, calib_ids, "rtn", ScalarConfig(bits=2, group_size=0))
    q = evaluate(qmodel, tok, text=text_file, seqlen=64, max_windows=2, reference=model)
    assert q.kl_divergence > 1e-4 and q.top1_agreement < 1.0
    assert q.reference_perplexity == pytest.approx(same.perplexity, rel=1e-5)


def test_bad_eval_arguments(tiny_model, text_file):
    model, tok = tiny_model
    with pytest.raises(ValueError, match="seqlen must be >= 2"):
        evaluate(model, tok, text=text_file, seqlen=1)
    with pytest.raises(ValueError, match="fewer than one window"):
        evaluate(model, tok, text=text_file, seqlen=100000)
    with pytest.raises(ValueError, match=r"windows must be token ids \[n, seqlen >= 2\]"):
        evaluate(model, tok, windows=torch.tensor([1, 2, 3]))
