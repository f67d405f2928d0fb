"""DFlash2's candidate selector: picks the drafted chain from each block row's top-k candidates.

DFlash takes every row's top-1 token on its own, so neighbours can disagree. The selector keeps each row's
`top_k` candidates (by the drafter's own logits U) and scores a candidate b at row t after predecessor a as

    S_t(a, b) = U_t(b) + < A[a] * H(h_t), B[b] >

with A, B codebooks [vocab, rank] and H a projection of the row's final-normed drafter hidden h_t. The walk starts
from the anchor (the pending token) and each pick is the next row's predecessor: greedy takes the argmax, sampling
draws from q_t = softmax(S_t / T) by the inverse CDF of a uniform, and q_t (zero off the candidates) is what the
verification needs to stay lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash.drafter.vocab import DraftScores


@dataclass(frozen=True, eq=False)
class SelectedChain:
    """The drafts of one round and the distribution each was drawn from."""

    tokens: torch.Tensor  # [rows] int64: the picked token per row
    candidates: torch.Tensor  # [rows, K] int64: candidate token ids
    q: torch.Tensor  # [rows, K] float32: the pick's distribution over the candidates (one-hot when greedy)

    def q_over_vocab(self, vocab_size: int) -> torch.Tensor:
        """q spread over the vocabulary: [rows, vocab], zero off the candidates."""
        full = self.q.new_zeros(self.q.shape[0], vocab_size)
        return full.scatter_(1, self.candidates, self.q)


@dataclass(frozen=True, eq=False)
class CandidateLattice:
    """Everything the walk needs of one drafter pass; `scores` is cheap (one rank-r product per row)."""

    candidates: torch.Tensor  # [rows, K] int64 token ids
    unary: torch.Tensor  # [rows, K] float32 drafter logits of the candidates
    projected: torch.Tensor  # [rows, rank] float32 H(h_t)
    selector: CandidateSelector

    @property
    def rows(self) -> int:
        return int(self.candidates.shape[0])

    def scores(self, row: int, predecessor: int) -> torch.Tensor:
        """S_row(predecessor, candidate) for every candidate of `row`: [K] float32."""
        a = self.selector.predecessor_codebook[predecessor].float()  # [rank]
        b = self.selector.successor_codebook[self.candidates[row]].float()  # [K, rank]
        return self.unary[row] + b @ (a * self.projected[row])

    def walk(
        self, anchor: int | torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None
    ) -> SelectedChain:
        """The chain from `anchor` (a token id, or [1] on the candidates' device): argmax per row at temperature 0,
        else an inverse-CDF draw from softmax(S / T). Every pick stays on the device: a GPU round reads nothing back
        per row (and a graph can capture the greedy walk)."""
        device = self.candidates.device
        top_k = self.candidates.shape[1]
        successors = self.selector.successor_codebook[self.candidates].float()  # [rows, K, rank]
        if isinstance(anchor, torch.Tensor):
            predecessor = anchor.reshape(1).to(torch.int64)  # [1]
        else:
            predecessor = torch.tensor([anchor], dtype=torch.int64, device=device)
        picks: list[torch.Tensor] = []
        q_rows: list[torch.Tensor] = []
        for row in range(self.rows):
            a = self.selector.predecessor_codebook.index_select(0, predecessor)[0].float()  # [rank]
            scores = self.unary[row] + successors[row] @ (a * self.projected[row])  # [K]: `scores(row, .)`
            if temperature <= 0.0:
                index = scores.argmax().reshape(1)  # the first maximum: ties go to the lowest candidate index
                q = (torch.arange(top_k, device=device) == index).to(scores.dtype)  # one-hot, no range check read back
            else:
                q = torch.softmax(scores / temperature, dim=-1)
                index = inverse_cdf_index(q, torch.rand((), generator=generator, device=q.device))
            predecessor = self.candidates[row].index_select(0, index)  # [1]
            picks.append(predecessor)
            q_rows.append(q)
        if not picks:
            return SelectedChain(self.candidates.new_zeros(0), self.candidates, self.unary.new_zeros(0, top_k))
        return SelectedChain(torch.cat(picks), self.candidates, torch.stack(q_rows))


def inverse_cdf_index(q: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The index i of q [K] with cdf(i - 1) <= u < cdf(i), as a [1] tensor on q's device (nothing read back); a u past
    the last (rounded) cdf takes the last non-zero."""
    cdf = q.cumsum(0)
    index = torch.searchsorted(cdf, uniform.reshape(1).to(cdf.dtype), right=True)  # [1]
    last = (torch.arange(q.shape[0], device=q.device) * (q > 0)).max().reshape(1)  # [1]
    return torch.where(index >= q.shape[0], last, index)


def inverse_cdf(q: torch.Tensor, uniform: torch.Tensor) -> int:
    """`inverse_cdf_index` as an int."""
    return int(inverse_cdf_index(q, uniform))


class CandidateSelector(nn.Module):
    """Parameter names follow the published checkpoints: `hidden_projection.weight` [rank, hidden],
    `predecessor_codebook` and `successor_codebook` [vocab, rank] (bare tensors)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))

    def lattice(self, hidden: torch.Tensor, scores: DraftScores) -> CandidateLattice:
        """hidden: the final-normed drafter rows [rows, hidden]; scores: their draft logits -> the candidate lattice.

        Candidates are the top `top_k` columns (fewer if the shortlist or vocabulary is smaller)."""
        logits = scores.logits.float()  # [rows, columns]
        k = min(self.top_k, logits.shape[-1])
        unary, columns = torch.topk(logits, k, dim=-1)  # [rows, K] each, descending
        candidates = columns if scores.ids is None else scores.ids[columns]
        projected = self.hidden_projection(hidden).float()  # [rows, rank]
        return CandidateLattice(candidates, unary, projected, self)
