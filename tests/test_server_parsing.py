"""Output parsing: tool calls (JSON, XML, coercion, streaming hold-back) and `<think>` splitting."""

from __future__ import annotations

import pytest

from dflash.server.conversation import ToolCall, ToolSpec
from dflash.server.reasoning import ReasoningSplitter
from dflash.server.tool_calls import ToolCallStreamParser, coerce_value, parse_call_body

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "flag": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "integer"}}, "opts": {"type": "object"},
        "name": {"type": "string"}, "maybe": {"type": ["integer", "null"]},
    },
}
TOOLS = {"f": ToolSpec("f", "", SCHEMA)}


def feed_chars(parser: ToolCallStreamParser, text: str) -> list[str | ToolCall]:
    out: list[str | ToolCall] = []
    for ch in text:
        out.extend(parser.feed(ch))
    out.extend(parser.finish())
    return out


def test_json_call_with_coercion() -> None:
    call = parse_call_body(
        '{"name": "f", "arguments": {"n": "3", "x": "2.5", "flag": "false", "tags": "[1, \\"2\\"]", '
        '"opts": "{\\"a\\": 1}", "name": 42, "maybe": "null"}}', TOOLS)
    assert call is not None and call.name == "f"
    assert call.arguments == {"n": 3, "x": 2.5, "flag": False, "tags": [1, 2], "opts": {"a": 1}, "name": "42",
                              "maybe": None}


def test_json_call_variants() -> None:
    as_string = parse_call_body('{"name": "f", "arguments": "{\\"n\\": 1}"}', TOOLS)
    assert as_string is not None and as_string.arguments == {"n": 1}
    parameters = parse_call_body('{"name": "g", "parameters": {"k": "v"}}', TOOLS)
    assert parameters is not None and parameters.arguments == {"k": "v"}
    truncated = parse_call_body('{"name": "f", "arguments": {"n": 1}', TOOLS)  # closing brace missing
    assert truncated is not None and truncated.arguments == {"n": 1}
    not_object = parse_call_body('{"name": "f", "arguments": [1, 2]}', TOOLS)
    assert not_object is not None and not_object.arguments is None and not_object.arguments_json == "[1, 2]"
    assert parse_call_body("just words", TOOLS) is None
    assert parse_call_body('{"arguments": {}}', TOOLS) is None


def test_xml_call() -> None:
    call = parse_call_body(
        "<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=name>\nmulti\nline\n</parameter>\n</function>", TOOLS)
    assert call is not None and call.arguments == {"n": 7, "name": "multi\nline"}


def test_values_that_do_not_convert_are_kept() -> None:
    assert coerce_value("three", {"type": "integer"}) == "three"
    assert coerce_value("3.5", {"type": "integer"}) == "3.5"
    assert coerce_value("4.0", {"type": "integer"}) == 4
    assert coerce_value("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "7"  # already valid
    assert coerce_value({"n": "1"}, {"type": "object", "properties": {"n": {"type": "integer"}}}) == {"n": 1}


def test_stream_parser_holds_back_markup_char_by_char() -> None:
    text = 'Hi <to> there <tool_call>\n{"name": "f", "arguments": {"n": "1"}}\n</tool_call> bye <tool_call>{"name": "f"}</tool_call>'
    parser = ToolCallStreamParser([TOOLS["f"]])
    pieces: list[str | ToolCall] = []
    for ch in text:
        new = parser.feed(ch)
        for piece in new:
            assert not (isinstance(piece, str) and "<tool_call" in piece)
        pieces.extend(new)
    pieces.extend(parser.finish())
    text_out = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    assert text_out == "Hi <to> there  bye "
    assert [c.arguments for c in calls] == [{"n": 1}, {}]


def test_stream_parser_unterminated_and_invalid_calls() -> None:
    cut = feed_chars(ToolCallStreamParser([TOOLS["f"]]), 'ok <tool_call>{"name": "f", "arguments": {"n": 2}}')
    assert "".join(p for p in cut if isinstance(p, str)) == "ok "
    assert isinstance(cut[-1], ToolCall) and cut[-1].arguments == {"n": 2}
    garbage = feed_chars(ToolCallStreamParser([TOOLS["f"]]), "a <tool_call>not json</tool_call> b")
    assert "".join(p for p in garbage if isinstance(p, str)) == "a <tool_call>not json</tool_call> b"  # kept, not lost
    cut_name = feed_chars(ToolCallStreamParser([TOOLS["f"], ToolSpec("fetch")]), '<tool_call>{"name": "fet')
    assert cut_name == ['<tool_call>{"name": "fet']  # a name cut short is no call to an offered tool
    partial = feed_chars(ToolCallStreamParser([TOOLS["f"]]), "ends with <tool_ca")
    assert "".join(p for p in partial if isinstance(p, str)) == "ends with <tool_ca"


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_reasoning_split(chunk: int) -> None:
    text = "\n<think>\nplan it\n</think>\n\nanswer with <think> literal"
    splitter = ReasoningSplitter()
    out = []
    for i in range(0, len(text), chunk):
        out.extend(splitter.feed(text[i : i + chunk]))
    out.extend(splitter.finish())
    reasoning = "".join(t for c, t in out if c == "reasoning")
    content = "".join(t for c, t in out if c == "content")
    assert reasoning == "\nplan it\n"
    assert content == "\n\nanswer with <think> literal"  # the later tag is text


def test_reasoning_when_prompt_opened_the_block() -> None:
    splitter = ReasoningSplitter(starts_in_reasoning=True)
    out = splitter.feed("deep thought</thi") + splitter.feed("nk>result") + splitter.finish()
    assert out == [("reasoning", "deep thought"), ("content", "result")]
    plain = ReasoningSplitter()
    assert plain.feed("no tags") + plain.finish() == [("content", "no tags")]
    off = ReasoningSplitter(enabled=False)
    assert off.feed("<think>x</think>") == [("content", "<think>x</think>")]
