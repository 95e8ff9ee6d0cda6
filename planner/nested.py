"""Nested checkpointing: checkpointed segments that hold checkpointed segments of their own.

A flat plan (``planner.simulate.Choice``) must hold every tensor crossing its segments'
boundaries plus the largest segment's recompute. Nesting lowers that floor: a segment's
recompute may itself keep only the inputs of its inner segments, which are recomputed again,
one at a time, when backward reaches them (Chen et al. 2016, section 4.3; Revolve; Rotor).

``NestedChoice`` describes such a plan as a tree of ``Nest`` segments. A plan without inner
segments is a flat plan and simulates through ``planner.simulate``'s vectorised replay;
``simulate_nested`` replays the others step by step, following what non-reentrant
``torch.utils.checkpoint`` does when checkpoints nest (read from torch 2.13's
``torch/utils/checkpoint.py`` and checked against measured peaks in ``tests/test_nested.py``):

* forward: a segment's inner checkpoints save their inputs through the *outer* segment's
  saved-tensor hooks, so the forward holds only the top-level segments' inputs. A checkpoint
  holds its inputs for as long as anything saved through it lives: until the backward of the
  first node inside it (at any depth) that saves; a segment where no node saves holds nothing;
* a checkpoint call, at any depth and in any run (the forward or a recompute), holds its
  arguments until it returns: the calling body's variable and ``checkpoint``'s own arguments
  keep them, whatever the callee saves (measured on the U-Net: a recompute running three
  nested levels held 1 MiB more than a rule that freed them after their last reader);
* the recompute of a segment runs its own nodes and its inner segments (whose nodes save
  nothing: they run under the inner segments' hooks), and stops early after the last thing it
  saves: a node of its own level that saves (which runs only when it saves something it
  creates, as in ``planner.simulate.recompute_stop``, and then re-creates only what it made
  before that save), or an inner segment's inputs (an inner segment starting there does not
  run at all);
* what a recompute re-creates lives until the backward of the first node of its level that
  saves it; an inner segment's input lives until that inner segment's own recompute ends, or
  longer when nodes of the inner level (or deeper segments) save it in turn; what a node the
  recompute does not reach reads (past the early stop, or outside the segment) lives until
  the recompute stops (the segment body's variable holds it);
* the first unpack recomputes: before the backward of a segment's last node that saves (at
  any depth), the segments whose last saver it is recompute, outermost first (an inner
  segment's inputs come from its parent's recompute); each segment recomputes once, and one
  where nothing saves never does;
* buffer copies (``planner.rewrite.Segment``): every run of a segment's body copies the buffers
  it may update, and its recompute copies them once more; the checkpoint frame of the call
  holds the first copy, see ``_Replay._buffer_copies``;
* the random state: each checkpoint restores the state of its own start, so inner recomputes
  draw what the forward drew, at any depth (tests check it bit for bit);
* what a custom autograd function keeps on its context (``Storage.held_by_context``) lives as
  long as the graph: the forward's copy to the end of backward, at any depth, a recompute's
  copy to the end of that recompute (``planner.simulate`` likewise).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from planner.choice import Choice, Simulation, validate_segments
from planner.problem import NEVER, Problem


@dataclass(frozen=True)
class Nest:
    """A checkpointed segment ``[start, stop)`` and the checkpointed segments inside it."""

    start: int
    stop: int
    inner: tuple[Nest, ...] = ()
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.start, self.stop, self.inner)))

    def __hash__(self) -> int:  # computed once: the replay looks segments up by the thousand
        return self._hash

    def walk(self) -> Iterable[Nest]:
        """This segment, then every segment inside it, parents before children."""
        yield self
        for child in self.inner:
            yield from child.walk()

    @property
    def depth(self) -> int:
        return 1 + max((child.depth for child in self.inner), default=0)


@dataclass(frozen=True)
class NestedChoice:
    """A plan of checkpointed segments that may nest: the top-level segments, in order."""

    segments: tuple[Nest, ...]

    def walk(self) -> Iterable[Nest]:
        for segment in self.segments:
            yield from segment.walk()

    @property
    def depth(self) -> int:
        return max((s.depth for s in self.segments), default=0)

    def flat(self) -> Choice | None:
        """The same plan as a flat ``Choice`` when nothing nests, else None."""
        if any(s.inner for s in self.segments):
            return None
        return Choice(tuple((s.start, s.stop) for s in self.segments))


def nested_choice(spec) -> NestedChoice:
    """A ``NestedChoice`` from plain tuples: ``(start, stop)`` or ``(start, stop, inner)``
    items, ``inner`` a list of the same form.

    Examples
    --------
    >>> nested_choice([(0, 8, [(0, 4), (4, 8)])]).depth
    2
    """
    if isinstance(spec, NestedChoice):
        return spec

    def nest(item) -> Nest:
        if isinstance(item, Nest):
            return item
        start, stop, *rest = item
        inner = tuple(nest(child) for child in (rest[0] if rest else ()))
        return Nest(int(start), int(stop), inner)

    return NestedChoice(tuple(nest(item) for item in spec))


def validate_nested(problem: Problem, choice) -> NestedChoice:
    """A valid ``NestedChoice`` (children sorted), or a ValueError naming the bad segment.

    Every segment must be a valid segment of the graph (``Problem.is_valid_segment``); the
    segments at one level are disjoint; an inner segment lies inside its parent and is smaller.
    """
    choice = nested_choice(choice)
    # Checked per level in plain Python (``validate_segments`` works out the same from whole
    # arrays each call, too slow for the hundreds of levels of a deep plan); it names what is
    # wrong when this finds something.
    n, allowed = problem.size, problem.cut_allowed.tolist()
    barred = np.concatenate(([0], np.cumsum(~problem.checkpointable))).tolist()

    def valid(ordered: list[Nest]) -> bool:
        previous = 0
        for s in ordered:
            if not (
                previous <= s.start < s.stop <= n
                and allowed[s.start]
                and allowed[s.stop]
                and barred[s.start] == barred[s.stop]
            ):
                return False
            previous = s.stop
        return True

    def check(nests: tuple[Nest, ...], parent: Nest | None) -> tuple[Nest, ...]:
        ordered = sorted(nests, key=lambda s: (s.start, s.stop))
        if not valid(ordered):
            validate_segments(problem, [(s.start, s.stop) for s in ordered])
        for s in ordered:
            if parent is not None and not (
                parent.start <= s.start < s.stop <= parent.stop
                and (s.start, s.stop) != (parent.start, parent.stop)
            ):
                raise ValueError(
                    f"inner segment ({s.start}, {s.stop}) does not lie strictly inside its parent "
                    f"({parent.start}, {parent.stop}): an inner segment must be smaller than, "
                    "and contained in, the segment holding it"
                )
        checked = [(s, check(s.inner, s)) for s in ordered]
        if all(a is b for a, b in zip(ordered, nests)) and all(s.inner is c for s, c in checked):
            return nests  # already in order: the same objects (hashes and lookups stay cheap)
        return tuple(Nest(s.start, s.stop, inner) for s, inner in checked)

    return NestedChoice(check(choice.segments, None))


def _last_in(positions: list[int], start: int, stop: int) -> int | None:
    """The last of sorted ``positions`` in ``[start, stop)``, or None."""
    index = bisect.bisect_left(positions, stop) - 1
    return positions[index] if index >= 0 and positions[index] >= start else None


def recompute_end(segment: Nest, saving: list[int]) -> int:
    """The last position the recompute of ``segment`` reaches (early stop), or start - 1;
    ``saving``: the sorted positions of the nodes that save something.

    That is the last node of the segment's own level that saves something, or the start of an
    inner segment (which saves its inputs there), whichever comes later.
    """
    end = max((child.start for child in segment.inner), default=segment.start - 1)
    stop = segment.stop
    for child in reversed(segment.inner):  # the stretches of its own level, last first
        last = _last_in(saving, child.stop, stop)
        if last is not None:
            return max(end, last)
        stop = child.start
    last = _last_in(saving, segment.start, stop)
    return end if last is None else max(end, last)


class _Replay:
    """The step-by-step replay of one nested plan (see the module docstring).

    A level is the forward (depth 0, ``segment`` None) or the recompute of a segment (depth 1
    for a top-level one, and so on). Position ``p`` lies in ``levels[p]`` segments, one per
    depth: ``owner[d][p]`` is the one of depth ``d + 1`` (segments of one depth are disjoint),
    so the segment of a level's children holding ``p`` is ``owner[depth][p]`` when
    ``owner[depth - 1][p]`` is the level's segment: no maps to build or look up.
    """

    def __init__(self, problem: Problem, choice: NestedChoice):
        self.problem = problem
        self.top = choice.segments
        self.nests = list(choice.walk())  # parents first
        self.levels = [0] * problem.size
        self.owner: list[list[Nest | None]] = []
        self.depth: dict[Nest, int] = {}  # the depth of a segment's recompute
        self.depth.update((segment, 1) for segment in self.top)
        for segment in self.nests:  # parents first: children overwrite their levels
            depth = self.depth[segment]
            self.depth.update((child, depth + 1) for child in segment.inner)
            if len(self.owner) < depth:
                self.owner.append([None] * problem.size)
            width = segment.stop - segment.start
            self.owner[depth - 1][segment.start : segment.stop] = [segment] * width
            self.levels[segment.start : segment.stop] = [depth] * width
        self.phases: list[str] = []
        self.positions: list[int] = []
        self.backward_step: list[int] = []  # per position
        self.triggered: list[tuple[int, int]] = []  # (first recompute step, the backward's node)
        # Each recompute: its first step, and the end of the positions it runs (``_run_stop``).
        self.runs: dict[Nest, tuple[int, int]] = {}
        self.run_end: dict[Nest, int] = {}  # the last step of each recompute
        saving = np.flatnonzero(problem.saves).tolist()
        self.end: dict[Nest, int] = {s: recompute_end(s, saving) for s in self.nests}
        # A checkpoint's frame lives while anything saved through it does: from the first to
        # the last node that saves inside it (at any depth); None when nothing does.
        self.saving: dict[Nest, tuple[int, int] | None] = {}
        for segment in self.nests:
            first = bisect.bisect_left(saving, segment.start)
            last = bisect.bisect_left(saving, segment.stop) - 1
            self.saving[segment] = (saving[first], saving[last]) if first <= last else None
        self.count: dict[Nest, int] = {}  # segments in each one's tree, itself included
        for segment in reversed(self.nests):  # children first
            self.count[segment] = 1 + sum(self.count[child] for child in segment.inner)
        self._schedule()

    # -- the order of steps --------------------------------------------------------------------
    def _run_stop(self, segment: Nest) -> int:
        """The recompute of ``segment`` runs positions ``[segment.start, this)`` in order, its
        inner segments whole: up to its early stop, short of an inner segment whose inputs
        are the last thing saved (which does not run). The early stop never falls strictly
        inside an inner segment (``recompute_end``), so no inner segment is cut."""
        end = self.end[segment]
        return end if any(child.start == end for child in segment.inner) else end + 1

    def _schedule(self) -> None:
        n = self.problem.size
        self.phases += ["forward"] * n
        self.positions += range(n)
        self.backward_step = [0] * n
        unpacking: dict[int, list[Nest]] = {}
        for segment in self.nests:  # parents first
            saving = self.saving[segment]
            if saving is not None:  # the first unpack recomputes: the last saver's backward
                unpacking.setdefault(saving[1], []).append(segment)
        for p in range(n - 1, -1, -1):
            if p in unpacking:  # p's backward recomputes from this step up to its own
                self.triggered.append((len(self.positions), p))
            for segment in unpacking.get(p, ()):
                stop = self._run_stop(segment)
                self.runs[segment] = (len(self.positions), stop)
                self.phases += ["recompute"] * (stop - segment.start)
                self.positions += range(segment.start, stop)
                self.run_end[segment] = len(self.positions) - 1
            self.backward_step[p] = len(self.positions)
            self.phases.append("backward")
            self.positions.append(p)

    # -- what holds each copy of a storage -----------------------------------------------------
    def _holds(self, segment: Nest, storage) -> list[int]:
        """Steps until which the recompute of ``segment``, which does not hold the producer of
        ``storage``, holds it: its own nodes that save it, and its children that take it."""
        depth, steps, users = self.depth[segment], [], set()
        for j in (*storage.readers, *storage.savers):
            if self.levels[j] < depth or self.owner[depth - 1][j] is not segment:
                continue  # outside the segment
            if self.levels[j] > depth:
                users.add(self.owner[depth][j])
            elif j in storage.savers and not storage.held_by_context:
                steps.append(self.backward_step[j])
        steps.extend(self._input_hold(child, storage) for child in users if self.saving[child])
        return steps

    def _input_hold(self, segment: Nest, storage) -> int:
        """The last step an input of ``segment``'s recompute stays alive through its level."""
        return max([self.run_end[segment], *self._holds(segment, storage)])

    def _crossings(self, storage) -> tuple[dict[int, int], list[tuple[int, Nest]]]:
        """What holds ``storage`` in each level holding its producer, by the level's depth (0:
        the forward, else the recompute of ``owner[depth - 1][producer]``), worked out once
        for every run of that level: the last step until which the level holds it, where
        something does (its own nodes that save it, a child segment that takes it as an
        input: a top-level one while its frame lives, an inner one as ``_input_hold`` says);
        and the checkpoint calls taking it, read by ``_release``.

        A reader or saver ``j`` leaves the producer's segments at some depth ``k``: it is a
        node of level ``k`` itself, or inside its child ``owner[k][j]``, which does not hold
        the producer (deeper levels on the producer's side do not hold ``j``).
        """
        owner, levels, p = self.owner, self.levels, storage.producer
        holds: dict[int, int] = {}
        entered: list[tuple[int, Nest]] = []  # (k, owner[k][j]) per reader j, see above
        users: set[tuple[int, Nest]] = set()
        if storage.held_by_context and storage.savers:  # the graph holds it: the forward's to
            holds[0] = self.backward_step[0]  # the end of backward, a recompute's to its end
        savers = set(storage.savers)
        for index, j in enumerate((*storage.readers, *storage.savers)):
            k = min(levels[j], levels[p])
            while k and owner[k - 1][j] is not owner[k - 1][p]:
                k -= 1
            if k < levels[j]:
                child = owner[k][j]
                users.add((k, child))
                if index < len(storage.readers):
                    entered.append((k, child))
            elif j in savers and not storage.held_by_context:
                holds[k] = max(holds.get(k, -1), self.backward_step[j])
        for k, child in users:
            saving = self.saving[child]
            if saving is None:  # a checkpoint that saves nothing holds nothing
                continue
            if k == 0:  # a top-level segment holds its inputs while its frame lives
                step = self.backward_step[saving[0]]
            else:
                step = self._input_hold(child, storage)
            holds[k] = max(holds.get(k, -1), step)
        return holds, entered

    def _release(
        self, segment, storage, crossings, created_at: int, first: int, stop: int, last
    ) -> int:
        """The step after which the copy of ``storage`` made at ``created_at`` in the level of
        ``segment`` (None: the forward) is freed; that level runs positions ``[start, stop)``
        from step ``first``, in order."""
        depth, start = (0, 0) if segment is None else (self.depth[segment], segment.start)
        holds, entered = crossings
        if depth in holds:
            return holds[depth]
        reached = [j for j in storage.readers if start <= j < stop]
        # The checkpoint calls taking it as an argument, among the segments of any depth that
        # run whole here: the calling body's variable and ``checkpoint``'s own arguments hold
        # it until the call returns, whatever the callee saves (not run when the recompute
        # stops at it).
        read = reached + [
            child.stop - 1 for k, child in entered if k >= depth and child.stop <= stop
        ]
        reads = [first + max(read) - start] if read else []
        if storage.is_output and segment is None:
            reads.append(last)
        if segment is not None and (
            len(reached) < len(storage.readers) or storage.is_output or storage.held_by_context
        ):
            # Read by a node the recompute never reaches (past its early stop, or outside the
            # segment), or returned by the model: the segment body's variable lives until the
            # recompute stops; a copy kept on an autograd context goes with the recompute's
            # graph, then too.
            reads.append(self.run_end[segment])
        return max(reads, default=created_at)

    def _gone(self, storage, node: int, handed: bool, graph: bool) -> int:
        """The phase of ``node``'s backward from which the copy of ``storage`` its step frees
        is gone: one handed to its functions (``handed``: a recomputed copy, or the graph's
        own where ``node`` runs outside checkpoints) goes as they return (a recomputed one)
        or as autograd releases them (the graph's: ``Storage.saver_ends``); otherwise a
        checkpoint's frame holds it, until the last of ``node``'s functions is released."""
        if handed and node in storage.savers:
            if not storage.saver_ends:
                return NEVER
            returned, released = storage.saver_ends[storage.savers.index(node)]
            return released if graph else returned
        return int(self.problem.backward_phases.released[node])

    def _buffer_copies(self, alloc: np.ndarray, free: np.ndarray) -> None:
        """The copies of buffers each run of a segment's body makes (``planner.rewrite.Segment``):
        one when the body starts, held by that call's checkpoint frame (its recompute context)
        while something saved through it lives, and one more during each recompute.

        A frame made in the forward, at any depth, lives until its recompute ends; one made
        inside a parent's recompute lives only as long as the graph that recompute builds,
        which goes when the recompute ends; one where nothing saves goes when its body returns.
        """
        problem = self.problem
        copying = [p for p, node in enumerate(problem.buffer_copies) if node]
        copies = {  # most segments copy nothing: only those holding a copying node are asked
            s: problem.buffer_copy_bytes(s.start, s.stop)
            if _last_in(copying, s.start, s.stop) is not None
            else 0
            for s in self.nests
        }
        if not any(copies.values()):
            return

        def body(segment: Nest, started: int, held_to: int) -> None:
            if copies[segment]:
                alloc[started] += copies[segment]
                free[held_to] += copies[segment]

        for segment in self.nests:
            saves = self.saving[segment] is not None
            body(segment, segment.start, self.run_end[segment] if saves else segment.stop - 1)
        for segment, (first, stop) in self.runs.items():
            if stop == segment.start:
                continue
            if copies[segment]:
                alloc[first] += copies[segment]
                free[self.run_end[segment]] += copies[segment]
            at = first - segment.start  # position + at: its step in this recompute
            for child in segment.inner:
                if child.start >= stop:
                    continue  # the recompute stops at its inputs: it does not run
                for inner in child.walk():
                    returned = at + inner.stop - 1
                    saves = self.saving[inner] is not None
                    body(inner, at + inner.start, self.run_end[segment] if saves else returned)

    # -- the replay ----------------------------------------------------------------------------
    def run(self, record: bool) -> Simulation:
        problem, steps = self.problem, len(self.phases)
        n = problem.size
        alloc = np.zeros(steps, dtype=np.int64)
        free = np.zeros(steps, dtype=np.int64)
        transient = np.zeros(steps, dtype=np.int64)
        by_producer: dict[int, list] = {}
        for s in problem.storages:  # each with the checkpoint calls taking it (``_release``)
            by_producer.setdefault(s.producer, []).append((s, self._crossings(s)))

        # Bytes made and freed, by step: gathered, then added up at once.
        made_at: list[int] = []
        made: list[int] = []
        freed_at: list[int] = []
        freed: list[int] = []
        outputs_read_by_loss = 0  # graph outputs freed once the loss has read them
        # What backward steps free, by node and the phase of its backward from which it is
        # gone (``BackwardPhases.credit``); what a context holds goes with the graph, when
        # backward ends.
        gone_node: list[int] = []
        gone_phase: list[int] = []
        gone_bytes: list[int] = []
        transient[:n] = problem.workspace
        alloc[:n] = problem.created_bytes
        for p in range(n):
            for s, crossings in by_producer.get(p, ()):
                released = self._release(None, s, crossings, p, 0, n, n - 1)
                freed_at.append(released)
                freed.append(s.nbytes)
                if s.is_output and released == n - 1:
                    outputs_read_by_loss += s.nbytes
                if self.phases[released] == "backward" and not s.held_by_context:
                    q = self.positions[released]
                    gone_node.append(q)
                    gone_phase.append(self._gone(s, q, self.levels[q] == 0, graph=True))
                    gone_bytes.append(s.nbytes)
        saves_own = problem.saves_own.tolist()
        node_seconds, node_flops = problem.seconds.tolist(), problem.flops.tolist()
        seconds = flops = 0.0
        ran_at: list[int] = []  # the steps where a node runs in a recompute, and the node
        ran: list[int] = []
        stopped_at: list[int] = []  # those where the recompute stops inside it
        stopped: list[int] = []
        for segment, (first, stop) in self.runs.items():
            end = self.end[segment]
            for q in range(segment.start, stop):
                step = first + q - segment.start
                if q == end and not saves_own[q]:
                    continue  # it saved its inputs and the recompute stopped: it never ran
                ran_at.append(step)
                ran.append(q)
                if q == end:  # stopped inside it: its temporaries as at its last save
                    stopped_at.append(step)
                    stopped.append(q)
                seconds += node_seconds[q]
                flops += node_flops[q]
                for s, crossings in by_producer.get(q, ()):
                    if q == end and not s.before_last_save:
                        continue  # made after the last save: the recompute stopped first
                    made_at.append(step)
                    made.append(s.nbytes)
                    freed_at.append(self._release(segment, s, crossings, step, first, stop, -1))
                    freed.append(s.nbytes)
                    if self.phases[freed_at[-1]] == "backward":
                        # Only a checkpoint's frame held it, and handed it to the backward
                        # functions that unpacked it (at any depth of the frames): it goes as
                        # they return.
                        q = self.positions[freed_at[-1]]
                        gone_node.append(q)
                        gone_phase.append(self._gone(s, q, True, graph=False))
                        gone_bytes.append(s.nbytes)
        transient[ran_at] = problem.workspace[ran]
        transient[stopped_at] = problem.stop_workspace[stopped]
        np.add.at(alloc, made_at, np.array(made, dtype=np.int64))
        np.add.at(free, freed_at, np.array(freed, dtype=np.int64))
        self._buffer_copies(alloc, free)
        # What a triggering backward has allocated when it unpacks is held through the
        # recomputes it triggers (``Problem.grad_before_unpack``).
        for first, p in self.triggered:
            last = self.backward_step[p] - 1
            if last >= first:
                alloc[first] += problem.grad_before_unpack[p]
                free[last] += problem.grad_before_unpack[p]
        # A checkpoint call costs Problem.checkpoint_seconds each time it runs: every segment
        # in the forward, and an inner one again inside its parent's recompute.
        calls = len(self.nests) + sum(
            self.count[child]
            for segment in self.runs
            for child in segment.inner
            if child.start < self.runs[segment][1]
        )
        call_seconds = problem.checkpoint_seconds * calls
        backward = np.array(self.backward_step, dtype=np.int64)
        alloc[backward] = alloc[backward] + problem.activation_grad_alloc + problem.grad_bytes_at
        free[backward] = free[backward] + problem.activation_grad_free

        first_backward = self.backward_step[n - 1] if n else n
        if first_backward > n:  # recomputes run before it: they hold the loss and the seed
            alloc[n] += problem.loss_bytes
            free[first_backward - 1] += problem.loss_bytes
        after = np.cumsum(alloc - free)
        live = after + free + transient
        # A backward step's high point may come after some of what it frees is gone.
        live[backward] -= problem.backward_phases.credit(
            np.array(gone_node, np.int64),
            np.array(gone_phase, np.int64),
            np.array(gone_bytes, np.int64),
        )
        step_bytes = int(after[-1]) if steps else 0
        step_bytes += problem.optimizer_step_bytes
        peak = max(int(live.max(initial=0)), step_bytes)
        if n:  # the default loss, summing the outputs after the last node has run
            loss_high = int(after[n - 1]) + outputs_read_by_loss + problem.default_loss_high
            peak = max(peak, loss_high)
        timeline = None
        if record:
            timeline = tuple(zip(self.phases, self.positions, live.tolist()))
        return Simulation(
            peak_bytes=int(problem.fixed_bytes + peak),
            recompute_seconds=seconds + call_seconds,
            recompute_flops=flops,
            optimizer_step_bytes=int(problem.fixed_bytes + step_bytes),
            timeline=timeline,
            call_seconds=call_seconds,
        )


