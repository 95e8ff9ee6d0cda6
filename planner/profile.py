"""Profile: one training step on fake tensors (meta tensors for a model already on the meta
device) that records, per node, what memory it creates and what autograd saves for backward, plus
FLOPs and bytes moved. No real activation memory is used.

Storages are the unit of memory: two tensors that share a storage (views) cost it once. Every
storage is given a small integer key. Storages of parameters, buffers, model inputs and constants
are *fixed*: they are live for the whole step whatever the plan does (the model's parameters and
buffers all, those forward never reads included).

Keys written into ``node.meta`` (the one place they are documented):

``planner.created``
    ``{storage: nbytes}`` of the storages this node creates and that outlive it: new outputs and
    tensors saved for backward (e.g. a dropout mask).
``planner.reads``
    storages that existed before this node and that its ops read (parameters included).
``planner.saved``
    storages autograd saved for backward while this node ran (fixed storages excluded), and
    those a custom autograd function keeps as attributes of its context (``ctx.offs``).
``planner.context_saved``
    of those, the ones kept on a context: the graph holds them, not saved-tensor hooks, so
    checkpointing the node does not drop them (its recompute makes a copy of its own).
``planner.writes``
    storages this node mutates in place.
``planner.containers``
    (ids of the Python containers among its argument values, ids of those it wrote into):
    a recompute would read a container as the whole forward left it (``planner.problem``).
``planner.output_storages``
    storages its output tensors live in: its own, or an earlier one it returns a view or an
    alias of (``nn.Identity`` of a buffer). With ``gm.meta["planner.buffer_storages"]``
    (storage -> a name of the buffer in it), they tell which inputs of a segment are buffers
    however forward reached them (``planner.in_place.BufferReads``).
``planner.workspace``
    the most the node holds at once beyond the storages it creates and keeps: its temporaries
    at their high point (each dies as the node's code drops it).
``planner.flops``, ``planner.bytes_moved``
    FLOPs (``torch.utils.flop_counter`` formulas) and bytes read plus written by its ATen ops.
``planner.requires_grad``
    whether any of its outputs requires grad (then backward allocates a gradient for it).
``planner.tensor_output``
    whether it returns any tensor (``x.size(1)`` does not: it holds no memory).
``planner.kept_bytes``
    bytes a selective-checkpoint cache holds when the node is *kept* inside a checkpointed
    segment: every storage its ops create (outputs and temporaries alike: the cache stores the
    result of each op, from the forward until the segment's recompute consumes it).
``planner.random``
    whether one of its ops draws random numbers (tagged ``torch.Tag.nondeterministic_seeded``:
    dropout, ``rand_like``...).
``planner.replay_ops``
    how a recompute may replay the node where nothing needs its values
    (``planner.choice.replayed_nodes``): per op that makes tensors (views and weight casts
    left out), in order, its name, whether the replay fakes it, and its FLOPs and bytes
    moved (``replay_ops``); () for a node that draws random numbers or writes in place, or
    whose every op must compute.
``planner.one_op``
    whether it dispatches one op, which makes new tensors (weight casts left out): given a
    replay's stand-ins, whose strides are not the real results', it dispatches the same op,
    where a node of several may take another path (``reshape`` views a stand-in it would
    copy; ``planner.choice.replayed_nodes``).
``planner.repeated_effects``
    what running the node again would repeat beyond its tensor operations, which a recompute
    would then do twice: a draw from a generator passed to an op (``torch.rand(...,
    generator=g)``; checkpoint restores only the default generators), and, for a module kept
    whole (``call_module``), attributes its forward sets and draws from Python's or numpy's
    random generators (``planner.side_effects.repeated_effects``); and an op that writes into a
    tensor the node saved before (RReLU fills the noise it saved), which a recompute, stopping
    once the last tensor is saved, would hand backward unwritten; and an item assignment into
    a Python container (``CONTAINER_WRITE``). Such nodes are never recomputed.
``planner.backward_high``, ``planner.backward_net``
    measured in the fake backward that follows the forward: the most bytes the node's backward
    has allocated at once (input and parameter gradients, temporaries), and what of it is still
    live when the node's backward ends (gradients waiting for their consumers, ``.grad``).
``planner.backward_phases``, ``planner.backward_ends``, ``planner.backward_released``
    the node's backward in phases, one more each time one of its functions returns (dropping
    what it unpacked) or is released (autograd drops what it saved, then sums the function's
    gradients into those its inputs already have, out of place): the high point of each
    phase, as bytes allocated since the node's backward began; per storage the node saved,
    ``(returned, released)``, the phases from which a recomputed copy handed to its functions
    and the graph's own copy are gone (None: not within its backward); and the phase from
    which all its functions were released (None if not seen). A module kept whole or a
    composite op frees its saved tensors function by function (``simulate``).
``planner.backward_before_unpack``
    what the node's backward has allocated when it first unpacks a saved tensor, where a
    checkpoint recomputes: that recompute runs on top of it (``CopySlices``, the backward of
    an op in place on a view, allocates its gradient buffers first).
``planner.high_before_last_save``
    the most the node's new storages held at once until its last tensor was saved: where a
    recompute that stops inside it is at its highest.
``planner.cost_before_last_save``
    (FLOPs, bytes moved) of the node's ops until its last tensor was saved: what a recompute
    that stops inside it computes of it (a Linear under autocast saves its casts, then stops
    before its matmul).
``planner.made_before_last_save``
    storages among ``planner.created`` that exist when the node's last tensor is saved. A
    checkpoint's recompute stops right there (non-reentrant checkpoint stops once every saved
    tensor is back): the node's other storages, such as an output that only later nodes
    save, are never re-created by it. (Under autocast a node casts its input and saves the
    cast before its op runs and makes the output.)
``planner.cast_cache``
    storages among ``planner.created`` that ``torch.autocast``'s weight-cast cache holds: the
    low-precision copies of leaf tensors that require grad (weights), which live until the
    outermost autocast region exits, whoever reads them.

Under an autocast region entered before the profile (around ``plan(...)``, as around the
training step; one turned off counts too), that region outlives the step: its cached casts are
fixed memory, of the kind ``"autocast cache"``, and no node creates them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.autograd.function import BackwardCFunction
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only

from planner.errors import InputsRefused, PlanningError
from planner.fakes import (
    Copies,
    FakeCall,
    FakeOnDevice,
    MetaCopies,
    MetaKernels,
    all_on_meta,
    casts_a_leaf,
    op_facts,
    quiet_fake_failures,
    real_cpu_allocations,
    tensors_in,
)
from planner.gcpause import paused_collection
from planner.in_place import write_back
from planner.regions import ClosingRegions, autocast_region_open, enter_autocast
from planner.side_effects import keeping_random_states, repeated_effects
from planner.step import grad_fn_of, nothing_to_differentiate, output_tensors, training_loss

META_KEYS = (
    "planner.created",
    "planner.reads",
    "planner.saved",
    "planner.writes",
    "planner.workspace",
    "planner.flops",
    "planner.bytes_moved",
    "planner.requires_grad",
    "planner.tensor_output",
    "planner.kept_bytes",
    "planner.random",
    "planner.replay_ops",
    "planner.one_op",
    "planner.repeated_effects",
    "planner.backward_high",
    "planner.backward_net",
    "planner.backward_phases",
    "planner.backward_ends",
    "planner.backward_released",
    "planner.backward_before_unpack",
    "planner.cast_cache",
    "planner.made_before_last_save",
    "planner.high_before_last_save",
    "planner.cost_before_last_save",
    "planner.context_saved",
    "planner.output_storages",
    "planner.containers",
)
COMPUTE_OPS = ("call_function", "call_method", "call_module")
# The repeated effect of a write into a Python container (``batch["x"] = h``,
# ``hs.append(h)``): ``planner.problem`` also pins the nodes that read the container.
CONTAINER_WRITE = "writes into a Python container"
# ``tensor.device`` of a fake tensor, dispatched like an op; it reads and moves no memory, and
# meta tensors never dispatch it, so counting it would make the two runs disagree.
_DEVICE_QUERY = torch.ops.prim.device.default


@dataclass(frozen=True)
class Profile:
    """What the forward pass showed beyond the per-node annotations."""

    storage_bytes: dict[int, int]
    # storage -> "parameter" | "buffer" | "input" | "constant" | "autocast cache"
    fixed_kind: dict[int, str]
    trainable: frozenset[int]  # parameter storages that require grad (backward makes a grad)
    output_storages: frozenset[int]  # storages reachable from the graph's output
    seconds: float = 0.0
    # ids of the model's parameters that require grad but get none in the step (an unused
    # head, a teacher run under no_grad): an optimizer makes them no state.
    gradless: frozenset[int] = frozenset()
    # The user's loss, recorded as one more node after the graph's last (see ``loss_node``).
    loss: fx.Node | None = None
    # The loss's storage: the training step holds the loss until it ends (its backward and
    # the optimizer step), long after the loss node, if any, created it.
    loss_bytes: int = 0
    # The default loss (no ``loss_fn``): the most bytes its sums hold at once, made after the
    # graph's last node while the outputs are still live.
    default_loss_high: int = 0
    # The gradient seeding backward (``ones_like`` of the loss), held until backward returns;
    # the fake backward counts it in the first node's allocation.
    seed_bytes: int = 0
    # Bytes of the outputs the default loss sums, when none of them is a 0-dim loss
    # (``Problem.summed_output_bytes``).
    summed_output_bytes: int = 0
    # Inputs that are inference tensors (made under ``torch.inference_mode``): autograd cannot
    # save them, and a checkpoint saves its arguments. (A segment reads a buffer or parameter
    # in its body: never an argument it saves, found by review.)
    inference_storages: frozenset[int] = frozenset()

    def fixed_bytes(self, kind: str) -> int:
        return sum(self.storage_bytes[s] for s, k in self.fixed_kind.items() if k == kind)

    @property
    def gradient_bytes(self) -> int:
        return sum(self.storage_bytes[s] for s in self.trainable)


def require_meta(node: fx.Node, key: str):
    """``node.meta[key]``, or an error saying which pass should have written it."""
    try:
        return node.meta[key]
    except KeyError:
        raise PlanningError(
            f"{node.format_node()} has no {key!r}: run planner.profile.profile() first"
        ) from None


@dataclass
class _Storages:
    """Gives each storage seen a key of its own while it lives. A weak reference forgets its
    address when it dies (a later storage may take that address, and gets a new key) and tells
    ``died``, which measures what a node holds at once."""

    keys: dict[int, int] = field(default_factory=dict)  # storage _cdata -> key
    nbytes: dict[int, int] = field(default_factory=dict)
    references: dict[int, weakref.ref] = field(default_factory=dict)
    count: int = 0  # keys given so far: the next key
    died: Callable[[int], None] | None = None

    def key(self, tensor: torch.Tensor) -> int | None:
        if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
            return None
        storage = tensor.untyped_storage()
        cdata = storage._cdata
        key = self.keys.get(cdata)
        if key is None:
            key = self.keys[cdata] = self.count
            self.count += 1
            self.nbytes[key] = storage.nbytes()
            forget = functools.partial(self._forget, cdata, key)
            self.references[cdata] = weakref.ref(storage, forget)
        return key

    def _forget(self, cdata: int, key: int, reference: weakref.ref) -> None:
        if self.references.get(cdata) is reference:
            del self.keys[cdata], self.references[cdata]
            if self.died is not None:
                self.died(key)

    def fixed_key(self, original, stand_in) -> int | None:
        """The key of a stand-in for one of the user's tensors, counted at the size of the
        user's storage: a fake copy has only what its elements span, where the real storage
        may hold more (``torch.hann_window(128)`` holds 129 floats)."""
        key = self.key(stand_in)
        if key is not None and isinstance(original, torch.Tensor):
            self.nbytes[key] = max(self.nbytes[key], original.untyped_storage().nbytes())
        return key


_SAME_DTYPE_OPS = frozenset(
    (
        torch.ops.aten.mm,
        torch.ops.aten.addmm,
        torch.ops.aten.bmm,
        torch.ops.aten.baddbmm,
        torch.ops.aten.convolution,
    )
)


def _check_same_dtype(func, inputs: list[torch.Tensor]) -> None:
    dtypes = list(dict.fromkeys(t.dtype for t in inputs))
    if len(dtypes) > 1:
        raise RuntimeError(
            f"{func.overloadpacket.__name__} got tensors of different dtypes "
            f"({', '.join(str(d).removeprefix('torch.') for d in dtypes)}), which it cannot run"
        )


# Norms whose CPU kernels return float32 statistics (mean, rstd) for a low-precision input with
# a float32 weight or running statistics (autocast keeps weights in float32), where their meta
# kernels give them in the input's dtype (torch 2.13): saved for backward, they would count half.
_CPU_MIXED_DTYPE_NORMS = frozenset(
    (torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_batch_norm.default)
)


def _cpu_statistics(out: tuple, inputs: list[torch.Tensor]) -> tuple:
    """A mixed-dtype CPU norm's result with its statistics in float32, as the kernel makes them."""
    x, others = inputs[0], inputs[1:]
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return out
    if not any(t.dtype is torch.float32 for t in others):
        return out
    return (out[0], *(statistic.float() for statistic in out[1:]))


