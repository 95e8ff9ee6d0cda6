"""What a plan chooses, and what a replay of it reports.

A flat plan is a ``Choice``: checkpointed segments and nodes kept inside them (nested plans,
``planner.nested``, build on it). ``validate_choice`` states which choices are valid (see
``planner.simulate`` for why: the early stop, the random-number rule), ``recomputed_nodes`` what
a recompute runs, the one definition of its cost, and ``call_seconds`` what the checkpoint calls
cost themselves; ``Simulation`` is what ``planner.simulate`` reports.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from planner.problem import Problem

Segments = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Choice:
    """What a plan checkpoints: segments, and nodes inside them whose outputs are kept."""

    segments: Segments  # sorted disjoint (start, stop) pairs
    keep: frozenset[int] = frozenset()  # positions inside segments saved in forward, not recomputed


def as_choice(value) -> Choice:
    """``value`` as a ``Choice``: a ``Choice`` itself, or plain segments (nothing kept)."""
    if isinstance(value, Choice):
        return value
    return Choice(tuple((int(a), int(b)) for a, b in value))


@dataclass(frozen=True)
class Simulation:
    """Result of a replay; bytes are absolute (fixed memory included)."""

    peak_bytes: int
    # Time the plan adds to a step: the nodes it runs again, plus ``call_seconds``.
    recompute_seconds: float
    recompute_flops: float
    # Live bytes at the high point of optimizer.step() (after backward, plus its temporaries).
    optimizer_step_bytes: int = 0
    # (phase, position, live bytes at the node's high point, before it frees anything)
    timeline: tuple[tuple[str, int, int], ...] | None = None
    # Of recompute_seconds, what the checkpoint calls and kept nodes cost themselves
    # (``Problem.checkpoint_seconds``, ``Problem.keep_seconds``).
    call_seconds: float = 0.0


def validate_segments(problem: Problem, segments) -> Segments:
    """Sorted, disjoint, valid segments, or a ValueError naming the bad one."""
    result = tuple(sorted((int(a), int(b)) for a, b in segments))
    if _segments_valid(problem, result):
        return result
    previous_stop = 0
    for start, stop in result:
        if not problem.is_valid_segment(start, stop):
            raise ValueError(
                f"segment ({start}, {stop}) is not valid for this graph: positions must satisfy "
                f"0 <= start < stop <= {problem.size}, both cuts must be allowed and every node "
                "checkpointable"
            )
        if start < previous_stop:
            raise ValueError(f"segment ({start}, {stop}) overlaps the one before it")
        previous_stop = stop
    return result


def _segments_valid(problem: Problem, segments: Segments) -> bool:
    """Whether sorted ``segments`` are all valid and disjoint, in a few array operations (a
    replay checks hundreds of segments; ``validate_segments`` then names a bad one)."""
    if not segments:
        return True
    starts, stops = np.array(segments, dtype=np.int64).T
    if starts[0] < 0 or stops[-1] > problem.size or (starts >= stops).any():
        return False
    if (starts[1:] < stops[:-1]).any():
        return False
    barred = np.concatenate(([0], np.cumsum(~problem.checkpointable)))
    allowed = problem.cut_allowed
    return bool(
        allowed[starts].all() and allowed[stops].all() and (barred[stops] == barred[starts]).all()
    )


def _keep_valid(problem: Problem, segments: Segments, keep: frozenset[int]) -> bool:
    """Whether ``keep`` is valid under valid ``segments`` (see ``validate_choice``), in a few
    array operations; ``validate_choice`` then names what is wrong."""
    kept = np.array(sorted(keep), dtype=np.int64)
    if kept[0] < 0 or kept[-1] >= problem.size or not problem.keepable[kept].all():
        return False
    if not segments:
        return False
    starts, stops = np.array(segments, dtype=np.int64).T
    last = problem.last_saving[stops - 1]  # recompute_stop, for every segment at once
    runs_to = np.where(last < starts, starts, last + problem.saves_own[np.maximum(last, 0)])
    home = np.searchsorted(starts, kept, side="right") - 1  # the segment starting at or before
    if (home < 0).any() or (kept >= runs_to[home]).any():
        return False  # in no segment, or past what its recompute runs (runs_to <= stop)
    # Random nodes run by a recompute: no kept one before a recomputed one of its segment.
    random = np.flatnonzero(problem.random)
    inside = np.searchsorted(starts, random, side="right") - 1
    run = (inside >= 0) & (random < runs_to[np.maximum(inside, 0)])
    random, inside = random[run], inside[run]
    is_kept = np.isin(random, kept)
    first_kept = np.full(len(segments), problem.size, dtype=np.int64)
    np.minimum.at(first_kept, inside[is_kept], random[is_kept])
    last_recomputed_random = np.full(len(segments), -1, dtype=np.int64)
    np.maximum.at(last_recomputed_random, inside[~is_kept], random[~is_kept])
    return bool((first_kept >= last_recomputed_random).all())


def validate_choice(problem: Problem, choice) -> Choice:
    """A valid ``Choice`` with sorted segments, or a ValueError naming what is wrong.

    Kept nodes must be keepable (``Problem.keepable``), lie inside a segment among the nodes its
    recompute runs (``recompute_stop``), and not change the random numbers the recompute draws
    (see the module docstring).
    """
    choice = as_choice(choice)
    segments = validate_segments(problem, choice.segments)
    keep = frozenset(int(k) for k in choice.keep)
    if not keep:
        return Choice(segments)
    if _keep_valid(problem, segments, keep):
        return Choice(segments, keep)
    ordered = sorted(keep)
    for k in ordered:
        if not 0 <= k < problem.size:
            raise ValueError(
                f"kept position {k} is not a node of this graph (0..{problem.size - 1})"
            )
        if not problem.keepable[k]:
            raise ValueError(
                f"node {k} ({problem.names[k]}) cannot be kept: it creates no memory, mutates a "
                "tensor in place, or what it creates is mutated later"
            )
    in_segments: list[int] = []
    for start, stop in segments:
        runs_to = recompute_stop(problem, start, stop)
        inside = ordered[bisect.bisect_left(ordered, start) : bisect.bisect_left(ordered, stop)]
        in_segments += inside
        late = [k for k in inside if k >= runs_to]
        if late:
            raise ValueError(
                f"node {late[0]} ({problem.names[late[0]]}) is kept but the recompute of segment "
                f"({start}, {stop}) never runs it (it runs nodes {start} to {runs_to - 1}): keep "
                "only nodes the recompute runs"
            )
        random = np.flatnonzero(problem.random[start:runs_to]) + start
        kept_random = [k for k in random.tolist() if k in keep]
        recomputed_random = [k for k in random.tolist() if k not in keep]
        if kept_random and recomputed_random and kept_random[0] < recomputed_random[-1]:
            raise ValueError(
                f"random node {kept_random[0]} ({problem.names[kept_random[0]]}) is kept before "
                f"random node {recomputed_random[-1]} ({problem.names[recomputed_random[-1]]}), "
                "which is recomputed: the recompute would draw different random numbers. Keep "
                "random nodes only after every recomputed one in the segment"
            )
    outside = keep.difference(in_segments)
    if outside:
        k = min(outside)
        raise ValueError(f"node {k} ({problem.names[k]}) is kept but lies in no segment")
    return Choice(segments, keep)


def last_recomputed(problem: Problem, start: int, stop: int) -> int:
    """The last position a recompute of ``(start, stop)`` runs to (early stop), or start - 1."""
    last = int(problem.last_saving[stop - 1]) if stop > start else -1
    return last if last >= start else start - 1


def recompute_stop(problem: Problem, start: int, stop: int) -> int:
    """One past the last node the recompute of ``(start, stop)`` runs.

    The recompute stops once autograd has saved again everything the segment saved: at the
    last saving node (``last_recomputed``), which runs only when it saves something it creates
    (autograd saves an op's inputs before the op runs, its outputs after).
    """
    end = last_recomputed(problem, start, stop)
    if end < start:
        return start
    return end + 1 if problem.saves_own[end] else end


def call_seconds(problem: Problem, choice) -> float:
    """What ``choice``'s checkpoint calls and kept nodes cost beyond the nodes they recompute:
    ``Problem.checkpoint_seconds`` per segment (it saves the random state, installs hooks and
    starts and stops a recompute, whatever it runs) and ``Problem.keep_seconds`` per kept node
    (the selective cache's work)."""
    choice = as_choice(choice)
    return problem.checkpoint_seconds * len(choice.segments) + problem.keep_seconds * len(
        choice.keep
    )


def recomputed_nodes(problem: Problem, choice) -> np.ndarray:
    """Per node, whether backward runs it again under ``choice``: the nodes each segment's
    recompute runs (``recompute_stop``) that are not kept. What a recompute costs is their
    ``Problem.seconds`` and ``Problem.flops``."""
    choice = as_choice(choice)
    runs = np.zeros(problem.size, dtype=bool)
    for start, stop in choice.segments:
        runs[start : recompute_stop(problem, start, stop)] = True
    runs[list(choice.keep)] = False
    return runs
