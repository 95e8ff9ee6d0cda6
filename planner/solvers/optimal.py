"""Least recompute under a budget: dynamic programming over blocks of the topological order.

A plan splits the order into *blocks*: single stored nodes and checkpointed segments. Every
allowed cut is a candidate segment boundary, so a plan may keep one expensive output and
recompute the cheap work around it.

Why a block DP can follow ``planner.simulate`` exactly: a storage that autograd keeps is
*released* at one backward step, the first of its *triggers* in order (a stored node that saves
it, or the start of another checkpointed segment that reads it). Charge each kept storage to the
block holding that trigger. Backward visits blocks last to first, so while it works on a block,
everything charged to earlier blocks is still alive. The live bytes at every instant of a
block's forward, recompute and backward are therefore ``R`` (the bytes charged to earlier
blocks) plus a *local* amount that depends only on the block and on which storages crossing its
first cut were already charged (the *mask*). Graph outputs are read by the loss after the last
node, so they count as read until the end of forward.

In words, the recurrence: the cheapest way to reach cut ``b`` with mask ``m'`` and charged bytes
``R'`` is the cheapest way to reach some earlier cut ``c`` (mask ``m``, charged ``R``), plus one
block ``[c, b)`` (a stored node when ``b = c + 1``, else a checkpointed segment) that fits,
``R + local(c, b, m) <= budget - fixed``, with ``R' = R + charged(c, b, m)`` and
``m'`` = the storages crossing ``b`` charged before or by this block::

    best(b, m')[R'] = min over blocks [c, b) of  best(c, m)[R] + recompute(c, b)

Since ``R`` only matters through the checks of later blocks, each state ``(cut, mask)`` keeps
the Pareto front of (charged bytes, cost) pairs as sorted numpy arrays; a block moves a whole
front at once, and only a prefix of it (the entries with least ``R``) can fit. When no plan fits,
the same search scores plans by their highest block peak instead, giving the lowest peak.

The search visits only candidate cuts. The stored nodes between two neighbouring candidates
form one block (each node must fit on top of what the nodes before it charged), so a search
pass costs per candidate and per segment tried, not per node.

Exactness and approximations
----------------------------
* Up to ``EXACT_NODES`` nodes the search is exact: fronts are not thinned, every allowed cut is
  a candidate and recompute peaks are replayed node by node. Its answer is the least recompute
  over all plans whose ``simulate`` peak fits (tests compare it with exhaustive search), or,
  when none fits, a plan of the lowest simulated peak.
* Larger problems use five explicit approximations, each on the safe side:

  - recompute peaks use ``_recompute_bound``, which can only over-estimate (so a plan the
    search accepts fits);
  - fronts keep two entries per ``bucket = limit // BUCKETS`` bytes of ``R`` (the cheapest
    and the least ``R``); the cheapest may hold up to ``bucket - 1`` bytes more than a dropped
    entry, so the answer costs no more than the best plan (under the bound) that fits
    ``budget - blocks * bucket``, where ``blocks`` counts that plan's blocks;
  - with more than ``CANDIDATE_CUTS`` allowed cuts, segments are searched coarse-to-fine
    (``_search``): a coarse pass over ``CANDIDATE_CUTS`` evenly spread cuts, then passes
    that move the best plan's boundaries to ever closer cuts and add short segments near the
    coarse cuts (``_corridors``). Each pass is
    optimal among the segments it tries, which include the best plan so far; the answer is
    the best of all passes;
  - a cut keeps at most ``MASKS`` masks (``_Search._masks_kept``: half with the cheapest
    entries, half with the least charged bytes). Storages alive whatever the plan, such as the
    weight casts autocast caches until its region exits, otherwise make thousands per cut.
  - refining passes and the keep pass drop every entry that already costs more than the best
    plan found before them (``_Search.ceiling``; block costs are never negative, so no plan
    through such an entry is cheaper). No plan cheaper than that one is lost, but the fronts
    are thinned among fewer entries, so plans can differ from a search without it, either way.

  The search never relies on these alone: ``solve`` replays its plan with ``simulate`` and
  also replays the ``greedy`` and ``sqrt_n`` plans, returning the cheapest that fits. So on
  large problems the result always fits when any of them fits, and never costs more than
  ``greedy`` or ``sqrt_n`` when they fit.
* Nodes kept inside segments (``Choice.keep``): up to ``EXACT_KEEP_NODES`` nodes the search
  tries every segment with every keep set too (``_KeepSets``: a kept node's cache is charged
  to its segment, like the segment's inputs, and the storages it keeps that cross the
  segment's end join the mask), so segments and keeps are chosen jointly and the answer is the
  least recompute over every valid ``Choice`` (tests compare it with the MILP). Larger graphs
  choose them jointly too, but only near the best segments-only plan, with a few keep sets per
  segment and a bound on their recompute peaks (``_keep_pass``, ``_keep_family``): three more
  approximations, each bounded by counts, none by time, so the same problem always gets the
  same plan. Keeps are also chosen after the segments, as before (``_prefix_keeps``); every
  plan is replayed beside the segments-only ones and wins only when cheaper.
* Segments stop growing from a cut as soon as their forward and backward peaks (which only
  grow with the segment) overflow the budget: no longer segment from there can fit.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from planner.problem import Problem
from planner.simulate import (
    Choice,
    Segments,
    Simulation,
    as_choice,
    last_recomputed,
    recompute_stop,
    simulate,
)
from planner.solvers import register
from planner.solvers.common import least_recompute_seconds

NEVER = np.iinfo(np.int64).max
STORED, SEGMENT = -1, 0  # kinds of blocks in the search's states; above 0: a keep set's id
EXACT_NODES = 48  # up to this many nodes: exact recompute peaks and unthinned fronts
CANDIDATE_CUTS = 96  # more allowed cuts than this: search coarse-to-fine
REFINE = 2  # each refining pass tries cuts this many times closer together, this many each side
SHORT = 8  # refining passes at this spacing or closer also try short segments near coarse cuts
BUCKETS = 256  # fronts of large problems keep one entry per 1/BUCKETS of the limit
MASKS = 64  # large problems keep at most this many masks per cut (_Search._masks_kept)
EXACT_MASKS = 1024  # and small ones this many: beyond, the exact search's time explodes
EXACT_KEEP_NODES = 12  # up to this many nodes: the search tries every keep set of every segment
# Larger graphs: a segment's keep sets use its KEEP_CANDIDATES most valuable nodes, every subset
# of them when there are at most KEEP_SUBSETS, else prefixes of 1, 2, 4, ... (_keep_family).
KEEP_CANDIDATES, KEEP_SUBSETS = 64, 4
# ... and keeps chosen after the segments (_prefix_keeps): on these coverings of the graph by
# articulation blocks, with PREFIXES evenly spaced prefix lengths, then FILL_NODES more nodes.
GROUPS, PREFIXES, FILL_NODES = (1, 2, 4), 64, 16
KEEP_ROUNDS = 2  # keep passes at most, each around the segments of the one before


@dataclass(frozen=True)
class _Tables:
    """Plan-independent arrays, computed once per problem."""

    nbytes: np.ndarray
    producer: np.ndarray
    last_use: np.ndarray  # last reader; the end of forward for graph outputs (the loss reads them)
    first_saver: np.ndarray  # NEVER when nothing saves the storage
    touches: tuple[tuple[int, ...], ...]  # sorted readers and savers of each storage
    crossing: tuple[tuple[int, ...], ...]  # per cut c: storages with producer < c <= last reader
    crossing_bits: tuple[int, ...]  # the same, as masks (_bits; masks are subsets of them)
    made_at: tuple[tuple[int, ...], ...]  # per node: storages it produces
    read_at: tuple[tuple[int, ...], ...]  # per node: storages it reads
    saved_first_at: tuple[tuple[int, ...], ...]  # per node: storages it saves first
    triggered_at: tuple[tuple[int, ...], ...]  # per node: storages crossing or made there it saves
    triggered_bits: tuple[int, ...]  # the same, as masks
    forward_live: np.ndarray  # per node: bytes alive by being read, plus its workspace
    backward_live: np.ndarray  # per node: gradients alive at its backward
    after_backward: np.ndarray  # per cut: gradients alive once backward reaches it
    saved_prefix: np.ndarray  # per node: cumulative bytes of storages first saved there
    kept_prefix: np.ndarray  # per node x: bytes of saved storages produced at or before x
    unsaved_alive: np.ndarray  # per node x: bytes of never-saved storages alive at x
    value: np.ndarray  # per node: _keep_value
    offered: np.ndarray  # per node: worth keeping (value > 0), making no cached weight cast
    remade_by_stop: np.ndarray  # per node: an early stop there makes all its storages again
    cache: np.ndarray  # per node: bytes its selective cache holds (storages made + temporaries)
    made_bytes: np.ndarray  # per node: bytes of the storages it makes
    read_until: np.ndarray  # per node: last use of the storages it makes (-1: none)
    # Problem.buffer_copies, flat: node, buffer, bytes, the node that passes the buffer in
    buffer_uses: tuple[np.ndarray, ...]
    # per node x: (positions, bytes) where keeping x adds to forward's live bytes: its storages
    # after their last reader, its temporaries in place of its workspace at x and after it
    cache_steps: tuple[tuple[np.ndarray, np.ndarray], ...]
    # per node x: nodes a recompute replays once x is kept (_replayed_with), wherever x's
    # segment starts at or before the first of them
    replayed_with: tuple[tuple[int, ...], ...]


_TABLES: weakref.WeakKeyDictionary[Problem, _Tables] = weakref.WeakKeyDictionary()


def _tables(problem: Problem) -> _Tables:
    """``_Tables`` of ``problem``, worked out once (``auto`` and a frontier solve it often)."""
    if problem not in _TABLES:
        _TABLES[problem] = _new_tables(problem)
    return _TABLES[problem]


def _new_tables(problem: Problem) -> _Tables:
    n = problem.size
    storages, arrays = problem.storages, problem.storage_arrays
    nbytes, producer, last_use = arrays.nbytes, arrays.producer, arrays.last_use
    first_saver = np.array([min(s.savers, default=NEVER) for s in storages], dtype=np.int64)

    crossing: list[list[int]] = [[] for _ in range(n + 1)]
    made_at: list[list[int]] = [[] for _ in range(n)]
    read_at: list[list[int]] = [[] for _ in range(n)]
    saved_first_at: list[list[int]] = [[] for _ in range(n)]
    alive = np.zeros(n + 1, dtype=np.int64)
    for k, s in enumerate(storages):
        made_at[s.producer].append(k)
        for j in s.readers:
            read_at[j].append(k)
        if s.savers:
            saved_first_at[min(s.savers)].append(k)
        for c in range(s.producer + 1, last_use[k] + 1):
            crossing[c].append(k)
        alive[s.producer] += s.nbytes
        alive[last_use[k] + 1] -= s.nbytes
    forward_live = np.cumsum(alive)[:n] + problem.workspace

    backward_live = np.zeros(n, dtype=np.int64)
    after_backward = np.zeros(n + 1, dtype=np.int64)
    grads = 0
    for i in range(n - 1, -1, -1):
        grads += int(problem.activation_grad_alloc[i] + problem.grad_bytes_at[i])
        backward_live[i] = grads
        grads -= int(problem.activation_grad_free[i])
        after_backward[i] = grads
    first_saved = np.zeros(n, dtype=np.int64)
    kept_made = np.zeros(n, dtype=np.int64)
    unsaved = np.zeros(n + 1, dtype=np.int64)
    for k in range(len(storages)):
        if first_saver[k] != NEVER:
            first_saved[first_saver[k]] += nbytes[k]
            kept_made[producer[k]] += nbytes[k]
        else:
            unsaved[producer[k]] += nbytes[k]
            unsaved[last_use[k] + 1] -= nbytes[k]
    made_bytes = np.zeros(n, dtype=np.int64)
    np.add.at(made_bytes, producer, nbytes)
    read_until = np.full(n, -1, dtype=np.int64)
    np.maximum.at(read_until, producer, last_use)
    buffer_uses = [(x, *use) for x, uses in enumerate(problem.buffer_copies) for use in uses]
    replayed_with = _replayed_with(problem, made_at, read_at)
    value = _keep_value(problem, replayed_with)
    makes_cast = np.zeros(n, dtype=bool)
    makes_cast[producer[arrays.cast_cache]] = True
    remade = np.ones(n, dtype=bool)
    remade[producer[~arrays.before_last_save]] = False
    triggered = tuple(
        tuple(k for k in (*crossing[x], *made_at[x]) if x in storages[k].savers) for x in range(n)
    )
    return _Tables(
        nbytes=nbytes,
        producer=producer,
        last_use=last_use,
        first_saver=first_saver,
        touches=tuple(tuple(sorted({*s.readers, *s.savers})) for s in storages),
        crossing=tuple(tuple(c) for c in crossing),
        crossing_bits=tuple(map(_bits, crossing)),
        made_at=tuple(map(tuple, made_at)),
        read_at=tuple(map(tuple, read_at)),
        saved_first_at=tuple(map(tuple, saved_first_at)),
        triggered_at=triggered,
        triggered_bits=tuple(map(_bits, triggered)),
        forward_live=forward_live,
        backward_live=backward_live,
        after_backward=after_backward,
        saved_prefix=np.cumsum(first_saved),
        kept_prefix=np.cumsum(kept_made),
        unsaved_alive=np.cumsum(unsaved)[:n],
        value=value,
        offered=(value > 0) & ~makes_cast,
        remade_by_stop=remade,
        cache=made_bytes + problem.kept_bytes - problem.created_bytes,
        made_bytes=made_bytes,
        read_until=read_until,
        buffer_uses=tuple(np.array(buffer_uses, dtype=np.int64).reshape(-1, 4).T),
        cache_steps=tuple(_cache_steps(problem, x, made_at[x], last_use, nbytes) for x in range(n)),
        replayed_with=replayed_with,
    )


def _replayed_with(problem: Problem, made_at: list, read_at: list) -> tuple[tuple[int, ...], ...]:
    """Per node x, the nodes that keeping x lets every recompute running x replay
    (``planner.choice.replayed_nodes``) whatever else it keeps: replayable nodes before x
    whose storages nothing but themselves saves and only x or others of them read, each of one
    op (``Problem.one_op``), none of those others computing from them in its replay (the scores
    ``q @ k.T`` and their scaling, under a kept softmax). A lower bound on what a keep set
    replays, which the search counts as spared (``_replay_credit``); ``simulate`` counts it
    all."""
    arrays = problem.storage_arrays
    readers: list[set[int]] = [set() for _ in range(problem.size)]
    unsaved = np.ones(problem.size, dtype=bool)  # saved by nothing but its maker
    for s in problem.storages:
        readers[s.producer].update(s.readers)
        unsaved[s.producer] &= set(s.savers) <= {s.producer} and not s.is_output
    open_ = problem.replayable & unsaved
    result: list[tuple[int, ...]] = []
    for x in range(problem.size):
        group, members = {x}, []
        waiting = sorted({int(arrays.producer[k]) for k in read_at[x]}, reverse=True)
        while waiting:
            p = waiting.pop(0)
            if p in group or not open_[p] or not readers[p] <= group:
                continue
            if not all(problem.one_op[r] for r in readers[p]):
                continue  # a reader of several ops may take another path on a stand-in
            if any(problem.replay_reads[r] for r in readers[p] - {x}):
                continue  # a member whose replay computes from it
            group.add(p)
            members.append(p)
            more = {int(arrays.producer[k]) for k in read_at[p]} - group
            waiting = sorted(set(waiting) | more, reverse=True)
        result.append(tuple(sorted(members)))
    return tuple(result)


def _replay_credit(problem: Problem, t: _Tables, c: int, keeps) -> np.ndarray:
    """Per keep set of a segment starting at ``c``: the recompute seconds its replays spare
    (``_Tables.replayed_with``), less what replaying costs (``call_seconds``)."""
    credit = np.zeros(len(keeps))
    for r, kept in enumerate(keeps):
        chosen = set(kept)
        replayed = {p for x in kept for p in t.replayed_with[x] if p >= c} - chosen
        if replayed:
            nodes = np.fromiter(replayed, np.int64)
            spared = problem.seconds - problem.replay_seconds - problem.keep_seconds
            credit[r] = float(spared[nodes].sum())
    return credit


def _bits(storages) -> int:
    """A set of storages as a mask: bit ``k`` says storage ``k`` is in it. Masks are dict keys
    and are or-ed and and-ed at every block the search tries, which ints do faster than sets."""
    mask = 0
    for k in storages:
        mask |= 1 << k
    return mask


def _cache_steps(problem: Problem, x: int, made: list[int], last_use, nbytes):
    """``_Tables.cache_steps`` of node ``x``."""
    held = int(problem.kept_bytes[x] - problem.created_bytes[x])
    at_x = max(0, held - int(problem.workspace[x]))
    positions = [*(int(last_use[k]) + 1 for k in made), x, x + 1]
    return np.array(positions, dtype=np.int64), np.array(
        [*(int(nbytes[k]) for k in made), at_x, held - at_x], dtype=np.int64
    )


def _recompute_peaks(problem: Problem, t: _Tables, c: int, stop: int) -> np.ndarray:
    """Peak live bytes of the recompute of ``[c, b)`` for every ``b`` in ``(c, stop]``.

    Index ``b - c - 1``; 0 where the segment saves nothing (no recompute). Recomputed copies are
    alive from their producer until the segment's last saving node when saved inside the
    segment, else until their last reader that is recomputed, or until the stop when something
    beyond it reads them. The recompute stops early, at the last saving node; outputs of that
    node are made again only if it saves one of them.
    """
    width = stop - c
    peaks = np.zeros(width, dtype=np.int64)
    kept_from = np.zeros(width + 1, dtype=np.int64)  # saved inside: alive from p to the end
    transient = np.zeros(width + 1, dtype=np.int64)  # difference array of [p, until] intervals
    until: dict[int, int] = {}  # recomputed, not (yet) saved inside -> last alive position
    saved_inside: set[int] = set()
    pending: tuple[int, ...] = ()  # made by the last saving node, not (yet) recomputed
    end, peak = c - 1, 0
    cast_cache = problem.storage_arrays.cast_cache

    def start(k: int) -> None:
        until[k] = int(t.producer[k])
        transient[until[k] - c] += t.nbytes[k]
        transient[until[k] - c + 1] -= t.nbytes[k]

    for x in range(c, stop):
        if problem.saves[x]:
            for k in t.saved_first_at[x]:
                if t.producer[k] < c:
                    continue
                saved_inside.add(k)
                kept_from[t.producer[k] - c] += t.nbytes[k]
                if k in until:
                    transient[t.producer[k] - c] -= t.nbytes[k]
                    transient[until.pop(k) - c + 1] += t.nbytes[k]
            for k in pending:
                if k not in saved_inside:
                    start(k)
            for y in range(end + 1, x + 1):
                for k in t.read_at[y]:
                    if k in until:
                        transient[until[k] - c + 1] += t.nbytes[k]
                        transient[y - c + 1] -= t.nbytes[k]
                        until[k] = y
                if y < x or problem.saves_own[x]:
                    for k in t.made_at[y]:
                        if k not in saved_inside:
                            start(k)
            # Read beyond the stop (graph outputs: by the loss), or a weight cast that autocast
            # caches: the frame, or the cache, holds it until then.
            for k, last in until.items():
                if (t.last_use[k] >= x or cast_cache[k]) and x > last:
                    transient[last - c + 1] += t.nbytes[k]
                    transient[x - c + 1] -= t.nbytes[k]
                    until[k] = x
            pending = () if problem.saves_own[x] else t.made_at[x]
            end = x
            span = end - c + 1
            live = np.cumsum(kept_from[:span]) + np.cumsum(transient[:span])
            work = problem.workspace[c : end + 1].copy()
            work[-1] *= bool(problem.saves_own[end])  # the early stop's node may not run
            peak = int((live + work).max())
        peaks[x - c] = peak
    return peaks


def _recompute_bound(problem: Problem, t: _Tables, c: int, stop: int) -> np.ndarray:
    """An upper bound on ``_recompute_peaks``, in a few vectorised passes.

    It counts every storage made in the segment that *anything* saves as kept from its producer
    to the end of the recompute, and every other one as alive from its producer to its last
    reader; the exact replay keeps some of them for less time (saved only after the segment,
    not re-created by the early stop), never for more. Over-estimating a peak only makes the
    search conservative: its plans still fit.
    """
    running = np.maximum.accumulate(_recompute_bound_profile(problem, t, c, stop))
    last = _last_saving(problem, c, stop)
    return np.where(last >= 0, running[np.maximum(last, 0)], 0)


def _recompute_bound_profile(problem: Problem, t: _Tables, c: int, stop: int) -> np.ndarray:
    """Per node of ``[c, stop)``: the live bytes ``_recompute_bound`` counts when the recompute
    of a segment from ``c`` runs it, its workspace included."""
    live = t.kept_prefix[c:stop] - (t.kept_prefix[c - 1] if c else 0) + t.unsaved_alive[c:stop]
    for k in t.crossing[c]:  # never-saved inputs of the segment are not re-created
        if t.first_saver[k] == NEVER:
            live[: t.last_use[k] - c + 1] -= t.nbytes[k]
    return live + problem.workspace[c:stop]


def _last_saving(problem: Problem, c: int, stop: int) -> np.ndarray:
    """Per ``b`` in ``(c, stop]`` (index ``b - c - 1``): offset of the last saving node, or -1."""
    saving_position = np.where(problem.saves[c:stop], np.arange(stop - c), -1)
    return np.maximum.accumulate(saving_position)


def _segment_costs(problem: Problem, t: _Tables, c: int, stop: int, exact: bool):
    """Mask-independent parts of the segments ``[c, b)`` for every ``b`` in ``(c, stop]``.

    Returns the recompute peak plus the gradients alive then (backward has passed the nodes
    after the last saving one), and the recompute cost: the forward time of the nodes the
    recompute runs (``recompute_stop``), as ``simulate`` charges it.
    """
    bound = _recompute_peaks if exact else _recompute_bound
    peaks = bound(problem, t, c, stop)
    last = _last_saving(problem, c, stop)
    grads = np.where(last >= 0, t.after_backward[c + last + 1], 0)
    before = np.concatenate(([0.0], np.cumsum(problem.seconds[c:stop])))
    at_stop = c + np.maximum(last, 0)
    runs_to = np.where(problem.saves_own[at_stop], last + 1, last)  # recompute_stop - c
    cost = np.where(last >= 0, before[np.maximum(runs_to, 0)], 0.0)
    return peaks + grads, cost


@dataclass(frozen=True)
class _Start:
    """The parts of ``_segment_locals`` for the segments ``[c, b)`` from one cut ``c`` that no
    mask changes; arrays indexed ``b - c - 1`` for ``b`` in ``(c, stop]``."""

    inputs: tuple[int, ...]  # storages crossing c
    nbytes: np.ndarray  # of each input
    freed: np.ndarray  # per input: offset after its last reader (at most the width)
    charges: np.ndarray  # per input: offset from which a segment holds it; the width when never
    saves: np.ndarray  # the segment saves something
    last: np.ndarray  # offset of its last saving node, or -1
    before: np.ndarray  # highest backward of the nodes before its first saving one
    after: np.ndarray  # highest backward from its first saving node on, inputs not counted
    with_saved: np.ndarray  # highest backward from its recompute on, inputs not counted
    tail: np.ndarray  # highest backward of the nodes after its last saving one
    copies: np.ndarray  # buffer copies (Problem.buffer_copy_bytes)


def _segment_start(problem: Problem, t: _Tables, c: int, stop: int) -> _Start:
    """``_Start`` of the segments from ``c`` (see ``_segment_locals``)."""
    width = stop - c
    saving = np.flatnonzero(problem.saves[c:stop])
    first = int(saving[0]) if saving.size else width  # offset of the first saving node
    saved_here = t.saved_prefix[c:stop] - (t.saved_prefix[c - 1] if c else 0)
    inputs = t.crossing[c]
    nbytes = t.nbytes[list(inputs)].astype(np.int64)
    first_saver = t.first_saver[list(inputs)]
    inner = (first_saver >= c) & (first_saver < stop)  # recomputed copies only come from inside
    saved_here = saved_here - _running(width, first_saver[inner] - c, nbytes[inner])
    touch = np.array([next((j for j in t.touches[k] if j >= c), NEVER) for k in inputs], np.int64)
    charges = np.where(touch < stop, np.maximum(touch - c, first), width)
    saves = np.arange(width) >= first
    grads = t.backward_live[c:stop]
    before = np.maximum.accumulate(grads)  # the backward of nodes before the first saving one
    before = np.where(saves, before[max(first - 1, 0)] if first else 0, before)
    last = _last_saving(problem, c, stop)
    with_saved = np.maximum.accumulate(np.where(saves, grads + saved_here, 0))
    # The highest gradients after the last saving node: a running maximum that restarts at each
    # saving node (group offsets larger than any value keep groups apart).
    group = np.cumsum(problem.saves[c:stop])
    scale = int(grads.max(initial=0)) + 1
    tail_values = np.where(problem.saves[c:stop], 0, grads) + group * scale
    tail = np.maximum.accumulate(tail_values) - group * scale
    with_saved = with_saved[np.maximum(last, 0)]
    return _Start(
        inputs=inputs,
        nbytes=nbytes,
        freed=np.minimum(t.last_use[list(inputs)] - c + 1, width),
        charges=charges,
        saves=saves,
        last=last,
        before=before,
        after=np.maximum(with_saved, tail),
        with_saved=with_saved,
        tail=tail,
        copies=_copy_bytes(problem, t, c, stop),
    )


def _running(width: int, offsets: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Per offset below ``width``: the bytes of ``nbytes`` whose offset is at or before it."""
    steps = np.zeros(width + 1, dtype=np.int64)
    np.add.at(steps, offsets, nbytes)
    return np.cumsum(steps[:width])


