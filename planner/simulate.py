"""Simulate: replay one training step under a choice of checkpointed segments, independently of
how the choice was made, giving the predicted peak memory and the recompute cost.

The replay follows what PyTorch does with non-reentrant ``torch.utils.checkpoint``:

* forward: each node allocates the storages it creates (plus a transient workspace); a storage
  dies after its last reader unless something keeps it for backward: a saver outside any
  checkpointed segment, or a checkpointed segment that takes it as input (the segment holds its
  inputs until its backward is done). The graph's outputs live until the loss has read them
  (``planner.measure.training_step`` drops them before backward).
* backward, in reverse order: on reaching the last node of a checkpointed segment, the segment's
  forward runs again up to its last node that saves anything (early stop: autograd saves inputs
  before an op runs and outputs after, so when that last node saves only inputs its outputs are
  never re-created), re-creating its saved storages. Each node's backward then allocates what
  the profile's fake backward measured for it (gradients, temporaries), and frees what it
  measured plus the saved storages no earlier node needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.graph import Problem

Segments = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Simulation:
    """Result of a replay; bytes are absolute (fixed memory included)."""

    peak_bytes: int
    recompute_seconds: float
    recompute_flops: float
    # (phase, position, live bytes at the node's high point, before it frees anything)
    timeline: tuple[tuple[str, int, int], ...] | None = None


def validate_segments(problem: Problem, segments) -> Segments:
    """Sorted, disjoint, valid segments, or a ValueError naming the bad one."""
    result = tuple(sorted((int(a), int(b)) for a, b in segments))
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


def last_recomputed(problem: Problem, start: int, stop: int) -> int:
    """The last position a recompute of ``(start, stop)`` runs to (early stop), or start - 1."""
    saving = np.flatnonzero(problem.saves[start:stop])
    return start + int(saving[-1]) if saving.size else start - 1


def simulate(problem: Problem, segments, *, record: bool = False) -> Simulation:
    """Replay one training step with ``segments`` checkpointed; see the module docstring."""
    segments = validate_segments(problem, segments)
    n = problem.size
    segment_of = np.full(n, -1, dtype=np.int64)
    for k, (start, stop) in enumerate(segments):
        segment_of[start:stop] = k

    forward_free = np.zeros(n, dtype=np.int64)  # freed after node i's forward
    backward_free = np.zeros(n, dtype=np.int64)  # freed after node i's backward
    recompute_alloc: dict[int, list[tuple[int, int]]] = {}  # segment -> [(producer, bytes)]
    recompute_free: dict[int, list[tuple[int, int]]] = {}  # segment -> [(after, bytes)]
    for s in problem.storages:
        home = segment_of[s.producer]
        release = []
        for j in s.savers:
            if segment_of[j] < 0:
                release.append(j)
            elif segment_of[j] != home:
                release.append(segments[segment_of[j]][0])
        for j in s.readers:
            if segment_of[j] >= 0 and segment_of[j] != home:
                release.append(segments[segment_of[j]][0])
        if release:
            backward_free[min(release)] += s.nbytes
        elif s.is_output:
            forward_free[n - 1] += s.nbytes  # read by the loss, then dropped before backward
        else:
            forward_free[s.last_reader] += s.nbytes
        if home >= 0:
            start, stop = segments[home]
            end = last_recomputed(problem, start, stop)
            if s.producer > end or (s.producer == end and not problem.saves_own[end]):
                continue  # early stop: the recompute ends at the last save, before this exists
            inner_savers = [j for j in s.savers if start <= j < stop]
            recompute_alloc.setdefault(home, []).append((s.producer, s.nbytes))
            if inner_savers:
                backward_free[min(inner_savers)] += s.nbytes
            else:
                inner_readers = [j for j in s.readers if j <= end]
                after = max(inner_readers, default=s.producer)
                recompute_free.setdefault(home, []).append((after, s.nbytes))

    timeline = [] if record else None
    live = 0
    peak = 0
    for i in range(n):
        live += int(problem.created_bytes[i])
        peak = max(peak, live + int(problem.workspace[i]))
        if record:
            timeline.append(("forward", i, live + int(problem.workspace[i])))
        live -= int(forward_free[i])

    recompute_seconds = 0.0
    recompute_flops = 0.0
    for i in range(n - 1, -1, -1):
        k = segment_of[i]
        if k >= 0 and i == segments[k][1] - 1:
            start, _ = segments[k]
            end = last_recomputed(problem, start, i + 1)
            allocs = np.zeros(n, dtype=np.int64)
            frees = np.zeros(n, dtype=np.int64)
            for position, nbytes in recompute_alloc.get(k, ()):
                allocs[position] += nbytes
            for position, nbytes in recompute_free.get(k, ()):
                frees[position] += nbytes
            for j in range(start, end + 1):
                live += int(allocs[j])
                peak = max(peak, live + int(problem.workspace[j]))
                if record:
                    timeline.append(("recompute", j, live + int(problem.workspace[j])))
                live -= int(frees[j])
            recompute_seconds += float(problem.seconds[start : end + 1].sum())
            recompute_flops += float(problem.flops[start : end + 1].sum())
        live += int(problem.activation_grad_alloc[i] + problem.grad_bytes_at[i])
        peak = max(peak, live)
        if record:
            timeline.append(("backward", i, live))
        live -= int(problem.activation_grad_free[i] + backward_free[i])

    return Simulation(
        peak_bytes=int(problem.fixed_bytes + peak),
        recompute_seconds=recompute_seconds,
        recompute_flops=recompute_flops,
        timeline=tuple(timeline) if record else None,
    )
