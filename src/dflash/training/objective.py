"""The anchor-block training objective of DFlash drafters.

For a sequence with target features at every position, sample anchors inside the assistant span. Each anchor
a builds a block [x_a, MASK x (B-1)] at positions a .. a+B-1 that sees context features strictly before a plus
its own block (both ways), never another block. Block slot k is trained to predict x_{a+k} (k >= 1) with
weight exp(-(k-1)/gamma): early slots decide acceptance, so they count most.

Optionally (`distill` > 0) each slot also learns the target's whole next-token distribution at that point
(forward KL to the target's softmax), mixed with the hard-label cross-entropy: soft labels carry more signal
per trained position, which matters when the target-answered data set is small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.host_copies import to_device


@dataclass
class BlockBatch:
    block_ids: torch.Tensor  # [batch, blocks*B] anchor token then MASK ids
    block_positions: torch.Tensor  # [batch, blocks*B]
    labels: torch.Tensor  # [batch, blocks*B] target token per slot, -100 where untrained (slot 0, padding)
    weights: torch.Tensor  # [batch, blocks*B] loss weight per slot (0 where untrained)
    mask: torch.Tensor  # [batch, 1, blocks*B, seq + blocks*B] bool, True = visible


def sample_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """loss_mask: [seq] bool (assistant tokens). Anchors are positions p with p and p+1 both trained.

    Returns up to `count` distinct sorted anchors [n] (on the mask's device: give a host mask to stay off the
    device's queue)."""
    valid = (loss_mask[:-1] & loss_mask[1:]).nonzero().squeeze(-1)
    if valid.numel() <= count:
        return valid
    pick = torch.randperm(valid.numel(), generator=generator, device="cpu")[:count].to(valid.device)
    return valid[pick].sort().values


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: list[torch.Tensor],
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> BlockBatch:
    """input_ids, loss_mask: [batch, seq]; anchors: per row a [n_row] tensor. Rows get `max n` blocks;
    missing blocks are padding (no loss, they see only themselves)."""
    batch, seq = input_ids.shape
    device = input_ids.device
    blocks = max(1, max(int(a.numel()) for a in anchors))
    slots = torch.arange(block_size, device=device)
    table = torch.full((batch, blocks), -1, dtype=torch.long)  # filled on the host, sent in one copy
    for row, a in enumerate(anchors):
        table[row, : a.numel()] = a.cpu()
    anchor_table = to_device(table, device)
    present = anchor_table >= 0  # [batch, blocks]
    start = anchor_table.clamp(min=0)
    positions = start[:, :, None] + slots  # [batch, blocks, B]
    target_pos = positions.clamp(max=seq - 1)
    labels = torch.gather(input_ids, 1, target_pos.view(batch, -1)).view(batch, blocks, block_size)
    trained = torch.gather(loss_mask, 1, target_pos.view(batch, -1)).view(batch, blocks, block_size)
    trained = trained & (positions < seq) & present[:, :, None] & (slots > 0)
    labels = torch.where(trained, labels, torch.full_like(labels, -100))
    decay = torch.exp(-(slots.float() - 1).clamp(min=0) / gamma)
    weights = trained.float() * decay
    block_ids = torch.full((batch, blocks, block_size), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, start)
    # visibility: context keys strictly before the anchor, plus every slot of the same block
    ctx_visible = torch.arange(seq, device=device)[None, None, :] < anchor_table[:, :, None]  # [batch, blocks, seq]
    ctx_visible = ctx_visible[:, :, None, :].expand(batch, blocks, block_size, seq)
    block_of = torch.arange(blocks, device=device).repeat_interleave(block_size)
    same_block = (block_of[:, None] == block_of[None, :])[None].expand(batch, -1, -1)
    mask = torch.cat((ctx_visible.reshape(batch, blocks * block_size, seq), same_block), dim=-1)[:, None]
    return BlockBatch(
        block_ids=block_ids.view(batch, -1),
        block_positions=positions.view(batch, -1),
        labels=labels.view(batch, -1),
        weights=weights.view(batch, -1),
        mask=mask,
    )


def teacher_logits_for_blocks(target_logits: torch.Tensor, batch: BlockBatch) -> torch.Tensor:
    """target_logits: [batch, seq, vocab] -> [batch, blocks*B, vocab]: for slot k of the block at anchor a (which
    predicts x_{a+k}), the target's logits at position a+k-1. Untrained slots get some in-range row (weight 0)."""
    seq, vocab = target_logits.shape[1], target_logits.shape[2]
    source = (batch.block_positions - 1).clamp(min=0, max=seq - 1)  # [batch, blocks*B]
    return torch.gather(target_logits, 1, source[..., None].expand(-1, -1, vocab))


def weighted_block_loss(
    logits: torch.Tensor, batch: BlockBatch, teacher_logits: torch.Tensor | None = None, distill: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logits, teacher_logits: [batch, blocks*B, vocab] -> (weighted mean loss, metrics).

    The loss per slot is (1 - distill) * cross-entropy to the label + distill * KL(target || drafter).
    Metrics (0-dim tensors, read when logged): `accuracy`, the share of trained slots whose argmax is the label."""
    flat_labels = batch.labels.view(-1)
    flat_logits = logits.float().view(-1, logits.shape[-1])
    per_slot = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="none")
    if distill > 0:
        if teacher_logits is None:
            raise ValueError("distillation needs the target's logits")
        log_drafter = F.log_softmax(flat_logits, dim=-1)
        log_teacher = F.log_softmax(teacher_logits.float().view(-1, teacher_logits.shape[-1]), dim=-1)
        kl = (log_teacher.exp() * (log_teacher - log_drafter)).sum(-1)
        per_slot = (1.0 - distill) * per_slot + distill * kl
    weights = batch.weights.view(-1)
    loss = (per_slot * weights).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        trained = flat_labels >= 0
        correct = (logits.argmax(-1).view(-1) == flat_labels) & trained
        accuracy = correct.sum() / trained.sum().clamp(min=1)
    return loss, {"accuracy": accuracy}


def acceptance_estimate(logits: torch.Tensor, batch: BlockBatch, block_size: int) -> torch.Tensor:
    """0-dim tensor: 1 + mean leading run of correct draft slots per real block (slots beyond the data count as
    wrong); computed on the device without reading anything back."""
    with torch.no_grad():
        return leading_run_acceptance(logits.argmax(-1) == batch.labels, batch, block_size)


def leading_run_acceptance(correct: torch.Tensor, batch: BlockBatch, block_size: int) -> torch.Tensor:
    """correct: [batch, blocks*B] bool, whether each slot's draft is its label -> 0-dim tensor: 1 + mean leading run
    of correct draft slots (slots 1..B-1; untrained slots count as wrong) per real block."""
    b = batch.labels.shape[0]
    labels = batch.labels.view(b, -1, block_size)[:, :, 1:]
    hits = correct.view(b, -1, block_size)[:, :, 1:] & (labels >= 0)
    run = hits.long().cumprod(-1).sum(-1)  # [batch, blocks]
    real = batch.labels.view(b, -1, block_size)[:, :, 1] >= 0
    return 1.0 + (run * real).sum() / real.sum().clamp(min=1)


def estimated_acceptance(logits: torch.Tensor, batch: BlockBatch, block_size: int) -> float:
    """`acceptance_estimate` as a number."""
    return float(acceptance_estimate(logits, batch, block_size).item())
