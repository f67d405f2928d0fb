"""Drivers for the batched core on in-memory models: sequences without a tokenizer, stepped on this thread."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from dflash.batch.core import BatchCore, CoreSettings
from dflash.batch.sequence import Sequence
from dflash.batch.target_pass import TargetRows
from dflash.drafter.model import DFlashDrafter
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.kv.prefix_cache import PrefixCache
from dflash.models.model import CausalLM
from dflash.speculative.tree import build_tree, tree_verify_inputs
from tests.spec_helpers import golden_pair, random_prompts


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


def sampled_counts(
    target: CausalLM, drafter: DFlashDrafter, mode: str, samples: int, new: int, *, budget: int, block: int,
    prepare: Callable[[BatchCore], None] | None = None, rounds: list[int] | None = None, eager_padded: bool = False,
) -> list[Counter[int]]:
    """Token counts per output position of `samples` requests on prompt [1, 2, 3] (seeds 0..), sampled at
    temperature 1, 64 in a batch; `prepare` adjusts each batch's core first (e.g. its speculation policy).
    `rounds` gains each request's speculative rounds. `eager_padded`: through the fixed-shape passes run eagerly
    (the CUDA path's steps: device rounds for DDTree requests)."""
    per_position: list[Counter[int]] = [Counter() for _ in range(new)]
    for first in range(0, samples, 64):
        core = make_core(target, drafter, max_batch=64, ddtree_budget=budget, linear_drafts=block - 1,
                         eager_padded=eager_padded)
        if prepare is not None:
            prepare(core)
        seqs = [
            make_sequence(target, [1, 2, 3], new, mode, sampling=SamplingParams(temperature=1.0, seed=seed))
            for seed in range(first, min(samples, first + 64))
        ]
        for seq in seqs:
            core.add(seq)
        drain(core)
        for seq in seqs:
            for position, token in enumerate(seq.sink.token_ids):
                per_position[position][token] += 1
            if rounds is not None:
                rounds.append(seq.stats.rounds)
    return per_position


def count_launches(core: BatchCore) -> list[int]:
    """Wrap the core's launcher of steps ahead (`dflash.batch.overlap`): the list gains each launch's requests."""
    assert core.overlap is not None
    launches: list[int] = []
    launch = core.overlap.launch

    def counted(seqs: list[Sequence], *args: Any, **kwargs: Any) -> Any:
        launches.append(len(seqs))
        return launch(seqs, *args, **kwargs)

    core.overlap.launch = counted  # type: ignore[method-assign]
    return launches


def overlap_on_and_off(
    monkeypatch: Any, target: CausalLM, prompts: list[list[int]], sampling: list[SamplingParams], new: int,
    **core_options: Any,
) -> tuple[list[list[list[int]]], list[int]]:
    """The same plain requests through a fresh core with steps launched ahead (DFLASH_BATCH_OVERLAP=1), then
    without: (each run's tokens per request, each run's launches)."""
    outputs, launched = [], []
    for overlap in ("1", "0"):
        monkeypatch.setenv("DFLASH_BATCH_OVERLAP", overlap)
        core = make_core(target, None, max_batch=len(prompts), **core_options)
        assert (core.overlap is not None) == (overlap == "1")
        launches = count_launches(core) if core.overlap is not None else []
        seqs = [make_sequence(target, p, new, "none", sampling=s) for p, s in zip(prompts, sampling, strict=True)]
        for seq in seqs:
            core.add(seq)
        drain(core)
        assert all(seq.error is None for seq in seqs)
        outputs.append([seq.sink.token_ids for seq in seqs])
        launched.append(len(launches))
    return outputs, launched



def decoding_core() -> tuple[CausalLM, DFlashDrafter, BatchCore, list[Sequence]]:
    """The golden pair's core with three DDTree requests (prompts of 9, 40 and 20 tokens) past their prompts."""
    target, drafter = golden_pair()
    core = make_core(target, drafter)
    prompts = random_prompts(3, target.config.vocab_size, seed=31, lengths=(9, 40, 20))
    seqs = [make_sequence(target, p, 10, "ddtree") for p in prompts]
    for seq in seqs:
        core.add(seq)
    while any(seq.phase != "decode" for seq in seqs):
        core.step()
    return target, drafter, core, seqs


def plain_core_with_tree_plain_chain(
    target: CausalLM, prompts: list[list[int]], tree_seed: int
) -> tuple[BatchCore, list[TargetRows]]:
    """A plain core on `target`'s device with one decoding request per prompt (three), and one step's rows for them:
    a 7-node tree (a random drafter's, drawn with `tree_seed`), a plain step and a 3-row chain."""
    core = make_core(target, None, max_batch=4)
    seqs = [make_sequence(target, prompt, 10, "none") for prompt in prompts]
    for seq in seqs:
        core.add(seq)
    while any(seq.phase != "decode" for seq in seqs):
        core.step()
    scores = torch.randn(5, target.config.vocab_size, generator=torch.Generator().manual_seed(tree_seed))
    tokens, positions, visibility = tree_verify_inputs(build_tree(scores, 7), seqs[0].pending, seqs[0].start, 0)
    items = [
        TargetRows(seqs[0].target, tokens, positions, visibility),
        TargetRows(seqs[1].target, torch.tensor([seqs[1].pending]), torch.tensor([seqs[1].start])),
        TargetRows(seqs[2].target, torch.tensor([seqs[2].pending, 3, 4]),
                   torch.arange(seqs[2].start, seqs[2].start + 3)),
    ]
    return core, items


def mixed_target_rows(target: CausalLM, seqs: list[Sequence]) -> list[TargetRows]:
    """One target pass's rows for three decoding requests: a plain step, a 7-node tree (a random drafter's), a
    4-row chain."""
    g = torch.Generator().manual_seed(0)
    items = []
    for index, seq in enumerate(seqs):
        if index == 1:
            tree = build_tree(torch.randn(5, target.config.vocab_size, generator=g), 7)
            tokens, positions, visibility = tree_verify_inputs(tree, seq.pending, seq.start, 0)
            items.append(TargetRows(seq.target, tokens, positions, visibility, logit_rows=slice(0, len(tokens))))
        else:
            n = 1 + 3 * (index // 2)
            tokens = torch.tensor([seq.pending] + [3] * (n - 1))
            items.append(TargetRows(seq.target, tokens, torch.arange(seq.start, seq.start + n), logit_rows=slice(0, n)))
    return items
