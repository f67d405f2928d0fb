"""Building a model from a `QuantizedCheckpoint`: the family's usual modules, with the fused projections,
the embedding and the LM head replaced by their quantized stand-ins.

q/k/v rows are stacked into `qkv_proj` and gate/up rows into `gate_up_proj`, as the dense loader does with
values. Everything else (norms, biases, RoPE tables) is dense float32, loaded by `CausalLM.load_weights`.
Quantized weights run on the CPU in float32 only.
"""

from __future__ import annotations

import torch

from dflash.errors import ModelLoadError
from dflash.models.model import CausalLM
from dflash.models.quantized_layers import QuantizedEmbedding, QuantizedLinear
from dflash.models.quantized_weights import QuantizedCheckpoint, QuantizedMatrix
from dflash.models.registry import MODEL_CLASSES
from dflash.models.rope import Rotary

__all__ = ["build_quantized_model"]


def build_quantized_model(checkpoint: QuantizedCheckpoint, *, device: torch.device | str = "cpu") -> CausalLM:
    """The model of `checkpoint` on the CPU, in eval mode, with quantized matrices."""
    if torch.device(device).type != "cpu":
        raise ModelLoadError(f"quantized weights run on the CPU only (asked for {device}); use --weights dense")
    config, matrices = checkpoint.config, checkpoint.matrices
    source = str(checkpoint.source)
    if config.architecture == "gemma4":  # its layers' projections are not the uniform q/k/v this builder joins
        raise ModelLoadError(f"{source}: quantized CPU weights do not support Gemma 4 yet; use --weights dense")

    def matrix(name: str) -> QuantizedMatrix:
        if name not in matrices:
            raise ModelLoadError(f"{source}: missing matrix {name!r}")
        return matrices[name]

    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    for i in range(config.num_layers):
        hf, own = f"model.layers.{i}.", f"layers.{i}."
        qkv = QuantizedMatrix.stack_rows([matrix(f"{hf}self_attn.{n}_proj.weight") for n in "qkv"], f"{hf}qkv")
        gate_up = QuantizedMatrix.stack_rows(
            [matrix(f"{hf}mlp.{n}_proj.weight") for n in ("gate", "up")], f"{hf}gate_up"
        )
        model.set_submodule(f"{own}self_attn.qkv_proj", QuantizedLinear(qkv, bias=config.attention_bias))
        model.set_submodule(
            f"{own}self_attn.o_proj", QuantizedLinear(matrix(f"{hf}self_attn.o_proj.weight"), bias=config.attention_bias)
        )
        model.set_submodule(f"{own}mlp.gate_up_proj", QuantizedLinear(gate_up))
        model.set_submodule(f"{own}mlp.down_proj", QuantizedLinear(matrix(f"{hf}mlp.down_proj.weight")))
    embedding = matrix("model.embed_tokens.weight")
    model.set_submodule("embed_tokens", QuantizedEmbedding(embedding))
    head = embedding if config.tie_word_embeddings else matrix("lm_head.weight")
    model.set_submodule("lm_head", QuantizedLinear(head))
    # Materialise what is still on the meta device (norms, RoPE tables), leaving the quantized modules alone.
    for module in model.modules():
        if not isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            module.to_empty(device="cpu", recurse=False)
        if isinstance(module, Rotary):
            module.recompute()
    model.load_weights(checkpoint.weights, source)
    return model.eval().requires_grad_(False)
