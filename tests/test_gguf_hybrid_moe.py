"""Qwen3.5-MoE and Qwen3-Next GGUF files (llama.cpp's `qwen35moe`, `qwen3next`): tiny transformers models written
the way llama.cpp's converter writes them load back to transformers' weights and logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dflash.config import ModelConfig
from dflash.errors import ModelLoadError
from dflash.models.gguf_loader import load_gguf
from dflash.models.moe_weights import stack_expert_weights
from dflash.models.registry import build_model
from dflash.models.weight_choice import choose_weights
from tests.hybrid_gguf import HYBRID_NAMES, converted_linear_attention, hybrid_metadata
from tests.hybrid_models import hf_tiny_35_moe, hf_tiny_next
from tests.loading_helpers import write_gguf
from tests.spec_helpers import one_torch_thread, run

transformers = pytest.importorskip("transformers")
_threads = one_torch_thread

# llama.cpp derives the layer kinds from the interval: every 4th layer is full attention
_LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
_MOE_NAMES = {  # transformers layer part -> llama.cpp tensor stem
    **HYBRID_NAMES,
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "linear_attn.in_proj_ba": "ssm_ba",
}


def _split_qkvz(cfg: Any, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's per-key-head [q, k, v, z] rows -> attn_qkv (all q, all k, all v) and attn_gate (all z)."""
    groups, key_dim = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    served = cfg.linear_num_value_heads // groups * cfg.linear_value_head_dim
    per_head = w.reshape(groups, -1, w.shape[-1])
    q, k, v, z = np.split(per_head, np.cumsum([key_dim, key_dim, served])[:3], axis=1)
    return np.concatenate([t.reshape(-1, w.shape[-1]) for t in (q, k, v)]), z.reshape(-1, w.shape[-1])


def _convert(hf: Any, arch: str, *, fused_experts: bool = False) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter writes them: Qwen3.5-MoE's value heads tiled, Qwen3-Next's
    `in_proj_qkvz` split; experts stacked per projection (or gate and up joined, the converter's option)."""
    cfg = hf.config
    out: dict[str, np.ndarray] = {}
    for name, tensor in hf.state_dict().items():
        w = tensor.detach().float().numpy()
        globals_ = {"model.embed_tokens.weight": ("token_embd.weight", w), "lm_head.weight": ("output.weight", w),
                    "model.norm.weight": ("output_norm.weight", w + 1)}
        if name in globals_:
            out[globals_[name][0]] = globals_[name][1]
            continue
        block, part = name.removeprefix("model.layers.").split(".", 1)
        b = f"blk.{block}."
        if part == "mlp.experts.gate_up_proj":  # [experts, 2 * width, hidden], gate rows first
            if fused_experts:
                out[b + "ffn_gate_up_exps.weight"] = w
            else:
                out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = np.split(w, 2, axis=1)
        elif part == "mlp.experts.down_proj":
            out[b + "ffn_down_exps.weight"] = w
        elif part == "linear_attn.in_proj_qkvz.weight":
            out[b + "attn_qkv.weight"], out[b + "attn_gate.weight"] = _split_qkvz(cfg, w)
        elif part.startswith("linear_attn.") and part != "linear_attn.in_proj_ba.weight":
            converted = converted_linear_attention(cfg, part, w, tiled=arch == "qwen35moe")
            assert converted is not None
            out[b + converted[0]] = converted[1]
        else:
            stem, suffix = part.rsplit(".", 1)
            if stem.endswith("norm"):
                w = w + 1
            if stem == "mlp.shared_expert_gate" and arch == "qwen3next":
                w = w[0]  # either form occurs: [1, hidden] or [hidden]
            out[f"{b}{_MOE_NAMES[stem]}.{suffix}"] = w
    return out


def _metadata(hf: Any, arch: str) -> dict[str, Any]:
    cfg = hf.config
    experts = {
        f"{arch}.expert_count": cfg.num_experts,
        f"{arch}.expert_used_count": cfg.num_experts_per_tok,
        f"{arch}.expert_feed_forward_length": cfg.moe_intermediate_size,
        f"{arch}.expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
    }
    # Qwen3.5-MoE's config has no dense width
    return {**hybrid_metadata(hf, 0, arch, dense_width=arch == "qwen3next"), **experts}


_MODELS = {"qwen35moe": hf_tiny_35_moe, "qwen3next": hf_tiny_next}
_CASES = [("qwen35moe", False), ("qwen35moe", True), ("qwen3next", False)]


@pytest.mark.parametrize(("arch", "fused_experts"), _CASES)
def test_gguf_loads_as_transformers_weights(arch: str, fused_experts: bool, tmp_path: Path) -> None:
    hf = _MODELS[arch](seed=21, layer_types=_LAYER_TYPES)
    tensors = _convert(hf, arch, fused_experts=fused_experts)
    path = write_gguf(tmp_path / "tiny.gguf", arch, _metadata(hf, arch), tensors)
    checkpoint = load_gguf(path, use_cache=False)
    config = checkpoint.config
    expected_config = ModelConfig.from_hf(hf.config.to_dict())
    assert config.architecture == expected_config.architecture == {"qwen35moe": "qwen3_5_moe"}.get(arch, "qwen3_next")
    for field in ("layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size", "linear_num_value_heads", "linear_value_head_dim"):
        assert getattr(config, field) == getattr(expected_config, field), field
    assert config.rotary_dim == expected_config.rotary_dim == 4
    sparse = [config.sparse_layer(i) for i in range(config.num_layers)]
    assert sparse == [expected_config.sparse_layer(i) for i in range(config.num_layers)]
    assert sparse == ([True] * 4 if arch == "qwen35moe" else [True, True, False, True])  # Qwen3-Next: layer 2 dense
    # transformers' tensors, with experts stacked per projection as every checkpoint holds them
    expected = stack_expert_weights(config, {k: v for k, v in hf.state_dict().items()})
    assert set(checkpoint.weights) == set(expected)
    for name, tensor in checkpoint.weights.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-5, msg=name)
    model = build_model(config, checkpoint.weights)
    ids = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)
        generated = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                                min_new_tokens=12)[0, 40:].tolist()
    assert run(model, None, ids[0].tolist(), 12, prefill_chunk=16)[0] == generated


