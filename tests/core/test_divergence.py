"""The per-token divergence: its numbers against an independent computation and against ``evaluate``, the
llama.cpp-style statistics, its bounds, the self-contained HTML and the ``diff`` command."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from factories import random_scalar_state

from vptq_core.cli import main
from vptq_core.divergence import Divergence, TokenRow, compute_divergence, divergence_chunks, token_pieces
from vptq_core.divergence_html import divergence_document, kl_color
from vptq_core.eval import evaluate
from vptq_core.models import TINY, load_model
from vptq_core.quant.blocks import block_linears, decoder_blocks
from vptq_core.quant.config import ScalarConfig
from vptq_core.quant.pipeline import quantize_model
from vptq_core.storage.checkpoint import save_quantized

TOKEN = re.compile(r'class="vq-t(?: vq-\w+)*"')  # a compared token's span
TEXT = "The quick brown fox jumps over the lazy dog; naïve café, 日本. <b>&amp;</b>\n\tThe end."


@pytest.fixture(scope="module")
def pair(calib_ids):
    """(original, quantized at 2 bits, tokenizer): the tiny model and its RTN copy."""
    model, tok = load_model(TINY)
    qmodel, _ = quantize_model(model, calib_ids, "rtn", ScalarConfig(bits=2, group_size=0))
    return model, qmodel, tok


def _logp(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.log_softmax(model(ids[None], use_cache=False).logits[0, :-1].float(), dim=-1)


def test_per_token_kl_equals_an_independent_computation_and_evaluate(pair):
    model, qmodel, tok = pair
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"])
    result = compute_divergence(model, qmodel, tok, text=TEXT, bos=False)
    assert [r.index for r in result.rows] == list(range(ids.numel()))
    assert [r.token_id for r in result.rows] == ids.tolist()
    assert not result.rows[0].predicted and all(r.predicted for r in result.rows[1:])
    logp_o, logp_q = _logp(model, ids), _logp(qmodel, ids)
    reference = F.kl_div(logp_q, logp_o, log_target=True, reduction="none").sum(-1)
    kl = torch.tensor([r.kl for r in result.rows[1:]])
    torch.testing.assert_close(kl, reference, rtol=1e-5, atol=1e-7)
    assert float(reference.min()) > 0  # 2-bit weights: every position departs
    ev = evaluate(qmodel, tok, windows=ids[None], reference=model)
    for name in ("kl_divergence", "kl_median", "kl_p90", "kl_p99", "kl_max", "delta_p_mean", "delta_p_p01",
                 "delta_p_p99", "top1_agreement"):
        assert result.summary[name] == pytest.approx(getattr(ev, name), rel=1e-6, abs=1e-9), name
    assert result.summary["tokens"] == ev.tokens == ids.numel() - 1
    assert result.summary["perplexity_quantized"] == pytest.approx(ev.perplexity, rel=1e-5)
    assert result.summary["perplexity_original"] == pytest.approx(ev.reference_perplexity, rel=1e-5)
    differs = (logp_o.argmax(-1) != logp_q.argmax(-1)).tolist()
    assert [r.top1_differs for r in result.rows[1:]] == differs


def test_top5_and_the_actual_tokens_probability(pair):
    model, qmodel, tok = pair
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"])
    rows = compute_divergence(model, qmodel, tok, ids=ids, bos=False).rows[1:]
    for side, logp in (("original", _logp(model, ids)), ("quantized", _logp(qmodel, ids))):
        top = logp.exp().topk(5, dim=-1)
        got_ids = torch.tensor([[e[0] for e in getattr(r, f"top_{side}")] for r in rows])
        got_p = torch.tensor([[e[2] for e in getattr(r, f"top_{side}")] for r in rows])
        assert torch.equal(got_ids, top.indices)
        torch.testing.assert_close(got_p, top.values, rtol=1e-5, atol=1e-7)
        actual = logp.exp().gather(-1, ids[1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([getattr(r, f"p_{side}") for r in rows]), actual)
    p_o, p_q = _logp(model, ids).exp(), _logp(qmodel, ids).exp()  # Δp: p_quantized - p_original of the
    top = p_o.argmax(-1, keepdim=True)  # original's top token
    expected = p_q.gather(-1, top)[:, 0] - p_o.gather(-1, top)[:, 0]
    torch.testing.assert_close(torch.tensor([r.delta_p for r in rows]), expected, rtol=1e-5, atol=1e-7)


def test_eval_statistics_are_the_quantiles_of_the_per_token_values(pair, text_file):
    model, qmodel, tok = pair
    ev = evaluate(qmodel, tok, text=text_file, seqlen=32, max_windows=3, reference=model)
    ids = tok(open(text_file, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
    every = torch.tensor(ids[: len(ids) // 32 * 32]).view(-1, 32)
    n = every.shape[0]
    kl, dp, agree = [], [], []
    for window in every[[int((i + 0.5) * n / 3) for i in range(3)]]:  # spread over the whole text
        logp_o, logp_q = _logp(model, window), _logp(qmodel, window)
        kl.append((logp_o.exp() * (logp_o - logp_q)).sum(-1))
        top = logp_o.argmax(-1, keepdim=True)
        dp.append(logp_q.gather(-1, top).exp()[:, 0] - logp_o.gather(-1, top).exp()[:, 0])
        agree.append(logp_o.argmax(-1) == logp_q.argmax(-1))
    kl, dp, agree = torch.cat(kl).double().numpy(), torch.cat(dp).double().numpy(), torch.cat(agree).numpy()
    assert kl.size == ev.tokens == 3 * 31
    expected = {"kl_divergence": kl.mean(), "kl_median": np.median(kl), "kl_p90": np.quantile(kl, 0.9),
                "kl_p99": np.quantile(kl, 0.99), "kl_max": kl.max(), "delta_p_mean": dp.mean(),
                "delta_p_p01": np.quantile(dp, 0.01), "delta_p_p99": np.quantile(dp, 0.99),
                "top1_agreement": agree.mean()}
    for name, value in expected.items():
        assert getattr(ev, name) == pytest.approx(float(value), rel=1e-4, abs=1e-7), name
    assert ev.kl_median <= ev.kl_p90 <= ev.kl_p99 <= ev.kl_max and ev.delta_p_p01 <= ev.delta_p_p99
    assert set(expected) <= set(ev.to_dict())
    plain = evaluate(qmodel, tok, text=text_file, seqlen=32, max_windows=1)
    assert plain.kl_p99 is None and plain.delta_p_mean is None  # no reference, no statistics


def test_windows_cover_every_token_once_and_start_from_bos_like_eval(pair):
    model, qmodel, tok = pair
    ids = torch.tensor(tok(TEXT * 2, add_special_tokens=False)["input_ids"])
    chunks = list(divergence_chunks(model, qmodel, tok, ids=ids, window=40, bos=False))
    assert len(chunks) == -(-(ids.numel() - 1) // 39) and [c.done for c in chunks][-1] == ids.numel()
    rows = [r for c in chunks for r in c.rows]
    assert [r.index for r in rows] == list(range(ids.numel()))
    assert chunks[-1].summary["tokens"] == ids.numel() - 1
    # With BOS every text token is predicted, each window starting from BOS, as evaluate's windows do.
    bos = int(tok.bos_token_id)
    short = ids[:30]
    rows = compute_divergence(model, qmodel, tok, ids=short, bos=True).rows
    assert all(r.predicted for r in rows) and len(rows) == 30
    ev = evaluate(qmodel, tok, windows=torch.cat([torch.tensor([bos]), short])[None], reference=model)
    assert sum(r.kl for r in rows) / 30 == pytest.approx(ev.kl_divergence, rel=1e-6)


def test_bounds_max_tokens_stop_and_time_limit(pair):
    model, qmodel, tok = pair
    long = TEXT * 8
    n = len(tok(long, add_special_tokens=False)["input_ids"])
    cut = compute_divergence(model, qmodel, tok, text=long, max_tokens=25, bos=False)
    assert len(cut.rows) == 25 and cut.total == 25 and cut.text_tokens == n
    assert cut.summary["tokens"] == 24 and cut.coverage_note() == f"the first 25 of {n} tokens (the token limit)"
    calls = []
    stop_after_one = lambda: calls.append(1) or len(calls) > 1  # noqa: E731
    chunks = list(divergence_chunks(model, qmodel, tok, text=long, window=20, should_stop=stop_after_one, bos=False))
    assert len(chunks) == 2 and len(chunks[0].rows) == 20 and chunks[1].rows == [] and chunks[1].stopped == "stopped"
    assert Divergence().add(chunks[0]).add(chunks[1]).coverage_note() == f"stopped after 20 of {n} tokens: stopped"
    timed = list(divergence_chunks(model, qmodel, tok, text=long, time_limit_s=0.0, bos=False))
    assert timed[-1].stopped == "time limit (0 s)" and not any(c.rows for c in timed[:-1])
    for bad, message in ((dict(text=""), "the text is empty"), (dict(text="x", ids=[1, 2]), "either a text"),
                         (dict(ids=[5]), "at least 2 are needed"), (dict(text=long, max_tokens=1), "max tokens")):
        with pytest.raises(ValueError, match=message):
            next(divergence_chunks(model, qmodel, tok, **bad))


def test_token_pieces_rebuild_the_text(pair):
    _, _, tok = pair
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    pieces = token_pieces(tok, ids)
    assert "".join(pieces) == TEXT and "" in pieces  # the bytes before a character's last are ""
    assert pieces[pieces.index("é") - 1] == ""


def _row(i: int, text: str, kl: float, differs: bool = False) -> TokenRow:
    return TokenRow(index=i, token_id=i, text=text, predicted=True, kl=kl, delta_p=-0.1, top1_differs=differs,
                    p_original=0.5, p_quantized=0.25, top_original=[(i, text, 0.5), (99, '"q" & <i>', 0.2)],
                    top_quantized=[(7, "</span><script>x()</script>", 0.3), (i, text, 0.25)])


def test_html_is_self_contained_and_escapes_every_token():
    rows = [TokenRow(index=0, token_id=0, text="Start", predicted=False),
            _row(1, "<script>alert('x')</script>", 0.5, differs=True), _row(2, " & \"quoted\"\n", 0.0001),
            _row(3, "\tok", 5.0)]
    summary = {"tokens": 3, "kl_divergence": 1.8, "kl_median": 0.5, "kl_p90": 4.1, "kl_p99": 4.9, "kl_max": 5.0,
               "delta_p_mean": -0.1, "delta_p_p01": -0.1, "delta_p_p99": -0.1, "top1_agreement": 2 / 3,
               "perplexity_original": 3.0, "perplexity_quantized": 4.0}
    page = divergence_document(Divergence(rows=rows, summary=summary, done=4, total=4, text_tokens=4),
                               title="<run> & co")
    assert page.startswith("<!DOCTYPE html>") and page.count("<script") == 1  # the placing script only
    assert "<script>alert" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "&lt;/span&gt;&lt;script&gt;x()&lt;/script&gt;" in page and "&lt;run&gt; &amp; co" in page
    assert "&amp; &quot;quoted&quot;" in page and "&quot;q&quot;␣&amp;␣&lt;i&gt;" in page
    for forbidden in ("http://", "https://", "<link", "@import", "url(", "<iframe", "<img"):
        assert forbidden not in page, forbidden
    assert not re.search(r"""(src|href)\s*=""", page)
    assert TOKEN.findall(page) == ['class="vq-t vq-x"', 'class="vq-t"', 'class="vq-t"']  # token 1's top-1 differs
    assert "3 tokens · KL mean 1.8000, median 0.5000, p99 4.9000" in page and "same top-1 66.7%" in page
    assert kl_color(0.0001) is None and 'data-kl="0.0001">' in page  # below the scale: uncoloured
    assert kl_color(5.0) == ("#8c2d04", "#ffffff") and kl_color(0.5) == ("#ec7014", "#ffffff")
    assert kl_color(0.005)[1] == "#1f2328"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A packed checkpoint of the tiny model (random 4-bit states) that records its source model."""
    model, tok = load_model(TINY)
    linears = {f"model.layers.{b}.{name}": m for b, block in enumerate(decoder_blocks(model))
               for name, m in block_linears(block).items()}
    states = {name: random_scalar_state(m.in_features, m.out_features, bits=4, group_size=32, seed=i)
              for i, (name, m) in enumerate(linears.items())}
    return save_quantized(model, tok, states, tmp_path_factory.mktemp("tiny") / "ckpt",
                          report={"model": {"source": TINY}, "method": "rtn"})