def _shapes(value):
    """``value`` with tensors replaced by their shapes (all a shape-only FLOP formula sees),
    lists by tuples and other values by (type, value), to be hashed."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (list, tuple)):
        return (type(value), *map(_shapes, value))
    return type(value), value


def replay_ops(ops: list, saved: set) -> tuple[tuple[str, bool, int, int], ...]:
    """How a recompute replays a node whose outputs nothing needs (``planner.choice.
    replayed_nodes``), from its ``ops`` as ``_CostMode`` recorded them: per op, (name, whether
    to fake it, FLOPs and bytes moved when computed). An op is computed where it cannot be
    replayed (``OpFacts.replayable``), where the node saves what it makes (``saved``:
    autograd saves an op's inputs, which may be copies the node made, and outputs), and where
    an op that is computed reads what it makes; the others return stand-ins
    (``planner.rewrite._Replaying``). () when none would be faked, or where a faked op would
    compute from another's stand-in (a view of it, ``_unsafe_view``, may take one): a
    stand-in's strides are not the real result's, and composite ops above the replay choose
    their path by them (``F.linear`` under autocast of a frozen weight, whose cast is not
    cached: ``addmm`` on the real cast, ``mm`` on a stand-in, which raised in backward; found
    by a tester). Such a node is recomputed, not replayed."""
    needed = set(saved)
    faked_from: set = set()  # what later faked ops of the node compute from, views left out
    replayed = []
    for name, replayable, read, made, flops, moved in reversed(ops):
        fake = replayable and not made & needed
        if fake and made & faked_from:
            return ()
        if fake:
            faked_from |= read - made
        else:
            needed |= read
        replayed.append((name, fake, flops, moved))
    replayed.reverse()
    return tuple(replayed) if any(fake for _, fake, _, _ in replayed) else ()


class _CostMode(TorchDispatchMode):
    """Counts FLOPs and bytes moved of every ATen op, and which storages each op creates."""

    def __init__(self, storages: _Storages, call: Callable):
        super().__init__()
        self.storages = storages
        storages.died = self._died
        self.call = call
        self.caching_casts = False  # set per node: autocast's state before the node ran
        self.flop_counts: dict[tuple, int] = {}  # see _flops
        self.reset()

    def _died(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key, 0)

    def _flops(self, func, formula: Callable, args: tuple, kwargs: dict, out) -> int:
        """``formula``'s FLOPs for this call. A formula of ``torch.utils.flop_counter`` that
        reads only shapes (``shape_wrapper``, which sets ``__wrapped__``) is computed once per
        distinct call: a long model repeats a few shapes, and the formulas are slow Python."""
        count = lambda: int(formula(*args, **kwargs, out_val=out))  # noqa: E731
        if not hasattr(formula, "__wrapped__"):
            return count()
        try:
            call = (func, _shapes(args), _shapes(tuple(kwargs.items())), _shapes(out))
            known = self.flop_counts.get(call)
        except TypeError:  # an argument that cannot be hashed
            return count()
        if known is None:
            known = self.flop_counts[call] = count()
        return known

    def reset(self):
        self.flops = 0
        self.bytes_moved = 0
        self.new: set[int] = set()
        # Bytes of the new storages alive, and the most at once (``_Storages.died``).
        self.live: dict[int, int] = {}
        self.live_bytes = self.high = 0
        self.reads: set[int | None] = set()  # None for tensors without a storage
        self.writes: set[int] = set()
        self.random = False
        # Per op making tensors of its own (views and weight casts left out), in order:
        # (name, replayable, storages read, storages made, FLOPs, bytes moved); see
        # ``replay_ops``.
        self.ops: list[tuple[str, bool, set, set, int, int]] = []
        self.op_count = 0  # ops dispatched, weight casts left out (``planner.one_op``)
        self.own_generator = False  # an op drew from a generator passed to it (not a default)
        # The tensors saved since the last op ran (``_Recorder.pack``): autograd saves an op's
        # inputs right before the op runs.
        self.just_saved: set[tuple] = set()
        self.overwrites_saved = False  # an op wrote into an input it saved before it ran
        self.casts: set[int] = set()  # new storages that autocast's weight-cast cache holds

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:
            return func(*args)
        key = self.storages.key
        inputs = tensors_in(args)
        if kwargs:
            inputs += tensors_in(tuple(kwargs.values()))
        else:
            kwargs = {}
        self.reads.update([key(t) for t in inputs])
        if func.overloadpacket in _SAME_DTYPE_OPS:
            _check_same_dtype(func, inputs)
        before = self.storages.count
        out = real_cpu_allocations(func, args, kwargs, self.call(func, args, kwargs))
        if func in _CPU_MIXED_DTYPE_NORMS:
            out = _cpu_statistics(out, inputs)
        facts = op_facts(func)
        self.random |= facts.random
        self.own_generator |= kwargs.get("generator") is not None
        for position, name in facts.written:
            value = args[position] if position < len(args) else kwargs.get(name)
            for t in tensors_in(value):
                written = key(t)
                if written is not None:
                    self.writes.add(written)
                    self.overwrites_saved |= _view(written, t) in self.just_saved
        outputs = tensors_in(out)
        for t in outputs:
            created = key(t)
            if created is not None and created >= before and created not in self.new:
                self.new.add(created)
                self.live[created] = self.storages.nbytes[created]
                self.live_bytes += self.live[created]
                self.high = max(self.high, self.live_bytes)
        if self.caching_casts and _is_cached_cast(func, inputs, outputs):
            cast = key(outputs[0])
            if cast is not None:
                self.casts.add(cast)
        flops = 0 if facts.flops is None else self._flops(func, facts.flops, args, kwargs, out)
        moved = 0 if facts.aliasing else sum(t.nbytes for t in inputs + outputs)
        self.flops += flops
        self.bytes_moved += moved
        weight_cast = casts_a_leaf(func, args)
        self.op_count += not weight_cast
        if not facts.aliasing and not weight_cast:
            # made: what its results hold, its inputs' storages too (``_unsafe_view``)
            made = {key(t) for t in outputs}
            # Factories, and ops given a device, run in a replay (``_Replaying``).
            fakeable = facts.replayable and bool(inputs) and "device" not in kwargs
            self.ops.append((str(func), fakeable, {key(t) for t in inputs}, made, flops, moved))
        self.just_saved.clear()
        return out


def _containers(values) -> list:
    """The Python containers among a node's argument values (a dict or list argument, what
    ``getitem`` or a module returned) and those they hold, by identity: forward may write into
    them, a module kept whole into one inside another."""
    found: dict[int, object] = {}
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, (dict, list, set, tuple)) and id(value) not in found:
            if not isinstance(value, tuple):  # a tuple cannot be written into
                found[id(value)] = value
            stack.extend(value.values() if isinstance(value, dict) else value)
    return list(found.values())


def _contents(container) -> tuple:
    """What a container holds, by identity, to tell whether a node wrote into it
    (``batch["x"] = h``, ``hs.update(...)``, ``hs.append(...)``)."""
    if isinstance(container, dict):
        return tuple((key, id(value)) for key, value in container.items())
    if isinstance(container, set):
        return tuple(sorted(map(id, container)))
    return tuple(map(id, container))


def _written_through_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view written in place (``h.view(...).mul_(s)``, a Linear's 3-d
    output updated in place): its base's backward is a ``CopySlices``."""
    grad_fn = tensor.grad_fn
    return (
        tensor._base is not None
        and grad_fn is not None
        and any(type(f).__name__ == "CopySlices" for f, _ in grad_fn.next_functions)
    )


