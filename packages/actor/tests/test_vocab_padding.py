"""Vocabulary padding arithmetic (the TP=2 parity test with an odd vocabulary is in test_context_parallel.py)."""

import pytest
import torch
from tidal.actor.vocab_padding import pad_vocab_rows, padded_vocab_size


@pytest.mark.parametrize(
    ("vocab", "tp", "padded"),
    [(128, 1, 128), (131, 1, 131), (152064, 2, 152064), (131, 2, 256), (32001, 4, 32256), (11, 2, 256)],
)
def test_padded_vocab_size(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded
    assert padded % tp == 0 and padded >= vocab


def test_pad_vocab_rows_appends_zero_rows():
    t = torch.randn(3, 4)
    padded = pad_vocab_rows(t, 8)
    assert padded.shape == (8, 4) and torch.equal(padded[:3], t) and not padded[3:].any()
    assert pad_vocab_rows(t, 3) is t
    with pytest.raises(ValueError, match="cannot pad a vocabulary of 3 rows down to 2"):
        pad_vocab_rows(t, 2)
