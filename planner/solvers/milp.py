"""Least recompute under a budget as a mixed-integer linear program, solved by HiGHS (scipy).

An independent second exact solver: it shares no code with the dynamic program of
``planner.solvers.optimal``, so on small graphs each checks the other, and its dual bound is a
certified lower bound on the least recompute for the budget even when a time limit stops it.
It chooses segments and, with ``keep=True`` (the default), the nodes kept inside them
(``planner.simulate.Choice``) together. The formulation reproduces ``planner.simulate``
exactly; docs/solvers.md derives it. In short:

* ``z[c, i]`` (binary) is 1 when node ``i`` lies in a checkpointed segment that starts at cut
  ``c``; it is non-increasing in ``i``, and the segment ``[c, b)`` is chosen exactly when
  ``x[c, b] = z[c, b-1] - z[c, b]`` is 1 (allowed cuts only; at most one segment per node).
* ``a[s, i]`` (continuous in [0, 1]) is 1 when storage ``s`` is still held for backward when
  backward reaches node ``i``: the simulator keeps a storage until the first (in position
  order) of its *release points*, a saver outside every segment or the start of another
  segment that reads or saves it; so ``a[s, i]`` is the OR of the release points at or before
  ``i``, written as lower bounds. Memory only grows with ``a``, so an optimum takes the OR.
* Every high point of the replay is one row ``live <= peak``: a forward node (created minus
  freed bytes plus workspace, plus the storages kept for backward), a backward node (gradients,
  storages held, and recomputed copies kept by a saver at or before it in the same segment),
  and the recompute of each segment (what is held then plus the segment's own recompute peak,
  a constant of the segment). Buffer copies (``Problem.buffer_copy_bytes``) weigh on the
  forward rows from the segment's start and on the backward rows until its recompute (running
  sums over the chosen segments), and twice on its recompute, which also holds what its
  triggering backward has allocated (``grad_before_unpack``) and, when it runs before the
  first backward step, the loss (``loss_bytes``).
* With keeps, ``y[k]`` (binary) is 1 when node ``k`` is kept, within the rules of
  ``validate_choice`` (rows); ``t[b, k]`` (continuous, bounded below like ``a``) when it is
  kept in the segment ending at ``b``. A kept node's cache is held from its forward to its
  segment's recompute, which then runs it not, and moves the recompute's peak: the recompute
  is one row per step instead of one at its peak.

The objective is the recompute time of the chosen segments (each a constant of its segment),
less that of the kept nodes. With ``budget_bytes=None`` the program minimises the peak instead.

scipy is optional: ``pip install scipy`` (or ``pip install 'torch-activation-planner[milp]'``).
The model has about n**2 / 2 binaries for ``n`` nodes (plus ``n`` and about n**2 / 2 more
variables with keeps, and n**2 / 2 recompute rows instead of ``n``): use it on graphs of up to
a few hundred nodes (segments alone) or a few dozen (with keeps).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np

from planner.problem import Problem
from planner.simulate import Choice, Segments, simulate
from planner.solvers import register

__all__ = ["MilpResult", "milp_plan", "solve"]


def _scipy_milp():
    """scipy's ``milp`` and its helpers; a clear error when scipy is missing."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_array
    except ImportError as error:
        raise ImportError(
            "the 'milp' solver needs scipy (HiGHS): pip install scipy "
            "(or pip install 'torch-activation-planner[milp]')"
        ) from error
    return milp, Bounds, LinearConstraint, csr_array


@dataclass(frozen=True)
class MilpResult:
    """What one MILP solve established, judged again by ``planner.simulate``.

    Attributes
    ----------
    segments, keep
        The decoded plan: its segments, ``()`` when the solver found none, and the nodes kept
        inside them (empty unless solved with ``keep=True``); ``choice`` is both together.
    status
        ``"optimal"`` (proven within the relative gap), ``"time limit"`` (stopped early; the
        plan, if any, is the best found), ``"infeasible"`` (proven: no plan fits the budget).
    fits
        Whether ``simulate`` puts the plan's peak within the budget (always checked, never
        assumed from the model).
    peak_bytes, recompute_seconds
        The plan's simulated peak and recompute time.
    bound_seconds
        A lower bound on the least recompute time of any plan that fits the budget: the
        solver's dual bound, valid even when stopped by the time limit; ``inf`` when no plan
        fits.
    program_peak_bytes
        The program's own peak for the plan (fixed memory included), found only when the plan
        does not fit (``None`` otherwise): the program accepted it within the budget, so a
        value other than ``peak_bytes`` means the formulation and ``simulate`` disagree, a bug.
    """

    segments: Segments
    status: str
    fits: bool
    peak_bytes: int
    recompute_seconds: float
    bound_seconds: float
    keep: frozenset[int] = frozenset()
    program_peak_bytes: int | None = None

    @property
    def choice(self) -> Choice:
        """The plan as a ``Choice`` (segments and kept nodes), as ``simulate`` takes it."""
        return Choice(self.segments, self.keep)


