"""The static (graph-ready) forwards against the eager path, on the CPU: same logits, features and tokens.

On the CPU the runner calls the static forwards directly (nothing is captured); the GPU tests at the end replay
real CUDA graphs and skip without a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dflash.drafter.int8 import quantize_drafter_int8
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.fastpath.runner import GraphRunner, attach_graph_runner
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.forwards import register_forwards
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.speculative.ddtree import decode_ddtree
from dflash.speculative.linear import decode_linear
from tests.spec_helpers import golden_pair, random_prompts
from tests.tiny_models import hf_tiny, ours_from_hf


def generate(
    target: CausalLM, drafter: DFlashDrafter | None, mode: str, prompt: list[int], max_new: int,
    sampling: SamplingParams | None = None,
) -> list[int]:
    sampling = sampling or SamplingParams()
    device = target.embed_tokens.weight.device
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
    chooser = TokenChooser(sampling, eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size, device=device)
    if mode == "none" or drafter is None:
        decode_autoregressive(target, request, sink, chooser, prefill_chunk=32)
    elif mode == "linear":
        decode_linear(target, drafter, request, sink, chooser, prefill_chunk=32)
    else:
        decode_ddtree(target, drafter, request, sink, chooser, prefill_chunk=32, budget=int(mode.split(":")[1]))
    return sink.token_ids


def eager_then_static(
    target: CausalLM, drafter: DFlashDrafter, mode: str, prompts: list[list[int]], max_new: int, *, capacity: int,
    fused: bool | None = False,
) -> tuple[list[list[int]], list[list[int]], GraphRunner]:
    """The tokens of every prompt without a runner, then through a freshly attached one (detached afterwards)."""
    eager = [generate(target, drafter, mode, p, max_new) for p in prompts]
    runner = attach_graph_runner(target, drafter, capacity=capacity, capture=False, fused=fused)
    try:
        static = [generate(target, drafter, mode, p, max_new) for p in prompts]
    finally:
        register_forwards(target, None)
    return eager, static, runner


def sliding_drafter(target: CausalLM, block: int = 4) -> DFlashDrafter:
    raw = {
        "num_hidden_layers": 2, "num_target_layers": target.config.num_layers, "hidden_size": 64,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": target.config.vocab_size, "block_size": block, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "dflash_config": {"mask_token_id": target.config.vocab_size - 1, "target_layer_ids": [1, 2]},
    }
    torch.manual_seed(11)
    return DFlashDrafter(DrafterConfig.from_dict(raw)).eval().requires_grad_(False)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_static_target_forward_matches_eager(family: str) -> None:
    """A chain, a tree and a single step through the runner give the eager forward's logits and features."""
    target = ours_from_hf(hf_tiny(family))
    runner = GraphRunner(target, None, capacity=600, capture=False)
    prompt = torch.tensor([random_prompts(1, 512, seed=4, lengths=(300,))[0]])
    eager_cache = target.new_cache(400)
    static_cache = runner.lease_target_cache(400)
    assert static_cache is not None
    with torch.inference_mode():
        target(prompt, cache=eager_cache)
        target(prompt, cache=static_cache)
        chain = torch.tensor([[5, 9, 200, 17, 3]])
        tree_ids = torch.tensor([[5, 9, 10, 200, 201, 17]])
        tree_positions = 300 + torch.tensor([[0, 1, 1, 2, 2, 3]])
        ancestors = torch.tensor(
            [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
             [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool,
        )
        for ids, positions, mask in ((chain, None, None), (tree_ids, tree_positions, ancestors), (chain[:, :1], None, None)):
            start = eager_cache.length
            eager = target(ids, positions, eager_cache, tree_mask=mask, capture=(1, 2))
            static = runner.target_forward(ids, positions, static_cache, mask, (1, 2), "all")
            assert static is not None and eager.logits is not None and static.logits is not None
            assert static.logits.shape == eager.logits.shape
            torch.testing.assert_close(static.logits, eager.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(static.features, eager.features, rtol=1e-5, atol=1e-5)
            assert static_cache.length == eager_cache.length == start + ids.shape[1]
            eager_cache.crop(start + 1)
            static_cache.crop(start + 1)
        torch.testing.assert_close(static_cache.keys[:, :, :, : static_cache.length],
                                   eager_cache.keys[:, :, :, : eager_cache.length], rtol=1e-5, atol=1e-5)
    assert runner.served == 3


@pytest.mark.parametrize("mode", ["none", "linear", "ddtree:6", "ddtree:24"])
def test_generation_through_the_runner_equals_eager(mode: str) -> None:
    target, drafter = golden_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=21, lengths=(7, 40, 130))
    eager, static, runner = eager_then_static(target, drafter, mode, prompts, 70, capacity=1024)
    assert static == eager
    assert runner.served > 3 * 20  # the decode steps really went through the static path


def test_sliding_window_models_through_the_runner() -> None:
    """Gemma 3 target (sliding layers, window 16) and a drafter with a sliding layer (window 8)."""
    target = ours_from_hf(hf_tiny("gemma3"))
    drafter = sliding_drafter(target)
    prompts = random_prompts(2, 512, seed=5, lengths=(30, 90))
    for mode in ("linear", "ddtree:8"):
        eager, static, runner = eager_then_static(target, drafter, mode, prompts, 40, capacity=512)
        assert static == eager
        assert runner.served > 20


def test_drafter_round_matches_eager() -> None:
    target, drafter = golden_pair()
    runner = GraphRunner(target, drafter, capacity=512, capture=False)
    features = torch.randn(1, 80, drafter.config.feature_size)
    leased = runner.lease_drafter_cache(300)
    assert leased is not None
    own = DFlashDrafter.new_cache(drafter, 300)
    with torch.inference_mode():
        first = drafter.draft_scores(target, 3, 40, features[:, :40], own).full()
        drafter.draft_scores(target, 3, 40, features[:, :40], leased).full()  # eager: 40 rows is not a graph shape
        assert runner.served == 0
        for new_rows in (1, 3, drafter.config.block_size):
            start = own.length + new_rows
            rows = features[:, own.length : start]
            eager = drafter.draft_scores(target, 7, start, rows, own).full()
            static = runner.draft_logits(7, start, rows, leased, drafter.config.block_size - 1)
            assert static is not None
            torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
            assert leased.length == own.length == start
    assert runner.served == 3
    assert not torch.equal(first, eager)


def test_a_second_live_cache_gets_its_own_memory() -> None:
    target, drafter = golden_pair()
    runner = GraphRunner(target, drafter, capacity=256, capture=False)
    first = runner.lease_target_cache(100)
    assert first is not None and first.shares_memory_with(runner.target_storage)
    assert runner.lease_target_cache(100) is None  # the first is alive: the model allocates its own
    assert runner.lease_target_cache(300) is None  # larger than the storage
    del first
    assert runner.lease_target_cache(100) is not None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["none", "linear", "ddtree:16"])
def test_cuda_graph_replay_equals_eager(mode: str) -> None:
    """fp32 on the GPU: replayed graphs give the eager tokens, across bucket sizes (prompts up to 400 tokens,
    300 new tokens cross the 256 and 512 buckets)."""
    target, drafter = golden_pair("cuda")
    try:
        prompts = random_prompts(3, target.config.vocab_size, seed=8, lengths=(9, 200, 400))
        eager = [generate(target, drafter, mode, p, 300) for p in prompts]
        runner = attach_graph_runner(target, drafter, capacity=2048)
        graphed = [generate(target, drafter, mode, p, 300) for p in prompts]
        assert graphed == eager
        assert runner.captured > 0 and runner.served > 100
    finally:
        register_forwards(target, None)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("draft_weights", ["dense", "int8"])
def test_cuda_graph_speculation_equals_plain_greedy(draft_weights: str) -> None:
    target, drafter = golden_pair("cuda")
    if draft_weights == "int8":  # quantized on the CPU, a copy of its own
        drafter = copy.deepcopy(golden_pair()[1])
        quantize_drafter_int8(drafter)
        drafter = drafter.to("cuda")
    try:
        runner = attach_graph_runner(target, drafter, capacity=2048)
        prompts = random_prompts(4, target.config.vocab_size, seed=9, lengths=(12, 300))
        for prompt in prompts:
            plain = generate(target, drafter, "none", prompt, 200)
            assert generate(target, drafter, "linear", prompt, 200) == plain
            assert generate(target, drafter, "ddtree:16", prompt, 200) == plain
        # plain, linear and tree rounds all ran as device-resident graphs (`dflash.fastpath.resident`)
        assert len(runner.residents) == 3 and all(decoder.launched > 0 for decoder in runner.residents.values())
    finally:
        register_forwards(target, None)


def fused_kernels_runnable() -> bool:
    from dflash.kernels.triton_decode import interpreting, triton_available

    return triton_available() and (torch.cuda.is_available() or interpreting())


fused = pytest.mark.skipif(not fused_kernels_runnable(), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")


def test_split_key_attention_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Multi-row forwards up to the graph rows use the split-key program by default, one-row steps and larger
    forwards SDPA; DFLASH_ATTENTION=sdpa opts out, an unknown value is an error that names the choices."""
    from dflash.fastpath.fused_layers import SPLIT_MAX_ROWS, split_key_attention

    monkeypatch.delenv("DFLASH_ATTENTION", raising=False)
    assert [split_key_attention(rows) for rows in (1, 2, 16, SPLIT_MAX_ROWS, SPLIT_MAX_ROWS + 1)] == [
        False, True, True, True, False,
    ]
    monkeypatch.setenv("DFLASH_ATTENTION", "sdpa")
    assert not split_key_attention(16)
    monkeypatch.setenv("DFLASH_ATTENTION", "flash")
    with pytest.raises(ValueError, match="'split' or 'sdpa'"):
        split_key_attention(16)


@fused
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("attention", ["sdpa", "split"])
def test_fused_layers_match_the_static_forward(family: str, attention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernels give the unfused static forward's logits, features and cache rows (fp32), with SDPA or
    the split-key attention program."""
    monkeypatch.setenv("DFLASH_ATTENTION", attention)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = ours_from_hf(hf_tiny(family)).to(device)
    plain = GraphRunner(target, None, capacity=512, capture=False, fused=False)
    fused_runner = GraphRunner(target, None, capacity=512, capture=False, fused=True)
    prompt = torch.tensor([random_prompts(1, 512, seed=6, lengths=(40,))[0]], device=device)
    caches = [plain.lease_target_cache(300), fused_runner.lease_target_cache(300)]
    assert caches[0] is not None and caches[1] is not None
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=device)
    with torch.inference_mode():
        for cache in caches:
            target(prompt, cache=cache)
        for ids, positions, mask in (
            (torch.tensor([[5, 9, 200, 17, 3]], device=device), None, None),
            (torch.tensor([[5, 9, 10]], device=device), torch.tensor([[45, 46, 46]], device=device), ancestors),
            (torch.tensor([[7]], device=device), None, None),
        ):
            outs = [r.target_forward(ids, positions, c, mask, (1, 3), "all") for r, c in zip((plain, fused_runner), caches, strict=True)]
            assert outs[0] is not None and outs[1] is not None
            torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(outs[1].features, outs[0].features, rtol=1e-4, atol=1e-4)
        length = caches[0].length
        torch.testing.assert_close(caches[1].keys[:, :, :, :length], caches[0].keys[:, :, :, :length], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[1].values[:, :, :, :length], caches[0].values[:, :, :, :length])


@fused
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_skinny_products_in_bf16_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on the device (where the skinny program replaces cuBLAS): a step, a 5-row verify and a 3-row tree give
    cuBLAS's logits within bf16 rounding."""
    target = ours_from_hf(hf_tiny("qwen3")).to("cuda", torch.bfloat16)
    prompt = torch.tensor([random_prompts(1, 512, seed=6, lengths=(40,))[0]], device="cuda")
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device="cuda")
    logits: dict[str, list[torch.Tensor]] = {}
    for products in ("cublas", "skinny"):
        monkeypatch.setenv("DFLASH_PRODUCTS", products)
        runner = GraphRunner(target, None, capacity=512, capture=False, fused=True)
        cache = runner.lease_target_cache(300)
        assert cache is not None
        with torch.inference_mode():
            target(prompt, cache=cache)
            logits[products] = []
            for ids, positions, mask in (
                (torch.tensor([[7]], device="cuda"), None, None),
                (torch.tensor([[5, 9, 200, 17, 3]], device="cuda"), None, None),
                (torch.tensor([[5, 9, 10]], device="cuda"), torch.tensor([[46, 47, 47]], device="cuda"), ancestors),
            ):
                out = runner.target_forward(ids, positions, cache, mask, (), "all")
                assert out is not None
                logits[products].append(out.logits.float())
    for got, expected in zip(logits["skinny"], logits["cublas"], strict=True):
        assert ((got - expected).abs().max() / expected.abs().max()).item() < 3e-2


