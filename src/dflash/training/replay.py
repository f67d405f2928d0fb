"""Fast, exact replay of greedy speculative decoding from one teacher-forced pass.

At temperature 0 the committed sequence is the target's greedy output, and the drafter's proposal in a round
starting at position s depends only on features of positions < s and on token x_s: exactly the anchor-block
of training anchored at s. So one target pass over (prompt + greedy answer) and one drafter pass with an
anchor at every answer position give every possible round; walking s -> s + a + 1 from the first answer
position reproduces the rounds linear DFlash would run, with their acceptance lengths. This makes evaluation
batched (seconds on a GPU) while `dflash bench acceptance` measures the real decoding loop.

DDTree replays the same way: the drafter's full distributions at each anchor give the tree a round would build,
and the greedy answer says which path the target would accept, so one pair of passes serves every budget.

A DFlash2 drafter's linear rounds draft its selector's greedy chain: while that chain is right its predecessors are
the answer's tokens, so the selector's scores with the answer's tokens as predecessors give every round's run
(`dflash.training.selector_objective`). Its trees (grown by the selector) are not replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.model import DFlashDrafter
from dflash.models.model import CausalLM
from dflash.speculative.tree import build_tree, follow_tree, linear_chain_tree
from dflash.training.objective import BlockBatch, build_blocks
from dflash.training.selector_objective import selector_terms


@dataclass
class ReplayResult:
    acceptance_lengths: list[int]  # per round, a + 1

    @property
    def mean(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0


@dataclass(frozen=True, eq=False)
class AnchorPass:
    """One drafter pass with a block anchored at every answer position but the last."""

    sequence: torch.Tensor  # [1, P+n] prompt + answer
    blocks: BlockBatch
    hidden: torch.Tensor  # [1, anchors*B, hidden] final-normed drafter rows
    logits: torch.Tensor  # [1, anchors*B, vocab]


@torch.no_grad()
def anchor_pass(target: CausalLM, drafter: DFlashDrafter, prompt: list[int], answer: list[int]) -> AnchorPass:
    config = drafter.config
    device = target.embed_tokens.weight.device
    seq = torch.tensor([prompt + answer], device=device)  # [1, P+n]
    trained = torch.zeros_like(seq, dtype=torch.bool)
    trained[0, len(prompt) :] = True
    features = target(seq, capture=config.target_layer_ids, logits="none").features
    assert features is not None
    anchors = [torch.arange(len(prompt), seq.shape[1] - 1, device=device)]
    blocks = build_blocks(seq, trained, anchors, block_size=config.block_size, mask_token_id=config.mask_token_id,
                          gamma=1.0)
    hidden = drafter.forward_blocks(target.embed(blocks.block_ids), blocks.block_positions,
                                    features.to(drafter.fc.weight.dtype), blocks.mask)
    logits = target.project_logits(hidden.to(target.lm_head.weight.dtype))  # [1, anchors*B, vocab]
    return AnchorPass(seq, blocks, hidden, logits)


@torch.no_grad()
def anchor_draft_logits(
    target: CausalLM, drafter: DFlashDrafter, prompt: list[int], answer: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's logits for a round anchored at every answer position but the last, and the labels.

    Returns (logits [anchors, B-1, vocab], labels [anchors, B-1] with -100 past the answer); anchor i is the
    round whose pending token is answer[i]."""
    return _per_round(anchor_pass(target, drafter, prompt, answer), drafter.config.block_size)


def _per_round(drafts: AnchorPass, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = drafts.logits.view(-1, block_size, drafts.logits.shape[-1])[:, 1:]  # [anchors, B-1, vocab]
    labels = drafts.blocks.labels.view(-1, block_size)[:, 1:]  # [anchors, B-1]
    return logits, labels


@torch.no_grad()
def replay(
    target: CausalLM,
    drafter: DFlashDrafter,
    prompt: list[int],
    answer: list[int],
    budgets: list[int],
    *,
    max_new_tokens: int | None = None,
) -> tuple[ReplayResult, dict[int, ReplayResult]]:
    """Linear rounds and DDTree rounds per budget, from one target pass and one drafter pass."""
    if isinstance(drafter, DFlash2Drafter) and budgets:
        raise ValueError("DDTree replay of a DFlash2 drafter (trees grown by its selector) is not built: "
                         "replay its linear rounds alone")
    if len(answer) < 2:
        single = ReplayResult([1] * len(answer[:1]))
        return single, {budget: single for budget in budgets}
    drafts = anchor_pass(target, drafter, prompt, answer)
    block_size = drafter.config.block_size
    logits, labels = _per_round(drafts, block_size)
    if isinstance(drafter, DFlash2Drafter):
        terms = selector_terms(drafter.candidate_selector, drafts.hidden, drafts.logits, drafts.sequence,
                               drafts.blocks)
        picked = (terms.scores.argmax(-1) == terms.target_index) & (terms.target_index >= 0)  # [1, anchors*B]
        return rounds_from_correct(picked.view(-1, block_size)[:, 1:], len(answer)), {}
    limit = max_new_tokens if max_new_tokens is not None else len(answer)
    trees = {budget: _tree_rounds(logits, answer, budget, limit) for budget in budgets}
    return linear_rounds(logits, labels, len(answer)), trees


def linear_rounds(logits: torch.Tensor, labels: torch.Tensor, answer_length: int) -> ReplayResult:
    """logits [anchors, B-1, vocab], labels [anchors, B-1] -> the rounds linear DFlash runs."""
    return rounds_from_correct((logits.argmax(-1) == labels) & (labels >= 0), answer_length)


def rounds_from_correct(correct: torch.Tensor, answer_length: int) -> ReplayResult:
    """correct [anchors, B-1] bool (whether a round at each anchor drafts each slot right) -> the rounds run."""
    runs = correct.long().cumprod(-1).sum(-1).tolist()  # accepted drafts if a round starts at each anchor
    lengths, offset, produced = [], 0, 1  # the first answer token comes from the prefill
    while produced < answer_length and offset < len(runs):
        accepted = runs[offset]
        lengths.append(accepted + 1)
        produced += accepted + 1
        offset += accepted + 1
    return ReplayResult(lengths)


def _tree_rounds(logits: torch.Tensor, answer: list[int], budget: int, limit: int) -> ReplayResult:
    """logits [anchors, B-1, vocab] -> the rounds DDTree with `budget` nodes runs on `answer`."""
    lengths, offset, produced = [], 0, 1
    while produced < len(answer):
        max_depth = min(logits.shape[1], limit - produced - 1)
        # the last token (no depth left) is a plain step
        tree = build_tree(logits[offset, :max_depth], budget) if max_depth > 0 else linear_chain_tree([])
        # the target's greedy choice after a node of depth d on the answer's path is answer[offset + d + 1]
        depths = [0, *tree.depths.tolist()]
        choices = [answer[offset + d + 1] if offset + d + 1 < len(answer) else -1 for d in depths]
        visited, _ = follow_tree(tree, choices)
        lengths.append(len(visited))
        produced += len(visited)
        offset += len(visited)
    return ReplayResult(lengths)
