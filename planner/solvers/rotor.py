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

On chains (``is_chain``: each node's one storage read by the next node alone) of up to
``CHAIN_NODES`` nodes, a second dynamic program (``_Front``) follows the replay's rules
exactly, the early stop and each frame's holds included: it keeps, per suffix of each level,
every plan that no other beats at every kind of moment, which costs a vector of needs instead
of one number per memory level. Its plans join the candidates, so on those chains ``rotor``
finds a cheapest nested plan at every budget (tested against an exhaustive search). Its fronts
can grow exponentially with the chain: past ``FRONT_WORK`` comparisons it is given up, and the
other candidates remain.
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
        _KNOWN[problem] = _Known(
            [*chain_plans(problem), *table_plans(problem, cuts), *bisections(problem, every_cut)]
        )
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
    if not problem.size:  # a graph of no op (the model returns an input): nothing to nest
        return flat
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


# -- the exact front on chains --------------------------------------------------------------------

CHAIN_NODES = 12  # the exact front runs on chains up to this size (its fronts grow with it)
# Comparisons of entries the front may make before chain_plans gives it up (about a second):
# its fronts can grow exponentially with the chain (6 x (Linear, GELU): a million times this).
FRONT_WORK = 2_000_000
_NONE = -(10**18)  # no moment of that kind


def is_chain(problem: Problem) -> bool:
    """Whether ``problem`` is a chain the exact front describes: node ``k`` makes one storage,
    read by node ``k + 1`` alone (the last node's is the only graph output), saved by ``k``
    and/or ``k + 1`` (by ``k`` after making it, so a recompute stopping at ``k`` makes it
    again); no buffer copies, autocast casts or tensors kept on an autograd context."""
    n = problem.size
    if len(problem.storages) != n or any(problem.buffer_copies):
        return False
    return all(
        s.producer == k
        and s.readers == ((k + 1,) if k < n - 1 else ())
        and s.is_output == (k == n - 1)
        and set(s.savers) <= {k, k + 1}
        and bool(problem.saves_own[k]) == (k in s.savers)
        and (s.before_last_save or k not in s.savers)
        and not s.cast_cache
        and not s.held_by_context
        for k, s in enumerate(problem.storages)
    )


@dataclass(frozen=True)
class _Entry:
    """One plan of a level's suffix. ``need`` holds the suffix's highest live bytes of its own
    at each kind of moment (``_Front``'s indices); plans are compared by it, ``cost`` (recompute
    seconds) and ``calls`` (checkpoint calls of one run of the suffix's segments)."""

    need: tuple[int, ...]
    cost: float
    items: tuple[Nest, ...]
    active: bool  # a node in it runs in its level's recompute (the early stop lies in it)
    calls: int


class _FrontTooLarge(Exception):
    """The front outgrew the work it was given."""


class _Front:
    """The nested plans of a chain and their exact peaks and costs, by dynamic programming over
    suffixes of each level, keeping every plan no other beats at every kind of moment.

    A level is the forward (``top``) or the recompute of a segment ``(a, e)`` and what follows
    it; processing a suffix is: run its first item, process the rest, do the first item's
    backward. What the first item leaves live through the rest is added to the rest's moments,
    so a suffix needs its own live bytes at three kinds of moment: ``W``, when its segment runs
    whole (in the forward, or inside its parent's recompute: nothing saved, each inner call
    holding its input until it returns); ``R``, the level's own run (the forward, or the
    recompute, which holds the gradients pending at its trigger); ``B + p``, the backward of
    node ``p`` and the recomputes run just before it. The rules are ``planner.nested``'s,
    specialised to chains; ``tests/test_nested.py`` checks every plan of random chains against
    the replay.

    The input of a suffix (``x``, the storage of the node before it) is either held by the
    item before for the whole suffix (``"held"``: not counted here) or counted here, living:
    ``"plain"``, until its reader runs (or the call taking it returns), or until the backward of
    the node or segment saving it; ``"frame"``, a top-level segment's input, until the backward
    of the segment's first saving node; ``"inner"``, an inner segment's input, until the
    segment's recompute ends, or longer as ``"plain"``.
    """

    W, R, B = 0, 1, 2

    def __init__(self, problem: Problem, work: int | None = None):
        self.problem = problem
        self.work_left = work  # comparisons of entries left (None: no limit)
        n = self.n = problem.size
        storages = problem.storages
        self.bytes = [int(s.nbytes) for s in storages] + [0]  # [-1]: the model's input, fixed
        self.saves_own = [k in storages[k].savers for k in range(n)]
        self.saves_input = [k > 0 and k in storages[k - 1].savers for k in range(n)]
        self.saves = [bool(s) for s in problem.saves]
        self.workspace = [int(x) for x in problem.workspace]
        allocated = problem.activation_grad_alloc + problem.grad_bytes_at
        net = allocated - problem.activation_grad_free
        self.allocated = [int(x) for x in allocated]
        self.pending = [int(x) for x in np.concatenate((np.cumsum(net[::-1])[::-1][1:], [0]))]
        self.step = int(net.sum()) + problem.optimizer_step_bytes
        self.seconds = [float(x) for x in problem.seconds]
        self.call = float(problem.checkpoint_seconds)
        self._levels: dict[tuple, list[_Entry]] = {}
        self._segments: dict[tuple, list[_Entry]] = {}

    def savers(self, start: int, stop: int) -> list[int]:
        return [p for p in range(start, stop) if self.saves[p]]

    def _pareto(self, entries: list[_Entry]) -> list[_Entry]:
        """The entries no other beats: every way of combining them costs only more (the
        compositions add and take maxima), so the front stays exact."""
        kept: list[_Entry] = []
        for e in sorted(entries, key=lambda e: (e.cost, e.calls, e.need)):
            if self.work_left is not None:
                self.work_left -= len(kept)
                if self.work_left < 0:
                    raise _FrontTooLarge
            if not any(
                k.active == e.active
                and (k.calls <= e.calls or not self.call)
                and all(x <= y for x, y in zip(k.need, e.need))
                for k in kept
            ):
                kept.append(e)
        return kept

    def _backward(self, p: int) -> int:
        return self.pending[p] + self.allocated[p]

    def level(self, a: int, e: int, k: int, x: int, mode: str, top: bool) -> list[_Entry]:
        """The plans of suffix ``[k, e)`` of the level of segment ``(a, e)`` (``top``: the
        step), its input ``x`` bytes counted here as ``mode`` says."""
        key = (a, e, k, x, mode, top)
        if key not in self._levels:
            if k == e:
                entries = [_Entry((_NONE,) * (self.n + 2), 0.0, (), False, 0)]
            else:
                entries = [*self._stored(a, e, k, x, mode, top)]
                entries += self._checkpointed(a, e, k, x, mode, top)
            self._levels[key] = self._pareto(entries)
        return self._levels[key]

    def _lives(self, k: int, e: int, mode: str, saved_later: bool):
        """Where the input of a suffix starting at ``k`` lives beyond its first item's own run:
        (through the rest's run, at which backward positions ``p``). ``saved_later``: saved by
        the first item (a node saving its input, a segment that saves)."""
        if mode == "frame":
            first = next(iter(self.savers(k, e)), e)
            return True, lambda p: p >= first
        if saved_later:
            return True, lambda p: True
        return mode == "inner", lambda p: False

    def _stored(self, a, e, k, x, mode, top):
        """Node ``k`` runs at this level, saving what it saves."""
        size = self.n + 2
        made = self.bytes[k]
        own = made if self.saves_own[k] else 0
        rest_x = 0 if own or k + 1 == e else made
        in_rest, at = self._lives(k, e, mode, self.saves_input[k])
        for rest in self.level(a, e, k + 1, rest_x, "held" if own else "plain", top):
            runs = top or rest.active or (self.saves[k] and self.saves_own[k])
            need = [_NONE] * size
            if runs:
                need[self.R] = x + made + self.workspace[k]
            if rest.need[self.R] > _NONE:
                need[self.R] = max(need[self.R], rest.need[self.R] + (x if in_rest else 0) + own)
            for p in range(k + 1, e):
                if rest.need[self.B + p] > _NONE:
                    need[self.B + p] = rest.need[self.B + p] + (x if at(p) else 0) + own
            need[self.B + k] = self._backward(k) + (x if at(k) else 0) + (own if runs else 0)
            whole = self.bytes[k - 1] if k > a else 0
            need[self.W] = max(whole + made + self.workspace[k], rest.need[self.W])
            cost = rest.cost + (self.seconds[k] if runs and not top else 0.0)
            active = top or rest.active or self.saves[k]
            yield _Entry(tuple(need), cost, rest.items, active, rest.calls)

    def _checkpointed(self, a, e, k, x, mode, top):
        """Segment ``(k, f)`` at this level, for every ``f``, with each of its own plans."""
        size = self.n + 2
        for f in range(k + 1, e + 1):
            if ((k, f) == (a, e) and not top) or not self.problem.is_valid_segment(k, f):
                continue
            savers = self.savers(k, f)
            if savers:
                inner_mode = "frame" if top or mode == "frame" else "inner"
                inners = self.segment(k, f, x, inner_mode)
            else:
                inners = self.whole_only(k, f)
            in_rest, at = self._lives(k, e, mode, bool(savers))
            whole_input = self.bytes[k - 1] if k > a else 0
            rest_x = self.bytes[f - 1] if f < e else 0
            for inner in inners:
                calls = 1 + inner.calls
                run_cost = (0.0 if top else sum(self.seconds[k:f])) + self.call * calls
                for rest in self.level(a, e, f, rest_x, "plain", top):
                    runs = top or rest.active
                    need = [_NONE] * size
                    if runs:
                        need[self.R] = x + inner.need[self.W]
                    if rest.need[self.R] > _NONE:
                        need[self.R] = max(need[self.R], rest.need[self.R] + (x if in_rest else 0))
                    for p in range(f, e):
                        if rest.need[self.B + p] > _NONE:
                            need[self.B + p] = rest.need[self.B + p] + (x if at(p) else 0)
                    last = savers[-1] if savers else k - 1
                    for p in range(last + 1, f):  # after its last saver: no recompute yet
                        need[self.B + p] = self._backward(p) + (x if savers else 0)
                    for p in range(k, last + 1):
                        need[self.B + p] = inner.need[self.B + p]
                    need[self.W] = max(whole_input + inner.need[self.W], rest.need[self.W])
                    cost = rest.cost + inner.cost + (run_cost if runs else 0.0)
                    items = (Nest(k, f, inner.items), *rest.items)
                    yield _Entry(tuple(need), cost, items, True, rest.calls + calls)

    def segment(self, k: int, f: int, x: int, mode: str) -> list[_Entry]:
        """The plans of segment ``(k, f)``, which saves something: its run whole (``W``) and
        its recompute, run before the backward of its last saver, with the gradients pending
        there, and its backward (``B``); its input ``x`` bytes living as ``mode`` says."""
        key = (k, f, x, mode)
        if key not in self._segments:
            last = self.savers(k, f)[-1]
            entries = []
            for entry in self.level(k, f, k, x, mode, False):
                need = list(entry.need)
                if need[self.R] > _NONE:
                    run = need[self.R] + self.pending[last]
                    need[self.B + last] = max(need[self.B + last], run)
                need[self.R] = _NONE
                entries.append(_Entry(tuple(need), entry.cost, entry.items, True, entry.calls))
            self._segments[key] = self._pareto(entries)
        return self._segments[key]

    def whole_only(self, k: int, f: int) -> list[_Entry]:
        """The plans of segment ``(k, f)``, which saves nothing: it never recomputes, so only
        its run whole counts (and its calls)."""
        key = (k, f, 0, "whole")
        if key not in self._segments:
            entries = []
            for entry in self.level(k, f, k, 0, "held", False):
                need = (entry.need[self.W],) + (_NONE,) * (self.n + 1)
                entries.append(_Entry(need, 0.0, entry.items, True, entry.calls))
            self._segments[key] = self._pareto(entries)
        return self._segments[key]

    def plans(self) -> list[tuple[int, float, NestedChoice]]:
        """The plans no other beats in both peak and recompute: (the peak ``simulate``
        replays, the recompute seconds, the plan), by rising peak."""
        scored = sorted(
            (
                (int(self.problem.fixed_bytes + max(max(e.need[self.R :]), self.step)), e.cost, e)
                for e in self.level(0, self.n, 0, 0, "held", True)
            ),
            key=lambda scored: scored[:2],
        )
        result: list[tuple[int, float, NestedChoice]] = []
        for peak, cost, entry in scored:
            if not result or cost < result[-1][1]:
                result.append((peak, cost, NestedChoice(entry.items)))
        return result


def chain_plans(problem: Problem) -> list[NestedChoice]:
    """The exact front's plans (``_Front``) on chains of up to ``CHAIN_NODES`` nodes whose
    front stays within ``FRONT_WORK`` comparisons, else none: at every budget, a cheapest
    nested plan that fits is among them."""
    if not 0 < problem.size <= CHAIN_NODES or not is_chain(problem):
        return []
    try:
        return [plan for _, _, plan in _Front(problem, FRONT_WORK).plans()]
    except _FrontTooLarge:
        return []
