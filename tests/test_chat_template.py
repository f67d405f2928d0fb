"""Chat template rendering: parity with transformers, the HF extensions, sandboxing, errors."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest

from dflash.chat_template import render_chat_template
from dflash.errors import GenerationError
from dflash.models.gguf_file import GGUFFile
from dflash.tokenizer import Tokenizer
from tests.loading_helpers import smollm2_path

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Und 3×3? 😀\n\nmulti-line\ttext"},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata)


@pytest.fixture(scope="module")
def reference() -> Any:
    transformers = pytest.importorskip("transformers")
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(
    smollm: Tokenizer, reference: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ours = smollm.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert smollm.encode(ours) == reference.encode(theirs, add_special_tokens=False)


def test_default_system_prompt(smollm: Tokenizer) -> None:
    text = smollm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_variables_and_extra_kwargs() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if tools %}T={{ tools | length }}{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    messages = [{"role": "user", "content": "x"}]
    text = render_chat_template(
        template,
        messages,
        tools=[{"type": "function"}],
        bos_token="<s>",
        eos_token="</s>",
        enable_thinking=False,
    )
    assert text == "<s>[user]x</s>T=1<no_think>[assistant]"
    assert render_chat_template(template, messages, add_generation_prompt=False) == "[user]x"


def test_tojson_keeps_unicode_and_indents() -> None:
    value = {"name": "café", "emoji": "😀", "tag": "<b>&"}
    assert render_chat_template("{{ v | tojson }}", [], v=value) == json.dumps(value, ensure_ascii=False)
    assert render_chat_template("{{ v | tojson(indent=2) }}", [], v=value) == json.dumps(
        value, ensure_ascii=False, indent=2
    )


def test_strftime_now_and_loopcontrols() -> None:
    year = render_chat_template("{{ strftime_now('%Y') }}", [])
    assert year == str(datetime.now().year)
    text = render_chat_template(
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
        [{"role": "user", "content": c} for c in "abcd"],
    )
    assert text == "ab"


def test_trim_blocks_and_generation_block() -> None:
    template = "{% for m in messages %}\n  {% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}"
    assert render_chat_template(template, [{"role": "assistant", "content": "x"}]) == "x"


def test_raise_exception_is_a_generation_error() -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    with pytest.raises(GenerationError, match="first message must be from the user"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}])


def test_errors_are_generation_errors() -> None:
    with pytest.raises(GenerationError, match="syntax error"):
        render_chat_template("{% for %}", [])
    with pytest.raises(GenerationError, match="failed to render"):
        render_chat_template("{{ messages[0].content }}", [])


def test_sandbox_blocks_unsafe_access() -> None:
    with pytest.raises(GenerationError):
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(GenerationError):  # immutable: templates cannot mutate the caller's data
        render_chat_template("{% set _ = messages.append(1) %}", [{"role": "user", "content": "x"}])
