"""Nested checkpointing by dynamic programming over a chain of candidate cuts (Rotor family).

The order is split at candidate cuts into *stages*. Processing stages ``s..t-1`` (their input
held) either *stores* stage ``s`` (runs it saving, then processes ``s+1..t-1`` with what is
left) or *checkpoints* stages ``s..s'-1`` (runs them without saving, holds their input while
it processes ``s'..t-1``, then processes ``s..s'-1`` again, recursively: the nested segment's
own plan). Following Beaumont et al. (Rotor, "Optimal checkpointing for heterogeneous
chains"), with ``m`` the memory left::

    opt(s, t, m) = min( f(s) + opt(s+1, t, m - saved(s))        where m >= need(s),
                        min over s < s' < t of
                            f(s..s'-1) + opt(s', t, m - input(s) - held(s')) + opt(s, s', m) )

The chain model follows what ``planner.simulate`` replays, in stage-sized pieces:

* ``saved(s)``: what stage ``s`` makes that autograd saves (held from its forward to its
  backward when the stage is stored);
* ``need(s)``: storing a stage needs room for its heaviest node's backward (its saved
  tensors, what the backward allocates, and the gradients made by later nodes and not yet
  freed: parameter gradients, the gradients of pending activations) and for its heaviest
  node's forward (what it reads, creates and works in);
* ``held(s')``: of the tensors crossing cut ``s'``, those that outlive the stage it opens
  (saved by a later node, or read past that stage); a tensor read there once and unsaved is
  freed after it;
* ``input(s)``: a checkpoint holds its whole input while something it saved lives, even what
  the caller counted as transient: the rest of the crossing bytes at cut ``s``.

It is still an approximation (the early stop, workspaces of recompute, which tensors of a cut
are held by which frame), so the table is only a generator of candidates: the plan of every
memory level, plus the flat ``optimal`` plan and Chen-style bisections (for the lowest floor),
are replayed exactly by ``simulate`` and the cheapest that fits wins, or the lowest peak when
none fits. So at budgets a flat plan meets, the answer never costs more than ``optimal``'s.
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


def _backward_bytes(problem: Problem, cuts: list[int]) -> np.ndarray:
    """Per stage, what the backward of its heaviest node holds beyond the stage's saved
    tensors: what it allocates, plus the gradients made after it and not yet freed."""
    allocated = problem.activation_grad_alloc + problem.grad_bytes_at
    net = allocated - problem.activation_grad_free
    pending = np.concatenate((np.cumsum(net[::-1])[::-1][1:], [0]))
    heaviest = pending + allocated
    return np.array([max(int(heaviest[a:b].max()), 0) for a, b in zip(cuts, cuts[1:])])


def _forward_bytes(problem: Problem, cuts: list[int]) -> np.ndarray:
    """Per stage, the heaviest forward of its nodes: what it reads, creates and works in."""
    a = problem.storage_arrays
    reads = np.zeros(problem.size, dtype=np.int64)
    np.add.at(reads, a.read_node, a.nbytes[a.read_storage])
    heaviest = reads + problem.created_bytes + problem.workspace
    return np.array([int(heaviest[start:stop].max()) for start, stop in zip(cuts, cuts[1:])])


def _held(problem: Problem, cuts: list[int]) -> np.ndarray:
    """Per cut, the bytes crossing it that live past the stage it opens: saved by a node at or
    after it, or read beyond that stage (a tensor read only there, unsaved, is transient)."""
    a = problem.storage_arrays
    held = np.zeros(len(cuts), dtype=np.int64)
    saved_after = np.full(a.nbytes.size, -1, dtype=np.int64)
    np.maximum.at(saved_after, a.save_storage, a.save_node)
    for index, cut in enumerate(cuts[:-1]):
        stage_end = cuts[index + 1]
        crossing = (a.producer < cut) & (a.last_use >= cut)
        lives = (saved_after >= cut) | (a.last_use >= stage_end)
        held[index] = int(a.nbytes[crossing & lives].sum())
    return held


def table_plans(problem: Problem, cuts: list[int]) -> list[NestedChoice]:
    """The plan the recurrence chooses at every memory level (see the module docstring)."""
    k = len(cuts) - 1
    if k < 1:
        return []
    saved_per_node = problem.saved_bytes_per_node()
    seconds = np.array([problem.seconds[a:b].sum() for a, b in zip(cuts, cuts[1:])])
    saved = np.array([saved_per_node[a:b].sum() for a, b in zip(cuts, cuts[1:])])
    held = _held(problem, cuts)
    backward = _backward_bytes(problem, cuts)
    need = np.maximum(saved + backward, _forward_bytes(problem, cuts))
    unit = max(int(saved.sum() + backward.max(initial=0)), 1) / LEVELS
    saved_units = np.ceil(saved / unit).astype(int)
    need_units = np.ceil(need / unit).astype(int)
    held_units = np.ceil(held / unit).astype(int)
    input_units = np.ceil((problem.cut_bytes[cuts] - held) / unit).astype(int)
    prefix = np.concatenate([[0.0], np.cumsum(seconds)])

    # opt[s, t] and arg[s, t]: the least cost of stages s..t-1 at each memory level, and the
    # first stage s' of the checkpointed span chosen there (-1: stage s stored). Each (s, t)
    # weighs every s' at once; of equal costs the stored stage wins, then the smallest s'.
    opt = np.full((k + 1, k + 1, LEVELS + 1), np.inf)
    arg = np.full((k + 1, k + 1, LEVELS + 1), -1)
    levels = np.arange(LEVELS + 1)
    valid = np.array([[a < b and problem.is_valid_segment(a, b) for b in cuts] for a in cuts])
    for s in range(k):
        opt[s, s + 1] = np.where(levels >= need_units[s], seconds[s], np.inf)
    for length in range(2, k + 1):
        for s in range(0, k - length + 1):
            t = s + length
            store = seconds[s] + _shift(opt[s + 1, t], saved_units[s])
            store[levels < need_units[s]] = np.inf
            spans = np.flatnonzero(valid[s, s + 1 : t]) + s + 1  # the s' of valid segments
            if not spans.size:
                opt[s, t] = store
                continue
            charge = input_units[s] + held_units[spans]
            source = levels - charge[:, None]  # opt[s', t] at m - charge, as _shift
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
            m -= int(input_units[s] + held_units[s2])
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
