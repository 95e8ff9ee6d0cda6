"""Chen et al. 2016, section 4.1: checkpoint about sqrt(n) equal segments.

Boundaries are taken from the articulation cuts when the graph has enough of them (one tensor
crosses each), else from every allowed cut. The budget is ignored: this is the fixed rule.
"""

from __future__ import annotations

import math

import numpy as np

from planner.problem import Problem
from planner.simulate import Segments
from planner.solvers import register
from planner.solvers.common import segments_between


@register("sqrt_n")
def solve(problem: Problem, budget_bytes: int, **options) -> Segments:
    n = problem.size
    if n < 2:
        return ()
    allowed = [c for c in problem.articulation_cuts if problem.cut_allowed[c] and 0 < c < n]
    if len(allowed) < math.isqrt(n):
        allowed = [int(c) for c in np.flatnonzero(problem.cut_allowed) if 0 < c < n]
    if not allowed:
        return segments_between(problem, ())
    count = max(1, round(math.sqrt(len(allowed))))
    step = len(allowed) / (count + 1)
    chosen = {allowed[min(len(allowed) - 1, round(step * (k + 1)))] for k in range(count)}
    return segments_between(problem, chosen)
