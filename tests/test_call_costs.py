"""What checkpointing costs besides recompute: each checkpoint call and each kept node.

``Problem.checkpoint_seconds`` and ``Problem.keep_seconds`` (from ``CostModel``) are part of a
plan's predicted time: ``simulate`` and the nested replay charge them, and ``optimal`` and the
MILP minimise what ``simulate`` reports, so the solvers agree with an exhaustive search that
judges every plan by ``simulate``. ``planner.overheads.checkpoint_overheads`` measures both.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from planner import CostModel
from planner.nested import Nest, NestedChoice
from planner.overheads import checkpoint_overheads
from planner.pipeline import plan, prepare
from planner.simulate import Choice, simulate
from planner.solvers import SOLVERS
from problems import all_plans, budgets, random_problem

CALL, KEEP = 2.0, 0.75  # seconds, beside random_problem's node times of 0.5 to 10


def chain(blocks: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(blocks)])
    return model, (torch.randn(4, 8),)


def test_a_plan_with_more_segments_is_predicted_to_cost_more_by_the_calls():
    model, inputs = chain()
    cost_model = CostModel(checkpoint_seconds=1e-3, keep_seconds=4e-4)
    _, problem = prepare(model, inputs, cost_model=cost_model)
    one, two = ((0, 4),), ((0, 2), (2, 4))  # both recompute nodes 0 to 3
    free = dataclasses.replace(problem, checkpoint_seconds=0.0, keep_seconds=0.0)
    assert simulate(free, one).recompute_seconds == simulate(free, two).recompute_seconds
    assert simulate(problem, two).recompute_seconds == pytest.approx(
        simulate(problem, one).recompute_seconds + 1e-3
    )
    kept = simulate(problem, Choice(two, frozenset({0})))
    assert kept.call_seconds == pytest.approx(2 * 1e-3 + 4e-4)
    assert kept.recompute_seconds == pytest.approx(
        simulate(free, Choice(two, frozenset({0}))).recompute_seconds + 2 * 1e-3 + 4e-4
    )
    assert simulate(problem, ()).recompute_seconds == 0.0


def test_the_nested_replay_charges_every_call_an_inner_segment_makes():
    """An inner segment runs in the forward and again inside its parent's recompute."""
    model, inputs = chain()
    _, problem = prepare(model, inputs, cost_model=CostModel(checkpoint_seconds=1e-3))
    free = dataclasses.replace(problem, checkpoint_seconds=0.0)
    nested = NestedChoice((Nest(0, 8, (Nest(2, 4),)),))
    result = simulate(problem, nested)
    assert result.call_seconds == pytest.approx(3 * 1e-3)
    assert result.recompute_seconds == pytest.approx(
        simulate(free, nested).recompute_seconds + 3 * 1e-3
    )


def test_the_segment_table_charges_each_segment_its_call():
    model, inputs = chain()
    p = plan(
        model,
        inputs,
        budget_bytes=10**12,
        solver=lambda problem, budget_bytes: Choice(((0, 2), (2, 4)), frozenset({2})),
        cost_model=CostModel(checkpoint_seconds=1e-3, keep_seconds=4e-4),
    )
    rows = p.segment_table()
    assert sum(r["recompute_seconds"] for r in rows) == pytest.approx(
        simulate(p.problem, Choice(p.segments, p.keep)).recompute_seconds
    )
    assert rows[1]["recompute_seconds"] - rows[0]["recompute_seconds"] == pytest.approx(
        4e-4 + p.problem.seconds[3] - p.problem.seconds[1], rel=1e-6
    )


def costly(seed: int):
    problem = random_problem(seed)
    return dataclasses.replace(problem, checkpoint_seconds=CALL, keep_seconds=KEEP)


@pytest.mark.parametrize("seed", range(12))
def test_optimal_finds_the_cheapest_plan_counting_the_calls(seed):
    problem = costly(seed)
    plans = all_plans(problem)
    results = [simulate(problem, plan) for plan in plans]
    for budget in budgets(problem, plans):
        least = min((r.recompute_seconds for r in results if r.peak_bytes <= budget), default=None)
        found = simulate(problem, SOLVERS["optimal"](problem, budget, keep=False))
        if least is None:
            assert found.peak_bytes > budget
            continue
        assert found.peak_bytes <= budget
        assert math.isclose(found.recompute_seconds, least, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_the_milp_finds_the_cheapest_choice_counting_calls_and_keeps(seed):
    """Against every valid (segments, keep set); ``optimal`` agrees within 1%."""
    pytest.importorskip("scipy")
    from planner.solvers.milp import milp_plan
    from test_milp import all_choices

    problem = costly(seed)
    choices = all_choices(problem)
    results = [simulate(problem, choice) for choice in choices]
    for budget in budgets(problem, choices)[::2]:
        least = min((r.recompute_seconds for r in results if r.peak_bytes <= budget), default=None)
        found = milp_plan(problem, budget)
        dp = simulate(problem, SOLVERS["optimal"](problem, budget))
        if least is None:
            assert not found.fits and dp.peak_bytes > budget
            continue
        assert found.fits and dp.peak_bytes <= budget
        assert math.isclose(found.recompute_seconds, least, rel_tol=1e-6, abs_tol=1e-9)
        assert found.bound_seconds <= least + 1e-9
        assert dp.recompute_seconds <= least * 1.01 + 1e-12


def test_costly_calls_make_optimal_choose_fewer_segments():
    """The cheapest plan with calls charged never has more segments than without (it would
    cost more and recompute no less), and on some budgets it has fewer."""
    fewer = 0
    for seed in range(12):
        problem = costly(seed)
        free = dataclasses.replace(problem, checkpoint_seconds=0.0, keep_seconds=0.0)
        for budget in budgets(problem):
            dear = SOLVERS["optimal"](problem, budget, keep=False)
            cheap = SOLVERS["optimal"](free, budget, keep=False)
            assert len(dear) <= len(cheap)
            fewer += len(dear) < len(cheap)
    assert fewer


def test_checkpoint_overheads_are_measured_positive_and_finite_on_cpu():
    model, inputs = chain()
    measured = checkpoint_overheads(model, inputs, repeat=5, blocks=16)
    assert set(measured) == {"checkpoint_seconds", "keep_seconds"}
    for seconds in measured.values():
        assert math.isfinite(seconds) and 0 < seconds < 1
    CostModel(**measured)  # accepted as it is


@pytest.mark.parametrize("value", [-1e-6, math.nan, math.inf])
def test_a_call_cost_that_is_negative_or_not_finite_is_refused(value):
    with pytest.raises(ValueError, match="checkpoint_overheads"):
        CostModel(checkpoint_seconds=value)
    with pytest.raises(ValueError, match="keep_seconds"):
        CostModel(keep_seconds=value)
