"""The drafter on a device of its own (`--draft-device`): copies of the target's embedding and LM head beside it,
features sent over and draft scores brought back each round (`dflash.generation.draft_device`).

On the CPU both "devices" are the CPU, which still runs every piece of the split path: the drafter reads the copies,
never the target's modules, and the loops get the same tokens and the same acceptance as without the split. The
GPU test puts the drafter on a second GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash.drafter.borrowed_heads import BorrowedHeads
from dflash.drafter.model import DFlashDrafter
from dflash.engine.engine import Engine, EngineOptions, resolve_options
from dflash.engine.loading import LoadOptions, load_engine
from dflash.errors import DFlashError
from dflash.fastpath.dispatch import graph_runner_of
from dflash.fastpath.runner import attach_graph_runner
from dflash.generation.draft_device import DraftDeviceForwards
from dflash.generation.forwards import forwards_for, register_forwards
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.speculative.ddtree import decode_ddtree
from dflash.speculative.linear import decode_linear
from tests.parallel_helpers import ENGINE_VOCAB, word_tokenizer
from tests.spec_helpers import golden_pair, random_prompts, tiny_random_pair
from tests.tiny_models import hf_tiny, ours_from_hf

CPU = torch.device("cpu")


class CountingHeads(BorrowedHeads):
    """Borrowed heads that count the drafter's calls (so a test knows the copies, not the target, served it)."""

    def __init__(self, target: CausalLM, device: torch.device) -> None:
        super().__init__(target, device)
        self.embeds = 0

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.embeds += 1
        return super().embed(input_ids)


def speculate(target: CausalLM, drafter: DFlashDrafter, mode: str, prompt: list[int], max_new: int,
              ) -> tuple[list[int], GenerationStats]:
    sampling = SamplingParams()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
    device = target.embed_tokens.weight.device
    chooser = TokenChooser(sampling, eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size, device=device)
    if mode == "linear":
        stats = decode_linear(target, drafter, request, sink, chooser, prefill_chunk=32)
    else:
        stats = decode_ddtree(target, drafter, request, sink, chooser, prefill_chunk=32, budget=8)
    return sink.token_ids, stats


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_borrowed_heads_compute_what_the_target_does(family: str) -> None:
    """Embedding scale and logit soft-capping (Gemma) included; tied heads share one copy."""
    target = ours_from_hf(hf_tiny(family))
    heads = BorrowedHeads(target, CPU)
    ids = torch.tensor([[1, 5, 9, 300]])
    assert torch.equal(heads.embed(ids), target.embed(ids))
    hidden = torch.randn(3, target.config.hidden_size)
    assert torch.equal(heads.project_logits(hidden), target.project_logits(hidden))
    assert heads.embed_tokens.weight.device == CPU and not heads.embed_tokens.weight.requires_grad
    if target.config.tie_word_embeddings:
        assert heads.lm_head.weight is heads.embed_tokens.weight


@pytest.mark.parametrize("mode", ["linear", "ddtree"])
@pytest.mark.parametrize("graph_runner", [False, True])
def test_split_rounds_give_the_same_tokens_and_acceptance(mode: str, graph_runner: bool) -> None:
    target, drafter = golden_pair()
    prompts = random_prompts(2, target.config.vocab_size, seed=31, lengths=(9, 70))
    alone = [speculate(target, drafter, mode, prompt, 48) for prompt in prompts]
    heads = CountingHeads(target, CPU)
    if graph_runner:  # the runner's static drafter round (capture off on the CPU) reads the copies too
        attach_graph_runner(target, drafter, capacity=512, capture=False, fused=False, draft_heads=heads)
    register_forwards(target, DraftDeviceForwards(forwards_for(target), heads, CPU))
    try:
        split = [speculate(target, drafter, mode, prompt, 48) for prompt in prompts]
        runner = graph_runner_of(target)
        assert (runner is not None) == graph_runner
    finally:
        register_forwards(target, None)
    for (tokens, stats), (split_tokens, split_stats) in zip(alone, split, strict=True):
        assert split_tokens == tokens
        assert split_stats.accepted_tokens == stats.accepted_tokens and split_stats.rounds == stats.rounds
    if graph_runner:
        assert runner is not None and runner.served > 0
    else:
        # every drafting round embedded its block there (a tree's last round may verify the root alone, undrafted)
        assert heads.embeds >= sum(stats.rounds for _, stats in split) - len(prompts)


def test_resident_decoder_is_not_used_for_split_rounds() -> None:
    target, drafter = golden_pair()
    forwards = DraftDeviceForwards(forwards_for(target), BorrowedHeads(target, CPU), CPU)
    chooser = TokenChooser(SamplingParams(), eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size,
                           device=CPU)
    assert forwards.resident(target, chooser, target.new_cache(64), drafter=drafter, drafter_cache=None) is None


def test_options_and_flags_that_a_split_drafter_refuses() -> None:
    with pytest.raises(DFlashError, match="--max-concurrency 1"):
        resolve_options(EngineOptions(max_batch=4), device=CPU, has_drafter=True, tensor_parallel=False,
                        draft_elsewhere=True)
    resolved = resolve_options(EngineOptions(), device=CPU, has_drafter=True, tensor_parallel=False,
                               draft_elsewhere=True)
    assert resolved.max_batch == 1  # the CPU's default of 8 would otherwise batch
    with pytest.raises(DFlashError, match=r"target runs on a GPU|no CUDA device"):
        load_engine("default", loading=LoadOptions(device="cpu", draft_device="cuda:1"))
    with pytest.raises(DFlashError, match="target runs on a GPU"):
        load_engine("default", loading=LoadOptions(device="cpu", draft_device="cpu"))


def test_an_engine_on_one_device_keeps_the_drafter_beside_the_target() -> None:
    target, drafter = tiny_random_pair(ENGINE_VOCAB, 0.3, block=5)
    engine = Engine(target, word_tokenizer(ENGINE_VOCAB), drafter, EngineOptions(max_batch=1))
    try:
        assert engine.draft_heads is None
        assert not isinstance(forwards_for(target), DraftDeviceForwards)
    finally:
        engine.close()


two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("mode", ["linear", "ddtree"])
def test_drafter_on_the_second_gpu_gives_the_one_gpu_tokens(mode: str) -> None:
    """float32 with CUDA graphs: the drafter's graphs captured and replayed on cuda:1, the target's on cuda:0;
    greedy tokens and acceptance equal those of the drafter beside the target."""
    target, drafter = golden_pair("cuda:0")
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    prompts = random_prompts(3, target.config.vocab_size, seed=8, lengths=(9, 200, 400))
    try:
        attach_graph_runner(target, drafter.to(first), capacity=2048)
        beside = [speculate(target, drafter, mode, prompt, 200) for prompt in prompts]
        register_forwards(target, None)
        heads = BorrowedHeads(target, second)
        drafter = copy.deepcopy(drafter).to(second)  # the cached pair's drafter stays on the first device
        runner = attach_graph_runner(target, drafter, capacity=2048, draft_heads=heads)
        register_forwards(target, DraftDeviceForwards(forwards_for(target), heads, first))
        split = [speculate(target, drafter, mode, prompt, 200) for prompt in prompts]
        assert runner.drafter_storage is not None and runner.drafter_storage.keys.device == second
        assert any(key[0] == "drafter" for key in runner._replays)  # the drafter's rounds replayed graphs on cuda:1
    finally:
        register_forwards(target, None)
    for (tokens, stats), (split_tokens, split_stats) in zip(beside, split, strict=True):
        assert split_tokens == tokens
        assert split_stats.accepted_tokens == stats.accepted_tokens
