"""The layers whose weights are split across ranks and whose outputs the ranks then combine.

Row-parallel projections: attention's output projection and the MLP's down projection end each sub-layer; with
their input columns split across ranks (`dflash.parallel.sharding`) their outputs are partial sums, and one
all-reduce per sub-layer (`dflash.parallel.collectives`) makes the residual stream whole and identical on every
rank again.

Vocabulary-parallel embedding and LM head: each rank keeps a world-th of the vocabulary's rows. A rank embeds the
ids in its range (zero elsewhere) and the all-reduce adds the ranks' rows (one non-zero term: exact); the head
gives each rank the logits of its range and an all-gather puts the whole rows together on every rank. The head is
a large matrix (a 152K vocabulary at hidden 5120 is 1.6 GB in bf16): split, each rank reads half of it per token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dflash.parallel.group import TensorParallel

__all__ = ["RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead", "prepare_sums", "split_layers"]


class RowParallelLinear(nn.Linear):
    """A linear layer over this rank's input columns whose output is summed across the ranks; a bias (whole on every
    rank) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, tensor_parallel: TensorParallel, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tensor_parallel = tensor_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's product x @ weight.T -> the whole projection (the sum over the ranks, plus the bias); for
        callers that compute the product their own way (`dflash.fastpath.fused_layers`)."""
        summed = self.tensor_parallel.sums(partial)
        return summed if self.bias is None else summed + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding rows [rank * rows, (rank + 1) * rows) of the vocabulary; its output is whole on every
    rank. weight: [rows, hidden]."""

    def __init__(self, rows: int, hidden: int, tensor_parallel: TensorParallel) -> None:
        super().__init__(rows, hidden)
        self.tensor_parallel = tensor_parallel
        self.first = tensor_parallel.rank * rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [...] -> [..., hidden]."""
        local = input_ids - self.first
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tensor_parallel.sums(rows * inside.unsqueeze(-1).to(rows.dtype))


class VocabParallelHead(nn.Linear):
    """An LM head holding the vocabulary rows of `VocabParallelEmbedding`; its logits are whole on every rank.
    weight: [rows, hidden]."""

    def __init__(self, hidden: int, rows: int, tensor_parallel: TensorParallel) -> None:
        super().__init__(hidden, rows, bias=False)
        self.tensor_parallel = tensor_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(F.linear(hidden, self.weight))

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's logits [..., rows] -> every rank's, in vocabulary order [..., world * rows]; for callers that
        compute the product their own way (`dflash.fastpath.fused_layers`)."""
        tp = self.tensor_parallel
        rows = part.shape[-1]
        flat = part.reshape(-1, rows)  # [n, rows]
        parts = torch.empty((tp.world * flat.shape[0], rows), dtype=part.dtype, device=part.device)  # [world * n, rows]
        dist.all_gather_into_tensor(parts, flat.contiguous(), group=tp.group)
        whole = parts.view(tp.world, flat.shape[0], rows).transpose(0, 1)  # [n, world, rows]
        return whole.reshape(*part.shape[:-1], tp.world * rows)


def split_layers(layers: nn.ModuleList, tensor_parallel: TensorParallel) -> None:
    """Make every decoder layer's attention output and MLP down projection row-parallel (same weight names and
    shapes, so checkpoints load as before)."""
    for layer in layers:
        for owner, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            plain = getattr(owner, name)
            setattr(owner, name, RowParallelLinear(
                plain.in_features, plain.out_features, tensor_parallel, bias=plain.bias is not None
            ))


def prepare_sums(model: nn.Module, tensor_parallel: TensorParallel) -> str:
    """Set up the run's all-reduce for `model`'s residual rows (its hidden size and dtype), once the model is on
    its device; a collective: every rank calls it. Returns the all-reduce in use ("nccl" | "symmetric" | "fused" | "oneway")."""
    embedding = model.get_submodule("embed_tokens")
    assert isinstance(embedding, nn.Embedding)
    return tensor_parallel.sums.prepare(embedding.embedding_dim, embedding.weight.dtype)