def _segment_locals(
    t: _Tables,
    c: int,
    masks: list[int],
    start: _Start,
    recompute: np.ndarray,
    width: int,
    keeps: bool = False,
) -> list[tuple]:
    """Per mask of ``masks``: charged bytes, local peak and its monotone part for the segments
    ``[c, b)``, and, with ``keeps``, the ``_SavingParts`` that keep sets add to (else None).
    The masks of one cut are worked out together, as rows of one array.

    Arrays are indexed ``b - c - 1`` for ``b`` in ``(c, c + width]`` (the segments a pass
    tries: often far fewer than the ``_Start`` covers). A segment holds its inputs
    from its forward until the backward of its first saving node, and only if it saves
    anything. Backward passes the nodes after its last saving node before the recompute runs,
    so their backward sees no recomputed copies. The monotone part (forward and backward peaks)
    never decreases with ``b``, so once it overflows the budget no longer segment from ``c``
    can fit: the search stops extending there.
    """
    forward = t.forward_live[c : c + width][None, :]
    if start.inputs:
        # An input charged to an earlier block is not counted twice while it is read; the
        # others are charged here, alive until the segment's backward ends. Row k of a
        # "steps" array holds input k's bytes from its offset on.
        read = np.array([[mask >> k & 1 for k in start.inputs] for mask in masks], dtype=np.int64)
        here = 1 - read
        offsets = np.arange(width)
        freed_steps = np.where(start.freed[:, None] <= offsets, start.nbytes[:, None], 0)
        charge_steps = np.where(start.charges[:, None] <= offsets, start.nbytes[:, None], 0)
        forward = forward - ((read @ start.nbytes)[:, None] - read @ freed_steps)
        held = here @ freed_steps  # after their last reader
        charged = here @ charge_steps
    else:
        held = charged = np.zeros((len(masks), width), dtype=np.int64)
    saves, last, copies = start.saves[:width], start.last[:width], start.copies[:width]
    recompute = recompute[:width]
    forward_peak = np.where(
        saves,
        np.maximum.accumulate(forward + held, axis=1),
        np.maximum.accumulate(forward, axis=1),
    )
    before, after = start.before[:width], start.after[:width]
    backward = np.maximum(before, np.where(saves, after + charged, 0))
    monotone = np.maximum(forward_peak, backward)
    # Buffer copies (Problem.buffer_copy_bytes): held from the segment's forward to the end of
    # its recompute, twice during it; with no recompute they go with the forward. The backward
    # of the nodes after the last saving one runs before the recompute, copies still held.
    held_copies = np.where(last >= 0, copies, 0)
    monotone = np.maximum(monotone, forward_peak + copies)  # forward_peak already runs up
    replays = (np.arange(width) > last) & (last >= 0)
    tail = start.tail[:width]
    before_recompute = np.where(replays, tail + charged + held_copies, 0)
    local = np.maximum(
        np.maximum(monotone, before_recompute), recompute + charged + 2 * held_copies
    )
    charged_here = charged + held_copies
    if not keeps:
        return [(charged_here[m], local[m], monotone[m], None) for m in range(len(masks))]
    forward_held = forward + held
    after_recompute = np.maximum(before, start.with_saved[:width] + charged)
    base = t.after_backward[c + np.maximum(last, 0) + 1] + charged + 2 * copies
    return [
        (
            charged_here[m],
            local[m],
            monotone[m],
            _SavingParts(
                forward=forward_held[m],
                copies=copies,
                after_recompute=after_recompute[m],
                before_recompute=tail + charged[m] + copies,
                recompute_base=base[m],
            ),
        )
        for m in range(len(masks))
    ]


