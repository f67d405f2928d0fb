"""Small drivers for speculative and plain decoding on in-memory models (no tokenizer needed)."""

from __future__ import annotations

import json
from functools import cache

import torch
from safetensors.torch import load_file

from dflash.config import ModelConfig
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.models.registry import build_model
from dflash.spec.drafter import DFlashDrafter
from dflash.spec.drafter_loader import load_drafter
from dflash.spec.linear import decode_linear
from tests.golden import golden_dir


@cache
def golden_pair() -> tuple[CausalLM, DFlashDrafter]:
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
    chooser = TokenChooser(sampling, eos_ids=eos, min_tokens=0, vocab_size=target.config.vocab_size, device="cpu")
    if drafter is None:
        stats = decode_autoregressive(target, request, sink, chooser, prefill_chunk=prefill_chunk)
    else:
        stats = decode_linear(target, drafter, request, sink, chooser, prefill_chunk=prefill_chunk)
    return sink.token_ids, stats


def random_prompts(count: int, vocab: int, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]
