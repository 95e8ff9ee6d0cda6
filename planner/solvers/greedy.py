"""Chen et al. 2016, algorithm 2 (greedy), with the budget search of section 4.2.

Walk the nodes accumulating saved bytes; once the running total passes a threshold ``b``, cut at
the next allowed cut. Each threshold gives a plan; the search tries thresholds from the largest
node's saved bytes to the total and keeps the cheapest plan whose simulated peak fits the budget
(or, when none fits, the one with the lowest peak, so the caller can report it).
"""

from __future__ import annotations

import weakref

import numpy as np

from planner.problem import Problem
from planner.simulate import Segments, simulate
from planner.solvers import register
from planner.solvers.common import least_recompute_seconds, rank, segments_between


def greedy_cuts(problem: Problem, threshold: float) -> list[int]:
    saved = problem.saved_bytes_per_node()
    cuts, running = [], 0
    for position in range(1, problem.size):
        running += saved[position - 1]
        if running > threshold and problem.cut_allowed[position]:
            cuts.append(position)
            running = 0
    return cuts


# Plans found, per problem and (budget, thresholds): ``optimal`` replays greedy's plan as a
# candidate and ``auto`` runs greedy after it, at the same budget (25 replays each).
_FOUND: weakref.WeakKeyDictionary[Problem, dict[tuple[int, int], Segments]] = (
    weakref.WeakKeyDictionary()
)


@register("greedy")
def solve(problem: Problem, budget_bytes: int, *, thresholds: int = 24, **options) -> Segments:
    found = _FOUND.setdefault(problem, {})
    key = (int(budget_bytes), thresholds)
    if key not in found:
        found[key] = _search(problem, budget_bytes, thresholds)
    return found[key]


def _search(problem: Problem, budget_bytes: int, thresholds: int) -> Segments:
    """The cheapest plan of the threshold search that fits, else the one of lowest peak."""
    saved = problem.saved_bytes_per_node()
    total = float(saved.sum())
    if total <= 0:
        return ()
    low = max(float(saved.max()), total / problem.size)
    candidates = [()] + [
        segments_between(problem, greedy_cuts(problem, b))
        for b in np.geomspace(low, total, thresholds)
    ]
    best: Segments = ()
    best_key = None
    for segments in dict.fromkeys(candidates):
        if best_key is not None and not best_key[0]:  # a plan fits: replay only a cheaper one
            if least_recompute_seconds(problem, segments) >= best_key[1]:
                continue
        key = rank(simulate(problem, segments), budget_bytes)
        if best_key is None or key < best_key:
            best, best_key = segments, key
    return best
