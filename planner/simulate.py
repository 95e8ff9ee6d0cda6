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


def _total_at(positions: np.ndarray, nbytes: np.ndarray, n: int) -> np.ndarray:
    """Bytes per position: ``nbytes`` summed by ``positions`` (exact integers, unlike bincount)."""
    total = np.zeros(n, dtype=np.int64)
    np.add.at(total, positions, nbytes)
    return total


def _releases(problem: Problem, segments: Segments, segment_of: np.ndarray):
    """Where each storage is freed: bytes freed after each node's forward and backward, and
    after each node of a recompute, plus the bytes each recompute node re-creates.

    A storage kept for backward is released at its first trigger: a saver outside any segment,
    or the start of another segment that saves or reads it. Recomputed copies are freed by
    their first saver inside the segment, else after their last reader the recompute runs.
    """
    n, a = problem.size, problem.storage_arrays
    never = n  # beyond every position: "no such node"
    starts = np.array([start for start, _ in segments] + [never], dtype=np.int64)
    ends = np.array([last_recomputed(problem, *segment) for segment in segments] + [-1], np.int64)
    home = segment_of[a.producer]

    def first(storage: np.ndarray, position: np.ndarray) -> np.ndarray:
        result = np.full(a.nbytes.size, never, dtype=np.int64)
        np.minimum.at(result, storage, position)
        return result

    saver_segment = segment_of[a.save_node]
    reader_segment = segment_of[a.read_node]
    elsewhere = np.where(saver_segment != home[a.save_storage], starts[saver_segment], never)
    release = np.minimum(
        first(a.save_storage, np.where(saver_segment < 0, a.save_node, elsewhere)),
        first(a.read_storage, np.where(
            (reader_segment >= 0) & (reader_segment != home[a.read_storage]),
            starts[reader_segment], never,
        )),
    )
    kept = release < never
    backward_free = _total_at(release[kept], a.nbytes[kept], n)
    forward_free = _total_at(a.last_use[~kept], a.nbytes[~kept], n)

    end = ends[home]  # -1 outside segments: nothing is recomputed
    recomputed = (a.producer < end) | ((a.producer == end) & problem.saves_own[end])
    inner_saver = first(
        a.save_storage, np.where(saver_segment == home[a.save_storage], a.save_node, never)
    )
    by_saver = recomputed & (inner_saver < never)
    backward_free += _total_at(inner_saver[by_saver], a.nbytes[by_saver], n)
    last_read = a.producer.copy()
    np.maximum.at(last_read, a.read_storage,
                  np.where(a.read_node <= end[a.read_storage], a.read_node, -1))
    by_reader = recomputed & (inner_saver == never)
    recompute_alloc = _total_at(a.producer[recomputed], a.nbytes[recomputed], n)
    recompute_free = _total_at(last_read[by_reader], a.nbytes[by_reader], n)
    return forward_free, backward_free, recompute_alloc, recompute_free, ends[:-1]


def simulate(problem: Problem, segments, *, record: bool = False) -> Simulation:
    """Replay one training step with ``segments`` checkpointed; see the module docstring.

    The replay is a sequence of steps (forward nodes, then backward nodes with each segment's
    recompute before its last node's backward), each allocating, peaking and freeing; the live
    bytes are a running sum over that sequence.
    """
    segments = validate_segments(problem, segments)
    n = problem.size
    segment_of = np.full(n, -1, dtype=np.int64)
    for k, (start, stop) in enumerate(segments):
        segment_of[start:stop] = k
    forward_free, backward_free, recompute_alloc, recompute_free, ends = _releases(
        problem, segments, segment_of
    )

    # The order of steps: forward 0..n-1, then from n-1 down to 0 the backward of each node,
    # preceded by its segment's recompute (start..end) when it is the segment's last node.
    phases, positions = [np.zeros(n, np.int8)], [np.arange(n)]
    upper = n
    for (start, stop), end in zip(reversed(segments), reversed(ends.tolist())):
        phases += [np.full(upper - stop, 2, np.int8), np.ones(end - start + 1, np.int8)]
        positions += [np.arange(upper - 1, stop - 1, -1), np.arange(start, end + 1)]
        upper = stop
    phases.append(np.full(upper, 2, np.int8))
    positions.append(np.arange(upper - 1, -1, -1))
    phase, position = np.concatenate(phases), np.concatenate(positions)

    backward = phase == 2
    recompute = phase == 1
    alloc = np.select(
        [phase == 0, recompute],
        [problem.created_bytes[position], recompute_alloc[position]],
        (problem.activation_grad_alloc + problem.grad_bytes_at)[position],
    )
    free = np.select(
        [phase == 0, recompute],
        [forward_free[position], recompute_free[position]],
        (problem.activation_grad_free + backward_free)[position],
    )
    transient = np.where(backward, 0, problem.workspace[position])
    live = np.cumsum(alloc - free) + free + transient  # at each step's high point
    peak = int(live.max(initial=0))

    # Summed in the order backward meets them (last segment first).
    recomputed = [slice(start, end + 1) for (start, _), end in zip(segments, ends.tolist())][::-1]
    timeline = None
    if record:
        names = ("forward", "recompute", "backward")
        timeline = tuple(zip([names[p] for p in phase.tolist()], position.tolist(),
                             live.tolist()))
    return Simulation(
        peak_bytes=int(problem.fixed_bytes + peak),
        recompute_seconds=sum((float(problem.seconds[span].sum()) for span in recomputed), 0.0),
        recompute_flops=sum((float(problem.flops[span].sum()) for span in recomputed), 0.0),
        timeline=timeline,
    )
