"""The batched core on a CUDA device: the graphed decoding pass equals the packed eager pass, and a batch of mixed
requests gives each request its tokens alone (float32)."""

from __future__ import annotations

import pytest
import torch

from tests.batch_helpers import count_launches, drain, make_core, make_sequence, overlap_on_and_off
from tests.spec_helpers import golden_pair, random_prompts, run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_graphed_batched_decoding_gives_each_request_its_tokens_alone() -> None:
    target, drafter = golden_pair()
    prompts = random_prompts(9, target.config.vocab_size, seed=21, lengths=(7, 90, 40))
    references = [run(target, None, p, 32)[0] for p in prompts]
    target, drafter = golden_pair("cuda")
    core = make_core(target, drafter, max_batch=6, prefill_chunk=32, cuda_graphs=True)
    assert core.graphs is not None
    seqs = [make_sequence(target, p, 32, ("none", "linear", "ddtree")[i % 3]) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    drain(core)
    assert core.graphs.captured > 0
    for seq, reference in zip(seqs, references, strict=True):
        assert seq.error is None
        assert seq.sink.token_ids == reference, seq.mode


@pytest.mark.gpu
@cuda
def test_graphed_plain_steps_launched_ahead_give_each_request_its_tokens_alone() -> None:
    """Plain greedy requests through the graphs with each step launched before the previous one is read
    (`dflash.batch.overlap`: host buffers in turn, tokens handed over on the device), some ending at EOS, one
    joining late: each request's tokens alone (float32)."""
    target, _ = golden_pair()
    prompts = random_prompts(8, target.config.vocab_size, seed=29, lengths=(5, 70, 33))
    lengths = [40, 12, 40, 27, 40, 8, 33, 40]
    references = [run(target, None, p, n)[0] for p, n in zip(prompts, lengths, strict=True)]
    eos = {2: references[2][9], 6: references[6][20]}
    expected = [r[: r.index(eos[i]) + 1] if i in eos else r for i, r in enumerate(references)]
    target = golden_pair("cuda")[0]
    core = make_core(target, None, max_batch=8, prefill_chunk=32, cuda_graphs=True)
    assert core.overlap is not None
    launches = count_launches(core)
    seqs = [make_sequence(target, p, n, "none", eos=(eos[i],) if i in eos else ())
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    for seq in seqs[:-1]:
        core.add(seq)
    for _ in range(10):
        core.step()
    core.add(seqs[-1])
    drain(core)
    assert len(launches) > 20 and max(launches) >= 6
    for seq, tokens in zip(seqs, expected, strict=True):
        assert seq.error is None
        assert seq.sink.token_ids == tokens
    assert core.target_pool.free_blocks == core.target_pool.num_blocks


@pytest.mark.gpu
@cuda
def test_graphed_sampled_steps_launched_ahead_draw_what_the_synchronous_steps_draw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded sampled requests beside greedy ones through the graphs: launched ahead (each request's chooser
    drawing on the device from its own stream) they give the tokens the synchronous steps give."""
    from dflash.generation.sampling import SamplingParams

    target, _ = golden_pair("cuda")
    prompts = random_prompts(4, target.config.vocab_size, seed=31, lengths=(6, 25))
    sampling = [SamplingParams(temperature=0.8, top_p=0.95, seed=5), SamplingParams(),
                SamplingParams(temperature=1.1, top_k=30, seed=6), SamplingParams(temperature=0.6, seed=7)]
    outputs, launched = overlap_on_and_off(monkeypatch, target, prompts, sampling, 30, prefill_chunk=32,
                                           cuda_graphs=True)
    assert outputs[0] == outputs[1]
    assert launched[0] > 10 and launched[1] == 0
