"""Simulate: replay one training step under a choice of checkpointed segments, independently of
how the choice was made, giving the predicted peak memory and the recompute cost.

The replay follows what PyTorch does with non-reentrant ``torch.utils.checkpoint``:

* forward: each node allocates the storages it creates (plus a transient workspace); a storage
  dies after its last reader unless something keeps it for backward: a saver outside any
  checkpointed segment, or a checkpointed segment that takes it as input and saves anything
  (its checkpoint frame holds its inputs until the backward of its first saving node, where the
  last saved tensor that keeps the frame alive goes); a segment that saves nothing still holds
  its inputs until it returns (the caller's variable and the checkpoint call's arguments).
  The graph's outputs live until the loss has read them (``planner.step.training_step`` drops
  them before backward).
* backward, in reverse order: the nodes after a segment's last saving node unpack nothing, so
  their backward runs first; on reaching that node, the segment's forward runs again up to it
  (early stop: autograd saves inputs before an op runs and outputs after, so when that last
  node saves only inputs its outputs are never re-created), re-creating its saved storages.
  The segment's body is one Python frame, and the stop an exception raised inside it: what a
  node beyond the stop reads, or the segment returns, stays alive until the stop. Each node's
  backward then allocates what the profile's fake backward measured for it (gradients,
  temporaries), and frees what it measured plus the saved storages no earlier node needs.
* buffers: a segment that can update buffers (BatchNorm statistics) copies them when its
  forward starts and again when its recompute starts (``planner.rewrite.Segment``); both copies
  are freed when the recompute ends (``Problem.buffer_copy_bytes``), or with the segment's
  forward when it saves nothing.
* optimizer step: on what backward leaves (parameter gradients), ``optimizer.step()`` holds its
  temporaries (``Problem.optimizer_step_bytes``); its state is fixed memory, live all along.
* a tensor a custom autograd function keeps on its context (``Storage.held_by_context``) lives
  as long as the graph holding it: the forward's copy to the end of backward, checkpointed or
  not (checkpointing drops saved tensors only), a recompute's copy to the recompute's end.

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

A recompute also *replays* the nodes whose values nothing in it needs
(``planner.choice.replayed_nodes``: nothing of the segment saves what they make, and only
kept or replayed nodes of the recompute read it): they run through autograd on stand-ins
(``planner.rewrite._Replaying``), re-creating no storage and holding no workspace.

What a recompute costs is the time (``Problem.seconds``) and FLOPs of the nodes it runs and
neither takes from the cache nor replays (``recomputed_nodes``), one definition that the
solvers, the segment table and the plots share. The node where the early stop happens runs
only when it saves something it creates, and then only until its last save: a matmul that
saves only its inputs is never run again, a Linear under autocast runs its casts and stops
before its matmul (``Problem.stop_flops``; its time is charged whole, as the solvers do).
The checkpoint calls cost time of their own (``call_seconds``):
``Problem.checkpoint_seconds`` per segment and ``Problem.keep_seconds`` per kept or replayed
node, added to the recompute's seconds.
"""

from __future__ import annotations

import numpy as np

from planner.choice import (
    Choice,
    Segments,
    Simulation,
    as_choice,
    call_seconds,
    last_recomputed,
    recompute_costs,
    recompute_stop,
    recomputed_nodes,
    replayed_nodes,
    validate_choice,
    validate_segments,
)
from planner.nested import NestedChoice, simulate_nested
from planner.problem import NEVER, Problem

__all__ = [
    "Choice",
    "Segments",
    "Simulation",
    "as_choice",
    "call_seconds",
    "last_recomputed",
    "recompute_costs",
    "recompute_stop",
    "recomputed_nodes",
    "replayed_nodes",
    "simulate",
    "validate_choice",
    "validate_segments",
]


def _total_at(positions: np.ndarray, nbytes: np.ndarray, n: int) -> np.ndarray:
    """Bytes per position: ``nbytes`` summed by ``positions`` (exact integers, unlike bincount)."""
    total = np.zeros(n, dtype=np.int64)
    np.add.at(total, positions, nbytes)
    return total


