"""Qwen3.5 hybrid GGUFs with their matrices kept quantized (`dflash.models.gguf_quantized`): the value-head rows
put back in transformers' order on the blocks, the output projection's columns left in llama.cpp's order and its
input reordered instead, the linear layers' input projections joined into one module. Against the dense loader of
the same file (which dequantises first), on the CPU kernels, the GPU programs (interpreted on the CPU), and
through speculative decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.bench.random_gguf import write_random_gguf
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.fastpath.runner import attach_graph_runner
from dflash.generation.forwards import register_forwards
from dflash.kernels.triton_gguf_matmul import gguf_programs_usable
from dflash.models.cpu_matmul import int8_obstacle
from dflash.models.gated_deltanet import GatedDeltaNet
from dflash.models.gguf_loader import load_gguf
from dflash.models.model import CausalLM
from dflash.models.quantized_model import InputOrdered, build_quantized_model
from dflash.models.quantized_weights import QuantizedCheckpoint
from dflash.models.registry import build_model
from dflash.models.resolve import load_checkpoint
from dflash.models.weight_choice import choose_weights
from tests.spec_helpers import one_torch_thread, random_prompts
from tests.test_fastpath import generate

_threads = one_torch_thread
VOCAB = 1024  # the tiny-hybrid shape's
needs_int8 = pytest.mark.skipif(int8_obstacle() is not None, reason="the K formats need the CPU's int8 kernel")


@pytest.fixture(autouse=True)
def _no_gguf_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_NO_CACHE", "1")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hybrid")
    return {mix: write_random_gguf(folder / f"tiny-hybrid-{mix}.gguf", "tiny-hybrid", mix) for mix in ("q8_0", "q4_k_m")}


def _dense(path: Path) -> CausalLM:
    checkpoint = load_gguf(path, use_cache=False)
    return build_model(checkpoint.config, checkpoint.weights)


def _quantized(path: Path, device_type: str) -> QuantizedCheckpoint:
    checkpoint = load_checkpoint(path, weights="quantized", quantized_for=device_type)
    assert isinstance(checkpoint, QuantizedCheckpoint)
    return checkpoint


def _logits(model: CausalLM, length: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits is not None
    return logits.float()


@pytest.mark.parametrize("mix", ["q8_0", pytest.param("q4_k_m", marks=needs_int8)])
def test_quantized_hybrid_matches_the_dense_model_on_the_cpu(files: dict[str, Path], mix: str) -> None:
    """Same file both ways; every linear layer's four input projections in one module, its output projection
    reordering its input (two value heads per key head: llama.cpp's tiled order differs from transformers'), the
    convolution dense. Q8_0 runs the float32 kernel (exact blocks, float32 rows); Q4_K_M the int8 kernel (inputs
    rounded to about 15 bits)."""
    checkpoint = _quantized(files[mix], "cpu")
    assert sorted(checkpoint.input_orders) == [f"model.layers.{i}.linear_attn.out_proj.weight" for i in (0, 1, 2)]
    assert "model.layers.0.linear_attn.conv1d.weight" in checkpoint.weights
    model = build_quantized_model(checkpoint)
    mixer = model.layers[0].linear_attn
    assert isinstance(mixer, GatedDeltaNet) and mixer.joined_projections == 4
    assert not hasattr(mixer, "in_proj_qkv") and isinstance(mixer.out_proj, InputOrdered)
    assert type(mixer.conv1d) is nn.Conv1d
    dense = _dense(files[mix])
    tolerance = 1e-5 if mix == "q8_0" else 2e-4
    for length in (7, 70):
        want, got = _logits(dense, length), _logits(model, length)
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance * want.abs().max().item())


@pytest.mark.skipif(not gguf_programs_usable(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
def test_quantized_hybrid_on_the_gpu_programs(files: dict[str, Path]) -> None:
    """The GPU modules (words for Q4_K and Q6_K, blocks otherwise) built on the CPU in float32 under Triton's
    interpreter: the logits of the dense model of the file, up to summation order."""
    checkpoint = _quantized(files["q4_k_m"], "cuda")
    model = build_quantized_model(checkpoint, block_programs=True)
    dense = _dense(files["q4_k_m"])
    for length in (5, 70):
        want, got = _logits(dense, length), _logits(model, length)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_auto_keeps_a_hybrid_quantized_on_the_cpu(files: dict[str, Path]) -> None:
    choice = choose_weights("auto", files["q8_0"], torch.device("cpu"), torch.float32)
    assert choice.kind == "quantized", choice.reason


def _drafter() -> DFlashDrafter:
    raw = {
        "num_hidden_layers": 1, "num_target_layers": 4, "hidden_size": 256, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": VOCAB,
        "block_size": 6, "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 2]},
    }
    torch.manual_seed(3)
    return DFlashDrafter(DrafterConfig.from_dict(raw)).eval().requires_grad_(False)


def test_speculation_on_a_quantized_hybrid_gives_the_plain_tokens(files: dict[str, Path]) -> None:
    """Linear DFlash and DDTree with a random drafter, eagerly and through the graph runner's static forwards
    (their joint projection, reordered output input and fixed recurrent buffers), give plain greedy decoding's
    tokens; prompts past one prefill chunk."""
    model = build_quantized_model(_quantized(files["q8_0"], "cpu"))
    drafter = _drafter()
    prompts = random_prompts(2, VOCAB, seed=4, lengths=(11, 40))
    plain = [generate(model, None, "none", p, 24) for p in prompts]
    for mode in ("linear", "ddtree:6"):
        assert [generate(model, drafter, mode, p, 24) for p in prompts] == plain, mode
    runner = attach_graph_runner(model, drafter, capacity=256, capture=False)
    try:
        static = [generate(model, drafter, "ddtree:6", p, 24) for p in prompts]
    finally:
        register_forwards(model, None)
    assert static == plain and runner.served > 10 and not runner.fused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantized_hybrid_in_cuda_graphs(files: dict[str, Path]) -> None:
    """bf16 on a GPU: the quantized hybrid's logits near the dense model's (float32), and DDTree through the
    graph runner's replayed graphs (joint projection, reordered input, fixed recurrent buffers) decodes."""
    checkpoint = _quantized(files["q4_k_m"], "cuda")
    model = build_quantized_model(checkpoint, device="cuda", dtype=torch.bfloat16)
    dense = _dense(files["q4_k_m"]).to("cuda")
    for length in (5, 70):
        ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length)).cuda()
        with torch.inference_mode():
            want, got = dense(ids).logits, model(ids).logits
        assert want is not None and got is not None
        torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-2 * want.abs().max().item())
    drafter = _drafter().to("cuda", torch.bfloat16)
    prompts = random_prompts(2, VOCAB, seed=4, lengths=(11, 90))
    runner = attach_graph_runner(model, drafter, capacity=512)
    try:
        tokens = [generate(model, drafter, "ddtree:6", p, 40) for p in prompts]
    finally:
        register_forwards(model, None)
    assert all(len(t) == 40 for t in tokens) and runner.captured > 0 and runner.served > 10


