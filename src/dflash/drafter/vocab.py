"""A drafter's vocabulary shortlist: the drafter scores only the target tokens it is likely to propose.

A DFlash drafter shares the target's LM head. With a large vocabulary that head is a large part of the drafter's
round: a Qwen3-8B's 151,936 x 4,096 rows are 1.2 GB read per round, next to 1.9 GB for five drafter layers. A
shortlist of the tokens the target actually writes most (counted in its answers, `dflash train vocab`) keeps only
those rows. Tokens outside the list score -inf, so the drafter never proposes them: acceptance can fall where the
target's next token is not on the list, outputs cannot change (the target verifies every token; at T > 0 the
drafter's distribution is zero outside the list, which speculative sampling allows).

File: `draft_vocab.safetensors` in a drafter's folder, one int64 tensor `ids` (distinct token ids, ascending).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.errors import ModelLoadError

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def read_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor:
    """The shortlist in `path` -> ids [size] int64, checked against the target's vocabulary."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        ids = load_file(str(path)).get("ids")
    except (OSError, ValueError, SafetensorError) as exc:
        raise ModelLoadError(f"{path}: cannot read the draft vocabulary: {exc}") from None
    if ids is None or ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
        raise ModelLoadError(f"{path}: expected one non-empty int64 tensor 'ids'")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ModelLoadError(f"{path}: ids must be distinct token ids below the target's vocabulary ({vocab_size})")
    return ids.sort().values


def write_draft_vocab(ids: torch.Tensor, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"ids": ids.to(torch.int64).sort().values.contiguous()}, str(path))


def most_frequent_tokens(counts: Counter[int], size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids of `counts` (ties to the lower id), plus `always` (e.g. end-of-turn tokens)
    -> ids [<= size + len(always)] int64, ascending."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]
    chosen = {token for token, _ in ranked} | set(always)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


@dataclass(frozen=True, eq=False)
class DraftScores:
    """The drafter's logits for some block positions over the columns `ids` (None: the whole vocabulary).

    With a shortlist every token off the list scores -inf, so its logits over the list alone carry the same
    distribution: argmax, top-k and log-softmax read them directly instead of a [rows, vocab] spread.
    `ids` is ascending, so the lowest column among equal maxima is also the lowest token id."""

    logits: torch.Tensor  # [rows, columns] (any leading shape for `full`)
    ids: torch.Tensor | None  # [columns] int64: the token id of each column
    vocab_size: int

    def greedy(self) -> torch.Tensor:
        """The most likely token per row: [rows] int64."""
        best = self.logits.argmax(dim=-1)  # [rows] columns
        return best if self.ids is None else self.ids[best]

    def full(self) -> torch.Tensor:
        """Logits over the whole vocabulary: [..., vocab], -inf off the shortlist."""
        if self.ids is None:
            return self.logits
        logits = self.logits.new_full((*self.logits.shape[:-1], self.vocab_size), float("-inf"))  # [..., vocab]
        return logits.scatter_(-1, self.ids.expand(self.logits.shape), self.logits)  # (index_copy_ is 2x slower)


class DraftHead(nn.Module):
    """The target's LM head restricted to a shortlist: hidden [..., hidden] -> logits [..., vocab], -inf
    outside the list (soft-capped where the target's family does)."""

    ids: torch.Tensor

    def __init__(self, ids: torch.Tensor, target: Any) -> None:
        super().__init__()
        self.vocab_size = int(target.config.vocab_size)
        self.cap = target.config.final_logit_softcapping
        self.register_buffer("ids", ids.to(target.lm_head.weight.device), persistent=False)
        self.rows = _head_rows(target.lm_head, ids)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.scores(hidden).full()

    def scores(self, hidden: torch.Tensor) -> DraftScores:
        """hidden [rows, hidden] -> the shortlist's logits [rows, size] (capped), with their token ids."""
        return DraftScores(self.capped(self.rows(hidden)), self.ids, self.vocab_size)

    def capped(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.tanh(scores / self.cap) * self.cap if self.cap else scores

    def spread(self, scores: torch.Tensor) -> torch.Tensor:
        """The shortlist's raw scores [..., size] -> logits [..., vocab] (capped, -inf off the list)."""
        return DraftScores(self.capped(scores), self.ids, self.vocab_size).full()


def _head_rows(lm_head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A copy of the rows `ids` of an LM head: dense `nn.Linear`, or GGUF blocks on the CPU kernel or the GPU."""
    # a quantized head exists only where its module was loaded (it needs gguf, which dense models do without)
    quantized = sys.modules.get("dflash.models.quantized_layers")
    if quantized is not None and isinstance(lm_head, quantized.QuantizedLinear):
        from gguf import GGMLQuantizationType

        from dflash.models.cpu_matmul import draft_products
        from dflash.models.quantized_layers import QuantizedLinear
        from dflash.models.quantized_weights import QuantizedMatrix

        blocks = lm_head.row_blocks(ids.to(lm_head.blocks.device))
        head = QuantizedLinear(QuantizedMatrix(blocks, GGMLQuantizationType(lm_head.qtype), lm_head.in_features))
        head.use_products(draft_products(lm_head.products))  # the target head's kernel, as a drafter's
        return head
    on_gpu = sys.modules.get("dflash.models.gpu_quantized_layers")
    if on_gpu is not None and isinstance(lm_head, on_gpu.GGUFLinear):  # GGUF blocks on the GPU
        return lm_head.rows(ids)
    weight = lm_head.weight  # [vocab, hidden]
    assert isinstance(weight, torch.Tensor)
    rows = nn.Linear(weight.shape[1], ids.numel(), bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(weight.index_select(0, ids.to(weight.device)))
    return rows.requires_grad_(False)
