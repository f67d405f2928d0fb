"""The selector's training objective for DFlash2 drafters, and the acceptance its greedy chain would reach.

At every mask slot of a training block (slot k >= 1 predicts x_{a+k}) the candidates are the top-k tokens of the
drafter's own logits U, as at inference. Given the TRUE predecessor p = x_{a+k-1} (teacher forcing; x_a, the
anchor, for slot 1) each candidate b scores

    S(p, b) = U(b) + < A[p] * H(h), B[b] >

and the loss is the cross-entropy over the K candidates toward x_{a+k}, on the slots whose label is one of the
candidates (the others have nothing to select), with the block loss's position weights exp(-(k-1)/gamma).

Why teacher forcing is the right predecessor: a greedy walk's pick at slot k only matters for acceptance while every
earlier pick was right, and then its predecessor is exactly the true token. For the same reason the leading run of
slots where argmax_K S(true predecessor, .) is the label IS the greedy walk's accepted run: the selector's
acceptance estimate comes from the loss's own scores, with no walk.

U is detached here: the block loss alone trains the drafter's logits over the whole vocabulary (they also rank
DDTree's children and choose the candidates), and the selector learns only the correction the pairwise term adds.
Without the detach, a cross-entropy restricted to K candidates would also push the unary logits, a second, narrower
objective on the same numbers. The drafter's hidden h is not detached: the trunk may learn features the pairwise
term reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.drafter.selector import CandidateSelector
from dflash.training.objective import BlockBatch, leading_run_acceptance


@dataclass(frozen=True, eq=False)
class SelectorTerms:
    scores: torch.Tensor  # [batch, blocks*B, K] float32: S(true predecessor, candidate) per block slot
    target_index: torch.Tensor  # [batch, blocks*B] int64: the label's index among the candidates, -1 if absent


def selector_terms(
    selector: CandidateSelector,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    blocks: BlockBatch,
) -> SelectorTerms:
    """hidden: final-normed drafter rows [batch, blocks*B, hidden]; logits: their drafter logits [batch, blocks*B,
    vocab]; input_ids: the sequences [batch, seq] the blocks were cut from -> the teacher-forced selector scores."""
    seq = input_ids.shape[1]
    k = min(selector.top_k, logits.shape[-1])
    unary, candidates = torch.topk(logits.detach().float(), k, dim=-1)  # [batch, rows, K] each
    previous = torch.gather(input_ids, 1, (blocks.block_positions - 1).clamp(min=0, max=seq - 1))  # [batch, rows]
    projected = selector.hidden_projection(hidden).float()  # [batch, rows, rank]
    conditioned = selector.predecessor_codebook[previous].float() * projected  # [batch, rows, rank]
    successors = selector.successor_codebook[candidates].float()  # [batch, rows, K, rank]
    pairwise = (successors @ conditioned[..., None]).squeeze(-1)  # [batch, rows, K]
    hit = candidates == blocks.labels[..., None]  # [batch, rows, K]; labels of untrained slots are -100
    target_index = torch.where(hit.any(-1), hit.long().argmax(-1), torch.full_like(blocks.labels, -1))
    return SelectorTerms(unary + pairwise, target_index)


def selector_loss(terms: SelectorTerms, blocks: BlockBatch) -> torch.Tensor:
    """Weighted mean cross-entropy over the candidates, on the trained slots whose label is a candidate (0-dim)."""
    log_q = torch.log_softmax(terms.scores, dim=-1)  # [batch, rows, K]
    picked = log_q.gather(-1, terms.target_index.clamp(min=0)[..., None]).squeeze(-1)  # [batch, rows]
    weights = blocks.weights * (terms.target_index >= 0)
    return -(picked * weights).sum() / weights.sum().clamp(min=1e-6)


def selector_acceptance_estimate(terms: SelectorTerms, blocks: BlockBatch, block_size: int) -> torch.Tensor:
    """0-dim tensor: 1 + mean accepted run of the selector's greedy chain per real block (teacher-forced scores give
    the walk's run exactly, see the module docstring); argmax ties go to the first candidate, as in the walk."""
    with torch.no_grad():
        correct = (terms.scores.argmax(-1) == terms.target_index) & (terms.target_index >= 0)  # [batch, rows]
        return leading_run_acceptance(correct, blocks, block_size)