@dataclass(frozen=True)
class _SavingParts:
    """The pieces of ``_segment_locals`` for segments ``[c, b)`` that save something, which
    kept nodes (``_KeepSets``) add to: arrays indexed ``b - c - 1``, except ``forward`` (per
    node of ``[c, stop)``: live bytes at its forward, the held inputs included)."""

    forward: np.ndarray
    copies: np.ndarray  # buffer copies: held from the forward to the end of the recompute
    after_recompute: np.ndarray  # highest backward once the recompute has run
    before_recompute: np.ndarray  # backward of the nodes after the last saving one (+ charged)
    recompute_base: np.ndarray  # live besides the recompute's own copies while it runs

    def locals(self, b_index: int, sets: _KeepSets) -> np.ndarray:
        """Local peak of the segment ending at index ``b_index`` under each keep set: the
        caches run up the forward, stay until the recompute (whose first steps then hold them)
        and change nothing after it (the recompute frees them as it frees copies)."""
        forward = (self.forward[: b_index + 1] + sets.forward).max(axis=1) + self.copies[b_index]
        return np.maximum.reduce(
            [
                forward,
                np.full(len(sets.keeps), self.after_recompute[b_index]),
                self.before_recompute[b_index] + sets.cache,
                self.recompute_base[b_index] + sets.recompute,
            ]
        )