def test_quantized_weights_are_declined(tmp_path: Path) -> None:
    """The hybrid mixtures' experts have no product over blocks: dense weights (dense-MLP hybrids load quantized,
    tests/test_gguf_hybrid_quantized.py)."""
    hf = hf_tiny_35_moe(seed=21, layer_types=_LAYER_TYPES)
    path = write_gguf(tmp_path / "tiny.gguf", "qwen35moe", _metadata(hf, "qwen35moe"), _convert(hf, "qwen35moe"))
    choice = choose_weights("auto", path, torch.device("cpu"), torch.float32)
    assert choice.kind == "dense" and "mixture of experts" in choice.reason
    with pytest.raises(ModelLoadError, match="mixture of experts"):
        choose_weights("quantized", path, torch.device("cpu"), torch.float32)


def test_malformed_files_are_load_errors(tmp_path: Path) -> None:
    hf = hf_tiny_35_moe(seed=21, layer_types=_LAYER_TYPES)
    metadata, tensors = _metadata(hf, "qwen35moe"), _convert(hf, "qwen35moe")
    no_router = {k: v for k, v in tensors.items() if k != "blk.2.ffn_gate_inp.weight"}
    with pytest.raises(ModelLoadError, match=r"layer 2 .* no router"):
        load_gguf(write_gguf(tmp_path / "a.gguf", "qwen35moe", metadata, no_router), use_cache=False)
    no_count = {k: v for k, v in metadata.items() if k != "qwen35moe.expert_count"}
    with pytest.raises(ModelLoadError, match=r"lacks qwen35moe\.expert_count"):
        load_gguf(write_gguf(tmp_path / "b.gguf", "qwen35moe", no_count, tensors), use_cache=False)
    short = {**tensors, "blk.1.ffn_down_exps.weight": tensors["blk.1.ffn_down_exps.weight"][:5]}
    with pytest.raises(ModelLoadError, match=r"experts\.down_proj"):
        load_gguf(write_gguf(tmp_path / "c.gguf", "qwen35moe", metadata, short), use_cache=False)
    # Qwen3-Next as an early converter wrote it, projections fused in `ssm_in`: not a layout this loader reads
    nxt = hf_tiny_next(seed=21, layer_types=_LAYER_TYPES)
    old = _convert(nxt, "qwen3next")
    old["blk.0.ssm_in.weight"] = np.concatenate((old.pop("blk.0.attn_qkv.weight"), old.pop("blk.0.attn_gate.weight")))
    with pytest.raises(ModelLoadError, match="ssm_in"):
        load_gguf(write_gguf(tmp_path / "d.gguf", "qwen3next", _metadata(nxt, "qwen3next"), old), use_cache=False)


def test_gguf_cache_keeps_the_joined_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second load from the dequantised cache gives the same config (dense-layer list included) and the rejoined
    `in_proj_qkvz` without parsing the GGUF again."""
    from dflash.models import gguf_loader

    nxt = hf_tiny_next(seed=21, layer_types=_LAYER_TYPES)
    path = write_gguf(tmp_path / "next.gguf", "qwen3next", _metadata(nxt, "qwen3next"), _convert(nxt, "qwen3next"))
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DFLASH_NO_CACHE", raising=False)
    monkeypatch.setattr(gguf_loader, "CACHE_MIN_SECONDS", 0.0)
    first = load_gguf(path)
    monkeypatch.setattr(gguf_loader, "GGUFFile", None)  # a second parse would fail
    second = load_gguf(path)
    assert second.config == first.config and second.config.mlp_only_layers == (2,)
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert torch.equal(second.weights[name], nxt.state_dict()[name])
