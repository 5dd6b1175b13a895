import pytest
import torch

from vptq_core.data import calibration_windows, eval_windows, wants_bos


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