def _releases(
    problem: Problem,
    segments: Segments,
    segment_of: np.ndarray,
    kept: np.ndarray,
    replayed: np.ndarray,
):
    """Where each storage is freed: bytes freed after each node's forward and backward, and
    after each node of a recompute, plus the bytes each recompute node re-creates; and per node,
    the part of what its backward frees that its high point does not hold, gone by then as its
    functions returned and were released (``BackwardPhases.credit``).

    A storage kept for backward is released at its first trigger: a saver outside any segment,
    or the start of another segment that saves or reads it. Recomputed copies are freed by
    their first saver inside the segment, else after their last reader the recompute runs.
    Storages of kept nodes (``kept``, per node) live from the forward to the recompute, which
    re-creates nothing for them and then frees them as recomputed copies. Replayed nodes
    (``replayed``, per node) re-create nothing either.
    """
    n, a = problem.size, problem.storage_arrays
    never = n  # beyond every position: "no such node"
    # A segment holds its inputs until the backward of its first saving node, where autograd
    # drops the last saved tensor that keeps its checkpoint frame alive; one that saves nothing
    # holds nothing.
    first_saving = [np.flatnonzero(problem.saves[start:stop]) for start, stop in segments]
    holds_to = np.array(
        [start + int(f[0]) if f.size else never for (start, _), f in zip(segments, first_saving)]
        + [never],
        dtype=np.int64,
    )
    ends = np.array([last_recomputed(problem, *segment) for segment in segments] + [-1], np.int64)
    home = segment_of[a.producer]

    def first(storage: np.ndarray, position: np.ndarray) -> np.ndarray:
        result = np.full(a.nbytes.size, never, dtype=np.int64)
        np.minimum.at(result, storage, position)
        return result

    saver_segment = segment_of[a.save_node]
    reader_segment = segment_of[a.read_node]
    elsewhere = np.where(saver_segment != home[a.save_storage], holds_to[saver_segment], never)
    # A saver's autograd context holds the forward's copy, checkpointed or not, as long as the
    # graph lives: to the end of backward (the last step, node 0's).
    saver_release = np.where(saver_segment < 0, a.save_node, elsewhere)
    saver_release = np.where(a.held_by_context[a.save_storage], 0, saver_release)
    release = np.minimum(
        first(a.save_storage, saver_release),
        first(
            a.read_storage,
            np.where(
                (reader_segment >= 0) & (reader_segment != home[a.read_storage]),
                holds_to[reader_segment],
                never,
            ),
        ),
    )
    # A kept node's weight casts are not in the selective cache: autocast's cache holds them
    # (planner.rewrite._Caching), and a recompute under a fresh region casts them again.
    cached = kept[a.producer] & ~a.cast_cache
    triggered = (release < never) & ~cached
    backward_free = _total_at(release[triggered], a.nbytes[triggered], n)
    # Where in its step's backward each goes (``Problem.backward_phases``): one the graph saves
    # there, as autograd releases the functions that unpacked it; one a checkpoint's frame
    # holds, as the last of the node's functions is released. What a context holds goes with
    # the graph, when backward ends.
    graph = triggered & ~a.held_by_context
    gone = np.where(graph, problem.backward_phases.released[np.minimum(release, n - 1)], NEVER)
    saver = (saver_segment < 0) & graph[a.save_storage]
    saver &= a.save_node == release[a.save_storage]
    gone[a.save_storage[saver]] = a.save_released[saver]
    gone_node, gone_phase = [release[graph]], [gone[graph]]
    gone_bytes = [a.nbytes[graph]]
    # A checkpoint call holds its arguments until it returns (the caller's variable and the
    # call's own), whatever its segment saves.
    returns = np.array([stop - 1 for _, stop in segments] + [-1], dtype=np.int64)
    argument = (reader_segment >= 0) & (reader_segment != home[a.read_storage])
    last_use = a.last_use.copy()
    np.maximum.at(last_use, a.read_storage[argument], returns[reader_segment[argument]])
    in_forward = ~triggered & ~cached
    forward_free = _total_at(last_use[in_forward], a.nbytes[in_forward], n)
    # Graph outputs the forward frees once the loss has read them (after its last node).
    outputs_read_by_loss = int(a.nbytes[in_forward & a.is_output & (last_use == n - 1)].sum())

    end = ends[home]  # -1 outside segments: nothing is recomputed
    made = a.before_last_save & problem.saves_own[end]
    recomputed = (a.producer < end) | ((a.producer == end) & made)
    inner_saver = first(
        a.save_storage, np.where(saver_segment == home[a.save_storage], a.save_node, never)
    )
    # A recompute's copy of what a context holds goes with the recompute's graph, at its end.
    inner_saver[a.held_by_context] = never
    by_saver = recomputed & (inner_saver < never)
    backward_free += _total_at(inner_saver[by_saver], a.nbytes[by_saver], n)
    # A recomputed copy goes as the functions that unpacked it return.
    handed = by_saver[a.save_storage] & (a.save_node == inner_saver[a.save_storage])
    gone_node.append(a.save_node[handed])
    gone_phase.append(a.save_returned[handed])
    gone_bytes.append(a.nbytes[a.save_storage[handed]])
    # The segment's body is one Python frame: what a node beyond the stop reads, or the segment
    # returns, stays in a variable until the recompute stops. autocast's cache holds a
    # recomputed weight cast until the recompute ends too (problem.py), and so does the graph
    # of the recompute a copy kept on an autograd context.
    last_read = a.producer.copy()
    np.maximum.at(last_read, a.read_storage, np.minimum(a.read_node, end[a.read_storage]))
    to_end = (a.cast_cache | a.is_output | a.held_by_context) & recomputed
    last_read = np.where(to_end, np.maximum(last_read, end), last_read)
    # A replay makes stand-ins, but for what its node saves itself (``replayed_nodes``).
    own = np.zeros(a.nbytes.size, dtype=bool)
    own[a.save_storage[a.save_node == a.producer[a.save_storage]]] = True
    recomputed &= ~replayed[a.producer] | own
    by_reader = recomputed & (inner_saver == never)
    created = recomputed & ~cached
    recompute_alloc = _total_at(a.producer[created], a.nbytes[created], n)
    recompute_free = _total_at(last_read[by_reader], a.nbytes[by_reader], n)
    credit = problem.backward_phases.credit(
        np.concatenate(gone_node), np.concatenate(gone_phase), np.concatenate(gone_bytes)
    )
    return (
        forward_free,
        backward_free,
        credit,
        recompute_alloc,
        recompute_free,
        ends[:-1],
        outputs_read_by_loss,
    )


