"""Token constraints are lossless in every decoding mode: plain, linear DFlash and DDTree choose each token from
the target's distribution restricted to what the constraint allows after that token's own prefix.

Greedy: with a one-of constraint (a "tool name" of several tokens, then free text) plain == linear == DDTree,
with a mostly right drafter so constrained drafts really get accepted (and wrong drafts, forbidden ones included,
get rejected); every output writes an offered name although the unconstrained model writes something else.
Sampling: the empirical distribution of the first three tokens (the prefill's choice, the root row's, a drafted
row's) matches the exact masked distribution in every mode; a control that masks speculative rows with the
committed prefix's mask must fail. Device-resident rounds (which cannot mask) wait until the constraint is done.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import dflash.generation.selection as selection
from dflash.drafter.model import DFlashDrafter
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.constraints import OneOfConstraint, TokenConstraint
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.generation.token_table import TokenTable
from dflash.models.model import CausalLM
from dflash.speculative.ddtree import decode_ddtree
from dflash.speculative.linear import decode_linear
from tests.spec_helpers import one_torch_thread, patch_draft_logits, tiny_random_pair

MODES = ("plain", "linear", "ddtree4", "ddtree16")


_one_thread = one_torch_thread  # autouse, module scope


def decode(
    target: CausalLM,
    drafter: DFlashDrafter,
    mode: str,
    prompt: list[int],
    max_new: int,
    constraint: TokenConstraint | None,
    sampling: SamplingParams | None = None,
) -> tuple[list[int], GenerationStats]:
    sampling = sampling or SamplingParams()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling, constraint=constraint)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
    chooser = TokenChooser(
        sampling, eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size, device="cpu",
        constraint=constraint.start() if constraint is not None else None,
    )
    if mode == "plain":
        stats = decode_autoregressive(target, request, sink, chooser, prefill_chunk=64)
    elif mode == "linear":
        stats = decode_linear(target, drafter, request, sink, chooser, prefill_chunk=64)
    else:
        budget = int(mode.removeprefix("ddtree"))
        stats = decode_ddtree(target, drafter, request, sink, chooser, prefill_chunk=64, budget=budget)
    return sink.token_ids, stats


# ---- greedy ----------------------------------------------------------------------------------------------------

GREEDY_VOCAB = 64
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def greedy_table() -> TokenTable:
    """Tokens 0-25 write one letter, 26-51 two letters (a name may be split several ways), 52 `"`, 53 `",`
    (runs past a name's end), 54-62 punctuation and spaces, 63 nothing (a special token)."""
    table: list[bytes | None] = [c.encode() for c in LETTERS]
    table += [(LETTERS[i] + LETTERS[(i * 7 + 3) % 26]).encode() for i in range(26)]
    table += [b'"', b'",', b" ", b"{", b"}", b":", b"\n", b"(", b")", b".", b"-", None]
    assert len(table) == GREEDY_VOCAB
    return TokenTable(table)


NAMES = (b'kiwi"', b'mango"', b'fig"')


def text_of(table: TokenTable, tokens: Sequence[int]) -> bytes:
    return b"".join(table.bytes_of[t] or b"" for t in tokens)


def install_mostly_right_drafter(
    monkeypatch: pytest.MonkeyPatch, drafter: DFlashDrafter, sequence: Sequence[int], vocab: int
) -> None:
    """The drafter's logits get the token of `sequence` (prompt + expected output) on top at most positions, and at
    some a wrong one first (token 52 `"` or a letter: often one the constraint forbids) with the right one second."""
    def oracle(original: Any, tgt: Any, pending: int, start: int, new_features: torch.Tensor, cache: Any,
               **kw: Any) -> torch.Tensor:
        logits = original(tgt, pending, start, new_features, cache, **kw).clone()  # [B-1, vocab]
        for row in range(logits.shape[0]):
            position = start + 1 + row
            if position >= len(sequence):
                break
            right = sequence[position]
            top = float(logits[row].max())
            if (position * 31 + start * 17) % 5 in (0, 3):
                logits[row, 52 if position % 2 else (right + 1) % vocab] = top + 6.0
                logits[row, right] = top + 5.5
            else:
                logits[row, right] = top + 6.0
        return logits

    patch_draft_logits(monkeypatch, drafter, oracle)


@pytest.mark.parametrize("prompt_seed", [0, 1, 2])
def test_greedy_constrained_output_is_the_same_in_every_mode(
    monkeypatch: pytest.MonkeyPatch, prompt_seed: int
) -> None:
    target, drafter = tiny_random_pair(GREEDY_VOCAB, 1.0, block=6)
    table = greedy_table()
    constraint = OneOfConstraint(table, NAMES)
    g = torch.Generator().manual_seed(prompt_seed)
    prompt = torch.randint(0, GREEDY_VOCAB - 1, (12,), generator=g).tolist()
    max_new = 24

    free, _ = decode(target, drafter, "plain", prompt, max_new, None)
    assert not any(text_of(table, free).startswith(name) for name in NAMES)  # the model alone writes no name

    plain, _ = decode(target, drafter, "plain", prompt, max_new, constraint)
    assert any(text_of(table, plain).startswith(name) for name in NAMES), text_of(table, plain)

    install_mostly_right_drafter(monkeypatch, drafter, [*prompt, *plain], GREEDY_VOCAB)
    accepted = 0
    for mode in MODES[1:]:
        tokens, stats = decode(target, drafter, mode, prompt, max_new, constraint)
        assert tokens == plain, mode
        accepted += stats.accepted_tokens
    assert accepted > 0


def test_greedy_constrained_output_with_a_random_drafter() -> None:
    """A drafter that is mostly wrong: its drafts are often forbidden by the constraint."""
    target, drafter = tiny_random_pair(GREEDY_VOCAB, 1.0, block=6)
    constraint = OneOfConstraint(greedy_table(), NAMES)
    for seed in range(3):
        prompt = torch.randint(0, GREEDY_VOCAB - 1, (9,), generator=torch.Generator().manual_seed(10 + seed)).tolist()
        plain, _ = decode(target, drafter, "plain", prompt, 16, constraint)
        for mode in MODES[1:]:
            assert decode(target, drafter, mode, prompt, 16, constraint)[0] == plain, (seed, mode)


# ---- sampling --------------------------------------------------------------------------------------------------

SAMPLE_VOCAB = 8
SAMPLE_PROMPT = [1, 2, 3]
# token i writes the letter "A" + i; the constraint lets the first three tokens write one of these, then anything
SAMPLE_TABLE = TokenTable([bytes([65 + i]) for i in range(SAMPLE_VOCAB)])
SAMPLE_OPTIONS = (b"BCA", b"BCF", b"BDH", b"BDA", b"EGA", b"EGC")
CONSTRAINED = 3  # positions the constraint decides


def allowed_after(prefix: Sequence[int]) -> list[int]:
    written = bytes(65 + t for t in prefix)
    return sorted({o[len(written)] - 65 for o in SAMPLE_OPTIONS if o.startswith(written)})


def exact_distributions(target: CausalLM) -> list[dict[int, float]]:
    """P(token k) for the constrained positions k, at temperature 1, from the target's own logits."""
    def next_probs(prefix: list[int]) -> dict[int, float]:
        ids = [*SAMPLE_PROMPT, *prefix]
        out = target(torch.tensor([ids]), cache=target.new_cache(len(ids) + 1))
        assert out.logits is not None
        keep = torch.tensor(allowed_after(prefix))
        probs = torch.softmax(out.logits[0, -1].float()[keep], dim=-1)
        return {int(t): float(p) for t, p in zip(keep, probs, strict=True)}

    marginals: list[Counter[int]] = [Counter() for _ in range(CONSTRAINED)]

    def walk(prefix: list[int], weight: float) -> None:
        if len(prefix) == CONSTRAINED:
            return
        for token, p in next_probs(prefix).items():
            marginals[len(prefix)][token] += weight * p
            walk([*prefix, token], weight * p)

    walk([], 1.0)
    return [dict(m) for m in marginals]


def sampled(target: CausalLM, drafter: DFlashDrafter, mode: str, samples: int) -> list[Counter[int]]:
    constraint = OneOfConstraint(SAMPLE_TABLE, SAMPLE_OPTIONS)
    counts: list[Counter[int]] = [Counter() for _ in range(CONSTRAINED)]
    for seed in range(samples):
        tokens, _ = decode(
            target, drafter, mode, SAMPLE_PROMPT, CONSTRAINED + 1, constraint, SamplingParams(temperature=1.0, seed=seed)
        )
        assert bytes(65 + t for t in tokens[:CONSTRAINED]) in SAMPLE_OPTIONS, (mode, tokens)
        for position in range(CONSTRAINED):
            counts[position][tokens[position]] += 1
    return counts


def total_variation(counts: Counter[int], exact: dict[int, float]) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts[k] / n - exact.get(k, 0.0)) for k in set(counts) | set(exact))


