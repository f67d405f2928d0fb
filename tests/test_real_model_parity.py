"""Greedy generation from the real GGUF files equals transformers' own generation from the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash.generation.request import GenerationRequest
from dflash.models.packaged import gemma3_270m_path
from dflash.models.registry import build_model
from dflash.models.resolve import default_model_path, load_checkpoint

CHATS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for better sleep.",
    "Explain what a hash table is in two sentences.",
]


def _transformers_from_gguf(path: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def _ours_greedy(model: torch.nn.Module, prompt: list[int], new: int, eos: tuple[int, ...]) -> list[int]:
    from dflash.generation.autoregressive import decode_autoregressive
    from dflash.generation.output import OutputSink
    from dflash.generation.sampling import SamplingParams
    from dflash.generation.selection import TokenChooser

    sink = OutputSink(lambda ids: "", eos_ids=eos, max_new_tokens=new)
    chooser = TokenChooser(SamplingParams(), eos_ids=eos, min_tokens=0, vocab_size=model.config.vocab_size, device="cpu")
    decode_autoregressive(model, GenerationRequest(prompt_ids=prompt, max_new_tokens=new), sink, chooser,
                          prefill_chunk=64)
    return sink.token_ids


@torch.no_grad()
def _theirs_greedy(model: torch.nn.Module, prompt: list[int], new: int, eos: tuple[int, ...]) -> list[int]:
    """Greedy until EOS (included) or `new` tokens, like ours."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=list(eos), pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_smollm2_64_greedy_tokens_match_transformers() -> None:
    path = default_model_path()
    checkpoint = load_checkpoint(str(path))
    ours = build_model(checkpoint.config, checkpoint.weights)
    theirs = _transformers_from_gguf(path)
    tokenizer = checkpoint.tokenizer
    assert tokenizer is not None
    for chat in CHATS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True)
        prompt = tokenizer.encode(text)
        eos = tokenizer.eos_token_ids
        assert _ours_greedy(ours, prompt, 64, eos) == _theirs_greedy(theirs, prompt, 64, eos), chat


@pytest.mark.slow
def test_gemma3_270m_32_greedy_tokens_match_transformers() -> None:
    path = gemma3_270m_path()
    if path is None:
        pytest.skip("gemma3-270m GGUF packages are not installed")
    checkpoint = load_checkpoint(str(path))
    ours = build_model(checkpoint.config, checkpoint.weights)
    del checkpoint.weights
    theirs = _transformers_from_gguf(path)
    tokenizer = checkpoint.tokenizer
    assert tokenizer is not None
    # a prompt longer than the 512-token sliding window, and a short one
    long_text = " ".join(f"Item {i} is a small red box." for i in range(90))
    for text in ("The history of the printing press begins", long_text + " The last item is"):
        prompt = [tokenizer.bos_token_id or 2, *tokenizer.encode(text)]
        if text is long_text:
            assert len(prompt) > 512
        eos = tokenizer.eos_token_ids
        ours_tokens = _ours_greedy(ours, prompt, 32, eos)
        assert len(ours_tokens) == 32  # a base model continuing prose: no early EOS
        assert ours_tokens == _theirs_greedy(theirs, prompt, 32, eos)
