"""Drivers for the batched core on in-memory models: sequences without a tokenizer, stepped on this thread."""

from __future__ import annotations

from collections.abc import Callable

from dflash.batch.core import BatchCore, CoreSettings
from dflash.batch.sequence import Sequence
from dflash.drafter.model import DFlashDrafter
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.kv.prefix_cache import PrefixCache
from dflash.models.model import CausalLM


def make_core(
    target: CausalLM,
    drafter: DFlashDrafter | None,
    *,
    max_batch: int = 8,
    prefill_chunk: int = 64,
    ddtree_budget: int = 8,
    linear_drafts: int = 15,
    max_step_rows: int = 512,
    pool_tokens: int = 4096,
    prefix_cache: PrefixCache | None = None,
    cuda_graphs: bool = False,
    eager_padded: bool = False,
) -> BatchCore:
    settings = CoreSettings(
        max_batch=max_batch, prefill_chunk=prefill_chunk, pool_tokens=pool_tokens, ddtree_budget=ddtree_budget,
        linear_drafts=linear_drafts, max_step_rows=max_step_rows, cuda_graphs=cuda_graphs, eager_padded=eager_padded,
    )
    return BatchCore(target, drafter, (), settings, prefix_cache)


def make_sequence(
    target: CausalLM,
    prompt: list[int],
    max_new: int,
    mode: str,
    *,
    sampling: SamplingParams | None = None,
    eos: tuple[int, ...] = (),
    should_stop: Callable[[], bool] | None = None,
    use_prefix_cache: bool = True,
) -> Sequence:
    sampling = sampling or SamplingParams()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling,
                                use_prefix_cache=use_prefix_cache)
    sink = OutputSink(lambda ids: "", eos_ids=eos, max_new_tokens=max_new)
    device = target.embed_tokens.weight.device
    chooser = TokenChooser(sampling, eos_ids=eos, min_tokens=0, vocab_size=target.config.vocab_size, device=device)
    return Sequence(request, mode, sink, chooser, should_stop)


def drain(core: BatchCore, limit: int = 10_000) -> int:
    """Step until nothing is active or waiting; returns the steps taken."""
    steps = 0
    while core.active or core.waiting:
        core.step()
        steps += 1
        assert steps < limit, "the core did not finish"
    return steps
