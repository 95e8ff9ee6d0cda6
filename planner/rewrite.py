"""Rewrite: build the planned module, in which each chosen segment runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

The planned module is an ``fx.GraphModule`` whose children, parameters and buffers are the user's
own objects, so its ``state_dict`` has the same keys and trains the same tensors. Each segment is
a small GraphModule kept in a plain attribute ``segment_<k>`` (not registered as a child, so
parameter and ``state_dict`` listings stay unchanged); it reaches the same leaf modules, and takes
parameters read through ``get_attr`` as explicit inputs so that ``.to()`` never leaves it stale.

The planned module is a :class:`planner.planned_module.PlannedModule`, which checks on every
call that it still computes what the model computes.

Segments with kept nodes (``planner.simulate.Choice.keep``) use the dispatch modes of
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (``_selective_contexts``, which
leave casts of leaf tensors out: see ``_Caching``): the segment's body brackets each kept node
with two marker calls, ``_keep_on`` and ``_keep_off``, which run identically in the forward and
in the recompute and enter the cache's mode around the kept node only (``_CacheScope``), where
the policy saves what its ops make. The other ops dispatch as in a plain checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner.errors import PlanningError
from planner.export_leaves import CALLS_KEY, positions
from planner.fakes import casts_a_leaf, op_facts, tensors_in
from planner.gcpause import paused_collection
from planner.in_place import BufferReads
from planner.model_call import CALL_KEY
from planner.nested import Nest, NestedChoice
from planner.planned_module import (
    PlannedModule,
    Snapshot,
    argument_positions,
    replays_allowed,
    share_user_state,
)
from planner.problem import Problem, compute_nodes
from planner.regions import REGION_ENTRIES, ClosingRegions, enter_autocast, enter_inference_mode
from planner.simulate import Choice, as_choice, replayed_nodes, validate_choice

# The cache scope of the selective segment running now (its forward or its recompute); per
# thread, as autograd may recompute a segment on a thread of its own.
_KEEPING = threading.local()


def _keep_on(quiet: str | None = None) -> None:
    """``quiet``: the name of a kept node that drew no random numbers at planning."""
    scope = getattr(_KEEPING, "scope", None)
    if scope is not None:  # None: not under checkpoint (a forward without grad)
        scope.enter(quiet)


def _keep_off() -> None:
    scope = getattr(_KEEPING, "scope", None)
    if scope is not None:
        scope.leave()


class _CacheScope:
    """While a selective segment's forward (or recompute) runs, the cache mode its kept nodes
    enter (``_keep_on``) and leave (``_keep_off``).

    The cache's mode is on only around kept nodes, so the other ops skip its Python dispatch.
    That changes nothing they compute: it would recompute them (``_keep_policy``) and store
    no tensor for them. The cache matches a recompute's ops to the forward's by their order
    among the ops it sees, and both see the same ops: those of the kept nodes, which the
    forward and the recompute run in the same order. A kept node that raises (the recompute's
    early stop) leaves the mode entered: leaving the scope leaves it.
    """

    def __init__(self, mode):
        self.mode = mode
        self.entered = False

    def enter(self, quiet: str | None = None) -> None:
        self.mode.quiet = quiet  # see _Caching
        if not self.entered:
            self.entered = True
            self.mode.__enter__()

    def leave(self) -> None:
        if self.entered:
            self.entered = False
            self.mode.__exit__(None, None, None)

    def __enter__(self):
        self.outer = getattr(_KEEPING, "scope", None)
        _KEEPING.scope = self
        return self

    def __exit__(self, *exc) -> None:
        self.leave()
        _KEEPING.scope = self.outer


@functools.cache
def _aliases(op) -> bool:
    """Whether ``op`` returns a view of, or writes into, an argument."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


# Ops of hooks on a kept module, not of its computation: FSDP2's all-gathers into buffers it
# frees and reuses, which a recompute served from the cache read as garbage (found by a tester:
# NaN gradients after accumulation), collectives, the profiler's records. A kept custom op of
# the model's own (``torch.library``) is cached like ATen's (found by review: recomputing it
# from a replayed input gave garbage gradients).
_HOOK_NAMESPACES = frozenset(
    {"fsdp", "c10d", "_c10d_functional", "c10d_functional", "_dtensor", "profiler"}
)


