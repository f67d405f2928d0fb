"""The acceptance rule of linear speculative decoding.

Drafts are the drafter's argmax; the target's choice at each verified row is made by the ordinary sampling
rule (argmax at temperature 0, a sample otherwise). A draft is accepted while it equals the target's choice:
every committed token is then exactly what the target alone would have produced (greedy) or a sample from the
target's distribution given the committed prefix (sampling), so the output is lossless.
"""

from __future__ import annotations

import torch


def accepted_prefix_length(draft_tokens: torch.Tensor, target_choices: torch.Tensor) -> int:
    """draft_tokens: [B-1] (block slots 1..B-1); target_choices: [B] (choice after each block slot 0..B-1).

    Returns a, the number of leading drafts equal to the target's choices; the round commits
    draft_tokens[:a] and then target_choices[a] (the bonus token).
    """
    matches = (draft_tokens == target_choices[: draft_tokens.shape[0]]).to(torch.int64)  # [B-1]
    return int(matches.cumprod(0).sum())
