"""Models whose GGUF matrices are Q4_K_M (Q4_K with Q6_K for some layers' attn_v / ffn_down) or Q4_0 on the CPU with
quantized weights: they load with `--weights quantized` (and `auto`), run on int8x2 products, give the dense float32
model's logits within the inputs' rounding and its greedy tokens, and speculative decoding (linear, DDTree on
tiles and vectors) gives plain greedy decoding's tokens; the float32 and AMX kernels are refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from dflash.bench.random_gguf import write_random_gguf
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.engine.loading import LoadOptions, load_engine
from dflash.errors import ModelLoadError
from dflash.generation.request import GenerationRequest
from dflash.models import cpu_matmul
from dflash.models.cpu_matmul import use_cpu_matmul
from dflash.models.gguf_loader import load_gguf
from dflash.models.model import CausalLM
from dflash.models.quantized_layers import QuantizedLinear, QuantizedStack
from dflash.models.quantized_model import build_quantized_model
from dflash.models.registry import build_model
from dflash.models.resolve import load_checkpoint
from dflash.models.weight_choice import choose_weights
from tests.spec_helpers import one_torch_thread, random_prompts, run
from tests.test_ddtree_decode import run_ddtree
from tests.test_int8_kernel import needs_int8
from tests.test_quantized_model import requantized_tiny_gguf

T = GGMLQuantizationType
CPU = torch.device("cpu")
_one_thread = one_torch_thread  # autouse, module scope


@pytest.fixture(autouse=True)
def _no_gguf_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_NO_CACHE", "1")


@pytest.fixture(scope="module")
def q4_k_m_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bench's random tiny Qwen3 in Q4_K_M: 2 layers, the second given more bits (Q6_K attn_v and ffn_down)."""
    return write_random_gguf(tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf", "tiny", "q4_k_m")


def quantized_and_dense(path: Path) -> tuple[CausalLM, CausalLM]:
    quantized = build_quantized_model(load_checkpoint(path, weights="quantized"))
    use_cpu_matmul(quantized, "int8x2")
    dense_checkpoint = load_gguf(path)
    return quantized, build_model(dense_checkpoint.config, dense_checkpoint.weights)


def assert_like_dense(quantized: CausalLM, dense: CausalLM, tolerance: float) -> None:
    """Logits within `tolerance` x max |logit| of the dense float32 model's, and the same greedy tokens."""
    ids = torch.randint(0, dense.config.vocab_size - 3, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got, want = quantized(ids).logits, dense(ids).logits
    assert got is not None and want is not None
    assert (got - want).abs().max().item() <= tolerance * want.abs().max().item()
    prompt = ids[0].tolist()
    assert run(quantized, None, prompt, 12)[0] == run(dense, None, prompt, 12)[0]


def random_drafter(target: CausalLM, block: int = 8) -> DFlashDrafter:
    config = target.config
    raw = {
        "num_hidden_layers": 1, "num_target_layers": config.num_layers, "hidden_size": config.hidden_size,
        "intermediate_size": config.hidden_size, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": config.vocab_size, "block_size": block,
        "dflash_config": {"mask_token_id": config.vocab_size - 1, "target_layer_ids": [0, config.num_layers - 1]},
    }
    torch.manual_seed(11)
    return DFlashDrafter(DrafterConfig.from_dict(raw)).eval().requires_grad_(False)


@needs_int8
def test_a_q4_k_m_model_on_int8x2_products_is_the_dense_model(q4_k_m_path: Path) -> None:
    """Every matrix as the file's blocks: q/k in Q4_K beside v in Q6_K as one stack, Q6_K ffn_down, a Q4_K
    embedding and LM head. Observed: max |logit difference| 3.7e-5 of max |logit| (two-part inputs, about 15 bits);
    the bound leaves a margin of about 13x."""
    quantized, dense = quantized_and_dense(q4_k_m_path)
    qkv = quantized.layers[1].self_attn.qkv_proj  # the layer given more bits
    assert isinstance(qkv, QuantizedStack)
    assert [part.qtype for part in qkv.parts] == [int(T.Q4_K), int(T.Q6_K)]
    assert isinstance(quantized.lm_head, QuantizedLinear) and quantized.lm_head.qtype == int(T.Q6_K)
    assert {m.products for m in quantized.modules() if isinstance(m, QuantizedLinear)} == {"int8x2"}
    ids = torch.tensor([[5, 900, 17]])
    with torch.inference_mode():
        assert torch.equal(quantized.embed(ids), dense.embed(ids))  # gguf's dequantised rows, as the dense loader's
    assert_like_dense(quantized, dense, tolerance=5e-4)


@needs_int8
def test_a_q4_0_model_on_int8x2_products_is_the_dense_model(tmp_path: Path) -> None:
    """Every matrix quantised to Q4_0 by `gguf` (rows of 64 values: two blocks, not a super-block). Observed: max
    |logit difference| 8.8e-5 of max |logit|."""
    path = requantized_tiny_gguf(tmp_path, "llama", lambda name: T.Q4_0)
    quantized, dense = quantized_and_dense(path)
    assert isinstance(quantized.lm_head, QuantizedLinear) and quantized.lm_head.qtype == int(T.Q4_0)
    assert_like_dense(quantized, dense, tolerance=5e-4)


@needs_int8
@pytest.mark.parametrize("products", ["int8x2", "int8"])
def test_speculation_is_plain_greedy_decoding(q4_k_m_path: Path, products: str) -> None:
    """Linear DFlash and DDTree (budgets 4 and 15: 5 verified rows on the vector path, 16 on AMX-INT8 tiles where
    the CPU has them, Q6_K always on vectors) commit exactly the plain greedy tokens."""
    target = build_quantized_model(load_checkpoint(q4_k_m_path, weights="quantized"))
    use_cpu_matmul(target, products)
    drafter = random_drafter(target)
    for prompt in random_prompts(2, target.config.vocab_size - 3, seed=5, lengths=(9, 30)):
        plain, _ = run(target, None, prompt, 24)
        linear, stats = run(target, drafter, prompt, 24)
        assert linear == plain and stats.rounds > 0
        for budget in (4, 15):
            tree, stats = run_ddtree(target, drafter, prompt, 24, budget=budget)
            assert tree == plain and stats.rounds > 0, budget


@needs_int8
def test_the_engine_loads_and_generates_a_q4_k_m_file(q4_k_m_path: Path) -> None:
    """`--weights quantized` and `auto` keep the blocks on the CPU; auto's products are int8x2; float32 and amx are
    refused with the formats named."""
    assert choose_weights("auto", q4_k_m_path, CPU, torch.float32).kind == "quantized"
    engine = load_engine(str(q4_k_m_path), "none", loading=LoadOptions(device="cpu", weights="quantized"))
    assert engine.cpu_matmul == "int8x2"
    out = engine.generate(GenerationRequest(prompt_ids=[3, 14, 15, 92], max_new_tokens=6), spec="none")
    assert len(out.token_ids) == 6
    for products in ("float32", "amx"):
        with pytest.raises(ModelLoadError, match=f"--cpu-matmul {products} reads Q4_1 and Q8_0 matrices only; "
                                                 "this model has Q4_K, Q6_K matrices"):
            load_engine(str(q4_k_m_path), "none", loading=LoadOptions(device="cpu", cpu_matmul=products))


def test_the_choice_of_products_for_formats_only_int8_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_matmul, "int8_obstacle", lambda: None)
    monkeypatch.setattr(cpu_matmul, "amx_obstacle", lambda: None)
    formats = {T.Q4_K, T.Q6_K, T.Q8_0}
    choice = cpu_matmul.choose_cpu_matmul("auto", speculative=True, formats=formats)
    assert choice == cpu_matmul.MatmulChoice(
        "int8x2", "auto: Q4_K, Q6_K matrices, which only the int8 kernel reads: inputs in two 8-bit parts"
    )
    assert cpu_matmul.choose_cpu_matmul("int8", formats=formats).kind == "int8"
    assert cpu_matmul.choose_cpu_matmul("auto", formats={T.Q4_1, T.Q8_0}).kind == "amx"  # as before
    with pytest.raises(ModelLoadError, match="--cpu-matmul amx reads Q4_1 and Q8_0 matrices only; this model has Q4_0"):
        cpu_matmul.choose_cpu_matmul("amx", formats={T.Q4_0})
    monkeypatch.setattr(cpu_matmul, "int8_obstacle", lambda: "no AVX2 here")
    with pytest.raises(ModelLoadError, match="Q5_K matrices need the int8 kernel, which is not available: no AVX2"):
        cpu_matmul.choose_cpu_matmul("auto", formats={T.Q5_K})


def test_without_the_int8_kernel_auto_weights_stay_dense(q4_k_m_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_matmul, "int8_obstacle", lambda: "no AVX2 here")
    choice = choose_weights("auto", q4_k_m_path, CPU, torch.float32)
    assert choice.kind == "dense" and "Q4_K, Q6_K matrices need the int8 kernel: no AVX2 here" in choice.reason
    with pytest.raises(ModelLoadError, match="need the int8 kernel: no AVX2 here"):
        choose_weights("quantized", q4_k_m_path, CPU, torch.float32)
