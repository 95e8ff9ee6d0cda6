"""Nested checkpointing by dynamic programming over a chain of candidate cuts (Rotor family).

The order is split at candidate cuts into *stages*. Processing stages ``s..t-1`` (their input
held) either *stores* stage ``s`` (runs it saving, then processes ``s+1..t-1`` with what is
left) or *checkpoints* stages ``s..s'-1`` (runs them without saving, holds the tensors crossing
cut ``s'``, processes ``s'..t-1``, then processes ``s..s'-1`` again, recursively: the nested
segment's own plan). Following Beaumont et al. (Rotor, "Optimal checkpointing for
heterogeneous chains"), with ``m`` the memory left::

    opt(s, t, m) = min( f(s) + opt(s+1, t, m - saved(s)),
                        min over s < s' < t of
                            f(s..s'-1) + opt(s', t, m - cut(s')) + opt(s, s', m) )

Cuts crossed by several tensors are handled as one boundary of their total bytes. The chain
model is an approximation of ``planner.simulate`` (it ignores gradients, workspaces and the
early stop), so the table is only a generator of candidates: the plan of every memory level,
plus the flat ``optimal`` plan and Chen-style bisections (for the lowest floor), are replayed
exactly by ``simulate`` and the cheapest that fits wins, or the lowest peak when none fits.
So at budgets a flat plan meets, the answer never costs more than ``optimal``'s.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field

import numpy as np

from planner.nested import Nest, NestedChoice
from planner.problem import Problem
from planner.simulate import Choice, Segments, Simulation, simulate
from planner.solvers import SOLVERS, register

MAX_STAGES = 48  # candidate cuts searched (evenly spread among the allowed ones beyond that)
LEVELS = 64  # memory levels of the table


def _candidate_cuts(problem: Problem) -> list[int]:
    """Allowed cuts (0 and n included), at most ``MAX_STAGES + 1`` evenly spread."""
    n = problem.size
    allowed = [int(c) for c in np.flatnonzero(problem.cut_allowed) if 0 < c < n]
    if len(allowed) > MAX_STAGES - 1:
        picks = np.linspace(0, len(allowed) - 1, MAX_STAGES - 1).round().astype(int)
        allowed = [allowed[i] for i in sorted(set(picks.tolist()))]
    return [0, *allowed, n]


def _shift(values: np.ndarray, by: int) -> np.ndarray:
    """``values[m - by]`` at each level ``m`` (infinite where ``m < by``)."""
    if by <= 0:
        return values
    shifted = np.full_like(values, np.inf)
    if by < values.size:
        shifted[by:] = values[:-by]
    return shifted


def table_plans(problem: Problem, cuts: list[int]) -> list[NestedChoice]:
    """The plan the recurrence chooses at every memory level (see the module docstring)."""
    k = len(cuts) - 1
    if k < 1:
        return []
    saved_per_node = problem.saved_bytes_per_node()
    seconds = np.array([problem.seconds[a:b].sum() for a, b in zip(cuts, cuts[1:])])
    saved = np.array([saved_per_node[a:b].sum() for a, b in zip(cuts, cuts[1:])])
    crossing = problem.cut_bytes[cuts]
    unit = max(int(saved.sum()), 1) / LEVELS
    saved_units = np.ceil(saved / unit).astype(int)
    cut_units = np.ceil(crossing / unit).astype(int)
    prefix = np.concatenate([[0.0], np.cumsum(seconds)])

    # opt[s, t] and arg[s, t]: the least cost of stages s..t-1 at each memory level, and the
    # first stage s' of the checkpointed span chosen there (-1: stage s stored). Each (s, t)
    # weighs every s' at once; of equal costs the stored stage wins, then the smallest s'.
    opt = np.full((k + 1, k + 1, LEVELS + 1), np.inf)
    arg = np.full((k + 1, k + 1, LEVELS + 1), -1)
    levels = np.arange(LEVELS + 1)
    valid = np.array([[a < b and problem.is_valid_segment(a, b) for b in cuts] for a in cuts])
    for s in range(k):
        opt[s, s + 1] = np.where(levels >= saved_units[s], seconds[s], np.inf)
    for length in range(2, k + 1):
        for s in range(0, k - length + 1):
            t = s + length
            store = seconds[s] + _shift(opt[s + 1, t], saved_units[s])
            spans = np.flatnonzero(valid[s, s + 1 : t]) + s + 1  # the s' of valid segments
            if not spans.size:
                opt[s, t] = store
                continue
            source = levels - cut_units[spans][:, None]  # opt[s', t] at m - cut(s'), as _shift
            after = np.where(source >= 0, opt[spans[:, None], t, np.maximum(source, 0)], np.inf)
            cost = (prefix[spans] - prefix[s])[:, None] + after + opt[s, spans]
            first = cost.argmin(axis=0)
            lowest = cost[first, levels]
            better = lowest < store
            opt[s, t] = np.where(better, lowest, store)
            arg[s, t] = np.where(better, spans[first], -1)

    def items(s: int, t: int, m: int) -> tuple[Nest, ...]:
        result: list[Nest] = []
        while s < t:
            s2 = int(arg[s, t][m])
            if s2 < 0:  # stage s stored at this level
                m -= int(saved_units[s])
                s += 1
                continue
            result.append(Nest(cuts[s], cuts[s2], items(s, s2, m)))
            m -= int(cut_units[s2])
            s = s2
        return tuple(result)

    plans = {NestedChoice(items(0, k, m)) for m in range(LEVELS + 1) if np.isfinite(opt[0, k][m])}
    return sorted(plans, key=repr)


def bisections(problem: Problem, cuts: list[int]) -> list[NestedChoice]:
    """Chen's recursion (section 4.3): maximal valid segments, each halved at a candidate cut
    recursively, to every depth: the lowest floors, at ``O(log n)`` boundaries held. Each
    half is cut at the cheapest boundary (fewest bytes crossing) in the middle half."""

    def halve(start: int, stop: int, depth: int) -> Nest:
        inside = cuts[bisect.bisect_right(cuts, start) : bisect.bisect_left(cuts, stop)]
        middle, quarter = (start + stop) / 2, (stop - start) / 4
        central = [c for c in inside if abs(c - middle) <= quarter] or inside
        ranked = sorted(central, key=lambda c: (int(problem.cut_bytes[c]), abs(c - middle)))
        for c in ranked:
            if depth and problem.is_valid_segment(start, c) and problem.is_valid_segment(c, stop):
                return Nest(start, stop, (halve(start, c, depth - 1), halve(c, stop, depth - 1)))
        return Nest(start, stop)

    top, start = [], 0
    for a, b in zip(cuts, cuts[1:]):
        if not problem.is_valid_segment(start, b):
            if start < a and problem.is_valid_segment(start, a):
                top.append((start, a))
            start = a if problem.is_valid_segment(a, b) else b
    if start < cuts[-1] and problem.is_valid_segment(start, cuts[-1]):
        top.append((start, cuts[-1]))
    depth = int(np.ceil(np.log2(max(len(cuts), 2))))
    return [NestedChoice(tuple(halve(a, b, d) for a, b in top)) for d in range(depth + 1)]


@dataclass
class _Known:
    """What rotor works out once per problem: its nested candidates (the table's plans and the
    bisections depend on the graph alone) and the replays of nested plans, which are slow and
    asked for again by ``auto``, ``lowest_peak`` and every budget of a frontier."""

    candidates: list[NestedChoice]
    replays: dict[NestedChoice, Simulation] = field(default_factory=dict)


_KNOWN: weakref.WeakKeyDictionary[Problem, _Known] = weakref.WeakKeyDictionary()


def _known(problem: Problem) -> _Known:
    if problem not in _KNOWN:
        cuts = _candidate_cuts(problem)
        every_cut = [0, *(int(c) for c in np.flatnonzero(problem.cut_allowed)[1:-1]), problem.size]
        _KNOWN[problem] = _Known([*table_plans(problem, cuts), *bisections(problem, every_cut)])
    return _KNOWN[problem]


def replay(problem: Problem, choice) -> Simulation:
    """``simulate(problem, choice)``, remembered per problem for nested plans."""
    if not isinstance(choice, NestedChoice):
        return simulate(problem, choice)
    replays = _known(problem).replays
    if choice not in replays:
        replays[choice] = simulate(problem, choice)
    return replays[choice]


@register("rotor")
def solve(
    problem: Problem, budget_bytes: int, *, flat=None, **options
) -> NestedChoice | Choice | Segments:
    """The cheapest plan that fits among the table's, the bisections and ``flat`` (a flat plan
    already found; ``optimal``'s when not given, run with ``options``); the lowest peak among
    them when none fits (see the module docstring)."""
    if flat is None:
        flat = SOLVERS["optimal"](problem, budget_bytes, **options)
    # Each distinct plan once, in order: the first of equals wins.
    candidates = dict.fromkeys([flat, *_known(problem).candidates])
    best: NestedChoice | Choice | Segments = flat
    best_key = None
    for candidate in candidates:
        result = replay(problem, candidate)
        fits = result.peak_bytes <= budget_bytes
        key = (not fits, result.recompute_seconds if fits else result.peak_bytes)
        if best_key is None or key < best_key:
            best, best_key = candidate, key
    return best