@fused
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "linear", "ddtree:6"])
@pytest.mark.parametrize("attention", ["sdpa", "split"])
def test_generation_with_fused_layers_equals_eager(mode: str, attention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_ATTENTION", attention)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter = golden_pair(device)
    try:
        prompts = random_prompts(2, target.config.vocab_size, seed=22, lengths=(9, 60))
        eager = [generate(target, drafter, mode, p, 40) for p in prompts]
        runner = attach_graph_runner(target, drafter, capacity=512, fused=True)
        static = [generate(target, drafter, mode, p, 40) for p in prompts]
        assert static == eager
        assert runner.fused and runner.served > 10
    finally:
        register_forwards(target, None)


@fused
@pytest.mark.gpu
@pytest.mark.parametrize(("attention", "draft_weights"), [("sdpa", "dense"), ("split", "dense"), ("split", "int8")])
def test_fused_drafter_round_matches_the_static_round(
    attention: str, draft_weights: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused drafter round (block rows attending through SDPA or the split-key program; dense or int8 rows
    joined) gives the static round's logits and cache rows (fp32)."""
    monkeypatch.setenv("DFLASH_ATTENTION", attention)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter = golden_pair(device)
    if draft_weights == "int8":  # quantized on the CPU, a copy of its own
        drafter = copy.deepcopy(golden_pair()[1])
        quantize_drafter_int8(drafter)
        drafter = drafter.to(device)
    runners = [GraphRunner(target, drafter, capacity=512, capture=False, fused=f) for f in (False, True)]
    assert runners[0].drafter_weights is None and runners[1].drafter_weights is not None
    caches = [r.lease_drafter_cache(300) for r in runners]
    features = torch.randn(1, 120, drafter.config.feature_size, device=device)
    with torch.inference_mode():
        for cache in caches:
            assert cache is not None
            drafter.draft_scores(target, 3, 70, features[:, :70], cache).full()  # eager first round
        for new_rows in (1, 5, drafter.config.block_size):
            outs = []
            for runner, cache in zip(runners, caches, strict=True):
                assert cache is not None
                start = cache.length + new_rows
                outs.append(runner.draft_logits(9, start, features[:, cache.length : start], cache, 7))
            assert outs[0] is not None and outs[1] is not None
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        length = caches[0].length  # type: ignore[union-attr]
        for name in ("keys", "values"):
            torch.testing.assert_close(getattr(caches[1], name)[:, :, :, :length],
                                       getattr(caches[0], name)[:, :, :, :length], rtol=1e-4, atol=1e-4)



def test_engine_warm_up_runs_through_the_runner() -> None:
    from dflash.engine.engine import EngineOptions
    from dflash.engine.loading import LoadOptions, load_engine

    # one request at a time: the single-request loops, which the runner serves
    options = EngineOptions(spec="linear", max_batch=1)
    engine = load_engine("default", options=options, loading=LoadOptions(weights="dense", device="cpu"))
    assert engine.warm_up() == 0  # on the CPU no runner is attached: nothing to warm up
    runner = attach_graph_runner(engine.target, engine.drafter, capacity=1024, capture=False)
    try:
        assert engine.warm_up() > 0
        assert runner.served > 0
    finally:
        register_forwards(engine.target, None)