def test_a_converted_hybrid_against_transformers(tmp_path: Path) -> None:
    """A transformers model written as llama.cpp's converter writes it, its matrices quantized to Q8_0 except b and
    a (kept float32, as a file may keep them): loads with q/k/v and z joined, b and a dense, and gives
    transformers' logits up to Q8_0's rounding. The same file all in float32 stays dense under `auto`."""
    from gguf import GGMLQuantizationType

    from tests.hybrid_gguf import convert_hybrid, hybrid_metadata
    from tests.hybrid_models import hf_tiny_hybrid
    from tests.loading_helpers import quantized, write_gguf

    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    hf = hf_tiny_hybrid(seed=5, layer_types=layer_types, linear_value_head_dim=16)  # rows of 64: Q8_0 blocks
    tensors = convert_hybrid(hf)
    dense_path = write_gguf(tmp_path / "f32.gguf", "qwen35", hybrid_metadata(hf, 0), tensors)
    assert choose_weights("auto", dense_path, torch.device("cpu"), torch.float32).kind == "dense"
    kept_float = (".ssm_conv1d.", ".ssm_beta.", ".ssm_alpha.")
    mixed = {
        name: quantized(w, GGMLQuantizationType.Q8_0) if w.ndim == 2 and not any(k in name for k in kept_float) else w
        for name, w in tensors.items()
    }
    path = write_gguf(tmp_path / "q8.gguf", "qwen35", hybrid_metadata(hf, 0), mixed)
    model = build_quantized_model(_quantized(path, "cpu"))
    mixer = model.layers[0].linear_attn
    assert isinstance(mixer, GatedDeltaNet) and mixer.joined_projections == 2
    assert type(mixer.in_proj_b) is nn.Linear and type(mixer.in_proj_a) is nn.Linear
    ids = torch.randint(0, hf.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want, got = hf(ids).logits, model(ids).logits
    assert got is not None
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())


@pytest.mark.skipif(not gguf_programs_usable(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
@torch.inference_mode()
def test_fused_runner_serves_a_quantized_hybrid(files: dict[str, Path]) -> None:
    """The fused hybrid forward over GGUF matrices (the joint input projection, the reordered output projection,
    the MLP through the word programs; float32 under the interpreter) against the unfused static forward: a
    prompt, then a 3-row tree, the same logits."""
    from dflash.fastpath.fused_hybrid import supports_fused_hybrid
    from dflash.fastpath.runner import GraphRunner

    model = build_quantized_model(_quantized(files["q4_k_m"], "cuda"), block_programs=True)
    assert supports_fused_hybrid(model)
    runners = [GraphRunner(model, None, capacity=64, capture=False, fused=fused) for fused in (False, True)]
    caches = [runner.lease_target_cache(40) for runner in runners]
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    steps = ((torch.tensor([random_prompts(1, VOCAB, seed=9, lengths=(9,))[0]]), None, None),
             (torch.tensor([[5, 9, 10]]), torch.tensor([[9, 10, 10]]), ancestors))
    for ids, positions, mask in steps:
        outs = [runner.target_forward(ids, positions, cache, mask, (), "all")
                for runner, cache in zip(runners, caches, strict=True)]
        assert outs[0] is not None and outs[1] is not None and outs[0].logits is not None
        torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=0, atol=1e-4 * outs[0].logits.abs().max().item())
    assert runners[1].fused and not runners[0].fused