@dataclass(frozen=True)
class _Storage:
    """Plan-independent facts about one storage that the rows need."""

    nbytes: int
    producer: int
    touches: tuple[int, ...]  # readers and savers, sorted: where a release can come from
    readers: tuple[int, ...]
    to_stop: bool  # a recomputed copy lives to the recompute's stop (graph output, weight cast)
    savers: tuple[int, ...]
    first_saver: int  # n when nothing saves it
    freed_in_forward: int  # where the forward frees it when nothing keeps it
    before_last_save: bool  # made again by a recompute that stops at its producer


@dataclass(frozen=True)
class _Formulation:
    """The program, in scipy's terms, plus how to read a plan out of a solution.

    ``z`` maps ``(c, i)`` to the column of ``z[c, i]``, ``y`` a node to the column of
    ``y[k]`` (kept); ``peak`` is the column of the peak (in
    units of ``scale`` bytes above fixed memory); ``seconds`` the objective coefficients of the
    recompute time (in units of ``time_scale`` seconds).
    """

    seconds: np.ndarray
    peak: int
    matrix: object
    row_lower: np.ndarray
    row_upper: np.ndarray
    integrality: np.ndarray
    z: dict[tuple[int, int], int]
    y: dict[int, int]
    scale: float
    time_scale: float

    def decode(self, x: np.ndarray) -> Choice:
        """The plan of a solution: segments ``[c, b)`` where ``z[c, b-1]`` is the last 1 from
        ``c``, and the nodes whose ``y`` is 1."""
        last: dict[int, int] = {}
        for (c, i), column in self.z.items():
            if x[column] > 0.5:
                last[c] = max(last.get(c, c), i)
        segments = tuple(sorted((c, i + 1) for c, i in last.items()))
        return Choice(segments, frozenset(k for k, column in self.y.items() if x[column] > 0.5))


