"""Committed-token sink: applies EOS, max tokens and stop strings one token at a time, and streams text.

Every decoding strategy pushes committed tokens here in order, so a speculative round that commits several
tokens stops exactly where plain decoding would (EOS, the token limit or a stop string inside the block).
Text is streamed with a hold-back: an incomplete UTF-8 sequence, or a tail that may be the start of a stop
string, is only released once it is known to be visible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dflash.generation.request import TokenCallback
from dflash.tokenizer import StreamDecoder

REPLACEMENT = "\ufffd"


class OutputSink:
    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        eos_ids: Sequence[int],
        max_new_tokens: int,
        stop: Sequence[str] = (),
        on_text: TokenCallback | None = None,
    ) -> None:
        self.decode = decode
        self.eos_ids = frozenset(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(s for s in stop if s)
        self.on_text = on_text
        self.token_ids: list[int] = []
        self.text = ""  # visible text released so far
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self._unreleased_ids: list[int] = []
        self._text_ids: list[int] = []  # tokens that produce text (EOS excluded)
        self._stream = StreamDecoder(decode)  # incremental: each push decodes a short window, not the whole
        self._streamed = ""  # the text of the text tokens so far, complete characters only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        """Commit one token; return True once the generation is finished (later pushes are ignored)."""
        if self.finished:
            return True
        self.token_ids.append(token)
        self._unreleased_ids.append(token)
        if token in self.eos_ids:
            self._finish("stop", "eos", self.decode(self._text_ids))
            return True
        self._text_ids.append(token)
        self._streamed += self._stream.push(token)
        full = self._streamed  # decode(text ids), but for an incomplete character at the end (held back)
        for stop in self.stop:
            index = full.find(stop, max(0, len(self.text) - len(stop)))
            if index >= 0:
                self._finish("stop", stop, full[:index])
                return True
        if len(self.token_ids) >= self.max_new_tokens:
            self._finish("length", None, full + self._stream.flush())
            return True
        self._release(self._safe_prefix(full))
        return False

    def push_many(self, tokens: Sequence[int]) -> bool:
        return any(self.push(t) for t in tokens)

    def finish_cancelled(self) -> None:
        if not self.finished:
            self._finish("cancelled", None, self.decode(self._text_ids))

    def _safe_prefix(self, full: str) -> str:
        safe = full.rstrip(REPLACEMENT)
        for stop in self.stop:  # hold back a tail that could still grow into a stop string
            for k in range(min(len(stop) - 1, len(safe)), 0, -1):
                if safe.endswith(stop[:k]):
                    safe = safe[: len(safe) - k]
                    break
        return safe

    def _release(self, visible: str) -> None:
        if len(visible) > len(self.text) and visible.startswith(self.text):
            delta = visible[len(self.text) :]
            self.text = visible
            ids, self._unreleased_ids = self._unreleased_ids, []
            if self.on_text is not None:
                self.on_text(delta, ids)

    def _finish(self, reason: str, stop_reason: str | None, final_text: str) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        final_text = final_text.rstrip(REPLACEMENT) if reason != "length" else final_text
        if final_text.startswith(self.text):
            delta, self.text = final_text[len(self.text) :], final_text
        else:  # cannot happen with a prefix-stable decoder; keep what was released
            delta = ""
        ids, self._unreleased_ids = self._unreleased_ids, []
        if self.on_text is not None and (delta or ids):
            self.on_text(delta, ids)
