"""Synthetic agent sessions in the Claude Code JSONL format, for the agent-loop benchmark and the reproducer.

A session opens with a user message carrying project instructions (as Claude Code sends CLAUDE.md, inside a
system reminder) and a task, then alternates assistant turns (thinking, a sentence, one tool call: Read, Bash,
Grep or Edit, each block in its own record sharing the message id, as Claude Code writes them) with tool results
whose size grows by `growth` per step up to `max_output_tokens`; the last output is cut to what is left of
`max_prefix_tokens`, and a text-only assistant turn ends the session.

Token counts are estimates (message contents through the model's tokenizer, plus a fixed allowance per message
and for the tool definitions the replay derives); the replay reports the exact counts. Keep the largest prefix
plus the replay's max tokens inside the model's context: about 8,000 for the default model (8,192 positions),
up to 16,000 and more only for models with a longer context.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CountTokens = Callable[[str], int]

PER_MESSAGE_TOKENS = 24  # role markers, separators and tool-call wrappers of one rendered message (measured)
TOOLS_TOKENS = 300  # the four derived tool definitions, the tool instructions and a default system prompt (measured)
LINE_SLACK_TOKENS = 40  # an output may pass its size by up to one line
TOOLS = ("Read", "Bash", "Grep", "Edit")
WORDS = ("parse", "token", "cache", "block", "route", "queue", "score", "index", "merge", "split", "load", "store",
         "batch", "frame", "state", "event", "retry", "limit", "shape", "width", "plan", "draft", "commit", "scan")


@dataclass(frozen=True)
class SessionShape:
    max_prefix_tokens: int = 7900  # estimated prompt tokens of the last call
    first_output_tokens: int = 150
    growth: float = 1.3
    max_output_tokens: int = 700
    seed: int = 0


def synthetic_session(shape: SessionShape, count_tokens: CountTokens) -> list[dict[str, Any]]:
    """Claude Code records of one session (a list of JSON objects, one per JSONL line)."""
    writer = _RecordWriter(random.Random(shape.seed), shape.seed)
    text = _instructions(writer.rng)
    writer.user(text)
    prefix = TOOLS_TOKENS + PER_MESSAGE_TOKENS + count_tokens(text)
    step = 0
    last = False
    while not last:
        tool = TOOLS[step % len(TOOLS)]
        sentence, tool_input = _action(writer.rng, tool, step)
        call_tokens = count_tokens(sentence) + count_tokens(json.dumps(tool_input)) + 2 * PER_MESSAGE_TOKENS
        output_tokens = int(min(shape.max_output_tokens, shape.first_output_tokens * shape.growth**step))
        room = shape.max_prefix_tokens - prefix - call_tokens - LINE_SLACK_TOKENS
        if output_tokens > room:  # the last step: its output fills what is left of the budget
            output_tokens, last = room, True
            if room < shape.first_output_tokens:
                break
        output = _tool_output(writer.rng, tool, tool_input, output_tokens, count_tokens)
        call_id = writer.assistant_call(sentence, tool, tool_input)
        writer.tool_result(call_id, output)
        prefix += call_tokens + count_tokens(output)
        step += 1
    writer.assistant_text("The failing test came from the cache key ignoring the block index; the fix is in place "
                          "and the whole suite passes.")
    return writer.records


class _RecordWriter:
    """Claude Code's record envelope: uuid chain, session id, timestamps, working directory."""

    def __init__(self, rng: random.Random, seed: int) -> None:
        self.rng = rng
        self.session = str(uuid.UUID(int=rng.getrandbits(128)))
        self.records: list[dict[str, Any]] = []
        self.parent: str | None = None
        self.seed = seed

    def _envelope(self, kind: str, message: dict[str, Any]) -> dict[str, Any]:
        record_id = str(uuid.UUID(int=self.rng.getrandbits(128)))
        record = {
            "parentUuid": self.parent, "isSidechain": False, "userType": "external", "cwd": "/home/dev/project",
            "sessionId": self.session, "version": "2.0.0", "gitBranch": "main", "type": kind, "message": message,
            "uuid": record_id, "timestamp": f"2026-01-01T10:{len(self.records) // 60:02d}:{len(self.records) % 60:02d}.000Z",
        }
        self.parent = record_id
        self.records.append(record)
        return record

    def user(self, text: str) -> None:
        self._envelope("user", {"role": "user", "content": text})

    def tool_result(self, call_id: str, output: str) -> None:
        record = self._envelope("user", {"role": "user", "content": [
            {"tool_use_id": call_id, "type": "tool_result", "content": output}]})
        record["toolUseResult"] = {"stdout": output[:200], "stderr": "", "interrupted": False}

    def assistant_call(self, sentence: str, tool: str, tool_input: dict[str, Any]) -> str:
        message_id = f"msg_{self.rng.getrandbits(64):016x}"
        call_id = f"toolu_{self.rng.getrandbits(64):016x}"
        thinking = {"type": "thinking", "thinking": f"I should use {tool} next.", "signature": "c2lnbmF0dXJl"}
        for block in (thinking, {"type": "text", "text": sentence},
                      {"type": "tool_use", "id": call_id, "name": tool, "input": tool_input}):
            self._envelope("assistant", self._assistant(message_id, block, "tool_use"))
        return call_id

    def assistant_text(self, text: str) -> None:
        message_id = f"msg_{self.rng.getrandbits(64):016x}"
        self._envelope("assistant", self._assistant(message_id, {"type": "text", "text": text}, "end_turn"))

    @staticmethod
    def _assistant(message_id: str, block: dict[str, Any], stop: str) -> dict[str, Any]:
        return {"id": message_id, "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
                "content": [block], "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}


def _instructions(rng: random.Random) -> str:
    rules = "\n".join(f"- Keep {rng.choice(WORDS)}_{rng.choice(WORDS)} functions pure; test them in "
                      f"tests/test_{rng.choice(WORDS)}.py before committing." for _ in range(24))
    return (
        "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
        "# claudeMd\nContents of /home/dev/project/CLAUDE.md (project instructions, checked into the codebase):\n\n"
        f"# Project rules\n{rules}\n</system-reminder>\n"
        "The test suite fails since yesterday's merge (tests/test_cache.py::test_block_keys). Find the cause, fix "
        "it, and run the whole suite."
    )


def _action(rng: random.Random, tool: str, step: int) -> tuple[str, dict[str, Any]]:
    module = f"src/project/{rng.choice(WORDS)}_{step}.py"
    if tool == "Read":
        return f"Let me read {module}.", {"file_path": f"/home/dev/project/{module}"}
    if tool == "Bash":
        return "Let me run the failing tests.", {"command": "python -m pytest -x -q tests/", "description": "Run tests"}
    if tool == "Grep":
        word = rng.choice(WORDS)
        return f"Let me find where {word} keys are built.", {"pattern": f"def {word}_", "path": "src/"}
    return f"I will fix the key in {module}.", {"file_path": f"/home/dev/project/{module}",
                                                 "old_string": "key = hash(tokens)",
                                                 "new_string": "key = hash((index, tokens))"}


def _tool_output(rng: random.Random, tool: str, tool_input: dict[str, Any], tokens: int, count: CountTokens) -> str:
    """Lines of a plausible tool output until about `tokens` tokens."""
    line_maker = {"Read": _source_line, "Bash": _test_line, "Grep": _grep_line, "Edit": _source_line}[tool]
    lines: list[str] = []
    used = 0
    if tool == "Edit":
        lines.append(f"The file {tool_input['file_path']} has been updated. Here's the result of running `cat -n` "
                     "on a snippet of the edited file:")
    while used < tokens:
        line = line_maker(rng, len(lines) + 1)
        lines.append(line)
        used += count(line) + 1
    return "\n".join(lines)


def _source_line(rng: random.Random, number: int) -> str:
    a, b = rng.choice(WORDS), rng.choice(WORDS)
    body = rng.choice((
        f"def {a}_{b}(items, limit={rng.randint(1, 64)}):",
        f"    {a} = [x for x in items if x.{b} < limit]",
        f"    return {a}_{b}({a}, limit - {rng.randint(1, 9)})",
        f"class {a.capitalize()}{b.capitalize()}:",
        f"    # {a} before {b}: the order matters for the {rng.choice(WORDS)} step",
        f"    self.{a} = {{k: v for k, v in {b}.items() if v}}",
    ))
    return f"{number:>6}\u2192{body}"


def _test_line(rng: random.Random, number: int) -> str:
    a, b = rng.choice(WORDS), rng.choice(WORDS)
    return rng.choice((
        f"tests/test_{a}.py::test_{a}_{b} PASSED",
        f"tests/test_{a}.py::test_{b}_{number} PASSED",
        f"tests/test_cache.py::test_{a}_keys FAILED - AssertionError: {rng.randint(100, 999)} != {rng.randint(100, 999)}",
        f"E       assert {a}_{b}(block) == expected[{number}]",
    ))


def _grep_line(rng: random.Random, number: int) -> str:
    a, b = rng.choice(WORDS), rng.choice(WORDS)
    return f"src/project/{a}_{rng.randint(0, 30)}.py:{number * 7}:def {a}_{b}(self, {b}, {rng.choice(WORDS)}):"
