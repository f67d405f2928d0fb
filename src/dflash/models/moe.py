"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen3-Next: a router picks k experts per token, whose gated
MLPs are mixed; Qwen3-Next adds a shared expert that every token passes through, scaled by a sigmoid gate.

Routing follows transformers' Qwen3-MoE exactly: router logits -> softmax in float32 -> top-k -> (optionally)
rescaled to sum to 1 -> cast back to the hidden dtype. Experts are stored stacked, [experts, out, in] per
projection (gate and up joined as in the dense MLP), so that a grouped GPU kernel can take them as they are.
The eager compute groups tokens by expert and runs only the experts that received tokens: a decode step of one
row touches k experts' weights, not all of them. On a GPU in 16-bit floats the grouped rows go through PyTorch's
grouped product (`grouped_mm`: two launches per layer for all experts, no host sync; empty groups cost nothing);
elsewhere one product per expert that received tokens, the count per expert read on the host. Where the grouped
product serves, up to 16 tokens (decode steps, verifications) go through two Triton programs instead, each (token, choice) pair
reading its expert's weights directly (`dflash.kernels.triton_experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import ModelConfig
from dflash.kernels import triton_experts
from dflash.kernels.fused_cpu import layer_ops
from dflash.models.layers import GatedMLP, activation

# PyTorch's grouped product (public from 2.9 as F.grouped_mm; torch._grouped_mm before): None where absent
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_experts(like: torch.Tensor) -> bool:
    """Whether experts run through the grouped product for activations like `like`: on a GPU in 16-bit floats,
    where PyTorch has it. (Its float32 form on CUDA copies between host and device, which no graph can replay.)"""
    return GROUPED_MM is not None and like.is_cuda and like.dtype in (torch.bfloat16, torch.float16)


class StackedExperts(nn.Module):
    """Every expert's gated MLP, stacked: gate_up_proj [experts, 2 * width, hidden], down_proj [experts, hidden,
    width]."""

    def __init__(self, experts: int, hidden: int, width: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))
        self.act = activation(act)
        self.num_experts = experts
        self.width = width

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden]; chosen: [tokens, k] expert ids; weights: [tokens, k] routing weights in x's dtype
        -> [tokens, hidden], the routing-weighted sum of each token's experts."""
        if (
            isinstance(self.act, nn.SiLU) and triton_experts.routed_programs_serve(x)
            and (grouped_experts(x) or triton_experts.SERVES_INTERPRETED)
        ):
            return triton_experts.routed_experts(x, chosen, weights, self.gate_up_proj, self.down_proj)
        if grouped_experts(x):
            return self.grouped(x, chosen, weights)
        k = chosen.shape[1]
        out = torch.zeros_like(x)
        flat = chosen.reshape(-1)  # [tokens * k]: entry j is token j // k's choice number j % k
        order = torch.argsort(flat, stable=True)  # grouped by expert, token order within an expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer
        tokens = order // k  # [tokens * k]: the token of each grouped entry
        scales = weights.reshape(-1)[order]  # [tokens * k]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]  # [count]
            gate_up = F.linear(x.index_select(0, rows), self.gate_up_proj[expert])  # [count, 2 * width]
            mixed = F.linear(self._gated(gate_up), self.down_proj[expert])  # [count, hidden]
            out.index_add_(0, rows, mixed * scales[start : start + count, None])
            start += count
        return out

    def grouped(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward` through the grouped product: every (token, choice) row sorted by expert, each expert's rows
        multiplied in one launch per projection, the rows put back in (token, choice) order and mixed in that
        order (no atomic adds: the same bits on every run). Nothing is read on the host."""
        assert GROUPED_MM is not None
        tokens, k = chosen.shape
        flat = chosen.reshape(-1)  # [tokens * k]
        order = torch.argsort(flat, stable=True)  # grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)  # [experts]: where each expert's rows end
        rows = x.index_select(0, order // k)  # [tokens * k, hidden]
        gate_up = GROUPED_MM(rows, self.gate_up_proj.transpose(1, 2), offs=ends)  # [tokens * k, 2 * width]
        mixed = GROUPED_MM(self._gated(gate_up), self.down_proj.transpose(1, 2), offs=ends)  # [tokens * k, hidden]
        by_token = torch.empty_like(mixed).index_copy_(0, order, mixed).view(tokens, k, -1)
        return (by_token * weights[..., None]).sum(dim=1)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of [rows, 2 * width] -> [rows, width]."""
        ops = layer_ops(gate_up) if isinstance(self.act, nn.SiLU) else None
        if ops is not None:
            return ops.silu_mul(gate_up)
        gate, up = gate_up.split(self.width, dim=-1)
        return self.act(gate) * up


class SparseMoeBlock(nn.Module):
    """Router (`gate`, weight [experts, hidden]) and experts; replaces the dense MLP of a sparse layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = StackedExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, config.hidden_act
        )
        self.top_k = config.num_experts_per_tok
        self.normalise = config.norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> (expert ids [tokens, k], routing weights [tokens, k] in x's dtype)."""
        logits = self.gate(x)  # [tokens, experts]
        if triton_experts.route_program_serves(logits):
            return triton_experts.route_rows(logits, self.top_k, self.normalise)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # the softmax runs in float32 whatever the dtype
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            top = top / top.sum(dim=-1, keepdim=True)
        return chosen, top.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden]."""
        flat = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
        chosen, weights = self.route(flat)
        return self.experts(flat, chosen, weights).view(x.shape)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen3-Next's block: the routed experts of `SparseMoeBlock` (same router, same routing) plus a dense gated
    MLP of `shared_expert_intermediate_size` (`shared_expert`) that every token takes, scaled by
    sigmoid(`shared_expert_gate`(x)) ([1, hidden]: one scalar gate per token)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden]."""
        flat = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
        chosen, weights = self.route(flat)
        routed = self.experts(flat, chosen, weights)  # [tokens, hidden]
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)  # [tokens, hidden]
        return (routed + shared).view(x.shape)
