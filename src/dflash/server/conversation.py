"""The API-neutral conversation every endpoint translates to: messages, tools, tool calls, tool choice."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call; `parameters` is its JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    strict: bool = False  # arguments must follow `parameters` exactly (OpenAI `strict: true`)

    def template_dict(self) -> dict[str, Any]:
        """The Hugging Face chat-template convention."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] | None  # None: the model wrote arguments that are not a JSON object
    id: str = field(default_factory=lambda: new_id("call_"))
    raw_arguments: str = ""  # what the model wrote, kept when it is not an object

    @property
    def arguments_json(self) -> str:
        if self.arguments is None:
            return self.raw_arguments
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Message:
    role: str  # system | developer | user | assistant | tool
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None  # with mode "named"


def parse_arguments(text: str) -> dict[str, Any] | None:
    """Arguments sent back by a client as a JSON string (OpenAI, Responses) -> an object, or None."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
