"""The decoder-only causal LM shared by every family, with hidden-state capture.

A forward takes token ids and their RoPE positions, writes K/V into an optional `KVCache`, and can return the
residual stream after chosen decoder layers (before the final norm): DFlash drafters are conditioned on them.
Family files (`llama.py`, `qwen3.py`, `gemma3.py`, `qwen3_moe.py`) only choose the decoder layer and the RoPE
bases; the hybrids (`qwen3_5.py`, `qwen3_next.py`) also give their caches the linear layers' recurrent state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch import nn

from dflash.config import SLIDING_ATTENTION, ModelConfig
from dflash.errors import ModelLoadError
from dflash.kv.cache import AttentionBackend, CacheWriter, KVCache
from dflash.models.layers import CAUSAL, AttentionMask, DecoderLayer, RMSNorm, embedding
from dflash.models.native_stack import native_layers
from dflash.models.rope import Rotary
from dflash.parallel.layers import VocabParallelEmbedding, VocabParallelHead, split_layers
from dflash.parallel.sharding import shard_config

if TYPE_CHECKING:
    from dflash.parallel.group import TensorParallel

LogitsMode = Literal["all", "last", "none"]

# On a GPU a forward without cache, mask or positions (the frozen target over training batches) runs its full-
# attention layers through SDPA's causal kernels instead of a materialised [batch, 1, seq, seq] mask.
CAUSAL_KERNELS = True


def causal_by_position(positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """positions [batch, seq], key_positions [batch, keys] -> bool [batch, 1, seq, keys]: a key is visible when
    its position is not after the query's (pads carry a position past every real one, so nothing sees them)."""
    return (key_positions[:, None, :] <= positions[:, :, None])[:, None]


