import pytest
import torch

from vptq_core.data import calibration_windows, eval_windows, load_text, wiki_articles
from vptq_core.models import byte_tokenizer


def test_wiki_split_never_overlaps():
    articles = wiki_articles()
    assert len(articles) > 80
    calib, ev = load_text("wiki", "calib"), load_text("wiki", "eval")
    assert articles[0] in calib and articles[0] not in ev
    assert articles[1] in ev and articles[1] not in calib
    assert "'''" not in calib and "[[" not in ev


def test_windows_shapes_and_seeding(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world. " * 200, encoding="utf-8")
    tok = byte_tokenizer()
    a = calibration_windows(tok, str(path), samples=5, seqlen=32, seed=1)
    b = calibration_windows(tok, str(path), samples=5, seqlen=32, seed=1)
    assert a.shape == (5, 32) and torch.equal(a, b)
    ev = eval_windows(tok, str(path), seqlen=100)
    assert ev.shape == (2600 // 100, 100)
    assert eval_windows(tok, str(path), seqlen=100, max_windows=3).shape == (3, 100)


def test_bad_text_sources(tmp_path):
    with pytest.raises(ValueError, match="must be one of wiki, pydocs or an existing UTF-8 text file"):
        load_text("nope.txt", "calib")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="is not valid UTF-8"):
        load_text(str(bad), "eval")
    short = tmp_path / "short.txt"
    short.write_text("tiny", encoding="utf-8")
    with pytest.raises(ValueError, match="fewer than seqlen"):
        calibration_windows(byte_tokenizer(), str(short), 2, 32)
    with pytest.raises(ValueError, match="split must be one of"):
        load_text("wiki", "train")


def test_pydocs_splits_by_topic_and_is_another_domain():
    from vptq_core.data import load_text, pydoc_topics

    topics = pydoc_topics()
    calib, held_out = load_text("pydocs", "calib"), load_text("pydocs", "eval")
    assert calib == "\n\n".join(topics[0::2]) and held_out == "\n\n".join(topics[1::2])
    assert not set(topics[0::2]) & set(topics[1::2])
    assert "def " in held_out or "class " in held_out  # code and technical prose, unlike the wiki text


def test_more_calibration_windows_start_with_the_fewer_ones():
    """Drawing n + k windows gives the n windows of a plain draw first (distillation's held-out windows are
    drawn on top of the calibration windows this way)."""
    tok = byte_tokenizer()
    few = calibration_windows(tok, "wiki", 32, 64, seed=3)
    more = calibration_windows(tok, "wiki", 36, 64, seed=3)
    assert torch.equal(more[:32], few) and not torch.equal(more[32:], few[:4])


@pytest.mark.parametrize("source", ["wiki", "pydocs"])
def test_calib_dev_and_test_share_no_document(source):
    from vptq_core.data import pydoc_topics, split_documents

    documents = wiki_articles() if source == "wiki" else pydoc_topics()
    parts = {split: set(split_documents(documents, split)) for split in ("calib", "dev", "test", "eval")}
    assert not parts["calib"] & parts["dev"] and not parts["calib"] & parts["test"] and not parts["dev"] & parts["test"]
    assert parts["dev"] | parts["test"] == parts["eval"]
    assert parts["calib"] | parts["eval"] == set(documents)
    assert min(len(parts["dev"]), len(parts["test"])) >= len(documents) // 4
    assert load_text(source, "dev") == "\n\n".join(split_documents(documents, "dev"))


def test_eval_windows_spread_over_the_whole_split(tmp_path):
    from vptq_core.data import spread_indices

    assert spread_indices(10, 3) == [1, 5, 8] and spread_indices(4, 9) == [0, 1, 2, 3]
    assert spread_indices(5, None) == list(range(5))
    path = tmp_path / "t.txt"
    path.write_text("".join(chr(ord("a") + i % 26) * 100 for i in range(20)), encoding="utf-8")
    tok = byte_tokenizer()
    every = eval_windows(tok, str(path), seqlen=100)
    four = eval_windows(tok, str(path), seqlen=100, max_windows=4)
    assert torch.equal(four, every[[2, 7, 12, 17]])  # not the first four: the last quarter of the text is in
    with pytest.raises(ValueError, match="held-out split"):
        eval_windows(tok, str(path), seqlen=100, split="calib")


def test_calibration_windows_never_overlap_when_the_text_holds_them():
    from vptq_core.data import window_starts

    for seed in range(5):
        starts = sorted(window_starts(10_000, 40, 128, seed))
        assert len(starts) == 40 and all(b - a >= 128 for a, b in zip(starts, starts[1:]))
        assert starts[0] >= 0 and starts[-1] + 128 <= 10_000
    assert window_starts(10_000, 40, 128, 1) != window_starts(10_000, 40, 128, 2)
    short = window_starts(300, 5, 128, 0)  # only 2 slots: overlapping offsets, all inside the text
    assert len(short) == 5 and all(0 <= s <= 300 - 128 for s in short)


def test_evaluate_names_its_split_and_dev_differs_from_test(tiny_model):
    from vptq_core.api import evaluate_model
    from vptq_core.eval import evaluate

    model, tok = tiny_model
    dev = evaluate(model, tok, text="wiki", seqlen=32, max_windows=3, split="dev")
    test = evaluate(model, tok, text="wiki", seqlen=32, max_windows=3)
    assert (dev.split, test.split) == ("dev", "test") and "test split" in test.protocol()
    assert dev.nll != test.nll
    given = evaluate(model, tok, windows=eval_windows(tok, "wiki", 32, 3))
    assert given.split is None and given.nll == test.nll
    with pytest.raises(ValueError, match="split must be one of test, dev, eval"):
        evaluate_model("tiny-random-llama", split="calib")


def test_the_evaluation_after_quantizing_names_its_split(tmp_path):
    import json

    from vptq_core.api import quantize_to_dir
    from vptq_core.quant.config import CalibConfig, ScalarConfig

    _, summary = quantize_to_dir("tiny-random-llama", "rtn", ScalarConfig(bits=4, group_size=16),
                                 CalibConfig(samples=2, seqlen=32), tmp_path / "q", device="cpu", evaluate_after=True)
    assert summary["eval"]["split"] == "test" and "(test split)" in summary["eval"]["protocol"]
    report = json.loads((tmp_path / "q" / "quant_report.json").read_text())
    assert report["eval"]["split"] == "test" and report["eval"]["protocol"] == summary["eval"]["protocol"]
