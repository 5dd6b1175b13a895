import pytest
import torch

from vptq_core.data import adds_bos, calibration_windows, eval_windows, wants_bos


class _Tok:
    """A character tokenizer that, like Gemma's, says it adds a BOS token."""

    bos_token_id = 2

    def __init__(self, add_bos: bool) -> None:
        self.add_bos_token = add_bos

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [3 + (ord(c) % 200) for c in text]}


def test_windows_start_with_bos_when_the_tokenizer_adds_one():
    plain, gemma = _Tok(False), _Tok(True)
    assert not wants_bos(plain) and wants_bos(gemma) and wants_bos(plain, True)
    a = eval_windows(plain, "wiki", 16, 4)
    b = eval_windows(gemma, "wiki", 16, 4)
    assert a.shape == b.shape == (4, 16)
    assert (b[:, 0] == 2).all() and (a[:, 0] != 2).any()
    # the same text, cut into windows of 15 tokens after the BOS token
    torch.testing.assert_close(b[:, 1:].reshape(-1), eval_windows(plain, "wiki", 15, 4).reshape(-1))
    c = calibration_windows(gemma, "wiki", 3, 16, seed=0)
    assert c.shape == (3, 16) and (c[:, 0] == 2).all()
    assert torch.equal(calibration_windows(plain, "wiki", 3, 16, seed=0, bos="auto"),
                       calibration_windows(plain, "wiki", 3, 16, seed=0, bos=False))
    with pytest.raises(ValueError, match="bos must be True, False or 'auto'"):
        eval_windows(plain, "wiki", 16, 4, bos="yes")


class _GgufTok(_Tok):
    """Like Gemma's tokenizer read from a GGUF file: ``add_bos_token`` False, yet encoding with special tokens
    puts the BOS token in front."""

    def __init__(self) -> None:
        super().__init__(False)

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": [self.bos_token_id, *ids] if add_special_tokens else ids}


def test_a_tokenizer_that_adds_bos_without_saying_so_gets_bos_windows():
    tok = _GgufTok()
    assert adds_bos(tok) and wants_bos(tok) and not wants_bos(tok, False)
    assert not adds_bos(_Tok(False))
    w = eval_windows(tok, "wiki", 16, 4)
    assert (w[:, 0] == 2).all()
    torch.testing.assert_close(w, eval_windows(_Tok(True), "wiki", 16, 4))


def test_written_windows_start_after_the_bos_token_where_windows_start_with_it():
    from types import SimpleNamespace

    from vptq_core.quant.sampling import start_tokens

    model = SimpleNamespace(config=SimpleNamespace(bos_token_id=2))
    with_bos = torch.tensor([[2, 7, 8, 9], [2, 5, 6, 7]])
    assert torch.equal(start_tokens(model, with_bos), with_bos[:, :2])
    text = torch.tensor([[2, 7, 8, 9], [4, 5, 6, 7]])  # not every window starts with BOS: the first token
    assert torch.equal(start_tokens(model, text), text[:, :1])
    assert torch.equal(start_tokens(SimpleNamespace(config=SimpleNamespace(bos_token_id=None)), with_bos),
                       with_bos[:, :1])
