"""Qwen3.5 GGUF files (llama.cpp's `qwen35`): a tiny transformers model written the way llama.cpp's converter
writes it loads back to the same weights and the same logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dflash.errors import ModelLoadError
from dflash.models.gguf_loader import load_gguf
from dflash.models.registry import build_model
from tests.hybrid_models import TINY_HYBRID, hf_tiny_hybrid
from tests.loading_helpers import gguf_tokenizer_metadata, train_byte_level_tokenizer, write_gguf
from tests.spec_helpers import one_torch_thread

transformers = pytest.importorskip("transformers")
_threads = one_torch_thread

_NAMES = {  # transformers layer part -> llama.cpp tensor stem
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}


def _tiled(rows: np.ndarray, groups: int, per_group: int, head_rows: int) -> np.ndarray:
    """Value-head rows from transformers' grouped order to llama.cpp's tiled order."""
    shaped = rows.reshape(groups, per_group, head_rows, *rows.shape[1:])
    return shaped.swapaxes(0, 1).reshape(rows.shape)


def _convert(hf: Any) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter writes them (see `dflash.models.gguf_hybrid`)."""
    cfg = hf.config
    groups, per_group = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    q_and_k, head_v = 2 * groups * cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def tile(rows: np.ndarray, head_rows: int) -> np.ndarray:
        return _tiled(rows, groups, per_group, head_rows)

    out: dict[str, np.ndarray] = {}
    for name, tensor in hf.state_dict().items():
        w = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w + 1
        elif name == "lm_head.weight":
            out["output.weight"] = w
        else:
            block, part = name.removeprefix("model.layers.").split(".", 1)
            b = f"blk.{block}."
            if part == "linear_attn.A_log":
                out[b + "ssm_a"] = tile(-np.exp(w)[:, None], 1)[:, 0]
            elif part == "linear_attn.dt_bias":
                out[b + "ssm_dt.bias"] = tile(w[:, None], 1)[:, 0]
            else:
                stem, suffix = part.rsplit(".", 1)
                if stem == "linear_attn.conv1d":
                    w = w[:, 0]
                if stem in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
                    w = np.concatenate((w[:q_and_k], tile(w[q_and_k:], head_v)))
                elif stem == "linear_attn.in_proj_z":
                    w = tile(w, head_v)
                elif stem in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
                    w = tile(w, 1)
                elif stem == "linear_attn.out_proj":
                    w = tile(w.T, head_v).T
                elif stem.endswith("norm") and stem != "linear_attn.norm":
                    w = w + 1
                out[f"{b}{_NAMES[stem]}.{suffix}"] = w
    return out


def _metadata(hf: Any, mtp_layers: int) -> dict[str, Any]:
    cfg, arch = hf.config, "qwen35"
    md = {
        f"{arch}.block_count": cfg.num_hidden_layers + mtp_layers,
        f"{arch}.nextn_predict_layers": mtp_layers,
        f"{arch}.context_length": 512,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.key_length": cfg.head_dim,
        f"{arch}.attention.value_length": cfg.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.rope.dimension_count": cfg.head_dim // 4,
        f"{arch}.full_attention_interval": 4,
        f"{arch}.ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        f"{arch}.ssm.state_size": cfg.linear_key_head_dim,
        f"{arch}.ssm.group_count": cfg.linear_num_key_heads,
        f"{arch}.ssm.time_step_rank": cfg.linear_num_value_heads,
        f"{arch}.ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
    }
    return {**md, **gguf_tokenizer_metadata(train_byte_level_tokenizer())}


@pytest.fixture(scope="module")
def hf_model() -> Any:
    # llama.cpp derives the layer kinds from the interval: every 4th layer is full attention
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return hf_tiny_hybrid(seed=21, layer_types=layer_types)


def test_gguf_loads_as_transformers_weights(hf_model: Any, tmp_path: Path) -> None:
    tensors = _convert(hf_model)
    tensors["blk.4.nextn.eh_proj.weight"] = np.zeros((8, 8), dtype=np.float32)  # a multi-token-prediction block
    path = write_gguf(tmp_path / "tiny.gguf", "qwen35", _metadata(hf_model, mtp_layers=1), tensors)
    checkpoint = load_gguf(path, use_cache=False)
    config = checkpoint.config
    assert config.architecture == "qwen3_5" and config.num_layers == 4 and config.rotary_dim == 4
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim) == (2, 4, 12)
    expected = {k: v for k, v in hf_model.state_dict().items()}
    assert set(checkpoint.weights) == set(expected)
    for name, tensor in checkpoint.weights.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-5, msg=name)
    model = build_model(config, checkpoint.weights)
    ids = torch.randint(0, TINY_HYBRID["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf_model(ids).logits, atol=1e-4, rtol=0)


def test_mixture_of_experts_hybrids_need_their_expert_metadata(hf_model: Any, tmp_path: Path) -> None:
    """`qwen3next` and `qwen35moe` files are read (tests/test_gguf_hybrid_moe.py); without the expert keys they
    are a clear load error."""
    for arch in ("qwen3next", "qwen35moe"):
        md = {k.replace("qwen35.", f"{arch}."): v for k, v in _metadata(hf_model, 0).items()}
        path = write_gguf(tmp_path / f"{arch}.gguf", arch, md, {"token_embd.weight": np.zeros((8, 4), np.float32)})
        with pytest.raises(ModelLoadError, match=rf"lacks {arch}\.expert_count"):
            load_gguf(path, use_cache=False)


def test_quantized_weights_are_refused(hf_model: Any, tmp_path: Path) -> None:
    from dflash.models.gguf_quantized import load_gguf_quantized

    path = write_gguf(tmp_path / "tiny.gguf", "qwen35", _metadata(hf_model, 0), _convert(hf_model))
    with pytest.raises(ModelLoadError, match="dense weights"):
        load_gguf_quantized(path)