def _keep_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save what ops of kept nodes create (the cache sees no other: ``_CacheScope``). Views and
    in-place ops are recomputed (free): saving them would hold the storage they alias; and so
    are the ops of hooks (``_HOOK_NAMESPACES``)."""
    if _aliases(op) or getattr(op, "namespace", "aten") in _HOOK_NAMESPACES:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _is_fake(value) -> bool:
    return isinstance(value, torch.Tensor) and is_fake(value)


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` draws random numbers in this call: torch tags fused attention and
    cuDNN's RNN kernels as random whatever their dropout (a plan made on another device, or on
    meta, may have profiled another kernel for the same node; found by review)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = [argument.name for argument in func._schema.arguments]

    def value(name: str, default):
        i = names.index(name)
        return args[i] if i < len(args) else kwargs.get(name, default)

    if "train" in names and not value("train", True):
        return False
    for name in ("dropout_p", "dropout"):
        if name in names:
            return bool(value(name, 0.0))
    return True


class _Caching(_CachingTorchDispatchMode):
    """The forward side of the selective-checkpoint cache, blind to leaf casts.

    The cache matches a recompute's calls of an op to the forward's by their order; a leaf cast
    that autocast's cache answers on one side only would shift the order of every later cast
    and hand a kept node another call's result (wrong gradients). Leaf casts therefore run
    outside the cache on both sides: never saved, recomputed (or answered by autocast's cache).
    """

    quiet: str | None = None  # the kept node running, if it drew nothing at planning

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if casts_a_leaf(func, args):
            return func(*args, **(kwargs or {}))
        if self.quiet is not None and _draws(func, args, kwargs or {}):
            # Served from the cache in the recompute, this draw would leave the generator
            # behind for every later draw there (found by a tester: a noise hook added to a
            # kept module after planning put the dropout after it 2.7 off, silently).
            raise PlanningError(
                f"{func} drew random numbers inside {self.quiet}, which the plan keeps (its "
                "results are saved, not recomputed) and which drew none at planning: a hook "
                "added to its module since, a dropout turned on in it, or a kernel of another "
                "kind on the device it runs on now. The recompute would not draw them again, "
                "and every later random op of the segment would draw other numbers. Plan "
                "again, as it runs now."
            )
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Cached(_CachedTorchDispatchMode):
    """The recompute side of the selective-checkpoint cache, blind to leaf casts (``_Caching``).

    Torch's cache hands each result over once. A second backward over the same graph
    (``retain_graph=True``, or a gradient penalty through ``create_graph=True``) recomputes the
    segment again; that recompute runs the kept nodes' ops too. It is exact: checkpoint restores
    the random state of the segment's start, so they draw what the forward drew."""

    def __init__(self, storage: dict):
        super().__init__(None, storage)
        self.recomputes = 0

    def __enter__(self):
        # Entered around each kept node (_CacheScope): the count of the ops it has answered
        # runs on across them; the recompute's scope starts it afresh (``restart``).
        return super(_CachedTorchDispatchMode, self).__enter__()

    def restart(self) -> None:
        """Count from the first op again, as torch's mode does on entering."""
        self.recomputes += 1
        self.func_counter.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.recomputes > 1 or casts_a_leaf(func, args):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _replay_on(ops: tuple[tuple[str, bool], ...]) -> None:
    mode = getattr(_REPLAYING, "mode", None)
    if mode is not None:  # None: in the forward, or not under checkpoint
        mode.start(ops)


def _replay_off() -> None:
    mode = getattr(_REPLAYING, "mode", None)
    if mode is not None and mode.entered:
        mode.__exit__(None, None, None)


# The replay mode of the recompute running now, per thread (as _KEEPING).
_REPLAYING = threading.local()


class _Replaying(TorchDispatchMode):
    """Around a replayed node in a recompute (``planner.choice.replayed_nodes``): of the ops
    that make tensors, those its profile marked (``planner.profile.replay_ops``) return
    stand-ins of their results' size and dtype holding one element, computed on meta tensors;
    the others (copies the node saves for its own backward), views and weight casts run.

    Autograd sits above this mode: it saves each op's inputs, which are real, for backward,
    which is all a recompute is for; nothing saves the stand-ins or computes from them. Should
    the ops differ from the profile's, the rest run; one that would compute from a stand-in
    raises rather than hand backward a wrong tensor.
    """

    def __init__(self):
        super().__init__()
        self.entered = False
        self.ops: tuple[tuple[str, bool], ...] = ()
        self.next = 0
        self.stand_ins: list[torch.Tensor] = []  # held, so that no address is reused
        self.addresses: set[int] = set()

    def start(self, ops: tuple[tuple[str, bool], ...]) -> None:
        self.ops, self.next = ops, 0
        self.__enter__()

    def __enter__(self):
        self.entered = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.entered = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op_facts(func).aliasing or casts_a_leaf(func, args):
            return func(*args, **kwargs)
        expected = self.ops[self.next] if self.next < len(self.ops) else ("", False)
        self.next += 1
        tensors = tensors_in(args) + tensors_in(tuple(kwargs.values()))
        if expected[0] != str(func):
            self.ops = ()  # not the profile's ops: the rest run
        elif expected[1] and tensors:  # the profile fakes only ops with tensor arguments
            return self._stand_ins(func, args, kwargs, tensors)
        if any(t.untyped_storage().data_ptr() in self.addresses for t in tensors):
            raise RuntimeError(
                f"planner: a replayed node of a recompute ran {func} on a value it did not "
                "compute, as its profile said it would not: the plan's recompute cannot be "
                "trusted for this call. Plan for these inputs again, and report it."
            )
        return func(*args, **kwargs)

    def _stand_ins(self, func, args, kwargs, tensors):
        device = next((t.device for t in tensors if t.dim()), tensors[0].device)

        def stand_in(meta: torch.Tensor) -> torch.Tensor:
            one = torch.empty((), dtype=meta.dtype, device=device)
            self.stand_ins.append(one)
            self.addresses.add(one.untyped_storage().data_ptr())
            return one.expand(meta.shape)

        with _disable_current_modes():  # outer modes (a FLOP counter) see nothing run
            on_meta = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            return tree_map_only(torch.Tensor, stand_in, func(*on_meta[0], **on_meta[1]))


@contextlib.contextmanager
def _replay_scope(recomputes: list):
    """The first recompute of a segment's call replays; a later one (``retain_graph=True``,
    ``create_graph=True``) computes its kept nodes (``_Cached``), which read what a replay
    would not compute, so it replays nothing."""
    recomputes.append(None)
    if len(recomputes) > 1:
        yield
        return
    outer = getattr(_REPLAYING, "mode", None)
    _REPLAYING.mode = mode = _Replaying()
    try:
        yield
    finally:
        if mode.entered:  # a replayed node stopped by the recompute's early stop
            mode.__exit__(None, None, None)
        _REPLAYING.mode = outer


# What a segment's body calls around a kept or replayed node.
_MARKERS: dict[str, tuple[Callable[..., None], Callable[[], None]]] = {
    "keep": (_keep_on, _keep_off),
    "replay": (_replay_on, _replay_off),
}


def _selective_contexts():
    """``create_selective_checkpoint_contexts(_keep_policy)``, with leaf casts left out, as
    scopes that enter the cache's modes around kept nodes only (``_CacheScope``)."""
    storage: dict = collections.defaultdict(dict)
    cached = _Cached(storage)
    return _CacheScope(_Caching(_keep_policy, storage)), _Reenterable(_recompute_scope, cached)


def _graph_kept() -> bool:
    """Whether the backward running now keeps the graph for another (``retain_graph=True``,
    ``create_graph=True``); assumed so where torch cannot tell."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


class _Reenterable:
    """A ``contextlib.contextmanager`` function as a context manager that can be entered again.

    ``checkpoint`` enters the recompute context once per recompute, and a second backward over
    the same graph (``retain_graph=True``, or a gradient penalty through ``create_graph=True``)
    recomputes again; a generator-based context manager can be entered only once."""

    def __init__(self, factory, *args):
        self._factory, self._args = factory, args
        self._entered: list = []

    def __enter__(self):
        context = self._factory(*self._args)
        self._entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc_info):
        return self._entered.pop().__exit__(*exc_info)


@contextlib.contextmanager
def _recompute_scope(cached: _Cached):
    cached.restart()
    with _CacheScope(cached):
        yield


@contextlib.contextmanager
def _nested(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _together(contexts: list):
    """One context entering ``contexts`` in order (the one itself, if only one)."""
    return contexts[0] if len(contexts) == 1 else _Reenterable(_nested, *contexts)


def _assign(buffers: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Put ``values`` back into ``buffers`` without moving their version counters.

    Autograd refuses a saved tensor whose version moved, and BatchNorm saves its running
    statistics (used in eval mode, unused in training), while its own update in training
    leaves their version alone. A ``copy_`` did move it: a BatchNorm called several times
    (an unrolled loop; a frozen one in eval mode), or a constant buffer every layer reads,
    failed in backward once a segment between the calls put its buffers back. So unchanged
    values are not written, and changed ones (the statistics a training BatchNorm updated)
    are written through ``.data``, as BatchNorm's own update is. Buffers whose values cannot
    be read (compiled, where a comparison would break the graph; meta, fake or subclassed
    tensors) are written with ``copy_``.
    """
    readable = not torch.compiler.is_compiling()
    for buffer, value in zip(buffers, values):
        if not (readable and type(buffer) is torch.Tensor and not buffer.is_meta):
            buffer.copy_(value)
        elif not torch.equal(buffer, value):
            buffer.data.copy_(value)


class Segment:
    """A checkpointed piece of the graph: callable, plus the buffers its recompute must restore.

    A BatchNorm in training mode updates its running statistics on every call, so recomputing
    it would update them twice; a forward that reads a buffer it (or a later node) updates would
    read the new value. ``contexts`` remembers the buffers' values when the segment runs,
    recomputes from them, and puts back the values the recompute found, leaving the buffers
    exactly as one forward leaves them (the simulator counts both copies:
    ``Problem.buffer_copy_bytes``). The buffers are named, not held: ``.double()`` or
    ``.to(device)`` on the model replace buffer tensors after planning, so they are looked up
    through ``root`` (the planned module) when the segment runs and when it is recomputed.
    A segment that keeps nodes (``selective``) also caches their ops' results in the forward
    and hands them to the recompute (``_keep_policy``); one that replays nodes (``replays``)
    replays them in its recompute (``_Replaying``).

    The parameters of the modules it calls (``called``) are not checkpoint inputs, which
    autograd saves: the model without the plan computes its backward with the tensors the
    forward used, or refuses (a parameter changed in place). ``contexts`` takes them at the
    forward, with their versions and ``requires_grad`` and the modules' training flags, and
    the recompute runs with them as they were (``_as_in_forward``): a parameter replaced since
    (``functional_call`` puts the model's back as it returns) or frozen, or a module put in
    eval mode, between the forward and the backward; it refuses a parameter changed in place
    (an ``optimizer.step()`` too early), whose old values are gone. Eagerly only (under
    torch.compile, see ``_context_fn``). Buffers' values at the forward are restored for the
    recompute. The
    modules are held, as ``body`` holds them (replacing one makes the planned module refuse to
    run); their parameters are read at every call.
    """

    def __init__(
        self,
        body: fx.GraphModule,
        modules: tuple[str, ...],
        tensors: tuple[str, ...],
        selective: bool,
        called: tuple[nn.Module, ...],
        replays: bool,
    ):
        self.body = body
        self.modules = modules  # targets of the called modules that have buffers
        self.tensors = tensors  # targets of the buffers the segment reads directly
        self.called = called  # every module it calls and their submodules, inner segments' too
        self.root: nn.Module | None = None  # the planned module, set once it is built
        self.selective = selective
        self.replays = replays  # its body marks replayed nodes (``_Replaying``)
        # Only a body that enters regions (autocast, grad mode) can leave one open when the
        # recompute stops early; the others skip ClosingRegions (a few us per call).
        entries = {n.target for n in body.graph.nodes if n.op == "call_function"}
        self.opens_regions = not entries.isdisjoint(REGION_ENTRIES)
        self.infers = enter_inference_mode in entries

    def __call__(self, *args):
        if torch.compiler.is_exporting() and any(map(_is_fake, args)):  # exporting this call:
            # a program that trained nothing (found by a tester); the flag is the process's
            raise PlanningError(
                "torch.export cannot record a plan's checkpointed segments: the exported "
                "program would run them without gradients. Export the model itself, or use "
                "torch.compile on the planned module."
            )
        if self.infers and torch.compiler.is_compiling():
            # aot_eager: "Inference tensors do not track version counter"
            raise PlanningError(
                "torch.compile cannot checkpoint a torch.inference_mode block, and this plan "
                "has one inside a segment. Run the plan without torch.compile (or compile "
                "without fullgraph=True: Dynamo then runs this segment eagerly, exactly)."
            )
        # ``forward``, not ``body(...)``: a GraphModule's call wrapper walks the traceback of
        # every exception, and the recompute's early stop is one (about 80 us per segment).
        if not self.opens_regions or torch.compiler.is_compiling():
            return self.body.forward(*args)
        with ClosingRegions():
            return self.body.forward(*args)

    @property
    def restores_buffers(self) -> bool:
        return bool(self.modules or self.tensors)

    @property
    def compiles(self) -> bool:
        """Whether torch.compile runs this segment exactly without ``contexts``: it applies
        buffer updates once, but recomputes from the buffers as updated. A BatchNorm's output
        reads its running statistics only in eval mode, when it does not update them; any other
        buffer could be read after an update."""
        root = self.root
        assert root is not None, "rewrite sets root before the segment can run"
        return not self.tensors and all(
            isinstance(root.get_submodule(target), nn.modules.batchnorm._BatchNorm)
            for target in self.modules
        )

    def buffers(self) -> list[torch.Tensor]:
        """The buffers the segment can write, as the planned module holds them now."""
        root = self.root
        assert root is not None, "rewrite sets root before the segment can run"
        found = {}
        for target in self.modules:
            for b in root.get_submodule(target).buffers():
                found[id(b)] = b
        for target in self.tensors:
            b = operator.attrgetter(target)(root)
            found[id(b)] = b
        return list(found.values())

    def contexts(self, leaves: tuple = ()):
        """The contexts of one call whose inputs that may be leaves are ``leaves``: (forward,
        recompute), as ``checkpoint``'s ``context_fn``."""
        state: list[list[tuple]] = []  # the forward's training flags, parameters and leaves
        forward = [_Reenterable(self._taking_state, state, leaves)]
        recompute = [_Reenterable(self._as_in_forward, state)]
        if self.restores_buffers:
            at_forward: list[torch.Tensor] = []
            forward.append(_Reenterable(self._remembering, at_forward))
            recompute.append(_Reenterable(self._replaying, at_forward))
        if self.selective:
            # innermost: the buffer copies stay outside the cache, whose op counts must match
            caching, cached = _selective_contexts()
            forward.append(caching)
            recompute.append(cached)
        if self.replays and replays_allowed():
            recompute.append(_Reenterable(_replay_scope, []))
        return _together(forward), _together(recompute)

    @contextlib.contextmanager
    def _taking_state(self, state: list, leaves: tuple):
        state.append([(m, m.training) for m in self.called])
        state.append(
            [
                (m, name, p, p._version, p.requires_grad)
                for m in self.called
                for name, p in m._parameters.items()
                if p is not None
            ]
        )
        # Weakly: a tensor made in forward (``arange``) lives as long as checkpoint holds it.
        state.append([(weakref.ref(t), t.requires_grad) for t in _leaves(leaves)])
        yield

    @contextlib.contextmanager
    def _as_in_forward(self, state: list):
        """Recompute with the parameters and training flags the forward used, as autograd,
        which saved what it computed, does: a parameter replaced since (the tensors
        ``torch.func.functional_call`` passed, put back when it returned; a new
        ``nn.Parameter`` assigned) is swapped back in, one frozen or unfrozen gets its
        ``requires_grad`` back, a module put in eval mode its training flag, for the recompute
        only. So does an input of the segment that is a leaf (a parameter the graph reads as
        an attribute, a model input) frozen or unfrozen since: with another flag, the recompute
        would save other tensors, which checkpoint hands to backward by position (the wrong
        ones, silently, when their sizes agree). One changed in place is refused: the gradient
        would mix the old values (saved outside the segment) with the new."""
        flags, parameters, leaves = state
        for _, _, p, version, _ in parameters:
            if p._version != version:
                raise RuntimeError(self._changed_message(p))
        moved = [(m, training) for m, training in flags if m.training != training]
        # Not one removed since (``prune`` moves a weight): the recompute fails as without
        # this, and the module is left as it is.
        swapped = [
            (m, name, p, m._parameters[name])
            for m, name, p, _, _ in parameters
            if m._parameters.get(name, p) is not p
            and not (_sharded(p) or _sharded(m._parameters[name]))
        ]
        held = [(t, grad) for ref, grad in leaves if (t := ref()) is not None]
        changed = [(p, grad) for _, _, p, _, grad in parameters] + held
        thawed = list({id(p): (p, grad) for p, grad in changed if p.requires_grad != grad}.values())
        for m, training in moved:
            m.training = training
        for m, name, p, _ in swapped:
            m._parameters[name] = p
        for p, grad in thawed:
            p.requires_grad_(grad)
        try:
            yield
        finally:
            for p, grad in thawed:
                p.requires_grad_(not grad)
            for m, name, _, now in reversed(swapped):
                m._parameters[name] = now
            for m, training in moved:
                m.training = not training

    def _changed_message(self, parameter: torch.Tensor) -> str:
        root = self.root
        assert root is not None, "rewrite sets root before the segment can run"
        names = (n for n, p in root.named_parameters(remove_duplicate=False) if p is parameter)
        name = next(names, "a parameter")
        return (
            f"parameter {name!r} was modified in place (an optimizer.step(), a copy_ or a "
            "load_state_dict) between the forward of the planned module and this backward, "
            "which recomputes a checkpointed segment that reads it: the gradient would mix its "
            "new values with the old ones the forward used. Without the plan, autograd refuses "
            "such a change to a tensor it saved (one of the variables needed for gradient "
            "computation has been modified by an inplace operation). Call backward() before "
            "changing parameters (optimizer.step() after loss.backward()), or run the forward "
            "again after the change."
        )

    @contextlib.contextmanager
    def _remembering(self, at_forward: list):
        with torch.no_grad():
            at_forward.extend(b.clone() for b in self.buffers())
        yield

    @contextlib.contextmanager
    def _replaying(self, at_forward: list):
        """Recompute from the buffers' values when the segment ran (a later update must not
        change what it reads), then leave them as they are now (not updated twice)."""
        buffers = self.buffers()
        with torch.no_grad():
            now = [b.clone() for b in buffers]
            _assign(buffers, at_forward)
        try:
            yield
        finally:
            with torch.no_grad():
                _assign(buffers, now)
            if not _graph_kept():  # no later recompute: the copies go now, as simulated
                at_forward.clear()

    def __repr__(self):
        return (
            f"Segment({len(self.body.graph.nodes)} nodes, restores the buffers of "
            f"{len(self.modules)} modules and {len(self.tensors)} tensors)"
        )


def _sharded(tensor) -> bool:
    """Whether ``tensor`` is a parameter FSDP2 holds sharded between a module's calls: its
    hooks, which run in the recompute too, put the gathered tensor in place for each call."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class _Box:
    """Hands a buffer to a checkpointed segment as a non-tensor argument.

    ``checkpoint`` saves its tensor arguments for the recompute, and autograd checks their
    version counters when it unpacks them. A segment that updates a buffer in place (the
    ``num_batches_tracked += 1`` and running statistics of a BatchNorm captured by
    ``torch.export``) would bump the version of its own saved input, and backward would fail with
    "modified by an inplace operation". Boxed, the buffer is passed by reference and read when
    the segment runs, exactly as a ``call_module`` BatchNorm reads its own buffers.
    """

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _context_fn(segment: Segment, *leaves):
    """``segment.contexts`` of a call whose inputs that may be leaves are ``leaves``; under
    torch.compile, which calls ``context_fn`` while tracing and recomputes in its own graph, a
    policy that recomputes every op (see ``Segment.compiles``)."""
    if not torch.compiler.is_compiling():
        return functools.partial(segment.contexts, leaves)
    if not segment.compiles:
        raise PlanningError(
            "torch.compile cannot run this plan exactly: a checkpointed segment reads buffers "
            f"({', '.join(segment.modules + segment.tensors)}) that forward may update in "
            "place, and a compiled recompute would read them as updated, not as the forward "
            "read them. Plans whose segments update only the statistics of BatchNorm modules "
            "called as single nodes, or keep nodes, compile. Compile the model unplanned "
            "(torch.compile(model); torch._functorch.config.activation_memory_budget sets its "
            "recompute), or run the plan without torch.compile."
        )
    return functools.partial(create_selective_checkpoint_contexts, _recompute_all)


def _recompute_all(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _leaves(values: tuple) -> list[torch.Tensor]:
    """The tensors of ``values`` that are leaves of autograd's graph."""
    return [t for t in values if isinstance(t, torch.Tensor) and t.grad_fn is None]


def _box(value):
    return _Box(value)


def _unbox(box):
    return box.value


def _holder(captured: fx.GraphModule, model: nn.Module) -> nn.Module:
    """A module holding the user's state, plus what only the captured graph has (constants)."""
    holder = nn.Module()
    share_user_state(holder, model)
    for node in captured.graph.find_nodes(op="get_attr") + captured.graph.find_nodes(
        op="call_module"
    ):
        top = node.target.split(".")[0]
        if not hasattr(holder, top):
            setattr(holder, top, getattr(captured, top))
    return holder


def _constants_on_top(captured: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """``captured``, or a copy of it that reads at its top level the tensors it holds under a
    submodule of the model that the submodule lacks: constants torch.export made in that
    submodule's forward (``0.lifted_tensor_0``, from ``torch.tensor(2.0)`` or ``h[h < 0] = 0``).

    The planned module holds the model's own submodules, which planning must not change, so
    such a constant can only sit beside them, as the graph's top-level constants do
    (``_holder``); it takes its node's name, unique in the graph.
    """
    nested = [
        node
        for node in captured.graph.find_nodes(op="get_attr")
        if hasattr(model, node.target.split(".")[0]) and not _holds(model, node.target)
    ]
    if not nested:
        return captured
    graph = fx.Graph()
    graph._codegen = captured.graph._codegen
    copies: dict[fx.Node, fx.Node] = {}
    for node in captured.graph.nodes:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    lifted = fx.GraphModule(captured, graph)
    lifted.meta.update(captured.meta)
    for node in nested:
        setattr(lifted, node.name, operator.attrgetter(node.target)(captured))
        copies[node].target = node.name
    lifted.recompile()
    return lifted


def _holds(module: nn.Module, target: str) -> bool:
    try:
        operator.attrgetter(target)(module)
    except AttributeError:
        return False
    return True


def _takes_item(node: fx.Node) -> bool:
    """Whether ``node`` takes an item out of another: ``t[0]``, or a field of a named tuple
    (``torch.sort(h).values``, a ``getattr`` node)."""
    return node.op == "call_function" and node.target in (operator.getitem, getattr)


def _unpacks(node: fx.Node) -> bool:
    """Whether ``node`` takes an item out of a node whose every use does so (a tuple)."""
    if not _takes_item(node):
        return False
    source = node.args[0]
    return isinstance(source, fx.Node) and all(map(_takes_item, source.users))


def _segment_buffers(members: list[fx.Node], inputs: list[fx.Node], reads_buffer: BufferReads):
    """Buffers a segment can write, by name: (targets of the modules it calls that have
    buffers, targets of the buffers its inputs are, or live in: ``BufferReads.restored``).
    ``reads_buffer`` remembers its answers: a nested plan asks again for every segment holding
    a node."""
    targets = [str(node.target) for node in members if node.op == "call_module"]
    modules = [target for target in targets if reads_buffer.holds_buffers(target)]
    tensors = [reads_buffer.restored(node) for node in inputs]
    return tuple(dict.fromkeys(modules)), tuple(dict.fromkeys(t for t in tensors if t))


# One GraphModule per segment: the collector's passes over their nodes took half the rewrite
# of 400 segments (0.25 of 0.52 CPU s; benchmarks/planning_time.py, the residual family).
@paused_collection()
def rewrite(
    captured: fx.GraphModule, model: nn.Module, choice, *, problem: Problem | None = None
) -> PlannedModule:
    """A GraphModule computing what ``captured`` computes, with ``choice`` checkpointed.

    ``choice`` is a ``planner.simulate.Choice`` or plain segments: ``(start, stop)`` positions
    over ``planner.problem.compute_nodes(captured)``, and positions of kept nodes. Given
    ``problem`` (``captured``'s, from ``prepare``), a choice ``simulate`` refuses is refused
    (``validate_choice``), and the recomputes replay the nodes whose values nothing needs
    (``planner.choice.replayed_nodes``), as ``simulate`` predicts; without it, they compute
    every node they run.
    """
    replay: dict[int, tuple[tuple[str, bool], ...]] = {}
    if problem is not None and not isinstance(choice, NestedChoice):
        choice = validate_choice(problem, choice)  # as simulate refuses what it cannot replay
        profiled = compute_nodes(captured)
        for k in np.flatnonzero(replayed_nodes(problem, choice)).tolist():
            ops = profiled[k].meta["planner.replay_ops"]
            replay[k] = tuple((name, fake) for name, fake, _, _ in ops)
    captured, choice, replay = _calls_view(captured, choice, replay)
    captured = _constants_on_top(captured, model)
    holder = _holder(captured, model)
    nodes = compute_nodes(captured)
    if isinstance(choice, NestedChoice):  # segments holding segments: see planner.nested
        marks: dict[fx.Node, tuple] = {}
        nests = choice.segments
    else:
        choice = as_choice(choice)
        marks = {nodes[k]: ("replay", ops) for k, ops in replay.items()}
        drew = problem.random if problem is not None else np.ones(len(nodes), bool)
        marks.update(
            {nodes[k]: ("keep",) + (() if drew[k] else (nodes[k].name,)) for k in choice.keep}
        )
        nests = tuple(Nest(start, stop) for start, stop in choice.segments)
    first = {nodes[s.start]: (k, s) for k, s in enumerate(nests)}
    inside = {node for s in nests for node in nodes[s.start : s.stop]}

    graph = fx.Graph()
    graph._codegen = captured.graph._codegen  # keeps torch.export's input/output pytree handling
    env: dict[fx.Node, fx.Node] = {}
    built: list[Segment] = []
    reads_buffer = BufferReads(holder, captured.meta.get("planner.buffer_storages"))
    for node in captured.graph.nodes:
        if node in first:
            k, nest = first[node]
            name = f"segment_{k}"
            _checkpoint_segment(graph, env, holder, name, nodes, nest, marks, built, reads_buffer)
        elif node not in inside and node not in env:
            env[node] = graph.node_copy(node, lambda n: env[n])

    planned = PlannedModule(holder, graph, class_name=f"Planned{type(model).__name__}")
    share_user_state(planned, model)
    # Only the flag, not .train()/.eval(): those would recurse into the user's own children.
    planned.training = holder.training = model.training
    planned.graph.lint()  # the constructor compiled the graph; lint only checks it
    planned._planner = Snapshot(
        model,
        called={n.target for n in captured.graph.find_nodes(op="call_module")},
        graph_reads={n.target for n in captured.graph.find_nodes(op="get_attr") if n.users},
        tensor_arguments=argument_positions(
            planned, captured.meta.get("planner.tensor_arguments", ())
        ),
        dtypes=captured.meta.get("planner.call_dtypes"),
        sizes=captured.meta.get("planner.call_sizes"),
        grads=captured.meta.get("planner.call_grads"),
        replays=bool(replay),
        checkpoints=bool(built),
        reads_grad_mode=captured.meta.get("planner.reads_grad_mode", False),
        autocast_regions=bool(captured.graph.find_nodes(op="call_function", target=enter_autocast)),
        opens_regions=any(
            captured.graph.find_nodes(op="call_function", target=entry) for entry in REGION_ENTRIES
        ),
    )
    if replay:
        targets = {n.target for n in planned.graph.find_nodes(op="get_attr")}
        planned._planner.remember_graph_tensors(planned, targets)
    for segment in built:
        segment.root = planned
    call = captured.meta.get(CALL_KEY)
    if call is not None:  # calls and outputs like the model's (see planner.model_call.ModelCall)
        call.install(planned)
    return planned


def _checkpoint_segment(
    graph,
    env,
    holder,
    name: str,
    nodes: list[fx.Node],
    nest: Nest,
    marks: dict[fx.Node, tuple],
    built,
    reads_buffer: BufferReads,
) -> None:
    """Append to ``graph`` a checkpoint call of ``nodes[nest.start:nest.stop]`` as a ``Segment``
    named ``name``, keeping the members in ``kept``; its inner segments (``nest.inner``) become
    checkpoint calls inside its body. Every segment built is appended to ``built``;
    ``reads_buffer`` is ``_segment_buffers``'s. Inputs that are buffers, or live in one (a
    view), are passed boxed (``_Box``)."""
    members = nodes[nest.start : nest.stop]
    inner = {nodes[child.start]: child for child in nest.inner}
    inner_members = {m for child in nest.inner for m in nodes[child.start : child.stop]}
    member_set = set(members)
    # Items taken out of a multi-output node before the segment (``split``): handed the tuple,
    # checkpoint would hold it whole, past the saved-tensor hooks of an enclosing checkpoint.
    # Only items that read nothing the segment computes can be taken out before it runs.
    unpacked = [m for m in members if _unpacks(m) and member_set.isdisjoint(m.all_input_nodes)]
    _define(graph, env, unpacked)
    member_set -= set(unpacked)
    inputs = list(
        dict.fromkeys(
            a
            for m in members
            for a in (m.all_input_nodes if m in member_set else [m])
            if a not in member_set
        )
    )
    outputs = [m for m in members if m in member_set and any(u not in member_set for u in m.users)]
    boxed = {a for a in inputs if reads_buffer.restored(a) is not None}
    body = fx.Graph()
    body_env = {a: body.placeholder(a.name) for a in inputs}
    for a in inputs:
        if a in boxed:
            body_env[a] = body.call_function(_unbox, (body_env[a],))
    selective = any(marks.get(m, ("",))[0] == "keep" for m in members)
    replays = any(marks.get(m, ("",))[0] == "replay" for m in members)
    for m in members:
        if m in inner:
            child = inner[m]
            child_name = f"{name}_{nest.inner.index(child)}"
            _checkpoint_segment(
                body, body_env, holder, child_name, nodes, child, marks, built, reads_buffer
            )
            continue
        if m in inner_members or m not in member_set:
            continue
        mark = marks.get(m)
        if mark is not None:  # ("keep", name if it draws nothing) or ("replay", its ops)
            on, off = _MARKERS[mark[0]]
            body.call_function(on, mark[1:])
        body_env[m] = body.node_copy(m, lambda n: body_env[n])
        if mark is not None:
            body.call_function(off)
    body.output(tuple(body_env[m] for m in outputs))
    modules, tensors = _segment_buffers(members, inputs, reads_buffer)
    targets = dict.fromkeys(str(m.target) for m in members if m.op == "call_module")
    called = tuple({id(m): m for t in targets for m in holder.get_submodule(t).modules()}.values())
    segment = Segment(fx.GraphModule(holder, body), modules, tensors, selective, called, replays)
    holder.__dict__[name] = segment  # a plain attribute, not a child: state_dict stays the user's

    _define(graph, env, inputs)
    callee = graph.get_attr(name)
    # Every segment recomputes under its contexts: the training flags and parameters of the
    # forward, and the flags of inputs that can be leaves (the model's inputs and the items of
    # its dict or list arguments, tensors it holds; ``_leaves`` keeps those without a grad_fn
    # when it runs): a flag flipped before backward would change what the recompute saves.
    leaves = [env[a] for a in inputs if a not in boxed]
    kwargs = {
        "use_reentrant": False,
        "preserve_rng_state": True,
        "context_fn": graph.call_function(_context_fn, (callee, *leaves)),
    }
    args = (
        callee,
        *[graph.call_function(_box, (env[a],)) if a in boxed else env[a] for a in inputs],
    )
    call = graph.create_node("call_function", checkpoint, args, kwargs, name=f"{name}_outputs")
    for index, m in enumerate(outputs):
        env[m] = graph.create_node("call_function", operator.getitem, (call, index), name=m.name)
    built.append(segment)


def _define(graph: fx.Graph, env: dict[fx.Node, fx.Node], used: list[fx.Node]) -> None:
    """Copy into ``graph`` the nodes of ``used`` it does not hold yet, each after those it reads.

    A segment is emitted where its first compute node stands, but the graph may list a node it
    reads after that node: a parameter's ``get_attr`` (``self.emb(ids) + self.pos[:n]`` lists
    ``pos`` after ``emb``), read by the segment or by an item taken out before it. Segments are
    intervals of the compute nodes, so what is missing is such a ``get_attr``, or an item whose
    own inputs are all defined by then: copying them early computes nothing twice.
    """
    for node in used:
        if node not in env:
            _define(graph, env, node.all_input_nodes)
            env[node] = graph.node_copy(node, lambda n: env[n])


def _calls_view(captured: fx.GraphModule, choice, replay: dict):
    """The graph to rewrite, ``choice`` and ``replay`` on it: for an export that keeps
    ``leaf_modules`` (see ``planner.export_leaves``), the graph calling them, with the
    positions of the graph profiled (every op inlined; no cut, keep or replay falls inside a
    call) moved onto it."""
    calls = captured.meta.get(CALLS_KEY)
    if calls is None:
        return captured, choice, replay
    calls.meta.update({k: v for k, v in captured.meta.items() if k != CALLS_KEY})
    first, last = positions(compute_nodes(captured), compute_nodes(calls))

    def moved(nest: Nest) -> Nest:
        return Nest(first[nest.start], last[nest.stop - 1] + 1, tuple(map(moved, nest.inner)))

    if isinstance(choice, NestedChoice):
        return calls, NestedChoice(tuple(map(moved, choice.segments))), {}
    choice = as_choice(choice)
    segments = tuple((first[a], last[b - 1] + 1) for a, b in choice.segments)
    keep = frozenset(first[k] for k in choice.keep)
    return calls, Choice(segments, keep), {first[k]: ops for k, ops in replay.items()}
