"""Llama family (SmolLM2, Llama 3.x): the plain pre-norm decoder with SwiGLU and RoPE."""

from dflash.models.model import CausalLM


class LlamaForCausalLM(CausalLM):
    """Everything Llama needs is in the shared layers; no per-layer extras."""
