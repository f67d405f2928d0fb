"""Agent session transcripts as OpenAI chat messages, and the calls an agent made during the session.

Two formats are read:
- Claude Code JSONL (one record per line, `type` "user" / "assistant" with an Anthropic-style `message`):
  consecutive records of the same role are coalesced (Claude Code writes one record per content block);
  `tool_use` blocks become assistant `tool_calls`, `tool_result` blocks become `tool` messages, thinking is
  dropped; side-chain (sub-agent) records and other record types (summaries, snapshots, system events) are
  skipped.
- OpenAI-style message lists: a JSON list of messages, a JSON object with `messages` (and optionally `tools`),
  or JSONL with one message per line.

`Transcript.calls()` gives, for every assistant turn, exactly the messages that preceded it: the prefix the agent
sent when the model produced that turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.errors import DFlashError

Message = dict[str, Any]


@dataclass
class Transcript:
    messages: list[Message]  # OpenAI chat messages
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool definitions
    source: str = ""
    format: str = ""  # "claude-code" | "openai"

    def calls(self) -> list[list[Message]]:
        """The prefix sent before each assistant turn (turns with nothing before them are skipped)."""
        return [self.messages[:i] for i, m in enumerate(self.messages) if m["role"] == "assistant" and i > 0]


def load_transcript(path: Path) -> Transcript:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DFlashError(f"{path}: {exc.strerror or exc}") from None
    stripped = text.lstrip()
    if stripped.startswith("[") or (stripped.startswith("{") and _is_single_json(stripped)):
        return from_openai(json.loads(stripped), source=str(path))
    records = [_json_line(line, path, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if records and all("role" in r and "type" not in r for r in records):
        return from_openai(records, source=str(path))
    return from_claude_code(records, source=str(path))


def from_openai(data: Any, *, source: str = "") -> Transcript:
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DFlashError(f"{source}: expected a list of chat messages (or an object with 'messages')")
    tools = (data.get("tools") or []) if isinstance(data, dict) else []
    return Transcript(list(messages), list(tools), source, "openai")


def from_claude_code(records: Iterable[dict[str, Any]], *, source: str = "") -> Transcript:
    groups: list[tuple[str, list[Any]]] = []  # (role, content blocks) of consecutive same-role records
    for record in records:
        if record.get("type") not in ("user", "assistant") or record.get("isSidechain"):
            continue
        message = record.get("message") or {}
        if message.get("model") == "<synthetic>":  # locally made error notices, never sent by the model
            continue
        role = message.get("role") or record["type"]
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        if groups and groups[-1][0] == role:
            groups[-1][1].extend(blocks)
        else:
            groups.append((role, blocks))
    messages: list[Message] = []
    for role, blocks in groups:
        messages.extend(_assistant_message(blocks) if role == "assistant" else _user_messages(blocks))
    if not messages:
        raise DFlashError(f"{source}: no user or assistant records found")
    return Transcript(messages, tools_from_calls(messages), source, "claude-code")


def tools_from_calls(messages: list[Message]) -> list[dict[str, Any]]:
    """Tool definitions for the tools a transcript calls (Claude Code transcripts do not record them): each
    takes the argument names seen in its calls, as strings."""
    seen: dict[str, dict[str, Any]] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            name = call["function"]["name"]
            arguments = json.loads(call["function"]["arguments"] or "{}")
            properties = seen.setdefault(name, {})
            for key in arguments if isinstance(arguments, dict) else {}:
                properties.setdefault(key, {"type": "string"})
    return [
        {"type": "function", "function": {"name": name, "description": f"The {name} tool.",
                                          "parameters": {"type": "object", "properties": props}}}
        for name, props in seen.items()
    ]


def _assistant_message(blocks: list[Any]) -> list[Message]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or f"call_{len(calls)}", "type": "function", "function": {
                "name": block.get("name") or "tool", "arguments": json.dumps(block.get("input") or {})}})
        # thinking and redacted_thinking blocks are dropped: agents do not resend them as text
    message: Message = {"role": "assistant", "content": "\n\n".join(t for t in texts if t)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _user_messages(blocks: list[Any]) -> list[Message]:
    """Tool results first (they answer the preceding assistant calls), then any user text."""
    results: list[Message] = []
    texts: list[str] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                            "content": _result_text(block.get("content"))})
        elif kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "image":
            texts.append("[image]")
    return results + ([{"role": "user", "content": "\n\n".join(texts)}] if texts else [])


def _result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for item in content or []:
        if isinstance(item, dict) and item.get("type") == "text":
            parts.append(item.get("text") or "")
        elif isinstance(item, dict) and item.get("type") == "image":
            parts.append("[image]")
    return "\n".join(parts)


def _is_single_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _json_line(line: str, path: Path, number: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DFlashError(f"{path}:{number}: not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise DFlashError(f"{path}:{number}: expected a JSON object per line")
    return record
