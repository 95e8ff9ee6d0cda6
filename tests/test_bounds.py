"""The recompute lower bound (``planner.bounds``) against exhaustive search, the exact MILP and
every solver: never above the least recompute of any plan that fits, zero where nothing needs
recomputing, rising as the peak falls, and equal to the optimum somewhere (not trivially 0).

``planner.simulate`` is the judge of what fits. The generated problems are varied the ways the
bound treats specially: weight casts autocast caches, storages kept on an autograd context, a
loss node with its own bytes.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import pytest

from planner.bounds import recompute_lower_bound
from planner.simulate import Choice, simulate, validate_choice
from planner.solvers import SOLVERS

pytest.importorskip("scipy")
from planner.solvers.milp import milp_plan
from problems import all_nested_plans, all_plans, random_problem, with_random_phases

SEEDS = range(8)


def variants(problem):
    """``problem`` as generated, and with what the bound treats apart added to it."""
    n = problem.size
    casts = tuple(
        dataclasses.replace(s, cast_cache=k % 2 == 0) for k, s in enumerate(problem.storages)
    )
    contexts = tuple(
        dataclasses.replace(s, held_by_context=k % 3 == 1) for k, s in enumerate(problem.storages)
    )
    checkpointable = problem.checkpointable.copy()
    checkpointable[n - 1] = False
    # Backward in phases, where what a node saved goes function by function.
    phased = with_random_phases(problem, np.random.default_rng(n))
    return {
        "plain": problem,
        "casts": dataclasses.replace(problem, storages=casts),
        "contexts": dataclasses.replace(problem, storages=contexts),
        "phased": phased,
        "phased contexts": dataclasses.replace(
            phased,
            storages=tuple(
                dataclasses.replace(s, held_by_context=k % 3 == 1)
                for k, s in enumerate(phased.storages)
            ),
        ),
        "loss": dataclasses.replace(
            problem,
            has_loss=True,
            checkpointable=checkpointable,
            loss_bytes=3,
            default_loss_high=2,
        ),
    }


def every_choice(problem):
    """Every valid flat plan (segments, and any keep set ``validate_choice`` accepts) and every
    nested plan."""
    for segments in all_plans(problem):
        inside = [x for start, stop in segments for x in range(start, stop)]
        for mask in range(1 << len(inside)):
            keep = frozenset(x for i, x in enumerate(inside) if mask >> i & 1)
            try:
                yield validate_choice(problem, Choice(segments, keep))
            except ValueError:
                continue
    yield from all_nested_plans(problem)


def least(simulations, peak: int, cost: str) -> float:
    """The least recompute of the plans that fit ``peak`` (checkpoint calls left out)."""
    fitting = [s for s in simulations if s.peak_bytes <= peak]
    if cost == "flops":
        return min((s.recompute_flops for s in fitting), default=math.inf)
    return min((s.recompute_seconds - s.call_seconds for s in fitting), default=math.inf)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "variant", ["plain", "casts", "contexts", "phased", "phased contexts", "loss"]
)
def test_never_above_the_least_recompute_of_every_plan_that_fits(seed, variant):
    problem = variants(random_problem(seed, nodes=6))[variant]
    simulations = [simulate(problem, choice) for choice in every_choice(problem)]
    for peak in sorted({s.peak_bytes for s in simulations}):
        for cost in ("flops", "seconds"):
            bound = recompute_lower_bound(problem, peak, cost=cost)
            assert bound <= least(simulations, peak, cost) * (1 + 1e-9) + 1e-9


@pytest.mark.parametrize("seed", SEEDS)
def test_below_the_exact_milp_and_every_solver(seed):
    check_against_the_milp_and_the_solvers(seed)


def test_equal_to_the_exact_milp_somewhere():
    """Not a trivial 0: on some of these graphs the bound meets the optimum where it is > 0."""
    assert any(any(check_against_the_milp_and_the_solvers(seed)) for seed in SEEDS)


def check_against_the_milp_and_the_solvers(seed: int) -> list[bool]:
    """Check the bound against the MILP's optimum and every solver's plan at five budgets;
    return, per budget, whether it equals a nonzero optimum."""
    problem = random_problem(seed, nodes=7)
    baseline = simulate(problem, ()).peak_bytes
    lowest = min(simulate(problem, plan).peak_bytes for plan in all_plans(problem))
    tight = []
    for budget in np.linspace(lowest, baseline, 5).astype(int).tolist():
        bound = recompute_lower_bound(problem, budget, cost="seconds")
        exact = milp_plan(problem, budget, keep=True)
        assert exact.status == "optimal" and exact.fits
        assert bound <= exact.recompute_seconds + 1e-9
        tight.append(bound > 0 and math.isclose(bound, exact.recompute_seconds, rel_tol=1e-6))
        for name, solver in SOLVERS.items():
            plan = simulate(problem, solver(problem, budget))
            if plan.peak_bytes <= budget:
                assert bound <= plan.recompute_seconds - plan.call_seconds + 1e-9, name
    return tight


def test_tight_on_a_chain_whose_saved_storages_are_all_made_by_their_readers():
    """Nodes that save only their own outputs, read by the next node alone: holding a storage
    or recomputing its producer (whose input is then held) is the whole choice, and the bound
    is the optimum at every budget."""
    problem = random_problem(3, nodes=6, chain=True)
    simulations = [simulate(problem, choice) for choice in every_choice(problem)]
    peaks = sorted({s.peak_bytes for s in simulations})
    tight = [
        math.isclose(recompute_lower_bound(problem, p), least(simulations, p, "flops"))
        for p in peaks
    ]
    assert any(t and least(simulations, p, "flops") > 0 for t, p in zip(tight, peaks))


@pytest.mark.parametrize("seed", SEEDS)
def test_zero_at_the_no_checkpointing_peak_and_rising_as_the_peak_falls(seed):
    problem = random_problem(seed)
    baseline = simulate(problem, ()).peak_bytes
    assert recompute_lower_bound(problem, baseline) == 0.0
    bounds = [recompute_lower_bound(problem, peak) for peak in range(baseline, 0, -4)]
    assert bounds == sorted(bounds)
    assert bounds[-1] == math.inf  # below fixed memory nothing fits


def test_a_zoo_model_below_the_solvers_and_above_zero_where_they_recompute():
    from planner import zoo
    from planner.pipeline import prepare
    from planner.solvers.auto import lowest_peak

    problem = prepare(*zoo.build("gpt", layers=2, d_model=64, heads=2, seq=64, batch=2))[1]
    baseline = simulate(problem, ()).peak_bytes
    assert recompute_lower_bound(problem, baseline) == 0.0
    lowest = lowest_peak(problem).peak_bytes
    for budget in np.linspace(lowest, baseline, 4).astype(int).tolist():
        flops = recompute_lower_bound(problem, budget)
        seconds = recompute_lower_bound(problem, budget, cost="seconds")
        for name in ("optimal", "greedy"):
            plan = simulate(problem, SOLVERS[name](problem, budget))
            if plan.peak_bytes <= budget:
                assert flops <= plan.recompute_flops, name
                assert seconds <= plan.recompute_seconds - plan.call_seconds, name
    assert recompute_lower_bound(problem, lowest) > 0
    assert recompute_lower_bound(problem, lowest, cost="seconds") > 0


def test_unknown_cost_and_missing_scipy(monkeypatch):
    problem = random_problem(1)
    with pytest.raises(ValueError, match="flops"):
        recompute_lower_bound(problem, 10**6, cost="bytes")
    for name in ("scipy", "scipy.optimize", "scipy.sparse"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install scipy"):
        recompute_lower_bound(problem, 10**6)
