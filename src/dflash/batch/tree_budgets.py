"""Which tree budget a step of DDTree requests verifies (or which chain length a step of linear requests does), or none
(a plain step), from measured step times and measured acceptance.

A bigger tree commits more tokens per round and costs more per step, and the more requests share a step, the more
every verified row costs against the plain rows it delays: the best budget moves with the load and the machine. When
every decoding request is a DDTree request (the steps `dflash.batch.device_trees` builds on the device), the
chooser compares, for the step's request bucket, a plain step and a round at each candidate budget, by expected
tokens per second:

* **step times** are measured, not modelled: the whole time from a step's start to the next one's, for every
  decoding step the option was chosen for (prompt chunks aside): its host work, its launch, the wait for the round
  before it, and what a steady chain of launched-ahead steps does not show (a chain's first launch, host-built rounds
  near a request's end, arrivals and ends breaking the chain), kept per (request bucket, option) as a decayed mean. An
  option not measured in a bucket yet is run for a few steps to measure it (the largest budget first: its rounds
  also tell every smaller budget's acceptance), and every `REFRESH_STEPS` steps of a bucket the option measured
  longest ago is run again, so that the table follows context lengths and traffic;
* **acceptance** (tokens committed per round) is kept per budget, engine-wide and per request: a round verified at
  budget B also reports the tokens the best c nodes alone would have committed for every candidate c < B (the tree
  of budget c is exactly those nodes: `dflash.fastpath.batched_trees.Walk.lengths_within`), so one budget's rounds
  measure all smaller ones.

A tree budget is taken over a plain step only where it is predicted `TREE_GAIN` faster (what trees cost at
arrivals and ends is not in their step times), and the choice changes only when another option is predicted
`SWITCH_MARGIN` faster and the time it would save over the next `SWITCH_HORIZON` steps exceeds what a change to it
was measured to cost: each change ends a chain of launched-ahead steps (the first round after plain steps is loaded
from the host and writes their drafter context first; the first plain step waits for the last round). Outputs never
depend on the choice (verification commits the target's own tokens, greedy or sampled).
"""

from __future__ import annotations

import math
from collections.abc import Callable

CANDIDATES = (7, 15, 31)  # tree budgets whose verification rows (budget + 1) fill a padded row bucket
CHAIN_CANDIDATES = (3, 7)  # chain lengths of linear requests (rows 4 and 8 fill a row bucket), with the top one
EXPLORE_STEPS = 6  # consecutive steps an option runs when it is measured
REFRESH_STEPS = 256  # steps of one request bucket between re-measurements of its least recently measured option
SWITCH_MARGIN = 1.05  # predicted speed-up that moves the choice off the current option
SWITCH_HORIZON = 32  # steps a change is assumed to last when its saving is weighed against its measured cost
# predicted speed-up a tree budget needs over a plain step: the step times leave out what trees add when requests
# arrive and end (a round loaded from the host instead of launched ahead, a round beside each prompt chunk: the
# gap between steady-state and measured DDTree speed in results/gpu_concurrency_h200.json, "tree_budgets_under_load");
# a chosen margin, not a measured figure
TREE_GAIN = 1.1
MIN_STEPS = 3  # observed steps before an option's time is trusted
SETTLE_STEPS = 2  # steps after a change of option left unobserved: the change's cost is not the option's
TIME_DECAY = 0.9  # weight of the older observations in an option's time
# an observed step counts as at most this many times the option's trusted time: one stalled step (a collection, a
# capture not seen as one) would otherwise price the option out for `REFRESH_STEPS` steps; a lasting change still
# moves the mean, by up to this factor a step
OUTLIER_FACTOR = 3.0
ROUND_DECAY = 0.99  # weight of the older rounds in the engine-wide acceptance
MIN_ROUNDS = 8  # rounds before the engine-wide acceptance at a budget replaces the prior
PRIOR_TOKENS = 2.0  # tokens per round assumed before any is measured


def candidate_budgets(top: int) -> list[int]:
    """The budgets a step may take where at most `top` nodes fit each request: the candidates below it and `top`."""
    if top <= 0:
        return []
    return sorted({b for b in CANDIDATES if b < top} | {top})


