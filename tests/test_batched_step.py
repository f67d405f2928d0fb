"""The batched decoding step (fixed key buckets, device-held slot) against the eager forward, row by row.

Teacher-forced: both paths see the same left-padded prompts and the same new tokens, so every step's logits can be
compared, across bucket boundaries, sliding windows and a decoder reused for a second batch. The GPU test replays
the captured CUDA graphs and skips without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from dflash.fastpath import batched_step
from dflash.fastpath.batched_step import PAD_POSITION, BatchedDecoder
from dflash.generation.batched import generate_batch
from dflash.models.model import CausalLM
from tests.spec_helpers import golden_pair, random_prompts
from tests.tiny_models import hf_tiny, ours_from_hf


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
    positions = torch.full((len(prompts), longest), PAD_POSITION, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt, device=device)
        positions[row, longest - len(prompt):] = torch.arange(len(prompt), device=device)
    return ids, positions


@torch.inference_mode()
def step_logits(model: CausalLM, decoder: BatchedDecoder, prompts: list[list[int]], new: torch.Tensor
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of every new token [batch, vocab] from the decoder's steps and from eager forwards on a plain cache.
    new: [batch, steps] token ids fed one column per step."""
    device = model.embed_tokens.weight.device
    ids, positions = left_padded(prompts, device)
    eager_cache = model.new_cache(ids.shape[1] + new.shape[1], len(prompts))
    model(ids, positions, eager_cache, logits="last")
    model(ids, positions, decoder.start(), logits="last")
    next_positions = torch.tensor([len(p) for p in prompts], device=device)
    stepped, eager = [], []
    for column in range(new.shape[1]):
        tokens = new[:, column]
        stepped.append(decoder.step(tokens, next_positions).float().clone())
        out = model(tokens[:, None], next_positions[:, None], eager_cache, logits="last")
        assert out.logits is not None
        eager.append(out.logits[:, -1].float())
        next_positions = next_positions + 1
    return stepped, eager


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_step_equals_eager_across_buckets(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched_step, "STEP_BUCKET", 8)  # 30 new tokens cross several buckets
    model = ours_from_hf(hf_tiny(family))
    prompts = random_prompts(3, model.config.vocab_size, seed=3, lengths=(5, 19, 11))
    new = torch.randint(0, model.config.vocab_size, (3, 30), generator=torch.Generator().manual_seed(4))
    decoder = BatchedDecoder(model, 3, 19 + 30)
    assert not decoder.capture  # no CUDA graphs on the CPU: the same step runs eagerly
    stepped, eager = step_logits(model, decoder, prompts, new)
    for a, b in zip(stepped, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_reused_decoder_hides_the_last_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second, shorter batch in the same decoder: the first batch's keys in the later slots stay invisible."""
    monkeypatch.setattr(batched_step, "STEP_BUCKET", 16)
    model = ours_from_hf(hf_tiny("llama"))
    decoder = BatchedDecoder(model, 2, 64)
    gen = torch.Generator().manual_seed(5)
    first = random_prompts(2, model.config.vocab_size, seed=6, lengths=(30, 24))
    step_logits(model, decoder, first, torch.randint(0, model.config.vocab_size, (2, 20), generator=gen))
    second = random_prompts(2, model.config.vocab_size, seed=7, lengths=(4, 9))
    stepped, eager = step_logits(model, decoder, second,
                                 torch.randint(0, model.config.vocab_size, (2, 12), generator=gen))
    for a, b in zip(stepped, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_step_past_capacity_is_refused() -> None:
    model = ours_from_hf(hf_tiny("llama"))
    decoder = BatchedDecoder(model, 1, 4)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], decoder.start(), logits="none")
        with pytest.raises(ValueError, match="holds 4 slots"):
            decoder.step(torch.tensor([5]), torch.tensor([4]))


def test_generate_batch_reuses_a_fitting_decoder() -> None:
    target, _ = golden_pair()
    prompts = random_prompts(2, target.config.vocab_size, seed=9, lengths=(30, 12))
    decoder = BatchedDecoder(target, 2, 30 + 40)
    reused = generate_batch(target, prompts, max_new_tokens=40, eos_ids=(), decoder=decoder)
    assert decoder.cache.length == 30 + 39  # the last token is chosen, never fed back
    assert reused == generate_batch(target, prompts, max_new_tokens=40, eos_ids=())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_captured_steps_equal_the_eager_step() -> None:
    """fp32 on the GPU: replayed graphs (several buckets, a reused decoder) give the eager step's logits."""
    target, _ = golden_pair("cuda")
    prompts = random_prompts(4, target.config.vocab_size, seed=10, lengths=(9, 200, 40, 120))
    new = torch.randint(0, target.config.vocab_size, (4, 150), generator=torch.Generator().manual_seed(11))
    graphed = BatchedDecoder(target, 4, 200 + 150)
    eager = BatchedDecoder(target, 4, 200 + 150, capture=False)
    for _ in range(2):
        replayed, _ = step_logits(target, graphed, prompts, new.cuda())
        stepped, plain = step_logits(target, eager, prompts, new.cuda())
        assert sorted(graphed.graphs) == [256, 350]  # the last bucket is cut to the capacity
        for a, b, c in zip(replayed, stepped, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
