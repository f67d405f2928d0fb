"""Committed-token sink: applies EOS, max tokens and stop strings one token at a time, and streams text.

Every decoding strategy pushes committed tokens here in order, so a speculative round that commits several
tokens stops exactly where plain decoding would (EOS, the token limit or a stop string inside the block).
Text is streamed with a hold-back: an incomplete UTF-8 sequence, or a tail that may be the start of a stop
string, is only released once it is known to be visible. A token's cost does not grow with the output: each push
decodes a short window of ids and looks at the new text and a short tail of the released text only.
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
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self._unreleased_ids: list[int] = []
        self._text_ids: list[int] = []  # tokens that produce text (EOS excluded)
        self._stream = StreamDecoder(decode)  # incremental: each push decodes a short window, not the whole
        # The streamed text (complete characters) is the released text followed by `_pending`. Each push looks at
        # the new text and a tail of the released text only, so a token costs the same at any output length: a
        # stop string may begin in the tail (it holds every stop string's length, summed, so that holding back a
        # stop string's prefix sees what the whole text would show), never further back.
        self._released: list[str] = []  # the released text, in pieces (joined when `text` is read)
        self._released_length = 0
        self._joined: str | None = ""  # "".join(_released), while current
        self._tail_length = sum(len(s) for s in self.stop)
        self._tail = ""  # the released text's last `_tail_length` characters
        self._pending = ""  # streamed, not released yet (an incomplete stop string, a trailing U+FFFD)
        # per stop string: its proper prefixes' lengths by their last character, longest first
        self._prefix_ends = [_prefix_ends(stop) for stop in self.stop]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The visible text released so far."""
        if self._joined is None:
            self._joined = "".join(self._released)
            self._released = [self._joined]
        return self._joined

    def push(self, token: int) -> bool:
        """Commit one token; return True once the generation is finished (later pushes are ignored)."""
        if self.finish_reason is not None:
            return True
        self.token_ids.append(token)
        self._unreleased_ids.append(token)
        if token in self.eos_ids:
            self._finish("stop", "eos", self.decode(self._text_ids))
            return True
        self._text_ids.append(token)
        piece = self._stream.push(token)
        if piece:
            self._pending += piece
            if self.stop and self._stop_found():
                return True
        if len(self.token_ids) >= self.max_new_tokens:
            self._finish("length", None, self.text + self._pending + self._stream.flush())
            return True
        if piece:  # without new text the held-back text stays held back
            self._release_visible()
        return False

    def push_many(self, tokens: Sequence[int]) -> bool:
        """Commit several tokens in order (a round's); True once the generation is finished. Without stop strings
        they are taken at once: the EOS and the token limit cut them as one push each would, and their text is
        decoded as one window (`StreamDecoder.push_complete`) and released in one piece; with stop strings, or text
        ending in an incomplete character, one push each."""
        if self.finish_reason is not None:
            return True
        if len(tokens) < 2 or self.stop:
            return any(self.push(t) for t in tokens)
        taken = list(tokens[: self.max_new_tokens - len(self.token_ids)])
        ends = next((index for index, token in enumerate(taken) if token in self.eos_ids), None)
        if ends is not None:  # the EOS ends it: its text need not stream first
            taken = taken[: ends + 1]
            self.token_ids += taken
            self._unreleased_ids += taken
            self._text_ids += taken[:-1]
            self._finish("stop", "eos", self.decode(self._text_ids))
            return True
        piece = self._stream.push_complete(taken)
        if piece is None:
            return any(self.push(t) for t in tokens)
        self.token_ids += taken
        self._unreleased_ids += taken
        self._text_ids += taken
        self._pending += piece
        if len(self.token_ids) >= self.max_new_tokens:
            self._finish("length", None, self.text + self._pending + self._stream.flush())
            return True
        if piece:
            self._release_visible()
        return False

    def finish_cancelled(self) -> None:
        if not self.finished:
            self._finish("cancelled", None, self.decode(self._text_ids))

    def _stop_found(self) -> bool:
        """End at the first stop string (in `stop` order) found from len(stop) characters before the released
        text's end on; True if one was."""
        window = self._tail + self._pending  # the streamed text from `offset` on
        offset = self._released_length - len(self._tail)
        for stop in self.stop:
            index = window.find(stop, max(0, self._released_length - len(stop)) - offset)
            if index >= 0:
                self._finish("stop", stop, (self.text + self._pending)[: offset + index])
                return True
        return False

    def _release_visible(self) -> None:
        """Release the pending text but for a trailing U+FFFD (an incomplete character) and a tail that could still
        grow into a stop string."""
        window = self._tail + self._pending
        safe = window.rstrip(REPLACEMENT)
        for stop, prefix_ends in zip(self.stop, self._prefix_ends, strict=True):
            # hold back the longest tail that is a prefix of the stop string (it could still grow into it): only
            # the prefixes ending in the text's last character can match
            for k in prefix_ends.get(safe[-1], ()) if safe else ():
                if k <= len(safe) and safe.endswith(stop[:k]):
                    safe = safe[: len(safe) - k]
                    break
        if len(safe) <= len(self._tail):
            return
        delta = safe[len(self._tail) :]
        self._pending = self._pending[len(delta) :]
        self._append_released(delta)
        ids, self._unreleased_ids = self._unreleased_ids, []
        if self.on_text is not None:
            self.on_text(delta, ids)

    def _append_released(self, delta: str) -> None:
        self._released.append(delta)
        self._released_length += len(delta)
        self._joined = None
        if self._tail_length:
            self._tail = (self._tail + delta)[-self._tail_length :]

    def _finish(self, reason: str, stop_reason: str | None, final_text: str) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        final_text = final_text.rstrip(REPLACEMENT) if reason != "length" else final_text
        released = self.text
        if final_text.startswith(released):
            delta = final_text[len(released) :]
            self._released, self._released_length, self._joined = [final_text], len(final_text), final_text
        else:  # cannot happen with a prefix-stable decoder; keep what was released
            delta = ""
        self._pending = ""
        ids, self._unreleased_ids = self._unreleased_ids, []
        if self.on_text is not None and (delta or ids):
            self.on_text(delta, ids)


def _prefix_ends(stop: str) -> dict[str, tuple[int, ...]]:
    """{character: the lengths k < len(stop) whose prefix stop[:k] ends in it, longest first}."""
    ends: dict[str, list[int]] = {}
    for k in range(len(stop) - 1, 0, -1):
        ends.setdefault(stop[k - 1], []).append(k)
    return {char: tuple(lengths) for char, lengths in ends.items()}
