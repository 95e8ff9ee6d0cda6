"""Small random ``Problem``s built directly (no torch), and exhaustive enumeration of plans:
the shared ground truth of the solver and simulator tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from planner.nested import Nest, NestedChoice
from planner.problem import NEVER, BackwardPhases, Problem, Storage
from planner.simulate import simulate


def random_problem(
    seed: int,
    nodes: int | None = None,
    *,
    chain: bool = False,
    phased: bool = False,
    replays: bool = False,
) -> Problem:
    """A small random graph: node i makes storage i, reads i-1 and maybe an earlier one.

    It covers what the formulation must get right: cuts crossed by several tensors (skips),
    storages saved by their producer and/or by readers, graph outputs, workspaces, gradient
    bookkeeping, forbidden cuts and nodes that may not be checkpointed. ``nodes`` fixes the
    size (3 to 7 nodes when not given). ``chain=True`` drops the skips and the extra graph
    output: storage i is read by node i + 1 alone (the same draws otherwise).
    ``phased=True`` runs each node's backward in one to three phases, with the storages its
    step frees gone from some phase on (``Problem.backward_phases``, ``Storage.saver_ends``;
    the same draws before it). ``replays=True`` makes about half the nodes replayable
    (``Problem.replayable``), some of whose replays still compute a quarter of their time and
    read their inputs (the same draws before it).
    """
    rng = np.random.default_rng(seed)
    n = nodes or int(rng.integers(3, 8))
    reads = [set() if i == 0 else {i - 1} for i in range(n)]
    for i in range(2, n):
        if rng.random() < 0.4:
            reads[i].add(int(rng.integers(0, i - 1)))
    saves_input = [rng.random() < 0.5 for _ in range(n)]
    outputs = {n - 1} | ({int(rng.integers(0, n))} if rng.random() < 0.2 else set())
    if chain:
        reads, outputs = [set() if i == 0 else {i - 1} for i in range(n)], {n - 1}
    storages = []
    for k in range(n):
        readers = tuple(i for i in range(n) if k in reads[i])
        savers = ({k} if rng.random() < 0.5 else set()) | {i for i in readers if saves_input[i]}
        storages.append(
            Storage(
                nbytes=int(rng.choice([1, 2, 4, 8, 16])),
                producer=k,
                readers=readers,
                savers=tuple(sorted(savers)),
                is_output=k in outputs,
                requires_grad=True,
            )
        )
    seconds = rng.choice([0.5, 1.0, 3.0, 10.0], n)
    arrays = dict(
        workspace=rng.choice([0, 0, 1, 4], n),
        grad_bytes_at=rng.choice([0, 0, 2], n),
        activation_grad_alloc=rng.integers(0, 9, n),
        activation_grad_free=rng.integers(0, 9, n),
        checkpointable=rng.random(n) > 0.1,
        cut_allowed=rng.random(n + 1) > 0.15,
    )
    # Per-node keeps: what a kept node's cache holds beyond what it creates, random nodes,
    # nodes that may not be kept.
    held = rng.choice([0, 0, 1, 4], n)
    problem = problem_of(
        storages,
        seconds,
        kept_bytes=np.array([s.nbytes for s in storages], dtype=np.int64) + held,
        random=rng.random(n) < 0.3,
        keepable=rng.random(n) > 0.2,
        **arrays,
    )
    problem = with_random_phases(problem, rng) if phased else problem
    if replays:
        replayable = (rng.random(n) < 0.5) & problem.keepable & ~problem.random
        reads = replayable & (rng.random(n) < 0.5)
        problem = dataclasses.replace(
            problem,
            replayable=replayable,
            replay_reads=reads,
            replay_share=np.where(reads, 0.25, 0.0),
            replay_flops=np.where(reads, problem.flops / 4, 0.0),
        )
    return problem


def with_random_phases(problem: Problem, rng) -> Problem:
    """``problem`` with random backward phases: per node one to three, one of them at the
    step's high point; per saver the phases from which a recomputed copy (after the first) and
    the graph's copy (no earlier) are gone, or never; and the last phase, or never, as the
    release of all the node's functions."""
    n = problem.size
    high = problem.activation_grad_alloc + problem.grad_bytes_at
    counts = rng.integers(1, 4, n)
    highs = []
    for i in range(n):
        phase_highs = rng.integers(0, high[i] + 1, counts[i])
        phase_highs[rng.integers(0, counts[i])] = high[i]
        highs.append(tuple(int(h) for h in phase_highs))
    released = [int(c) - 1 if c > 1 and rng.random() < 0.8 else None for c in counts]

    def ends(saver: int) -> tuple[int, int]:
        last = int(counts[saver]) - 1
        if last < 1 or rng.random() < 0.2:
            return NEVER, NEVER
        returned = int(rng.integers(1, last + 1))
        return returned, int(rng.integers(returned, last + 1))

    storages = tuple(
        dataclasses.replace(s, saver_ends=tuple(ends(j) for j in s.savers))
        for s in problem.storages
    )
    phases = BackwardPhases.of(highs, released)
    return dataclasses.replace(problem, storages=storages, backward_phases=phases)


