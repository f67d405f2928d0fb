"""The row-parallel projections: each rank multiplies its slice of the inputs, then the ranks sum the parts.

Attention's output projection and the MLP's down projection end each sub-layer; with their input columns split
across ranks (`dflash.parallel.sharding`) their outputs are partial sums, and one all-reduce per sub-layer
(`dflash.parallel.collectives`) makes the residual stream whole and identical on every rank again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.parallel.group import TensorParallel

__all__ = ["RowParallelLinear", "prepare_sums", "split_layers"]


class RowParallelLinear(nn.Linear):
    """A bias-free linear layer over this rank's input columns whose output is summed across the ranks."""

    def __init__(self, in_features: int, out_features: int, tensor_parallel: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tensor_parallel = tensor_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's product x @ weight.T -> the whole projection (the sum over the ranks); for callers that
        compute the product their own way (`dflash.fastpath.fused_layers`)."""
        return self.tensor_parallel.sums(partial)


def split_layers(layers: nn.ModuleList, tensor_parallel: TensorParallel) -> None:
    """Make every decoder layer's attention output and MLP down projection row-parallel (same weight names and
    shapes, so checkpoints load as before)."""
    for layer in layers:
        for owner, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            plain = getattr(owner, name)
            if plain.bias is not None:
                raise ValueError(f"a row-parallel {name} has no bias (the sum would add it once per rank)")
            setattr(owner, name, RowParallelLinear(plain.in_features, plain.out_features, tensor_parallel))


def prepare_sums(model: nn.Module, tensor_parallel: TensorParallel) -> str:
    """Set up the run's all-reduce for `model`'s residual rows (its hidden size and dtype), once the model is on
    its device; a collective: every rank calls it. Returns the all-reduce in use ("nccl" | "symmetric")."""
    embedding = model.get_submodule("embed_tokens")
    assert isinstance(embedding, nn.Embedding)
    return tensor_parallel.sums.prepare(embedding.embedding_dim, embedding.weight.dtype)