@pytest.mark.parametrize("args, message", [
    (["--text", "/no/such.txt"], "--text '/no/such.txt': no such file"),
    (["--text", "{text}", "--prompt", "hi"], "argument --prompt: not allowed with argument --text"),
    ([], "one of the arguments --text --prompt is required"),
    (["--prompt", "   "], "--prompt is empty"),
    (["--prompt", "hi", "--max-tokens", "0"], "expected a positive integer, got 0"),
])
def test_diff_bad_input_exits_2_with_one_line(args, message, text_file, tmp_path, capsys):
    args = [a.replace("{text}", text_file) for a in args]
    try:
        rc = main(["diff", "--model", TINY, "--original", TINY, "--out", str(tmp_path / "d.html"), *args])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err


def test_diff_writes_the_html_of_a_run_against_its_recorded_original(checkpoint, tmp_path, capsys):
    out = tmp_path / "diff.html"
    assert main(["diff", "--model", str(checkpoint), "--prompt", TEXT, "--out", str(out), "--max-tokens", "40"]) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"39 tokens · KL mean [\d.]+, .*same top-1 [\d.]+% .*\(the first 40 of \d+ tokens \(the "
                        rf"token limit\)\) -> {re.escape(str(out))}", line), line
    page = out.read_text(encoding="utf-8")
    assert len(TOKEN.findall(page)) == 39 and "vs its original tiny-random-llama" in page
    assert main(["eval", "--model", str(checkpoint), "--text", str(out), "--seqlen", "64", "--max-windows", "2"]) == 0
    assert "KL per token: median" in capsys.readouterr().out
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe caf\xe9")
    assert main(["diff", "--model", str(checkpoint), "--text", str(tmp_path / "bad.txt"), "--out", str(out)]) == 2
    assert "is not valid UTF-8" in capsys.readouterr().err
