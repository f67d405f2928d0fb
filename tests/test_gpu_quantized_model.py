"""A model whose matrices stay GGUF blocks for the GPU programs (`dflash.models.gpu_quantized_layers`), on a tiny
random Q4_K_M / Q8_0 file, against the dense model of the same file; run on a GPU, or on the CPU under Triton's
interpreter (float32 there, which makes the comparison tight)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from dflash.bench.random_gguf import write_random_gguf
from dflash.errors import ModelLoadError
from dflash.fastpath.fused_layers import apply_linear
from dflash.kernels.triton_gguf_matmul import MAX_ROWS, gguf_programs_usable
from dflash.models.cpu_matmul import int8_obstacle
from dflash.models.gguf_loader import load_gguf
from dflash.models.gpu_quantized_layers import GGUFEmbedding, GGUFLinear, uses_gpu_quantized_weights
from dflash.models.quantized_model import build_quantized_model
from dflash.models.registry import build_model
from dflash.models.resolve import load_checkpoint
from dflash.models.weight_choice import choose_weights

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# float32 under the interpreter: summation order only; bf16 on a GPU: activations and tiles rounded to bf16
TOLERANCE = 2e-2 if ON_GPU else 1e-4
needs_triton = pytest.mark.skipif(
    not gguf_programs_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)"
)


@pytest.fixture(autouse=True)
def _no_gguf_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_NO_CACHE", "1")


def tiny_file(tmp_path: Path, mix: str) -> Path:
    return write_random_gguf(tmp_path / f"tiny_{mix}.gguf", "tiny", mix)


@needs_triton
@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0"])
def test_block_model_matches_the_dense_model(tmp_path: Path, mix: str) -> None:
    """Same file, two paths: every projection, the embedding and the LM head as blocks against the dense loader's
    dequantised weights. Logits of a 5-token forward (the block program) and of a 70-token one (past 64 rows:
    dequantised for cuBLAS) within `TOLERANCE` of the largest logit; embedding rows equal (float32)."""
    path = tiny_file(tmp_path, mix)
    dense_checkpoint = load_gguf(path)
    dense = build_model(dense_checkpoint.config, dense_checkpoint.weights, device=DEVICE, dtype=torch.float32)
    checkpoint = load_checkpoint(path, weights="quantized", quantized_for="cuda")
    model = build_quantized_model(checkpoint, device=DEVICE, dtype=DTYPE, block_programs=True)
    assert uses_gpu_quantized_weights(model) and not uses_gpu_quantized_weights(dense)
    assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear) and all(b.device.type == DEVICE.type for b in qkv.buffers())
    if mix == "q4_k_m":  # q and k in Q4_K as words, v in Q6_K as blocks
        assert qkv.formats == [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K] and hasattr(qkv, "words")
    assert model.layers[0].input_layernorm.weight.dtype == DTYPE
    expected_type = GGMLQuantizationType.Q6_K if mix == "q4_k_m" else GGMLQuantizationType.Q8_0
    assert model.lm_head.qtype == expected_type and model.layers[1].mlp.down_proj.qtype == expected_type
    generator = torch.Generator().manual_seed(4)
    for length in (5, MAX_ROWS + 6):
        ids = torch.randint(0, checkpoint.config.vocab_size, (1, length), generator=generator).to(DEVICE)
        with torch.inference_mode():
            want = dense(ids).logits
            got = model(ids).logits
            if not ON_GPU:
                assert torch.equal(model.embed(ids), dense.embed(ids))
        assert got is not None and want is not None and got.dtype == DTYPE
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=0, atol=TOLERANCE * scale)


@needs_triton
def test_fused_path_and_shortlist_rows_use_the_blocks(tmp_path: Path) -> None:
    """The fused forwards' `apply_linear` runs a `GGUFLinear` through its block program, and a head cut to a token
    shortlist gives those tokens' logits."""
    checkpoint = load_checkpoint(tiny_file(tmp_path, "q4_k_m"), weights="quantized", quantized_for="cuda")
    model = build_quantized_model(checkpoint, device=DEVICE, dtype=DTYPE, block_programs=True)
    hidden = torch.randn((3, checkpoint.config.hidden_size), generator=torch.Generator().manual_seed(0)).to(DEVICE, DTYPE)
    gate_up = model.layers[0].mlp.gate_up_proj
    with torch.inference_mode():
        assert torch.equal(apply_linear(hidden, gate_up), gate_up(hidden))
        ids = torch.tensor([7, 1000, 3, 512], device=DEVICE)
        head = model.lm_head
        assert isinstance(head, GGUFLinear)
        shortlist = head.rows(ids)
        assert (shortlist.out_features, shortlist.qtype) == (4, head.qtype)
        torch.testing.assert_close(shortlist(hidden), head(hidden)[:, ids], rtol=0, atol=0)
        dense_rows = head.dequantized()[ids]  # [4, hidden]
        torch.testing.assert_close(
            shortlist(hidden).float(), hidden.float() @ dense_rows.float().T, rtol=0, atol=TOLERANCE
        )