def _as_strided_gradient(grad_inputs, grad_outputs):
    """The gradient eager backward hands ``CopySlices`` for a view written in place: autograd
    regenerates such a view's backward by ``as_strided``, which copies the gradient into a new
    tensor of the base's size, where the profile's fake tensors replay the view and pass a
    view of it on (found trying the library: one such tensor under the measured peak, 6-11%
    over a plan's budget). The copy is made here, as eager makes it."""
    return tuple(None if g is None else g.clone() for g in grad_inputs)


def _view(key: int, tensor: torch.Tensor) -> tuple:
    """Which part of storage ``key`` a tensor views: a cell writing one chunk of its gates
    after saving another (``gru_cell``) does not write what it saved."""
    return key, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


def _autocast_device(gm: fx.GraphModule) -> str | None:
    """The device whose ops autocast casts in this step, if any: the device of an autocast
    region around the call, else of the first region of forward that turns autocast on."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return device
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.find_nodes(op="call_function", target=enter_autocast):
                device, _, enabled, _ = node.args
                if enabled:
                    return device
    return None


def autocast_on() -> bool:
    """Whether autocast is on here, on either device."""
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def caching_casts() -> bool:
    """Whether autocast is on here and caches the casts of weights."""
    return torch.is_autocast_cache_enabled() and autocast_on()


def _is_cached_cast(func, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    """Whether an op run under autocast is a cast its cache keeps: a float32 leaf tensor that
    requires grad (a weight), copied to another dtype (autocast_mode.cpp, ``cached_cast``)."""
    return (
        func is torch.ops.aten._to_copy.default
        and len(inputs) == 1
        and inputs[0].is_leaf
        and inputs[0].requires_grad
        and inputs[0].dtype is torch.float32
        and len(outputs) == 1
        and outputs[0].dtype is not torch.float32
    )


@functools.cache
def _output_mask_position(func) -> int | None:
    """Where ``func`` takes an ``output_mask`` argument, if it does (read once per op)."""
    names = [argument.name for argument in func._schema.arguments]
    return names.index("output_mask") if "output_mask" in names else None


def _computed(func, args: tuple, kwargs: dict, out):
    """The outputs that ``func`` really computes. A backward op given an ``output_mask``
    (``native_batch_norm_backward``, ``convolution_backward``) returns no tensor where the mask
    is False on a real device, but its fake kernel may return a full one (a batch norm's
    gradient for an input that needs none): those allocate nothing."""
    position = _output_mask_position(func)
    if position is None or not isinstance(out, tuple):
        return out
    mask = args[position] if position < len(args) else kwargs.get("output_mask")
    if mask is None or len(mask) != len(out):
        return out
    return tuple(t for t, wanted in zip(out, mask) if wanted)


class _BackwardMemory(TorchDispatchMode):
    """Attributes the memory that backward allocates to the node whose backward is running.

    A pre-hook on each node's output ``grad_fn`` marks where that node's backward starts;
    storages created from then on (gradients, temporaries) count against it, and weak
    references tell when they are freed. Storages alive since the forward are not counted here:
    the simulator decides their fate, which depends on the plan.

    A node's backward runs one or more backward functions (a module kept whole, a composite op:
    many). Each drops what it unpacked as it returns and what it saved as autograd releases
    it, so the node's backward is recorded in *phases*, one more at each such event: the high
    point of each, and per saved storage the phase from which a recomputed copy handed to its
    functions is gone (the stand-ins they unpacked died) and the phase from which the graph's
    own copy is (the functions that unpacked it were released). The replay then holds each
    saved storage only through the phases it lives in (``BackwardPhases.credit``).
    """

    def __init__(self, forward_storages: _Storages, nodes: list[fx.Node], call: Callable):
        super().__init__()
        self.forward = forward_storages
        self.call = call
        self.nodes = nodes
        self.live = 0
        self.current: fx.Node | None = None
        self.start = 0
        self.tracked: dict[int, tuple[int, weakref.ref]] = {}  # _cdata -> (nbytes, reference)
        self.phases: dict[fx.Node, list[int]] = {}  # the high point of each phase, per node
        self.allocated = True  # since the current phase began: a next event starts a new one
        self.net: dict[fx.Node, int] = {}
        self.paused = False  # while it makes a stand-in (``stand_in``)
        self.before_unpack: dict[fx.Node, int] = {}  # see ``unpacking``
        self.entered_at = 0
        # Per (node, storage key): how often the forward saved it (``_Recorder.pack``) and the
        # backward unpacked it, by which functions, the stand-ins still alive, and the phase
        # from which the last was gone; the unpacks a stand-in could not watch.
        self.packs: collections.Counter = collections.Counter()
        self.unpacks: collections.Counter = collections.Counter()
        self.unpackers: dict[tuple, set] = collections.defaultdict(set)
        self.alive: collections.Counter = collections.Counter()
        self.copy_gone: dict[tuple, int] = {}
        self.unwatched: set[tuple] = set()
        self.released_at: dict[int, int] = {}  # id of a backward function -> the phase after
        # autograd released it
        self.all_released: dict[fx.Node, int] = {}  # the phase after the last own release

    def enter(self, node: fx.Node) -> None:
        self._close()
        # What the loss's backward allocated before the first node (the seed, ``ones_like``
        # of the loss, held by ``backward()`` until it returns) counts as that node's.
        self.current, self.start = node, (0 if self.current is None else self.live)
        self.entered_at = self.live  # for the first node, after the loss's seed
        phases = self.phases.setdefault(node, [])
        if phases:  # another of its functions starts: its phases go on
            phases[-1] = max(phases[-1], self.live - self.start)
        else:
            phases.append(self.live - self.start)
        self.allocated = True  # an event right away starts a phase after the first
        self.net.setdefault(node, 0)

    def _event(self, node: fx.Node) -> int | None:
        """One of ``node``'s functions returned or was released: the phase from which what it
        dropped is gone (a new one, unless nothing was allocated since the last event). None
        when ``node``'s backward is not the current one: its allocations are charged elsewhere
        then, and it tells nothing."""
        if node is not self.current:
            return None
        phases = self.phases[node]
        if self.allocated:
            phases.append(self.live - self.start)
            self.allocated = False
        return len(phases) - 1

    def unpacking(self) -> None:
        """A backward function unpacks a saved tensor: where a checkpoint recomputes. What the
        current node's backward holds at its first unpack, it holds through that recompute:
        ``CopySlices`` (an op in place on a view) makes its gradient buffers before its
        function unpacks (found trying the library: 4-11% over a nested plan's budget)."""
        if self.current is not None and self.current not in self.before_unpack:
            # The replay holds the loss and its seed through a first recompute already.
            self.before_unpack[self.current] = self.live - self.entered_at

    def reach(self, node: fx.Node) -> None:
        """One of ``node``'s own backward functions is about to run: its backward starts here
        if none of its outputs' functions did. An op in place on its output (``h.mul_(2)``
        after a Linear) puts a ``CopySlices`` in place of the output's function, and the
        node's ``AddmmBackward0`` runs after the in-place op's, which was charged with it
        (found trying the library: a plan 5% over its budget)."""
        if node not in self.phases:
            self.enter(node)

    def stand_in(self, tensor: torch.Tensor, key: int | None) -> torch.Tensor:
        """A tensor like ``tensor`` (of storage ``key``) on a storage of its own, not counted,
        that tells when the backward function it is handed to is done with it: there a
        recomputed copy a checkpoint handed that function would be gone
        (``_Recorder.unpack``)."""
        unpacked = (self.current, key)
        function = torch._C._current_autograd_node()
        if self.current is not None and key is not None:
            self.unpacks[unpacked] += 1
            self.unpackers[unpacked].add(id(function))
        if tensor.layout is not torch.strided or isinstance(function, BackwardCFunction):
            # A sparse tensor's end is not watched; nor one a custom function's backward gets,
            # which may return what it saved as a gradient (a fused loss's; ``hand_on``).
            self.unwatched.add(unpacked)
            return tensor
        stand_in = self._like(tensor)
        storage = stand_in.untyped_storage()
        cdata = storage._cdata
        self.alive[unpacked] += 1
        ended = functools.partial(self._applied, cdata, unpacked)
        self.tracked[cdata] = (0, weakref.ref(storage, ended))
        return stand_in

    def _like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor like ``tensor`` on a storage of its own, made without counting it."""
        self.paused = True
        try:
            return tensor.new_empty_strided(tensor.size(), tensor.stride())
        finally:
            self.paused = False

    def _applied(self, cdata: int, unpacked: tuple, reference: weakref.ref) -> None:
        """A stand-in died (weakref callback): the function it was handed to is done with it.
        One that outlives its node's backward (kept by a gradient) tells nothing."""
        del self.tracked[cdata]
        self.alive[unpacked] -= 1
        phase = self._event(unpacked[0])
        if phase is None:
            self.unwatched.add(unpacked)
        elif not self.alive[unpacked]:
            self.copy_gone[unpacked] = phase

    def hand_on(self, grad_inputs: tuple) -> tuple | None:
        """A custom function's backward returned its gradients: one on a storage of the
        forward's (a fused loss computes its gradient in forward, saves it and returns it,
        ``gi.mul_(g)``) lives on as the next function's incoming gradient after autograd
        released it (found by review: plans up to 3.6% under their measured peaks). It goes on
        as a tensor on a storage of its own, counted as this backward's from here on, whose
        death tells when the next function is done with it; not in the high point now, where
        it is still the saved tensor."""
        handed = [
            t is not None
            and t.layout is torch.strided
            and t.untyped_storage()._cdata in self.forward.keys
            for t in grad_inputs
        ]
        if not any(handed):
            return None
        result = []
        for t, forward in zip(grad_inputs, handed):
            if forward:
                t = self._like(t)
                storage = t.untyped_storage()
                cdata, nbytes = storage._cdata, storage.nbytes()
                self.tracked[cdata] = (
                    nbytes,
                    weakref.ref(storage, functools.partial(self._free, cdata)),
                )
                self.live += nbytes
            result.append(t)
        return tuple(result)

    def released(self, node: fx.Node, function: int, last: bool) -> None:
        """The function of id ``function``, one of ``node``'s own, has run (a post-hook):
        autograd now releases what it saved (``last``: the last of them), then sums its
        gradients into those its inputs already have (a skip's gradient and the main path's,
        out of place)."""
        phase = self._event(node)
        if phase is not None:
            self.released_at[function] = phase
            if last:
                self.all_released[node] = phase

    def _close(self) -> None:
        if self.current is not None:
            self.net[self.current] += self.live - self.start

    def _ends(self, node: fx.Node) -> dict[int, tuple[int | None, int | None]]:
        """Per storage ``node`` saved, the phases from which a recomputed copy handed to its
        functions and the graph's own copy are gone (None: not within its backward). Where
        not every save was unpacked where watched, both go with the last release."""
        last = self.all_released.get(node)
        ends: dict[int, tuple[int | None, int | None]] = {}
        for key in require_meta(node, "planner.saved"):
            unpacked = (node, key)
            returned = released = last
            if self.unpacks[unpacked] >= self.packs[unpacked] > 0:
                phases = [self.released_at.get(f) for f in self.unpackers[unpacked]]
                released = None if None in phases else max(p for p in phases if p is not None)
                returned = released
                if unpacked not in self.unwatched and not self.alive[unpacked]:
                    returned = self.copy_gone.get(unpacked, released)
            if released is None or returned is None:
                released = None  # the graph's copy is what its functions unpacked
            else:
                released = max(released, returned)
            ends[key] = (returned, released)
        return ends

    def finish(self) -> None:
        self._close()
        for node in self.nodes:
            phases = self.phases.get(node, [0])
            node.meta["planner.backward_high"] = max(phases)
            node.meta["planner.backward_net"] = self.net.get(node, 0)
            node.meta["planner.backward_phases"] = tuple(phases)
            node.meta["planner.backward_ends"] = self._ends(node)
            node.meta["planner.backward_released"] = self.all_released.get(node)
            node.meta["planner.backward_before_unpack"] = self.before_unpack.get(node, 0)

    def _free(self, cdata: int, reference: weakref.ref) -> None:  # a weakref callback
        self.live -= self.tracked.pop(cdata)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = real_cpu_allocations(func, args, kwargs, self.call(func, args, kwargs))
        if self.paused:
            return out
        grew = False
        for t in tensors_in(_computed(func, args, kwargs, out)):
            if t.layout is not torch.strided:
                continue
            storage = t.untyped_storage()
            cdata = storage._cdata
            if cdata in self.forward.keys or cdata in self.tracked:
                continue
            nbytes = storage.nbytes()
            reference = weakref.ref(storage, functools.partial(self._free, cdata))
            self.tracked[cdata] = (nbytes, reference)
            self.live += nbytes
            grew = True
        # Only an allocation can raise the high-water mark (enter() starts every node at 0).
        if grew and self.current is not None:
            phases = self.phases[self.current]
            phases[-1] = max(phases[-1], self.live - self.start)
            self.allocated = True
        return out


class _HighWater(TorchDispatchMode):
    """The most bytes of new storages live at once while it is on (weak references tell when
    they are freed): what a piece of the step outside the graph, the default loss, holds."""

    def __init__(self, call: Callable):
        super().__init__()
        self.call = call
        self.live = self.high = 0
        self.tracked: dict[int, weakref.ref] = {}

    def _free(self, cdata: int, nbytes: int, reference: weakref.ref) -> None:
        if self.tracked.pop(cdata, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage()._cdata for t in tensors_in((args, tuple(kwargs.values())))}
        out = self.call(func, args, kwargs)
        for t in tensors_in(out):
            storage = t.untyped_storage()
            cdata = storage._cdata
            if cdata in inputs or cdata in self.tracked:
                continue
            nbytes = storage.nbytes()
            free = functools.partial(self._free, cdata, nbytes)
            self.tracked[cdata] = weakref.ref(storage, free)
            self.live += nbytes
            self.high = max(self.high, self.live)
        return out


class _Recorder(fx.Interpreter):
    """Runs the graph node by node, annotating each compute node."""

    def __init__(
        self, module: fx.GraphModule, storages: _Storages, cost: _CostMode, copies: Copies
    ):
        super().__init__(module, garbage_collect_values=True)
        self.extra_traceback = False  # our error names the node; fx's would repeat the graph
        self.copies = copies
        self.storages = storages
        self.cost = cost
        self.saved_by_current: set[int] = set()
        self.made_before_last_save: set[int] = set()  # new storages when a tensor was saved
        self.high_before_last_save = 0  # and the most its new storages held until then
        self.cost_before_last_save = (0, 0)  # and the FLOPs and bytes its ops had moved
        # Under an autocast region entered before the step (casting or not), cached casts
        # outlive it: fixed.
        self.casts_outlive_step = autocast_region_open()
        self.fixed_casts: set[int] = set()
        nodes = [n for n in module.graph.nodes if n.op in COMPUTE_OPS]
        self.backward = _BackwardMemory(storages, nodes, cost.call)
        self.hooked: set = set()  # grad_fns whose backward is charged to a node already
        self.owned: set = set()  # the backward functions of the nodes recorded so far

    def fetch_attr(self, target: str):
        return self.copies(super().fetch_attr(target))

    def pack(self, tensor):
        key = self.storages.key(tensor)
        if key is not None:
            self.saved_by_current.add(key)
            self.backward.packs[self.recording, key] += 1
            self.cost.just_saved.add(_view(key, tensor))
        self.made_before_last_save = set(self.cost.new)
        self.high_before_last_save = self.cost.high
        self.cost_before_last_save = (self.cost.flops, self.cost.bytes_moved)
        return tensor, tensor._version, self.recording

    def unpack(self, packed):
        """Hand a backward function a stand-in for what it saved, on a storage of its own that
        dies when the function returns: that tells ``self.backward`` where the function
        ended. The profile's tensors have no values, only sizes, so the stand-in computes the
        same; it is not counted as an allocation.

        Autograd checks that a saved tensor was not modified in place since it was saved only
        when no saved-tensor hooks are on, so the check is made here: a checkpoint's recompute
        would hand backward the tensor as recomputed and train with wrong gradients where the
        model's own backward raises."""
        tensor, version, saver = packed
        if tensor._version != version:
            raise PlanningError(self._overwritten(tensor, saver))
        self.backward.unpacking()
        return self.backward.stand_in(tensor, self.storages.key(tensor))

    def _overwritten(self, tensor: torch.Tensor, saver: fx.Node) -> str:
        """Why backward would refuse ``tensor``, which ``saver`` saved and a later node wrote
        over in place, and what to do."""
        key = self.storages.key(tensor)
        nodes = self.backward.nodes  # the compute nodes in order, and a loss_fn's last
        after = nodes[nodes.index(saver) :]  # the saver itself too: a loss_fn is one node
        writers = [n for n in after if key in n.meta.get("planner.writes", ())]
        where = (
            f"node {saver.name!r} ({saver.op} {_target_name(saver)}) saved a tensor for backward"
        )
        if writers and writers[0].target is write_back:
            buffer = cast(fx.Node, writers[0].args[0]).target
            return (
                f"the captured graph cannot be trained: {where}, the buffer {buffer!r}, to "
                "which forward then assigns a new value (self.x = ...). torch.export's graph "
                "writes that value into the buffer in place where Python only rebinds the "
                "name, so backward would refuse the buffer, and a plan would hide that and "
                "train with wrong gradients. Read the buffer through a copy where an operation "
                "saves it (x * self.x.clone()), or plan a model symbolic_trace can capture."
            )
        by = f" by node {writers[0].name!r} ({_target_name(writers[0])})" if writers else ""
        return (
            f"the model's own backward fails: {where} that the forward then modified in "
            f"place{by} (autograd raises 'one of the variables needed for gradient "
            "computation has been modified by an inplace operation'). A plan would hide that "
            "error and train with wrong gradients. Make the in-place operation out of place "
            "(for example t = t * 2 instead of t.mul_(2))."
        )

    def run_node(self, node: fx.Node):
        if node.op not in COMPUTE_OPS:
            return super().run_node(node)
        try:
            # The tensors passed in count as read even when no operation touches them
            # (``nn.Identity``): a checkpoint starting at a later node still takes them.
            passed = [t for n in node.all_input_nodes for t in tree_leaves(self.env.get(n))]
            containers = _containers(self.env.get(n) for n in node.all_input_nodes)
            before = [_contents(c) for c in containers]
            run = functools.partial(super().run_node, node)
            if node.op != "call_module":
                out = self.record(node, run, passed)
            else:
                with repeated_effects(self.fetch_attr(cast(str, node.target))) as effects:
                    out = self.record(node, run, passed)
                node.meta["planner.repeated_effects"] += tuple(effects)
            written = {id(c) for c, was in zip(containers, before) if _contents(c) != was}
            if written:
                node.meta["planner.repeated_effects"] += (CONTAINER_WRITE,)
            node.meta["planner.containers"] = ({id(c) for c in containers}, written)
            return out
        except PlanningError:
            raise
        except (DynamicOutputShapeException, DataDependentOutputException) as error:
            reads_value = error.func is torch.ops.aten._local_scalar_dense.default
            what = (
                "reads a Python number from a tensor (.item(), float(t), int(t)), which "
                "depends on the tensor's values"
                if reads_value
                else f"calls {error.func}, whose result's sizes torch's fake tensors cannot "
                "give (they may depend on the values in its inputs)"
            )
            advice = (
                "Keep that computation out of the planned forward: plan the part before it "
                "(return what it takes, e.g. the log-probabilities of a CTC loss) and apply it "
                "to the planned module's output in the training step (its own memory is then "
                "not in the prediction)."
            )
            if reads_value and _has_forward_hooks(self.module, node):
                advice = (
                    f"{node.target!r} has forward hooks, which the profile runs too: register "
                    "a hook that logs values (.item()) after planning, where it runs on real "
                    "tensors (and again in each recompute), or log without .item(). " + advice
                )
            raise PlanningError(
                f"the model's forward cannot be profiled at node {node.name!r} ({node.op} "
                f"{node.target}): it {what}, and planner's profile runs on fake tensors, which "
                f"have sizes only. The inputs are not at fault. {advice}"
            ) from error
        except Exception as error:
            raise InputsRefused(
                f"the model's forward failed on the example inputs at node {node.name!r} "
                f"({node.op} {node.target}): {type(error).__name__}: {error}. Check the "
                "example inputs' shapes and dtypes against what the model expects; if the "
                "model itself fails on them (an out= argument that requires grad), the "
                "forward is at fault, not the inputs."
            ) from error

    def release(self) -> None:
        """Drop the stand-ins and their backward functions. Those hold hooks that hold the
        recorder, which holds them (``hooked``, ``owned``, the values in ``env``): a cycle
        through autograd's C++ graph, which the garbage collector cannot see, that kept the
        graph module and the root tensors it held alive, replaced ones too (found by a
        tester: 0.5 MiB over the budget)."""
        self.env.clear()
        self.hooked.clear()
        self.owned.clear()

    def record(self, node: fx.Node, run: Callable, passed=()):
        """Run ``run()`` as the computation of ``node`` and write its annotations; ``passed``
        holds the values given to it (their tensors count as read)."""
        self.cost.reset()
        self.recording = node
        # Read before the node runs: autocast hides its own state from the ops it dispatches.
        self.cost.caching_casts = caching_casts()
        self.saved_by_current = set()
        self.made_before_last_save = set()
        makers = [(t, grad_fn_of(t)) for t in passed if isinstance(t, torch.Tensor)]
        self.high_before_last_save = 0
        self.cost_before_last_save = (0, 0)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            out = run()
        node.meta["planner.high_before_last_save"] = self.high_before_last_save
        node.meta["planner.cost_before_last_save"] = self.cost_before_last_save
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        stashed = _context_tensors(tensors, self.owned | {grad_fn for _, grad_fn in makers})
        for tensor in stashed:
            self.pack(tensor)
        out_keys = {self.storages.key(t) for t in tensors} - {None}
        # The cache holds a cast whoever reads it: past the node, or past the whole step.
        if self.casts_outlive_step:
            self.fixed_casts |= self.cost.casts
        new = self.cost.new - self.fixed_casts
        casts = self.cost.casts & new
        kept = (new & out_keys) | (new & self.saved_by_current) | casts
        nbytes = self.storages.nbytes
        node.meta["planner.created"] = {k: nbytes[k] for k in sorted(kept)}
        node.meta["planner.cast_cache"] = frozenset(casts)
        node.meta["planner.made_before_last_save"] = frozenset(kept & self.made_before_last_save)
        given = {self.storages.key(t) for t in passed if isinstance(t, torch.Tensor)}
        node.meta["planner.reads"] = frozenset((self.cost.reads | given) - new - {None})
        node.meta["planner.saved"] = frozenset(self.saved_by_current)
        node.meta["planner.context_saved"] = frozenset(
            {self.storages.key(t) for t in stashed} - {None}
        )
        node.meta["planner.writes"] = frozenset(self.cost.writes)
        node.meta["planner.output_storages"] = frozenset(out_keys)
        # What the node holds at once beyond what it keeps: its temporaries die as it goes.
        node.meta["planner.workspace"] = max(self.cost.high - sum(nbytes[k] for k in kept), 0)
        node.meta["planner.kept_bytes"] = sum(nbytes[k] for k in new)
        node.meta["planner.random"] = self.cost.random
        node.meta["planner.one_op"] = self.cost.op_count == 1 and len(self.cost.ops) == 1
        node.meta["planner.replay_ops"] = (
            ()
            if self.cost.random or self.cost.writes
            else replay_ops(self.cost.ops, self.saved_by_current)
        )
        # A recompute stops once the last tensor is saved (non-reentrant checkpoint's early
        # stop): an op that then writes into what it saved (RReLU fills the noise it saved)
        # would hand backward the tensor unwritten.
        effects: tuple[str, ...] = ("own generator",) if self.cost.own_generator else ()
        effects += ("writes what it saved",) if self.cost.overwrites_saved else ()
        node.meta["planner.repeated_effects"] = effects
        node.meta["planner.flops"] = self.cost.flops
        node.meta["planner.bytes_moved"] = self.cost.bytes_moved
        node.meta["planner.requires_grad"] = any(t.requires_grad for t in tensors)
        node.meta["planner.tensor_output"] = bool(tensors)
        for t in tensors:
            if (grad_fn := grad_fn_of(t)) is not None and _written_through_view(t):
                grad_fn.register_hook(_as_strided_gradient)
        # A node that returns a tensor it was given (dropout with p=0, ``to`` to the same dtype)
        # shares its grad_fn: that backward is the maker's, and runs where the maker's does
        # (after the maker's recompute when it is checkpointed), so it is charged to the maker.
        outputs = {grad_fn_of(t) for t in tensors} - {None} - self.hooked
        for grad_fn in outputs:
            self.hooked.add(grad_fn)
            grad_fn.register_prehook(lambda grads, node=node: self.backward.enter(node))
        # A tensor passed in and updated in place (``x.mul_(s)``) has a backward function of
        # this node's that its later readers reach, whenever they run: nothing is released.
        if all(grad_fn_of(t) is grad_fn for t, grad_fn in makers):
            self._hook_release(node, outputs, {grad_fn for _, grad_fn in makers})
        return out

    def _hook_release(self, node: fx.Node, outputs: set, given: set) -> None:
        """Tell ``self.backward`` when the last of ``node``'s own backward functions has run:
        those reached from its outputs' before the functions of earlier nodes, of the tensors
        passed in (``given``), or of parameters. One that never runs (a gradient nobody needs)
        leaves the node's backward high point whole, as if nothing were released."""
        reached = _backward_functions(outputs, stops=self.owned | given)
        own = {grad_fn for grad_fn in reached if not _accumulates(grad_fn)}
        self.owned |= own
        remaining = [len(own)]

        def ran(function: int):
            def hook(grad_inputs, grad_outputs) -> None:
                remaining[0] -= 1
                self.backward.released(node, function, last=not remaining[0])

            return hook

        for grad_fn in own:
            if isinstance(grad_fn, BackwardCFunction):
                grad_fn.register_hook(lambda grad_inputs, _: self.backward.hand_on(grad_inputs))
            # By id: the hook must not hold its own function (an uncollectable cycle through
            # the C++ graph); ``self.owned`` keeps each alive, so ids stay unique.
            grad_fn.register_hook(ran(id(grad_fn)))
            grad_fn.register_prehook(lambda grads, node=node: self.backward.reach(node))


def _backward_functions(starts, stops: set) -> set:
    """The backward functions reached from ``starts`` through ``next_functions``, without
    entering those of ``stops``."""
    reached, pending = set(), list(starts)
    while pending:
        grad_fn = pending.pop()
        if grad_fn is None or grad_fn in stops or grad_fn in reached:
            continue
        reached.add(grad_fn)
        pending.extend(next_fn for next_fn, _ in grad_fn.next_functions)
    return reached


def _accumulates(grad_fn) -> bool:
    """Whether ``grad_fn`` is an ``AccumulateGrad``: it adds into a leaf's ``.grad``."""
    return hasattr(grad_fn, "variable")


@contextlib.contextmanager
def _grads_left_alone(loss: torch.Tensor):
    """Puts back the ``.grad`` of every tensor the backward of ``loss`` accumulates into. A
    ``loss_fn`` may read the user's own tensors that require grad (an L2 penalty on the model's
    parameters, a learnable loss weight): the fake backward would leave fake gradients there,
    or fail adding one to a real gradient they already hold. Yields those tensors: the leaves
    that get a gradient."""
    reached = _backward_functions([loss.grad_fn], stops=set())
    leaves = [grad_fn.variable for grad_fn in reached if _accumulates(grad_fn)]
    grads = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    try:
        yield leaves
    finally:
        for leaf, grad in zip(leaves, grads):
            leaf.grad = grad


def _context_tensors(outputs: list[torch.Tensor], stops: set) -> list[torch.Tensor]:
    """Tensors that a custom autograd function kept as attributes of its context (``ctx.offs =
    offs`` in Hugging Face's grouped matmul of MoE experts) rather than through
    ``save_for_backward``: the saved-tensor hooks never see them, yet the graph holds them until
    the function's backward, like saved tensors. Every function of the node's own backward
    (reached from its outputs, short of ``stops``: a module kept whole may apply one inside;
    found by review, 3-5% under the measured peak)."""
    functions = _backward_functions({grad_fn_of(t) for t in outputs}, stops)
    contexts = {f for f in functions if isinstance(f, BackwardCFunction)}
    return [
        t
        for ctx in contexts
        for t in tree_leaves(list(vars(ctx).values()))
        if isinstance(t, torch.Tensor)
    ]


def _has_forward_hooks(module: nn.Module, node: fx.Node) -> bool:
    """Whether ``node`` calls a module that has forward hooks or forward pre-hooks."""
    if node.op != "call_module":
        return False
    called = module.get_submodule(cast(str, node.target))
    return bool(called._forward_hooks or called._forward_pre_hooks)


def _backward_failure(func) -> str:
    """Why the fake backward could not run ``func``, and what helps."""
    if func is torch.ops.aten._local_scalar_dense.default:
        return (
            "the model's backward cannot be profiled: it reads a Python number from a tensor "
            "(.item(), float(t)), which depends on the tensor's values, and planner's profile "
            "runs on fake tensors, which have sizes only. A backward hook on a module "
            "(register_full_backward_hook) that logs a gradient's norm with .item() does "
            "this: register such hooks after planning (on a module the graph calls whole, "
            "they then run on real tensors), or log without .item()."
        )
    return (
        f"the model's backward cannot be profiled: it calls {func}, whose result's sizes "
        "torch's fake tensors cannot give (they depend on the values in its inputs), and "
        "planner's profile runs on fake tensors. A boolean-mask assignment in forward "
        "(h[mask] = v) does this; torch.where(mask[..., None], v, h) computes the same values "
        "without it. Or keep that computation out of the planned forward."
    )


def placeholder_values(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values of ``gm``'s placeholders for a call ``gm(*args, **kwargs)``."""
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = []
    for name, value in bound.arguments.items():
        kind = inspect.signature(gm.forward).parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            values.extend(value)
        elif kind == inspect.Parameter.VAR_KEYWORD:
            values.extend(value.values())
        else:
            values.append(value)
    return values


def loss_node(loss_fn: Callable) -> fx.Node:
    """A stand-alone node for the user's loss, annotated like the graph's nodes.

    It is not part of any graph: the loss runs outside the planned module, after its forward and
    before its backward, and is never checkpointed; but its memory (a float copy of the logits,
    a log-softmax saved for backward, the logits' gradient) is often the largest of the step.
    """
    graph = fx.Graph()
    return graph.create_node(
        "call_function", loss_fn, (graph.placeholder("output"),), name="loss_fn"
    )


class _StandIns(TorchDispatchMode):
    """Replaces the user's tensors that reach an op (a loss's labels, closed over) by their
    stand-ins, once each, before the cost mode sees them: the labels then cost their bytes
    once, as a constant, and the user's tensors are only read."""

    def __init__(self, copies: Copies):
        super().__init__()
        self.copies = copies
        # A meta run's tensors are meta; a fake run's are fakes (a meta label is the user's).
        self.meta_run = isinstance(copies.convert, MetaCopies)

    def _is_stand_in(self, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, FakeTensor) or (tensor.is_meta and self.meta_run)

    def _stand_in(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._is_stand_in(tensor):
            return tensor
        # Made outside the modes: the ops making a meta copy are no memory of the loss node
        # (the labels are the user's, live all step: fixed, as in a fake run).
        with _disable_current_modes():
            return self.copies(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Nearly every op (all of backward) sees stand-ins only: call it as it is, without
        # rebuilding its arguments (ATen arguments hold tensors in lists and tuples only).
        if all(map(self._is_stand_in, tensors_in(args) + tensors_in(tuple(kwargs.values())))):
            return func(*args, **kwargs)
        args, kwargs = tree_map_only(torch.Tensor, self._stand_in, (args, kwargs))
        return func(*args, **kwargs)


# What a loss_fn that fake tensors cannot run does, and what to write instead (found trying the
# library: a masked-language-model loss and a one-hot target were refused without a way out).
_LOSS_ADVICE: dict[type[Exception], str] = {
    DataDependentOutputException: (
        " It reads a tensor's value (.item(), float(t), .tolist(), an if on a tensor, or an op "
        "that checks its input's values: F.one_hot(labels, n) checks that labels are not "
        "negative), which fake tensors do not have: compute metrics outside loss_fn and return "
        "the loss tensor (a one-hot target of labels never negative: "
        "F.one_hot(labels.clamp(min=0), n); or F.cross_entropy)."
    ),
    DynamicOutputShapeException: (
        " It makes a tensor whose size depends on values (indexing with a boolean mask, "
        "out[labels != -100], nonzero, masked_select, unique), which fake tensors cannot size: "
        "leave positions out by F.cross_entropy(..., ignore_index=-100), or weigh them, "
        "(loss * mask).sum() / mask.sum()."
    ),
}


def _run_loss(loss_fn: Callable, output, copies: Copies) -> torch.Tensor:
    """``loss_fn(output)`` on the stand-in output (see ``_StandIns`` for its labels)."""
    with _StandIns(copies):
        try:
            loss = loss_fn(output)
        except Exception as error:
            raise PlanningError(
                f"loss_fn failed on the model's output: {type(error).__name__}: {error}. It is "
                "called as loss_fn(output) with what the model returns (on fake tensors while "
                "planning); labels and other tensors it needs come through its closure."
                + _LOSS_ADVICE.get(type(error), "")
            ) from error
    check_loss(loss)
    return loss


def check_loss(loss) -> None:
    """A loss must be a 0-dim floating-point tensor that requires grad, as ``backward()`` needs."""
    if not (
        isinstance(loss, torch.Tensor)
        and loss.dim() == 0
        and loss.is_floating_point()
        and loss.requires_grad
    ):
        got = (
            f"a tensor of shape {tuple(loss.shape)}, dtype {loss.dtype}, requires_grad="
            f"{loss.requires_grad}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        if isinstance(loss, torch.Tensor) and not torch.is_grad_enabled():
            raise PlanningError(  # found by a tester: a @torch.no_grad() setup function
                f"loss_fn returned {got} because planning runs under torch.no_grad() or "
                "torch.inference_mode(): planning runs a training step, forward and backward. "
                "Call planner.plan with gradients enabled (outside those blocks, or inside "
                "torch.enable_grad())."
            )
        raise PlanningError(
            f"loss_fn must return a 0-dim floating-point tensor that requires grad (the value "
            f"whose backward() is the training step), got {got}. Reduce it to a scalar, e.g. "
            ".mean(), and compute it from the model's output."
        )


def warn_of_hook_computed_weights(gm: fx.GraphModule) -> None:
    """Warn of modules whose weight a forward pre-hook computes (the old hook-based
    ``torch.nn.utils.weight_norm`` and ``spectral_norm``): the hook stores it as a plain
    attribute that lives past the node's backward, into the next step, and every recompute
    makes another; the profile does not follow it (measured: 66 KB over a plan's prediction
    with six 64x64 layers, about the size of their weights)."""
    hooked = {
        name: "weight_norm" if isinstance(hook, WeightNorm) else "spectral_norm"
        for name, module in gm.named_modules()
        for hook in module._forward_pre_hooks.values()
        if isinstance(hook, (WeightNorm, SpectralNorm))
    }
    if hooked:
        kinds = sorted(set(hooked.values()))
        warnings.warn(
            f"{', '.join(list(hooked)[:4])}{', ...' if len(hooked) > 4 else ''} compute their "
            f"weights in forward pre-hooks (torch.nn.utils.{' / '.join(kinds)}): the tensors "
            "they store on the modules are not counted, so the measured peak can exceed the "
            "prediction by about their bytes. Use "
            f"{' / '.join('torch.nn.utils.parametrizations.' + k for k in kinds)} instead, "
            "which plans exactly.",
            stacklevel=2,
        )


def _unread_state(model: nn.Module, gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """``("parameter" | "buffer", tensor)`` for each storage of ``model``'s parameters and
    buffers that ``gm`` does not hold: those forward never reads (an EMA copy of the network,
    an unused head, a table longer than the example needs), which ``symbolic_trace`` leaves out
    of the graph. They are live for the whole step all the same. Tied tensors count once."""
    seen = {t.untyped_storage()._cdata for t in _held_tensors(gm)}
    unread = []
    for kind, tensors in (("parameter", model.parameters()), ("buffer", model.buffers())):
        for tensor in tensors:
            if tensor.layout is not torch.strided:  # sparse: no storage to count
                continue
            storage = tensor.untyped_storage()._cdata
            if storage not in seen:
                seen.add(storage)
                unread.append((kind, tensor))
    return unread


def _held_tensors(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The strided tensors ``gm``'s modules hold: parameters, buffers and plain attributes
    (tensor constants of the graph)."""
    held = [*gm.parameters(), *gm.buffers()]
    for module in gm.modules():
        held += [value for value in vars(module).values() if isinstance(value, torch.Tensor)]
    return [t for t in held if t.layout is torch.strided]


@paused_collection()
def profile(
    gm: fx.GraphModule,
    args: tuple,
    kwargs: dict | None = None,
    *,
    loss_fn: Callable | None = None,
    model: nn.Module | None = None,
) -> Profile:
    """Annotate every compute node of ``gm`` (see the module docstring) from one fake training
    step: forward, the loss, backward.

    The loss is ``loss_fn(output)`` when given, recorded as the node ``Profile.loss`` (its
    memory, reads, saves and backward, like any node's); otherwise the loss of
    ``planner.step.training_loss``, whose memory is negligible and not recorded.

    ``gm`` itself is not run: a copy on fake tensors is, so neither real memory nor the user's
    parameters are touched. When every input, parameter and buffer is already on the ``meta``
    device, the copy is made of fresh meta tensors and runs without ``FakeTensorMode``, whose
    per-op dispatch is most of the cost on large graphs; the annotations are the same. Under
    autocast (around the call or in forward) such a copy is made of fake tensors on autocast's
    device instead, since autocast does not cast the ops of meta tensors.
    Savings are deduplicated by storage; parameter storages are fixed, never saved.

    ``model``, the module ``gm`` was captured from, adds its parameters and buffers that ``gm``
    does not hold to the fixed storages (see ``_unread_state``).
    """
    start = time.perf_counter()
    kwargs = kwargs or {}
    warn_of_hook_computed_weights(gm)
    storages = _Storages()
    fixed_kind: dict[int, str] = {}
    trainable: set[int] = set()
    inference: set[int] = set()
    call: Callable[[Any, tuple, dict], Any]
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet_fake_failures())
        stack.enter_context(keeping_random_states(gm))
        on_meta, autocast_device = all_on_meta(gm, args, kwargs), _autocast_device(gm)
        if on_meta and autocast_device is None:
            copies, call = Copies(MetaCopies()), MetaKernels()
        else:
            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
            if on_meta and autocast_device is not None:  # autocast ignores meta tensors
                copies = Copies(FakeOnDevice(mode, autocast_device))
                call = FakeCall(mode, autocast_device)
            else:
                copies = Copies(functools.partial(mode.from_tensor, static_shapes=True))
                call = FakeCall(mode)
        originals = tree_leaves((args, kwargs))
        args, kwargs = tree_map_only(torch.Tensor, copies, (args, kwargs))
        # Every stand-in now, before the run: meta copies are made by ops that the cost mode
        # would count as memory of the node that first used the tensor.
        for module in gm.modules():
            if module is not gm:  # the graph runs here, not gm: a copy would only recompile it
                copies(module)
        for p in gm.parameters():
            key = storages.fixed_key(p, copies(p))
            if key is None:  # not strided (sparse): no storage to count
                continue
            fixed_kind[key] = "parameter"
            if p.requires_grad:
                trainable.add(key)
        buffers: dict[int, str] = {}  # storage -> a name of the buffer, for the rewrite
        for name, b in gm.named_buffers():
            key = storages.fixed_key(b, copies(b))
            if key is not None:
                fixed_kind.setdefault(key, "buffer")
                buffers.setdefault(key, name)
        gm.meta["planner.buffer_storages"] = buffers
        for original, t in zip(originals, tree_leaves((args, kwargs))):
            key = storages.fixed_key(original, t)  # None for non-tensors
            if key is not None:
                fixed_kind.setdefault(key, "input")
        for original in originals:
            if isinstance(original, torch.Tensor) and original.is_inference():
                key = storages.key(copies(original))
                if key is not None:
                    inference.add(key)
        for kind, tensor in _unread_state(model, gm) if model is not None else ():
            key = storages.key(tensor)  # the user's own tensor: nothing runs on it
            if key is not None:
                fixed_kind.setdefault(key, kind)
        cost = _CostMode(storages, call)
        recorder = _Recorder(gm, storages, cost, copies)
        stack.callback(recorder.release)  # on errors too (found by review)
        # ClosingRegions: a forward that leaves a grad mode set must not leave it set here.
        with cost, warnings.catch_warnings(), ClosingRegions(always=True):
            warnings.simplefilter("ignore", FutureWarning)  # pytree specs of exported modules
            output = recorder.run(*placeholder_values(gm, args, kwargs))
        output_keys = {k for t in tree_leaves(output) if (k := storages.key(t)) is not None}
        loss_at = None if loss_fn is None else loss_node(loss_fn)
        default_loss = _HighWater(call)
        summed = 0
        if loss_fn is None or loss_at is None:
            terms = [t for t in output_tensors(output) if t.is_floating_point() and t.requires_grad]
            if not any(t.dim() == 0 for t in terms):
                summed = sum(t.numel() * t.element_size() for t in terms)
            with default_loss:
                try:
                    loss = training_loss(output)
                except ValueError:
                    why = nothing_to_differentiate(output)
                    message = f"a training step has nothing to differentiate: {why}"
                    raise PlanningError(message) from None
        else:
            recorder.backward.nodes.append(loss_at)
            with cost:
                loss = recorder.record(
                    loss_at, functools.partial(_run_loss, loss_fn, output, copies)
                )
        del output
        loss_bytes, seed_bytes = loss.untyped_storage().nbytes(), loss.element_size()
        # A loss_fn's labels, saved for backward, are the user's: replaced there as well.
        labels = _StandIns(copies) if loss_fn is not None else contextlib.nullcontext()
        with _grads_left_alone(loss) as graded:
            # A parameter gets a gradient through its stand-in, or itself where a loss_fn
            # reads the user's own (found by review: 65% over a budget that left its state out).
            reached = {id(leaf) for leaf in graded}
            gradless = frozenset(
                id(p)
                for p in (model or gm).parameters()
                if p.requires_grad
                and id(p) not in reached
                and id(copies.memo.get(id(p))) not in reached
            )
            # Anomaly mode's NaN check reads values, which fake tensors have not. (The mode
            # is process-wide: switched only when on, and only its NaN check.)
            nan_check = (
                torch.autograd.set_detect_anomaly(True, check_nan=False)
                if torch.is_anomaly_enabled()
                else contextlib.nullcontext()
            )
            with recorder.backward, labels, nan_check:
                try:
                    loss.backward()
                except (DynamicOutputShapeException, DataDependentOutputException) as error:
                    raise PlanningError(_backward_failure(error.func)) from error
            recorder.backward.finish()
    produced, read = set(), set()
    for node in [*gm.graph.nodes, *([loss_at] if loss_at is not None else [])]:
        if node.op in COMPUTE_OPS:
            produced.update(require_meta(node, "planner.created"))
            read.update(node.meta["planner.reads"])
    for key in recorder.fixed_casts:
        fixed_kind[key] = "autocast cache"
    for key in read - produced - set(fixed_kind):
        fixed_kind[key] = "constant"  # tensors the graph holds, e.g. lifted by torch.export
    return Profile(
        storage_bytes=dict(storages.nbytes),
        fixed_kind=fixed_kind,
        # A parameter no node reads gets no gradient (an unused head an export keeps).
        trainable=frozenset(trainable & read),
        gradless=gradless,
        output_storages=frozenset(output_keys),
        seconds=time.perf_counter() - start,
        loss=loss_at,
        loss_bytes=loss_bytes,
        default_loss_high=default_loss.high,
        seed_bytes=seed_bytes,
        summed_output_bytes=summed,
        inference_storages=frozenset(inference),
    )


def _target_name(node: fx.Node) -> str:
    """A node's target as a message names it: a function by its name (``iadd``, ``mul``)."""
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))
