"""Random-weight GGUF files at real model shapes, for speed comparisons on the same file (`dflash bench make-gguf`).

Speed depends on the shapes and the block formats, not on the values, so the blocks are random bytes with their
scales set so that the weights come out N(0, ~0.02)-like: no float model is made or quantized (the `gguf` package
cannot quantize the K formats anyway), and a 32B file is written in a minute, one tensor at a time. The layout
follows llama.cpp's conventions (tensor names, metadata keys, `qwen3` architecture), with a synthetic byte-level
vocabulary of the shape's size, so llama.cpp and dflash both load it.

Quant mixes: `q8_0` (every matrix Q8_0), `q4_1` and `q4_0` (every matrix in that 32-value format) and `q4_k_m`
(llama.cpp's Q4_K_M rule: Q4_K, with Q6_K for the output matrix and for attn_v / ffn_down in the layers that get
more bits: the first and last eighth, and every third in between). Norms stay float32. The K formats need rows
of whole 256-value super-blocks: `smollm2-135m` (rows of 576) is written in the 32-value mixes only (llama.cpp
itself stores such rows in Q5_0 / Q8_0 in a Q4_K_M file). The Qwen3.5 hybrid shapes (`qwen35` architecture) are
described in `dflash.bench.random_gguf_hybrid`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType

from dflash.bench.gguf_shapes import SHAPES, HybridShape, Shape, add_decoder_metadata
from dflash.bench.random_gguf_hybrid import add_hybrid_metadata, hybrid_float_tensor, hybrid_layer_tensors

Q8_0, Q4_K, Q6_K, F32 = (
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.F32
)
Q4_0, Q4_1 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1
QUANT_MIXES = ("q8_0", "q4_1", "q4_0", "q4_k_m")
SINGLE_FORMAT_MIXES = {"q8_0": Q8_0, "q4_1": Q4_1, "q4_0": Q4_0}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third one in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def layer_tensors(shape: Shape, layer: int, mix: str) -> list[tuple[str, tuple[int, int], GGMLQuantizationType]]:
    """(GGUF name, (rows, columns), format) of one layer's matrices and norms."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    single = SINGLE_FORMAT_MIXES.get(mix)
    base = single or Q4_K
    rich = single or (Q6_K if more_bits(layer, shape.layers) else Q4_K)
    p = f"blk.{layer}."
    return [
        (p + "attn_norm.weight", (1, h), F32),
        (p + "attn_q.weight", (q, h), base),
        (p + "attn_k.weight", (kv, h), base),
        (p + "attn_v.weight", (kv, h), rich),
        (p + "attn_output.weight", (h, q), base),
        (p + "attn_q_norm.weight", (1, shape.head_dim), F32),
        (p + "attn_k_norm.weight", (1, shape.head_dim), F32),
        (p + "ffn_norm.weight", (1, h), F32),
        (p + "ffn_gate.weight", (shape.intermediate, h), base),
        (p + "ffn_up.weight", (shape.intermediate, h), base),
        (p + "ffn_down.weight", (h, shape.intermediate), rich),
    ]


def all_tensors(shape: Shape, mix: str) -> list[tuple[str, tuple[int, int], GGMLQuantizationType]]:
    """Every tensor of the file, in llama.cpp's order."""
    single = SINGLE_FORMAT_MIXES.get(mix)
    tensors = [("token_embd.weight", (shape.vocab, shape.hidden), single or Q4_K)]
    for layer in range(shape.layers):
        if isinstance(shape, HybridShape):
            rich = single or (Q6_K if more_bits(layer, shape.layers) else Q4_K)
            tensors += hybrid_layer_tensors(shape, layer, single or Q4_K, rich)
        else:
            tensors += layer_tensors(shape, layer, mix)
    tensors.append(("output_norm.weight", (1, shape.hidden), F32))
    if not shape.tied:
        tensors.append(("output.weight", (shape.vocab, shape.hidden), single or Q6_K))
    return tensors