@dataclass(frozen=True)
class _KeepSets:
    """Every keep set of one segment ``[c, b)`` and what it changes, whatever the mask.

    Kept nodes are additive: each holds its storages from its forward to the recompute
    (``cache``), keeps them past their last reader in forward, fills the recompute's steps
    before its own with them and spares the recompute its workspace (``planner.simulate``), so
    a set's effects are sums of per-node rows.
    """

    nodes: np.ndarray  # every node some set keeps
    keeps: tuple[tuple[int, ...], ...]
    forward: np.ndarray  # (sets, b - c): bytes the caches add at each node's forward
    recompute: np.ndarray  # (sets,): the recompute's own peak with the keeps
    cache: np.ndarray  # (sets,): bytes held from the forward to the recompute
    saved: np.ndarray  # (sets,): recompute seconds spared, less what the kept nodes cost


def _keep_candidates(problem: Problem, t: _Tables, c: int, b: int) -> tuple[list, list]:
    """(non-random, random) nodes of ``[c, b)`` the recompute runs that a keep set may hold.

    Left out, as the MILP leaves them: nodes making a weight cast that autocast caches (the
    selective cache does not hold it), and an early-stop node making a storage its recompute
    does not re-create (nothing would free its cache entry).
    """
    end, runs_to = last_recomputed(problem, c, b), recompute_stop(problem, c, b)
    arrays = problem.storage_arrays
    candidates = [
        x
        for x in range(c, runs_to)
        if problem.keepable[x]
        and not any(arrays.cast_cache[k] for k in t.made_at[x])
        and (x < end or all(arrays.before_last_save[k] for k in t.made_at[x]))
    ]
    return [x for x in candidates if not problem.random[x]], [
        x for x in candidates if problem.random[x]
    ]


def _keep_sets(problem: Problem, t: _Tables, c: int, b: int) -> _KeepSets | None:
    """Every valid non-empty keep set of the segment ``[c, b)`` (``validate_choice``): any
    subset of its non-random candidates, with a suffix of its random nodes (kept random nodes
    come after every recomputed one); None when it has none. Exact: the search's answer with
    them is the least recompute over every ``Choice``."""
    plain, randoms = _keep_candidates(problem, t, c, b)
    runs_to = recompute_stop(problem, c, b)
    every_random = np.flatnonzero(problem.random[c:runs_to]) + c
    suffixes = [
        tuple(every_random[i:].tolist())
        for i in range(every_random.size + 1)
        if set(every_random[i:].tolist()) <= set(randoms)
    ]
    nodes = plain + randoms
    if not nodes:
        return None
    column = {x: j for j, x in enumerate(nodes)}
    rows = []
    for mask in range(1 << len(plain)):
        for suffix in suffixes:
            chosen = [x for j, x in enumerate(plain) if mask >> j & 1] + list(suffix)
            if chosen:
                rows.append(chosen)
    member = np.zeros((len(rows), len(nodes)), dtype=np.int64)
    for r, chosen in enumerate(rows):
        member[r, [column[x] for x in chosen]] = 1

    width, steps = b - c, last_recomputed(problem, c, b) - c + 1
    forward = np.zeros((len(nodes), width), dtype=np.int64)
    recompute = np.zeros((len(nodes), steps), dtype=np.int64)
    for j, x in enumerate(nodes):
        held = int(problem.kept_bytes[x] - problem.created_bytes[x])
        for k in t.made_at[x]:
            forward[j, t.last_use[k] - c + 1 :] += t.nbytes[k]  # not freed in forward
            recompute[j, : x - c] += t.nbytes[k]  # in the cache before the recompute makes it
        forward[j, x - c] += max(0, held - int(problem.workspace[x]))  # replaces its workspace
        forward[j, x - c + 1 :] += held
        recompute[j, : x - c + 1] += held
        recompute[j, x - c] -= problem.workspace[x]  # the recompute does not run it
    profile = _recompute_profile(problem, t, c, b)
    return _KeepSets(
        nodes=np.array(nodes, dtype=np.int64),
        keeps=tuple(map(tuple, rows)),
        forward=member @ forward,
        recompute=(profile + member @ recompute).max(axis=1),
        cache=member @ t.cache[nodes],
        saved=member @ (problem.seconds[nodes] - problem.keep_seconds)  # call_seconds
        + _replay_credit(problem, t, c, rows),
    )


def _keep_family(
    problem: Problem, t: _Tables, c: int, b: int, profile: np.ndarray, ranked: np.ndarray
):
    """A few keep sets of the segment ``[c, b)`` for graphs above ``EXACT_KEEP_NODES``, with
    bounds on what they add (None when it has no candidate).

    The sets: of its ``KEEP_CANDIDATES`` most valuable candidates (``_keep_value``, random
    nodes left out), every subset when there are at most ``KEEP_SUBSETS``, else the prefixes
    of 1, 2, 4, ... of them and all of them. What a set adds in forward is exact (as in
    ``_keep_sets``); in the recompute it is bounded: a kept node's storages count from its
    start to the kept node's step, its temporaries to that step included, on top of
    ``profile`` (the ``_recompute_bound_profile`` from ``c``, which counts the storages from
    there on anyway), and its workspace is not taken off. ``ranked``: the offered nodes from
    ``c`` on, most valuable first (``_ranked``).
    """
    end, runs_to = last_recomputed(problem, c, b), recompute_stop(problem, c, b)
    run = (ranked < end) | ((ranked < runs_to) & t.remade_by_stop[ranked])
    nodes = ranked[run][:KEEP_CANDIDATES]
    if not nodes.size:
        return None
    count, listed = nodes.size, nodes.tolist()
    if count <= KEEP_SUBSETS:
        every = np.arange(1, 1 << count)
        member = (every[:, None] >> np.arange(count)[None, :]) & 1
        keeps = tuple(tuple(x for j, x in enumerate(listed) if row >> j & 1) for row in every)
    else:
        sizes = sorted({min(1 << k, count) for k in range(count.bit_length() + 1)})
        member = (np.arange(count)[None, :] < np.array(sizes)[:, None]).astype(np.int64)
        keeps = tuple(tuple(listed[:size]) for size in sizes)
    width, steps = b - c, end - c + 1
    steps_of = [t.cache_steps[x] for x in nodes.tolist()]
    positions = np.concatenate([positions for positions, _ in steps_of])
    nbytes = np.concatenate([nbytes for _, nbytes in steps_of])
    column = np.repeat(np.arange(count), [positions.size for positions, _ in steps_of])
    forward = np.zeros((width + 1, len(member)), dtype=np.int64)  # difference arrays, by column
    np.add.at(forward, np.minimum(positions - c, width), nbytes[:, None] * member[:, column].T)
    made = member * t.made_bytes[nodes][None, :]
    held = member * (t.cache - t.made_bytes)[nodes][None, :]
    until = np.zeros((len(member), steps + 1), dtype=np.int64)
    np.add.at(until.T, nodes - c, -made.T)
    np.add.at(until.T, nodes - c + 1, -held.T)
    until[:, 0] += (made + held).sum(axis=1)
    return _KeepSets(
        nodes=nodes,
        keeps=keeps,
        forward=np.cumsum(forward, axis=0)[:width].T,
        recompute=(profile[:steps] + np.cumsum(until, axis=1)[:, :steps]).max(axis=1),
        cache=(made + held).sum(axis=1),
        saved=member @ (problem.seconds[nodes] - problem.keep_seconds)  # call_seconds
        + _replay_credit(problem, t, c, keeps),
    )


def _ranked(t: _Tables, c: int, stop: int) -> np.ndarray:
    """The offered nodes of ``[c, stop)`` (``_Tables.offered``), most valuable first (in
    order of position among equals)."""
    nodes = np.flatnonzero(t.offered[c:stop]) + c
    return nodes[np.argsort(-t.value[nodes], kind="stable")]


