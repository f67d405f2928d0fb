"""The batched core on a CUDA device: the graphed decoding pass equals the packed eager pass, and a batch of mixed
requests gives each request its tokens alone (float32)."""

from __future__ import annotations

import pytest
import torch

from tests.batch_helpers import drain, make_core, make_sequence
from tests.spec_helpers import golden_pair, random_prompts, run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_graphed_batched_decoding_gives_each_request_its_tokens_alone() -> None:
    target, drafter = golden_pair()
    prompts = random_prompts(9, target.config.vocab_size, seed=21, lengths=(7, 90, 40))
    references = [run(target, None, p, 32)[0] for p in prompts]
    target, drafter = target.to("cuda"), drafter.to("cuda")
    try:
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
    finally:
        target.to("cpu"), drafter.to("cpu")
