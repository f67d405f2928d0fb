"""The anchor-block objective: block layout, visibility, slot weights, and the distillation term."""

from __future__ import annotations

import torch

from dflash.training.objective import (
    build_blocks,
    estimated_acceptance,
    sample_anchors,
    teacher_logits_for_blocks,
    weighted_block_loss,
)

MASK = 99


def _one_row_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(10, 22)[None]  # [1, 12]
    trained = torch.zeros((1, 12), dtype=torch.bool)
    trained[0, 4:] = True  # prompt 0..3, answer 4..11
    return ids, trained


def test_blocks_layout_labels_and_visibility() -> None:
    ids, trained = _one_row_batch()
    blocks = build_blocks(ids, trained, [torch.tensor([5, 8])], block_size=4, mask_token_id=MASK, gamma=2.0)
    assert blocks.block_ids.tolist() == [[15, MASK, MASK, MASK, 18, MASK, MASK, MASK]]
    assert blocks.block_positions.tolist() == [[5, 6, 7, 8, 8, 9, 10, 11]]
    assert blocks.labels.tolist() == [[-100, 16, 17, 18, -100, 19, 20, 21]]
    decay = torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 2.0)
    assert torch.allclose(blocks.weights[0, 1:4], decay) and blocks.weights[0, 0] == 0
    mask = blocks.mask[0, 0]  # [8, 12 + 8]
    assert mask[0, :12].tolist() == [True] * 5 + [False] * 7  # first block sees context strictly before 5
    assert mask[4, :12].tolist() == [True] * 8 + [False] * 4
    assert mask[0, 12:].tolist() == [True] * 4 + [False] * 4  # own block only
    assert mask[5, 12:].tolist() == [False] * 4 + [True] * 4


def test_anchors_stay_inside_the_answer() -> None:
    _, trained = _one_row_batch()
    anchors = sample_anchors(trained[0], 3, torch.Generator().manual_seed(0))
    assert anchors.numel() == 3 and bool((anchors >= 4).all()) and bool((anchors <= 10).all())
    assert anchors.tolist() == sorted(set(anchors.tolist()))


def test_teacher_rows_are_the_predictions_of_the_previous_position() -> None:
    ids, trained = _one_row_batch()
    blocks = build_blocks(ids, trained, [torch.tensor([5])], block_size=4, mask_token_id=MASK, gamma=2.0)
    target_logits = torch.arange(12, dtype=torch.float32)[None, :, None].expand(1, 12, 3)  # row p holds p
    teacher = teacher_logits_for_blocks(target_logits, blocks)
    assert teacher[0, :, 0].tolist() == [4.0, 5.0, 6.0, 7.0]  # slot k predicts x_{5+k}: the target's row 5+k-1


def test_distillation_term() -> None:
    ids, trained = _one_row_batch()
    blocks = build_blocks(ids, trained, [torch.tensor([5])], block_size=4, mask_token_id=MASK, gamma=2.0)
    vocab = 32
    teacher = torch.randn(1, 4, vocab, generator=torch.Generator().manual_seed(1))
    # the drafter equal to the teacher: pure distillation loss is zero, hard-label loss is not
    pure_kl, _ = weighted_block_loss(teacher.clone(), blocks, teacher, distill=1.0)
    hard, _ = weighted_block_loss(teacher.clone(), blocks)
    assert abs(pure_kl.item()) < 1e-5 and hard.item() > 0.1
    # a drafter far from the teacher pays for it, and the mix interpolates the two losses
    other = torch.randn(1, 4, vocab, generator=torch.Generator().manual_seed(2)) * 3
    kl, _ = weighted_block_loss(other, blocks, teacher, distill=1.0)
    ce, _ = weighted_block_loss(other, blocks)
    mixed, _ = weighted_block_loss(other, blocks, teacher, distill=0.25)
    assert kl.item() > 0.1
    assert abs(mixed.item() - (0.75 * ce.item() + 0.25 * kl.item())) < 1e-5


def test_estimated_acceptance_counts_the_leading_run() -> None:
    ids, trained = _one_row_batch()
    blocks = build_blocks(ids, trained, [torch.tensor([5])], block_size=4, mask_token_id=MASK, gamma=2.0)
    logits = torch.zeros(1, 4, 32)
    logits[0, 1, 16] = logits[0, 2, 0] = logits[0, 3, 18] = 1.0  # slot 1 right, slot 2 wrong, slot 3 right
    assert estimated_acceptance(logits, blocks, 4) == 2.0