class _Rows:
    """Sparse rows ``lower <= sum(value * x[column]) <= upper``, collected as triplets."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.columns: list[int] = []
        self.values: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, terms, lower: float, upper: float) -> None:
        row = len(self.lower)
        for column, value in terms:
            self.rows.append(row)
            self.columns.append(column)
            self.values.append(float(value))
        self.lower.append(lower)
        self.upper.append(upper)


def _storages(problem: Problem) -> list[_Storage]:
    n = problem.size
    return [
        _Storage(
            nbytes=s.nbytes,
            producer=s.producer,
            touches=tuple(sorted({*s.readers, *s.savers})),
            readers=tuple(s.readers),
            to_stop=s.is_output or s.cast_cache,
            savers=tuple(sorted(set(s.savers))),
            first_saver=min(s.savers, default=n),
            freed_in_forward=n - 1 if s.is_output else s.last_reader,
            before_last_save=s.before_last_save,
        )
        for s in problem.storages
    ]


def _recompute_steps(problem: Problem, storages: list[_Storage], made_at, c: int, end: int):
    """Bytes the recompute of a segment from ``c`` adds at each of its steps ``c..end``.

    As in the simulator: each recomputed storage is allocated by its producer; one saved inside
    the segment stays (its saver is at or before ``end``, the last saving node), the others are
    freed after their last reader that is recomputed. The outputs of ``end`` itself are made
    again only when ``end`` saves one of them (early stop), and only then does it run; even
    then, not those it makes after its last save (``Storage.before_last_save``). Nothing
    is kept here: ``_formulate`` adds what kept nodes change, step by step.
    """
    width = end - c + 1
    allocated = np.zeros(width, dtype=np.int64)
    freed = np.zeros(width, dtype=np.int64)
    for p in range(c, end + 1):
        if p == end and not problem.saves_own[end]:
            continue
        for k in made_at[p]:
            s = storages[k]
            if p == end and not s.before_last_save:
                continue
            allocated[p - c] += s.nbytes
            if s.first_saver > end:  # no saver up to end: freed after its last reader
                # The body's frame holds what a node beyond the stop reads until the stop.
                after = max([p] + [min(j, end) for j in s.readers] + [end] * s.to_stop)
                freed[after - c] += s.nbytes
    live = np.cumsum(allocated) - np.concatenate(([0], np.cumsum(freed)[:-1]))
    work = problem.workspace[c : end + 1].copy()
    work[-1] *= bool(problem.saves_own[end])  # nor does ``end`` run then: no workspace
    return live + work


def _formulate(problem: Problem, keep: bool = False) -> _Formulation:
    """Build the program for ``problem``; the budget only bounds the peak column later.

    With ``keep``, nodes kept inside segments are chosen too (``y``), and each segment's
    recompute is one row per step instead of one row at its peak, since keeps move the peak.
    """
    _, _, _, csr_array = _scipy_milp()
    n = problem.size
    storages = _storages(problem)
    made_at: list[list[int]] = [[] for _ in range(n)]
    for k, s in enumerate(storages):
        made_at[s.producer].append(k)
    scale = float(max(1, simulate(problem, ()).peak_bytes - problem.fixed_bytes))
    time_scale = float(problem.seconds.sum()) or 1.0

    columns = 0

    def new_columns(count: int) -> range:
        nonlocal columns
        columns += count
        return range(columns - count, columns)

    # z[c, i]: node i in the segment that starts at c. ``last_end[c]``: the furthest cut a
    # segment from c can reach (all nodes checkpointable, cut allowed).
    z: dict[tuple[int, int], int] = {}
    last_end: dict[int, int] = {}
    for c in range(n):
        if not (problem.cut_allowed[c] and problem.checkpointable[c]):
            continue
        stop = c
        while stop < n and problem.checkpointable[stop]:
            stop += 1
        ends = [b for b in range(c + 1, stop + 1) if problem.cut_allowed[b]]
        if ends:
            last_end[c] = ends[-1]
            for i, column in zip(range(c, ends[-1]), new_columns(ends[-1] - c)):
                z[c, i] = column
    starts_covering: list[list[int]] = [[] for _ in range(n)]  # node i -> starts c with z[c, i]
    for c, i in z:
        starts_covering[i].append(c)

    # The segments [c, b) a plan may choose, each with the last node its recompute reaches.
    last_saving = np.maximum.accumulate(np.where(problem.saves, np.arange(n), -1))
    segment_end: dict[tuple[int, int], int] = {}
    for c, end_cut in last_end.items():
        for b in range(c + 1, end_cut + 1):
            if problem.cut_allowed[b]:
                segment_end[c, b] = int(last_saving[b - 1])

    def runs_to(c: int, b: int) -> int:  # as planner.choice.recompute_stop
        end = segment_end[c, b]
        if end < c:
            return c
        return end + 1 if problem.saves_own[end] else end

    # y[k]: node k kept (keepable, and some segment's recompute runs it). Not offered: nodes
    # that make weight casts autocast caches (``simulate`` leaves those out of the selective
    # cache; the program does not model that yet).
    y: dict[int, int] = {}
    if keep:
        casting = {s.producer for s in problem.storages if s.cast_cache}
        for k in range(n):
            runs = any(c <= k < runs_to(c, b) for c, b in segment_end if b > k)
            if problem.keepable[k] and runs and k not in casting:
                y[k] = new_columns(1)[0]
    # t[b, k]: k kept in the segment that ends at b (a product of binaries, bounded below).
    t: dict[tuple[int, int], int] = {}
    for c, b in segment_end:
        for k in y:
            if c <= k < runs_to(c, b) and (b, k) not in t:
                t[b, k] = new_columns(1)[0]

    # A segment holds its inputs until the backward of its first saving node (none when it
    # saves nothing), so a storage can be released up to the first saving node at or after its
    # last touch: ``last_release``. a[s, i] for i from the producer to there; kept[s] is its last.
    next_saving = np.full(n + 1, -1, dtype=np.int64)  # -1: no saving node at or after i
    for i in range(n - 1, -1, -1):
        next_saving[i] = i if problem.saves[i] else next_saving[i + 1]
    last_release = [
        max(s.touches[-1], int(next_saving[s.touches[-1]])) if s.touches else -1 for s in storages
    ]
    a: dict[tuple[int, int], int] = {}
    for k, s in enumerate(storages):
        if s.touches:
            span = range(s.producer, last_release[k] + 1)
            for i, column in zip(span, new_columns(len(span))):
                a[k, i] = column
    # Running sums of kept bytes: freed-in-forward before i (forward rows), last touch before
    # i (backward rows), and cached bytes of kept nodes whose segment's recompute comes after
    # backward i (backward rows), so that each memory row stays short.
    kept_forward = new_columns(n)
    kept_backward = new_columns(n)
    cached = new_columns(n) if y else None
    # Buffer copies (Problem.buffer_copy_bytes) of the segments a plan may choose: a segment
    # copies them when its forward starts and again when its recompute starts, and both copies
    # go when the recompute ends. Running sums again: ``copies_forward[i]``, the copies of the
    # chosen segments starting at or before i (forward rows); ``copies_backward[i]``, those of
    # the chosen segments whose recompute ends (at their last saving node) before i, not yet
    # recomputed when backward reaches i (backward and recompute rows).
    copy_bytes = {
        (c, b): problem.buffer_copy_bytes(c, b)
        for (c, b), end in segment_end.items()
        if end >= c and problem.buffer_copies
    }
    copy_bytes = {key: nbytes for key, nbytes in copy_bytes.items() if nbytes}
    # What a segment's recompute holds on top of its own steps (``planner.simulate``): both
    # copies; what the backward that triggers it (its last saving node's) has allocated when it
    # unpacks (``Problem.grad_before_unpack``); and the loss and backward's seed when it runs
    # before the first backward step, its last saving node being the graph's last node
    # (``Problem.loss_bytes``).
    recompute_extra = {
        (c, b): 2 * copy_bytes.get((c, b), 0)
        + int(problem.grad_before_unpack[end])
        + (problem.loss_bytes if end == n - 1 else 0)
        for (c, b), end in segment_end.items()
        if end >= c
    }
    copies_forward = new_columns(n) if copy_bytes else None
    copies_backward = new_columns(n) if copy_bytes else None
    peak = new_columns(1)[0]

    rows = _Rows()
    seconds = np.zeros(columns)
    # A segment that saves nothing is not offered: it frees nothing, yet its checkpoint call
    # holds its inputs until it returns (planner.simulate); the same plan without it is better.
    for c in last_end:
        f = int(next_saving[c])
        reaches = [(z[c, f], -1.0)] if f >= 0 and (c, f) in z else []
        rows.add([(z[c, c], 1.0), *reaches], -math.inf, 0.0)

    def segment_terms(c: int, b: int, value: float):
        """``value * x[c, b]`` as terms in z."""
        terms = [(z[c, b - 1], value)]
        if (c, b) in z:
            terms.append((z[c, b], -value))
        return terms

    prefix_seconds = np.concatenate(([0.0], np.cumsum(problem.seconds)))
    recompute_steps: dict[tuple[int, int], np.ndarray] = {}
    ending_at: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n + 1)]  # b -> [(c, L)]
    for c, end_cut in last_end.items():
        for b in range(c + 1, end_cut):  # z[c, .] never increases, nor drops at a forbidden cut
            upper = math.inf if problem.cut_allowed[b] else 0.0
            rows.add([(z[c, b - 1], 1.0), (z[c, b], -1.0)], 0.0, upper)
    for (c, b), end in segment_end.items():
        if end < c:
            continue  # saves nothing: no recompute, nothing to pay
        # its recompute, and the checkpoint call's own cost (planner.choice.call_seconds)
        recompute = prefix_seconds[runs_to(c, b)] - prefix_seconds[c] + problem.checkpoint_seconds
        for column, value in segment_terms(c, b, recompute):
            seconds[column] += value / time_scale
        if (c, end) not in recompute_steps:
            recompute_steps[c, end] = _recompute_steps(problem, storages, made_at, c, end)
        ending_at[b].append((c, recompute_steps[c, end]))
    for k, column in y.items():  # a kept node is not run again, and costs the cache's work
        seconds[column] += (problem.keep_seconds - problem.seconds[k]) / time_scale

    for i in range(n):  # a node lies in at most one segment
        if starts_covering[i]:
            rows.add([(z[c, i], 1.0) for c in starts_covering[i]], -math.inf, 1.0)

    # Which keeps are valid (planner.choice.validate_choice): inside a segment whose recompute
    # runs the node, and a kept random node after every recomputed one of its segment.
    for k, column in y.items():
        runs_k = [(c, b) for c, b in segment_end if c <= k < runs_to(c, b)]
        rows.add(
            [(column, 1.0)] + [tm for c, b in runs_k for tm in segment_terms(c, b, -1.0)],
            -math.inf,
            0.0,
        )
        for b in {b for _, b in runs_k}:
            terms = [(t[b, k], 1.0), (column, -1.0)]
            terms += [tm for c, b2 in runs_k if b2 == b for tm in segment_terms(c, b, -1.0)]
            rows.add(terms, -1.0, math.inf)
    random = [int(r) for r in np.flatnonzero(problem.random)]
    for first in (r for r in random if r in y):
        for later in (r for r in random if r > first):
            both_run = [(c, b) for c, b in segment_end if c <= first and later < runs_to(c, b)]
            if not both_run:
                continue
            terms = [(y[first], 1.0)] + ([(y[later], -1.0)] if later in y else [])
            terms += [tm for c, b in both_run for tm in segment_terms(c, b, 1.0)]
            rows.add(terms, -math.inf, 1.0)

    held_at: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # i -> [(a column, bytes)]
    for k, s in enumerate(storages):
        if not s.touches:
            continue
        # A storage of a kept node stays in the cache instead: nothing holds it for backward.
        cache = [(y[s.producer], 1.0)] if s.producer in y else []
        for i in range(s.producer, last_release[k] + 1):
            held_at[i].append((a[k, i], s.nbytes))
            if i > s.producer:
                rows.add([(a[k, i], 1.0), (a[k, i - 1], -1.0)], 0.0, math.inf)  # stays held
        for c in range(s.producer + 1, s.touches[-1] + 1):
            # Another segment, from c, that reads or saves s (it then holds the first touch at
            # or after c) holds it until the backward of its first saving node f, if it has one.
            touch, f = next(j for j in s.touches if j >= c), int(next_saving[c])
            if f >= 0 and (c, max(touch, f)) in z:
                rows.add([(a[k, f], 1.0), (z[c, max(touch, f)], -1.0)] + cache, 0.0, math.inf)
        for j in s.savers:  # a saver outside every segment keeps s
            terms = [(a[k, j], 1.0)] + [(z[c, j], 1.0) for c in starts_covering[j]]
            rows.add(terms + cache, 1.0, math.inf)

    def kept(k: int) -> int:
        return a[k, last_release[k]]

    # What a kept node holds: its storages (cached) and its temporaries (``held``). When it is
    # where its segment's recompute stops, the storages it makes after its last save are never
    # made again, so the simulator never frees their cache (``leaks``: to the end of the step).
    made_bytes = np.array([sum(storages[k].nbytes for k in made) for made in made_at])
    held = problem.kept_bytes - problem.created_bytes
    stays = {
        (b, k): sum(storages[j].nbytes for j in made_at[k] if not storages[j].before_last_save)
        for b, k in t
        if last_saving[b - 1] == k
    }
    cache_bytes = {key: made_bytes[key[1]] - stays.get(key, 0) for key in t}
    leaks = [(t[key], nbytes / scale) for key, nbytes in stays.items() if nbytes]
    for i in range(n):
        terms = [(kept_forward[i], 1.0)]
        if i:
            terms.append((kept_forward[i - 1], -1.0))
        for k, s in enumerate(storages):
            if s.freed_in_forward == i - 1:
                if s.touches:
                    terms.append((kept(k), -s.nbytes / scale))
                if s.producer in y:  # cached: not freed in forward
                    terms.append((y[s.producer], -s.nbytes / scale))
        if i - 1 in y:
            terms.append((y[i - 1], -held[i - 1] / scale))
        rows.add(terms, 0.0, 0.0)
        terms = [(kept_backward[i], 1.0)]
        if i:
            terms.append((kept_backward[i - 1], -1.0))
        terms += [
            (kept(k), -storages[k].nbytes / scale)
            for k, s in enumerate(storages)
            if s.touches and last_release[k] == i - 1
        ]
        rows.add(terms, 0.0, 0.0)
        if cached is not None:  # caches of segments whose recompute comes after backward i
            terms = [(cached[i], 1.0)]
            if i:
                terms.append((cached[i - 1], -1.0))
            terms += [
                (column, -(cache_bytes[b, k] + held[k]) / scale)
                for (b, k), column in t.items()
                if last_saving[b - 1] + 1 == i
            ]
            rows.add(terms, 0.0, 0.0)

    if copies_forward is not None and copies_backward is not None:
        for i in range(n):
            terms = [(copies_forward[i], 1.0)] + ([(copies_forward[i - 1], -1.0)] if i else [])
            terms += [
                tm
                for (c, b), nbytes in copy_bytes.items()
                if c == i
                for tm in segment_terms(c, b, -nbytes / scale)
            ]
            rows.add(terms, 0.0, 0.0)
            terms = [(copies_backward[i], 1.0)] + ([(copies_backward[i - 1], -1.0)] if i else [])
            terms += [
                tm
                for (c, b), nbytes in copy_bytes.items()
                if segment_end[c, b] == i - 1
                for tm in segment_terms(c, b, -nbytes / scale)
            ]
            rows.add(terms, 0.0, 0.0)

    # Plan-independent parts of the replay, in bytes above fixed memory.
    created = np.cumsum(problem.created_bytes)
    freed_before = np.zeros(n + 1, dtype=np.int64)
    for s in storages:
        freed_before[s.freed_in_forward + 1] += s.nbytes
    freed_before = np.cumsum(freed_before)
    grads = problem.activation_grad_alloc + problem.grad_bytes_at
    grads_after = np.concatenate(
        (np.cumsum((grads - problem.activation_grad_free)[::-1])[::-1], [0])
    )  # gradients alive once backward has passed node i
    saved_weight = np.zeros((n + 1, n + 1))  # [c, i]: bytes made at >= c, first saved at <= i
    for s in storages:
        if s.first_saver < n:
            saved_weight[s.producer, s.first_saver] += s.nbytes
    saved_weight = np.cumsum(np.cumsum(saved_weight[::-1], axis=0)[::-1], axis=1)

    def memory_row(terms, constant: float) -> None:
        rows.add(terms + [(peak, -1.0)], -math.inf, -constant / scale)

    def recompute_rows(b: int, before, grads_alive: float) -> None:
        """The recompute of the segment ending at ``b``, on top of what is held then."""
        if not keep:  # one row at the recompute's peak
            recompute = [
                tm
                for c, steps in ending_at[b]
                for tm in segment_terms(c, b, (steps.max() + recompute_extra[c, b]) / scale)
            ]
            memory_row(before + recompute, grads_alive)
            return
        # One row per recompute step q: the step's bytes in the segment [c, b) with c <= q,
        # plus the cache of nodes kept in it: storages until their producer's step, temporaries
        # through it; a kept node runs no workspace. (With no segment [c <= q, b), the row is
        # below the one of the first step of the segment ending at b, if any.)
        end = int(last_saving[b - 1])
        for q in range(min(c for c, _ in ending_at[b]), end + 1):
            terms = [
                tm
                for c, steps in ending_at[b]
                if c <= q
                for tm in segment_terms(c, b, (steps[q - c] + recompute_extra[c, b]) / scale)
            ]
            for k in range(q, b):
                if (b, k) in t:
                    terms.append((t[b, k], (held[k] + (cache_bytes[b, k] if k > q else 0)) / scale))
            if q in y:
                terms.append((y[q], -problem.workspace[q] / scale))
            memory_row(before + terms, grads_alive)

    recompute_at: list[list[int]] = [[] for _ in range(n)]  # the last saving node -> ends b
    for b in range(1, n + 1):
        if ending_at[b]:
            recompute_at[int(last_saving[b - 1])].append(b)

    for i in range(n):
        forward = [(kept_forward[i], 1.0)]
        if i in y:  # a kept node's temporaries replace its workspace, where larger
            forward.append((y[i], max(0, held[i] - problem.workspace[i]) / scale))
        if copies_forward is not None and copies_backward is not None:
            forward.append((copies_forward[i], 1.0))
        memory_row(forward, created[i] - freed_before[i] + problem.workspace[i])
        before = [(column, nbytes / scale) for column, nbytes in held_at[i]]
        before.append((kept_backward[i], 1.0))
        if copies_backward is not None:
            before.append((copies_backward[i], 1.0))
        if cached is not None:
            before.append((cached[i], 1.0))
        before += leaks
        # Copies the recompute made: it runs at the backward of the segment's last saving node,
        # so only when the segment holds a saving node at or after i.
        recomputed = [
            (z[c, int(next_saving[i])], saved_weight[c, i] / scale)
            for c in starts_covering[i]
            if (c, int(next_saving[i])) in z
        ]
        memory_row(before + recomputed, grads_after[i + 1] + grads[i])
        for b in recompute_at[i]:
            recompute_rows(b, before, grads_after[i + 1])

    # optimizer.step() on what backward leaves: the same for every plan, but for the leaks.
    memory_row(leaks, simulate(problem, ()).optimizer_step_bytes - problem.fixed_bytes)

    integrality = np.zeros(columns)
    integrality[list(z.values())] = 1
    integrality[list(y.values())] = 1
    matrix = csr_array((rows.values, (rows.rows, rows.columns)), shape=(len(rows.lower), columns))
    return _Formulation(
        seconds=seconds,
        peak=peak,
        matrix=matrix,
        row_lower=np.array(rows.lower),
        row_upper=np.array(rows.upper),
        integrality=integrality,
        z=z,
        y=y,
        scale=scale,
        time_scale=time_scale,
    )


def _run(form: _Formulation, objective: np.ndarray, peak_limit: float, time_limit: float):
    """One HiGHS solve with the peak column bounded by ``peak_limit`` (scaled bytes)."""
    milp, Bounds, LinearConstraint, _ = _scipy_milp()
    upper = np.where(form.integrality > 0, 1.0, math.inf)
    upper[form.peak] = peak_limit
    return milp(
        objective,
        integrality=form.integrality,
        bounds=Bounds(np.zeros(len(objective)), upper),
        constraints=LinearConstraint(form.matrix, form.row_lower, form.row_upper),
        options={"time_limit": max(time_limit, 0.01), "mip_rel_gap": 1e-4},
    )


_STATUS = {0: "optimal", 1: "time limit", 2: "infeasible"}


def _program_peak(problem: Problem, form: _Formulation, choice: Choice, time_limit: float):
    """The program's lowest peak (bytes, fixed memory included) with its segment and keep
    variables pinned to ``choice``: what the formulation says the plan's peak is. None when
    HiGHS does not find it in time."""
    milp, Bounds, LinearConstraint, _ = _scipy_milp()
    inside = {(c, i) for c, b in choice.segments for i in range(c, b)}
    lower = np.zeros(len(form.seconds))
    upper = np.where(form.integrality > 0, 1.0, math.inf)
    for key, column in form.z.items():
        lower[column] = upper[column] = float(key in inside)
    for node, column in form.y.items():
        lower[column] = upper[column] = float(node in choice.keep)
    objective = np.zeros(len(lower))
    objective[form.peak] = 1.0
    answer = milp(
        objective,
        integrality=form.integrality,
        bounds=Bounds(lower, upper),
        constraints=LinearConstraint(form.matrix, form.row_lower, form.row_upper),
        options={"time_limit": max(time_limit, 0.01)},
    )
    if answer.status != 0:
        return None
    return round(problem.fixed_bytes + answer.fun * form.scale)


def _least_recompute(
    problem: Problem, form: _Formulation, budget_bytes: int, deadline: float, retries: int
) -> MilpResult:
    # Half a byte over: peaks are whole bytes, so this admits the same plans, while a peak row
    # that the budget meets exactly is no longer at the bound (HiGHS's presolve then cut off
    # an optimum: tests/test_milp.py, random_problem(30, 8) at 138 bytes).
    limit = budget_bytes - problem.fixed_bytes + 0.5
    answer = _run(form, form.seconds, limit / form.scale, deadline - time.perf_counter())
    status = _STATUS.get(answer.status, "failed")
    dual = answer.mip_dual_bound if answer.mip_dual_bound is not None else 0.0
    bound = math.inf if status == "infeasible" else form.time_scale * max(0.0, dual)
    choice = Choice(())
    simulated = None
    for attempt in range(retries + 1):
        if answer.x is None:
            break
        choice = form.decode(answer.x)
        simulated = simulate(problem, choice)
        if simulated.peak_bytes <= budget_bytes or attempt == retries:
            break
        limit -= simulated.peak_bytes - budget_bytes  # take the overshoot off and solve again
        answer = _run(form, form.seconds, limit / form.scale, deadline - time.perf_counter())
    if simulated is None:
        return MilpResult((), status, False, 0, 0.0, bound)
    fits = simulated.peak_bytes <= budget_bytes
    program_peak = None
    if not fits:
        # Every decoded plan met the program's rows at a peak within the budget (a few bytes
        # over at most: HiGHS's tolerance, which the retries take off), so one that still does
        # not fit is one where the program and simulate disagree: find by how much. An LP once
        # the plan is pinned, quick; it runs even when the time is spent.
        remaining = max(deadline - time.perf_counter(), 5.0)
        program_peak = _program_peak(problem, form, choice, remaining)
    return MilpResult(
        choice.segments,
        status,
        fits,
        simulated.peak_bytes,
        simulated.recompute_seconds,
        bound,
        choice.keep,
        program_peak,
    )


def milp_plan(
    problem: Problem,
    budget_bytes: int | None,
    *,
    time_limit: float = 60.0,
    retries: int = 3,
    keep: bool = True,
) -> MilpResult:
    """Solve the program for one budget and check the plan with ``simulate``.

    Parameters
    ----------
    problem
        The graph to plan.
    budget_bytes
        Memory of the whole step, as ``simulate`` counts it. ``None`` asks for the lowest peak
        first, then the least recompute at that peak: how ``solve`` answers a budget that
        nothing fits (the status is then that of the lowest-peak solve when it is not optimal).
    time_limit
        Seconds for HiGHS, over all the solves this call makes. A solve stopped by it still
        returns its best plan and a valid lower bound.
    retries
        HiGHS accepts a row violated within its feasibility tolerance, so a plan can exceed the
        budget by a few bytes in ``simulate``; it is then solved again with the budget lowered
        by the excess, at most this many times.
    keep
        Also choose nodes to keep inside the segments (``Choice.keep``), jointly with the
        segments; ``False`` formulates segments alone (smaller, faster).

    Returns
    -------
    MilpResult
        The plan, whether it fits (by ``simulate``), and the lower bound on its recompute.

    Examples
    --------
    >>> from planner import zoo
    >>> from planner.pipeline import prepare
    >>> problem = prepare(*zoo.mlp_chain(depth=3, width=8, batch=2))[1]
    >>> result = milp_plan(problem, None)
    >>> result.status, result.fits, result.recompute_seconds >= result.bound_seconds
    ('optimal', True, True)
    """
    _scipy_milp()  # fail early and the same way whatever the budget
    baseline = simulate(problem, ())
    if budget_bytes is not None and baseline.peak_bytes <= budget_bytes:
        return MilpResult((), "optimal", True, baseline.peak_bytes, 0.0, 0.0)
    deadline = time.perf_counter() + time_limit
    form = _formulate(problem, keep)
    if budget_bytes is not None:
        return _least_recompute(problem, form, budget_bytes, deadline, retries)
    objective = np.zeros(len(form.seconds))
    objective[form.peak] = 1.0
    lowest = _run(form, objective, math.inf, time_limit)
    if lowest.x is None:
        return MilpResult((), _STATUS.get(lowest.status, "failed"), False, 0, 0.0, 0.0)
    peak = simulate(problem, form.decode(lowest.x)).peak_bytes
    if peak >= baseline.peak_bytes:
        return MilpResult(
            (), _STATUS.get(lowest.status, "failed"), True, baseline.peak_bytes, 0.0, 0.0
        )
    result = _least_recompute(problem, form, peak, deadline, retries)
    if lowest.status == 0:
        return result
    return dataclasses.replace(result, status=_STATUS.get(lowest.status, "failed"))


@register("milp")
def solve(
    problem: Problem, budget_bytes: int, *, time_limit: float = 60.0, keep: bool = True, **options
) -> Segments | Choice:
    """Least recompute whose simulated peak fits ``budget_bytes``; else the lowest peak.

    Returns plain segments, or a ``Choice`` when the plan keeps nodes inside them.

    Parameters
    ----------
    problem
        The graph to plan.
    budget_bytes
        Memory of the whole step, as ``simulate`` counts it (fixed memory included).
    time_limit
        Seconds for HiGHS. When it finds no plan that fits in time (or none exists), the answer
        is the MILP's lowest-peak plan, or, when that too fails, the greedy solver's, with a
        warning: a plan is never passed off as fitting without ``simulate`` agreeing. The
        warning tells apart a plan HiGHS proved optimal that ``simulate`` refuses (the program
        and the replay disagree: both peaks) from running out of time.
    keep
        Choose kept nodes too (see ``milp_plan``).
    """
    result = milp_plan(problem, budget_bytes, time_limit=time_limit, keep=keep)
    if result.fits:
        return result.choice if result.keep else result.segments
    if result.status == "infeasible":
        lowest = milp_plan(problem, None, time_limit=time_limit, keep=keep)
        if lowest.status == "optimal":
            return lowest.choice if lowest.keep else lowest.segments
    from planner.solvers.greedy import solve as greedy

    if result.program_peak_bytes not in (None, result.peak_bytes):  # a plan, refused: a bug
        message = (
            f"the MILP's optimal plan does not fit the budget of {budget_bytes} bytes: the "
            f"program puts its peak at {result.program_peak_bytes} bytes, planner.simulate at "
            f"{result.peak_bytes} ({result.choice}). The formulation and the replay disagree "
            "(a bug in planner.solvers.milp); using the greedy solver's plan instead. Use "
            "solver='optimal'."
        )
    else:
        message = (
            f"the MILP found no plan that fits within {time_limit:g} s (status: "
            f"{result.status}); using the greedy solver's plan instead. Raise time_limit= or "
            "use solver='optimal'."
        )
    warnings.warn(message, stacklevel=2)
    return greedy(problem, budget_bytes)
