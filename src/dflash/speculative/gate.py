"""Whether a lone request's next round speculates or is a plain step, from measured round times.

On a CPU whether speculation pays depends on the machine (a verified row is nearly free with AMX tiles, costs a
tenth of a step or more without), on the model (a large LM head makes every verified row dear) and on the request
(repetitive text is accepted in long runs). The gate measures it as the request runs: the wall time of speculative
rounds and of plain steps (exponentially weighted means, kept by the engine across requests: they are the machine's
and the model's), and the tokens each speculative round commits (the request's own mean once it has a few rounds,
else the engine's). Each round takes the mode with more tokens per second. The mode not taken is measured again
now and then (`PROBE_EVERY` rounds, `PROBE_ROUNDS` in a row), so a change in either side is followed.

Greedy outputs never depend on the gate: a plain step commits the target's own next token, a speculative round the
tokens the target agrees with. Sampled ones keep the target's distribution either way, but rounds and plain steps
draw their random numbers in a different order, so the engine gives no gate to a sampled request with a seed (its
text would then depend on measured times).
"""

from __future__ import annotations

from dataclasses import dataclass, field

WARM_ROUNDS = 4  # rounds of each mode measured before the comparison is trusted
PROBE_EVERY = 64  # rounds in a row of the mode the comparison favours, after which the other is measured again
PROBE_ROUNDS = 2  # rounds of the other mode then (a first speculative one is not timed: `record`)
DECAY = 0.9  # weight of the earlier mean in each update (about the last ten rounds)
PRIOR_TOKENS = 2.0  # tokens per speculative round assumed before any round is measured


def _mix(mean: float | None, value: float) -> float:
    return value if mean is None else DECAY * mean + (1.0 - DECAY) * value


@dataclass
class GateCosts:
    """The engine's measurements, shared by its requests: seconds per speculative round and per plain step, and
    tokens per speculative round over every request."""

    spec_seconds: float | None = None
    plain_seconds: float | None = None
    spec_rounds: int = 0
    plain_rounds: int = 0
    tokens: float | None = None


@dataclass
class SpeculationGate:
    """One request's choices over the engine's `costs`: `speculate()` before each round, `record(...)` after it."""

    costs: GateCosts
    tokens: float | None = None  # this request's tokens per speculative round
    rounds: int = 0  # this request's speculative rounds
    streak: int = 0  # rounds in a row of the favoured mode since the last probe
    probe_left: int = 0  # rounds of the probed mode still to run
    choices: list[bool] = field(default_factory=list)  # every round's mode, in order (diagnostics, tests)

    def speculate(self) -> bool:
        costs = self.costs
        if costs.spec_rounds < WARM_ROUNDS:
            choice = True
        elif costs.plain_rounds < WARM_ROUNDS:
            choice = False
        elif self.probe_left > 0:
            self.probe_left -= 1
            choice = not self._better()
        else:
            choice = self._better()
            self.streak += 1
            if self.streak > PROBE_EVERY:  # measure the other mode again
                self.streak, self.probe_left = 0, PROBE_ROUNDS - 1
                choice = not choice
        self.choices.append(choice)
        return choice

    def record(self, speculative: bool, seconds: float, tokens: int) -> None:
        """The round just chosen took `seconds` and committed `tokens`. A request's first speculative round and one
        right after plain steps also fed the drafter the context rows before it (the prompt's, the plain steps'):
        their tokens count, their time does not (it would weigh that context into one sample)."""
        costs = self.costs
        if speculative:
            fed_context = len(self.choices) < 2 or not self.choices[-2]
            if not fed_context:
                costs.spec_seconds = _mix(costs.spec_seconds, seconds)
            costs.spec_rounds += 1
            costs.tokens = _mix(costs.tokens, float(tokens))
            self.rounds += 1
            self.tokens = _mix(self.tokens, float(tokens))
        else:
            costs.plain_seconds = _mix(costs.plain_seconds, seconds)
            costs.plain_rounds += 1

    def expected_tokens(self) -> float:
        """Tokens a speculative round of this request commits: its own mean after a few rounds, else the engine's."""
        if self.tokens is not None and self.rounds >= WARM_ROUNDS:
            return self.tokens
        return self.costs.tokens if self.costs.tokens is not None else PRIOR_TOKENS

    def _better(self) -> bool:
        """Whether speculating gives more tokens per second than plain steps, as measured."""
        spec, plain = self.costs.spec_seconds, self.costs.plain_seconds
        if spec is None or plain is None:
            return True
        return self.expected_tokens() / spec >= 1.0 / plain
