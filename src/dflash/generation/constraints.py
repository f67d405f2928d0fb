"""Token constraints: which tokens the target may choose at each output position of one generation.

A `TokenConstraint` rides on the `GenerationRequest` (`constraint`); each generation (a retry included) starts
its own `ConstraintState`. The `TokenChooser` keeps that state in step with the committed output (`advance`)
and masks every disallowed token's logit to -inf before the sampling rule, so the choice at each position comes
from the target's distribution restricted to the allowed tokens, in every decoding mode.

Speculative rounds verify rows whose prefixes run past the committed output (a linear draft, or the paths of a
draft tree). `row_masks` walks those paths: it advances the state along each path, reads the allowed tokens of
every row, and rolls back, so the committed state is unchanged afterwards. A row below a drafted token the
constraint forbids gets no mask: the target's masked choice above it can never equal that token, so such a row
is never committed from.

Once `finished`, a state restricts nothing more; the chooser then drops it and decoding costs what it did
without a constraint.

`OneOfConstraint` is the rule tool calls need for their names: write exactly one of a few byte strings (a tool
name and the character that ends it), then anything. A token may run past the end of the chosen string (`",`
after a JSON name); it is allowed, and it finishes the constraint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from dflash.generation.token_table import TokenTable

__all__ = ["ConstraintState", "OneOfConstraint", "OneOfState", "TokenConstraint", "row_masks"]


class ConstraintState(Protocol):
    @property
    def finished(self) -> bool:
        """True once nothing is restricted any more (and from then on)."""
        ...

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next: bool [n] on the CPU (ids >= n are not allowed). Only asked while not finished."""
        ...

    def advance(self, token: int) -> bool:
        """Take `token` as written. False (state unchanged) when it is not allowed."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last `count` successful `advance` calls."""
        ...


class TokenConstraint(Protocol):
    def start(self) -> ConstraintState:
        """A fresh state for one generation, before its first output token."""
        ...


def row_masks(
    state: ConstraintState, drafts: Sequence[int], parents: Sequence[int] | None, vocab_size: int
) -> torch.Tensor:
    """Allowed tokens of every verified row: bool [len(drafts) + 1, vocab_size] on the CPU.

    Row 0 continues the committed output; row i >= 1 continues row `parents[i]`'s prefix with `drafts[i - 1]`
    (`parents` has one entry per row, the root's first; None: a chain, row i after row i - 1). A parent row
    always comes before its children. `state` is left as it was."""
    rows = len(drafts) + 1
    masks = torch.ones(rows, vocab_size, dtype=torch.bool)
    # free: nothing restricts this row (finished before it, or below a forbidden draft, see the module docstring)
    free = [False] * rows
    lineage: list[list[int]] = [[] for _ in range(rows)]  # the rows from depth 1 down to each row
    path: list[int] = []  # rows whose draft token is currently advanced into `state`, from depth 1 down
    try:
        for row in range(rows):
            if row > 0:
                parent = row - 1 if parents is None else int(parents[row])
                if free[parent]:
                    free[row] = True
                    continue
                # move the state to the parent's prefix: back to the common ancestor, then down its lineage
                wanted = lineage[parent]
                common = 0
                while common < min(len(path), len(wanted)) and path[common] == wanted[common]:
                    common += 1
                state.rollback(len(path) - common)
                del path[common:]
                for step in wanted[common:]:
                    state.advance(int(drafts[step - 1]))  # accepted when this row was first visited
                    path.append(step)
                if not state.advance(int(drafts[row - 1])):
                    free[row] = True
                    continue
                path.append(row)
                lineage[row] = list(path)
            if state.finished:
                free[row] = True
                continue
            allowed = state.allowed()
            width = min(allowed.shape[0], vocab_size)
            masks[row, :width] = allowed[:width]
            masks[row, width:] = False
    finally:
        state.rollback(len(path))
    return masks


class OneOfConstraint:
    """Write one of `options` (byte strings, none a prefix of another), then anything."""

    def __init__(self, table: TokenTable, options: Sequence[bytes]) -> None:
        if not options or any(not o for o in options):
            raise ValueError("a one-of constraint needs non-empty options")
        self.table = table
        self.options = tuple(dict.fromkeys(options))

    def start(self) -> OneOfState:
        return OneOfState(self)


class OneOfState:
    def __init__(self, rule: OneOfConstraint) -> None:
        self.rule = rule
        self.written = b""  # bytes written so far, a proper prefix of at least one option
        self._finished = False
        self._history: list[tuple[bytes, bool]] = []

    @property
    def finished(self) -> bool:
        return self._finished

    def allowed(self) -> torch.Tensor:
        table = self.rule.table
        mask = torch.zeros(table.vocab_size, dtype=torch.bool)
        tokens: list[int] = []
        for option in self.rule.options:
            if not option.startswith(self.written):
                continue
            rest = option[len(self.written) :]
            for end in range(1, len(rest)):  # a token that writes a proper prefix of the rest
                tokens.extend(table.exactly(rest[:end]))
            tokens.extend(table.starting_with(rest))  # the whole rest, and maybe more after it
        if tokens:
            mask[torch.tensor(tokens, dtype=torch.long)] = True
        return mask

    def advance(self, token: int) -> bool:
        if self._finished:
            self._history.append((self.written, True))
            return True
        table = self.rule.table
        data = table.bytes_of[token] if 0 <= token < len(table.bytes_of) else None
        if data is None:
            return False
        text = self.written + data
        done = any(text.startswith(o) for o in self.rule.options)
        if not done and not any(o.startswith(text) for o in self.rule.options):
            return False
        self._history.append((self.written, self._finished))
        self.written, self._finished = text, done
        return True

    def rollback(self, count: int) -> None:
        for _ in range(count):
            self.written, self._finished = self._history.pop()
