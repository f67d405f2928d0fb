"""The prefix cache on the real default model and its shipped drafter (CPU, fp32, greedy): a hit leaves target and
drafter exactly where a cold prefill leaves them, so answers and acceptance are those of the cache-free engine.

Cases: the restored state itself (K/V, features, logits, first drafts), a growing agent conversation with tool
calls and results (linear, plain and DDTree decoding), two conversations interleaved (A, B, A), eviction under a
small budget, a request cancelled mid-prefill and sent again (its completed chunks are reused, in every mode),
the read-only forecast of the cached prefix, prompts sharing part of a block, and the per-request opt-out. A
prefill chunk of 32 tokens makes blocks small, so short prompts exercise several of them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dflash.engine.engine import Engine, EngineOptions
from dflash.engine.loading import load_engine
from dflash.generation.cached_prefill import prefill_prompt
from dflash.generation.request import GenerationRequest, GenerationResult
from dflash.kv.prefix_cache import PrefixCache
from dflash.server.conversation import Message, ToolCall, ToolSpec
from dflash.server.prompt import PromptBuilder

pytestmark = pytest.mark.timeout(300)

CHUNK = 32
TOOLS = (ToolSpec("read_file", "Read a file of the repository", {"type": "object", "properties": {"path": {"type": "string"}}}),)


@pytest.fixture(scope="module")
def engine() -> Engine:
    # every round speculative: warm and cold answers are compared round for round
    return load_engine("default", options=EngineOptions(prefill_chunk=CHUNK, prefix_cache_mb=64, always_speculate=True))


@pytest.fixture()
def cache(engine: Engine) -> PrefixCache:
    """The engine's prefix cache, emptied for the test."""
    assert engine.prefix_cache is not None
    engine.prefix_cache = PrefixCache(64 << 20, CHUNK, engine.prefix_cache.feature_layers)
    return engine.prefix_cache


def ask(engine: Engine, ids: list[int], *, spec: str = "linear", cached: bool = True, max_new: int = 10,
        should_stop: Callable[[], bool] | None = None) -> GenerationResult:
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=max_new, use_prefix_cache=cached)
    return engine.generate(request, spec=spec, should_stop=should_stop)


def same_as_cold(engine: Engine, ids: list[int], *, spec: str = "linear", max_new: int = 10) -> GenerationResult:
    """Answer with the cache, check it against the cache-free answer, and return the cached one."""
    cold = ask(engine, ids, spec=spec, cached=False, max_new=max_new)
    warm = ask(engine, ids, spec=spec, max_new=max_new)
    assert warm.token_ids == cold.token_ids
    assert warm.stats.accepted_per_round == cold.stats.accepted_per_round  # same drafts: acceptance cannot drop
    return warm


def agent_conversation(topic: str, turns: int) -> list[list[Message]]:
    """The prompts an agent loop sends: each one is the previous plus an answer with a tool call and its result."""
    messages = [
        Message("system", f"You are a careful coding agent working on the {topic} project. Use tools when needed."),
        Message("user", f"Find out what the {topic} project does and summarise its main module."),
    ]
    prompts = [list(messages)]
    for turn in range(turns - 1):
        path = f"src/{topic}/module_{turn}.py"
        call = ToolCall("read_file", {"path": path}, id=f"call_{topic}_{turn}")
        listing = "\n".join(f"def {topic}_step_{turn}_{i}(value):\n    return value * {i} + {turn}" for i in range(6))
        messages += [Message("assistant", f"Let me read {path}.", tool_calls=[call]),
                     Message("tool", listing, tool_call_id=call.id, name="read_file")]
        prompts.append(list(messages))
    return prompts


def prompt_ids(engine: Engine, messages: list[Message]) -> list[int]:
    return PromptBuilder(engine).build(messages, TOOLS).ids


