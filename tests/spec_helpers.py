"""Small drivers for speculative and plain decoding on in-memory models (no tokenizer needed)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dflash.config import ModelConfig
from dflash.drafter.loader import load_drafter
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.drafter.vocab import DraftScores
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.models.registry import build_model
from dflash.speculative.linear import decode_linear
from tests.golden import golden_dir
from tests.tiny_models import hf_tiny, ours_from_hf


def patch_draft_logits(
    monkeypatch: pytest.MonkeyPatch, drafter: DFlashDrafter, replacement: Callable[..., torch.Tensor]
) -> None:
    """Make the decoding loops draft from `replacement(original, target, pending, start, new_features, cache, **kw)`
    -> logits [drafts, vocab], where `original` takes the same arguments and gives the drafter's own logits."""
    own = drafter.draft_scores  # bound before patching

    def original(*args: Any, **kwargs: Any) -> torch.Tensor:
        return own(*args, **kwargs).full()

    def draft_scores(*args: Any, **kwargs: Any) -> DraftScores:
        logits = replacement(original, *args, **kwargs)  # [drafts, vocab]
        return DraftScores(logits, None, logits.shape[-1])

    monkeypatch.setattr(drafter, "draft_scores", draft_scores)


def golden_pair(device: str = "cpu") -> tuple[CausalLM, DFlashDrafter]:
    """The golden tiny target and drafter: on the CPU one shared pair; on another device a pair loaded afresh per
    call (moving a module moves it in place: a GPU test must neither leave the CPU tests' pair on the GPU nor see what
    an earlier test attached to a pair)."""
    if torch.device(device).type == "cpu":
        return _shared_golden_pair()
    target, drafter = _load_golden_pair()
    return target.to(device), drafter.to(device)


@cache
def _shared_golden_pair() -> tuple[CausalLM, DFlashDrafter]:
    return _load_golden_pair()


def _load_golden_pair() -> tuple[CausalLM, DFlashDrafter]:
    path = golden_dir("dflash-tiny")
    config = ModelConfig.from_hf(json.loads((path / "target" / "config.json").read_text()))
    target = build_model(config, load_file(str(path / "target" / "model.safetensors")))
    return target, load_drafter(str(path / "drafter"), config)


def run(
    target: CausalLM,
    drafter: DFlashDrafter | None,
    prompt: list[int],
    max_new: int,
    *,
    sampling: SamplingParams | None = None,
    eos: tuple[int, ...] = (),
    prefill_chunk: int = 64,
) -> tuple[list[int], GenerationStats]:
    sampling = sampling or SamplingParams()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling)
    sink = OutputSink(lambda ids: "", eos_ids=eos, max_new_tokens=max_new)
    device = target.embed_tokens.weight.device
    chooser = TokenChooser(sampling, eos_ids=eos, min_tokens=0, vocab_size=target.config.vocab_size, device=device)
    if drafter is None:
        stats = decode_autoregressive(target, request, sink, chooser, prefill_chunk=prefill_chunk)
    else:
        stats = decode_linear(target, drafter, request, sink, chooser, prefill_chunk=prefill_chunk)
    return sink.token_ids, stats


def total_variation(a: Counter[int], b: Counter[int]) -> float:
    """Total variation distance between two empirical distributions (token counts)."""
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))


def random_prompts(count: int, vocab: int, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]


def assert_drafts_like(target: CausalLM, dense: DFlashDrafter, rounded: DFlashDrafter) -> None:
    """A drafter with rounded weights drafts like the dense one: logits within 2% (and not identical), top-1
    flips on at most a fifth of the positions, each a near-tie of the dense logits (the tiny random drafter's
    logits are nearly flat)."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 40, dense.config.feature_size, generator=g)
    logits = {
        name: drafter.draft_scores(target, 7, 40, features, drafter.new_cache(128)).full()  # [B-1, vocab]
        for name, drafter in (("dense", dense), ("rounded", rounded))
    }
    error = (logits["rounded"] - logits["dense"]).norm() / logits["dense"].norm()
    assert 0 < error < 0.02
    dense_top = logits["dense"].topk(2, dim=-1).values  # [B-1, 2]
    flipped = logits["rounded"].argmax(-1) != logits["dense"].argmax(-1)
    assert flipped.float().mean() <= 0.2
    assert ((dense_top[:, 0] - dense_top[:, 1])[flipped] < 0.05 * logits["dense"].abs().max()).all()


def assert_speculation_lossless(target: CausalLM, drafter: DFlashDrafter) -> None:
    """Linear DFlash with `drafter` gives the target's own greedy tokens on a few random prompts, in rounds."""
    for prompt in random_prompts(4, target.config.vocab_size, seed=5, lengths=(9, 30)):
        plain, _ = run(target, None, prompt, 40)
        spec, stats = run(target, drafter, prompt, 40)
        assert spec == plain and stats.rounds > 0


def tiny_random_pair(vocab: int, embed_scale: float, block: int) -> tuple[CausalLM, DFlashDrafter]:
    """A `vocab`-token llama target (tied embeddings: `embed_scale` sets how sharp its next-token distributions are)
    and a random one-layer drafter with blocks of `block` tokens."""
    hf = hf_tiny("llama", seed=3)
    hf.resize_token_embeddings(vocab)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(embed_scale)
    hf.config.vocab_size = vocab
    target = ours_from_hf(hf)
    config_raw = {
        "num_hidden_layers": 1, "num_target_layers": 4, "hidden_size": 64, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab,
        "block_size": block, "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": [1]},
    }
    torch.manual_seed(7)
    return target, DFlashDrafter(DrafterConfig.from_dict(config_raw)).eval().requires_grad_(False)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """For modules of tiny models (assign it to a module-level name): intra-op threads only add overhead there, and
    spin badly on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def oracle_logits(logits: torch.Tensor, start: int, sequence: list[int]) -> torch.Tensor:
    """Put the token `sequence` holds at each drafted position on top, except at some (position, round) pairs where
    a wrong token goes first and the right one second: linear rounds stop there, trees continue."""
    logits = logits.clone()  # [drafts, vocab]
    vocab = logits.shape[1]
    for row in range(logits.shape[0]):
        position = start + 1 + row
        if position >= len(sequence):
            break
        right, top = sequence[position], float(logits[row].max())
        if (position * 31 + start * 17) % 7 in (0, 3):
            logits[row, (right + 1) % vocab] = top + 6.0
            logits[row, right] = top + 5.5
        else:
            logits[row, right] = top + 6.0
    return logits
