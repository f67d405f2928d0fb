"""Batched greedy/sampled generation for offline work (training data), left-padded in one static cache.

Rows of different prompt lengths share one cache. A left pad is given an out-of-range position, so no real
token ever attends to it (attention is causal by position), while the pad itself still sees keys and
never produces NaN. Each row stops at EOS or `max_new_tokens`; the batch stops when every row has.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash.models.model import CausalLM

PAD_POSITION = 1 << 30


@torch.inference_mode()
def generate_batch(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Return the generated ids of each prompt (EOS included when produced)."""
    device = model.embed_tokens.weight.device
    batch, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((batch, longest), dtype=torch.long, device=device)
    positions = torch.full((batch, longest), PAD_POSITION, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        pad = longest - len(prompt)
        ids[row, pad:] = torch.tensor(list(prompt), device=device)
        positions[row, pad:] = torch.arange(len(prompt), device=device)
    cache = model.new_cache(longest + max_new_tokens, batch=batch)
    out = model(ids, positions, cache, logits="last")
    next_positions = torch.tensor([len(p) for p in prompts], device=device)
    eos = torch.tensor(list(eos_ids), device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    generated = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        assert out.logits is not None
        logits = out.logits[:, -1].float()
        if temperature > 0:
            tokens = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        else:
            tokens = logits.argmax(-1)
        generated[:, step] = tokens
        finished_now = ~done & torch.isin(tokens, eos)
        lengths = torch.where(finished_now, torch.full_like(lengths, step + 1), lengths)
        done |= finished_now
        if step % 16 == 15 and bool(done.all()):
            break
        out = model(tokens[:, None], next_positions[:, None], cache, logits="last")
        next_positions = next_positions + 1
    rows = generated.tolist()
    return [row[: int(n)] for row, n in zip(rows, lengths.tolist(), strict=True)]
