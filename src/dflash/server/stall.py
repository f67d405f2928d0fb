"""Agent stall recovery: opt-in nudges for small models driving coding agents, read from the environment.

All three are off unless set; values are parsed by meaning (`0`, `false`, `no`, `off` and the empty string
are off) and a value that means nothing raises `DFlashError` at start-up instead of being guessed at.

- `DFLASH_MIN_TOKENS=N`: when a request offers tools, EOS is suppressed before N tokens (a model that
  "answers" an agent with an empty turn keeps going instead).
- `DFLASH_STALL_TOOL_PREFIX=1`: a turn with tools that ends (EOS) right after an action preamble such as
  "Let me check the file:" without calling a tool is continued once, from the model's own output followed
  by the opening of a call to the tool that `tool_choice` forces, or the only tool.
- `DFLASH_DEGENERATE_RUN_TOKENS=N`: a run of N identical tokens ends the turn with finish reason "length".
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dflash.environment import DEGENERATE_RUN_TOKENS as ENV_DEGENERATE_RUN
from dflash.environment import MIN_TOKENS as ENV_MIN_TOKENS
from dflash.environment import STALL_TOOL_PREFIX as ENV_TOOL_PREFIX
from dflash.environment import env_count, env_flag


@dataclass(frozen=True)
class StallSettings:
    min_tokens: int = 0  # DFLASH_MIN_TOKENS
    tool_prefix: bool = False  # DFLASH_STALL_TOOL_PREFIX
    degenerate_run_tokens: int = 0  # DFLASH_DEGENERATE_RUN_TOKENS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StallSettings:
        env = os.environ if env is None else env
        return cls(
            min_tokens=env_count(env, ENV_MIN_TOKENS),
            tool_prefix=env_flag(env, ENV_TOOL_PREFIX),
            degenerate_run_tokens=env_count(env, ENV_DEGENERATE_RUN),
        )

    def describe(self) -> list[str]:
        """The recoveries that are on, for the start-up banner."""
        out = []
        if self.min_tokens:
            out.append(f"{ENV_MIN_TOKENS}={self.min_tokens}")
        if self.tool_prefix:
            out.append(f"{ENV_TOOL_PREFIX}=1")
        if self.degenerate_run_tokens:
            out.append(f"{ENV_DEGENERATE_RUN}={self.degenerate_run_tokens}")
        return out


_ACTION = re.compile(
    r"\b(let me|let's|let us|i'll|i will|i am going to|i'm going to|i need to|i should|now i|next,? i|"
    r"first,? i|i can)\b",
    re.IGNORECASE,
)


def looks_like_action_preamble(text: str) -> bool:
    """True when visible text ends announcing an action ("Let me look at the file:") rather than answering."""
    stripped = text.rstrip()
    if not stripped:
        return False
    if stripped.endswith(":"):
        return True
    last = re.split(r"(?<=[.!?])\s+|\n", stripped)[-1]
    return stripped[-1] in ".…" and _ACTION.search(last) is not None


class DegenerateRun:
    """Watches committed token ids for a run of one repeated token of length `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.last: int | None = None
        self.run = 0

    def observe(self, ids: Sequence[int]) -> bool:
        for token in ids:
            if token == self.last:
                self.run += 1
            else:
                self.last, self.run = token, 1
            if self.run >= self.limit:
                return True
        return False
