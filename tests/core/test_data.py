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