def random_blocks(rows: int, columns: int, kind: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8: random blocks of `kind` whose weights have a spread of about 0.02."""
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    if columns % block_values:
        raise ValueError(f"{columns} columns do not split into {kind.name} blocks of {block_values}")
    blocks = rows * (columns // block_values)
    raw = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
    _SCALES[kind](raw, rng)
    return raw.reshape(rows, -1)


def _fp16_bytes(values: np.ndarray | float) -> np.ndarray:
    """[n] floats -> [n, 2] uint8, little-endian float16."""
    return np.asarray(values).astype("<f2").view(np.uint8).reshape(-1, 2)


def _q8_0_scales(raw: np.ndarray, rng: np.random.Generator) -> None:
    # d (fp16) then 32 int8: random int8 have a spread of ~74, so d ~ 0.02 / 74
    raw[:, 0:2] = _fp16_bytes(rng.uniform(2.0e-4, 3.4e-4, raw.shape[0]))


def _q4_1_scales(raw: np.ndarray, rng: np.random.Generator) -> None:
    # d, m (fp16), 16 bytes of nibbles: w = d * q + m, q in 0..15 (spread ~4.6): d ~ 0.02 / 4.6, m = -7.5 d centres
    d = rng.uniform(3.5e-3, 5.2e-3, raw.shape[0])
    raw[:, 0:2] = _fp16_bytes(d)
    raw[:, 2:4] = _fp16_bytes(-7.5 * d)


def _q4_0_scales(raw: np.ndarray, rng: np.random.Generator) -> None:
    # d (fp16), 16 bytes of nibbles: w = d * (q - 8), centred already
    raw[:, 0:2] = _fp16_bytes(rng.uniform(3.5e-3, 5.2e-3, raw.shape[0]))


def _q4_k_scales(raw: np.ndarray, rng: np.random.Generator) -> None:
    # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: w = d * sc * q - dmin * m, q in 0..15
    # with random 6-bit sc (~32) and q (spread ~4.6): d ~ 0.02 / (32 * 4.6); dmin * m ~ d * sc * 7.5 centres them
    d = rng.uniform(1.0e-4, 1.6e-4, raw.shape[0])
    raw[:, 0:2] = _fp16_bytes(d)
    raw[:, 2:4] = _fp16_bytes(d * 7.5)


def _q6_k_scales(raw: np.ndarray, rng: np.random.Generator) -> None:
    # 128 bytes low bits, 64 high bits, 16 int8 scales, then d (fp16): w = d * sc * (q - 32), q in 0..63 (spread
    # ~18.5); scales kept in 16..63 so that d ~ 0.02 / (40 * 18.5)
    raw[:, 192:208] = rng.integers(16, 64, size=(raw.shape[0], 16), dtype=np.uint8)
    raw[:, 208:210] = _fp16_bytes(rng.uniform(2.0e-5, 3.4e-5, raw.shape[0]))


_SCALES: dict[GGMLQuantizationType, Callable[[np.ndarray, np.random.Generator], None]] = {
    Q8_0: _q8_0_scales, Q4_1: _q4_1_scales, Q4_0: _q4_0_scales, Q4_K: _q4_k_scales, Q6_K: _q6_k_scales,
}


def _tensor_data(
    name: str, shape: tuple[int, int], kind: GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    rows, columns = shape
    if kind == F32:  # norms around 1; a hybrid's other float tensors as `hybrid_float_tensor` makes them
        return hybrid_float_tensor(name, shape, rng)
    return random_blocks(rows, columns, kind, rng)


def write_random_gguf(path: Path, shape_name: str, mix: str, seed: int = 0) -> Path:
    """Write the random model `shape_name` in quant mix `mix` to `path`, tensor by tensor."""
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; choose one of {', '.join(SHAPES)}")
    if mix not in QUANT_MIXES:
        raise ValueError(f"unknown quant mix {mix!r}; choose one of {', '.join(QUANT_MIXES)}")
    shape = SHAPES[shape_name]
    if mix not in SINGLE_FORMAT_MIXES and shape.hidden % 256:
        raise ValueError(f"{shape_name}'s rows of {shape.hidden} values are not whole 256-value super-blocks: "
                         f"write it in {', '.join(SINGLE_FORMAT_MIXES)}")
    rng = np.random.default_rng(seed)
    hybrid = isinstance(shape, HybridShape)
    writer = GGUFWriter(str(path), "qwen35" if hybrid else "qwen3")
    writer.add_name(f"random {shape_name} {mix}")
    if isinstance(shape, HybridShape):
        add_hybrid_metadata(writer, shape)
    else:
        add_decoder_metadata(writer, shape, context=40960, rope_base=1_000_000.0)
    writer.add_file_type(FILE_TYPES[mix])
    _add_vocabulary(writer, shape.vocab)
    tensors = all_tensors(shape, mix)
    for name, dims, kind in tensors:
        rows, columns = dims
        block_values, block_bytes = GGML_QUANT_SIZES[kind]
        nbytes = rows * columns // block_values * block_bytes
        if kind == F32:
            writer.add_tensor_info(name, (columns,) if rows == 1 else dims, np.dtype(np.float32), nbytes)
        else:
            writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in tensors:
        writer.write_tensor_data(_tensor_data(name, dims, kind, rng))
    writer.close()
    return path


FILE_TYPES = {
    "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_1": LlamaFileType.MOSTLY_Q4_1, "q4_0": LlamaFileType.MOSTLY_Q4_0,
    "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
}


def _add_vocabulary(writer: GGUFWriter, size: int) -> None:
    """A byte-level BPE vocabulary of `size` entries: the 256 byte symbols, one merged pair (loaders want merges),
    filler tokens, the chat specials last (random weights: only the ids matter)."""
    alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    alphabet += [chr(256 + i) for i in range(256 - len(alphabet))]
    merged = alphabet[0] + alphabet[1]
    fillers = [f"<t{i}>" for i in range(size - len(alphabet) - 1 - len(SPECIALS))]
    tokens = [*alphabet, merged, *fillers, *SPECIALS]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (size - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_token_merges([f"{alphabet[0]} {alphabet[1]}"])
    writer.add_bos_token_id(size - 2)
    writer.add_eos_token_id(size - 3)