def _recompute_profile(problem: Problem, t: _Tables, c: int, b: int) -> np.ndarray:
    """Live bytes at each step of the recompute of ``[c, b)`` (nothing kept), above what is
    live when it starts, as ``planner.simulate`` replays it: a re-created storage lives from
    its producer to the end of the recompute when a node of the segment saves it, else to its
    last reader the recompute runs (the stop, for what the stop's node or a later one reads,
    and for graph outputs and weight casts); each node the recompute runs adds its workspace.
    """
    end, runs_to = last_recomputed(problem, c, b), recompute_stop(problem, c, b)
    arrays = problem.storage_arrays
    delta = np.zeros(end - c + 2, dtype=np.int64)
    for x in range(c, end + 1):
        for k in t.made_at[x]:
            if x == end and not (problem.saves_own[end] and arrays.before_last_save[k]):
                continue  # the early stop's node does not make it again
            storage = problem.storages[k]
            if any(c <= j < b for j in storage.savers) or storage.is_output or storage.cast_cache:
                until = end
            else:
                until = max([x, *(min(j, end) for j in storage.readers)])
            delta[x - c] += t.nbytes[k]
            delta[until - c + 1] -= t.nbytes[k]
    work = np.where(np.arange(c, end + 1) < runs_to, problem.workspace[c : end + 1], 0)
    return np.cumsum(delta)[:-1] + work


def _copy_bytes(problem: Problem, t: _Tables, c: int, stop: int) -> np.ndarray:
    """``problem.buffer_copy_bytes(c, b)`` for every ``b`` in ``(c, stop]`` (index ``b - c - 1``):
    a buffer passed in by a node of the segment is never copied, so only those passed from
    before ``c`` (or by no node) count, once each, from the first node that uses it."""
    node, buffer, nbytes, passed_by = t.buffer_uses
    chosen = np.flatnonzero((node >= c) & (node < stop) & (passed_by < c))
    _, first = np.unique(buffer[chosen], return_index=True)  # uses are in node order
    chosen = chosen[first]
    return _running(stop - c, node[chosen] - c, nbytes[chosen])


def _stored_local(t: _Tables, c: int, mask: int):
    """Charged bytes and local peak of keeping node ``c`` outside every segment (``mask``: the
    storages crossing cut ``c`` already charged)."""
    charged = sum(int(t.nbytes[k]) for k in t.triggered_at[c] if not mask >> k & 1)
    forward = int(t.forward_live[c]) - sum(int(t.nbytes[k]) for k in t.crossing[c] if mask >> k & 1)
    return charged, max(forward, int(t.backward_live[c]) + charged)


def _next_mask(t: _Tables, b: int, previous: int, triggered: int) -> int:
    """Storages crossing cut ``b`` already charged: before, or by the block just chosen."""
    return (previous | triggered) & t.crossing_bits[b]


def _pareto(charged: np.ndarray, value: np.ndarray, bucket: int, ordered: bool = False):
    """Indices of the entries no other beats on both charged bytes and value, thinned to two
    per ``bucket`` bytes of charged memory; ``ordered``: charged bytes already strictly
    increase (one chunk of a front), so no sort is needed.

    The front comes out sorted by charged bytes, values strictly decreasing. Thinning keeps, of
    the entries whose charged bytes share one multiple of ``bucket``, the one of least value
    (it may hold up to ``bucket - 1`` bytes more than a dropped one) and the one of least
    memory (what a tight budget needs). With ``bucket == 1`` nothing is thinned.

    The sort is stable: of entries equal on both counts, the first merged is kept, so the plan
    does not depend on the tie order of the sort numpy picks for the CPU (and timsort merges
    the sorted chunks faster than quicksort sorts them).
    """
    # Filters are made with np.empty and filled with out= (np.ones costs more than the work on
    # short fronts).
    order = None if ordered else charged.argsort(kind="stable")
    values = value if order is None else value[order]
    keep = np.empty(values.size, dtype=bool)
    keep[0] = True
    np.less(values[1:], np.minimum.accumulate(values)[:-1], out=keep[1:])
    order = keep.nonzero()[0] if order is None else order[keep]
    sizes = charged[order]
    if not ordered:
        # Of entries with equal charged bytes, the last kept is the cheapest (values decrease).
        last = np.empty(order.size, dtype=bool)
        last[-1] = True
        np.not_equal(sizes[1:], sizes[:-1], out=last[:-1])
        order, sizes = order[last], sizes[last]
    if bucket > 1 and order.size > 2:
        change = sizes[1:] // bucket != sizes[:-1] // bucket
        edge = np.empty(order.size, dtype=bool)
        edge[0] = edge[-1] = True
        np.logical_or(change[:-1], change[1:], out=edge[1:-1])
        order = order[edge]
    return order


class _OutOfTime(Exception):
    """A search pass ran past the solver's time limit."""


