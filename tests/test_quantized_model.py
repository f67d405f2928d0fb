"""Quantized-weight models on tiny GGUF files (llama, qwen3, gemma3) against the dense loader, the
`--weights` choice, build failures, and `dflash inspect`."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from dflash.cli import main as cli_main
from dflash.errors import ModelLoadError
from dflash.kernels import build
from dflash.kernels.build import KernelUnavailable, load_quant_kernel
from dflash.models.gguf_file import GGUFFile
from dflash.models.gguf_loader import load_gguf
from dflash.models.gguf_quantized import load_gguf_quantized
from dflash.models.quantized_layers import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedStack,
    uses_quantized_weights,
)
from dflash.models.quantized_model import build_quantized_model
from dflash.models.registry import build_model
from dflash.models.resolve import load_checkpoint
from dflash.models.weight_choice import choose_weights
from tests.loading_helpers import quantized, smollm2_path, tiny_model_gguf, write_gguf

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_gguf_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_NO_CACHE", "1")


def requantized_tiny_gguf(
    tmp_path: Path, arch: str, qtype_of: Callable[[str], GGMLQuantizationType], seed: int = 0
) -> Path:
    """A random tiny model of `arch` whose matrices are stored in `qtype_of(name)` (norms stay float32)."""
    plain = tmp_path / f"{arch}-f32.gguf"
    _, metadata = tiny_model_gguf(plain, arch, seed)
    source = GGUFFile(plain)
    tensors = {}
    for name, info in source.tensors.items():
        values = source.dequantize(info)
        tensors[name] = quantized(values, qtype_of(name)) if values.ndim == 2 else values
    return write_gguf(tmp_path / f"{arch}-quantized.gguf", arch, metadata, tensors)


def mixed_types(name: str) -> GGMLQuantizationType:
    """Q8_0 for the embedding and the output head, Q4_1 for the layers (the default model's layout)."""
    return Q8_0 if name in ("token_embd.weight", "output.weight") else Q4_1


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_tiny_quantized_model_matches_the_dense_model(tmp_path: Path, arch: str) -> None:
    """Same blocks, two paths: the quantized model's logits equal the dense model's up to summation order,
    and its embedding rows are bitwise the dense loader's (Q/K un-permutation, fusing, tied/untied head,
    Gemma's norm shift and embedding scale all go through the quantized path)."""
    path = requantized_tiny_gguf(tmp_path, arch, mixed_types)
    dense_ck = load_gguf(path)
    dense = build_model(dense_ck.config, dense_ck.weights)
    quant_ck = load_gguf_quantized(path)
    assert quant_ck.type_counts() == {"Q4_1": 14, "Q8_0": 2 if arch == "qwen3" else 1}
    model = build_quantized_model(quant_ck)
    assert uses_quantized_weights(model) and not uses_quantized_weights(dense)
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(model.layers[1].self_attn.qkv_proj, QuantizedLinear)
    ids = torch.randint(0, dense_ck.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model.embed(ids), dense.embed(ids))
        want = dense(ids).logits
        got = model(ids).logits
    assert got is not None and want is not None
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_tiny_quantized_block_forward_matches_single_steps(tmp_path: Path) -> None:
    """A 9-token forward over a cache (a verification) against nine one-token steps: every projection is
    batch invariant, so the first layer's q/k/v are bitwise equal; attention (SDPA) is the one op whose
    rounding depends on the number of queries, so the logits agree to float32 rounding only."""
    path = requantized_tiny_gguf(tmp_path, "llama", mixed_types)
    model = build_quantized_model(load_gguf_quantized(path))
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    qkv_outputs: list[torch.Tensor] = []
    model.layers[0].self_attn.qkv_proj.register_forward_hook(lambda m, i, out: qkv_outputs.append(out))
    with torch.inference_mode():
        cache = model.new_cache(32)
        model(ids[:, :7], cache=cache)
        qkv_outputs.clear()
        block = model(ids[:, 7:], cache=cache).logits
        block_qkv = qkv_outputs.pop()
        cache = model.new_cache(32)
        model(ids[:, :7], cache=cache)
        qkv_outputs.clear()
        steps = torch.cat([model(ids[:, i : i + 1], cache=cache).logits for i in range(7, 16)], dim=1)  # type: ignore[misc]
    assert torch.equal(block_qkv, torch.cat(qkv_outputs, dim=1))
    assert block is not None
    torch.testing.assert_close(block, steps, rtol=0, atol=1e-5 * steps.abs().max().item())


def test_fused_parts_of_different_types_run_one_product_per_format(tmp_path: Path) -> None:
    """q and v in Q4_1 with k in Q8_0: the fused projection keeps one matrix per run of a format, its outputs side
    by side, and the model's logits are the dense model's up to summation order."""
    path = requantized_tiny_gguf(tmp_path, "llama", lambda name: Q8_0 if ".attn_k." in name else Q4_1)
    model = build_quantized_model(load_gguf_quantized(path))
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedStack)
    assert [(p.qtype, p.out_features) for p in qkv.parts] == [(int(Q4_1), 32), (int(Q8_0), 16), (int(Q4_1), 16)]
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantizedLinear)  # gate and up share Q4_1: one matrix
    dense_ck = load_gguf(path)
    dense = build_model(dense_ck.config, dense_ck.weights)
    ids = torch.randint(0, dense_ck.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got, want = model(ids).logits, dense(ids).logits
    assert got is not None and want is not None
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_unsupported_matrix_types(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A float32 (or any other unsupported) matrix: auto stays dense, quantized is refused with the reason."""
    path = tmp_path / "f32.gguf"
    tiny_model_gguf(path, "llama")
    with caplog.at_level(logging.INFO, "dflash.models.weight_choice"):
        choice = choose_weights("auto", path, CPU, torch.float32)
    assert choice.kind == "dense" and "F32" in choice.reason
    with pytest.raises(ModelLoadError, match=r"F32 .*CPU kernels read Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K"):
        choose_weights("quantized", path, CPU, torch.float32)
    with pytest.raises(ModelLoadError, match="F32"):
        load_checkpoint(path, weights="quantized")


def test_auto_choice(tmp_path: Path) -> None:
    default = smollm2_path()
    assert choose_weights("auto", default, CPU, torch.float32).kind == "quantized"
    assert choose_weights("quantized", default, CPU, torch.float32).kind == "quantized"
    assert choose_weights("dense", default, CPU, torch.float32).kind == "dense"
    on_gpu = choose_weights("auto", default, torch.device("cuda"), torch.bfloat16)
    assert on_gpu.kind == "dense" and "opt-in" in on_gpu.reason
    in_bf16 = choose_weights("auto", default, CPU, torch.bfloat16)
    assert in_bf16.kind == "dense" and "float32" in in_bf16.reason
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    assert choose_weights("auto", hf_dir, CPU, torch.float32).kind == "dense"
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        choose_weights("quantized", hf_dir, CPU, torch.float32)
    with pytest.raises(ModelLoadError, match="bfloat16 or float16"):
        choose_weights("quantized", default, torch.device("cuda"), torch.float32)
    with pytest.raises(ModelLoadError, match="CPU only"):
        choose_weights("quantized", default, torch.device("mps"), torch.float32)


def test_kernel_unavailable_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_kernel(extra_flags: tuple[str, ...] = ()) -> None:
        raise KernelUnavailable("building the kernel quant_matmul.cpp failed: g++: not found")

    monkeypatch.setattr(build, "load_quant_kernel", no_kernel)
    with caplog.at_level(logging.WARNING, "dflash.models.weight_choice"):
        choice = choose_weights("auto", smollm2_path(), CPU, torch.float32)
    assert choice.kind == "dense" and "g++: not found" in choice.reason
    assert any("g++: not found" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    with pytest.raises(ModelLoadError, match="g\\+\\+: not found"):
        choose_weights("quantized", smollm2_path(), CPU, torch.float32)


def test_a_failing_build_raises_kernel_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real compiler failure (a flag g++ rejects) becomes KernelUnavailable, remembered for the process."""
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    flags = ("-fno-such-option-in-any-compiler",)
    with pytest.raises(KernelUnavailable, match=r"building the kernel quant_matmul\.cpp failed"):
        load_quant_kernel(flags)
    with pytest.raises(KernelUnavailable, match=r"building the kernel quant_matmul\.cpp failed"):
        load_quant_kernel(flags)


def test_inspect_reports_the_weight_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["inspect", "default"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["weights"]["path"] == "quantized"
    assert info["weights"]["matrix_types"] == {"Q4_1": 210, "Q8_0": 1}
    assert info["weights"]["kernel_isa"] in ("avx512", "avx2", "generic")
    assert info["parameters"] > 130_000_000
    assert cli_main(["inspect", "default", "--weights", "dense"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert dense["weights"]["path"] == "dense" and dense["parameters"] == info["parameters"]
