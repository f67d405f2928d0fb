"""Qwen3-Next: the Qwen3.5 hybrid layers (`dflash.models.qwen3_5`) with mixture-of-experts MLPs.

The layers compute exactly as Qwen3.5-MoE's (`dflash.models.qwen3_5_moe`, whose expert conversion it shares), with
two differences: some layers may keep a dense MLP (`mlp_only_layers`, `decoder_sparse_step`), and the Gated
DeltaNet's projections come fused per key-head group (`in_proj_qkvz`: for each key head, its q and k rows then the
v and z rows of the value heads it serves; `in_proj_ba`: the b then a rows of those value heads), which
`load_weights` splits before the experts are converted.
"""

from __future__ import annotations

import torch

from dflash.config import LINEAR_ATTENTION, ModelConfig
from dflash.models.qwen3_5_moe import Qwen35MoeForCausalLM


def split_grouped_projections(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`linear_attn.in_proj_qkvz` / `in_proj_ba` -> Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
    `in_proj_a` (all heads of q, then of k, then of v; value heads in the same order); other tensors unchanged."""
    key_heads, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    group = config.linear_num_value_heads // key_heads  # value heads per key head
    served = group * config.linear_value_head_dim  # value rows per key head
    out = dict(weights)
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}.linear_attn."
        if kind != LINEAR_ATTENTION or p + "in_proj_qkvz.weight" not in weights or p + "in_proj_ba.weight" not in weights:
            continue  # a missing tensor is reported by the model's own check
        qkvz = out.pop(p + "in_proj_qkvz.weight")
        hidden = qkvz.shape[-1]
        per_group = qkvz.view(key_heads, -1, hidden)  # [key_heads, 2 * key_dim + 2 * served, hidden]
        q, k, v, z = per_group.split((key_dim, key_dim, served, served), dim=1)
        out[p + "in_proj_qkv.weight"] = torch.cat([t.reshape(-1, hidden) for t in (q, k, v)])
        out[p + "in_proj_z.weight"] = z.reshape(-1, hidden)
        b, a = out.pop(p + "in_proj_ba.weight").view(key_heads, 2 * group, hidden).split(group, dim=1)
        out[p + "in_proj_b.weight"], out[p + "in_proj_a.weight"] = b.reshape(-1, hidden), a.reshape(-1, hidden)
    return out


class Qwen3NextForCausalLM(Qwen35MoeForCausalLM):
    def load_weights(self, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """DeltaNet projections split per kind, then the experts converted as Qwen3.5-MoE's."""
        super().load_weights(split_grouped_projections(self.config, weights), source)
