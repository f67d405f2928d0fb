"""The speculation policy's online cost fit: plain-float least squares that recovers a step's cost terms and agrees
with a dense solve of the same weighted system, and the plan it makes."""

from __future__ import annotations

import random

import pytest
import torch

from dflash.batch.policy import MIN_OBSERVATIONS, PRIOR_ACCEPTANCE, SpeculationPolicy, StepCosts


def test_the_fit_recovers_the_step_s_cost_terms() -> None:
    costs = StepCosts()
    generator = random.Random(0)
    for _ in range(40):
        rows, drafted = generator.randint(1, 300), generator.random() < 0.5
        costs.observe(rows, drafted, 0.0011 + 2.5e-5 * rows + (0.0023 if drafted else 0.0))
    base, per_row, draft = costs.coefficients
    assert base == pytest.approx(0.0011, rel=1e-4)
    assert per_row == pytest.approx(2.5e-5, rel=1e-4)
    assert draft == pytest.approx(0.0023, rel=1e-4)
    assert costs.predict(100, True) == pytest.approx(0.0011 + 0.0025 + 0.0023, rel=1e-4)
    assert costs.trusted


@pytest.mark.parametrize("drafting", ["mixed", "always"])
def test_predictions_equal_a_dense_weighted_least_squares_solve(drafting: str) -> None:
    """Noisy steps, and a degenerate history (the drafter ran every step: base and draft terms inseparable but for
    the ridge): predictions agree with torch's solve of the same decayed normal equations."""
    costs = StepCosts()
    gram = torch.eye(3, dtype=torch.float64) * 1e-6
    moment = torch.zeros(3, dtype=torch.float64)
    generator = random.Random(1)
    for step in range(200):
        rows = generator.randint(1, 256)
        drafted = drafting == "always" or generator.random() < 0.5
        seconds = 0.001 + rows * 2e-5 + (0.002 if drafted else 0.0) + generator.random() * 1e-4
        costs.observe(rows, drafted, seconds)
        x = torch.tensor([1.0, float(rows), 1.0 if drafted else 0.0], dtype=torch.float64)
        gram = costs.decay * gram + torch.outer(x, x)
        moment = costs.decay * moment + x * seconds
        if step < MIN_OBSERVATIONS:
            continue
        coef = torch.linalg.solve(gram, moment)
        for rows_asked, drafted_asked in ((10, True), (200, False), (64, True)):
            x = torch.tensor([1.0, float(rows_asked), 1.0 if drafted_asked else 0.0], dtype=torch.float64)
            expected = max(float(coef @ x), 1e-9)
            assert costs.predict(rows_asked, drafted_asked) == pytest.approx(expected, rel=1e-3)


def test_the_plan_speculates_where_it_pays() -> None:
    """A drafted step costing 3 ms more than a plain one: at 2 tokens per round for 8 requests a 32-node tree does
    not pay, at 6 it does."""
    policy = SpeculationPolicy(ddtree_budget=32, linear_drafts=15, max_step_rows=256)
    for step in range(40):
        rows = 8 + (step % 5) * 60
        drafted = step % 2 == 0
        policy.costs.observe(rows, drafted, 0.001 + 2e-6 * rows + (0.003 if drafted else 0.0))
    assert not policy.plan([2.0] * 8, [32] * 8, plain_rows=0)
    assert policy.plan([6.0] * 8, [32] * 8, plain_rows=0)


def test_a_new_request_expects_the_recent_acceptance_of_its_mode() -> None:
    """Before a request has speculated a few rounds, its expected tokens per round are the recent mean of every
    request of its mode (the fixed prior before any)."""
    policy = SpeculationPolicy(ddtree_budget=32, linear_drafts=15, max_step_rows=256)
    assert policy.prior("ddtree") == PRIOR_ACCEPTANCE
    for tokens in (3, 4, 3, 4, 3, 4, 3, 4, 3, 4):
        policy.record_round("ddtree", tokens)
    assert 3.4 < policy.prior("ddtree") < 3.6
    assert policy.prior("linear") == PRIOR_ACCEPTANCE
