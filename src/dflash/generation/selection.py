"""The target's token choice at one or several consecutive output positions.

Wraps the sampling rule with what depends on the output so far: EOS suppression before `min_tokens`
and presence/frequency penalties. Plain and speculative decoding both choose through `TokenChooser`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash.generation.sampling import SamplingParams, apply_penalties, choose_tokens


class TokenChooser:
    def __init__(
        self,
        params: SamplingParams,
        *,
        eos_ids: Sequence[int],
        min_tokens: int,
        vocab_size: int,
        device: torch.device | str,
    ) -> None:
        self.params = params
        self.generator = params.make_generator(device)
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
        self.min_tokens = min_tokens
        self.counts = torch.zeros(vocab_size, device=device) if params.penalised else None

    def choose(self, logits: torch.Tensor, output_index: int) -> torch.Tensor:
        """logits: [rows, vocab], row i deciding output token number output_index + i -> tokens [rows]."""
        if self.min_tokens > output_index and self.eos.numel():
            rows = logits.shape[0]
            blocked = torch.arange(output_index, output_index + rows, device=logits.device) < self.min_tokens
            rows_blocked = blocked.nonzero().squeeze(-1)
            logits = logits.clone()
            logits[rows_blocked[:, None], self.eos[None, :]] = float("-inf")
        if self.counts is not None:
            logits = apply_penalties(logits, self.counts, self.params)
        return choose_tokens(logits, self.params, self.generator)

    def observe(self, tokens: Sequence[int]) -> None:
        """Record committed tokens (penalties count them)."""
        if self.counts is not None and tokens:
            index = torch.tensor(list(tokens), device=self.counts.device)
            self.counts.index_add_(0, index, torch.ones(len(tokens), device=self.counts.device))