def _hold_loss_through_first_recompute(problem, phase, alloc, free) -> None:
    """The loss and backward's seed live from the end of forward; the first backward step
    allocates them (``Problem.loss_bytes``). A recompute that runs before that step (a segment
    ending at the last saving node of the graph) holds them too. ``phase``: 2 for backward."""
    first_backward = int(np.argmax(phase == 2)) if problem.size else 0
    if first_backward > problem.size:  # recompute steps come between forward and it
        alloc[problem.size] += problem.loss_bytes
        free[first_backward - 1] += problem.loss_bytes


def simulate(problem: Problem, choice, *, record: bool = False) -> Simulation:
    """Replay one training step under ``choice`` (a ``Choice``, or plain segments); see the
    module docstring.

    The replay is a sequence of steps (forward nodes, then backward nodes with each segment's
    recompute before its last node's backward), each allocating, peaking and freeing; the live
    bytes are a running sum over that sequence.
    """
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
    replayed = replayed_nodes(problem, choice)
    releases = _releases(problem, segments, segment_of, kept, replayed)
    forward_free, backward_free, credit, *recomputes, ends, outputs = releases
    recompute_alloc, recompute_free = recomputes

    # The order of steps: forward 0..n-1, then from n-1 down to 0 the backward of each node,
    # preceded by its segment's recompute (start..end) when it is the segment's last saving
    # node: the first whose backward unpacks a saved tensor. A segment that restores buffers
    # copies them when its forward starts and again when its recompute starts; both copies go
    # when the recompute ends (``planner.rewrite.Segment``).
    copied = [problem.buffer_copy_bytes(start, stop) for start, stop in segments]
    copy_alloc, copy_free = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for (start, stop), end, nbytes in zip(segments, ends.tolist(), copied):
        copy_alloc[start] += nbytes
        if end < start:  # no recompute: the copies go with the segment's forward
            copy_free[stop - 1] += nbytes
    phases, positions = [np.zeros(n, np.int8)], [np.arange(n)]
    extra_alloc, extra_free = [copy_alloc], [copy_free]
    upper = n
    backwards = zip(reversed(segments), reversed(ends.tolist()), reversed(copied))
    for (start, _), end, nbytes in backwards:
        if end < start:
            continue  # it saves nothing: no recompute
        steps = end - start + 1
        phases += [np.full(upper - end - 1, 2, np.int8), np.ones(steps, np.int8)]
        positions += [np.arange(upper - 1, end, -1), np.arange(start, end + 1)]
        extra_alloc += [np.zeros(upper - end - 1, np.int64), np.zeros(steps, np.int64)]
        extra_free += [np.zeros(upper - end - 1, np.int64), np.zeros(steps, np.int64)]
        # What the triggering backward (the last saver's) has allocated when it unpacks is
        # held through the recompute too (``Problem.grad_before_unpack``).
        unpacking = int(problem.grad_before_unpack[end])
        extra_alloc[-1][0], extra_free[-1][-1] = nbytes + unpacking, 2 * nbytes + unpacking
        upper = end + 1
    phases.append(np.full(upper, 2, np.int8))
    positions.append(np.arange(upper - 1, -1, -1))
    extra_alloc.append(np.zeros(upper, np.int64))
    extra_free.append(np.zeros(upper, np.int64))
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
    # nor does the early stop's node when it saves only inputs, nor a replay computing nothing.
    runs = recomputed_nodes(problem, choice, replayed)
    computes = runs | (replayed & problem.replay_reads)
    forward_transient = np.where(kept, np.maximum(problem.workspace - held, 0), problem.workspace)
    # A recompute stopping inside a node holds its temporaries as they were at its last save.
    recompute_transient = problem.workspace.copy()
    stops = ends[ends >= 0]
    recompute_transient[stops] = problem.stop_workspace[stops]
    transient = np.select(
        [phase == 0, recompute & computes[position]],
        [forward_transient[position], recompute_transient[position]],
        0,
    )
    alloc = alloc + np.concatenate(extra_alloc)
    free = free + np.concatenate(extra_free)
    _hold_loss_through_first_recompute(problem, phase, alloc, free)
    after = np.cumsum(alloc - free)
    live = after + free + transient  # at each step's high point
    # A backward step's high point may come after some of what it frees is gone: as its
    # functions return and are released (``_releases``).
    backward = np.flatnonzero(phase == 2)
    live[backward] -= credit[position[backward]]
    peak = int(live.max(initial=0))
    if n:  # the default loss, summing the outputs after the last node has run
        peak = max(peak, int(after[n - 1]) + outputs + problem.default_loss_high)
    # optimizer.step() runs on what backward leaves (gradients), with its temporaries.
    step = int(after[-1]) + problem.optimizer_step_bytes if n else problem.optimizer_step_bytes
    peak = max(peak, step)

    # Summed in the order backward meets them (last segment first).
    recomputed = [slice(start, stop) for start, stop in segments][::-1]
    seconds, flops = recompute_costs(problem, choice, replayed)
    timeline = None
    if record:
        names = ("forward", "recompute", "backward")
        timeline = tuple(zip([names[p] for p in phase.tolist()], position.tolist(), live.tolist()))
    calls = call_seconds(problem, choice, replayed)
    return Simulation(
        peak_bytes=int(problem.fixed_bytes + peak),
        optimizer_step_bytes=int(problem.fixed_bytes + step),
        recompute_seconds=sum((float(seconds[span].sum()) for span in recomputed), 0.0) + calls,
        recompute_flops=sum((float(flops[span].sum()) for span in recomputed), 0.0),
        timeline=timeline,
        call_seconds=calls,
    )
