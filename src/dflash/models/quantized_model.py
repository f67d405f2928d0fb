"""Building a model from a `QuantizedCheckpoint`: the family's usual modules, with the fused projections,
the embedding and the LM head replaced by their quantized stand-ins.

q/k/v rows are stacked into `qkv_proj` and gate/up rows into `gate_up_proj`, as the dense loader does with
values (on the CPU parts in different formats, as Q4_K_M's attn_v in Q6_K beside Q4_K, become a
`QuantizedStack`: one product per format). A hybrid's Gated DeltaNet layers get one joint module for their input
projections (`GatedDeltaNet.join_input_projections`: q/k/v and z, then b and a where the file quantized them), and
an output projection whose stored columns are out of order takes its input reordered (`InputOrdered`).
Everything else (norms, biases, RoPE tables, a hybrid's convolution) is dense, loaded by `CausalLM.load_weights`.
On the CPU the stand-ins are `quantized_layers.py`'s (the CPU kernel, float32); on a CUDA device
`gpu_quantized_layers.py`'s (the Triton block programs, bfloat16 or float16), every matrix moved there as its blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.errors import ModelLoadError
from dflash.models.gated_deltanet import GatedDeltaNet
from dflash.models.materialize import materialize
from dflash.models.model import CausalLM
from dflash.models.quantized_layers import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedStack,
    linear_of_parts,
)
from dflash.models.quantized_weights import QuantizedCheckpoint, QuantizedMatrix
from dflash.models.registry import MODEL_CLASSES
from dflash.models.rope import Rotary

__all__ = ["build_quantized_model"]


def build_quantized_model(
    checkpoint: QuantizedCheckpoint,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    block_programs: bool = False,
) -> CausalLM:
    """The model of `checkpoint` in eval mode with quantized matrices: on the CPU in float32, or on a CUDA device
    in `dtype` (bfloat16 unless given; float16 too). `block_programs` builds the GPU modules on the CPU, in any
    float dtype: for tests under Triton's interpreter."""
    device = torch.device(device)
    if block_programs and device.type == "cpu":
        dtype = dtype or torch.float32
    elif device.type == "cpu":
        dtype = dtype or torch.float32
        if dtype != torch.float32:
            raise ModelLoadError(f"quantized CPU weights compute in float32 (asked for {dtype}); use --weights dense")
    elif device.type == "cuda":
        dtype = dtype or torch.bfloat16
        if dtype not in (torch.bfloat16, torch.float16):
            raise ModelLoadError(f"quantized GPU weights take bfloat16 or float16 (asked for {dtype})")
    else:
        raise ModelLoadError(f"quantized weights run on the CPU or a CUDA device (asked for {device}); use --weights dense")
    config, matrices = checkpoint.config, checkpoint.matrices
    source = str(checkpoint.source)
    if config.architecture == "gemma4":  # its layers' projections are not the uniform q/k/v this builder joins
        raise ModelLoadError(f"{source}: quantized CPU weights do not support Gemma 4 yet; use --weights dense")
    on_gpu = device.type == "cuda" or block_programs
    if on_gpu:
        from dflash.models.gpu_quantized_layers import GGUFEmbedding, GGUFLinear

    def matrix(name: str) -> QuantizedMatrix:
        if name not in matrices:
            raise ModelLoadError(f"{source}: missing matrix {name!r}")
        return matrices[name]

    def linear(weights: QuantizedMatrix, bias: bool = False) -> nn.Module:
        return GGUFLinear(weights, device, dtype, bias) if on_gpu else QuantizedLinear(weights, bias=bias)

    def fused(parts: list[QuantizedMatrix], bias: bool = False) -> nn.Module:
        """The parts' rows as one module, in any mix of formats."""
        if on_gpu:
            return GGUFLinear(parts, device, dtype, bias)
        return linear_of_parts(parts, bias=bias)

    def ordered(name: str, module: nn.Module) -> nn.Module:
        order = checkpoint.input_orders.get(name)
        return module if order is None else InputOrdered(module, order.to(device))

    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    for i, layer in enumerate(model.layers):
        hf, own = f"model.layers.{i}.", f"layers.{i}."
        mixer = getattr(layer, "linear_attn", None)
        if isinstance(mixer, GatedDeltaNet):
            names = [f"{hf}linear_attn.{n}.weight" for n in mixer.PROJECTIONS]
            count = next((n for n, name in enumerate(names) if name not in matrices), len(names))  # quantized ones
            mixer.join_input_projections(fused([matrix(name) for name in names[: max(count, 1)]]), max(count, 1))
            name = f"{hf}linear_attn.out_proj.weight"
            model.set_submodule(f"{own}linear_attn.out_proj", ordered(name, linear(matrix(name))))
        else:
            qkv = [matrix(f"{hf}self_attn.{n}_proj.weight") for n in "qkv"]
            model.set_submodule(f"{own}self_attn.qkv_proj", fused(qkv, bias=config.attention_bias))
            model.set_submodule(
                f"{own}self_attn.o_proj", linear(matrix(f"{hf}self_attn.o_proj.weight"), bias=config.attention_bias)
            )
        gate_up = [matrix(f"{hf}mlp.{n}_proj.weight") for n in ("gate", "up")]
        model.set_submodule(f"{own}mlp.gate_up_proj", fused(gate_up))
        model.set_submodule(f"{own}mlp.down_proj", linear(matrix(f"{hf}mlp.down_proj.weight")))
    embedding = matrix("model.embed_tokens.weight")
    if on_gpu:  # moved once: a tied head then shares the table's device blocks
        embedding = QuantizedMatrix(embedding.blocks.to(device), embedding.qtype, embedding.columns)
        model.set_submodule("embed_tokens", GGUFEmbedding(embedding, device, dtype))
    else:
        model.set_submodule("embed_tokens", QuantizedEmbedding(embedding))
    head = embedding if config.tie_word_embeddings else matrix("lm_head.weight")
    model.set_submodule("lm_head", linear(head))
    # Materialise what is still on the meta device (norms, RoPE tables), leaving the quantized modules alone.
    quantized = (
        QuantizedLinear, QuantizedStack, QuantizedEmbedding, InputOrdered, *((GGUFLinear, GGUFEmbedding) if on_gpu else ())
    )
    for module in model.modules():
        if not isinstance(module, quantized):
            materialize(module, device, recurse=False)
    model.to(dtype)  # floating tensors only: the blocks stay uint8
    for module in model.modules():
        if isinstance(module, Rotary):  # computed on the real device, as the dense builder does
            module.recompute()
    model.load_weights(checkpoint.weights, source)
    return model.eval().requires_grad_(False)


class InputOrdered(nn.Module):
    """`inner` applied to x's features reordered: y = inner(x[..., order]), for a matrix whose stored columns are
    not in the model's input order (order[j]: the input feature stored column j multiplies)."""

    order: torch.Tensor

    def __init__(self, inner: nn.Module, order: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("order", order, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.order))

