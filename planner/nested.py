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

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from planner.choice import Choice, Simulation, validate_segments
from planner.problem import Problem


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

    def check(nests: tuple[Nest, ...], parent: Nest | None) -> tuple[Nest, ...]:
        ordered = sorted(nests, key=lambda s: (s.start, s.stop))
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
        return tuple(Nest(s.start, s.stop, check(s.inner, s)) for s in ordered)

    return NestedChoice(check(choice.segments, None))


def recompute_end(problem: Problem, segment: Nest) -> int:
    """The last position the recompute of ``segment`` reaches (early stop), or start - 1.

    That is the last node of the segment's own level that saves something, or the start of an
    inner segment (which saves its inputs there), whichever comes later.
    """
    end = segment.start - 1
    inside = np.zeros(segment.stop - segment.start, dtype=bool)
    for child in segment.inner:
        inside[child.start - segment.start : child.stop - segment.start] = True
        end = max(end, child.start)
    own = np.flatnonzero(problem.saves[segment.start : segment.stop] & ~inside)
    if own.size:
        end = max(end, segment.start + int(own[-1]))
    return end


class _Replay:
    """The step-by-step replay of one nested plan (see the module docstring)."""

    def __init__(self, problem: Problem, choice: NestedChoice):
        self.problem = problem
        self.top = choice.segments
        self.phases: list[str] = []
        self.positions: list[int] = []
        self.backward_step: dict[int, int] = {}
        self.runs: dict[Nest, list[tuple[int, int]]] = {}  # (position, step) of each recompute
        self.run_end: dict[Nest, int] = {}  # the last step of each recompute
        self.end: dict[Nest, int] = {s: recompute_end(problem, s) for s in choice.walk()}
        self._maps: dict[tuple[Nest, ...], dict[int, Nest]] = {}
        # A checkpoint's frame lives while anything saved through it does: from the first to
        # the last node that saves inside it (at any depth); None when nothing does.
        self.saving: dict[Nest, tuple[int, int] | None] = {}
        for segment in choice.walk():
            saving = np.flatnonzero(problem.saves[segment.start : segment.stop])
            self.saving[segment] = (
                (segment.start + int(saving[0]), segment.start + int(saving[-1]))
                if saving.size
                else None
            )
        self._schedule()

    # -- the order of steps --------------------------------------------------------------------
    def _add(self, phase: str, position: int) -> int:
        self.phases.append(phase)
        self.positions.append(position)
        return len(self.phases) - 1

    def _executed(self, segment: Nest) -> list[int]:
        """Positions the recompute of ``segment`` runs, in order (inner segments whole)."""
        end = self.end[segment]
        children = {child.start: child for child in segment.inner}
        result, q = [], segment.start
        while q <= end:
            child = children.get(q)
            if child is None:
                result.append(q)
                q += 1
            elif child.start == end:
                break  # its inputs are the last thing saved: it does not run
            else:
                result.extend(range(child.start, child.stop))
                q = child.stop
        return result

    def _schedule(self) -> None:
        n = self.problem.size
        for p in range(n):
            self._add("forward", p)
        unpacking: dict[int, list[Nest]] = {}
        for segment in (s for top in self.top for s in top.walk()):  # parents first
            saving = self.saving[segment]
            if saving is not None:  # the first unpack recomputes: the last saver's backward
                unpacking.setdefault(saving[1], []).append(segment)
        for p in range(n - 1, -1, -1):
            for segment in unpacking.get(p, ()):
                self.runs[segment] = [
                    (q, self._add("recompute", q)) for q in self._executed(segment)
                ]
                self.run_end[segment] = len(self.phases) - 1
            self.backward_step[p] = self._add("backward", p)

    # -- what holds each copy of a storage -----------------------------------------------------
    def _inside(self, children: tuple[Nest, ...]) -> dict[int, Nest]:
        """Position -> the segment among ``children`` that holds it."""
        inside = self._maps.get(children)
        if inside is None:
            inside = {p: child for child in children for p in range(child.start, child.stop)}
            self._maps[children] = inside
        return inside

    def _holds(self, segment: Nest | None, storage, home: Nest | None, children) -> list[int]:
        """Steps until which the level of ``segment`` (None: the forward) holds ``storage``."""
        steps = []
        span = (0, self.problem.size) if segment is None else (segment.start, segment.stop)
        inside = self._inside(children)
        for j in storage.savers:
            if storage.held_by_context:  # the graph holds it: the forward's, to the end of
                if segment is None:  # backward; a recompute's, to the recompute's end
                    steps.append(self.backward_step[0])
            elif span[0] <= j < span[1] and j not in inside:
                steps.append(self.backward_step[j])
        users = {inside[j] for j in (*storage.readers, *storage.savers) if j in inside}
        for child in users:
            saving = self.saving[child]
            if child is home or saving is None:  # a checkpoint that saves nothing holds nothing
                continue
            if segment is None:  # a top-level segment holds its inputs while its frame lives
                steps.append(self.backward_step[saving[0]])
            else:
                steps.append(self._input_hold(child, storage))
        return steps

    def _input_hold(self, segment: Nest, storage) -> int:
        """The last step an input of ``segment``'s recompute stays alive through its level."""
        return max([self.run_end[segment], *self._holds(segment, storage, None, segment.inner)])

    def _call_returns(self, children, storage, executed: dict[int, int]) -> list[int]:
        """Steps where the checkpoint calls that take ``storage`` as an argument return, in a
        run of the body holding ``children``: the calling body's variable and ``checkpoint``'s
        own arguments hold it until then, whatever the callee saves. The outermost such call,
        among the segments of any depth that run whole here, returns last."""
        steps = []
        for j in storage.readers:
            nests = children
            while (child := self._inside(nests).get(j)) is not None:
                if not child.start <= storage.producer < child.stop:
                    if child.stop - 1 in executed:  # not run when the recompute stops at it
                        steps.append(executed[child.stop - 1])
                    break
                nests = child.inner
        return steps

    def _release(self, segment, storage, created_at: int, executed: dict[int, int], last) -> int:
        children = self.top if segment is None else segment.inner
        home = self._inside(children).get(storage.producer)
        holds = self._holds(segment, storage, home, children)
        if holds:
            return max(holds)
        reads = [executed[j] for j in storage.readers if j in executed]
        reads += self._call_returns(children, storage, executed)
        if storage.is_output and segment is None:
            reads.append(last)
        if segment is not None and (len(reads) < len(storage.readers) or storage.held_by_context):
            # Read by a node the recompute never reaches (past its early stop, or outside the
            # segment): the segment body's variable lives until the recompute stops; a copy kept
            # on an autograd context goes with the recompute's graph, then too.
            reads.append(self.run_end[segment])
        return max(reads, default=created_at)

    def _buffer_copies(self, alloc: np.ndarray, free: np.ndarray) -> None:
        """The copies of buffers each run of a segment's body makes (``planner.rewrite.Segment``):
        one when the body starts, held by that call's checkpoint frame (its recompute context)
        while something saved through it lives, and one more during each recompute.

        A frame made in the forward, at any depth, lives until its recompute ends; one made
        inside a parent's recompute lives only as long as the graph that recompute builds,
        which goes when the recompute ends; one where nothing saves goes when its body returns.
        """
        copies = {s: self.problem.buffer_copy_bytes(s.start, s.stop) for s in self.end}

        def body(segment: Nest, started: int, held_to: int) -> None:
            if copies[segment]:
                alloc[started] += copies[segment]
                free[held_to] += copies[segment]

        for segment in (s for top in self.top for s in top.walk()):
            saves = self.saving[segment] is not None
            body(segment, segment.start, self.run_end[segment] if saves else segment.stop - 1)
        for segment, executed in self.runs.items():
            if not executed:
                continue
            if copies[segment]:
                alloc[executed[0][1]] += copies[segment]
                free[self.run_end[segment]] += copies[segment]
            at = dict(executed)
            for child in segment.inner:
                if child.start not in at:
                    continue  # the recompute stops at its inputs: it does not run
                for inner in child.walk():
                    returned = at[inner.stop - 1]
                    saves = self.saving[inner] is not None
                    body(inner, at[inner.start], self.run_end[segment] if saves else returned)

    # -- the replay ----------------------------------------------------------------------------
    def run(self, record: bool) -> Simulation:
        problem, steps = self.problem, len(self.phases)
        n = problem.size
        alloc = np.zeros(steps, dtype=np.int64)
        free = np.zeros(steps, dtype=np.int64)
        transient = np.zeros(steps, dtype=np.int64)
        by_producer: dict[int, list] = {}
        for s in problem.storages:
            by_producer.setdefault(s.producer, []).append(s)

        forward = {p: p for p in range(n)}
        outputs_read_by_loss = 0  # graph outputs freed once the loss has read them
        for p in range(n):
            transient[p] = problem.workspace[p]
            alloc[p] += problem.created_bytes[p]
            for s in by_producer.get(p, ()):
                released = self._release(None, s, p, forward, n - 1)
                free[released] += s.nbytes
                if s.is_output and released == n - 1:
                    outputs_read_by_loss += s.nbytes
        seconds = flops = 0.0
        for segment, executed in self.runs.items():
            at = dict(executed)
            end = self.end[segment]
            for q, step in executed:
                if q == end and not problem.saves_own[q]:
                    continue  # it saved its inputs and the recompute stopped: it never ran
                transient[step] = problem.workspace[q]
                seconds += float(problem.seconds[q])
                flops += float(problem.flops[q])
                for s in by_producer.get(q, ()):
                    if q == end and not s.before_last_save:
                        continue  # made after the last save: the recompute stopped first
                    alloc[step] += s.nbytes
                    free[self._release(segment, s, step, at, -1)] += s.nbytes
        self._buffer_copies(alloc, free)
        # A checkpoint call costs Problem.checkpoint_seconds each time it runs: every segment
        # in the forward, and an inner one again inside its parent's recompute.
        calls = sum(1 for top in self.top for _ in top.walk()) + sum(
            sum(1 for _ in child.walk())
            for segment, executed in self.runs.items()
            for child in segment.inner
            if child.start in dict(executed)
        )
        call_seconds = problem.checkpoint_seconds * calls
        for p, step in self.backward_step.items():
            alloc[step] += problem.activation_grad_alloc[p] + problem.grad_bytes_at[p]
            free[step] += problem.activation_grad_free[p]

        first_backward = self.backward_step.get(n - 1, n)
        if first_backward > n:  # recomputes run before it: they hold the loss and the seed
            alloc[n] += problem.loss_bytes
            free[first_backward - 1] += problem.loss_bytes
        after = np.cumsum(alloc - free)
        live = after + free + transient
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
      runs), what its backward allocates at its high point, and the gradients made by the
      backward of later nodes and not yet freed (parameter gradients accumulated by then, the
      gradients of the outputs and of every pending activation): the same in every plan, since
      recompute changes which activations live, not the gradients;
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
    backward = saved + pending + allocated
    step = int(net.sum()) + problem.optimizer_step_bytes
    return int(problem.fixed_bytes + max(int(forward.max()), int(backward.max()), step))
