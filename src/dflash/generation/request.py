"""Request and result records shared by every decoding strategy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash.generation.constraints import TokenConstraint
from dflash.generation.sampling import SamplingParams

TokenCallback = Callable[[str, list[int]], None]  # (new visible text, new token ids)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # added to the model's EOS ids
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS is suppressed before this many tokens
    use_prefix_cache: bool = True  # read and fill the engine's prefix cache (when it has one)
    constraint: TokenConstraint | None = None  # restricts the tokens chosen (`dflash.generation.constraints`)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # speculative decoding
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # [k] = rounds that accepted k drafts
    accepted_per_round: list[int] = field(default_factory=list)  # drafts accepted in each round, in order
    fallbacks: int = 0
    plain_steps: int = 0  # steps a speculative request took plainly where they measured faster (not rounds)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per round, the target's own (bonus) token included."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.accepted_per_round.append(accepted)
        if len(self.acceptance_histogram) <= accepted:
            self.acceptance_histogram.extend([0] * (accepted + 1 - len(self.acceptance_histogram)))
        self.acceptance_histogram[accepted] += 1

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }
        if self.rounds:
            out.update(
                rounds=self.rounds,
                draft_tokens=self.draft_tokens,
                accepted_tokens=self.accepted_tokens,
                acceptance_length=round(self.acceptance_length, 4),
                acceptance_histogram=list(self.acceptance_histogram),
            )
        if self.plain_steps:
            out["plain_steps"] = self.plain_steps
        out["fallbacks"] = self.fallbacks
        return out


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    stats: GenerationStats
    stop_reason: str | None = None  # "eos" | the stop string | None
