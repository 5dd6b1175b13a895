"""Degenerate windows: a window the original model wrote that is stuck repeating itself (a line, a phrase, one
token) teaches the quantized model nothing about the text it will see, and weighs heavily in the Hessians and the
block targets. ``sampling.sample_windows`` redraws such windows and ``sampling.sampled_calibration`` keeps the text
window for one that stays degenerate (docs/methods.md#self-written-calibration).

The measure is the share of a window's n-grams that already occurred earlier in it: running text repeats few of its
4-grams, a loop repeats nearly all. The limit is set well above what text windows and the original's ordinary
samples reach (``bench/sampling.py --repetition`` measures both).
"""

from __future__ import annotations

import torch

REPEAT_NGRAM = 4
# Above this share of repeated 4-grams a written window counts as degenerate: above every text window of the
# calib splits and every ordinary sample of the original measured (bench/sampling.py --repetition; the figures are
# in bench/results/sampling_dtype_spr.txt), far below a loop's share.
MAX_REPEATED_SHARE = 0.5


def repeated_share(window: torch.Tensor, n: int = REPEAT_NGRAM) -> float:
    """The share of the ``n``-grams of ``window`` (1-D token ids) that already occurred earlier in it: 0 when none
    repeats, near 1 for a window stuck in a loop; 0 for a window shorter than ``n`` + 1 tokens."""
    ids = [int(t) for t in torch.as_tensor(window).reshape(-1).tolist()]
    total = len(ids) - n + 1
    if total < 2:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(total):
        gram = tuple(ids[i : i + n])
        if gram in seen:
            repeats += 1
        else:
            seen.add(gram)
    return repeats / total


def degenerate(windows: torch.Tensor, limit: float = MAX_REPEATED_SHARE) -> torch.Tensor:
    """[n] bool: the rows of ``windows`` [n, seqlen] whose share of repeated n-grams exceeds ``limit``."""
    return torch.tensor([repeated_share(row) > limit for row in windows], dtype=torch.bool)