def test_a_hit_restores_the_cold_state_exactly(engine: Engine, cache: PrefixCache) -> None:
    """K/V, features and last logits after a warm prefill equal a cold prefill bit for bit, and so do the drafts."""
    assert engine.drafter is not None
    first, second = agent_conversation("billing", 2)
    ask(engine, prompt_ids(engine, first), max_new=1)  # fills the cache with the first prompt's blocks
    ids = prompt_ids(engine, second)
    prompt = torch.tensor([ids])
    layers = engine.drafter.config.target_layer_ids
    runs = []
    for prefix_cache in (None, cache):
        target_cache = engine.target.new_cache(len(ids) + 1)
        with torch.inference_mode():
            out = prefill_prompt(engine.target, target_cache, prompt, chunk=CHUNK, capture=layers, prefix_cache=prefix_cache)
            assert out is not None and out.features is not None
            drafter_cache = engine.drafter.new_cache(len(ids) + 20)
            drafts = engine.drafter.draft_scores(engine.target, 1, len(ids), out.features, drafter_cache).full()  # [B-1, vocab]
        runs.append((out, target_cache, drafts, drafter_cache))
    (cold, cold_cache, cold_drafts, cold_drafter), (warm, warm_cache, warm_drafts, warm_drafter) = runs
    assert cold.cached_tokens == 0 and warm.cached_tokens >= 3 * CHUNK and warm.cached_tokens % CHUNK == 0
    assert torch.equal(warm.logits, cold.logits)
    assert torch.equal(warm.features, cold.features)
    n = len(ids)
    assert torch.equal(warm_cache.keys[:, :, :, :n], cold_cache.keys[:, :, :, :n])
    assert torch.equal(warm_cache.values[:, :, :, :n], cold_cache.values[:, :, :, :n])
    assert torch.equal(warm_cache.positions[:, :n], cold_cache.positions[:, :n])
    assert torch.equal(warm_drafts, cold_drafts)
    assert torch.equal(warm_drafter.keys[:, :, :, :n], cold_drafter.keys[:, :, :, :n])


def test_growing_agent_conversation_answers_as_without_cache(engine: Engine, cache: PrefixCache) -> None:
    rounds = 0
    previous_length = 0
    for turn, messages in enumerate(agent_conversation("weather", 3)):
        ids = prompt_ids(engine, messages)
        spec = ("linear", "none", "ddtree")[turn]
        warm = same_as_cold(engine, ids, spec=spec)
        rounds += warm.stats.rounds
        if turn:  # everything the last prompt prefilled in full blocks is reused
            assert warm.stats.cached_tokens == previous_length // CHUNK * CHUNK
        previous_length = len(ids)
    assert rounds > 0
    stats = cache.stats()
    assert stats.hits >= 2 and stats.tokens == previous_length // CHUNK * CHUNK


def test_interleaved_conversations_keep_their_own_prefixes(engine: Engine, cache: PrefixCache) -> None:
    conv_a, conv_b = agent_conversation("parser", 2), agent_conversation("scheduler", 2)
    first_a = prompt_ids(engine, conv_a[0])
    for ids in (first_a, prompt_ids(engine, conv_b[0])):
        ask(engine, ids, max_new=1)
    warm = same_as_cold(engine, prompt_ids(engine, conv_a[1]))
    assert warm.stats.cached_tokens == len(first_a) // CHUNK * CHUNK


def test_eviction_under_a_small_budget_keeps_answers_exact(engine: Engine, cache: PrefixCache) -> None:
    conv_a, conv_b = agent_conversation("ledger", 2), agent_conversation("router", 2)
    block_bytes = cache_block_bytes(engine)
    engine.prefix_cache = small = PrefixCache(6 * block_bytes, CHUNK, cache.feature_layers)
    for messages in (conv_a[0], conv_b[0]):  # about 6 blocks each: B's evict part of A's
        ask(engine, prompt_ids(engine, messages), max_new=1)
    stats = small.stats()
    assert stats.evictions > 0 and stats.bytes <= stats.budget_bytes and stats.blocks <= 6
    for messages in (conv_a[1], conv_b[1]):
        same_as_cold(engine, prompt_ids(engine, messages))
    assert small.stats().bytes <= small.stats().budget_bytes


def cache_block_bytes(engine: Engine) -> int:
    config, drafter = engine.target.config, engine.drafter
    assert drafter is not None
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # K and V, fp32
    return CHUNK * (kv + drafter.config.feature_size * 4)


def stop_after_chunks(chunks: int) -> Callable[[], bool]:
    """A `should_stop` that turns true once `chunks` prefill chunks ran (the prefill polls it before each chunk)."""
    polls = [0]

    def should_stop() -> bool:
        polls[0] += 1
        return polls[0] > chunks

    return should_stop


