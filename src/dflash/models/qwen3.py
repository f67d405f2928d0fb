"""Qwen3 family: the Llama block plus per-head RMSNorm of queries and keys (enabled by `config.qk_norm`)."""

from dflash.models.model import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 differs from Llama only by q/k norms, which the shared attention applies from the config."""
