"""Grammar constraints through llguidance: a Lark grammar (JSON schemas inline as `%json {...}`) over tokens.

llguidance computes the allowed-token bitmask of a grammar state, consumes tokens and rolls them back, which is
the whole of what a `ConstraintState` must do. Its tokenizer is built from the model's `tokenizer.json` text
once per tokenizer (`GrammarVocabulary`); each generation gets its own matcher.

A grammar for a part of the output (a tool call) is compiled with `release=True`: its state is `finished` as
soon as the grammar accepts. Such a grammar ends with a free tail (`/(.|\\n)*/`), so the tokens that finish the
constrained part may also carry the text after it, and from then on nothing is restricted. A grammar for the
whole output (`release=False`, a JSON answer) stays on to the end: once complete it allows only EOS.

llguidance is imported only when a grammar is built, so the engine imports and runs without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dflash.errors import GenerationError

FREE_TAIL = r"/(.|\n)*/"  # a Lark terminal that matches any text, the empty one included


class GrammarVocabulary:
    """An llguidance tokenizer for one model: `tokenizer_json` (a `tokenizers` JSON text), `vocab_size` ids."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        llguidance = _import_llguidance()
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=list(eos_ids) or None)
        self.words = int(self.tokenizer.vocab_size)  # ids the grammar knows; higher ids are never allowed

    def compile(self, lark: str, *, release: bool = True) -> GrammarConstraint:
        """Raises `GenerationError` when the grammar (or a schema inside it) is not valid. `release`: the
        constraint finishes once the grammar accepts (see the module docstring)."""
        llguidance = _import_llguidance()
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:  # the first line says what is wrong; the rest quotes the grammar
            first = messages[0].strip().splitlines()[0] if messages and messages[0].strip() else "rejected"
            raise GenerationError(f"invalid grammar: {first}")
        return GrammarConstraint(self, grammar, release)


class GrammarConstraint:
    def __init__(self, vocabulary: GrammarVocabulary, grammar: str, release: bool = True) -> None:
        self.vocabulary = vocabulary
        self.grammar = grammar
        self.release = release

    def start(self) -> GrammarState:
        llguidance = _import_llguidance()
        matcher = llguidance.LLMatcher(self.vocabulary.tokenizer, self.grammar, log_level=0)
        if matcher.is_error():
            raise GenerationError(f"grammar matcher: {matcher.get_error()}")
        return GrammarState(self.vocabulary, matcher, self.release)


class GrammarState:
    def __init__(self, vocabulary: GrammarVocabulary, matcher: Any, release: bool = True) -> None:
        self.vocabulary = vocabulary
        self.matcher = matcher
        self.release = release
        self._finished = release and bool(matcher.is_accepting())
        self._history: list[bool] = []

    @property
    def finished(self) -> bool:
        return self._finished

    def allowed(self) -> torch.Tensor:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocabulary.words]
        return torch.from_numpy(mask.astype(np.bool_))

    def advance(self, token: int) -> bool:
        # validate first: consuming a token the grammar refuses leaves the matcher in an error state for good
        if not 0 <= token < self.vocabulary.words or self.matcher.validate_tokens([token]) != 1:
            return False
        if not self.matcher.consume_token(token):
            raise GenerationError(f"grammar matcher: {self.matcher.get_error()}")
        self._history.append(self._finished)
        self._finished = self.release and bool(self.matcher.is_accepting())
        return True

    def rollback(self, count: int) -> None:
        if count <= 0:
            return
        self.matcher.rollback(count)
        for _ in range(count):
            self._finished = self._history.pop()


def _import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise GenerationError("grammar constraints need the llguidance package (pip install llguidance)") from None
    return llguidance