def simulate_nested(problem: Problem, choice, *, record: bool = False) -> Simulation:
    """Replay one training step under a nested plan (see the module docstring)."""
    return _Replay(problem, validate_nested(problem, choice)).run(record)


def physical_floor(problem: Problem) -> int:
    """The least memory any plan of ``problem`` must hold at once, recompute of any kind
    included: the bar against which a plan's lowest peak is judged (at best 1x).

    Every plan holds the fixed memory (parameters, buffers, inputs, optimizer state) all along,
    and at some moment one of:

    * the forward of a node (in the forward or in a recompute): the storages it reads, those it
      creates and its workspace, plus the graph outputs made before it (they live until the loss
      reads them, and checkpointing never drops what a segment returns);
    * the backward of a node: the storages it saves (recomputed or kept, they are there when it
      runs) and what its backward allocates while they are, or what it allocates at its high
      point after they went (``Problem.grad_after_saved``), and the gradients
      made by the backward of later nodes and not yet freed (parameter gradients accumulated
      by then, the gradients of the outputs and of every pending activation): the same in
      every plan, since recompute changes which activations live, not the gradients;
    * the optimizer step: the gradients backward leaves, plus the step's temporaries.

    The largest of these is the floor: no plan's simulated peak is lower (checked on every
    nested plan of small graphs in ``tests/test_nested.py``).
    """
    n, a = problem.size, problem.storage_arrays
    if n == 0:
        return int(problem.fixed_bytes + problem.optimizer_step_bytes)
    reads = np.zeros(n, dtype=np.int64)  # graph outputs among them counted once, below
    output_read = a.is_output[a.read_storage]
    np.add.at(reads, a.read_node[~output_read], a.nbytes[a.read_storage[~output_read]])
    outputs = np.zeros(n + 1, dtype=np.int64)
    np.add.at(outputs, a.producer[a.is_output] + 1, a.nbytes[a.is_output])
    outputs_before = np.cumsum(outputs)[:n]
    forward = reads + problem.created_bytes + problem.workspace + outputs_before

    saved = np.zeros(n, dtype=np.int64)
    np.add.at(saved, a.save_node, a.nbytes[a.save_storage])
    allocated = problem.activation_grad_alloc + problem.grad_bytes_at
    net = allocated - problem.activation_grad_free
    pending = np.concatenate((np.cumsum(net[::-1])[::-1][1:], [0]))  # made after node i's
    # The saved tensors may be gone by the part of the high point after their release.
    backward = pending + np.maximum(saved + allocated - problem.grad_after_saved, allocated)
    step = int(net.sum()) + problem.optimizer_step_bytes
    return int(problem.fixed_bytes + max(int(forward.max()), int(backward.max()), step))
