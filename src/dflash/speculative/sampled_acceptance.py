"""Speculative sampling with the drafter's own distribution q (DFlash2's selector returns it).

The equality rule of `dflash.speculative.acceptance` is lossless for any drafts but accepts a sampled draft only
when the target happens to sample the same token. With q known, the classic rule accepts more and keeps the
target's distribution exactly: draft d_i (drawn from q_i given the drafts before it) is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from norm(max(p_i - q_i, 0)); when every
draft is accepted the bonus is drawn from p after the last one.
"""

from __future__ import annotations

import torch


def speculative_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """target_probs: [n+1, vocab], row i the target's distribution after the committed output and drafts[:i];
    draft_tokens: [n]; draft_probs: [n, vocab], row i the q draft i was drawn from.

    Returns (a, token): the first a drafts are accepted, then `token` (a resample or the bonus) is committed."""
    n = int(draft_tokens.shape[0])
    uniforms = torch.rand(n, generator=generator, device=target_probs.device)  # [n]
    for i in range(n):
        token = int(draft_tokens[i])
        p, q = target_probs[i, token], draft_probs[i, token]
        if q > 0 and uniforms[i] * q < p:  # u < p / q: always when p >= q
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)  # [vocab]
        total = residual.sum()
        # p <= q everywhere only when p == q (then nothing is ever rejected); rounding can still get here
        row = residual / total if total > 0 else target_probs[i]
        return i, int(torch.multinomial(row, 1, generator=generator))
    return n, int(torch.multinomial(target_probs[n], 1, generator=generator))