def candidate_chains(top: int) -> list[int]:
    """The chain lengths a step of linear requests may take, at most `top` drafts each."""
    if top <= 0:
        return []
    return sorted({c for c in CHAIN_CANDIDATES if c < top} | {top})


class TreeBudgetChooser:
    def __init__(self) -> None:
        # True: always the largest budget, False: always a plain step (tests and benchmarks that time fixed work)
        self.forced: bool | None = None
        self._times: dict[tuple[int, int], list[float]] = {}  # (bucket, option) -> [mean seconds, observations]
        self._rounds: dict[int, list[float]] = {}  # budget -> [decayed rounds, decayed tokens, rounds]
        self._current: dict[int, int] = {}  # bucket -> the option its steps take
        self._run: dict[int, int] = {}  # bucket -> steps its current option has taken in a row
        self._pinned: dict[int, list[int]] = {}  # bucket -> [option, steps left] while an option is measured
        self._steps: dict[int, int] = {}  # bucket -> steps chosen so far
        self._measured: dict[tuple[int, int], int] = {}  # (bucket, option) -> the bucket's step count then
        self.chosen: dict[tuple[int, int], int] = {}  # (bucket, option) -> steps that took it
        # (bucket, option) -> [seconds, steps] of the steps right after a change to it, which its time leaves out:
        # what a change costs (a round loaded from the host rather than launched ahead, a chain's first launch)
        self._settling: dict[tuple[int, int], list[float]] = {}
        # bucket -> the best round's predicted tokens per second over a plain step's, at the bucket's last choice made
        # from measured times (inf / 0.0 where `forced` takes rounds / plain steps); what a speculation pause reads
        self._round_gain: dict[int, float] = {}

    # ---- measurements ------------------------------------------------------------------------------------
    def observe(self, bucket: int, option: int, seconds: float) -> None:
        """A step of `option` (0: plain, else the tree budget) at request bucket `bucket` took `seconds` (the first
        `SETTLE_STEPS` steps after the bucket changed option are not counted)."""
        if self._current.get(bucket) == option and self._run.get(bucket, 0) <= SETTLE_STEPS:
            settling = self._settling.setdefault((bucket, option), [0.0, 0.0])
            settling[0] += seconds
            settling[1] += 1
            return
        entry = self._times.setdefault((bucket, option), [seconds, 0.0])
        if entry[1] >= MIN_STEPS:
            seconds = min(seconds, OUTLIER_FACTOR * entry[0])
        entry[0] = TIME_DECAY * entry[0] + (1 - TIME_DECAY) * seconds if entry[1] else seconds
        entry[1] += 1
        self._measured[(bucket, option)] = self._steps.get(bucket, 0)

    def step_time(self, bucket: int, option: int) -> float | None:
        entry = self._times.get((bucket, option))
        return entry[0] if entry is not None and entry[1] >= MIN_STEPS else None

    def record(self, budget: int, tokens: int, within: dict[int, int]) -> None:
        """A round at `budget` committed `tokens`; `within`: what each smaller budget's tree would have committed."""
        for size, committed in ((budget, tokens), *within.items()):
            totals = self._rounds.setdefault(size, [0.0, 0.0, 0.0])
            totals[0] = ROUND_DECAY * totals[0] + 1.0
            totals[1] = ROUND_DECAY * totals[1] + committed
            totals[2] += 1

    def prior(self, budget: int) -> float:
        """Tokens per round at `budget` for a request with too few rounds of its own: the engine-wide mean."""
        totals = self._rounds.get(budget)
        if totals is None or totals[2] < MIN_ROUNDS:
            return PRIOR_TOKENS
        return totals[1] / totals[0]

    # ---- the choice --------------------------------------------------------------------------------------
    def choose(self, bucket: int, requests: int, budgets: list[int], expected: Callable[[int], float]) -> int:
        """The option for a step of `requests` DDTree requests (request bucket `bucket`): 0 for a plain step
        or one of `budgets`; `expected(budget)`: the tokens a round at `budget` would commit over all of them."""
        if self.forced is not None:
            self._round_gain[bucket] = math.inf if self.forced else 0.0
            return budgets[-1] if self.forced and budgets else 0
        steps = self._steps.get(bucket, 0) + 1
        self._steps[bucket] = steps
        options = [0, *budgets]
        pinned = self._pinned.get(bucket)
        if pinned is not None and pinned[0] in options and pinned[1] > 0:
            pinned[1] -= 1
            return self._take(bucket, pinned[0])
        unmeasured = [o for o in options if self.step_time(bucket, o) is None]
        if unmeasured:  # the largest budget first: its rounds measure the smaller budgets' acceptance too
            return self._pin(bucket, max(unmeasured))
        stale = min(options, key=lambda o: self._measured.get((bucket, o), 0))
        if steps - self._measured.get((bucket, stale), 0) > REFRESH_STEPS:
            return self._pin(bucket, stale)
        tokens = {o: expected(o) if o else float(requests) for o in options}  # committed by one step of each
        rates = {o: tokens[o] / (self.step_time(bucket, o) or 1e-9) for o in options}
        if budgets:
            self._round_gain[bucket] = max(rates[b] for b in budgets) / rates[0]
        rates[0] *= TREE_GAIN  # a tree must beat a plain step by this much (the costs it adds at arrivals and ends)
        best = max(options, key=lambda o: rates[o])
        current = self._current.get(bucket)
        if current in rates and current != best:
            # seconds the change would save over the horizon: the tokens of its steps, each made faster
            saved = SWITCH_HORIZON * tokens[best] * (1 / rates[current] - 1 / rates[best])
            if rates[current] * SWITCH_MARGIN >= rates[best] or saved <= self.change_cost(bucket, best):
                best = current
        return self._take(bucket, best)

    def round_gain(self, bucket: int) -> float | None:
        """The best round's predicted speed over a plain step's at `bucket`'s last choice from measurements (>1:
        rounds pay); None before one."""
        return self._round_gain.get(bucket)

    def change_cost(self, bucket: int, option: int) -> float:
        """Seconds a change to `option` costs beyond its steady steps: its settling steps' excess over its measured
        step time (0 until both are measured)."""
        settling = self._settling.get((bucket, option))
        steady = self.step_time(bucket, option)
        if settling is None or not settling[1] or steady is None:
            return 0.0
        return max(0.0, settling[0] / settling[1] - steady) * SETTLE_STEPS

    def _pin(self, bucket: int, option: int) -> int:
        self._pinned[bucket] = [option, EXPLORE_STEPS - 1]
        self._times.pop((bucket, option), None)  # measured afresh: an old time (a capture, other traffic) goes
        return self._take(bucket, option)

    def _take(self, bucket: int, option: int) -> int:
        self._run[bucket] = self._run.get(bucket, 0) + 1 if self._current.get(bucket) == option else 1
        self._current[bucket] = option
        self.chosen[(bucket, option)] = self.chosen.get((bucket, option), 0) + 1
        return option

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """By request bucket: the steps each option took, its measured step time (ms), and the mean time (ms) and
        count of the steps right after a change to it (left out of its time); by budget: the engine-wide tokens per
        round (0 stands for plain steps)."""
        steps: dict[str, dict[str, float]] = {}
        for (bucket, option), count in sorted(self.chosen.items()):
            steps.setdefault(str(bucket), {})[str(option)] = count
        times: dict[str, dict[str, float]] = {}
        for (bucket, option), (seconds, _) in sorted(self._times.items()):
            times.setdefault(str(bucket), {})[str(option)] = round(seconds * 1e3, 3)
        settling_ms: dict[str, dict[str, float]] = {}
        settling_steps: dict[str, dict[str, float]] = {}
        for (bucket, option), (seconds, settled) in sorted(self._settling.items()):
            settling_ms.setdefault(str(bucket), {})[str(option)] = round(seconds / settled * 1e3, 3)
            settling_steps.setdefault(str(bucket), {})[str(option)] = settled
        tokens = {str(b): round(t[1] / t[0], 3) for b, t in sorted(self._rounds.items()) if t[0]}
        return {"steps": steps, "step_ms": times, "settling_ms": settling_ms, "settling_steps": settling_steps,
                "tokens_per_round": {"all": tokens}}
