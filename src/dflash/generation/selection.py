"""The target's token choice at one or several consecutive output positions.

Wraps the sampling rule with what depends on the output so far: EOS suppression before `min_tokens`,
presence/frequency penalties, and a token constraint (`dflash.generation.constraints`) whose disallowed tokens
are masked to -inf before the rule. Plain and speculative decoding both choose through `TokenChooser`.

Under tensor parallelism every rank runs the same loop, and a `TokenAgreement` makes the first rank's choice every
rank's (`dflash.parallel.spmd`): sampled tokens and constraints then need to exist on that rank alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from dflash.generation.constraints import ConstraintState, row_masks
from dflash.generation.sampling import SamplingParams, apply_penalties, choose_tokens, filtered_probs


class TokenAgreement(Protocol):
    def agree(self, choose: Callable[[], torch.Tensor], rows: int, device: torch.device) -> torch.Tensor:
        """The tokens [rows] every rank commits (the first rank's `choose()`)."""
        ...


class TokenChooser:
    def __init__(
        self,
        params: SamplingParams,
        *,
        eos_ids: Sequence[int],
        min_tokens: int,
        vocab_size: int,
        device: torch.device | str,
        constraint: ConstraintState | None = None,
        agreement: TokenAgreement | None = None,
    ) -> None:
        self.params = params
        self.agreement = agreement
        self.generator = params.make_generator(device)
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
        self.has_eos = bool(eos_ids)  # read per request and step by the batched core: no tensor call
        self.min_tokens = min_tokens
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size, device=device) if params.penalised else None
        # dropped once finished: from then on choosing costs nothing more than without one
        self.constraint = constraint if constraint is not None and not constraint.finished else None

    @property
    def constrained(self) -> bool:
        """Whether a constraint still restricts the next tokens (the GPU-resident rounds cannot apply one)."""
        return self.constraint is not None

    def allowed(self, drafts: Sequence[int] = (), parents: Sequence[int] | None = None) -> torch.Tensor | None:
        """The constraint's allowed tokens of each verified row, bool [len(drafts) + 1, vocab], or None without
        a constraint. Row 0 follows the committed output, row i its parent row's prefix plus `drafts[i - 1]`
        (`parents`: one per row, root first; None: a chain, as in linear verification)."""
        if self.constraint is None:
            return None
        return row_masks(self.constraint, drafts, parents, self.vocab_size)

    def choose(self, logits: torch.Tensor, output_index: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [rows, vocab], row i deciding output token number output_index + i -> tokens [rows].

        `allowed` [rows, vocab] (from `allowed`) restricts each row; with a constraint and no `allowed`, the one
        row follows the committed output."""
        if self.agreement is not None:
            return self.agreement.agree(
                lambda: self._choose(logits, output_index, allowed), logits.shape[0], logits.device
            )
        return self._choose(logits, output_index, allowed)

    def probabilities(
        self, logits: torch.Tensor, output_index: int, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The distribution `choose` samples each row from (sampling only): logits [rows, vocab] -> [rows, vocab].
        Speculative sampling compares it with the drafter's q."""
        return filtered_probs(self._restricted(logits, output_index, allowed), self.params)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of probs [rows, vocab] from the chooser's random stream -> [rows]."""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def _choose(self, logits: torch.Tensor, output_index: int, allowed: torch.Tensor | None) -> torch.Tensor:
        return choose_tokens(self._restricted(logits, output_index, allowed), self.params, self.generator)

    def _restricted(self, logits: torch.Tensor, output_index: int, allowed: torch.Tensor | None) -> torch.Tensor:
        """logits [rows, vocab] with EOS suppression, the constraint's mask and penalties applied."""
        if allowed is None and self.constraint is not None:
            assert logits.shape[0] == 1, "rows past the committed output need their masks (TokenChooser.allowed)"
            allowed = self.allowed()
        restricted = logits
        if self.min_tokens > output_index and self.eos.numel():
            rows = logits.shape[0]
            blocked = torch.arange(output_index, output_index + rows, device=logits.device) < self.min_tokens
            rows_blocked = blocked.nonzero().squeeze(-1)
            restricted = logits.clone()
            restricted[rows_blocked[:, None], self.eos[None, :]] = float("-inf")
        if allowed is not None:
            allowed = allowed.to(logits.device, non_blocking=True)
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # a row with nothing allowed is left free
            masked = restricted.masked_fill(~allowed, float("-inf"))
            # a constraint that allows only EOS outranks min_tokens: such a row keeps EOS
            empty = torch.isneginf(masked).all(dim=-1, keepdim=True)
            restricted = torch.where(empty, logits.masked_fill(~allowed, float("-inf")), masked)
        if self.counts is not None:
            restricted = apply_penalties(restricted, self.counts, self.params)
        return restricted

    def observe(self, tokens: Sequence[int]) -> None:
        """Record committed tokens (penalties count them; the constraint follows them)."""
        if self.counts is not None and tokens:
            index = torch.tensor(list(tokens), device=self.counts.device)
            self.counts.index_add_(0, index, torch.ones(len(tokens), device=self.counts.device))
        for token in tokens:
            if self.constraint is None:
                break
            if not self.constraint.advance(int(token)) or self.constraint.finished:
                # finished, or a token it refuses (only a caller choosing without the masks commits one)
                self.constraint = None
