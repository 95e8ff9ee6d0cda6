"""Simulate: replay one training step under a choice of checkpointed segments, independently of
how the choice was made, giving the predicted peak memory and the recompute cost.

The replay follows what PyTorch does with non-reentrant ``torch.utils.checkpoint``:

* forward: each node allocates the storages it creates (plus a transient workspace); a storage
  dies after its last reader unless something keeps it for backward: a saver outside any
  checkpointed segment, or a checkpointed segment that takes it as input (the segment holds its
  inputs until its backward is done). The graph's outputs live until the loss has read them
  (``planner.step.training_step`` drops them before backward).
* backward, in reverse order: on reaching the last node of a checkpointed segment, the segment's
  forward runs again up to its last node that saves anything (early stop: autograd saves inputs
  before an op runs and outputs after, so when that last node saves only inputs its outputs are
  never re-created), re-creating its saved storages. Each node's backward then allocates what
  the profile's fake backward measured for it (gradients, temporaries), and frees what it
  measured plus the saved storages no earlier node needs.
* optimizer step: on what backward leaves (parameter gradients), ``optimizer.step()`` holds its
  temporaries (``Problem.optimizer_step_bytes``); its state is fixed memory, live all along.

A choice may also *keep* nodes inside segments (``Choice.keep``), as
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` does with a policy that saves
their ops: a kept node's storages, outputs and temporaries alike (``Problem.kept_bytes``), stay
live from its forward until the segment's recompute, which takes them from the cache instead of
running the node (no time, no new memory); from there they are freed as recomputed copies are.
A kept node must be one the recompute runs (``recompute_stop``: a cache entry the recompute
never reaches would stay live until the segment's backward ends, and would save nothing), and
among the random nodes the recompute runs, the kept ones must come after all recomputed ones:
the recompute restores the random state of the segment's start, and a kept node draws nothing,
so a random node after it would draw different numbers.

What a recompute costs is the time (``Problem.seconds``) and FLOPs of the nodes it runs and
does not take from the cache (``recomputed_nodes``), one definition that the solvers, the
segment table and the plots share. The node where the early stop happens runs only when it
saves something it creates: a matmul that saves only its inputs is never run again.
"""

from __future__ import annotations

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
    recompute_seconds: float
    recompute_flops: float
    # Live bytes at the high point of optimizer.step() (after backward, plus its temporaries).
    optimizer_step_bytes: int = 0
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
    for k in sorted(keep):
        if not 0 <= k < problem.size:
            raise ValueError(
                f"kept position {k} is not a node of this graph (0..{problem.size - 1})"
            )
        if not problem.keepable[k]:
            raise ValueError(
                f"node {k} ({problem.names[k]}) cannot be kept: it creates no memory, mutates a "
                "tensor in place, what it creates is mutated later, or it runs under autocast"
            )
    for start, stop in segments:
        runs_to = recompute_stop(problem, start, stop)
        inside = sorted(k for k in keep if start <= k < stop)
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
    outside = keep - {k for start, stop in segments for k in range(start, stop)}
    if outside:
        k = min(outside)
        raise ValueError(f"node {k} ({problem.names[k]}) is kept but lies in no segment")
    return Choice(segments, keep)


def last_recomputed(problem: Problem, start: int, stop: int) -> int:
    """The last position a recompute of ``(start, stop)`` runs to (early stop), or start - 1."""
    saving = np.flatnonzero(problem.saves[start:stop])
    return start + int(saving[-1]) if saving.size else start - 1


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


def _total_at(positions: np.ndarray, nbytes: np.ndarray, n: int) -> np.ndarray:
    """Bytes per position: ``nbytes`` summed by ``positions`` (exact integers, unlike bincount)."""
    total = np.zeros(n, dtype=np.int64)
    np.add.at(total, positions, nbytes)
    return total


