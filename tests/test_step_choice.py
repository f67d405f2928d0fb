"""A launched plain step's draws (`dflash.batch.step_choice`): the same tokens as the synchronous step's
`choose_step_rows` for every request of a mixed batch, padding rows aside, eager or replayed from a captured graph
whose parameters and positions change between replays."""

from __future__ import annotations

import pytest
import torch

from dflash.batch.device_sampling import choose_step_rows
from dflash.batch.step_choice import StepChoices, StepSampling
from dflash.generation.sampling import SamplingParams

VOCAB = 300
PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.15),
]
BUCKET = 8  # the padded pass's requests: rows past the real ones are padding


def _draws(choices: StepChoices, logits: torch.Tensor, positions: torch.Tensor, sampling: StepSampling
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step's draw for the first len(params) rows, `choose_step_rows`'s for them)."""
    count = len(sampling.params)
    drawn = choices.choose(logits, positions, sampling)[:count].clone()
    expected = choose_step_rows(logits[:count], sampling.params, sampling.seeds, positions[:count].tolist())
    return drawn, expected


def _check_replays(device: torch.device, graphed: bool) -> None:
    generator = torch.Generator(device=device).manual_seed(5)
    logits = torch.empty((BUCKET, VOCAB), device=device)  # one buffer, rewritten between draws as a graph's is
    positions = torch.empty(BUCKET, dtype=torch.long, device=device)
    choices = StepChoices(torch.cuda.graph_pool_handle() if graphed else None, graphed=graphed)
    sampling = StepSampling(PARAMS, list(range(len(PARAMS))))
    for step in range(8):
        logits.copy_(torch.randn((BUCKET, VOCAB), generator=generator, device=device) * 3)
        positions.copy_(torch.arange(BUCKET, device=device) * 7 + 100 + step)
        if step % 2 == 0:  # new requests (odd steps: the same ones again, their parameters already loaded)
            params = PARAMS[: 3 + step % 3] if step < 4 else [SamplingParams(temperature=0.9)] * 4  # modes change
            sampling = StepSampling(params, [11 * index + step for index in range(len(params))])
        drawn, expected = _draws(choices, logits, positions, sampling)
        assert torch.equal(drawn, expected), step
        greedy = [index for index, p in enumerate(sampling.params) if p.greedy]
        assert torch.equal(drawn[greedy], logits[greedy].argmax(dim=-1))


def test_eager_draws_equal_the_synchronous_step_s() -> None:
    _check_replays(torch.device("cpu"), graphed=False)


def test_draws_are_not_all_the_argmax() -> None:
    """A control: sampled rows drawn over many positions leave the argmax often (the equality above is no tautology
    of greedy rows)."""
    logits = torch.zeros((BUCKET, VOCAB))
    logits[:, 0] = 1.0
    choices = StepChoices(None, graphed=False)
    params = [SamplingParams(temperature=1.0)] * BUCKET
    off = 0
    for position in range(40):
        positions = torch.full((BUCKET,), position, dtype=torch.long)
        off += int((choices.choose(logits, positions, StepSampling(params, list(range(BUCKET)))) != 0).sum())
    assert off > 0.5 * 40 * BUCKET


@pytest.mark.gpu
def test_graphed_draws_equal_the_synchronous_step_s() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_replays(torch.device("cuda"), graphed=True)
