"""``"auto"``: run the strategies and keep the cheapest plan that fits the budget.

``choose`` is how the pipeline, ``frontier`` and ``plan_batch`` run any solver by name: for
``"auto"`` it also reports which strategy won (``"auto:greedy"``). ``lowest_peak`` is the
minimum budget ``plan`` accepts and reports.
"""

from __future__ import annotations

import weakref

from planner.errors import PlanningError
from planner.gcpause import paused_collection
from planner.nested import NestedChoice
from planner.problem import Problem
from planner.simulate import Choice, Segments, Simulation, simulate
from planner.solvers import SOLVERS, get_solver, register
from planner.solvers.common import checked_result, rank, segments_between
from planner.solvers.rotor import replay

AUTO_OPTIMAL_MAX_NODES = 50_000
AUTO_OPTIMAL_SECONDS = 30.0  # auto's time limit for optimal (its best plan by then is kept)
# auto tries nested plans (rotor) when no flat plan fits, on graphs up to this size: its
# step-by-step replays take about 0.5 s at 400 nodes and 13 s at 4,000.
AUTO_ROTOR_MAX_NODES = 2_000


_LOWEST: weakref.WeakKeyDictionary[Problem, tuple] = weakref.WeakKeyDictionary()


def lowest_peak_plan(problem: Problem) -> tuple[Segments | Choice | NestedChoice, Simulation]:
    """The candidate plan with the lowest simulated peak, among those the strategies consider.

    Worked out once per problem: ``auto`` asks when no plan fits, and ``plan`` again for its
    error message; ``frontier`` starts from it."""
    if problem not in _LOWEST:
        _LOWEST[problem] = _lowest_peak_plan(problem)
    return _LOWEST[problem]


def lowest_flat_plan(problem: Problem) -> tuple[Segments | Choice | NestedChoice, Simulation]:
    """The flat plan (no nesting) with the lowest simulated peak among the strategies' own."""
    candidates = [
        SOLVERS["greedy"](problem, 0),
        segments_between(problem, problem.articulation_cuts),
        segments_between(problem, [c for c in range(problem.size) if problem.cut_allowed[c]]),
    ]
    if "optimal" in SOLVERS and problem.size <= AUTO_OPTIMAL_MAX_NODES:
        candidates.append(SOLVERS["optimal"](problem, 0, time_limit=AUTO_OPTIMAL_SECONDS))
    return min(((c, simulate(problem, c)) for c in candidates), key=lambda r: r[1].peak_bytes)


def _lowest_peak_plan(problem: Problem) -> tuple[Segments | Choice | NestedChoice, Simulation]:
    lowest = lowest_flat_plan(problem)
    if "rotor" in SOLVERS and problem.size <= AUTO_ROTOR_MAX_NODES:  # nested: a lower floor
        nested = SOLVERS["rotor"](problem, 0, flat=lowest[0])
        lowest = min(lowest, (nested, replay(problem, nested)), key=lambda r: r[1].peak_bytes)
    return lowest


def lowest_peak(problem: Problem) -> Simulation:
    """The lowest simulated peak found: the minimum budget ``plan`` reports and accepts."""
    return lowest_peak_plan(problem)[1]


def auto(problem: Problem, budget: int, **options) -> tuple[str, Segments | Choice | NestedChoice]:
    """(``"auto:<strategy>"``, choice): the cheapest plan of the strategies that fits.

    Runs ``optimal`` on graphs of at most ``AUTO_OPTIMAL_MAX_NODES`` nodes (its search takes
    about 1-3 s at 10,000-20,000 nodes on two CPU cores, growing about linearly; past
    ``AUTO_OPTIMAL_SECONDS`` it stops with the best plan found by then), then ``greedy`` and
    ``sqrt_n``. Name ``solver="optimal"`` to run it on larger graphs, without a time limit.
    """
    best: tuple[tuple[bool, float], str, Segments | Choice | NestedChoice] | None = None
    unbeatable = (False, 0.0) if problem.seconds.min(initial=0.0) >= 0 else None
    for name in ("optimal", "greedy", "sqrt_n"):
        if best is not None and best[0] == unbeatable:
            break  # it fits and recomputes nothing: no later strategy can rank before it
        if name not in SOLVERS or (name == "optimal" and problem.size > AUTO_OPTIMAL_MAX_NODES):
            continue
        limit = {"time_limit": AUTO_OPTIMAL_SECONDS} if name == "optimal" else {}
        segments = checked_result(
            name, SOLVERS[name](problem, budget, **{**limit, **options}), problem
        )
        key = rank(simulate(problem, segments), budget)
        if best is None or key < best[0]:
            best = (key, f"auto:{name}", segments)
    if best is None:
        raise PlanningError(
            "solver='auto' runs optimal, greedy and sqrt_n, and none of them is in "
            "planner.solvers.SOLVERS: name a registered solver with solver="
        )
    if best[0][0] and "rotor" in SOLVERS and problem.size <= AUTO_ROTOR_MAX_NODES:
        found = SOLVERS["rotor"](problem, budget, flat=best[2], **options)
        nested = checked_result("rotor", found, problem)
        if replay(problem, nested).peak_bytes <= budget:  # no flat plan fits; a nested one
            return "auto:rotor", nested
    if best[0][0]:  # nothing fits: the plan with the lowest peak may still (the stated minimum)
        segments, result = lowest_peak_plan(problem)
        if result.peak_bytes <= budget:
            return "auto:lowest_peak", segments
    return best[1], best[2]


@register("auto")
def solve(problem: Problem, budget_bytes: int, **options) -> Segments | Choice | NestedChoice:
    return auto(problem, budget_bytes, **options)[1]


@paused_collection()
def choose(
    problem: Problem, budget: int, solver="auto", **options
) -> tuple[str, Segments | Choice | NestedChoice]:
    """Run ``solver`` (a registered name such as ``"auto"``, or a callable) and return (name
    that ran, choice): plain segments, or a ``Choice`` when the solver keeps nodes inside them.
    The registered ``"auto"`` names the strategy that won (``"auto:greedy"``)."""
    name, solver_fn = get_solver(solver)
    if solver_fn is solve:
        return auto(problem, budget, **options)
    return name, checked_result(name, solver_fn(problem, budget, **options), problem)
