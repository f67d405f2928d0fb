"""Context-overflow errors worded the way each API's own service words them.

Clients act on these words, not just on the status: Claude Code retries with a smaller `max_tokens` when it
reads Anthropic's "input length and `max_tokens` exceed context limit: A + B > C" and compacts the conversation
on "prompt is too long"; LiteLLM and aider map "maximum context length is" / "exceed context limit" to their
context-window error; OpenAI clients read the code `context_length_exceeded`. Every message carries the
figures, so a person reading a log sees what did not fit.
"""

from __future__ import annotations

from typing import Literal

from dflash.server.errors import APIError

API = Literal["chat", "completions", "responses", "anthropic"]
CODE = "context_length_exceeded"


def prompt_too_long(api: API, prompt_tokens: int, limit: int, *, prompt_param: str) -> APIError:
    """The prompt alone leaves no room for a single output token."""
    if api == "anthropic":
        return APIError(400, f"prompt is too long: {prompt_tokens} tokens > {limit - 1} maximum "
                        f"(the context limit is {limit} tokens, output included)", param=prompt_param, code=CODE)
    opening = "Your input exceeds the context window of this model. " if api == "responses" else ""
    return APIError(
        400, f"{opening}This model's maximum context length is {limit} tokens. However, your {_what(api)} "
        f"resulted in {prompt_tokens} tokens, which leaves no room for output. Please reduce the length of the "
        f"{_what(api)}.", param=prompt_param, code=CODE,
    )


def output_does_not_fit(
    api: API, prompt_tokens: int, requested: int, limit: int, *, prompt_param: str, output_param: str
) -> APIError:
    """The prompt fits, but not with the output budget the client asked for."""
    if api == "anthropic":
        return APIError(
            400, f"input length and `{output_param}` exceed context limit: {prompt_tokens} + {requested} > {limit}, "
            f"decrease input length or `{output_param}` and try again", param=output_param, code=CODE,
        )
    opening = "Your input exceeds the context window of this model. " if api == "responses" else ""
    return APIError(
        400, f"{opening}This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + requested} tokens ({prompt_tokens} in the {_what(api)}, {requested} in the "
        f"completion). Please reduce the length of the {_what(api)} or `{output_param}` "
        f"(at most {limit - prompt_tokens} fits).",
        param=prompt_param if api == "responses" else output_param, code=CODE,
    )


def _what(api: API) -> str:
    return {"responses": "input", "completions": "prompt"}.get(api, "messages")
