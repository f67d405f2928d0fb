"""The static target forward with fused element-wise kernels (`dflash.kernels.triton_decode`).

Same inputs, outputs and cache writes as `static_target_forward`'s layer loop, for the pre-norm families whose
layers are plain `DecoderLayer`s with SiLU MLPs (Llama, SmolLM2, Qwen3), and Qwen3-MoE's where its experts run
through the grouped product (the mixture is the block's own forward). Per layer: add+RMSNorm, QKV product,
q/k norm + rotary + cache store, attention (SDPA for one row, the split-key program for a few), output product,
add+RMSNorm, gate/up product, SiLU*up, down product. The products (and the LM head, `fused_logits`) go through
`dflash.kernels.triton_skinny.fast_linear`: the skinny program for up to 64 rows, cuBLAS beyond.
The residual add after the MLP is deferred into the next layer's add+RMSNorm, whose sum output is therefore the
previous layer's output (what feature capture needs). Under tensor parallelism the layers hold this rank's heads
and MLP width (`CausalLM.layer_config`) and the output and down products are summed across the ranks inside the
captured graph, by the add+RMSNorm that follows each (`PartialSums.add_rms_norm`: one kernel with the symmetric
buffer; the sum then the add+RMSNorm otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash import environment
from dflash.drafter.model import TargetHeads
from dflash.fastpath.static_forward import block_visibility
from dflash.kernels.triton_attention import attention_kernel_usable, few_row_attention
from dflash.kernels.triton_decode import add_rms_norm, rope_and_store, silu_and_mul, triton_available
from dflash.kernels.triton_gguf_int8 import QuantizedInput, add_rms_norm_quantized, silu_and_mul_quantized
from dflash.kernels.triton_skinny import fast_linear
from dflash.kv.cache import KVCache
from dflash.models.gpu_quantized_layers import GGUFLinear
from dflash.models.int8_linear import Int8Linear
from dflash.models.layers import DecoderLayer, GatedMLP, RMSNorm
from dflash.models.model import CausalLM
from dflash.models.moe import SparseMoeBlock
from dflash.models.quantized_model import InputOrdered
from dflash.models.qwen3_moe import Qwen3MoeDecoderLayer
from dflash.parallel.collectives import PartialSums
from dflash.parallel.layers import RowParallelLinear, VocabParallelHead

SPLIT_MAX_ROWS = 128  # the largest forward measured (`benchmarks/gpu_attention_rows.py`): the runner's graph rows


def split_key_attention(rows: int) -> bool:
    """Whether a forward of `rows` query rows attends through the split-key Triton program
    (`dflash.kernels.triton_attention`) instead of SDPA: for 2 to `SPLIT_MAX_ROWS` rows (verifications, tree
    verifications, prefill chunks), where it measured 1.3x to 10x faster than SDPA on an H100; one-row steps keep
    SDPA, which is faster there. DFLASH_ATTENTION=sdpa keeps SDPA everywhere (read when a graph is captured)."""
    return 1 < rows <= SPLIT_MAX_ROWS and environment.attention() == "split"


def supports_fused_layers(model: CausalLM) -> bool:
    """Dense pre-norm layers (`DecoderLayer`), or Qwen3-MoE's (the same attention; a `SparseMoeBlock` MLP run as
    it is, through the grouped product, so only where the model is capturable)."""
    config = model.config
    return (
        triton_available()
        and all(type(layer) is DecoderLayer or _fusable_expert_layer(model, layer) for layer in model.layers)
        and config.hidden_act == "silu"
        and not config.norm_adds_one
        and not any(model.sliding)
        and config.head_dim % 2 == 0
        and config.head_dim & (config.head_dim - 1) == 0
        and not config.final_logit_softcapping
    )


def _fusable_expert_layer(model: CausalLM, layer: nn.Module) -> bool:
    return (
        type(layer) is Qwen3MoeDecoderLayer and model.capturable
        and (type(layer.mlp) is SparseMoeBlock or type(layer.mlp) is GatedMLP)
    )


def apply_linear(x: torch.Tensor, module: nn.Module, rounded: QuantizedInput | None = None) -> torch.Tensor:
    """module(x) for x [rows, in] through `fast_linear`: an `nn.Linear`, an `Int8Linear` (int8 rows), or a
    `RowParallelLinear` (this rank's product, then the sum over the ranks), or a `VocabParallelHead` (this rank's
    logits, then every rank's gathered); a `GGUFLinear` through its own block program, an `InputOrdered` one
    after reordering x. `rounded`: x's rows rounded for a `GGUFLinear` that reads them so (`rounds_for`)."""
    if isinstance(module, Int8Linear):
        return fast_linear(x, module.values, module.bias, module.scales)
    if isinstance(module, RowParallelLinear):
        return module.reduce(fast_linear(x, module.weight))  # the sum over the ranks, then any bias
    if isinstance(module, VocabParallelHead):
        return module.gather(fast_linear(x, module.weight))
    if isinstance(module, GGUFLinear):
        return module(x, rounded)  # GGUF blocks or words: their programs (`dflash.kernels.gpu_quantized_products`)
    if isinstance(module, InputOrdered):  # stored columns out of the input's order (a hybrid's GGUF out_proj)
        return apply_linear(x.index_select(-1, module.order), module.inner)
    assert isinstance(module, nn.Linear)
    return fast_linear(x, module.weight, module.bias)


@dataclass(frozen=True)
class Owed:
    """A sub-layer's output not yet added to the residual stream: rows [rows, hidden], with the sum over the ranks
    still to do where they are a row-parallel product's partial rows (`sums`), which the next add+RMSNorm does."""

    rows: torch.Tensor
    sums: PartialSums | None = None


# Which of the symmetric buffer's two regions a sub-layer's sum goes through: consecutive sums must alternate
# (`dflash.kernels.triton_rank_sums`), and each layer has one of each, in this order.
ATTENTION_REGION, MLP_REGION = 0, 1


def last_product(x: torch.Tensor, module: nn.Module, rounded: QuantizedInput | None = None) -> Owed:
    """A sub-layer's last product, module(x) for x [rows, in]; a row-parallel one's sum over the ranks is left to
    the add+RMSNorm that follows (`add_norm`)."""
    if isinstance(module, RowParallelLinear) and module.bias is None:
        return Owed(fast_linear(x, module.weight), module.tensor_parallel.sums)
    return Owed(apply_linear(x, module, rounded))  # a biased row-parallel product: summed (then the bias) right away


def rounds_for(module: nn.Module, rows: int) -> bool:
    """Whether `module` multiplies `rows` rows through their 8-bit rounding (a `GGUFLinear` of words), which the
    program producing them then makes in the same launch (`add_norm_for`, `silu_and_mul_quantized`): bitwise the
    rounding the product would make, one launch fewer."""
    return isinstance(module, GGUFLinear) and module.rounds_input(rows)


def add_norm(x: torch.Tensor, owed: Owed | None, norm: RMSNorm, region: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm(x, owed rows)` with any sum over the ranks the rows still owe -> (normed [rows, hidden],
    the residual stream with the rows added [rows, hidden])."""
    if owed is None or owed.sums is None:
        return add_rms_norm(x, None if owed is None else owed.rows, norm.weight, norm.eps, adds_one=norm.adds_one)
    return owed.sums.add_rms_norm(owed.rows, x, norm.weight, norm.eps, region)


def add_norm_for(
    x: torch.Tensor, owed: Owed | None, norm: RMSNorm, region: int, consumer: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, QuantizedInput | None]:
    """`add_norm`, with the normed rows also rounded for `consumer` in the same program where it reads them rounded
    -> (normed, the residual stream, the rounding or None)."""
    if (owed is None or owed.sums is None) and rounds_for(consumer, x.shape[0]):
        return add_rms_norm_quantized(
            x, None if owed is None else owed.rows, norm.weight, norm.eps, adds_one=norm.adds_one
        )
    h, x = add_norm(x, owed, norm, region)
    return h, x, None


def fused_logits(model: TargetHeads, hidden: torch.Tensor) -> torch.Tensor:
    """`model.project_logits(hidden)` for hidden [rows, hidden] -> [rows, vocab], the head through `fast_linear`
    where it is a plain linear layer and no soft-capping follows."""
    if isinstance(model.lm_head, nn.Linear) and not model.config.final_logit_softcapping:
        return apply_linear(hidden, model.lm_head)
    return model.project_logits(hidden)


def forward_setup(
    model: CausalLM, storage: KVCache, positions: torch.Tensor, length: torch.Tensor, tree_mask: torch.Tensor,
    bucket: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new rows' slots [rows] (their positions written into `storage`), additive mask [1, 1, rows, bucket] and
    rotary cos, sin [rows, head_dim]: one program (`dflash.kernels.triton_round_setup`) where the rotary table is
    prepared, torch ops otherwise. positions: [1, rows]; length: [1] long; tree_mask: [rows, rows] bool."""
    rows = positions.shape[1]
    dtype = model.embed_tokens.weight.dtype
    table = model.rotary.table(dtype, positions.device)
    if table is not None and tree_mask.is_contiguous():
        from dflash.kernels.triton_round_setup import target_setup

        slots, additive, cos, sin = target_setup(
            length, positions[0], tree_mask, storage.positions[0], table, bucket, dtype
        )
        return slots, additive[None, None], cos, sin
    slots = length + torch.arange(rows, device=positions.device)  # [rows]
    storage.positions[0].index_copy_(0, slots, positions[0])
    visible = block_visibility(length, tree_mask, bucket)[None, None]  # [1, 1, rows, bucket]
    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    cos, sin = model.rotary.rows_cos_sin(positions[0], dtype)  # [rows, head_dim]
    return slots, additive, cos, sin


def embed_rows(model: TargetHeads, input_ids: torch.Tensor) -> torch.Tensor:
    """model.embed(input_ids)[0] for input_ids [1, rows] -> [rows, hidden] contiguous; a plain embedding as one
    gather (CUDA's index_select, which an embedding lookup is, takes several microseconds for 2-16 ids)."""
    embedding = model.embed_tokens
    if type(embedding) is nn.Embedding and model.config.embed_scale == 1.0:
        return embedding.weight[input_ids[0]]
    return model.embed(input_ids)[0].contiguous()


def project_and_store(
    layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    slots: torch.Tensor, config: Any, rounded: QuantizedInput | None = None,
) -> torch.Tensor:
    """The QKV product of normed rows h [rows, hidden]; q and k normalised (Qwen3) and rotated in place, k and v
    stored at `slots` of one layer's keys/values [kv_heads, capacity, head_dim] (a negative slot: not stored)
    -> qkv [rows, (heads + 2 kv_heads) * head_dim]. `rounded`: h rounded for the product (`add_norm_for`)."""
    attention = layer.self_attn
    qkv = apply_linear(h, attention.qkv_proj, rounded)
    q_norm, k_norm = attention.q_norm, attention.k_norm
    rope_and_store(
        qkv, cos, sin, keys, values, slots, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        q_norm_weight=q_norm.weight if q_norm is not None else None,
        k_norm_weight=k_norm.weight if k_norm is not None else None,
        eps=q_norm.eps if q_norm is not None else 1e-6,
    )
    return qkv


def attention_residual_and_mlp(layer: Any, x: torch.Tensor, attended: Owed) -> tuple[torch.Tensor, Owed]:
    """The rest of a layer after attention: x + attended, its RMSNorm and the MLP -> (the residual stream, the MLP
    output not yet added: the next add+RMSNorm adds it)."""
    if isinstance(layer.mlp, SparseMoeBlock):  # routed experts: the block's own forward (grouped products)
        h, x = add_norm(x, attended, layer.post_attention_layernorm, ATTENTION_REGION)
        return x, Owed(layer.mlp(h))
    mlp = layer.mlp
    h, x, rounded = add_norm_for(x, attended, layer.post_attention_layernorm, ATTENTION_REGION, mlp.gate_up_proj)
    gate_up = apply_linear(h, mlp.gate_up_proj, rounded)
    if rounds_for(mlp.down_proj, gate_up.shape[0]):
        activated, activated_rounded = silu_and_mul_quantized(gate_up)
        return x, last_product(activated, mlp.down_proj, activated_rounded)
    return x, last_product(silu_and_mul(gate_up), mlp.down_proj)


def fused_layers(
    model: CausalLM,
    storage: KVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    length: torch.Tensor,
    tree_mask: torch.Tensor,
    bucket: int,
    capture: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids, positions: [1, rows]; length: [1] long (the new rows go to slots length..); tree_mask: [rows, rows]
    bool -> (final-normed hidden [1, rows, hidden], features [1, rows, len(capture) * hidden] or None)."""
    config = model.layer_config  # this rank's heads under tensor parallelism
    rows = input_ids.shape[1]
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    slots, additive, cos, sin = forward_setup(model, storage, positions, length, tree_mask, bucket)
    wanted = set(capture)
    captured: dict[int, torch.Tensor] = {}
    split_keys = split_key_attention(rows) and storage.keys.is_contiguous() and attention_kernel_usable(head_dim)
    x = embed_rows(model, input_ids)  # [rows, hidden]
    pending: Owed | None = None  # the last MLP output, not yet added to x
    layer: Any
    for index, layer in enumerate(model.layers):
        attention = layer.self_attn
        h, x, rounded = add_norm_for(x, pending, layer.input_layernorm, MLP_REGION, attention.qkv_proj)
        if index - 1 in wanted:
            captured[index - 1] = x
        qkv = project_and_store(
            layer, h, cos, sin, storage.keys[index, 0], storage.values[index, 0], slots, config, rounded
        )
        if split_keys:
            out = few_row_attention(
                qkv[:, : heads * head_dim].view(rows, heads, head_dim), storage.keys[index, 0],
                storage.values[index, 0], additive[0, 0], bucket, attention.scale,
            )  # [rows, heads, head_dim]
            attended = last_product(out.reshape(rows, heads * head_dim), attention.o_proj)
        else:
            q = qkv[:, : heads * head_dim].view(rows, heads, head_dim).transpose(0, 1)[None]  # [1, heads, rows, hd]
            out = F.scaled_dot_product_attention(
                q, storage.keys[index, :, :, :bucket], storage.values[index, :, :, :bucket], attn_mask=additive,
                scale=attention.scale, enable_gqa=heads != kv_heads,
            )  # [1, heads, rows, head_dim]
            attended = last_product(out[0].transpose(0, 1).reshape(rows, heads * head_dim), attention.o_proj)
        x, pending = attention_residual_and_mlp(layer, x, attended)
    return final_norm_and_features(model, x, pending, captured, capture)


def final_norm_and_features(
    model: CausalLM, x: torch.Tensor, pending: Owed | None, captured: dict[int, torch.Tensor], capture: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """After the last layer: its owed MLP rows added and the final norm -> (hidden [1, rows, hidden], the captured
    layers' residual streams joined [1, rows, len(capture) * hidden] or None). captured: the layers' streams so far
    (the last one's is the sum this add makes)."""
    hidden, x = add_norm(x, pending, model.norm, MLP_REGION)
    if len(model.layers) - 1 in capture:
        captured[len(model.layers) - 1] = x
    features = torch.cat([captured[layer] for layer in capture], dim=-1)[None] if capture else None
    return hidden[None], features
