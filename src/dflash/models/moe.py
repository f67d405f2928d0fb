"""Sparse mixture-of-experts MLP with a gated shared expert (Qwen3-Next).

A router scores every expert per token (softmax in float32), keeps the top `num_experts_per_tok` (renormalised to
sum to one when `norm_topk_prob`), and sums those experts' SwiGLU outputs weighted by their scores. A shared
SwiGLU expert, scaled by sigmoid(shared_expert_gate(x)), is added for every token.

Experts are stored stacked, one tensor for all: `experts.gate_up_proj` [experts, 2 * width, hidden] (gate rows then
up rows) and `experts.down_proj` [experts, hidden, width]; checkpoints name them one expert at a time, which
`stack_expert_weights` converts.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import ModelConfig
from dflash.models.layers import GatedMLP, activation


class StackedExperts(nn.Module):
    def __init__(self, experts: int, hidden: int, width: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))
        self.act = activation(act)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden]; chosen, weights: [tokens, top_k] -> [tokens, hidden]. Only experts that some token
        chose run, each over its tokens."""
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            token, rank = (chosen == expert).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[expert]) * weights[token, rank, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k, self.normalise = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)  # the router
        self.experts = StackedExperts(config.num_experts, hidden, config.moe_intermediate_size, config.hidden_act)
        self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]."""
        flat = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
        router_logits = self.gate(flat)  # [tokens, experts]
        scores, chosen = router_logits.float().softmax(dim=-1).topk(self.top_k, dim=-1)  # [tokens, top_k]
        if self.normalise:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        routed = self.experts(flat, chosen, scores.to(router_logits.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).view_as(x)


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def stack_expert_weights(weights: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (`...mlp.experts.3.up_proj.weight`) -> the stacked `experts.gate_up_proj` and
    `experts.down_proj` of each layer; other tensors unchanged. A layer missing some expert's tensor keeps no
    stacked tensor (the model then reports it missing)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    for name, tensor in weights.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            parts.setdefault(match[1], {})[(match[3], int(match[2]))] = tensor
    for prefix, found in parts.items():
        if all((kind, e) in found for kind in ("gate", "up", "down") for e in range(num_experts)):
            out[prefix + ".gate_up_proj"] = torch.stack(
                [torch.cat((found[("gate", e)], found[("up", e)])) for e in range(num_experts)]
            )
            out[prefix + ".down_proj"] = torch.stack([found[("down", e)] for e in range(num_experts)])
    return out
