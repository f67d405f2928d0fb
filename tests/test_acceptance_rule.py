"""The longest-prefix acceptance rule on hand-made drafts and target choices."""

from __future__ import annotations

import torch

from dflash.speculative.acceptance import accepted_prefix_length


def t(*values: int) -> torch.Tensor:
    return torch.tensor(values)


def test_full_match_accepts_every_draft() -> None:
    assert accepted_prefix_length(t(5, 6, 7), t(5, 6, 7, 8)) == 3


def test_early_mismatch_stops_at_the_first_difference() -> None:
    assert accepted_prefix_length(t(5, 9, 7), t(5, 6, 7, 8)) == 1


def test_first_token_mismatch_accepts_nothing() -> None:
    assert accepted_prefix_length(t(9, 6, 7), t(5, 6, 7, 8)) == 0


def test_later_matches_after_a_mismatch_do_not_count() -> None:
    assert accepted_prefix_length(t(5, 0, 7, 8), t(5, 6, 7, 8, 1)) == 1


def test_from_hand_made_logits() -> None:
    vocab = 10
    target_logits = torch.full((4, vocab), -5.0)
    for row, token in enumerate([3, 4, 2, 9]):
        target_logits[row, token] = 5.0
    choices = target_logits.argmax(-1)
    assert accepted_prefix_length(t(3, 4, 1), choices) == 2  # bonus is choices[2] == 2
    assert int(choices[2]) == 2
