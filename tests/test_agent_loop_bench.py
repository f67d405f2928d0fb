"""The agent-loop benchmark's parts: transcript reading (Claude Code JSONL and OpenAI-style lists), the synthetic
session generator, usage-less streams, and the whole `dflash bench agent-loop` / `prefix-repro` commands against a
real loopback server with the prefix cache (default model, small budgets)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash.bench.chat_stream import _Accumulator
from dflash.bench.synthetic_session import PER_MESSAGE_TOKENS, TOOLS_TOKENS, SessionShape, synthetic_session
from dflash.bench.transcript import from_claude_code, load_transcript
from dflash.cli import main
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import load_engine
from dflash.server import ServerSettings, create_app
from tests.server_helpers import ServerThread, serving

pytestmark = pytest.mark.timeout(240)


def chars(text: str) -> int:
    return max(1, len(text) // 4)


def claude_code_records() -> list[dict[str, object]]:
    def record(kind: str, message: dict[str, object], **extra: object) -> dict[str, object]:
        return {"type": kind, "uuid": "u", "parentUuid": None, "sessionId": "s", "message": message, **extra}

    call = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}
    return [
        {"type": "summary", "summary": "an earlier session"},
        record("user", {"role": "user", "content": "List the files."}),
        record("assistant", {"id": "m1", "role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}),
        record("assistant", {"id": "m1", "role": "assistant", "content": [{"type": "text", "text": "Listing."}]}),
        record("assistant", {"id": "m1", "role": "assistant", "content": [call]}),
        record("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                     "content": [{"type": "text", "text": "a.py\nb.py"}]}]}),
        record("user", {"role": "user", "content": [{"type": "text", "text": "And the tests?"}]}),
        record("assistant", {"role": "assistant", "content": [{"type": "text", "text": "side"}]}, isSidechain=True),
        record("assistant", {"role": "assistant", "model": "<synthetic>", "content": [{"type": "text", "text": "API Error"}]}),
        record("assistant", {"id": "m2", "role": "assistant", "content": [{"type": "text", "text": "Two files."}]}),
        {"type": "file-history-snapshot", "snapshot": {}},
    ]


def test_claude_code_records_become_chat_messages() -> None:
    transcript = from_claude_code(claude_code_records())
    assert transcript.messages == [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "Listing.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py\nb.py"},
        {"role": "user", "content": "And the tests?"},
        {"role": "assistant", "content": "Two files."},
    ]
    assert [len(prefix) for prefix in transcript.calls()] == [1, 4]
    assert transcript.tools[0]["function"]["name"] == "Bash"
    assert transcript.tools[0]["function"]["parameters"]["properties"] == {"command": {"type": "string"}}


def test_openai_style_files_are_read_in_every_layout(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    (tmp_path / "list.json").write_text(json.dumps(messages))
    (tmp_path / "object.json").write_text(json.dumps({"messages": messages, "tools": tools}))
    (tmp_path / "lines.jsonl").write_text("".join(json.dumps(m) + "\n" for m in messages))
    for name, expected_tools in (("list.json", []), ("object.json", tools), ("lines.jsonl", [])):
        transcript = load_transcript(tmp_path / name)
        assert transcript.format == "openai" and transcript.messages == messages and transcript.tools == expected_tools
        assert transcript.calls() == [messages[:2]]


def test_synthetic_session_grows_within_its_budget() -> None:
    shape = SessionShape(max_prefix_tokens=3000, first_output_tokens=100, growth=1.5, max_output_tokens=400, seed=3)
    records = synthetic_session(shape, chars)
    assert records == synthetic_session(shape, chars)  # deterministic for a seed
    transcript = from_claude_code(records)
    assert transcript.format == "claude-code"
    sizes = [chars(m["content"]) for m in transcript.messages if m["role"] == "tool"]
    assert len(sizes) >= 4 and max(sizes) > 2 * sizes[0] and max(sizes) <= 400 * 1.1
    last = transcript.calls()[-1]
    content = sum(chars(m["content"]) + sum(chars(c["function"]["arguments"]) for c in m.get("tool_calls", []))
                  for m in last)
    assert content + TOOLS_TOKENS + PER_MESSAGE_TOKENS * len(last) <= 3000
    assert content > 1800  # it got close to the budget
    assert {t["function"]["name"] for t in transcript.tools} == {"Read", "Bash", "Grep", "Edit"}


def test_a_stream_without_usage_counts_output_deltas() -> None:
    acc = _Accumulator(started=0.0)
    for piece in ("Hel", "lo", ""):
        acc.chunk({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
    acc.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]},
                            "finish_reason": "tool_calls"}], "timings": {"acceptance_length": 2.5}})
    record = acc.record(ended=1.0)
    assert not record.usage_reported and record.prompt_tokens is None and record.cached_tokens is None
    assert record.completion_tokens == 3 and record.text == "Hello" and record.finish_reason == "tool_calls"
    assert record.answer() == 'Hello\n<call f {}>' and not record.empty
    assert record.as_dict()["acceptance_length"] == 2.5
    assert _Accumulator(started=0.0).record(ended=1.0).empty


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    # every round speculative: cold and warm calls' acceptance are compared
    engine = load_engine("default", options=EngineOptions(prefill_chunk=32, prefix_cache_mb=128, always_speculate=True))
    with serving(create_app(engine, ServerSettings())) as running:
        yield running


def test_agent_loop_command_replays_cold_and_warm(server: ServerThread, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    session, out = tmp_path / "session.jsonl", tmp_path / "result.json"
    assert main(["bench", "agent-session", "--out", str(session), "--max-prefix-tokens", "1400",
                 "--first-output-tokens", "100", "--max-output-tokens", "150"]) == 0
    assert main(["bench", "agent-loop", "--transcript", str(session), "--base-url", server.url, "--max-tokens", "6",
                 "--long-prefix-tokens", "900", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows, totals = result["calls"], result["totals"]
    assert len(rows) == len(load_transcript(session).calls()) >= 3
    assert all(r["cold"]["cached_tokens"] == 0 for r in rows)  # cold calls switch the cache off
    assert all(r["warm"]["cached_tokens"] > 0 for r in rows[1:])  # warm calls reuse the previous prompt
    assert totals["identical_answers"] == len(rows) and totals["empty_answers"] == {"cold": 0, "warm": 0}
    assert totals["long_prefix"]["calls"] >= 1 and result["command"].startswith("dflash bench agent-loop")
    assert all(r["warm"]["ttft_s"] > 0 and r["warm"]["usage_reported"] for r in rows)
    acceptance = totals["acceptance_length"]  # from the server's timings: the cache leaves the drafts alone
    assert acceptance["warm"] is not None and acceptance["warm"] == acceptance["cold"]
    table = capsys.readouterr().out
    assert "warm/cold" in table and f"identical answers {len(rows)}/{len(rows)}" in table


def test_prefix_repro_passes_on_a_sound_cache(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "prefix-repro", "--base-url", server.url, "--calls", "3", "--max-tokens", "6",
                 "--max-prefix-tokens", "1500", "--compare-cold", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["passed"] and len(result["calls"]) == 3
    assert all(row["cached_tokens"] > 0 and row["same_as_cold"] for row in result["calls"][1:])
