"""What a plan chooses, and what a replay of it reports.

A flat plan is a ``Choice``: checkpointed segments and nodes kept inside them (nested plans,
``planner.nested``, build on it). ``validate_choice`` states which choices are valid (see
``planner.simulate`` for why: the early stop, the random-number rule), ``recomputed_nodes`` and
``replayed_nodes`` what a recompute computes and what it replays, ``recompute_costs`` the one
definition of its cost, and ``call_seconds`` what the checkpoint calls cost themselves;
``Simulation`` is what ``planner.simulate`` reports.
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
    starts = np.array(segments, dtype=np.int64)[:, 0]
    runs_to = _runs_to(problem, segments)
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


def call_seconds(problem: Problem, choice, replayed: np.ndarray | None = None) -> float:
    """What ``choice``'s checkpoint calls and kept nodes cost beyond the nodes they recompute:
    ``Problem.checkpoint_seconds`` per segment (it saves the random state, installs hooks and
    starts and stops a recompute, whatever it runs) and ``Problem.keep_seconds`` per kept or
    replayed node (the selective cache's work, or the replay's). ``replayed``: its
    ``replayed_nodes``, when the caller has them."""
    choice = as_choice(choice)
    if replayed is None:
        replayed = replayed_nodes(problem, choice)
    marked = len(choice.keep) + int(replayed.sum())
    return problem.checkpoint_seconds * len(choice.segments) + problem.keep_seconds * marked


def _runs_to(problem: Problem, segments: Segments) -> np.ndarray:
    """``recompute_stop`` of every segment at once."""
    if not segments:
        return np.zeros(0, dtype=np.int64)
    starts, stops = np.array(segments, dtype=np.int64).T
    last = problem.last_saving[stops - 1]
    return np.where(last < starts, starts, last + problem.saves_own[np.maximum(last, 0)])


def _run_by_recompute(problem: Problem, choice: Choice) -> np.ndarray:
    """Per node, whether a recompute runs it (kept, replayed or computed)."""
    change = np.zeros(problem.size + 1, dtype=np.int64)
    if choice.segments:
        np.add.at(change, np.array(choice.segments, dtype=np.int64)[:, 0], 1)
        np.add.at(change, _runs_to(problem, choice.segments), -1)
    return np.cumsum(change)[: problem.size] > 0


def recomputed_nodes(problem: Problem, choice, replayed: np.ndarray | None = None) -> np.ndarray:
    """Per node, whether backward computes it again under ``choice``: the nodes each segment's
    recompute runs (``recompute_stop``) that are neither kept nor replayed
    (``replayed_nodes``; ``replayed``, when the caller has them)."""
    choice = as_choice(choice)
    if replayed is None:
        replayed = replayed_nodes(problem, choice)
    runs = _run_by_recompute(problem, choice)
    runs[list(choice.keep)] = False
    return runs & ~replayed


def recompute_costs(
    problem: Problem, choice, replayed: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per node, the seconds and FLOPs backward spends on it again under ``choice``, the one
    definition of a recompute's cost: ``Problem.seconds`` and ``Problem.flops`` where it is
    recomputed (``recomputed_nodes``), ``Problem.replay_seconds`` and ``replay_flops`` where
    it is replayed (``replayed_nodes``; ``replayed``, when the caller has them), nothing
    elsewhere; of a node inside which a recompute stops (``recompute_stop``), no more FLOPs
    than ``Problem.stop_flops``, what it runs until its last save. Its time is charged whole,
    as the solvers' segment costs charge it (a bound on the safe side)."""
    choice = as_choice(choice)
    if replayed is None:
        replayed = replayed_nodes(problem, choice)
    runs = recomputed_nodes(problem, choice, replayed)
    seconds = np.where(runs, problem.seconds, np.where(replayed, problem.replay_seconds, 0.0))
    flops = np.where(runs, problem.flops, np.where(replayed, problem.replay_flops, 0.0))
    if choice.segments:
        starts, stops = np.array(choice.segments, dtype=np.int64).T
        last = problem.last_saving[stops - 1]
        inside = last[(last >= starts) & problem.saves_own[np.maximum(last, 0)]]
        flops[inside] = np.minimum(flops[inside], problem.stop_flops[inside])
    return seconds, flops


def replayed_nodes(problem: Problem, choice) -> np.ndarray:
    """Per node, whether a recompute under ``choice`` replays it: runs it through autograd,
    which saves its inputs, but fakes the ops whose results nothing needs
    (``planner.rewrite._Replaying``, ``planner.profile.replay_ops``).

    A recompute exists to hand backward the tensors autograd saves; a value is needed only
    where a node of the recompute saves it or computes from it. So a replayable node
    (``Problem.replayable``) the recompute runs and does not keep is replayed when no other
    node of its segment saves what it makes, and every node the recompute computes that reads
    what it makes (beside what it saves itself, which its replay computes) is kept (the cache
    answers) or replayed itself: the scores ``q @ k.T`` when the softmax over them is kept. A
    replay that still computes something (a copy the node saves for its own backward) reads
    the node's inputs (``Problem.replay_reads``). A stand-in's strides are not the real
    result's, so only a kept or replayed node of one op (``Problem.one_op``) may read it: a
    node of several can take another path on it (``reshape`` views what it would copy),
    which the cache, matching the recompute's ops to the forward's, or the replay, matching
    them to the profile's, would not follow.
    """
    choice = as_choice(choice)
    replayed = _run_by_recompute(problem, choice) & problem.replayable
    replayed[list(choice.keep)] = False
    if not replayed.any():
        return replayed
    a = problem.storage_arrays
    kept = np.zeros(problem.size, dtype=bool)
    kept[list(choice.keep)] = True
    segment_of = np.full(problem.size, -1, dtype=np.int64)
    for k, (start, stop) in enumerate(choice.segments):
        segment_of[start:stop] = k
    runs_to = np.append(_runs_to(problem, choice.segments), 0)
    home = segment_of[a.producer]
    # Saved by another node of the same segment (every such saver is one the recompute
    # reaches); what its producer saves, its replay computes.
    same = (home[a.save_storage] >= 0) & (segment_of[a.save_node] == home[a.save_storage])
    own = a.save_node == a.producer[a.save_storage]
    saved = np.zeros(a.nbytes.size, dtype=bool)
    saved[a.save_storage[same & ~own]] = True
    computed_by_replay = np.zeros(a.nbytes.size, dtype=bool)
    computed_by_replay[a.save_storage[own]] = True
    reader_home = home[a.read_storage]
    inside = (reader_home >= 0) & (segment_of[a.read_node] == reader_home)
    inside &= a.read_node < runs_to[reader_home]
    read_storage, read_node = a.read_storage[inside], a.read_node[inside]
    # A node's replay needs its readers' replays: from all candidates down to the set that
    # holds (as many rounds as the longest chain of replayed nodes, plus one).
    while True:
        needed = saved.copy()
        answered = kept[read_node] | (replayed[read_node] & ~problem.replay_reads[read_node])
        computing = ~(answered & problem.one_op[read_node])
        needed[read_storage[computing]] = True
        blocked = np.zeros(problem.size, dtype=bool)
        blocked[a.producer[needed & ~computed_by_replay]] = True
        still = replayed & ~blocked
        if (still == replayed).all():
            return replayed
        replayed = still