def scaled_embeddings(embed_tokens: nn.Module, config: ModelConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids: [batch, seq] -> [batch, seq, hidden], times the family's embedding scale."""
    x: torch.Tensor = embed_tokens(input_ids)
    if config.embed_scale != 1.0:
        x = x * torch.tensor(config.embed_scale, dtype=x.dtype)
    return x


def capped_logits(lm_head: nn.Module, config: ModelConfig, hidden: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden [..., hidden] -> logits [..., vocab], soft-capped where the family is."""
    logits: torch.Tensor = lm_head(hidden)
    cap = config.final_logit_softcapping
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [batch, seq or 1, vocab]
    features: torch.Tensor | None  # [batch, seq, len(capture) * hidden]: captured layer outputs, concatenated


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; subclasses pick the layer type.

    With `tensor_parallel` this process holds one rank's share of the decoder layers (`dflash.parallel`): a
    world-th of the heads and MLP width (`layer_config`), with row-parallel output projections, and of the
    vocabulary's rows of the embeddings and LM head where it divides evenly; their outputs are combined across the
    ranks, so the residual stream, the captured features and the logits are the same on every rank. `config`
    always describes the whole model."""

    layer_class: ClassVar[type[nn.Module]] = DecoderLayer
    @property
    def capturable(self) -> bool:
        """Whether a forward's work is fixed by its shapes, so CUDA graphs can capture it (not so where the host
        decides what runs, as per-expert products do)."""
        return True

    def __init__(self, config: ModelConfig, tensor_parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tensor_parallel = tensor_parallel
        self.layer_config = config if tensor_parallel is None else shard_config(config, tensor_parallel.world)
        vocab_rows = self.layer_config.vocab_size  # a world-th of the vocabulary where it is split across ranks
        self.embed_tokens: nn.Embedding
        self.lm_head: nn.Linear
        if tensor_parallel is not None and vocab_rows != config.vocab_size:
            self.embed_tokens = VocabParallelEmbedding(vocab_rows, config.hidden_size, tensor_parallel)
            self.lm_head = VocabParallelHead(config.hidden_size, vocab_rows, tensor_parallel)
        else:
            self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.layers = nn.ModuleList(self.layer_class(self.layer_config, i) for i in range(config.num_layers))
        if tensor_parallel is not None and tensor_parallel.world > 1:
            split_layers(self.layers, tensor_parallel)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_adds_one)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config.rotary_dim, config.rope_theta, config.rope_scaling)
        local_theta = config.rope_local_theta
        self.rotary_local = Rotary(config.head_dim, local_theta) if local_theta is not None else self.rotary
        self.sliding = [t == SLIDING_ATTENTION for t in config.layer_types]

    # ---- the small interface a drafter uses -------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [batch, seq] -> [batch, seq, hidden], with the family's embedding scale applied."""
        return scaled_embeddings(self.embed_tokens, self.config, input_ids)

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [..., hidden] -> logits [..., vocab] (soft-capped where the family does)."""
        return capped_logits(self.lm_head, self.config, hidden)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        return KVCache.matching(self.layer_config, capacity, self.embed_tokens.weight, batch)  # this rank's heads

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        attn_mask: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        capture: Sequence[int] = (),
        logits: LogitsMode = "all",
    ) -> ForwardOutput:
        """input_ids, positions: [batch, seq]; attn_mask: optional [batch or 1, seq, keys] bool (True = visible),
        where keys = cache.length + seq (the committed slots then the new tokens); tree_mask: optional [seq, seq]
        bool, the visibility among the new tokens when each sees every committed slot (tree verification).
        Without a mask attention is causal by position. The cache length advances by seq."""
        batch, seq = input_ids.shape
        past = cache.length if cache is not None else 0
        if tree_mask is not None:
            if attn_mask is not None:
                raise ValueError("give attn_mask or tree_mask, not both")
            committed = torch.ones(seq, past, dtype=torch.bool, device=tree_mask.device)
            attn_mask = torch.cat((committed, tree_mask.to(torch.bool)), dim=1)[None]  # [1, seq, past + seq]
        plain_causal = positions is None and cache is None and attn_mask is None
        if positions is None:
            positions = torch.arange(past, past + seq, device=input_ids.device).expand(batch, seq)
        if cache is not None:
            cache.reserve(seq)
            key_positions = cache.write_positions(positions)
        else:
            key_positions = positions
        full_mask: AttentionMask
        full_mask, sliding_mask = self._masks(positions, key_positions, attn_mask)
        if plain_causal and CAUSAL_KERNELS and input_ids.is_cuda:
            full_mask = CAUSAL
        x, features = self.run_layers(input_ids, positions, full_mask, sliding_mask, cache, capture)
        if cache is not None:
            cache.advance(seq)
        return self.finish(x, features, logits)

    def run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        full_mask: AttentionMask,
        sliding_mask: torch.Tensor | None,
        cache: CacheWriter | AttentionBackend | None,
        capture: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding and every decoder layer. input_ids, positions: [batch, seq]; masks: [batch or 1, 1, seq, keys]
        -> (residual stream [batch, seq, hidden], captured features [batch, seq, len(capture) * hidden] or None)."""
        dtype = self.embed_tokens.weight.dtype
        cos, sin = self.rotary.cos_sin(positions, dtype)
        local_cos, local_sin = (cos, sin) if self.rotary_local is self.rotary else self.rotary_local.cos_sin(positions, dtype)
        x = self.embed(input_ids)
        native = native_layers(self, x, cos, sin, full_mask, cache, capture)
        if native is not None:  # every layer in one native call, bitwise the loop below
            return native
        wanted = set(capture)
        captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            if self.sliding[index]:
                x = layer(x, local_cos, local_sin, sliding_mask, cache)
            else:
                x = layer(x, cos, sin, full_mask, cache)
            if index in wanted:
                captured[index] = x
        features = torch.cat([captured[layer] for layer in capture], dim=-1) if capture else None
        return x, features

    def finish(self, x: torch.Tensor, features: torch.Tensor | None, logits: LogitsMode) -> ForwardOutput:
        """Final norm and LM head over the residual stream x [batch, seq, hidden] as `logits` asks."""
        if logits == "none":
            return ForwardOutput(None, features)
        if logits == "last":
            x = x[:, -1:]
        return ForwardOutput(self.project_logits(self.norm(x)), features)

    def _masks(
        self, positions: torch.Tensor, key_positions: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Boolean masks [batch, 1, seq, keys] for full-attention and sliding-window layers (None = all visible)."""
        batch, seq = positions.shape
        full: torch.Tensor | None
        if attn_mask is not None:
            full = attn_mask.view(-1, 1, seq, key_positions.shape[1])
        elif batch == 1 and seq == 1:
            full = None  # the newest token sees every committed slot
        else:
            full = causal_by_position(positions, key_positions)
        sliding = None
        window = self.sliding_window
        if window is not None:
            in_window = (positions[:, :, None] - key_positions[:, None, :] < window)[:, None]
            sliding = in_window if full is None else full & in_window
        return full, sliding

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding-attention layers, None when the model has none."""
        return self.config.sliding_window if any(self.sliding) else None

    # ---- weights -----------------------------------------------------------------------------------------
    def load_weights(self, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Copy Hugging Face-named tensors into the fused modules (q/k/v and gate/up are concatenated)."""
        own = self.state_dict()
        fused: dict[str, torch.Tensor] = {}
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            attn = [weights.get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            if all(t is not None for t in attn):
                fused[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(attn, dim=0)  # type: ignore[arg-type]
            bias = [weights.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            if all(t is not None for t in bias):
                fused[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(bias, dim=0)  # type: ignore[arg-type]
            mlp = [weights.get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
            if all(t is not None for t in mlp):
                fused[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(mlp, dim=0)  # type: ignore[arg-type]
        fused_parts = (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.", ".mlp.gate_proj.", ".mlp.up_proj.")
        for name, tensor in weights.items():
            if not any(part in name for part in fused_parts):
                fused.setdefault(name.removeprefix("model."), tensor)
        if self.config.tie_word_embeddings:
            fused.pop("lm_head.weight", None)
            own.pop("lm_head.weight", None)
        missing = sorted(set(own) - set(fused))
        if missing:
            raise ModelLoadError(f"{source}: missing weights {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for key, target in own.items():
                value = fused[key]
                if tuple(value.shape) != tuple(target.shape):
                    raise ModelLoadError(
                        f"{source}: tensor {key} has shape {tuple(value.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(value.to(target.dtype))
