"""`<think>...</think>` splitting: reasoning goes to its own channel (OpenAI `reasoning_content`,
Anthropic `thinking` blocks, Responses reasoning items), the rest is the visible answer.

A `<think>` opens reasoning only before any visible text (a literal "<think>" later in an answer, e.g. in
code, stays text). When the prompt itself ends with `<think>` (templates that open the block for the
model), output starts inside reasoning. Partial tags are held back while streaming.
"""

from __future__ import annotations

from typing import Literal

from dflash.server.tool_calls import _partial_suffix

Channel = Literal["content", "reasoning"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ReasoningSplitter:
    def __init__(self, *, starts_in_reasoning: bool = False, enabled: bool = True) -> None:
        self.enabled = enabled
        self._in_reasoning = starts_in_reasoning and enabled
        self._may_open = enabled and not starts_in_reasoning
        self._buffer = ""

    def feed(self, text: str) -> list[tuple[Channel, str]]:
        if not self.enabled:
            return [("content", text)] if text else []
        self._buffer += text
        out: list[tuple[Channel, str]] = []
        while self._buffer:
            if self._in_reasoning:
                index = self._buffer.find(THINK_CLOSE)
                if index >= 0:
                    out.append(("reasoning", self._buffer[:index]))
                    self._buffer, self._in_reasoning = self._buffer[index + len(THINK_CLOSE) :], False
                    continue
                keep = _partial_suffix(self._buffer, THINK_CLOSE)
                out.append(("reasoning", self._buffer[: len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            if self._may_open:
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buffer, self._in_reasoning, self._may_open = stripped[len(THINK_OPEN) :], True, False
                    continue
                if not stripped or THINK_OPEN.startswith(stripped):
                    break  # could still become "<think>"
                self._may_open = False
            out.append(("content", self._buffer))
            self._buffer = ""
        return [(channel, piece) for channel, piece in out if piece]

    def finish(self) -> list[tuple[Channel, str]]:
        rest, self._buffer = self._buffer, ""
        if not rest:
            return []
        return [("reasoning" if self._in_reasoning else "content", rest)]


class WhitespaceTrim:
    """Drops a channel's leading whitespace and holds whitespace-only pieces until visible text follows,
    so that answers do not start with the blank lines after `</think>` or end with those before a call."""

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def push(self, text: str) -> str:
        if not text.strip():
            if self._started:
                self._pending += text
            return ""
        if not self._started:
            self._started = True
            return text.lstrip()
        out, self._pending = self._pending + text, ""
        return out

    def reset_pending(self) -> None:
        """A call was emitted: whitespace between it and the next text is not part of the answer."""
        self._pending = ""
