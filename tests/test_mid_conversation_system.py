"""Mid-conversation system messages (`role: "system"` inside Anthropic `messages`, which Claude Code sends on every
request): accepted and rendered at their point of the conversation, natively where the chat template allows it,
folded into the neighbouring user turn where it does not."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from dflash.server import ServerSettings, create_app
from dflash.server.prompt import fold_inline_system
from tests.server_helpers import FakeEngine, serving

pytestmark = pytest.mark.timeout(60)

# A template that renders only a leading system message and insists on user/assistant alternation afterwards,
# as Gemma's and Mistral's do.
STRICT = (
    "{% if messages[0].role == 'system' %}{% set rest = messages[1:] %}<<SYS>>{{ messages[0].content }}<</SYS>>\n"
    "{% else %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if m.role not in ['user', 'assistant'] or (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "[{{ m.role }}]{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
# A template that silently drops every system message but the first.
DROPPING = (
    "{% for m in messages %}{% if m.role != 'system' or loop.first %}[{{ m.role }}]{{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)

CLAUDE_CODE_LIKE: dict[str, Any] = {
    "model": "any", "max_tokens": 20,
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "list the files"}]},
        {"role": "system", "content": [{"type": "text", "text": "Available agents: general-purpose.",
                                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
    ],
}


def test_claude_code_request_is_answered_with_system_text_in_place() -> None:
    engine = FakeEngine()
    with serving(create_app(engine, ServerSettings())) as server:
        response = httpx.post(f"{server.url}/v1/messages", json=CLAUDE_CODE_LIKE, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["text"]
    prompt = engine.prompts[0]
    assert prompt.index("<|im_start|>system\nYou are Claude Code.") < prompt.index("<|im_start|>user\nlist the files")
    assert prompt.index("list the files") < prompt.index("<|im_start|>system\nAvailable agents: general-purpose.")


def test_official_sdk_sends_and_gets_an_answer() -> None:
    engine = FakeEngine()
    with serving(create_app(engine, ServerSettings())) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        message = client.messages.create(
            model="any", max_tokens=100,
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "and now?"},
                {"role": "system", "content": "Answer in French."},
            ],
        )
        tokens = client.messages.count_tokens(
            model="any", messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."}]
        )
    assert message.stop_reason == "end_turn"
    assert "<|im_start|>system\nAnswer in French.<|im_end|>" in engine.prompts[0]
    assert tokens.input_tokens > len("Be brief.")


@pytest.mark.parametrize("template", [STRICT, DROPPING])
def test_templates_that_cannot_render_it_get_it_folded_into_the_user_turn(template: str) -> None:
    engine = FakeEngine()
    with serving(create_app(engine, ServerSettings(chat_template=template))) as server:
        response = httpx.post(f"{server.url}/v1/messages", json=CLAUDE_CODE_LIKE, timeout=30)
    assert response.status_code == 200, response.text
    prompt = engine.prompts[0]
    assert "You are Claude Code." in prompt
    assert "[user]list the files\n\nAvailable agents: general-purpose.\n" in prompt


def test_leading_and_consecutive_system_messages_are_joined() -> None:
    engine = FakeEngine()
    body = {
        "model": "any", "max_tokens": 5, "system": "Top.",
        "messages": [
            {"role": "system", "content": "Also first."},
            {"role": "user", "content": "q"},
            {"role": "system", "content": "One."},
            {"role": "system", "content": [{"type": "text", "text": "Two."}]},
        ],
    }
    with serving(create_app(engine, ServerSettings())) as server:
        response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert engine.prompts[0].startswith("<|im_start|>system\nTop.\n\nAlso first.<|im_end|>\n<|im_start|>user\nq")
    assert "<|im_start|>system\nOne.\n\nTwo.<|im_end|>" in engine.prompts[0]


def test_system_message_with_non_text_blocks_is_refused_in_anthropic_words() -> None:
    body = {
        "model": "any", "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]},
        ],
    }
    with serving(create_app(FakeEngine(), ServerSettings())) as server:
        response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    message = error["error"]["message"]
    assert "messages.1.content.0" in message and "text blocks only" in message
    assert "role system" in message and "not supported" in message  # what Claude Code's fallback looks for


def test_fold_keeps_order_and_roles() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "system", "content": "after u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "after a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "system", "content": "last"},
    ]
    assert fold_inline_system(messages) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1\n\nafter u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "after a1\n\nu2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "last"},
    ]


def test_mid_conversation_system_blocks_end_their_turn() -> None:
    engine = FakeEngine()
    body = {
        "model": "any", "max_tokens": 5,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "q"},
            {"type": "mid_conv_system", "content": [{"type": "text", "text": "Reply in French."}]},
        ]}],
    }
    with serving(create_app(engine, ServerSettings())) as server:
        response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert "<|im_start|>user\nq<|im_end|>\n<|im_start|>system\nReply in French.<|im_end|>" in engine.prompts[0]