@dataclass
class _Search:
    """One run of the DP over a set of candidate cuts.

    ``limit`` is the memory above fixed bytes that every block must fit. ``peak_mode`` scores a
    plan by its highest block peak instead of its recompute cost (used when no plan fits the
    budget, to find the lowest peak). With ``keeps``, every segment is also tried with each of
    its keep sets (``_KeepSets``): segments and kept nodes are then chosen jointly.
    """

    problem: Problem
    t: _Tables
    limit: int
    peak_mode: bool
    exact: bool
    bucket: int
    candidate_cuts: int = CANDIDATE_CUTS
    deadline: float = math.inf  # time.perf_counter() past which a pass stops (_OutOfTime)
    keeps: bool = False
    # Entries costing more than this are dropped (the cost of a plan already found): block costs
    # are never negative, so no plan through them can cost less (see _extend).
    ceiling: float = math.inf
    segment_memo: dict = field(default_factory=dict)  # per c: (stop, _segment_costs)
    step_memo: dict = field(default_factory=dict)
    # A state entry's block: STORED, SEGMENT (nothing kept) or the keep set of that id.
    keep_memo: dict = field(default_factory=dict)
    profile_memo: dict = field(default_factory=dict)  # per c: _recompute_bound_profile, _ranked
    start_memo: dict = field(default_factory=dict)  # per c: (stop, _segment_start)
    charged_memo: dict = field(default_factory=dict)  # per c: (stop, _charged_inputs' prefixes)
    locals_memo: dict = field(default_factory=dict)  # per (c, mask, keeps): _segment_locals
    mask_memo: dict = field(default_factory=dict)  # per (c, mask): {b: _next_mask}
    blocks_memo: dict = field(default_factory=dict)  # per (c, mask, b): _keep_blocks
    kept_nodes: list = field(default_factory=lambda: [()])

    @cached_property
    def tie(self) -> float:
        """Of plans with equal cost, prefer fewer segments and kept nodes (a segment that
        recomputes nothing still holds its inputs)."""
        return 1e-12 * float(self.problem.seconds.sum())

    @cached_property
    def stops(self) -> np.ndarray:
        """Per position: where the longest segment from there stops (the first node from there
        on that is not checkpointable, else the end)."""
        n = self.problem.size
        stop = np.where(self.problem.checkpointable, n, np.arange(n))
        return np.minimum.accumulate(stop[::-1])[::-1]

    @cached_property
    def prunable(self) -> bool:
        """Whether no block costs less than nothing, so that a ``ceiling`` may drop entries."""
        problem = self.problem
        return bool(
            problem.seconds.min(initial=0.0) >= 0
            and problem.checkpoint_seconds >= 0
            and problem.keep_seconds >= 0
            and not self.peak_mode
        )

    @cached_property
    def segment_tie(self) -> float:
        """Added to each segment's cost: what its checkpoint call costs itself, as ``simulate``
        charges it (``planner.choice.call_seconds``), and the ``tie``."""
        return self.problem.checkpoint_seconds + self.tie

    def run(self, corridors: dict[int, np.ndarray]) -> tuple[float, Choice] | None:
        """(score, choice) of the best plan whose segments are ``[c, b)`` with ``b`` in
        ``corridors[c]``.

        Only the cuts named there are visited: between two neighbours every node is stored, a
        run that ``_stored_run`` turns into one block (its per-node steps are memoised across
        passes), so fronts are merged and thinned only at those cuts.
        """
        problem, n = self.problem, self.problem.size
        named = [np.array([0, n]), np.fromiter(corridors, int), *corridors.values()]
        positions = np.unique(np.concatenate(named)).tolist()
        self.pending: dict[int, dict[int, list]] = {p: {} for p in positions}
        self.states: list[tuple] = []  # (position, charged, value, origin: see _settle)
        self.pending[0][0] = [(np.zeros(1, np.int64), np.zeros(1), -1, STORED, 0)]
        for c, following in zip(positions, positions[1:]):
            if time.perf_counter() > self.deadline:
                raise _OutOfTime
            here = self._settle(c)
            stop, ends = c, np.zeros(0, dtype=np.int64)
            if c in corridors and problem.cut_allowed[c] and problem.checkpointable[c]:
                stop = int(self.stops[c])
                ends = corridors[c][(corridors[c] > c) & (corridors[c] <= stop)]
            width = int(ends[-1]) - c if ends.size else 0  # ends are sorted
            if ends.size:
                recompute, cost = self._segment_costs(c, c + width)
                found = self._segment_locals(c, [mask for mask, _ in here], recompute, width)
            for k, (mask, state) in enumerate(here):
                charged = self.states[state][1]
                self._extend_stored(state, following, *self._stored_run(c, following, mask))
                if not ends.size:
                    continue
                held_b, local_b, monotone, parts = found[k]
                overflow = (charged[0] + monotone[:width] > self.limit).nonzero()[0]
                reach = c + 1 + (int(overflow[0]) if overflow.size else width)
                reachable = ends[ends < reach]
                masks = self._next_masks(c, mask, reachable.tolist())
                i = reachable - c - 1
                self._extend(
                    state,
                    reachable.tolist(),
                    masks,
                    local_b[i],
                    held_b[i],
                    cost[i] + self.segment_tie,
                    SEGMENT,
                )
                if self.keeps:
                    self._extend_with_keeps(
                        state, c, reachable.tolist(), stop, mask, masks, parts, held_b, cost
                    )
        finals = self._settle(n)
        if not finals:
            return None
        state, index = min(
            ((s, int(np.argmin(self.states[s][2]))) for _, s in finals),
            key=lambda si: self.states[si[0]][2][si[1]],
        )
        score = float(self.states[state][2][index])
        segments, keep = [], []
        while state >= 0:
            parent, previous, kind = self._origin(state, index)
            if kind != STORED:
                segments.append((self.states[parent][0], self.states[state][0]))
                keep += self.kept_nodes[kind]
            state, index = parent, previous
        return score, Choice(tuple(reversed(segments)), frozenset(keep))

    def _extend_with_keeps(
        self, state, c: int, ends: list[int], stop: int, mask: int, following, parts, held, cost
    ):
        """Extend the front of ``state`` by each segment ``[c, b)``, ``b`` in ``ends``, under
        each of its keep sets that can fit: a keep set charges its caches to the segment, and
        the storages of kept nodes crossing ``b`` join the mask (their cache holds them until
        the recompute). ``mask``: the state's; ``following``: the segments' masks at ``ends``
        without keeps. One ``_extend`` for all of them (blocks in order of end, then of keep
        set)."""
        found = [
            (b, blocks)
            for b, mask_b in zip(ends, following)
            if (blocks := self._keep_blocks(c, b, stop, mask, mask_b, parts, held, cost))
        ]
        if not found:
            return
        local = np.concatenate([blocks[0] for _, blocks in found])
        rows = np.flatnonzero(int(self.states[state][1][0]) + local <= self.limit)
        if not rows.size:
            return
        listed = rows.tolist()
        targets = [b for b, blocks in found for _ in blocks[4]]
        next_masks = [mask_b for _, blocks in found for mask_b in blocks[3]]
        kinds = [kind for _, blocks in found for kind in blocks[4]]
        self._extend(
            state,
            [targets[r] for r in listed],
            [next_masks[r] for r in listed],
            local[rows],
            np.concatenate([blocks[1] for _, blocks in found])[rows],
            np.concatenate([blocks[2] for _, blocks in found])[rows],
            [kinds[r] for r in listed],
        )

    def _keep_blocks(
        self, c: int, b: int, stop: int, mask: int, mask_b: int, parts, held, cost
    ) -> tuple | None:
        """Per keep set of ``[c, b)`` from a state of mask ``mask`` (``mask_b`` at ``b``
        without keeps): local peak, charged bytes, cost, mask at ``b`` and block kind (None
        when it has no keep set). They depend on the mask, not on the front extended, so they
        are worked out once for all states and passes."""
        key = c, mask, b
        if key not in self.blocks_memo:
            known = self._keep_sets(c, b, stop)
            blocks = None
            if known is not None:
                sets, first_id, joins = known
                i = b - c - 1
                ties = self.segment_tie + self.tie * np.array([len(keeps) for keeps in sets.keeps])
                blocks = (
                    parts.locals(i, sets),
                    held[i] + sets.cache,
                    cost[i] - sets.saved + ties,
                    [mask_b | bits for bits in joins],
                    list(range(first_id, first_id + len(sets.keeps))),
                )
            self.blocks_memo[key] = blocks
        return self.blocks_memo[key]

    def _keep_sets(self, c: int, b: int, stop: int) -> tuple[_KeepSets, int, tuple] | None:
        """The keep sets of ``[c, b)``, computed once: ``_keep_sets`` when the search is exact,
        else ``_keep_family``; with the id of the first in ``kept_nodes`` (the block kinds
        of the search's states, one per set, in order) and, per set, the storages its caches
        hold that cross ``b`` (they join the mask there)."""
        if (c, b) not in self.keep_memo:
            if self.problem.size <= EXACT_KEEP_NODES:
                sets = _keep_sets(self.problem, self.t, c, b)
            else:
                if c not in self.profile_memo:
                    self.profile_memo[c] = (
                        _recompute_bound_profile(self.problem, self.t, c, stop),
                        _ranked(self.t, c, stop),
                    )
                sets = _keep_family(self.problem, self.t, c, b, *self.profile_memo[c])
            if sets is not None:
                t = self.t
                outlive = sets.nodes[t.read_until[sets.nodes] >= b].tolist()
                crossing = {x: [k for k in t.made_at[x] if t.last_use[k] >= b] for x in outlive}
                joins = tuple(
                    _bits(k for x in keeps if x in crossing for k in crossing[x])
                    for keeps in sets.keeps
                )
                self.keep_memo[c, b] = sets, len(self.kept_nodes), joins
                self.kept_nodes.extend(sets.keeps)
            else:
                self.keep_memo[c, b] = None
        return self.keep_memo[c, b]

    def _segment_start(self, c: int, stop: int) -> _Start:
        """``_segment_start`` of the segments from ``c`` to ``stop`` at least, computed once for
        all passes unless a later one needs longer segments: their first entries do not depend
        on how far they reach, and most cuts only start short segments."""
        known = self.start_memo.get(c)
        if known is None or known[0] < stop:
            known = stop, _segment_start(self.problem, self.t, c, stop)
            self.start_memo[c] = known
        return known[1]

    def _charged_inputs(self, c: int, ends: list[int]) -> list[int]:
        """The inputs each segment ``[c, b)``, ``b`` in ``ends``, charges (``_Start.charges``),
        as masks: those whose offset is below ``b - c``, a prefix of the inputs in order of
        offset, so one list of prefixes per cut answers every ``b`` (until a longer segment
        needs a new start: offsets within the shorter one do not change)."""
        known = self.charged_memo.get(c)
        if known is None or known[0] < max(ends):
            start = self._segment_start(c, max(ends))
            order = np.argsort(start.charges, kind="stable")
            prefixes = [0]
            for k in np.asarray(start.inputs, dtype=np.int64)[order].tolist():
                prefixes.append(prefixes[-1] | 1 << k)
            known = self.start_memo[c][0], start.charges[order], prefixes
            self.charged_memo[c] = known
        counts = known[1].searchsorted(np.array(ends) - c).tolist()
        return [known[2][count] for count in counts]

    def _segment_locals(self, c: int, masks: list, recompute, width: int) -> list:
        """``_segment_locals`` of the segments from ``c`` under each of ``masks``, for at
        least ``width`` ends: passes revisit the same states, and each result's first entries
        do not depend on how many were asked, so one worked out for more ends serves fewer."""
        memo = self.locals_memo
        missing = [m for m in masks if memo.get((c, m, self.keeps), (0,))[0] < width]
        if missing:
            start = self._segment_start(c, c + width)
            found = _segment_locals(self.t, c, missing, start, recompute, width, self.keeps)
            for mask, result in zip(missing, found):
                memo[c, mask, self.keeps] = width, result
        return [memo[c, m, self.keeps][1] for m in masks]

    def _next_masks(self, c: int, mask: int, ends: list[int]) -> list:
        """The mask at each of ``ends`` after a segment from ``c`` under ``mask``, each worked
        out once for all passes."""
        memo = self.mask_memo.setdefault((c, mask), {})
        missing = [b for b in ends if b not in memo]
        if missing:
            for b, charged in zip(missing, self._charged_inputs(c, missing)):
                memo[b] = _next_mask(self.t, b, mask, charged)
        return [memo[b] for b in ends]

    def _segment_costs(self, c: int, stop: int):
        """``_segment_costs`` of the segments from ``c`` to ``stop`` at least, computed once
        for all passes unless a later one needs longer segments (see ``_segment_start``)."""
        known = self.segment_memo.get(c)
        if known is None or known[0] < stop:
            known = stop, _segment_costs(self.problem, self.t, c, stop, self.exact)
            self.segment_memo[c] = known
        return known[1]

    def _stored_run(self, c: int, end: int, mask: int) -> tuple[int, int, int]:
        """Local peak, charged bytes and mask at ``end`` of keeping every node of ``[c, end)``.

        The nodes are blocks one after the other: node ``x`` must fit on top of the bytes the
        nodes before it in the run charged, so the run's local peak is the highest of those
        sums. Steps are memoised by (node, mask), since passes revisit the same runs.
        """
        peak, held = None, 0
        for x in range(c, end):
            step = self.step_memo.get((x, mask))
            if step is None:
                charged, local = _stored_local(self.t, x, mask)
                triggered = self.t.triggered_bits[x]
                step = charged, local, _next_mask(self.t, x + 1, mask, triggered)
                self.step_memo[(x, mask)] = step
            charged, local, mask = step
            peak = held + local if peak is None else max(peak, held + local)
            held += charged
        assert peak is not None, "an empty run"  # callers pass end > c
        return peak, held, mask

    def _extend_stored(self, state, end: int, local: int, held: int, mask: int) -> None:
        """``_extend`` by the run of stored nodes to ``end``: one block of no cost."""
        charged, value = self.states[state][1:3]
        count = int(charged.searchsorted(self.limit - local, side="right"))
        first = 0
        if self.peak_mode:
            value = np.maximum(value[:count], charged[:count] + local)
        elif self.ceiling < math.inf:
            first = int((value[:count] > self.ceiling).sum())
        if first < count:
            chunk = (charged[first:count] + held, value[first:count], state, STORED, first)
            self.pending[end].setdefault(mask, []).append(chunk)

    def _extend(self, state, ends, masks, local, held, cost, kinds: int | list[int]) -> None:
        """Extend the front of ``state`` by one block to each of ``ends``, keeping what fits;
        ``kinds``: the blocks' kind, one for all or one per end.

        Charged bytes are sorted, so the entries that fit a block are a prefix of the front:
        only the blocks that some entry fits, and only the longest such prefix, are worked out.
        Costs decrease along the front, so the entries over ``ceiling`` are a prefix too; a
        chunk keeps the index of its first entry in the front.
        """
        charged, value = self.states[state][1:3]
        counts = charged.searchsorted(self.limit - local, side="right")
        rows = counts.nonzero()[0]
        if not rows.size:
            return
        counts = counts[rows]
        longest = int(counts.max())
        charged, value = charged[:longest], value[:longest]
        grown = charged + held[rows, None]
        if self.peak_mode:
            scores = np.maximum(value, charged + local[rows, None])
        else:
            scores = value + cost[rows, None]
        if self.ceiling < math.inf and not self.peak_mode:
            firsts = (scores > self.ceiling).sum(axis=1).tolist()
        else:
            firsts = [0] * rows.size
        pending = self.pending
        kind_of = [kinds] * len(ends) if isinstance(kinds, int) else kinds
        for i, (row, count, first) in enumerate(zip(rows.tolist(), counts.tolist(), firsts)):
            if first < count:
                chunk = (grown[i, first:count], scores[i, first:count], state, kind_of[row], first)
                pending[ends[row]].setdefault(masks[row], []).append(chunk)

    def _settle(self, position: int) -> list[tuple[int, int]]:
        """Turn the blocks that reached ``position`` into Pareto fronts, one state per mask."""
        settled = []
        for mask, chunks in self._masks_kept(position).items():
            fronts, values, parents, kinds, firsts = zip(*chunks)
            if len(chunks) == 1:  # a slice of one front, moved: already in order
                charged, value = fronts[0], values[0]
                keep = _pareto(charged, value, self.bucket, ordered=True)
            else:
                charged, value = np.concatenate(fronts), np.concatenate(values)
                keep = _pareto(charged, value, self.bucket)
            # Where an entry came from is looked up only for the plan found (_origin).
            origin = keep, tuple(map(len, fronts)), parents, kinds, firsts
            self.states.append((position, charged[keep], value[keep], origin))
            settled.append((mask, len(self.states) - 1))
        self.pending[position] = {}
        return settled

    def _origin(self, state: int, index: int) -> tuple[int, int, int]:
        """(parent state, index in its front, block kind) of entry ``index`` of ``state``: the
        chunk it was merged from, found by its position among the chunks' entries."""
        keep, lengths, parents, kinds, firsts = self.states[state][3]
        entry, chunk = int(keep[index]), 0
        while entry >= lengths[chunk]:
            entry -= lengths[chunk]
            chunk += 1
        return parents[chunk], entry + firsts[chunk], kinds[chunk]

    def _masks_kept(self, position: int) -> dict[int, list]:
        """The masks that reached ``position``; above ``MASKS`` of them (``EXACT_MASKS`` on
        problems the search is exact on), the half whose fronts hold the cheapest entry and
        the half whose fronts hold the least charged bytes.

        Storages that stay alive whatever the plan, such as weight casts autocast caches until
        its region exits, cross most cuts, and each way of charging them is a mask of its own:
        thousands per cut on a Llama with autocast inside ``forward``, and on a 25-node model
        whose output stacks every block's (found trying the library: 10 s for its lowest
        peak). Capping them by count keeps the search's time bounded and its plans repeatable.
        """
        pending = self.pending[position]
        most = EXACT_MASKS if self.exact else MASKS
        if len(pending) <= most:
            return pending

        def least(column: int):
            return lambda item: min(float(chunk[column].min()) for chunk in item[1])

        by_value = sorted(pending.items(), key=least(1))[: most // 2]
        by_charged = sorted(pending.items(), key=least(0))[: most // 2]
        return dict(by_value + by_charged)


def _coarse_cuts(problem: Problem, allowed: np.ndarray, spacing: int) -> np.ndarray:
    """One allowed cut per run of ``spacing`` allowed cuts: the one crossed by fewest bytes."""
    chosen = [allowed[0], allowed[-1]]
    for first in range(0, allowed.size, spacing):
        window = allowed[first : first + spacing]
        chosen.append(window[int(np.argmin(problem.cut_bytes[window]))])
    return np.unique(chosen)


def _corridors(
    allowed: np.ndarray, coarse: np.ndarray, plan: Segments, spacing: int
) -> dict[int, np.ndarray]:
    """The segments a refining pass may use: those of the coarse pass, every segment that
    starts near the start of a segment of ``plan`` and ends near its end or the next one's, and,
    once ``spacing <= SHORT``, short segments near every coarse cut.

    "Near" is ``REFINE`` allowed cuts each side, ``spacing`` apart. So a pass moves the plan's
    boundaries, merges neighbouring segments, falls back to coarse ones or adds short segments
    (a few cheap ops whose outputs are large: what the coarse grid cannot express), and its
    number of segments to try grows with the plan and the grid, not with the square of the
    candidates.
    """

    def near(cut: int) -> np.ndarray:
        index = np.searchsorted(allowed, cut) + spacing * np.arange(-REFINE, REFINE + 1)
        return allowed[np.clip(index, 0, allowed.size - 1)]

    ends: dict[int, list[np.ndarray]] = {int(c): [coarse] for c in coarse}
    for cut in coarse.tolist() if spacing <= SHORT else ():
        around = near(cut)
        for c in around.tolist():
            ends.setdefault(c, []).append(around)
    for (start, end), (_, following) in zip(plan, (*plan[1:], plan[-1])):
        targets = np.concatenate([near(end), near(following)])
        for c in near(start).tolist():
            ends.setdefault(c, []).append(targets)
    return {c: np.unique(np.concatenate(arrays)) for c, arrays in ends.items()}


def _search(search: _Search) -> tuple[float, Choice] | None:
    """Best plan over every allowed cut when there are few, else coarse-to-fine.

    With more than ``candidate_cuts`` allowed cuts, a first pass keeps one cut in every
    ``spacing`` (the one crossed by fewest bytes). Each later pass divides the spacing by
    ``REFINE`` and searches the ``_corridors`` around the best plan so far, until neighbouring
    cuts are tried. The best plan so far is always among the segments tried, but a pass can
    still miss it (its fronts are thinned at more cuts), so the answer is the best of all
    passes.
    """
    allowed = np.flatnonzero(search.problem.cut_allowed)
    best = None
    try:
        if allowed.size <= search.candidate_cuts:
            return search.run({int(c): allowed for c in allowed})
        spacing = -(-allowed.size // search.candidate_cuts)
        coarse = _coarse_cuts(search.problem, allowed, spacing)
        best = search.run({int(c): coarse for c in coarse})
        while best is not None and best[1].segments and spacing > 1:
            spacing = max(1, spacing // REFINE)
            search.ceiling = best[0] if search.prunable else math.inf
            found = search.run(_corridors(allowed, coarse, best[1].segments, spacing))
            if found is not None and found[0] <= best[0]:
                best = found
    except _OutOfTime:
        pass  # the best plan of the passes that finished
    return best


def _heuristics(problem: Problem, budget_bytes: int) -> list[Segments]:
    from planner.solvers.greedy import solve as greedy
    from planner.solvers.sqrt_n import solve as sqrt_n

    return [greedy(problem, budget_bytes), sqrt_n(problem, budget_bytes)]


def _searched_plan(
    problem: Problem, budget_bytes: int, candidate_cuts: int, deadline: float, keeps: bool
) -> Segments | Choice:
    """Least recompute found by the block search, with segments alone or (``keeps``) with
    kept nodes too; see ``solve``."""
    if problem.size == 0 or simulate(problem, ()).peak_bytes <= budget_bytes:
        return ()
    t = _tables(problem)
    exact = problem.size <= EXACT_NODES
    limit = budget_bytes - problem.fixed_bytes
    bucket = 1 if exact else max(1, limit // BUCKETS)
    joint = keeps and problem.size <= EXACT_KEEP_NODES  # larger: a pass of their own
    search = _Search(problem, t, limit, False, exact, bucket, candidate_cuts, deadline, joint)
    found = _search(search) if limit > 0 else None
    plans = [_plain(found[1])] if found is not None else []
    results: dict[Segments | Choice, Simulation] = {plan: simulate(problem, plan) for plan in plans}
    if not exact or not any(r.peak_bytes <= budget_bytes for r in results.values()):
        for plan in _heuristics(problem, budget_bytes):
            results[plan] = simulate(problem, plan)
    if not any(r.peak_bytes <= budget_bytes for r in results.values()):
        known = min(results.values(), key=lambda r: r.peak_bytes).peak_bytes
        lowest = known - problem.fixed_bytes
        peak_bucket = 1 if exact else max(1, lowest // BUCKETS)
        lowest_found = _search(
            _Search(problem, t, lowest, True, exact, peak_bucket, candidate_cuts, deadline, joint)
        )
        if lowest_found is not None:
            results[_plain(lowest_found[1])] = simulate(problem, lowest_found[1])
    best = _best(results, budget_bytes)
    fits = results[best].peak_bytes <= budget_bytes
    in_time = time.perf_counter() <= deadline  # with no time_limit, always
    if keeps and not joint and limit > 0 and fits and t.offered.any() and in_time:
        segments = as_choice(best).segments
        # The search's best plan is among those the keep pass tries: nothing dearer can win.
        ceiling = found[0] if found is not None and found[1].segments == segments else math.inf
        # Each keep pass moves and merges segments around its start, so a pass around the last
        # pass's segments can find cheaper plans still (one did on the zoo GPT at per-block's
        # peak); passes stop once one finds nothing cheaper.
        for _ in range(KEEP_ROUNDS):
            before = results[_best(results, budget_bytes)].recompute_seconds
            kept = _keep_pass(search, segments, ceiling)
            if kept is None:
                break
            found_plan = _plain(kept[1])
            results[found_plan] = simulate(problem, found_plan)
            if results[found_plan].recompute_seconds >= before:
                break
            # The plan found is among those the next pass tries: nothing dearer can win.
            segments, ceiling = kept[1].segments, kept[0]
        to_beat = results[_best(results, budget_bytes)].recompute_seconds
        results.update(_prefix_keeps(problem, budget_bytes, segments, to_beat))
        best = _best(results, budget_bytes)
    return best


def _best(results: dict[Segments | Choice, Simulation], budget_bytes: int) -> Segments | Choice:
    """The cheapest plan that fits, else the one of lowest peak (the cheaper of equal ones)."""
    ranked = {
        plan: (
            r.peak_bytes > budget_bytes,
            0 if r.peak_bytes <= budget_bytes else r.peak_bytes,
            r.recompute_seconds,
        )
        for plan, r in results.items()
    }
    return min(ranked, key=ranked.__getitem__)


def _keep_pass(search: _Search, plan: Segments, ceiling: float) -> tuple[float, Choice] | None:
    """The best plan of one more pass that tries keep sets (``_keep_family``) on the segments
    near those of ``plan``: starting within ``REFINE`` allowed cuts of one of its segments'
    starts, ending as near its end or the next one's (``_corridors``), so that boundaries move
    and neighbours merge into longer segments with kept nodes; ``ceiling``: the cost of
    ``plan`` in the search, when known. Empty past the deadline."""
    allowed = np.flatnonzero(search.problem.cut_allowed)
    corridors = _corridors(allowed, np.zeros(0, dtype=np.int64), plan, 1)
    try:
        keeping = replace(search, keeps=True)
        keeping.ceiling = ceiling if keeping.prunable else math.inf
        found = keeping.run(corridors)
    except _OutOfTime:
        return None
    return found


def _plain(plan: Segments | Choice) -> Segments | Choice:
    """A choice that keeps nothing as its segments, as solvers return it."""
    return plan.segments if isinstance(plan, Choice) and not plan.keep else plan


@register("optimal")
def solve(
    problem: Problem,
    budget_bytes: int,
    *,
    candidate_cuts: int = CANDIDATE_CUTS,
    time_limit: float | None = None,
    keep: bool = True,
    **options,
) -> Segments | Choice:
    """Least recompute whose simulated peak fits ``budget_bytes``; else the lowest peak found.

    Parameters
    ----------
    problem
        The graph to plan.
    budget_bytes
        Memory of the whole step, as ``simulate`` counts it (fixed memory included). A budget
        no plan fits (``0`` included) asks for the plan of lowest peak, which
        ``planner.solvers.auto.lowest_peak`` uses to report the minimum.
    candidate_cuts
        Cuts of the first coarse-to-fine pass on graphs with more allowed cuts than this. More
        can find cheaper plans on large graphs, in more time (docs/solvers.md has figures).
    time_limit
        Seconds after which the search stops and keeps the best plan of the passes that
        finished (the ``greedy`` and ``sqrt_n`` plans are always among the candidates).
    keep
        Also choose nodes to keep inside the segments (selective checkpointing), jointly with
        the segments: every keep set of every segment up to ``EXACT_KEEP_NODES`` nodes, a few
        per segment near the best segments-only plan above (``_keep_pass``), and after it
        (``_prefix_keeps``). ``False``: segments alone.

    Returns
    -------
    Segments or Choice
        Checkpointed segments, or a ``Choice`` when nodes inside them are kept; every plan
        returned was replayed by ``simulate``, and one that fits the budget is returned
        whenever the search or a heuristic found one.
    """
    deadline = math.inf if time_limit is None else time.perf_counter() + time_limit
    return _searched_plan(problem, budget_bytes, candidate_cuts, deadline, keep)


# --------------------------------------------------------------------------------------------
# Keeping nodes inside segments (selective checkpointing)


def _keep_value(problem: Problem, replayed_with=None) -> np.ndarray:
    """Recompute seconds a kept node saves per byte it holds, its own and those of the nodes
    it lets a recompute replay (``_Tables.replayed_with``); 0 where keeping is never tried.

    Random nodes (dropout) are left to the recompute: they are cheap, and keeping one is only
    valid after every random node the recompute runs (``validate_choice``).
    """
    if replayed_with is None:
        replayed_with = _tables(problem).replayed_with
    spared = problem.seconds - problem.keep_seconds  # a kept node costs the cache's work
    replaying = problem.seconds - problem.replay_seconds - problem.keep_seconds
    for x, replayed in enumerate(replayed_with):
        if replayed:
            spared[x] += float(replaying[list(replayed)].sum())
    worth = problem.keepable & ~problem.random & (spared > 0)
    return np.where(worth, spared / np.maximum(problem.kept_bytes, 1), 0.0)


def _eligible(problem: Problem, segments: Segments, value: np.ndarray) -> np.ndarray:
    """Positions that may be kept under ``segments``, most valuable first: inside a segment,
    run by its recompute, and worth keeping (``_keep_value``)."""
    positions = [
        x
        for start, stop in segments
        for x in range(start, recompute_stop(problem, start, stop))
        if value[x] > 0
    ]
    order = np.array(positions, dtype=np.int64)
    return order[np.argsort(-value[order], kind="stable")]


def _best_prefix(problem: Problem, budget: int, segments: Segments, order: np.ndarray):
    """(simulation, choice, the eligible nodes left out) keeping the most valuable eligible
    nodes of ``segments`` (``order``: ``_eligible``) that fit: a binary search over how many,
    in ``_keep_value`` order; None when ``segments`` alone does not fit.

    More kept nodes hold more memory and cost less to recompute, so the search looks for the
    longest prefix that fits, among ``PREFIXES + 1`` evenly spaced lengths (every length when
    there are fewer eligible nodes): about log2(PREFIXES) replays per segmentation, whatever
    the graph's size. Peaks are not strictly monotone in the length, so the answer is a prefix
    that fits (every candidate is simulated), not always the longest.
    """
    lengths = np.unique(np.linspace(0, order.size, min(order.size, PREFIXES) + 1).round()).astype(
        int
    )

    def run(count: int):
        choice = Choice(segments, frozenset(order[:count].tolist()))
        return simulate(problem, choice), choice

    best = run(0)
    if best[0].peak_bytes > budget:
        return None
    low, high = 0, lengths.size - 1  # lengths[low] fits; look for a longer one
    while low < high:
        middle = (low + high + 1) // 2
        result = run(int(lengths[middle]))
        if result[0].peak_bytes <= budget:
            low, best = middle, result
        else:
            high = middle - 1
    return (*best, order[int(lengths[low]) :])


def _fill(problem: Problem, budget: int, best, candidates: np.ndarray):
    """``best`` (simulation, choice) with each of the first ``FILL_NODES`` of ``candidates``
    kept too, in order, when the plan still fits: a node that does not fit is skipped, not the
    end of the search (a later, smaller one may fit). One replay per candidate."""
    for x in candidates[:FILL_NODES].tolist():
        choice = Choice(best[1].segments, best[1].keep | {x})
        result = simulate(problem, choice)
        if result.peak_bytes <= budget:
            best = result, choice
    return best


def _block_groups(problem: Problem) -> list[Segments]:
    """Segments between articulation cuts (one per residual block on residual networks), and
    between every second and every fourth of them: the coverings keeps are tried on."""
    from planner.solvers.common import segments_between

    cuts = [c for c in problem.articulation_cuts if problem.cut_allowed[c]]
    return [segments_between(problem, cuts[k - 1 :: k]) for k in GROUPS if k <= max(len(cuts), 1)]


def _prefix_keeps(
    problem: Problem, budget: int, segments: Segments, to_beat: float
) -> dict[Segments | Choice, Simulation]:
    """Keeps chosen after the segments, as ``optimal`` did before ``_keep_pass``, where they can
    still win: of a few segmentations (``segments`` and ``_block_groups``), each gets the
    longest fitting prefix of its eligible nodes by ``_keep_value`` (``_best_prefix``), then
    each of its next ``FILL_NODES`` eligible nodes that still fits (``_fill``). Bounded by
    counts: at most about 25 replays per segmentation.

    ``to_beat``: the recompute seconds of the best fitting plan found before. A plan costing as
    much or more cannot win (it would rank after it), so a segmentation, or a fill, that could
    not go below it even keeping all its eligible nodes (``_least_seconds``) is not replayed."""
    if simulate(problem, segments).peak_bytes > budget:
        return {}
    value = _keep_value(problem)
    plans: dict[Segments | Choice, Simulation] = {}
    for candidate in dict.fromkeys([segments, *_block_groups(problem)]):
        order = _eligible(problem, candidate, value)
        if _least_seconds(problem, Choice(candidate), order) >= to_beat:
            continue
        found = _best_prefix(problem, budget, candidate, order)
        if found is None:
            continue
        result, choice, rest = found
        if _least_seconds(problem, choice, rest[:FILL_NODES]) >= to_beat:
            continue
        result, choice = _fill(problem, budget, (result, choice), rest)
        if choice.keep:
            plans[choice] = result
            to_beat = min(to_beat, result.recompute_seconds)
    return plans


def _least_seconds(problem: Problem, choice: Choice, more: np.ndarray) -> float:
    """A lower bound on the recompute seconds of ``choice`` with any of the nodes ``more`` kept
    too, each run by its segment's recompute and worth keeping (``_keep_value``: it spares more
    seconds than keeping it costs), so that keeping all of them costs least."""
    kept = Choice(choice.segments, choice.keep | set(more.tolist()))
    return least_recompute_seconds(problem, kept)
