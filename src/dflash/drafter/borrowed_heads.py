"""The target's embedding and LM head, copied onto the drafter's own device (`--draft-device`).

A drafter has no embedding or LM head: it borrows its target's (`dflash.drafter.model.TargetModel`). When the
drafter runs on another GPU than the target, reading them across the link on every round would cost more than the
round, so the drafter's device keeps copies (for a Qwen3-32B-sized vocabulary about 3 GB in bf16, one matrix when the
two are tied). The copies compute exactly what the target's modules compute: same weights, same dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash.errors import ModelLoadError
from dflash.models.model import capped_logits, scaled_embeddings

__all__ = ["BorrowedHeads"]


class BorrowedHeads(nn.Module):
    """`embed` and `project_logits` of `target`, on `device`; duck-types the target for the drafter's forwards
    (they read `embed_tokens`, `lm_head` and `config` besides the two methods)."""

    def __init__(self, target: Any, device: torch.device) -> None:
        super().__init__()
        self.config = target.config
        self.tensor_parallel = None
        self.embed_tokens = _embedding_on(target.embed_tokens, device)
        if target.lm_head.weight is target.embed_tokens.weight:  # tied: one copy serves both
            self.lm_head = nn.Linear(self.embed_tokens.weight.shape[1], self.embed_tokens.weight.shape[0], bias=False,
                                     device="meta")
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head = _linear_on(target.lm_head, device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [batch, seq] -> [batch, seq, hidden], scaled as the target scales its embeddings."""
        return scaled_embeddings(self.embed_tokens, self.config, input_ids)

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., hidden] -> logits [..., vocab], soft-capped where the target's family is."""
        return capped_logits(self.lm_head, self.config, hidden)


def _embedding_on(module: nn.Module, device: torch.device) -> nn.Embedding:
    if type(module) is not nn.Embedding:
        raise ModelLoadError(
            f"--draft-device: the target's embedding is a {type(module).__name__}, which cannot be copied to "
            "another device (dense weights only)"
        )
    return nn.Embedding.from_pretrained(module.weight.detach().to(device), freeze=True)


def _linear_on(module: nn.Module, device: torch.device) -> nn.Linear:
    if type(module) is not nn.Linear:
        raise ModelLoadError(
            f"--draft-device: the target's LM head is a {type(module).__name__}, which cannot be copied to another "
            "device (dense weights, one whole vocabulary)"
        )
    weight = module.weight.detach()
    copy = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, device=device, dtype=weight.dtype)
    copy.requires_grad_(False)
    copy.weight.copy_(weight)
    if module.bias is not None:
        copy.bias.copy_(module.bias.detach())
    return copy
