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

# Verified rows per step by device class: on the CPU a row costs about a tenth of a plain step up to a few dozen
# rows, on the GPU a step stays launch- and weight-bound for hundreds.
DEFAULT_MAX_STEP_ROWS = {"cpu": 32, "cuda": 256}
# Until a request has speculated a few rounds, its acceptance length is taken as this (a conservative figure for
# a trained drafter: results/README.md lists 2.5-4 tokens per round).
PRIOR_ACCEPTANCE = 2.0
MIN_OBSERVATIONS = 8  # steps before the fitted costs are trusted (before that: always speculate)
MIN_ROUNDS = 8  # drafted rounds over all requests before their mean replaces PRIOR_ACCEPTANCE for new requests
ROUND_DECAY = 0.99  # weight of older rounds in that mean


@dataclass(frozen=True)
class RoundPlan:
    ddtree_budget: int  # drafted tree nodes per DDTree request this step (0: a plain step)
    linear_drafts: int  # drafts verified per linear request this step (0: a plain step)


class StepCosts:
    """Online fit of step time = base + per_row * rows + draft * drafted (drafted: 1 if the drafter ran).

    Three unknowns: the sums are kept as Python floats and the 3x3 system is solved once per observation (not per
    prediction), so the fit costs a few microseconds of a step instead of a dozen small tensor operations."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        # weighted sum of x x^T (a small ridge keeps it solvable), row-major 3x3
        self.gram = [[1e-6 if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.moment = [0.0, 0.0, 0.0]  # weighted sum of x * seconds
        self.observations = 0
        self._coef: tuple[float, float, float] | None = None

    def observe(self, rows: int, drafted: bool, seconds: float) -> None:
        x = (1.0, float(rows), 1.0 if drafted else 0.0)
        decay = self.decay
        for i in range(3):
            row = self.gram[i]
            for j in range(3):
                row[j] = decay * row[j] + x[i] * x[j]
            self.moment[i] = decay * self.moment[i] + x[i] * seconds
        self.observations += 1
        self._coef = None

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(base, per_row, draft): the least-squares solution of gram @ coef = moment."""
        if self._coef is None:
            self._coef = _solve3(self.gram, self.moment)
        return self._coef

    def predict(self, rows: int, drafted: bool) -> float:
        base, per_row, draft = self.coefficients
        return max(base + per_row * rows + (draft if drafted else 0.0), 1e-9)

    @property
    def trusted(self) -> bool:
        return self.observations >= MIN_OBSERVATIONS


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float]:
    """x with a @ x = b for a 3x3 `a` (Gaussian elimination with partial pivoting, as an LU solve does)."""
    m = [[*a[i], b[i]] for i in range(3)]  # augmented rows
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            return (0.0, 0.0, 0.0)
        for r in range(col + 1, 3):
            factor = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= factor * m[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x[0], x[1], x[2]


@dataclass
class SpeculationPolicy:
    ddtree_budget: int
    linear_drafts: int
    max_step_rows: int

    def __post_init__(self) -> None:
        self.costs = StepCosts()
        self._rounds: dict[str, list[float]] = {}  # mode -> [drafted rounds, tokens they committed], decayed

    def record_round(self, mode: str, tokens: int) -> None:
        """A drafted round of a `mode` request committed `tokens`: the engine-wide acceptance (`prior`)."""
        totals = self._rounds.setdefault(mode, [0.0, 0.0])
        totals[0] = ROUND_DECAY * totals[0] + 1.0
        totals[1] = ROUND_DECAY * totals[1] + tokens

    def prior(self, mode: str) -> float:
        """Expected tokens per drafted round of a `mode` request that has not speculated a few rounds yet: the
        recent mean over every request of that mode (the drafter and the traffic decide it more than the request),
        `PRIOR_ACCEPTANCE` before any."""
        totals = self._rounds.get(mode)
        if totals is None or totals[0] < MIN_ROUNDS:
            return PRIOR_ACCEPTANCE
        return totals[1] / totals[0]

    def share(self, speculating: int, plain_rows: int) -> RoundPlan:
        """Each speculating request's share of the row cap, beside `plain_rows` rows of other requests."""
        if speculating < 1:
            return RoundPlan(self.ddtree_budget, self.linear_drafts)
        share = max(0, self.max_step_rows - plain_rows) // speculating - 1  # drafted rows each, beside its root
        return RoundPlan(max(0, min(self.ddtree_budget, share)), max(0, min(self.linear_drafts, share)))

    def round_rows(self, decoding: int) -> set[int]:
        """The rows the largest round of a step may have when `decoding` requests decode in it, over every split
        into speculating and plain requests (a fixed-shape pass pads every request to the largest)."""
        rows = {1}
        for speculating in range(1, decoding + 1):
            plan = self.share(speculating, plain_rows=decoding - speculating)
            rows.update((plan.ddtree_budget + 1, plan.linear_drafts + 1))
        return rows

    def plan(self, acceptance: list[float], drafted_rows: list[int], plain_rows: int) -> bool:
        """Whether to speculate this step: `acceptance` and `drafted_rows` per speculating request (expected
        tokens per round, drafted rows it would verify), `plain_rows` rows of requests decoding plainly."""
        if not acceptance or not self.costs.trusted:
            return True
        n = len(acceptance)
        speculate = self.costs.predict(plain_rows + n + sum(drafted_rows), True)
        plain = self.costs.predict(plain_rows + n, False)
        return (sum(acceptance) + plain_rows) / speculate >= (n + plain_rows) / plain
