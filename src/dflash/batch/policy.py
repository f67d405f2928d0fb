"""How much to speculate per request when several share a step, from measured costs.

A step's time grows with the rows it verifies and with the drafter round, and the more requests share it, the
less a drafted row is worth against the plain rows it delays. The policy keeps two measurements:

* `StepCosts`: the step's wall time fitted online as `base + per_row * rows + draft * drafted` (exponentially
  weighted least squares over recent steps, so it follows the machine and the context lengths);
* per request, its acceptance length (tokens committed per speculative round, a running mean).

Each step it compares speculating (every speculative request verifies its tree or block: expected tokens = the sum
of their acceptance lengths) against a plain step for everyone (one token each), per second of predicted step
time, and speculates only where that pays. The verified rows of one step are also capped (`max_step_rows`) and
shared among the speculating requests. Outputs never depend on the plan: every strategy is lossless whatever the
drafts; only speed does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Verified rows per step by device class: on the CPU a row costs about a tenth of a plain step up to a few dozen
# rows, on the GPU a step stays launch- and weight-bound for hundreds.
DEFAULT_MAX_STEP_ROWS = {"cpu": 32, "cuda": 256}
# Until a request has speculated a few rounds, its acceptance length is taken as this (a conservative figure for
# a trained drafter: results/README.md lists 2.5-4 tokens per round).
PRIOR_ACCEPTANCE = 2.0
MIN_OBSERVATIONS = 8  # steps before the fitted costs are trusted (before that: always speculate)


@dataclass(frozen=True)
class RoundPlan:
    ddtree_budget: int  # drafted tree nodes per DDTree request this step (0: a plain step)
    linear_drafts: int  # drafts verified per linear request this step (0: a plain step)


class StepCosts:
    """Online fit of step time = base + per_row * rows + draft * drafted (drafted: 1 if the drafter ran)."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.gram = torch.eye(3, dtype=torch.float64) * 1e-6  # weighted sum of x x^T (a small ridge keeps it solvable)
        self.moment = torch.zeros(3, dtype=torch.float64)  # weighted sum of x * seconds
        self.observations = 0

    def observe(self, rows: int, drafted: bool, seconds: float) -> None:
        x = torch.tensor([1.0, float(rows), 1.0 if drafted else 0.0], dtype=torch.float64)
        self.gram = self.decay * self.gram + torch.outer(x, x)
        self.moment = self.decay * self.moment + x * seconds
        self.observations += 1

    def predict(self, rows: int, drafted: bool) -> float:
        coef = torch.linalg.solve(self.gram, self.moment)
        x = torch.tensor([1.0, float(rows), 1.0 if drafted else 0.0], dtype=torch.float64)
        return max(float(coef @ x), 1e-9)

    @property
    def trusted(self) -> bool:
        return self.observations >= MIN_OBSERVATIONS


@dataclass
class SpeculationPolicy:
    ddtree_budget: int
    linear_drafts: int
    max_step_rows: int

    def __post_init__(self) -> None:
        self.costs = StepCosts()

    def share(self, speculating: int, plain_rows: int) -> RoundPlan:
        """Each speculating request's share of the row cap, beside `plain_rows` rows of other requests."""
        if speculating < 1:
            return RoundPlan(self.ddtree_budget, self.linear_drafts)
        share = max(0, self.max_step_rows - plain_rows) // speculating - 1  # drafted rows each, beside its root
        return RoundPlan(max(0, min(self.ddtree_budget, share)), max(0, min(self.linear_drafts, share)))

    def plan(self, acceptance: list[float], drafted_rows: list[int], plain_rows: int) -> bool:
        """Whether to speculate this step: `acceptance` and `drafted_rows` per speculating request (expected
        tokens per round, drafted rows it would verify), `plain_rows` rows of requests decoding plainly."""
        if not acceptance or not self.costs.trusted:
            return True
        n = len(acceptance)
        speculate = self.costs.predict(plain_rows + n + sum(drafted_rows), True)
        plain = self.costs.predict(plain_rows + n, False)
        return (sum(acceptance) + plain_rows) / speculate >= (n + plain_rows) / plain
