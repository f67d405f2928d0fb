"""Wire protocols with a scripted fake engine (the output must be controlled): tool-call round trips in the
OpenAI chat, Anthropic and Responses APIs, streamed and not, reasoning split, template tool formats,
tool_choice, stop sequences and template kwargs. Driven by the official SDKs and raw httpx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from dflash.server import ServerSettings, create_app
from tests.server_helpers import HERMES, QWEN3_CODER, FakeEngine, ServerThread, serving, sse_events

pytestmark = pytest.mark.timeout(60)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ANTHROPIC_WEATHER = {
    "name": "get_weather", "description": "Weather forecast for a city",
    "input_schema": WEATHER["function"]["parameters"],
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3", "metric": "true"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(fake: FakeEngine) -> Iterator[ServerThread]:
    with serving(create_app(fake, ServerSettings())) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh(fake: FakeEngine) -> None:
    fake.outputs.clear()
    fake.requests.clear()
    fake.prompts.clear()


@pytest.fixture(scope="module")
def oa(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def claude(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="dummy", max_retries=0, timeout=30)


# ------------------------------------------------------------------------------------- OpenAI chat
def test_openai_tool_call_round_trip(oa: openai.OpenAI, fake: FakeEngine) -> None:
    fake.script("Let me check.\n" + CALL)
    first = oa.chat.completions.create(model="any", messages=ASK, tools=[WEATHER], max_tokens=200)
    # SmolLM-style template without tool support: the tools were described in an injected system section.
    assert "# Tools" in fake.prompts[0] and '"name": "get_weather"' in fake.prompts[0]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3, "metric": True}  # coerced to schema

    fake.script("It will be sunny, 21 degrees.")
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = oa.chat.completions.create(model="any", messages=history, tools=[WEATHER], max_tokens=200)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It will be sunny, 21 degrees."
    assert second.choices[0].message.tool_calls is None
    prompt = fake.prompts[1]
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt  # the result reached the model
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "metric": true}}' in prompt


def test_openai_streamed_tool_call_never_leaks_markup(oa: openai.OpenAI, fake: FakeEngine) -> None:
    fake.script("Checking <b>now</b> <tool_c" + "ity>\n" + CALL + "\n")
    chunks = list(oa.chat.completions.create(model="any", messages=ASK, tools=[WEATHER], max_tokens=300, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking <b>now</b> <tool_city>"  # a near-miss of the tag is text; the call is not
    assert "tool_call" not in content and "get_weather" not in content
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3, "metric": True}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_reasoning_content(oa: openai.OpenAI, fake: FakeEngine, server: ServerThread) -> None:
    fake.script("<think>\nThe user wants weather.\n</think>\n\nSunny.")
    result = oa.chat.completions.create(model="any", messages=ASK, max_tokens=100)
    message = result.choices[0].message
    assert message.content == "Sunny."
    assert message.model_extra["reasoning_content"] == "The user wants weather."
    fake.script("<think>\nThe user wants weather.\n</think>\n\nSunny.")
    body = {"model": "any", "messages": ASK, "max_tokens": 100, "stream": True}
    events = sse_events(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).text)
    deltas = [json.loads(data)["choices"][0]["delta"] for _, data in events[:-1] if json.loads(data)["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants weather."
    assert "".join(d.get("content") or "" for d in deltas) == "Sunny."


def test_tool_choice_named_forces_the_call(oa: openai.OpenAI, fake: FakeEngine) -> None:
    fake.script('{"city": "Rome"}}\n</tool_call>')
    result = oa.chat.completions.create(
        model="any", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert fake.prompts[0].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert "You must call the function get_weather." in fake.prompts[0]
    (call,) = result.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert result.choices[0].finish_reason == "tool_calls" and not result.choices[0].message.content


def test_tool_choice_none_hides_tools(oa: openai.OpenAI, fake: FakeEngine) -> None:
    result = oa.chat.completions.create(model="any", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=50)
    assert "# Tools" not in fake.prompts[0] and "get_weather" not in fake.prompts[0]
    assert result.choices[0].message.content == fake.default


def test_stop_strings_and_content_parts(oa: openai.OpenAI, fake: FakeEngine) -> None:
    fake.script("alpha beta END gamma")
    result = oa.chat.completions.create(
        model="any", max_tokens=100, stop=["END", "ZZZ"],
        messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Go"}, {"type": "text", "text": "!"}]}],
    )
    assert result.choices[0].message.content == "alpha beta"
    assert result.choices[0].finish_reason == "stop"
    assert "<|im_start|>system\nBe brief.<|im_end|>" in fake.prompts[0] and "Go!" in fake.prompts[0]
    assert fake.requests[0].stop == ("END", "ZZZ")


def test_sampling_parameters_reach_the_engine(oa: openai.OpenAI, fake: FakeEngine) -> None:
    oa.chat.completions.create(
        model="any", messages=ASK, max_completion_tokens=33, temperature=0.7, top_p=0.9, seed=5,
        presence_penalty=0.5, frequency_penalty=0.25, extra_body={"top_k": 40, "min_p": 0.05},
    )
    request = fake.requests[0]
    assert request.max_new_tokens == 33
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 40, 0.05, 5)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, 0.25)


def test_developer_role_passes_through_by_default(oa: openai.OpenAI, fake: FakeEngine) -> None:
    oa.chat.completions.create(model="any", max_tokens=20,
                               messages=[{"role": "developer", "content": "Rules."}, *ASK])
    assert "<|im_start|>developer\nRules." in fake.prompts[0]


def test_remap_developer_role_and_native_tools_template() -> None:
    engine = FakeEngine()
    settings = ServerSettings(chat_template=HERMES, remap_developer_role=True)
    with serving(create_app(engine, settings)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
        engine.script(CALL)
        result = client.chat.completions.create(
            model="any", messages=[{"role": "developer", "content": "Rules."}, *ASK], tools=[WEATHER], max_tokens=300,
        )
        prompt = engine.prompts[0]
        assert "<|im_start|>system\nRules." in prompt and "developer" not in prompt
        assert "TOOLS: get_weather" in prompt and "# Tools" not in prompt  # the template renders tools itself
        (call,) = result.choices[0].message.tool_calls or []
        history = [*ASK, result.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "21C"}]
        client.chat.completions.create(model="any", messages=history, tools=[WEATHER], max_tokens=50)
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "metric": true}}' \
            '</tool_call>' in engine.prompts[1]  # the template's own rendering of the earlier call
        assert "<|im_start|>tool\n21C<|im_end|>" in engine.prompts[1]

        # chat_template_kwargs reach the template; a prompt ending in <think> starts inside reasoning.
        engine.script("Weather needs a tool.</think>Sunny.")
        thought = client.chat.completions.create(
            model="any", messages=ASK, max_tokens=80, extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        assert engine.prompts[2].endswith("<|im_start|>assistant\n<think>\n")
        assert thought.choices[0].message.content == "Sunny."
        assert thought.choices[0].message.model_extra["reasoning_content"] == "Weather needs a tool."


def test_qwen3_coder_xml_tool_calls() -> None:
    engine = FakeEngine().script(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    with serving(create_app(engine, ServerSettings(chat_template=QWEN3_CODER))) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(model="any", messages=ASK, tools=[WEATHER], max_tokens=300, stream=True))
    assert "<function>get_weather</function>" in engine.prompts[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "New York", "days": 3}


# --------------------------------------------------------------------------------------- Anthropic
def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic, fake: FakeEngine) -> None:
    fake.script("I'll look it up.\n" + CALL)
    first = claude.messages.create(
        model="any", max_tokens=300, tools=[ANTHROPIC_WEATHER], system="You are terse.", messages=ASK,
    )
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    tool_use = first.content[1]
    assert tool_use.type == "tool_use" and tool_use.id.startswith("toolu_")
    assert tool_use.name == "get_weather" and tool_use.input == {"city": "Paris", "days": 3, "metric": True}
    assert fake.prompts[0].startswith("<|im_start|>system\nYou are terse.\n\n# Tools")

    fake.script("Sunny and 21C.")
    second = claude.messages.create(
        model="any", max_tokens=300, tools=[ANTHROPIC_WEATHER],
        messages=[*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                "content": [{"type": "text", "text": "21C, sun"}]}]}],
    )
    assert second.stop_reason == "end_turn" and second.content[0].text == "Sunny and 21C."
    assert "<tool_response>\n21C, sun\n</tool_response>" in fake.prompts[1]
    assert "I'll look it up.\n<tool_call>" in fake.prompts[1]


def test_anthropic_stream_event_sequence(server: ServerThread, fake: FakeEngine) -> None:
    script = "<think>Need data.</think>Checking.\n" + CALL
    fake.script(script)
    body = {"model": "any", "max_tokens": 300, "stream": True, "tools": [ANTHROPIC_WEATHER], "messages": ASK}
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    events = [(name, json.loads(data)) for name, data in sse_events(response.text)]
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for n, e in events if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert names.count("content_block_stop") == 3
    assert all(n == e["type"] for n, e in events)
    deltas = [e["delta"] for n, e in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Need data."
    assert "".join(d.get("text", "") for d in deltas) == "Checking."
    partial = "".join(d.get("partial_json", "") for d in deltas)
    assert json.loads(partial) == {"city": "Paris", "days": 3, "metric": True}
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == "tool_use" and final["usage"]["output_tokens"] == len(script) + 1
    assert events[0][1]["message"]["usage"]["input_tokens"] == len(fake.requests[0].prompt_ids)


def test_anthropic_sdk_stream_tool_use_and_thinking(claude: anthropic.Anthropic, fake: FakeEngine) -> None:
    fake.script("<think>Need data.</think>" + CALL)
    with claude.messages.stream(model="any", max_tokens=300, tools=[ANTHROPIC_WEATHER], messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "Need data."
    assert final.content[1].input == {"city": "Paris", "days": 3, "metric": True}
    assert final.stop_reason == "tool_use"


def test_anthropic_stop_sequence_and_tool_choice(claude: anthropic.Anthropic, fake: FakeEngine) -> None:
    fake.script("one two STOP three")
    message = claude.messages.create(model="any", max_tokens=100, messages=ASK, stop_sequences=["STOP"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
    assert message.content[0].text == "one two"
    fake.script('{"city": "Oslo"}}</tool_call>')
    forced = claude.messages.create(model="any", max_tokens=100, messages=ASK, tools=[ANTHROPIC_WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.stop_reason == "tool_use" and forced.content[-1].input == {"city": "Oslo"}
    fake.script("plain")
    message = claude.messages.create(model="any", max_tokens=3, messages=ASK)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


# --------------------------------------------------------------------------------------- Responses
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_function_call_round_trip(oa: openai.OpenAI, fake: FakeEngine) -> None:
    fake.script(CALL)
    first = oa.responses.create(model="any", instructions="Be terse.", input="Weather in Paris?",
                                tools=[RESPONSES_WEATHER], max_output_tokens=300)
    assert fake.prompts[0].startswith("<|im_start|>system\nBe terse.")
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3, "metric": True}
    assert first.status == "completed"

    fake.script("Sunny.")
    follow_input: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sun, 21C"},
    ]
    second = oa.responses.create(model="any", input=follow_input, tools=[RESPONSES_WEATHER], max_output_tokens=300)
    assert second.output_text == "Sunny."
    assert "<tool_response>\nsun, 21C\n</tool_response>" in fake.prompts[1]
    assert second.usage is not None and second.usage.output_tokens == len("Sunny.") + 1


def test_responses_stream_events(oa: openai.OpenAI, fake: FakeEngine) -> None:
    fake.script("<think>hmm</think>Let me see.\n" + CALL)
    events = list(oa.responses.create(model="any", input="Weather?", tools=[RESPONSES_WEATHER],
                                      max_output_tokens=300, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for required in ("response.output_item.added", "response.output_text.delta", "response.output_text.done",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.reasoning_text.delta"):
        assert required in types, required
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me see."
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert json.loads(final.output[2].arguments) == {"city": "Paris", "days": 3, "metric": True}


def test_responses_incomplete_on_max_output_tokens(oa: openai.OpenAI, fake: FakeEngine) -> None:
    fake.script("a long answer")
    response = oa.responses.create(model="any", input="x", max_output_tokens=4)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output_text == "a lo"


# ------------------------------------------------------------------------------------- completions
def test_completions_are_raw(oa: openai.OpenAI, fake: FakeEngine) -> None:
    fake.script("<think>not reasoning here</think> <tool_call>{}</tool_call>")
    result = oa.completions.create(model="any", prompt="Once upon", max_tokens=200, echo=True)
    assert result.choices[0].text == "Once upon<think>not reasoning here</think> <tool_call>{}</tool_call>"
    assert fake.prompts[0] == "Once upon"
    fake.script("streamed text")
    chunks = list(oa.completions.create(model="any", prompt=[79, 110, 99, 101], max_tokens=200, stream=True))
    assert fake.prompts[1] == "Once"
    assert "".join(c.choices[0].text for c in chunks) == "streamed text"
    assert chunks[-1].choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------- agent-shaped bodies
def test_claude_code_shaped_request(server: ServerThread, fake: FakeEngine) -> None:
    fake.script(CALL)
    body = {
        "model": "fake-model", "max_tokens": 2000, "stream": True, "temperature": 1,
        "metadata": {"user_id": "u"}, "context_management": {"edits": []},
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Be concise."}],
        "tools": [{**ANTHROPIC_WEATHER, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                         {"type": "text", "text": "weather?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "sig"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain", "is_error": False},
                                         {"type": "text", "text": "and Paris?"}]},
        ],
    }
    response = httpx.post(f"{server.url}/v1/messages?beta=true", json=body, timeout=30,
                          headers={"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert response.status_code == 200, response.text
    events = [json.loads(data) for _, data in sse_events(response.text)]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    prompt = fake.prompts[0]
    assert prompt.startswith("<|im_start|>system\nYou are Claude Code.\n\nBe concise.\n\n# Tools")
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in prompt
    assert prompt.index("<tool_response>\nrain\n</tool_response>") < prompt.index("and Paris?")
    assert fake.requests[0].max_new_tokens == 2000 and fake.requests[0].sampling.temperature == 1


def test_codex_shaped_request(server: ServerThread, fake: FakeEngine) -> None:
    fake.script("Done.")
    body = {
        "model": "fake-model", "instructions": "You are Codex.", "stream": True, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "text": {"verbosity": "low"}, "tool_choice": "auto",
        "tools": [{"type": "function", "name": "shell", "description": "run", "strict": False,
                   "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}},
                  {"type": "web_search"}],
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: none"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\nb.txt"},
        ],
    }
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert events[-1][0] == "response.completed"
    assert json.loads(events[-1][1])["response"]["output"][0]["content"][0]["text"] == "Done."
    prompt = fake.prompts[0]
    assert prompt.startswith("<|im_start|>system\nYou are Codex.\n\n# Tools")
    assert "<|im_start|>developer\nsandbox: none" in prompt and "web_search" not in prompt
    assert '{"name": "shell", "arguments": {"command": ["ls"]}}' in prompt and "a.txt\nb.txt" in prompt