def _releases(problem: Problem, segments: Segments, segment_of: np.ndarray, kept: np.ndarray):
    """Where each storage is freed: bytes freed after each node's forward and backward, and
    after each node of a recompute, plus the bytes each recompute node re-creates.

    A storage kept for backward is released at its first trigger: a saver outside any segment,
    or the start of another segment that saves or reads it. Recomputed copies are freed by
    their first saver inside the segment, else after their last reader the recompute runs.
    Storages of kept nodes (``kept``, per node) live from the forward to the recompute, which
    re-creates nothing for them and then frees them as recomputed copies.
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
        first(
            a.read_storage,
            np.where(
                (reader_segment >= 0) & (reader_segment != home[a.read_storage]),
                starts[reader_segment],
                never,
            ),
        ),
    )
    cached = kept[a.producer]
    triggered = (release < never) & ~cached
    backward_free = _total_at(release[triggered], a.nbytes[triggered], n)
    in_forward = ~triggered & ~cached
    forward_free = _total_at(a.last_use[in_forward], a.nbytes[in_forward], n)

    end = ends[home]  # -1 outside segments: nothing is recomputed
    made = a.before_last_save & problem.saves_own[end]
    recomputed = (a.producer < end) | ((a.producer == end) & made)
    inner_saver = first(
        a.save_storage, np.where(saver_segment == home[a.save_storage], a.save_node, never)
    )
    by_saver = recomputed & (inner_saver < never)
    backward_free += _total_at(inner_saver[by_saver], a.nbytes[by_saver], n)
    last_read = a.producer.copy()
    np.maximum.at(
        last_read, a.read_storage, np.where(a.read_node <= end[a.read_storage], a.read_node, -1)
    )
    # autocast's cache holds a recomputed weight cast until the recompute ends (problem.py).
    last_read = np.where(a.cast_cache & recomputed, np.maximum(last_read, end), last_read)
    by_reader = recomputed & (inner_saver == never)
    created = recomputed & ~cached
    recompute_alloc = _total_at(a.producer[created], a.nbytes[created], n)
    recompute_free = _total_at(last_read[by_reader], a.nbytes[by_reader], n)
    return forward_free, backward_free, recompute_alloc, recompute_free, ends[:-1]


def simulate(problem: Problem, choice, *, record: bool = False) -> Simulation:
    """Replay one training step under ``choice`` (a ``Choice``, or plain segments); see the
    module docstring.

    The replay is a sequence of steps (forward nodes, then backward nodes with each segment's
    recompute before its last node's backward), each allocating, peaking and freeing; the live
    bytes are a running sum over that sequence.
    """
    from planner.nested import NestedChoice, simulate_nested  # nested imports this module

    if isinstance(choice, NestedChoice):  # nested plans replay step by step; flat ones here
        if choice.flat() is None:
            return simulate_nested(problem, choice, record=record)
        choice = choice.flat()
    choice = validate_choice(problem, choice)
    segments = choice.segments
    n = problem.size
    kept = np.zeros(n, dtype=bool)
    kept[list(choice.keep)] = True
    # A kept node's temporaries stay in the cache too: held from its forward to its recompute.
    held = np.where(kept, problem.kept_bytes - problem.created_bytes, 0)
    segment_of = np.full(n, -1, dtype=np.int64)
    for k, (start, stop) in enumerate(segments):
        segment_of[start:stop] = k
    forward_free, backward_free, recompute_alloc, recompute_free, ends = _releases(
        problem, segments, segment_of, kept
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

    recompute = phase == 1
    alloc = np.select(
        [phase == 0, recompute],
        [(problem.created_bytes + held)[position], recompute_alloc[position]],
        (problem.activation_grad_alloc + problem.grad_bytes_at)[position],
    )
    free = np.select(
        [phase == 0, recompute],
        [forward_free[position], (recompute_free + held)[position]],
        (problem.activation_grad_free + backward_free)[position],
    )
    # A kept node's forward holds its temporaries (no transient on top); its recompute runs none,
    # nor does the early stop's node when it saves only inputs.
    runs = recomputed_nodes(problem, choice)
    forward_transient = np.where(kept, np.maximum(problem.workspace - held, 0), problem.workspace)
    transient = np.select(
        [phase == 0, recompute & runs[position]],
        [forward_transient[position], problem.workspace[position]],
        0,
    )
    after = np.cumsum(alloc - free)
    live = after + free + transient  # at each step's high point
    peak = int(live.max(initial=0))
    # optimizer.step() runs on what backward leaves (gradients), with its temporaries.
    step = int(after[-1]) + problem.optimizer_step_bytes if n else problem.optimizer_step_bytes
    peak = max(peak, step)

    # Summed in the order backward meets them (last segment first).
    recomputed = [slice(start, stop) for start, stop in segments][::-1]
    seconds, flops = np.where(runs, problem.seconds, 0.0), np.where(runs, problem.flops, 0.0)
    timeline = None
    if record:
        names = ("forward", "recompute", "backward")
        timeline = tuple(zip([names[p] for p in phase.tolist()], position.tolist(), live.tolist()))
    return Simulation(
        peak_bytes=int(problem.fixed_bytes + peak),
        optimizer_step_bytes=int(problem.fixed_bytes + step),
        recompute_seconds=sum((float(seconds[span].sum()) for span in recomputed), 0.0),
        recompute_flops=sum((float(flops[span].sum()) for span in recomputed), 0.0),
        timeline=timeline,
    )