def test_quantized_on_a_gpu_is_opt_in_and_reads_k_quants(tmp_path: Path) -> None:
    """A Q4_K_M file: `quantized` on CUDA in bf16 keeps its blocks (as the CPU's int8 kernel does); float32 on CUDA
    is refused; `auto` stays dense on a GPU."""
    path = tiny_file(tmp_path, "q4_k_m")
    cuda = torch.device("cuda")
    assert choose_weights("quantized", path, cuda, torch.bfloat16).kind == "quantized"
    assert choose_weights("quantized", path, cuda, torch.float16).kind == "quantized"
    assert choose_weights("auto", path, cuda, torch.bfloat16).kind == "dense"
    with pytest.raises(ModelLoadError, match="bfloat16 or float16"):
        choose_weights("quantized", path, cuda, torch.float32)
    if int8_obstacle() is None:
        assert choose_weights("quantized", path, torch.device("cpu"), torch.float32).kind == "quantized"
    checkpoint = load_checkpoint(path, weights="quantized", quantized_for="cuda")
    with pytest.raises(ModelLoadError, match="take bfloat16 or float16"):
        build_quantized_model(checkpoint, device=cuda, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_decodes_through_graphs_with_gpu_blocks(tmp_path: Path) -> None:
    """`--weights quantized` on CUDA end to end: the engine loads the Q4_K_M file's blocks, decodes greedily through
    the graph runner (fused layers, captured graphs), and every token it picks is the argmax of the same model's
    eager logits up to bf16 rounding (within 2% of the largest logit of the top one)."""
    runner = check_tokens_against_eager(tmp_path, [5, 77, 300, 12, 901, 64, 8])
    assert runner.captured > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_prompt_longer_than_the_graphs_runs_through_the_fused_layers(tmp_path: Path) -> None:
    """A prompt chunk past the graphs' rows (a quantized target prefills in long chunks) runs eagerly through the
    fused layers into the runner's storage; the tokens that follow are still the eager model's argmax."""
    prompt = torch.randint(10, 1000, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = check_tokens_against_eager(tmp_path, prompt)
    assert runner.fused_chunks >= 1 and runner.max_rows < 300


def check_tokens_against_eager(tmp_path: Path, prompt: list[int]) -> Any:
    """Greedy tokens of the quantized engine (graph runner) for `prompt`, each the argmax of the same model's eager
    logits up to bf16 rounding; -> the runner."""
    from dflash.engine.loading import LoadOptions, load_engine
    from dflash.fastpath.dispatch import graph_runner_of
    from dflash.generation.request import GenerationRequest

    path = tiny_file(tmp_path, "q4_k_m")
    engine = load_engine(str(path), "none", loading=LoadOptions(device="cuda", weights="quantized"))
    assert uses_gpu_quantized_weights(engine.target)
    result = engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True), spec="none")
    runner = graph_runner_of(engine.target)
    assert runner is not None
    tokens = list(result.token_ids)
    assert len(tokens) == 12
    with torch.inference_mode():
        logits = engine.target(torch.tensor([prompt + tokens[:-1]], device="cuda")).logits
    assert logits is not None
    chosen = logits[0, len(prompt) - 1 :].float()  # [12, vocab]: the rows that picked each token
    picked = chosen.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    gap = chosen.max(dim=1).values - picked
    assert gap.max().item() <= 0.02 * chosen.abs().max().item()
    return runner
