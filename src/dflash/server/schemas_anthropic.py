"""Request models of the Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`).

Content blocks are a tagged union on `type`, checked field by field. Unknown top-level fields are ignored
rather than refused (the real API refuses them, but agents such as Claude Code send beta-only fields like
`context_management` that a local server has no reason to reject); `cache_control` and `citations` on blocks
are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image"]


class DocumentBlock(_Block):
    type: Literal["document"]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]


class MidConversationSystemBlock(_Block):
    """System instructions at this point of the conversation, as the trailing block(s) of a turn."""

    type: Literal["mid_conv_system"]
    content: str | list[TextBlock]


ContentBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
    | MidConversationSystemBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(_Block):
    role: Literal["user", "assistant", "system"]  # "system": an instruction from this point of the conversation on
    content: str | list[ContentBlock]


class AnthropicTool(_Block):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    strict: bool | None = None  # the input must follow input_schema (enforced when a call is forced)


class AnthropicToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Block):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class _Conversation(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension: passed to the chat template


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    cache_prompt: bool | None = None  # extension: false skips the prefix cache for this request


class CountTokensRequest(_Conversation):
    pass
