"""Speculation paused under sustained load where it has stopped paying: speculative requests become plain ones.

When many requests decode together and the device rounds' chooser (`dflash.batch.tree_budgets`) keeps taking plain
steps for everyone, a speculative request still costs more than a plain one: each plain step keeps its row's
features for the drafter, and every return to rounds (a re-measurement, a change of the choice) first writes the
drafter context of every plain step since. Sampled at temperature 1, where the default drafter's rounds commit ~1.5
tokens, that is most of a loaded server's steps (results/README.md, "lengths that differ"). After `PAUSE_AFTER`
consecutive steps in which every decoding request took a plain step, with at least `MIN_REQUESTS` of them
speculative and the chooser predicting its best round clearly slower than a plain step (`PAUSE_BELOW`, from measured
step times and acceptance), those requests stop speculating: their drafter state (context rows, table) is dropped
and they decode as plain requests; requests admitted while the pause holds start plain. The pause holds for
`HOLD_STEPS` steps, or until fewer than `MIN_REQUESTS // 2` requests are active; then arrivals speculate again. Until
the paused requests end, those arrivals take plain steps beside them (keeping their features: a batch of plain and
speculative requests would take the host-built path, whose prompt steps cost twice plain decoding's under this load,
results/gpu_concurrency_h200_speculation_pause_sampled.json); then the batch speculates as one and the chooser
measures afresh. Steps planned on the host-built path (mixed strategies) never count. Outputs do not change: a plain
step samples the target as a round does (greedy, or the same uniform of seed and position), only the speed does.
"""

from __future__ import annotations

# a step counts only where the step's chooser last predicted its best round at most this fraction of a plain step's
# speed (`TreeBudgetChooser.round_gain`): near break-even (greedy at 32 clients, where the choice alternates) rounds
# still pay at times and a pause would lose them; a chosen margin, not a measured figure
PAUSE_BELOW = 0.8
MIN_REQUESTS = 16  # decoding speculative requests a step must have to count towards a pause
PAUSE_AFTER = 64  # consecutive such steps of plain rows for everyone before speculation pauses
HOLD_STEPS = 2048  # steps a pause holds for arrivals before they speculate again (several requests' lifetimes)


class SpeculationPause:
    def __init__(self) -> None:
        self._run = 0  # consecutive counted steps that were plain for everyone
        self._counted = -1  # the step index last counted (a step may plan its rounds twice)
        self._until = -1  # step index up to which the pause holds
        self.pauses = 0  # times speculation paused
        self.paused_requests = 0  # speculative requests made plain (decoding ones and arrivals)
        self.gains: list[float | None] = []  # per pause: the chooser's best round over a plain step when it paused

    def due(self, step: int, speculative: int, all_plain: bool) -> bool:
        """Count step `step`'s plan (`speculative` decoding requests that speculate, `all_plain`: every request
        takes a plain step); True when speculation should pause now (then the count starts again)."""
        if step == self._counted:
            return False
        self._counted = step
        if not all_plain or speculative < MIN_REQUESTS:
            self._run = 0
            return False
        self._run += 1
        if self._run < PAUSE_AFTER:
            return False
        self._run = 0
        self._until = step + HOLD_STEPS
        self.pauses += 1
        return True

    def holds(self, step: int, active: int) -> bool:
        """Whether a request admitted at step `step`, with `active` requests already active, starts plain."""
        if step > self._until or active < MIN_REQUESTS // 2:
            self._until = -1
            return False
        return True
