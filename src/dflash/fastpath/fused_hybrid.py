"""The graph runner's static forward of a Qwen3.5 hybrid with fused kernels.

Same inputs, outputs, cache and state writes as `static_target_forward`'s layer loop over `Qwen35DecoderLayer`s with
dense SiLU MLPs. Per layer: add+RMSNorm with (1 + weight) (`dflash.kernels.triton_decode`), then

* a Gated DeltaNet layer: one product for its q/k/v, z, b and a projections (their weights made views of one
  matrix, `join_projections`), the convolution and everything before the delta rule in one program, the rule in
  one (`dflash.kernels.triton_delta_rule`, key heads shared, not repeated), the gated RMSNorm in one, the output
  product; the state goes to the storage's fixed buffers (`dflash.kv.static_recurrent`);
* a gated attention layer: the module's own forward (a quarter of the layers);

then add+RMSNorm, gate/up product, SiLU*up and down product (`fused_layers.attention_residual_and_mlp`). The
products take `fast_linear` (the skinny program for few rows). Where a linear layer's rows are a tree, every row's
convolution and state follow its own path, as in the eager layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dflash.fastpath.fused_layers import (
    MLP_REGION,
    Owed,
    add_norm,
    apply_linear,
    attention_residual_and_mlp,
    embed_rows,
    final_norm_and_features,
    last_product,
)
from dflash.fastpath.static_forward import SlotWriter, block_visibility
from dflash.kernels.triton_decode import triton_available
from dflash.kernels.triton_delta_rule import delta_rule_rows
from dflash.kernels.triton_gated_deltanet import conv_taps, gated_norm, gdn_inputs
from dflash.kernels.triton_skinny import fast_linear
from dflash.kv.cache import KVCache
from dflash.kv.recurrent import DeltaRows
from dflash.kv.static_recurrent import StaticRecurrentStates
from dflash.models.gated_deltanet import GatedDeltaNet
from dflash.models.gpu_quantized_layers import GGUFLinear
from dflash.models.layers import GatedMLP
from dflash.models.model import CausalLM
from dflash.models.quantized_model import InputOrdered
from dflash.models.qwen3_5 import Qwen35DecoderLayer


def supports_fused_hybrid(model: CausalLM) -> bool:
    """Qwen3.5 layers with dense SiLU MLPs (no experts), their projections plain linear layers without bias or
    GGUF matrices (a quantized model: the linear layers' input projections one joint module of all four, an
    output projection that may reorder its input)."""
    if not triton_available() or not model.config.is_hybrid or model.config.hidden_act != "silu":
        return False
    for layer in model.layers:
        if type(layer) is not Qwen35DecoderLayer or type(layer.mlp) is not GatedMLP:
            return False
        mixer = layer.linear_attn
        linears: list[nn.Module] = [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        if mixer is not None and mixer.in_proj_joint is not None:
            if mixer.joined_projections != len(mixer.PROJECTIONS):
                return False
            linears += [mixer.in_proj_joint, mixer.out_proj]
        elif mixer is not None:
            linears += [mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a, mixer.out_proj]
        if not all(_fusable_product(module) for module in linears):
            return False
    return True


def _fusable_product(module: nn.Module) -> bool:
    """A product `apply_linear` runs: a linear layer without bias, or GGUF matrices (reordering their input)."""
    if isinstance(module, InputOrdered):
        module = module.inner
    if type(module) is GGUFLinear:
        return module.bias is None
    return type(module) is nn.Linear and module.bias is None


def join_projections(mixer: GatedDeltaNet) -> torch.Tensor:
    """One [channels + z + 2 * value_heads, hidden] matrix for the layer's q/k/v, z, b and a projections; the four
    modules' weights become views of it (no second copy). Joined again if the modules were moved since."""
    parts = (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a)
    joined: torch.Tensor | None = mixer.__dict__.get("joined_weight")
    if joined is not None and parts[0].weight.data_ptr() == joined.data_ptr():
        return joined
    joined = torch.cat([part.weight.detach() for part in parts], dim=0)
    start = 0
    for part in parts:
        rows = part.weight.shape[0]
        part.weight = nn.Parameter(joined[start : start + rows], requires_grad=False)
        start += rows
    mixer.__dict__["joined_weight"] = joined  # a plain attribute: not a parameter or buffer of the module
    return joined


