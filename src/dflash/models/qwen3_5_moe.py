"""Qwen3.5-MoE (Qwen3.5-35B-A3B, Qwen3.5-122B-A10B): the Qwen3.5 hybrid layers (`dflash.models.qwen3_5`) with the
mixture of experts plus gated shared expert (`dflash.models.moe.SharedExpertMoeBlock`) as every layer's MLP.

The layers compute as Qwen3.5's and the block as Qwen3-Next's (same router: softmax in float32, top-k, always
rescaled to sum to 1); only the checkpoint's expert layout needs converting: the hub's files and transformers'
save_pretrained write one tensor per expert, transformers holds them fused in memory, llama.cpp stacks them per
projection (`dflash.models.moe_weights`).
"""

from __future__ import annotations

import torch

from dflash.models.moe import grouped_experts
from dflash.models.moe_weights import fuse_shared_experts, join_gate_up, stack_expert_weights
from dflash.models.qwen3_5 import Qwen35ForCausalLM


class Qwen35MoeForCausalLM(Qwen35ForCausalLM):
    """Captured in CUDA graphs where its experts run without host decisions (a GPU in 16-bit floats: the routed
    programs or the grouped product), its recurrent state in the runner's fixed buffers, as Qwen3.5's; elsewhere
    the per-expert products read their token counts on the host, which no graph can replay."""

    @property
    def capturable(self) -> bool:
        return grouped_experts(self.embed_tokens.weight)

    def load_weights(self, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Experts in any checkpoint form stacked with gate and up joined; the shared expert's gate and up joined
        as in a dense MLP."""
        converted = join_gate_up(self.config, stack_expert_weights(self.config, weights, source))
        super().load_weights(fuse_shared_experts(converted), source)
