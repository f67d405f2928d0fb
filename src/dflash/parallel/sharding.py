"""Which part of each weight a rank keeps: Megatron-style column and row splits of the decoder layers.

Column-parallel (output rows split): q, k, v (weights and biases) and gate, up. Row-parallel (input columns split):
o and down, whose partial outputs are summed across ranks (`dflash.parallel.layers`). Rank r keeps attention heads
[r * H/N, (r+1) * H/N) and key/value heads [r * KV/N, (r+1) * KV/N); with grouped queries a query head j reads key/
value head j // (H/KV), so every rank's query heads read only its own key/value heads, and its KV cache holds only
those. The embeddings and the LM head are replicated, or, with `vocab_split`, split by vocabulary rows (rank r
keeps ids [r * V/N, (r+1) * V/N); `VocabParallelEmbedding` / `VocabParallelHead` make their outputs whole again);
norms are replicated. Weights are named as in Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`), which every loader
produces.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dflash import environment
from dflash.config import ModelConfig
from dflash.errors import ModelLoadError

__all__ = ["ShardSpan", "shard_config", "shard_span", "shard_weights", "vocab_split"]

ShardSpan = tuple[int, int, int]  # (dimension, start, length) of a rank's part of a tensor

# HF name endings -> (split dimension, what sets the part's length)
_SPLITS: dict[str, tuple[int, str]] = {
    "self_attn.q_proj.weight": (0, "q"),
    "self_attn.q_proj.bias": (0, "q"),
    "self_attn.k_proj.weight": (0, "kv"),
    "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"),
    "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "mlp"),
    "mlp.up_proj.weight": (0, "mlp"),
    "mlp.down_proj.weight": (1, "mlp"),
}


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The configuration of one rank's share: a world-th of the heads, key/value heads and MLP width, and of the
    vocabulary's rows where they divide evenly (`vocab_split`)."""
    if world == 1:
        return config
    if config.is_hybrid:
        raise ModelLoadError(f"--tensor-parallel {world}: linear-attention (hybrid) models are not split across ranks")
    if config.architecture == "gemma4":
        raise ModelLoadError(
            f"--tensor-parallel {world}: Gemma 4 models (mixed head sizes, shared K/V) are not split across devices "
            "yet; run them on one device"
        )
    if config.is_moe:
        raise ModelLoadError(
            f"--tensor-parallel {world}: mixture-of-experts models ({config.architecture}) are not split across "
            "devices yet; run them on one device"
        )
    for what, count in (
        ("attention heads", config.num_heads),
        ("key/value heads", config.num_kv_heads),
        ("MLP width (intermediate_size)", config.intermediate_size),
    ):
        if count % world:
            raise ModelLoadError(f"--tensor-parallel {world}: the model's {count} {what} do not split evenly")
    return replace(
        config,
        num_heads=config.num_heads // world,
        num_kv_heads=config.num_kv_heads // world,
        intermediate_size=config.intermediate_size // world,
        vocab_size=config.vocab_size // world if vocab_split(config, world) else config.vocab_size,
    )


def vocab_split(config: ModelConfig, world: int) -> bool:
    """Whether the embeddings and the LM head are split by vocabulary rows across `world` ranks: where the
    vocabulary divides evenly, unless DFLASH_TP_VOCAB_SPLIT=0. Each rank then reads half the head's bytes per step
    (a 32B model's step 0.17-0.27 ms shorter on two H200s, `results/gpu_tensor_parallel_h200.json`) for an
    all-gather of the logits."""
    return world > 1 and config.vocab_size % world == 0 and environment.tp_vocab_split()


def shard_span(name: str, config: ModelConfig, rank: int, world: int) -> ShardSpan | None:
    """Rank `rank`'s part of the tensor `name` (HF naming), or None when every rank keeps all of it."""
    if world == 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        if not vocab_split(config, world):
            return None
        rows = config.vocab_size // world
        return 0, rank * rows, rows
    if not name.startswith("model.layers."):
        return None
    for ending, (dim, kind) in _SPLITS.items():
        if name.endswith(ending):
            local = shard_config(config, world)
            length = {
                "q": local.num_heads * local.head_dim,
                "kv": local.num_kv_heads * local.head_dim,
                "mlp": local.intermediate_size,
            }[kind]
            return dim, rank * length, length
    return None


def shard_weights(
    weights: dict[str, torch.Tensor], config: ModelConfig, rank: int, world: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights: split tensors narrowed to its part (views), the others as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        span = shard_span(name, config, rank, world)
        out[name] = tensor if span is None else tensor.narrow(*span)
    return out