def problem_of(storages: list[Storage], seconds, **arrays) -> Problem:
    """The ``Problem`` of ``storages``, storage ``k`` made by node ``k``: what follows from the
    storages (created bytes, which nodes save, bytes crossing each cut) is derived; ``arrays``
    gives the rest (workspace, gradient bookkeeping, checkpointable nodes, allowed cuts)."""
    n = len(storages)
    cut_delta = np.zeros(n + 2, dtype=np.int64)
    for s in storages:
        end = n if s.is_output else s.last_reader
        cut_delta[s.producer + 1] += s.nbytes
        cut_delta[end + 1] -= s.nbytes
    seconds = np.asarray(seconds, dtype=np.float64)
    return Problem(
        names=tuple(f"n{i}" for i in range(n)),
        labels=("op",) * n,
        flops=seconds * 1e12,
        bytes_moved=np.zeros(n),
        seconds=seconds,
        created_bytes=np.array([s.nbytes for s in storages], dtype=np.int64),
        saves=np.array([any(i in s.savers for s in storages) for i in range(n)]),
        saves_own=np.array([i in storages[i].savers for i in range(n)]),
        cut_bytes=np.cumsum(cut_delta)[: n + 1],
        articulation_cuts=(),
        storages=tuple(storages),
        fixed_bytes=100,
        parameter_bytes=50,
        gradient_bytes=50,
        **arrays,
    )


def all_plans(problem: Problem):
    """Every set of disjoint valid segments."""
    n = problem.size

    def from_position(start):
        yield ()
        for a in range(start, n):
            for b in range(a + 1, n + 1):
                if problem.is_valid_segment(a, b):
                    for rest in from_position(b):
                        yield ((a, b), *rest)

    return list(dict.fromkeys(from_position(0)))


def budgets(problem: Problem, plans=None) -> list[int]:
    """Every peak some plan reaches, and one byte below each: where the answer can change."""
    peaks = {simulate(problem, plan).peak_bytes for plan in plans or all_plans(problem)}
    return sorted({b for p in peaks for b in (p - 1, p)})


def all_nested_plans(problem) -> list[NestedChoice]:
    """Every nested plan of ``problem``: each level a set of disjoint valid segments, each
    segment holding any such set strictly inside it."""

    def level(start: int, stop: int, parent) -> list[tuple[Nest, ...]]:
        def from_position(p: int):
            yield ()
            for a in range(p, stop):
                for b in range(a + 1, stop + 1):
                    if problem.is_valid_segment(a, b) and (a, b) != parent:
                        for inner in level(a, b, (a, b)):
                            for rest in from_position(b):
                                yield (Nest(a, b, inner), *rest)

        return list(from_position(start))

    return [NestedChoice(plan) for plan in level(0, problem.size, None)]