@pytest.mark.slow
def test_sampling_follows_the_masked_distribution_in_every_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """n=600 per mode, tolerance TV 0.08 (sampling noise is about 0.03 here). Token 0 is the prefill's choice,
    token 1 the root row's, token 2 a drafted row's (linear row 1, a depth-1 tree node); full-tree DDTree (budget
    72) verifies tokens 1-3 in one round."""
    target, drafter = tiny_random_pair(SAMPLE_VOCAB, 2.0, block=4)
    exact = exact_distributions(target)
    assert all(len(e) >= 2 and sorted(e.values())[-2] > 0.1 for e in exact)  # real choices at every position
    samples, tolerance = 600, 0.08
    for mode in ("plain", "linear", "ddtree6", "ddtree72"):
        counts = sampled(target, drafter, mode, samples)
        distances = [total_variation(c, e) for c, e in zip(counts, exact, strict=True)]
        assert max(distances) < tolerance, (mode, distances)

    # control: drafted rows masked as if they followed the committed output (ignoring their draft path)
    def committed_only(state: Any, drafts: Sequence[int], parents: Any, vocab_size: int) -> torch.Tensor:
        row = original(state, (), None, vocab_size)
        return row.expand(len(drafts) + 1, vocab_size)

    original = selection.row_masks
    monkeypatch.setattr(selection, "row_masks", committed_only)
    with pytest.raises(AssertionError):
        sampled(target, drafter, "ddtree72", samples)  # writes tokens no option allows


