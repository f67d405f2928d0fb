"""Batched greedy/sampled generation for offline work (training data, exact replay), left-padded in one cache.

Rows of different prompt lengths share one cache. A left pad is given an out-of-range position, so no real
token ever attends to it (attention is causal by position), while the pad itself still sees keys and
never produces NaN. The prompt runs eagerly; every new token is one `BatchedDecoder` step (replayed from a CUDA
graph on a GPU). Each row stops at EOS or `max_new_tokens`; the batch stops when every row has.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash.fastpath.batched_step import PAD_POSITION, BatchedDecoder
from dflash.models.model import CausalLM

__all__ = ["PAD_POSITION", "BatchedDecoder", "generate_batch"]


@torch.inference_mode()
def generate_batch(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    decoder: BatchedDecoder | None = None,
) -> list[list[int]]:
    """Return the generated ids of each prompt (EOS included when produced). `decoder` (one per batch size, reused
    across calls: its CUDA graphs are captured once) is made for this call when not given or too small."""
    device = model.embed_tokens.weight.device
    batch, longest = len(prompts), max(len(p) for p in prompts)
    if decoder is None or not decoder.fits(batch, longest + max_new_tokens):
        decoder = BatchedDecoder(model, batch, longest + max_new_tokens)
    ids = torch.zeros((batch, longest), dtype=torch.long, device=device)
    positions = torch.full((batch, longest), PAD_POSITION, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        pad = longest - len(prompt)
        ids[row, pad:] = torch.tensor(list(prompt), device=device)
        positions[row, pad:] = torch.arange(len(prompt), device=device)
    out = model(ids, positions, decoder.start(), logits="last")
    assert out.logits is not None
    logits = out.logits[:, -1]  # [batch, vocab]
    next_positions = torch.tensor([len(p) for p in prompts], device=device)
    eos = torch.tensor(list(eos_ids), device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    generated = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        scores = logits.float()
        if temperature > 0:
            tokens = torch.multinomial(torch.softmax(scores / temperature, -1), 1, generator=generator)[:, 0]
        else:
            tokens = scores.argmax(-1)
        generated[:, step] = tokens
        finished_now = ~done & torch.isin(tokens, eos)
        lengths = torch.where(finished_now, torch.full_like(lengths, step + 1), lengths)
        done |= finished_now
        if step + 1 == max_new_tokens or (step % 16 == 15 and bool(done.all())):
            break
        logits = decoder.step(tokens, next_positions)
        next_positions = next_positions + 1
    rows = generated.tolist()
    return [row[: int(n)] for row, n in zip(rows, lengths.tolist(), strict=True)]
