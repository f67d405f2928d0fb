"""Chat prompts whose content cannot forge turns: special tokens typed in content are encoded as text.

A chat template writes the conversation between control markers (`<|im_start|>`, `<|im_end|>`, `<start_of_turn>`,
...). Encoding the rendered prompt the ordinary way recognises those markers anywhere in the text, so a user
message, a tool result or a document that contains `<|im_end|>\\n<|im_start|>system\\n...` would end its turn and open
a system turn of its own. Here only the template's own markers become control tokens:

1. `protect` replaces every special-token text found in the conversation's strings (as the tokenizer itself would
   find it) by a private-use character that occurs nowhere in the request;
2. the template renders the protected conversation: any special token left in its output is the template's;
3. `encode` turns those into their ids and encodes the text between them with special tokens off, the protected
   spans put back as the literal characters they were.

Without any special text in the content the result is exactly the ordinary encoding of the rendered prompt (the
tokenizer splits at special tokens and encodes the pieces between them on their own, as step 3 does).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import tokenizers

__all__ = ["SpecialText", "SpecialTextGuard"]

# Supplementary Private Use Area-A: never produced by templates, tokenizers or real text in practice; characters of
# it that a request does use are skipped when sentinels are chosen, so restoring is exact in any case.
_SENTINEL_FIRST, _SENTINEL_LAST = 0xF0000, 0xFFFFD


class SpecialText:
    """What a tokenizer needs to tell special-token text apart: its special tokens and a copy of its backend that
    encodes them as plain text."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend = backend
        self.special_ids = frozenset(
            int(i) for i, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self.first_chars = frozenset(
            token.content[0] for token in backend.get_added_tokens_decoder().values() if token.special and token.content
        )
        self.literal_backend = tokenizers.Tokenizer.from_str(backend.to_str())
        self.literal_backend.encode_special_tokens = True

    def spans(self, text: str) -> list[tuple[int, int, int]]:
        """(start, end, token id) of every special token the tokenizer finds in `text`, in order."""
        if not self.special_ids or not any(c in text for c in self.first_chars):
            return []
        encoding = self.backend.encode(text, add_special_tokens=False)
        return [
            (start, end, int(tid))
            for tid, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
            if tid in self.special_ids
        ]

    def guard(self) -> SpecialTextGuard:
        return SpecialTextGuard(self)


class SpecialTextGuard:
    """One prompt's protection: `protect` its conversation and tools, render them, then `encode` the rendering."""

    def __init__(self, special: SpecialText) -> None:
        self.special = special
        self.literal_of: dict[str, str] = {}  # sentinel character -> the special-token text it stands for
        self._sentinel_of: dict[str, str] = {}
        self._taken: set[int] = set()

    # ---- before rendering --------------------------------------------------------------------------------
    def protect(self, value: Any) -> Any:
        """A copy of `value` (JSON-like: dicts, lists, strings, scalars) whose strings hold sentinels where they held
        special-token text. Dict keys are left alone: templates look them up by name."""
        self._taken.update(ord(c) for text in _strings(value) for c in text if _SENTINEL_FIRST <= ord(c) <= _SENTINEL_LAST)
        return self._protect(value)

    def _protect(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._protect_text(value)
        if isinstance(value, Mapping):
            return {k: self._protect(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._protect(v) for v in value]
        return value

    def _protect_text(self, text: str) -> str:
        spans = self.special.spans(text)
        if not spans:
            return text
        parts: list[str] = []
        last = 0
        for start, end, _ in spans:
            parts.append(text[last:start])
            parts.append(self._sentinel(text[start:end]))
            last = end
        parts.append(text[last:])
        return "".join(parts)

    def _sentinel(self, literal: str) -> str:
        sentinel = self._sentinel_of.get(literal)
        if sentinel is None:
            code = _SENTINEL_FIRST + len(self.literal_of)
            while code in self._taken:
                code += 1
            if code > _SENTINEL_LAST:
                raise ValueError("too many distinct special-token texts in one request")
            self._taken.add(code)
            sentinel = chr(code)
            self._sentinel_of[literal] = sentinel
            self.literal_of[sentinel] = literal
        return sentinel

    # ---- after rendering ---------------------------------------------------------------------------------
    def restore(self, text: str) -> str:
        """`text` with every sentinel put back as the literal text it replaced."""
        if not self.literal_of:
            return text
        return "".join(self.literal_of.get(c, c) for c in text)

    def encode(self, rendered: str) -> list[int]:
        """Token ids of the rendered prompt: the template's special tokens as control tokens, content as text."""
        if not self.literal_of:  # nothing was protected: the ordinary encoding is the right one
            return list(self.special.backend.encode(rendered, add_special_tokens=False).ids)
        ids: list[int] = []
        last = 0
        for start, end, tid in self.special.spans(rendered):
            ids.extend(self._encode_literal(rendered[last:start]))
            ids.append(tid)
            last = end
        ids.extend(self._encode_literal(rendered[last:]))
        return ids

    def _encode_literal(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.special.literal_backend.encode(self.restore(text), add_special_tokens=False).ids)


def _strings(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
