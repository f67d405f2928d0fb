"""The target's choice at each row of a device round (`dflash.batch.device_sampling`): greedy rows take the argmax,
sampled rows follow the host's filtered distribution (temperature, top-k, min-p, top-p) for every request's own
parameters in one batch, with uniforms that depend only on (seed, committed length, row)."""

from __future__ import annotations

import pytest
import torch

from dflash.batch.device_sampling import (
    RowSampling,
    choice_mode,
    choose_rows,
    choose_step_rows,
    device_seed,
    host_uniforms,
    row_uniforms,
)
from dflash.generation.sampling import SamplingParams, filtered_probs

VOCAB = 12
PARAMS = [  # one request each, in one batch
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=0.0),
]


def _sampling(params: list[SamplingParams], seeds: list[int]) -> RowSampling:
    sampling = RowSampling.zeros(len(params), torch.device("cpu"))
    sampling.fill(params, seeds)
    return sampling


def test_the_mode_follows_the_requests_parameters() -> None:
    assert choice_mode([SamplingParams(), SamplingParams(temperature=0.0)]) == "greedy"
    assert choice_mode([SamplingParams(), SamplingParams(temperature=0.8, min_p=0.1)]) == "sampled"
    assert choice_mode([SamplingParams(temperature=0.8, top_p=0.9)]) == "filtered"
    assert choice_mode([SamplingParams(top_k=5), SamplingParams(temperature=1.0, top_k=5)]) == "filtered"
    assert choice_mode([SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.8)]) == "mixed"
    assert device_seed(SamplingParams(temperature=1.0, seed=7)) == device_seed(SamplingParams(temperature=1.0, seed=7))
    assert 0 <= device_seed(SamplingParams(temperature=1.0, seed=-3)) < 2**31


def test_uniforms_are_uniform_and_independent_across_positions_and_seeds() -> None:
    seeds = torch.arange(4000, dtype=torch.long)
    positions = torch.tensor([17, 18, 19]).expand(4000, 3)
    first = row_uniforms(seeds, positions)  # [seeds, rows]
    later = row_uniforms(seeds, positions + 3)
    assert ((first >= 0) & (first < 1)).all()
    for values in (first[:, 0], first[:, 2], later[:, 0]):
        histogram = torch.histc(values, bins=10, min=0.0, max=1.0)
        assert (histogram - 400).abs().max() < 80  # ~4 standard deviations
    for a, b in ((first[:, 0], first[:, 1]), (first[:, 0], later[:, 0]), (first[:-1, 0], first[1:, 0])):
        assert abs(float(torch.corrcoef(torch.stack((a, b)))[0, 1])) < 0.06
    # adjacent positions jointly uniform: 20,000 pairs in 10 x 10 cells of 200 expected (within 5 deviations)
    many = torch.arange(20000, dtype=torch.long)
    pair = row_uniforms(many, torch.tensor([40, 41]).expand(20000, 2))
    cells = torch.histc((pair[:, 0] * 10).floor() * 10 + (pair[:, 1] * 10).floor(), bins=100, min=0, max=100)
    assert (cells - 200).abs().max() < 5 * 200**0.5
    # a function of (seed, position) alone: the same in any batch, and a row at position 18 draws what the next
    # row of a round from 17 draws
    assert torch.equal(row_uniforms(seeds[5:9], positions[5:9]), first[5:9])
    assert torch.equal(row_uniforms(seeds, positions - 1)[:, 1], first[:, 0])
    # made on the host (host-built rounds, plain steps): the same values
    wide = torch.randint(0, 2**31, (300,), generator=torch.Generator().manual_seed(2))
    spread = torch.randint(0, 2**20, (300, 4), generator=torch.Generator().manual_seed(3))
    on_host = host_uniforms(wide.tolist(), spread.tolist())
    assert torch.equal(torch.from_numpy(on_host).float(), row_uniforms(wide, spread))


def _of_mode(mode: str) -> list[SamplingParams]:
    """The requests of PARAMS a round of `mode` can hold (greedy ones in every mode)."""
    if mode == "mixed":
        return PARAMS
    filtered = mode == "filtered"
    return [p for p in PARAMS if p.greedy or (p.top_k > 0 or p.top_p < 1.0) == filtered]


@pytest.mark.parametrize("mode", ["sampled", "filtered", "mixed"])
def test_each_request_s_rows_follow_its_filtered_distribution(mode: str) -> None:
    """Many rounds (committed lengths) of one batch: each request's row-0 tokens match `filtered_probs` of its own
    parameters within TV 0.03, nothing outside the filtered support; a greedy request takes the argmax."""
    generator = torch.Generator().manual_seed(1)
    params = _of_mode(mode)
    assert choice_mode(params) == mode
    requests, rows = len(params), 2
    logits = (torch.randn((requests, 1, VOCAB), generator=generator) * 2).expand(requests, rows, VOCAB).contiguous()
    sampling = _sampling(params, [11 * index + 5 for index in range(requests)])
    greedy = logits.argmax(dim=-1)
    rounds = 6000
    counts = torch.zeros((requests, VOCAB))
    for past in range(0, 2 * rounds, 2):
        positions = (past + torch.arange(rows))[None].expand(requests, rows)
        chosen = choose_rows(logits, sampling, row_uniforms(sampling.seed, positions), mode, greedy)
        counts[torch.arange(requests), chosen[:, 0]] += 1
    for index, p in enumerate(params):
        expected = filtered_probs(logits[index, :1], p)[0] if not p.greedy else torch.nn.functional.one_hot(
            greedy[index, 0], VOCAB).float()
        distance = 0.5 * (counts[index] / rounds - expected).abs().sum()
        assert distance < 0.03, (p, float(distance))
        assert (counts[index][expected == 0] == 0).all()  # nothing outside the filtered support


def test_a_request_s_tokens_do_not_depend_on_the_others_parameters() -> None:
    """Each request of a mixed batch (top-k and top-p requests beside plain sampled and greedy ones) draws, row for
    row, what it draws in a round of its own kind alone, and what `choose_step_rows` draws for its row."""
    generator = torch.Generator().manual_seed(3)
    requests, rows = len(PARAMS), 3
    logits = torch.randn((requests, rows, VOCAB), generator=generator) * 2
    seeds = [7 * index + 1 for index in range(requests)]
    positions = (40 + torch.arange(rows))[None].expand(requests, rows)
    uniforms = row_uniforms(torch.tensor(seeds), positions)  # [requests, rows]
    together = choose_rows(logits, _sampling(PARAMS, seeds), uniforms, "mixed", logits.argmax(dim=-1))
    for index, p in enumerate(PARAMS):
        alone = choose_rows(logits[index : index + 1], _sampling([p], [seeds[index]]), uniforms[index : index + 1],
                            choice_mode([p]), logits[index : index + 1].argmax(dim=-1))
        assert torch.equal(together[index], alone[0]), p
    step = choose_step_rows(logits[:, 0], PARAMS, seeds, [40] * requests)  # [requests]
    assert torch.equal(step, together[:, 0])


def test_greedy_mode_is_the_argmax() -> None:
    logits = torch.randn((2, 3, VOCAB))
    greedy = logits.argmax(dim=-1)
    sampling = _sampling([SamplingParams(), SamplingParams()], [1, 2])
    assert torch.equal(choose_rows(logits, sampling, None, "greedy", greedy), greedy)