# ---- device-resident rounds ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["plain", "linear", "ddtree8"])
def test_resident_rounds_wait_for_the_constraint_to_finish(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """With a graph runner attached (its rounds run eagerly on the CPU) the host loop chooses while the name is
    being written and the resident rounds take over after it; the tokens equal the host loop's."""
    from dflash.fastpath.resident import ResidentDecoder
    from dflash.fastpath.runner import attach_graph_runner
    from dflash.generation.forwards import register_forwards

    target, drafter = tiny_random_pair(GREEDY_VOCAB, 1.0, block=6)
    table = greedy_table()
    constraint = OneOfConstraint(table, NAMES)
    prompt = torch.randint(0, GREEDY_VOCAB - 1, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    expected, _ = decode(target, drafter, mode, prompt, 24, constraint)

    took_over_at: list[int] = []
    own_decode = ResidentDecoder.decode

    def spy(self: ResidentDecoder, start: int, sink: OutputSink, *args: Any, **kwargs: Any) -> None:
        took_over_at.append(len(sink.token_ids))
        own_decode(self, start, sink, *args, **kwargs)

    monkeypatch.setattr(ResidentDecoder, "decode", spy)
    attach_graph_runner(target, drafter, capacity=256, capture=False)
    try:
        tokens, _ = decode(target, drafter, mode, prompt, 24, constraint)
    finally:
        register_forwards(target, None)
    assert tokens == expected
    assert len(took_over_at) == 1
    written = text_of(table, expected[: took_over_at[0]])
    assert any(written.startswith(name) for name in NAMES), written  # not before the name was complete