def join_all_projections(model: CausalLM) -> None:
    """`join_projections` for every linear layer now (not at the first capture), then the replaced matrices'
    memory handed back to the device: each joined matrix is larger than the pieces it replaces, so the caching
    allocator could not reuse them, and a model near the GPU's size would run out."""
    for layer in model.layers:
        if isinstance(layer.linear_attn, GatedDeltaNet) and layer.linear_attn.in_proj_joint is None:
            join_projections(layer.linear_attn)
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.empty_cache()


def fused_gdn(
    mixer: GatedDeltaNet, h: torch.Tensor, states: StaticRecurrentStates, taps: torch.Tensor,
    ancestors: torch.Tensor | None, count: torch.Tensor | None,
) -> torch.Tensor:
    """One Gated DeltaNet layer's token mixing for normed rows h [rows, hidden] -> the gated read-out [rows,
    value_heads * value_dim] (before the output product); its state written to `states`."""
    if mixer.in_proj_joint is not None:  # GGUF matrices, joined at load
        proj = apply_linear(h, mixer.in_proj_joint)  # [rows, channels + z + 2 * value_heads]
    else:
        proj = fast_linear(h, join_projections(mixer))
    channels = mixer.shape.conv_channels
    window, state = states.read(mixer.slot)  # [1, kernel - 1, channels], [1, value_heads, key_dim, value_dim]
    kept = states.row_buffers(mixer.slot, h.shape[0])  # the rows' inputs go straight to the rollback's buffers
    chain = ancestors is None
    new_window = states.next_windows[mixer.slot] if chain else window  # a tree leaves the window to its cut
    q, k, v, g, beta = gdn_inputs(
        proj, window[0], mixer.conv1d.weight, taps, mixer.A_log, mixer.dt_bias, key_heads=mixer.key_heads,
        value_heads=mixer.value_heads, key_dim=mixer.key_dim, value_dim=mixer.value_dim, kept=kept,
        window_out=new_window[0] if chain else None, count=count,
    )
    read, new_state = delta_rule_rows(
        q[None], k[None], v[None], g[None], beta[None], state, ancestors=ancestors,
        final=states.final_buffer(mixer.slot), count=count,
    )
    assert read is not None
    conv_inputs = kept.conv_inputs if kept is not None else proj[:, :channels]
    states.write(mixer.slot, new_window, new_state, DeltaRows(conv_inputs[None], k[None], v[None], g[None], beta[None]))
    z_offset = channels
    return gated_norm(read[0], proj, z_offset, mixer.norm.weight, mixer.norm.eps, h.dtype)


def fused_hybrid_layers(
    model: CausalLM,
    storage: KVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    length: torch.Tensor,
    tree_mask: torch.Tensor,
    bucket: int,
    capture: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fused_layers`' contract for a hybrid: input_ids, positions [1, rows]; length [1] long; tree_mask [rows,
    rows] bool; the storage's recurrent state says whether the rows are a tree (`tree_ancestors`) and how many of a
    chain's are live (`count_rows`) -> (final-normed hidden [1, rows, hidden], features or None)."""
    states = storage.recurrent
    assert isinstance(states, StaticRecurrentStates)
    rows = input_ids.shape[1]
    device = input_ids.device
    ancestors, count = states.tree_ancestors, states.count_rows
    taps = conv_taps(rows, states.shape.conv_kernel, ancestors, device)  # shared by every linear layer
    slots = length + torch.arange(rows, device=device)  # [rows]
    storage.positions[0].index_copy_(0, slots, positions[0])
    full = block_visibility(length, tree_mask, bucket)[None, None]  # [1, 1, rows, bucket]
    cos, sin = model.rotary.cos_sin(positions, model.embed_tokens.weight.dtype)
    writer = SlotWriter(storage, slots, bucket)
    wanted = set(capture)
    captured: dict[int, torch.Tensor] = {}
    x = embed_rows(model, input_ids)  # [rows, hidden]
    pending: Owed | None = None
    layer: Any
    for index, layer in enumerate(model.layers):
        h, x = add_norm(x, pending, layer.input_layernorm, MLP_REGION)
        if index - 1 in wanted:
            captured[index - 1] = x
        mixer = layer.linear_attn
        if mixer is not None:
            attended = last_product(fused_gdn(mixer, h, states, taps, ancestors, count), mixer.out_proj)
        else:
            attended = Owed(layer.self_attn(h[None], cos, sin, full, writer)[0])
        x, pending = attention_residual_and_mlp(layer, x, attended)
    return final_norm_and_features(model, x, pending, captured, capture)
