"""Token selection: greedy at temperature 0, otherwise temperature / top-k / top-p / min-p sampling.

Speculative decoding uses the same function for the target's choice at every verified position, so the
sampling rule (and its random stream) is shared by plain and speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.errors import GenerationError
from dflash.kernels.fused_cpu import layer_ops


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise GenerationError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        if self.seed is not None:
            generator.manual_seed(self.seed % 2**64)  # any integer names a seed; torch takes 64 bits
        else:
            generator.seed()
        return generator


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [rows, vocab] -> probabilities [rows, vocab] after temperature, top-k, top-p and min-p."""
    logits = logits.float()
    # Shifted so the best score is 0 before dividing: a tiny temperature then sends the others to -inf (the
    # argmax limit) instead of overflowing every score to inf and the softmax to NaN.
    # A temperature below float32's smallest normal would round to 0 (0/0 = NaN at the best score); the limit is
    # reached well before it.
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    scores = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0:
        floor = probs.max(dim=-1, keepdim=True).values * params.min_p
        probs = probs.masked_fill(probs < floor, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        dropped = before >= params.top_p
        dropped[..., 0] = False  # the most likely token always stays (a top_p below float precision keeps it alone)
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(-1, keepdim=True)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """OpenAI-style presence/frequency penalties. logits: [rows, vocab]; counts: [vocab] tokens generated so far."""
    if not params.penalised:
        return logits
    penalty = params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(counts.dtype)
    return logits - penalty.to(logits.dtype)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [rows, vocab] -> one token per row [rows] (argmax when greedy, else a sample per row)."""
    if params.greedy:
        ops = layer_ops(logits) if logits.dim() == 2 else None
        return logits.argmax(dim=-1) if ops is None else ops.argmax_rows(logits)  # the same tokens, faster on a CPU
    probs = filtered_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
