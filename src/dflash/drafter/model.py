"""The DFlash drafter: a few Qwen3-style layers that fill a block of MASK tokens in one pass.

The drafter is conditioned on target features (the residual stream after chosen target layers). Those are
projected once per round, `ctx = hidden_norm(fc(features))`, and enter every drafter layer only as extra
keys/values in front of the block's own keys/values; only block rows are queries. Full-attention layers are
non-causal (the block sees itself both ways); sliding-window layers are causal inside their window.
The drafter borrows the target's embedding and LM head through the `TargetModel` interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import SLIDING_ATTENTION, ModelConfig
from dflash.drafter.native_drafter import native_absorb, native_block
from dflash.errors import ModelLoadError
from dflash.kernels.fused_cpu import layer_ops
from dflash.kv.cache import KVCache
from dflash.models.layers import RMSNorm, activation, fits_attention_kernel
from dflash.models.native_parts import layers_changed
from dflash.models.rope import Rotary, apply_rotary

if TYPE_CHECKING:
    from dflash.drafter.vocab import DraftHead, DraftScores


class TargetModel(Protocol):
    """What a drafter may use of its target."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class TargetHeads(TargetModel, Protocol):
    """What the fast path's drafter rounds read of the target besides the two methods: the modules behind them
    (a `CausalLM`, or the copies kept on the drafter's own device, `dflash.drafter.borrowed_heads`)."""

    @property
    def embed_tokens(self) -> nn.Module: ...

    @property
    def lm_head(self) -> nn.Module: ...

    @property
    def config(self) -> ModelConfig: ...


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Evenly spaced from layer 1 to L-3 (the published rule); one feature takes the middle layer."""
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


@dataclass(frozen=True)
class DrafterConfig:
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        """Read the published layout; DFlash fields may be nested under `dflash_config` or at top level."""
        nested = raw.get("dflash_config") or {}
        try:
            layers = int(raw["num_hidden_layers"])
            num_target_layers = int(raw.get("num_target_layers") or nested.get("num_target_layers") or -1)
            if num_target_layers < 1:
                raise KeyError("num_target_layers")
            mask_id = nested.get("mask_token_id", raw.get("mask_token_id"))
            if mask_id is None:
                raise KeyError("mask_token_id")
            layer_ids = nested.get("target_layer_ids", raw.get("target_layer_ids"))
            if layer_ids is None:
                layer_ids = default_target_layer_ids(num_target_layers, layers)
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            layer_types = tuple(raw.get("layer_types") or ("full_attention",) * layers)
            return cls(
                block_size=int(raw.get("block_size", nested.get("block_size", 16))),
                mask_token_id=int(mask_id),
                target_layer_ids=tuple(int(i) for i in layer_ids),
                num_target_layers=num_target_layers,
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                rope_scaling=raw.get("rope_scaling") or None,
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                layer_types=layer_types,
                sliding_window=int(raw["sliding_window"]) if raw.get("sliding_window") else None,
                hidden_act=str(raw.get("hidden_act", "silu")),
            )
        except (KeyError, TypeError) as exc:
            raise ModelLoadError(f"{source}: not a DFlash drafter config (missing or bad field: {exc})") from None

    def to_dict(self) -> dict[str, Any]:
        """The published (z-lab) config layout."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "hidden_act": self.hidden_act,
            "attention_bias": False,
            "tie_word_embeddings": False,
        }

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features the drafter reads (the fc input)."""
        return len(self.target_layer_ids) * self.hidden_size


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        # Inference-only concatenations of [k; v] and [q; k; v] (`fuse_projections`): one product instead of two
        # or three where each call has a fixed cost (the CPU kernels). Not part of the checkpoint.
        self.kv_proj: nn.Module | None = None
        self.qkv_proj: nn.Module | None = None

    def fuse_projections(self, concatenate: Callable[[list[nn.Module]], nn.Module]) -> None:
        self.kv_proj = concatenate([self.k_proj, self.v_proj])
        self.qkv_proj = concatenate([self.q_proj, self.k_proj, self.v_proj])

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [batch, rows, hidden] -> normed, rotated keys and values [batch, kv_heads, rows, head_dim]."""
        size = self.num_kv_heads * self.head_dim
        k, v = (self.k_proj(x), self.v_proj(x)) if self.kv_proj is None else self.kv_proj(x).split((size, size), -1)
        return self._keys(k, cos, sin), self._values(v)

    def _keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """k: [batch, rows, kv_heads * head_dim] -> normed, rotated [batch, kv_heads, rows, head_dim]."""
        batch, rows, _ = k.shape
        k = self.k_norm(k.view(batch, rows, self.num_kv_heads, self.head_dim))
        return apply_rotary(k.transpose(1, 2), cos, sin)

    def _values(self, v: torch.Tensor) -> torch.Tensor:
        batch, rows, _ = v.shape
        return v.view(batch, rows, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def block_qkv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, queries: slice | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed block rows h [batch, block, hidden] -> rotated queries [batch, heads, queries, head_dim] of the
        `queries` rows (None: all), keys and values [batch, kv_heads, block, head_dim] of every row."""
        if self.qkv_proj is None:
            block_k, block_v = self.keys_values(h, cos, sin)
            projected_q = self.q_proj(h if queries is None else h[:, queries])
        else:
            size = self.num_kv_heads * self.head_dim
            projected_q, k_rows, v_rows = self.qkv_proj(h).split((self.num_heads * self.head_dim, size, size), -1)
            block_k, block_v = self._keys(k_rows, cos, sin), self._values(v_rows)
            if queries is not None:
                projected_q = projected_q[:, queries]
        if queries is not None:
            cos, sin = cos[:, :, queries], sin[:, :, queries]
        batch, rows, _ = projected_q.shape
        q = self.q_norm(projected_q.view(batch, rows, self.num_heads, self.head_dim))
        return apply_rotary(q.transpose(1, 2), cos, sin), block_k, block_v

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor | None,
        queries: slice | None = None,
        context_rows: int | None = None,
    ) -> torch.Tensor:
        """h: normed block rows [batch, block, hidden]; context_k/v: [batch, kv_heads, context, head_dim].
        `queries` picks the block rows whose output is wanted (every row still serves as a key and value).
        `context_rows`: context_k/v are views of a cache with free slots after their first `context_rows`
        (the context); the block's keys and values are written there instead of joined to copies."""
        q, block_k, block_v = self.block_qkv(h, cos, sin, queries)
        if queries is not None:
            mask = None if mask is None else mask[:, :, queries]
        batch, _, rows, _ = q.shape
        if context_rows is None:
            k = torch.cat((context_k, block_k), dim=2)
            v = torch.cat((context_v, block_v), dim=2)
        else:
            end = context_rows + block_k.shape[2]
            context_k[:, :, context_rows:end] = block_k
            context_v[:, :, context_rows:end] = block_v
            k, v = context_k[:, :, :end], context_v[:, :, :end]
        ops = layer_ops(q)
        if ops is not None and fits_attention_kernel(q, mask):
            return self.o_proj(ops.attention(q, k, v, mask, self.head_dim**-0.5))  # [batch, rows, heads * head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, rows, -1))


class DrafterMLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = activation(config.hidden_act)
        self.silu = config.hidden_act == "silu"
        self.gate_up_proj: nn.Module | None = None  # [gate; up] in one product (`fuse_projections`)

    def fuse_projections(self, concatenate: Callable[[list[nn.Module]], nn.Module]) -> None:
        self.gate_up_proj = concatenate([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)  # [..., 2 * intermediate]
        ops = layer_ops(gate_up) if self.silu else None
        if ops is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor | None,
        queries: slice | None = None,
        context_rows: int | None = None,
    ) -> torch.Tensor:
        """x: [batch, block, hidden] -> [batch, block, hidden], or only the `queries` rows of it."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, mask, queries, context_rows)
        x = (x if queries is None else x[:, queries]) + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Module tree mirrors the published checkpoint names (fc, hidden_norm, layers.N..., norm)."""

    draft_head: DraftHead | None

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        self.sliding = [t == SLIDING_ATTENTION for t in config.layer_types] or [False] * config.num_layers
        # the target's LM head cut to a shortlist (`dflash.drafter.vocab`); kept out of the module tree so
        # it is neither exported, quantized nor moved with the drafter (it lives where the target's head does)
        object.__setattr__(self, "draft_head", None)

    @property
    def sliding_block_causal(self) -> bool:
        """Whether sliding-window layers are causal inside the block (always for DFlash)."""
        return True

    def use_draft_vocab(self, ids: torch.Tensor | None, target: Any) -> None:
        """Score only the token ids in `ids` (None: the whole vocabulary). Call after both models are placed."""
        from dflash.drafter.vocab import DraftHead

        object.__setattr__(self, "draft_head", None if ids is None else DraftHead(ids, target))

    def project(self, target: TargetModel, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed drafter hidden [..., hidden] -> draft logits [..., vocab] (-inf outside a shortlist)."""
        head = self.draft_head
        return target.project_logits(hidden) if head is None else head(hidden)

    def project_scores(self, target: TargetModel, hidden: torch.Tensor) -> DraftScores:
        """Final-normed drafter hidden [rows, hidden] -> draft logits over the shortlist (or the whole vocabulary)."""
        from dflash.drafter.vocab import DraftScores

        head = self.draft_head
        if head is None:
            logits = target.project_logits(hidden)  # [rows, vocab]
            return DraftScores(logits, None, logits.shape[-1])
        return head.scores(hidden)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        """Context K/V of committed positions, one slot per position."""
        return KVCache.matching(self.config, capacity, self.fc.weight, batch)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features: [batch, rows, n*target_hidden] -> ctx [batch, rows, hidden]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def absorb_context(self, features: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
        """Append committed context rows to `cache` without running a block: their keys/values in every layer.

        features: [batch, rows, n*target_hidden] of the positions [batch, rows] that follow cache.length."""
        rows = features.shape[1]
        if not rows:
            return
        cache.reserve(rows)
        ctx = self.context(features)  # [batch, rows, hidden]
        cos, sin = self.rotary.cos_sin(positions, self.fc.weight.dtype)
        cache.write_positions(positions)
        if not native_absorb(self, ctx, cos, sin, cache):  # one native call for every layer, bitwise this loop
            layer: Any
            for index, layer in enumerate(self.layers):
                cache.write(index, *layer.self_attn.keys_values(ctx, cos, sin))
        cache.advance(rows)

    def draft_hidden(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        new_features: torch.Tensor,
        new_positions: torch.Tensor,
        cache: KVCache,
        *,
        window: int | None = None,
        outputs: slice | None = None,
    ) -> torch.Tensor:
        """One inference round. Appends the new context rows to `cache` (they are committed positions), then
        runs the block. block_embeds: [batch, block, hidden]; block_positions: [batch, block];
        new_features: [batch, new, n*target_hidden]; new_positions: [batch, new] -> final-normed [batch, block, hidden].
        `window` limits attention to the last `window` context positions. `outputs` returns only those block rows
        ([batch, len(outputs), hidden]): the last layer then computes queries, attention output and MLP for them
        alone (every block row still gives that layer its keys and values)."""
        self.absorb_context(new_features, new_positions, cache)
        length = cache.length
        first = max(0, length - window) if window else 0
        block = block_embeds.shape[1]
        cache.reserve(block)  # the block's keys and values go to the free slots after the context (not committed)
        masks = self._inference_masks(block_positions, cache.positions[:, first:length])
        cos, sin = self.rotary.cos_sin(block_positions, self.fc.weight.dtype)
        x = block_embeds.to(self.fc.weight.dtype)
        native = native_block(self, x, cos, sin, cache, first, masks, outputs)  # bitwise the loop below
        if native is not None:
            return self.norm(native)
        layer: Any
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            slots_k = cache.keys[index, :, :, first : length + block]
            slots_v = cache.values[index, :, :, first : length + block]
            queries = outputs if index == last else None
            x = layer(x, cos, sin, slots_k, slots_v, masks[self.sliding[index]], queries, length - first)
        return self.norm(x)

    def fuse_projections(self, concatenate: Callable[[list[nn.Module]], nn.Module]) -> None:
        """Give every layer one product for [q; k; v], one for [k; v] (context rows) and one for [gate; up];
        `concatenate` builds a module computing its inputs' outputs side by side (inference only)."""
        layer: Any
        for layer in self.layers:
            layer.self_attn.fuse_projections(concatenate)
            layer.mlp.fuse_projections(concatenate)
        layers_changed()  # a plan of the native layers describes the modules before

    def forward_blocks(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        features: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Training forward over many blocks at once, each seeing its own context prefix.

        block_embeds: [batch, blocks*B, hidden]; block_positions: [batch, blocks*B]; features: [batch, seq,
        n*target_hidden] at positions 0..seq-1; mask: [batch, 1, blocks*B, seq + blocks*B] bool -> final-normed
        hidden [batch, blocks*B, hidden]. Full-attention layers only (sliding drafters use the inference path).
        """
        ctx = self.context(features)
        seq = features.shape[1]
        ctx_positions = torch.arange(seq, device=features.device).expand(features.shape[0], seq)
        ctx_cos, ctx_sin = self.rotary.cos_sin(ctx_positions, ctx.dtype)
        cos, sin = self.rotary.cos_sin(block_positions, ctx.dtype)
        x = block_embeds.to(ctx.dtype)
        layer: Any
        for layer in self.layers:
            context_k, context_v = layer.self_attn.keys_values(ctx, ctx_cos, ctx_sin)
            x = layer(x, cos, sin, context_k, context_v, mask)
        return self.norm(x)

    def _inference_masks(self, block_positions: torch.Tensor, context_positions: torch.Tensor) -> dict[bool, torch.Tensor | None]:
        """{sliding?: mask [batch, 1, block, context + block] or None (everything visible)}."""
        masks: dict[bool, torch.Tensor | None] = {False: None, True: None}
        if any(self.sliding):
            keys = torch.cat((context_positions, block_positions), dim=1)
            query = block_positions[:, :, None]
            visible = (keys[:, None, :] <= query) & (query - keys[:, None, :] < (self.config.sliding_window or 1 << 30))
            masks[True] = visible[:, None]
        return masks

    def draft_scores(
        self,
        target: TargetModel,
        pending_token: int,
        start: int,
        new_features: torch.Tensor,
        cache: KVCache,
        *,
        window: int | None = None,
        num_drafts: int | None = None,
    ) -> DraftScores:
        """Block [pending, MASK x (B-1)] at positions start.. -> the drafter's logits for positions start+1 ..
        start+num_drafts (default num_drafts = B-1; fewer rows skip LM-head work, the block itself always has B
        slots as in training), over its shortlist alone where it has one ([num_drafts, size] and the columns' token
        ids): the form the decoding loops read, as they need only the best tokens and their log-probabilities.

        `new_features` [1, new, n*target_hidden] are the features of positions cache.length .. start-1.
        """
        last = self.config.block_size if num_drafts is None else 1 + num_drafts
        device = self.fc.weight.device
        block = torch.full((1, self.config.block_size), self.config.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = pending_token
        block_positions = torch.arange(start, start + self.config.block_size, device=device)[None]
        new_positions = torch.arange(cache.length, cache.length + new_features.shape[1], device=device)[None]
        hidden = self.draft_hidden(target.embed(block), block_positions, new_features, new_positions, cache,
                                   window=window, outputs=slice(1, last))  # [1, last - 1, hidden]
        return self.project_scores(target, hidden[0])
