"""Fast, exact replay of greedy speculative decoding from one teacher-forced pass.

At temperature 0 the committed sequence is the target's greedy output, and the drafter's proposal in a round
starting at position s depends only on features of positions < s and on token x_s: exactly the anchor-block
of training anchored at s. So one target pass over (prompt + greedy answer) and one drafter pass with an
anchor at every answer position give every possible round; walking s -> s + a + 1 from the first answer
position reproduces the rounds linear DFlash would run, with their acceptance lengths. This makes evaluation
batched (seconds on a GPU) while `dflash bench acceptance` measures the real decoding loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.models.model import CausalLM
from dflash.spec.drafter import DFlashDrafter
from dflash.training.objective import build_blocks


@dataclass
class ReplayResult:
    acceptance_lengths: list[int]  # per round, a + 1

    @property
    def mean(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0


@torch.no_grad()
def replay_linear(target: CausalLM, drafter: DFlashDrafter, prompt: list[int], answer: list[int]) -> ReplayResult:
    """Rounds of greedy linear DFlash on `answer` (the target's greedy continuation of `prompt`)."""
    if len(answer) < 2:
        return ReplayResult([1] * len(answer[:1]))
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
    drafts = target.project_logits(hidden.to(target.lm_head.weight.dtype)).argmax(-1)  # [1, anchors*B]
    labels = blocks.labels.view(-1, config.block_size)[:, 1:]  # [anchors, B-1]
    correct = (drafts.view(-1, config.block_size)[:, 1:] == labels) & (labels >= 0)
    runs = correct.long().cumprod(-1).sum(-1).tolist()  # accepted drafts if a round starts at each anchor
    lengths, offset, produced = [], 0, 1  # the first answer token comes from the prefill
    while produced < len(answer) and offset < len(runs):
        accepted = runs[offset]
        lengths.append(accepted + 1)
        produced += accepted + 1
        offset += accepted + 1
    return ReplayResult(lengths)