@pytest.mark.parametrize("spec", ["none", "linear", "ddtree"])
def test_a_cancelled_prefill_keeps_its_chunks_for_the_resend(engine: Engine, cache: PrefixCache, spec: str) -> None:
    """A client gives up during the prefill and sends the same prompt again: the resend restores every chunk the
    first attempt completed (K/V and drafter features) and answers exactly as a cold run."""
    ids = prompt_ids(engine, agent_conversation("archive", 2)[1])
    assert len(ids) > 5 * CHUNK
    result = ask(engine, ids, spec=spec, should_stop=stop_after_chunks(3))
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert cache.stats().blocks == 3
    warm = same_as_cold(engine, ids, spec=spec)
    assert warm.stats.cached_tokens == 3 * CHUNK
    assert cache.stats().blocks == len(ids) // CHUNK


def test_each_cancelled_resend_gets_further(engine: Engine, cache: PrefixCache) -> None:
    """Retries that are cancelled too still make progress: each one resumes where the last stopped."""
    ids = prompt_ids(engine, agent_conversation("archive", 2)[1])
    for attempt in (1, 2):
        result = ask(engine, ids, should_stop=stop_after_chunks(2))
        assert result.finish_reason == "cancelled"
        assert cache.stats().blocks == 2 * attempt
    warm = same_as_cold(engine, ids)
    assert warm.stats.cached_tokens == 4 * CHUNK


def test_a_prefill_cancelled_before_its_first_chunk_stores_nothing(engine: Engine, cache: PrefixCache) -> None:
    ids = prompt_ids(engine, agent_conversation("archive", 2)[1])
    result = ask(engine, ids, should_stop=stop_after_chunks(0))
    assert result.finish_reason == "cancelled" and cache.stats().blocks == 0


def test_the_cached_prompt_forecast_matches_what_the_prefill_restores(engine: Engine, cache: PrefixCache) -> None:
    first, second = (prompt_ids(engine, messages) for messages in agent_conversation("invoice", 2))
    request = GenerationRequest(prompt_ids=second, max_new_tokens=1)
    assert engine.cached_prompt_tokens(request) == 0
    ask(engine, first, max_new=1)
    before = cache.stats()
    forecast = engine.cached_prompt_tokens(request)
    assert forecast == len(first) // CHUNK * CHUNK > 0
    assert cache.stats() == before  # a forecast is not a lookup: no hit, no miss
    assert engine.cached_prompt_tokens(GenerationRequest(prompt_ids=second, max_new_tokens=1, use_prefix_cache=False)) == 0
    assert ask(engine, second, max_new=1).stats.cached_tokens == forecast
    # the same prompt again: every full block but the one holding the last token, as the prefill restores
    again = engine.cached_prompt_tokens(request)
    assert again == (len(second) - 1) // CHUNK * CHUNK
    assert ask(engine, second, max_new=1).stats.cached_tokens == again


def test_prompts_sharing_part_of_a_block_reuse_only_whole_blocks(engine: Engine, cache: PrefixCache) -> None:
    base = prompt_ids(engine, agent_conversation("compiler", 1)[0])
    shared = 2 * CHUNK + CHUNK // 2  # two blocks and half of the third
    assert len(base) > 3 * CHUNK
    ask(engine, base, max_new=1)
    other = [*base[:shared], *engine.encode(" Also explain how the tests are organised and what they check.")]
    warm = same_as_cold(engine, other)
    assert warm.stats.cached_tokens == 2 * CHUNK


def test_opting_out_neither_reads_nor_writes(engine: Engine, cache: PrefixCache) -> None:
    ids = prompt_ids(engine, agent_conversation("mailer", 1)[0])
    ask(engine, ids, cached=False, max_new=1)
    assert cache.stats().blocks == 0 and cache.stats().hits + cache.stats().misses == 0
    ask(engine, ids, max_new=1)
    again = ask(engine, ids, cached=False, max_new=1)
    assert again.stats.cached_tokens == 0 and cache.stats().hits == 0


def test_no_budget_means_no_cache(engine: Engine) -> None:
    plain = Engine(engine.target, engine.tokenizer, engine.drafter, EngineOptions(prefix_cache_mb=0))
    assert plain.prefix_cache is None
    result = ask(plain, prompt_ids(engine, agent_conversation("mailer", 1)[0]), max_new=1)
    assert result.stats.cached_tokens == 0
