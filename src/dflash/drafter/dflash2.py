"""The DFlash2 drafter: DFlash's one-pass block drafter plus block convolutions and a candidate selector.

Every layer wraps its attention and its MLP in a `BlockDynamicConv` (taps inside the block only), and a
`CandidateSelector` picks the round's chain from each row's top-k candidates. The rest (context from target
features, borrowed embedding and LM head, K/V cache of context rows) is DFlash's (`dflash.drafter.model`).
Config and weight names follow the published checkpoints; see docs/dflash2.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from dflash.drafter.block_conv import BlockDynamicConv
from dflash.drafter.model import DFlashDrafter, DrafterConfig, DrafterLayer, TargetModel
from dflash.drafter.selector import CandidateLattice, CandidateSelector, SelectedChain
from dflash.errors import ModelLoadError
from dflash.kv.cache import KVCache

DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
_DFLASH2_KEYS = ("selector_rank", "selector_top_k", "conv_kernel_size")


def is_dflash2_config(raw: dict[str, Any]) -> bool:
    """Whether a drafter config.json describes a DFlash2 drafter (its architecture, or any DFlash2 field)."""
    nested = raw.get("dflash_config") or {}
    return DFLASH2_ARCHITECTURE in (raw.get("architectures") or []) or any(
        nested.get(key, raw.get(key)) for key in _DFLASH2_KEYS
    )


@dataclass(frozen=True)
class DFlash2Config(DrafterConfig):
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    input_embedding_scale: float = 1.0
    # sliding layers causal inside the block (DFlash's rule, `is_causal` unset) or not (`is_causal: false`, the
    # published DFlash2 drafters: the window then only limits the context)
    sliding_block_causal: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DFlash2Config:
        """The published layout: DFlash2 fields in `dflash_config` (winning over top-level ones), Qwen3 fields at
        the top level. `num_target_layers` may be absent when `target_layer_ids` is given."""
        nested = raw.get("dflash_config") or {}

        def value(key: str, default: Any = None) -> Any:
            return nested.get(key, raw.get(key, default))

        patched = dict(raw)
        if "block_size" in nested:
            patched["block_size"] = nested["block_size"]
        layer_ids = value("target_layer_ids")
        if not (raw.get("num_target_layers") or nested.get("num_target_layers")) and layer_ids:
            # only used to derive default layer ids: the fit to the target is checked on the ids themselves
            patched["num_target_layers"] = max(int(i) for i in layer_ids) + 1
        rope = raw.get("rope_parameters")
        if "rope_theta" not in raw and isinstance(rope, dict) and "rope_theta" in rope:
            patched["rope_theta"] = rope["rope_theta"]
        base = DrafterConfig.from_dict(patched, source)
        for unsupported, neutral in (("output_multiplier", 1.0), ("final_logit_softcapping", None)):
            if value(unsupported) not in (neutral, None, 0):
                raise ModelLoadError(f"{source}: DFlash2 {unsupported}={value(unsupported)!r} is not supported")
        try:
            extra: dict[str, Any] = {
                "conv_kernel_size": int(value("conv_kernel_size")),
                "conv_group_size": int(value("conv_group_size", 16)),
                "selector_rank": int(value("selector_rank")),
                "selector_top_k": int(value("selector_top_k")),
                "input_embedding_scale": float(value("input_embedding_scale", 1.0)),
            }
        except (TypeError, ValueError):
            raise ModelLoadError(
                f"{source}: a DFlash2 drafter needs conv_kernel_size, selector_rank and selector_top_k "
                f"(got {[value(key) for key in _DFLASH2_KEYS]})"
            ) from None
        causal = raw.get("is_causal", nested.get("causal"))
        if causal:
            raise ModelLoadError(f"{source}: DFlash2 is_causal=true (causal full-attention layers) is not supported")
        extra["sliding_block_causal"] = causal is None
        problems = [f"{key} {extra[key]} < 1" for key in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                         "selector_top_k") if extra[key] < 1]
        if not problems and base.hidden_size % extra["conv_group_size"]:
            problems.append(f"hidden_size {base.hidden_size} is not a multiple of conv_group_size "
                            f"{extra['conv_group_size']}")
        if problems:
            raise ModelLoadError(f"{source}: bad DFlash2 config: " + "; ".join(problems))
        return cls(**{f.name: getattr(base, f.name) for f in fields(DrafterConfig)}, **extra)

    def to_dict(self) -> dict[str, Any]:
        """The published DFlash2 config layout."""
        raw = super().to_dict()
        raw["architectures"] = [DFLASH2_ARCHITECTURE]
        raw["dflash_config"] = {
            **raw["dflash_config"],
            "block_size": raw.pop("block_size"),
            "conv_kernel_size": self.conv_kernel_size,
            "conv_group_size": self.conv_group_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
            "input_embedding_scale": self.input_embedding_scale,
        }
        if not self.sliding_block_causal:
            raw["is_causal"] = False
        return raw


class DFlash2Layer(DrafterLayer):
    """A DFlash layer whose attention and MLP each sit between the two halves of a block convolution."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config)
        sizes = (config.hidden_size, config.conv_kernel_size, config.conv_group_size, config.block_size)
        self.attention_conv = BlockDynamicConv(*sizes)
        self.mlp_conv = BlockDynamicConv(*sizes)

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
        """x: [batch, rows, hidden] -> [batch, rows, hidden], or its `queries` rows. Every row is computed: the
        output convolution of a row reads its predecessor's sub-layer output."""
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        attended = self.self_attn(h, cos, sin, context_k, context_v, mask, None, context_rows)
        x = x + self.attention_conv.finish(attended, kernel)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        x = x + self.mlp_conv.finish(self.mlp(h), kernel)
        return x if queries is None else x[:, queries]


