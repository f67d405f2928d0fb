"""The bytes every vocabulary token writes, computed once per tokenizer, with lookups by exact bytes and by prefix.

Constraints that work on text (`dflash.generation.constraints`) need each token's own bytes, not a decoded
string: a byte-level BPE token may hold half of a UTF-8 character, and decoding a SentencePiece token alone
drops or keeps its leading space depending on the decoder. So the bytes come from the vocabulary itself:

* byte-level BPE (GPT-2 alphabet, `ByteLevel` decoder): each character of the token maps back to one byte;
* SentencePiece-style (`▁` for a space, `<0xNN>` byte-fallback tokens): `▁` is a space, `<0xNN>` the byte NN;
* anything else: the token decoded alone, when that gives clean text.

Added tokens that are not special (e.g. `<tool_call>` in some vocabularies) write their content; special tokens
(EOS, turn markers) write nothing and are never allowed by a text constraint.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from typing import Any

import tokenizers

_SPM_SPACE = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    found = {str(decoder.get("type"))}
    for inner in decoder.get("decoders") or ():
        found |= _decoder_types(inner)
    return found


def _byte_fallback(piece: str) -> bytes | None:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    return None


class TokenTable:
    """`bytes_of[i]`: what token `i` writes (None: nothing a text constraint may allow), for `vocab_size` ids."""

    def __init__(self, bytes_of: Sequence[bytes | None], vocab_size: int | None = None) -> None:
        self.vocab_size = max(vocab_size or 0, len(bytes_of))
        self.bytes_of: list[bytes | None] = [b if b else None for b in bytes_of]
        by_bytes: dict[bytes, list[int]] = {}
        for token, data in enumerate(self.bytes_of):
            if data is not None:
                by_bytes.setdefault(data, []).append(token)
        self.by_bytes = by_bytes
        self._sorted = sorted(by_bytes)  # distinct byte strings, for prefix ranges

    @classmethod
    def from_tokenizer(cls, backend: tokenizers.Tokenizer, vocab_size: int | None = None) -> TokenTable:
        """The table of a `tokenizers.Tokenizer` (see the module docstring for how each kind is read)."""
        spec = json.loads(backend.to_str())
        size = backend.get_vocab_size(with_added_tokens=True)
        added = {int(t["id"]): t for t in spec.get("added_tokens") or ()}
        kinds = _decoder_types(spec.get("decoder"))
        byte_level = "ByteLevel" in kinds
        sentencepiece = not byte_level and ("ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds)
        alphabet = _byte_level_alphabet() if byte_level else {}
        table: list[bytes | None] = [None] * size
        for token in range(size):
            if token in added:
                entry = added[token]
                table[token] = None if entry.get("special") else str(entry["content"]).encode()
                continue
            piece = backend.id_to_token(token)
            if piece is None:
                continue
            if byte_level:
                if all(ch in alphabet for ch in piece):
                    table[token] = bytes(alphabet[ch] for ch in piece)
            elif sentencepiece:
                table[token] = _byte_fallback(piece) or piece.replace(_SPM_SPACE, " ").encode()
            else:
                text = backend.decode([token], skip_special_tokens=False)
                table[token] = text.encode() if "\ufffd" not in text else None
        return cls(table, vocab_size)

    def exactly(self, data: bytes) -> list[int]:
        """Tokens whose bytes are `data`."""
        return self.by_bytes.get(data, [])

    def starting_with(self, prefix: bytes) -> list[int]:
        """Tokens whose bytes start with `prefix` (equal included)."""
        out: list[int] = []
        index = bisect.bisect_left(self._sorted, prefix)
        while index < len(self._sorted) and self._sorted[index].startswith(prefix):
            out.extend(self.by_bytes[self._sorted[index]])
            index += 1
        return out
