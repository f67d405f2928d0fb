"""How much to speculate per request when several share a step.

A step's cost grows with the rows it verifies, and the more requests share it, the less a drafted row is worth
against the plain decoding rows it delays. The policy caps the verified rows of one step (`max_step_rows`) and shares
them among the speculating requests: each gets up to its configured tree budget / draft count, fewer under load,
and none (a plain step that keeps its features for the next round) once a share falls below one drafted row.
Outputs never depend on the plan: every strategy is lossless whatever the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

# Verified rows per step by device class: on the CPU a row costs about a tenth of a plain step up to a few dozen
# rows, on the GPU a step stays launch- and weight-bound for hundreds.
DEFAULT_MAX_STEP_ROWS = {"cpu": 32, "cuda": 256}


@dataclass(frozen=True)
class RoundPlan:
    ddtree_budget: int  # drafted tree nodes per DDTree request this step (0: a plain step)
    linear_drafts: int  # drafts verified per linear request this step (0: a plain step)


@dataclass(frozen=True)
class SpeculationPolicy:
    ddtree_budget: int
    linear_drafts: int
    max_step_rows: int

    def plan(self, speculating: int, plain_rows: int = 0) -> RoundPlan:
        """The plan for a step with `speculating` speculative requests and `plain_rows` other rows."""
        if speculating < 1:
            return RoundPlan(self.ddtree_budget, self.linear_drafts)
        share = max(0, self.max_step_rows - plain_rows) // speculating - 1  # drafted rows each, beside its root
        return RoundPlan(max(0, min(self.ddtree_budget, share)), max(0, min(self.linear_drafts, share)))
