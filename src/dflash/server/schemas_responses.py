"""Request models of the OpenAI Responses API (`/v1/responses`, the API Codex speaks).

Input items are checked one by one (`input_item`), so an error names the item (`input.3.call_id: ...`).
Unknown top-level fields (`store`, `include`, `prompt_cache_key`, `reasoning`...) are ignored; `text` (its answer
format) is read by `dflash.server.response_format`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputContent(_Lenient):
    type: str
    text: str | None = None


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContent]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = ""


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputContent]


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[InputContent] = []
    content: list[InputContent] | None = None


class ResponsesTool(_Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stream: bool = False
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_prompt: bool | None = None  # extension: false skips the prefix cache for this request
