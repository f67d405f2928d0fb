"""The model shapes `dflash bench make-gguf` writes: Qwen3-family decoders (`Shape`) and Qwen3.5 hybrids
(`HybridShape`), with the metadata keys every such file carries."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGUFWriter


@dataclass(frozen=True)
class Shape:
    """A Qwen3-family decoder's sizes."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False


@dataclass(frozen=True, kw_only=True)
class HybridShape(Shape):
    """A Qwen3.5 hybrid's sizes: a `Shape` (its gated attention layers and MLPs) and its linear-attention layers'."""

    key_heads: int  # linear attention: q/k heads
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    interval: int = 4  # every interval-th layer is full attention
    rotary_dim: int = 64

    def is_linear(self, layer: int) -> bool:
        return (layer + 1) % self.interval != 0

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


SHAPES: dict[str, Shape] = {
    "qwen3-8b": Shape(36, 4096, 12288, 32, 8, 128, 151936),
    "qwen3-32b": Shape(64, 5120, 25600, 64, 8, 128, 151936),
    "qwen3-0.6b": Shape(28, 1024, 3072, 16, 8, 128, 151936, tied=True),
    "smollm2-135m": Shape(30, 576, 1536, 9, 3, 64, 49152, tied=True),  # the default model's sizes
    "tiny": Shape(2, 256, 512, 4, 2, 64, 1024),  # for tests
    "qwen3.5-27b": HybridShape(64, 5120, 17408, 24, 4, 256, 248320, key_heads=16, value_heads=48, key_dim=128,
                               value_dim=128),
    # for tests: rows of 256 values (the K formats' super-blocks), two value heads per key head
    "tiny-hybrid": HybridShape(4, 256, 512, 4, 2, 64, 1024, key_heads=2, value_heads=4, key_dim=32, value_dim=64,
                               rotary_dim=16),
}


def add_decoder_metadata(writer: GGUFWriter, shape: Shape, context: int, rope_base: float) -> None:
    """The sizes every decoder's file states (block count, widths, heads), its context and RoPE base."""
    writer.add_block_count(shape.layers)
    writer.add_context_length(context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(rope_base)
