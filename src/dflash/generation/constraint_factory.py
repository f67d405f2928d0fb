"""Constraints for one model: its token table and its grammar vocabulary, each built once, on first use.

The engine owns one `ConstraintFactory` (`Engine.constraints`); the server asks it for the constraints of a
turn. Building a table reads the whole vocabulary (a fraction of a second for 50k tokens), so it is cached.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from dflash.generation.constraints import OneOfConstraint
from dflash.generation.grammar import GrammarConstraint, GrammarVocabulary
from dflash.generation.token_table import TokenTable
from dflash.tokenizer import Tokenizer


class ConstraintFactory:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self._lock = threading.Lock()  # requests build their turns on several threads
        self._table: TokenTable | None = None
        self._grammar: GrammarVocabulary | None = None

    @property
    def table(self) -> TokenTable:
        with self._lock:
            if self._table is None:
                self._table = TokenTable.from_tokenizer(self.tokenizer.backend, self.vocab_size)
            return self._table

    def one_of(self, options: Sequence[bytes]) -> OneOfConstraint:
        """Write exactly one of `options`, then anything."""
        return OneOfConstraint(self.table, options)

    def grammar(self, lark: str, *, release: bool = True) -> GrammarConstraint:
        """Follow a Lark grammar (llguidance syntax); `release`: free once it accepts, else to the end of the
        output. Raises `GenerationError` for an invalid one."""
        with self._lock:
            if self._grammar is None:
                self._grammar = GrammarVocabulary(self.tokenizer.to_json(), self.vocab_size, self.eos_ids)
            vocabulary = self._grammar
        return vocabulary.compile(lark, release=release)