class DFlash2Drafter(DFlashDrafter):
    """Module tree mirrors the published checkpoint names (DFlash's plus layers.N.{attention,mlp}_conv and
    candidate_selector)."""

    config: DFlash2Config

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(DFlash2Layer(config) for _ in range(config.num_layers))
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k
        )

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
        """`DFlashDrafter.draft_hidden` with the published input embedding scale."""
        scale = self.config.input_embedding_scale
        embeds = block_embeds if scale == 1.0 else block_embeds * scale
        return super().draft_hidden(
            embeds, block_positions, new_features, new_positions, cache, window=window, outputs=outputs
        )

    def forward_blocks(
        self, block_embeds: torch.Tensor, block_positions: torch.Tensor, features: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        scale = self.config.input_embedding_scale
        return super().forward_blocks(block_embeds * scale, block_positions, features, mask)

    @property
    def sliding_block_causal(self) -> bool:
        return self.config.sliding_block_causal

    def _inference_masks(
        self, block_positions: torch.Tensor, context_positions: torch.Tensor
    ) -> dict[bool, torch.Tensor | None]:
        """DFlash's masks, or with `is_causal: false` sliding layers that see the whole block (and the context
        within their window)."""
        if self.config.sliding_block_causal or not any(self.sliding):
            return super()._inference_masks(block_positions, context_positions)
        keys = torch.cat((context_positions, block_positions), dim=1)  # [batch, keys]
        distance = block_positions[:, :, None] - keys[:, None, :]  # [batch, block, keys]
        visible = distance < (self.config.sliding_window or 1 << 30)  # block keys (distance <= 0) always pass
        return {False: None, True: visible[:, None]}

    def draft_lattice(
        self,
        target: TargetModel,
        pending_token: int,
        start: int,
        new_features: torch.Tensor,
        cache: KVCache,
        *,
        window: int | None = None,
        num_drafts: int | None = None,
    ) -> CandidateLattice:
        """One drafter round (the block [pending, MASK x (B-1)] at positions start.., as `draft_scores`) -> the
        selector's candidates for the `num_drafts` rows after `pending` (default B-1)."""
        last = self.config.block_size if num_drafts is None else 1 + num_drafts
        device = self.fc.weight.device
        block = torch.full((1, self.config.block_size), self.config.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = pending_token
        block_positions = torch.arange(start, start + self.config.block_size, device=device)[None]
        new_positions = torch.arange(cache.length, cache.length + new_features.shape[1], device=device)[None]
        hidden = self.draft_hidden(target.embed(block), block_positions, new_features, new_positions, cache,
                                   window=window, outputs=slice(1, last))[0]  # [last - 1, hidden]
        return self.candidate_selector.lattice(hidden, self.project_scores(target, hidden))

    def draft_chain(
        self,
        target: TargetModel,
        pending_token: int,
        start: int,
        new_features: torch.Tensor,
        cache: KVCache,
        *,
        window: int | None = None,
        num_drafts: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> SelectedChain:
        """One round's drafts: the selector's walk from `pending_token` (greedy at temperature 0, else sampled with
        the q the verification needs)."""
        lattice = self.draft_lattice(
            target, pending_token, start, new_features, cache, window=window, num_drafts=num_drafts
        )
        return lattice.walk(pending_token, temperature, generator)
