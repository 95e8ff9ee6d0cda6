"""The planned module: the rewritten graph, tied to the model it was planned from.

A :class:`PlannedModule` owns the user's own children, parameters and buffers
(``share_user_state``) and saves and loads its root state through the model
(``planner.model_state``), so its ``state_dict`` is the model's. On every call it checks that
it still computes what the model computes (``Snapshot``): in another training mode it runs the
model itself, and when the model's structure changed since planning it refuses. A call that
leaves out a forward argument that was a tensor when planning (``tensor_arguments``), or runs
in other dtypes or under another autocast (``call_dtypes``; both recorded by
``planner.pipeline.prepare``), is a call form of its own, planned when first seen; a call
with larger tensors than then (``call_sizes``) warns once. ``planner.rewrite.rewrite`` builds
it.
"""

from __future__ import annotations

import contextlib
import copy
import dis
import functools
import inspect
import operator
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple, cast

import numpy as np
import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_iter, tree_leaves, tree_unflatten

from planner.errors import PlanningError, checkpointing_disable_advice
from planner.hooks import (
    HOOK_TABLES,
    acting_hooks,
    process_wide_hook_count,
    process_wide_hooks,
    process_wide_hooks_message,
)
from planner.model_call import CALL_KEY
from planner.model_code import (
    ATTRIBUTE_LOADS,
    codes,
    global_loads,
    loaded_attributes,
    method_codes,
)
from planner.model_state import ModelStateDict
from planner.regions import ClosingRegions, autocast_region_open
from planner.step import grad_fn_of, output_tensors
from planner.units import mib

# One call form is planned at a time, in whichever thread first makes that call.
_PLANNING_CALL_FORM = threading.Lock()


def share_user_state(planned: nn.Module, model: nn.Module) -> None:
    """Make ``planned`` own the user's children, parameters and buffers (same objects, same
    order, so that ``state_dict`` keys come out identical); anything only the captured graph
    has (constants, export's guards) follows them."""
    for table in ("_modules", "_parameters", "_buffers"):
        own, users = getattr(planned, table), getattr(model, table)
        merged = {**users, **{k: v for k, v in own.items() if k not in users}}
        own.clear()
        own.update(merged)
    planned._non_persistent_buffers_set |= model._non_persistent_buffers_set
    # Constants torch.export lifted into buffers (``lifted_tensor_0``: a ``torch.tensor(...)``
    # in forward) are the graph's, not the model's state: kept out of ``state_dict``.
    planned._non_persistent_buffers_set |= planned._buffers.keys() - model._buffers.keys()


def tensor_arguments(model: nn.Module, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """Names of ``model.forward``'s arguments that held tensors in the call ``model(*args,
    **kwargs)``: the planned graph computes with them, so a call must pass them again."""
    return tuple(
        name for name, value in _named_arguments(model, args, kwargs) if _holds_tensor(value)
    )


def call_dtypes(
    model: nn.Module, args: tuple, kwargs: dict, *, layouts: bool = False
) -> CallDtypes:
    """The dtypes of the call ``model(*args, **kwargs)``, which the planned graph was captured
    for: a forward may branch on them (``if h.dtype == torch.float16``), and sizes follow them.
    ``layouts``: the tensor arguments' ``_layout`` and the devices of the call too, for a
    capture that bakes in branches on the layouts (torch.export: ``if x.requires_grad``, ``if
    not x.is_contiguous()``) and the devices (``torch.arange(n, device=x.device)``)."""
    named = _named_arguments(model, args, kwargs)
    tensors = [(n, v) for n, v in named if torch.is_tensor(v)]
    tables = _state_tables(model)
    return CallDtypes(
        _state_dtypes(tables),
        {name: value.dtype for name, value in tensors},
        autocast_state(),
        {name: _layout(value) for name, value in tensors} if layouts else {},
        _devices(tables, [v for _, v in named if _holds_tensor(v)]) if layouts else (),
    )


def _devices(tables: list[dict], values: list) -> tuple[torch.device, ...]:
    """The devices of the arguments ``values`` (None where absent; of a container, its first
    tensor: a batch dict of a parameterless model moves too) and of the first parameter or
    buffer, each once, in a fixed order: a model and its inputs move together (the device of
    every parameter would cost about 0.5 us each on every call)."""
    first = next((t for table in tables for t in table.values() if t is not None), None)
    tensors = [v if v is None or torch.is_tensor(v) else _first_tensor(v) for v in values]
    devices = {v.device for v in (*tensors, first) if isinstance(v, torch.Tensor)}
    return tuple(sorted(devices, key=str))


def _first_tensor(value) -> torch.Tensor | None:
    return next((leaf for leaf in tree_iter(value) if isinstance(leaf, torch.Tensor)), None)


def _layout(tensor: torch.Tensor) -> tuple[bool, bool]:
    """Whether ``tensor`` requires grad and is contiguous."""
    return tensor.requires_grad, tensor.is_contiguous()


def call_sizes(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, tuple[torch.Size, ...]]:
    """The shapes of the tensors of each argument of the call ``model(*args, **kwargs)`` that
    holds some, by name: the plan's budget holds up to these sizes."""
    sizes = {name: _shapes(value) for name, value in _named_arguments(model, args, kwargs)}
    return {name: shapes for name, shapes in sizes.items() if shapes}


def call_grads(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, tuple[bool, ...]]:
    """Whether each tensor of each argument of the call ``model(*args, **kwargs)`` requires
    grad, by name (``Snapshot.replays_hold``)."""
    grads = {name: _grads(value) for name, value in _named_arguments(model, args, kwargs)}
    return {name: flags for name, flags in grads.items() if flags}


@torch.compiler.disable  # Dynamo cannot trace ``is_inference``
def _any_inference(args: tuple, kwargs: dict) -> bool:
    """Whether a tensor of the call is an inference tensor (made under inference mode)."""
    return any(torch.is_tensor(t) and t.is_inference() for t in tree_leaves((args, kwargs)))


def _requires_grad(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _grads(value) -> tuple[bool, ...]:
    if isinstance(value, torch.Tensor):
        return (value.requires_grad,)
    return tuple(leaf.requires_grad for leaf in tree_leaves(value) if torch.is_tensor(leaf))


# Whether the planned module's call running on this thread lets its recomputes replay nodes
# (``Snapshot.replays_hold``; read by ``planner.rewrite.Segment.contexts``).
_CALL = threading.local()


def replays_allowed() -> bool:
    return getattr(_CALL, "replays", False)


def _shapes(value) -> tuple[torch.Size, ...]:
    if isinstance(value, torch.Tensor):  # the common case, without a pytree walk
        return (value.shape,)
    return tuple(leaf.shape for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))


def _larger(shapes: tuple[torch.Size, ...], planned: tuple[torch.Size, ...]) -> bool:
    """Whether some dimension of ``shapes`` exceeds the planned one, or, for a tensor of
    another rank (a batch of the unbatched example), its number of elements does (found
    trying the library: a (3, 256, 128) call of a plan for (256, 128) ran 130% over its budget
    without a word)."""
    return shapes != planned and any(  # equal, the common case: one tuple comparison
        any(a > b for a, b in zip(shape, before))
        if len(shape) == len(before)
        else shape.numel() > before.numel()
        for shape, before in zip(shapes, planned)
    )


class CallDtypes(NamedTuple):
    state: tuple[torch.dtype, ...]  # of the parameters and buffers, module by module
    arguments: dict[str, torch.dtype]  # of the arguments that are tensors, by name
    autocast: tuple[tuple[str, torch.dtype | None], ...]  # autocast_state() around the call
    layouts: dict[str, tuple[bool, bool]]  # of the tensor arguments where baked (call_dtypes)
    devices: tuple[torch.device, ...] = ()  # of the call where baked (call_dtypes)


def autocast_state(off_regions: bool = True) -> tuple[tuple[str, torch.dtype | None], ...]:
    """``(device type, dtype)`` of each autocast in force: a graph captured by torch.export
    bakes in the casts (and checks the dtypes) of the autocast it was captured under, and a
    step's memory follows its precision. With ``off_regions``, ``("off", None)`` where only
    regions turned off are open: the weight casts of forward's own autocast regions then
    outlive the step (``planner.regions.autocast_region_open``; found by a tester: 6% over a
    budget planned outside such a region)."""
    state = tuple(
        [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    )
    if (
        off_regions
        and not state
        and not torch.compiler.is_compiling()
        # Not in backward: the recompute of a checkpoint around the call (the user's own)
        # enters regions turned off for its own reasons (found by review: a recompute called
        # the planned module as a new call form, which raised).
        and torch._C._current_graph_task_id() == -1
        and autocast_region_open()
    ):
        return (("off", None),)
    return state


def _named_arguments(model: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, object]]:
    """``(name, value)`` of each argument of the call, those of ``**kwargs`` by their own
    names; ``*args`` left out (no name to call them by). Empty where the call does not bind."""
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return []  # capture reports the mismatch
    named: list[tuple[str, object]] = []
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            named += value.items()
        elif kind != inspect.Parameter.VAR_POSITIONAL:
            named.append((name, value))
    return named


def _state_tables(model: nn.Module) -> list[dict]:
    # Empty ones too: a buffer added to a module that had none (torch.nn.utils.prune's mask on
    # a Linear) is a change of the step (found trying the library: 27% over the budget).
    return [t for m in model.modules() for t in (m._parameters, m._buffers)]


def _state_dtypes(tables: list[dict]) -> tuple[torch.dtype, ...]:
    # A plain comprehension: it runs on every call, and torch.compile traces it.
    return tuple([t.dtype for table in tables for t in table.values() if t is not None])


def _holds_tensor(value) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))


def argument_positions(planned: fx.GraphModule, names) -> tuple[tuple[str, int | None], ...]:
    """``(name, position)`` of each argument in ``names`` in the planned forward's signature
    (``None``: keyword only)."""
    positional = [
        p.name
        for p in inspect.signature(planned.forward).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return tuple((n, positional.index(n) if n in positional else None) for n in names)


_SCALARS = (bool, int, float, str, type(None))
# numpy's scalars (``np.float32(0.5)``, a schedule's ``np.cos(...)``): tracing bakes them in as
# it does Python's, and they are compared by value and type (``_Held``).
_NUMPY_SCALARS = (np.bool_, np.number)
_CONTAINER_ITEMS = 64  # longer lists and dicts are not compared (see _is_plain_container)
# What every module holds privately for torch itself (``_is_full_backward_hook``...): never the
# model's own values, whatever its code names.
_TORCH_BOOKKEEPING = frozenset(vars(nn.Module()))


def _is_scalar(value) -> bool:
    return _is_plain(value) or (type(value) is tuple and all(map(_is_plain, value)))


def _is_plain_container(value) -> bool:
    """A short list, or dict, of scalars: state a forward may branch on, changed in place by a
    library's methods (PEFT's ``merged_adapters`` list, the ``scaling`` dict of a LoRA layer,
    found by a tester: ``merge_adapter()`` after planning applied the adapter twice)."""
    if type(value) is list:
        return len(value) <= _CONTAINER_ITEMS and all(map(_is_scalar, value))
    if type(value) is dict:
        return len(value) <= _CONTAINER_ITEMS and all(
            _is_plain(k) and _is_scalar(v) for k, v in value.items()
        )
    return False


def _is_plain(value) -> bool:
    return type(value) in _SCALARS or isinstance(value, _NUMPY_SCALARS)


def _holds_numpy(value) -> bool:
    return isinstance(value, _NUMPY_SCALARS) or (
        type(value) is tuple and any(isinstance(v, _NUMPY_SCALARS) for v in value)
    )


def _is_module_globals(space: dict) -> bool:
    """Whether ``space`` is a Python module's globals (``Snapshot.attributes`` compares some)."""
    module = sys.modules.get(space.get("__name__", ""))
    return module is not None and vars(module) is space


def _same_settings(then, now) -> bool:
    """Whether the list or dict of scalars ``then`` (``_is_plain_container``) holds in ``now``:
    every entry it had, unchanged (``_same``), and none added but values that are no scalars
    (tensors: a cache an eval-mode forward fills, found by review)."""
    if type(now) is not type(then) or len(now) < len(then):
        return False
    if type(then) is dict:
        added = [now[k] for k in now.keys() - then.keys()]
        return all(k in now and _same(v, now[k]) for k, v in then.items()) and not any(
            map(_is_scalar, added)
        )
    return all(map(_same, then, now)) and not any(map(_is_scalar, now[len(then) :]))


def _same(then, now) -> bool:
    """Whether ``now`` is the value ``then`` was, of the same type: ``np.float32(0.5)`` is not
    ``0.5``, nor ``np.float64(0.5)`` (arithmetic with them promotes differently)."""
    if then is now:
        return True
    if type(then) is not type(now):
        return False
    if type(then) is tuple:
        return len(then) == len(now) and all(map(_same, then, now))
    return bool(then == now)


class _Held:
    """A value at planning that the per-call check compares with ``==`` standing on the left,
    so that its own rule decides: ``_same`` for numpy's scalars (they equal Python's numbers of
    the same value), identity for a tensor (whose ``==`` compares elements)."""

    __slots__ = ("equal", "value")

    def __init__(self, value, equal: Callable[[object, object], bool]):
        self.value, self.equal = value, equal

    def __eq__(self, other) -> bool:
        return self.equal(self.value, other)

    def __ne__(self, other) -> bool:
        return not self.equal(self.value, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return _shown(self.value)


def _still(then, now) -> bool:
    """Whether ``now`` is what ``then`` (a ``_reference``) stands for, by its rule called
    directly: Dynamo does not trace ``_Held.__eq__`` against a numpy scalar."""
    return then.equal(then.value, now) if isinstance(then, _Held) else then == now


def _reference(value):
    """What the per-call check compares ``value`` with (``_Held`` for a tensor and numpy's
    scalars, else the value itself)."""
    if isinstance(value, torch.Tensor) or _is_callable_object(value):
        return _Held(value, operator.is_)
    if _is_plain_container(value):  # a copy: a library changes the object in place
        return _Held(copy.copy(value), _same_settings)
    return _Held(value, _same) if _holds_numpy(value) else value


_BY_IDENTITY = (torch.Generator, torch.Tensor)


def _is_callable_object(value) -> bool:
    """A function or callable object held as a plain attribute, which the traced forward
    called and the graph inlined: diffusers' attention ``processor``, an ``activation``
    function (found by a tester: ``unet.set_attn_processor(...)`` after planning was ignored).
    Compared by identity."""
    return callable(value) and not isinstance(value, (nn.Module, torch.Tensor))


def _compared(module: nn.Module, key: str, value, names: _Names) -> bool:
    """Whether the attribute ``key`` of ``module`` is compared on every call: a scalar, a short
    list or dict of scalars (by contents), or (by identity) a callable (``_is_callable_object``),
    a ``torch.Generator`` or a tensor that is neither a parameter nor a buffer (``self.tau =
    torch.tensor(0.5)`` replaced: the graph holds the old one; reseeding or updating it in
    place is followed). Public ones where
    the module's code names them (``names.mentioned``); private ones (``self._tau`` behind a
    property; not what torch keeps on every module or on its own modules) and tensors only
    where the code a call runs reads them (``names.loaded``, within ``mentioned``)."""
    if key in ("training", "forward") or key not in names.mentioned:
        return False  # most attributes, by the cheapest test first (forward: forward_dicts)
    if not (
        _is_scalar(value)
        or _is_plain_container(value)
        or isinstance(value, _BY_IDENTITY)
        or _is_callable_object(value)
    ):
        return False
    if key.startswith("_") and (key in _TORCH_BOOKKEEPING or _torch_own(type(module))):
        return False
    return key in names.loaded or not (key.startswith("_") or isinstance(value, torch.Tensor))


def _torch_own(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "torch"


@functools.cache
def _names_read(cls: type) -> _Names:
    """The attributes the traced forward of a ``cls`` module could have read. ``mentioned``:
    every name its methods (``method_codes``, ``__init__`` included) and the helpers a call
    runs mention, for public scalars, which a library's function handed the module may read
    (transformers' attention reads ``module.is_causal``); others (``model.global_step``) may
    change freely. ``loaded``: those the code a call runs reads (``loaded_attributes``), for
    private ones and tensors, which a forward may keep for itself (``self._last = out``).
    What ``set_extra_state`` restores from a checkpoint counts only where loaded (found by a
    tester: a step counter resumed from a checkpoint was refused as a change)."""
    mentioned: set[str] = set()
    for code in (*method_codes(cls), *(code for code, _ in codes(cls))):
        mentioned.update(code.co_names)
        mentioned.update(c for c in code.co_consts if isinstance(c, str))  # getattr(self, "x")
    loaded = loaded_attributes(cls)
    restored = {
        i.argval
        for klass in cls.__mro__
        if callable(vars(klass).get("set_extra_state"))
        for i in dis.get_instructions(vars(klass)["set_extra_state"])
        if i.opname == "STORE_ATTR"
    }
    return _Names(frozenset(mentioned - (restored - loaded)), loaded)


@functools.cache
def _own_mentions(cls: type) -> frozenset[str]:
    """The names the methods ``cls`` itself defines mention (its bases' left out), but those
    its ``forward`` only sets: a setter (``set_temperature``) names a setting, a forward that
    stores a value without reading it keeps a memo (found by review: an eval-only statistic
    was refused)."""
    mentioned: set[str] = set()
    for key, value in vars(cls).items():
        value = value.fget if isinstance(value, property) else value
        code = getattr(getattr(value, "__func__", value), "__code__", None)
        if code is None:
            continue
        if key == "forward":
            loads = dis.get_instructions(code)
            mentioned.update(i.argval for i in loads if i.opname in ATTRIBUTE_LOADS)
        else:
            mentioned.update(code.co_names)
        mentioned.update(c for c in code.co_consts if isinstance(c, str))
    return frozenset(mentioned)


class _Names(NamedTuple):
    mentioned: frozenset[str]
    loaded: frozenset[str]


@functools.cache
def _read_outside(cls: type) -> tuple[tuple[str, ...], tuple[tuple[dict, str], ...]]:
    """The plain values (``_SCALARS``, numpy's) that the methods of ``cls`` read and that live
    outside its instances, which tracing bakes in just as an instance's own: keys of its
    classes' bodies (``scale = 1.0``, a private default ``_tau = 1.0`` that a property reads;
    torch's own classes' private ones left out) it names, and ``(globals, key)`` of the public
    globals it loads as globals (``USE_GELU = True``; not attributes: a training script's
    ``step`` counter is no concern of a model whose code reads ``self.step``). A library's
    private module state (transformers' ``_is_ds_init_called``) is left out."""
    classes = [k for k in cls.__mro__ if k not in (nn.Module, object)]
    in_body = {
        k
        for klass in classes
        for k, v in vars(klass).items()
        if _is_scalar(v) and not (k.startswith("_") and (_torch_own(klass) or k.startswith("__")))
    }
    read = sorted(k for k in in_body & _names_read(cls).mentioned if k not in _TORCH_BOOKKEEPING)
    in_globals = [
        (space, key)
        for space, key in global_loads(cls)
        if not key.startswith("_") and _is_scalar(space.get(key, []))
    ]
    return tuple(k for k in read if k != "training"), tuple(in_globals)


def _attribute_change(name: str, then, now) -> str:
    if isinstance(then, _Held) and isinstance(then.value, torch.Tensor):
        return (
            f"{name}, a tensor that is neither a parameter nor a buffer, was replaced (the "
            "graph reads the one held at planning: update it in place, or register it as a "
            "buffer, which the graph reads through the module)"
        )
    if isinstance(then, _Held) and _is_callable_object(then.value):
        was, new = _described(then.value), _described(now)
        if was == new:  # another instance of the same class
            new = f"another {new.removeprefix('an ')}"
        return f"{name} was replaced ({was} at planning, now {new}; the graph calls the former)"
    if isinstance(then, torch.Generator) and isinstance(now, torch.Generator):
        return (
            f"{name} was replaced by another torch.Generator (the graph draws from the one "
            "held at planning; reseeding that one in place is fine)"
        )
    if isinstance(then, torch.Generator):
        return f"{name} changed from a torch.Generator to {_shown(now)}"
    return f"{name} changed from {then!r} to {_shown(now)}"


def _shown(value) -> str:
    return "a tensor" if isinstance(value, torch.Tensor) else repr(value)


def _described(value) -> str:
    """A function by its name (``tanh``), another callable by its class (a processor)."""
    if inspect.isroutine(value):  # read on the type: an object's own __getattr__ may raise
        name = getattr(value, "__name__", None)  # (found by review: a KeyError)
        if isinstance(name, str):
            return name
    return f"an instance of {type(value).__qualname__}"


class Snapshot:
    """What the planned graph was traced from, compared with the model on every call.

    Tracing bakes into the graph the modules it traced through, the plain attributes their
    forward read (``self.scale``, ``self.heads``...) and every module's ``training`` flag. The
    modules the graph calls (``call_module`` nodes) read their own attributes and children when
    they run, so they are compared by identity, and by the attributes of theirs that their
    traced parent's code names (``self.drop.p``). Parameters and buffers are read through
    the modules when the graph runs, so they may be replaced (``.double()``, FSDP2's sharding).
    """

    def __init__(
        self,
        model: nn.Module,
        called: set[str],
        tensor_arguments,
        dtypes: CallDtypes | None,
        sizes: dict[str, tuple[torch.Size, ...]] | None = None,
        checkpoints: bool = False,
        reads_grad_mode: bool = False,
        grads: dict[str, tuple[bool, ...]] | None = None,
        replays: bool = False,
        graph_reads: set[str] | None = None,
        autocast_regions: bool = False,
        opens_regions: bool = False,
    ):
        self.model = model
        # Whether forward enters autocast regions, whose casts a region around the call keeps.
        self.autocast_regions = autocast_regions
        self.opens_regions = opens_regions  # any region (grad mode, autocast): see _checked_call
        self.checkpoints = checkpoints  # whether the graph runs checkpointed segments
        self.replays = replays and grads is not None  # whether its recomputes replay nodes
        self.graph_tensors: list[Callable] = []  # see remember_graph_tensors
        self.graph_tensor_grads: list[bool] = []
        # What each tensor argument's tensors required at planning (``call_grads``).
        self.argument_grads = [(grads or {}).get(name, ()) for name, _ in tensor_arguments]
        self.reads_grad_mode = reads_grad_mode  # forward called torch.is_grad_enabled()
        self.warned_hooks = False
        self.warned_vmap = False
        self.module_names = [name for name, _ in model.named_modules()]
        self.module_dicts = [m.__dict__ for _, m in model.named_modules()]
        self.flags = self.training_flags()
        inside_called = {
            id(sub)
            for name, module in model.named_modules()
            if name in called
            for sub in module.modules()
        }
        traced = [(name, m) for name, m in model.named_modules() if id(m) not in inside_called]
        # Flat lists, compared with map() on every call: a few microseconds per hundred modules.
        self.names = [name for name, _ in traced]
        self.children = [m._modules for _, m in traced]
        self.sizes = list(map(len, self.children))
        self.child_dicts = [c for c in self.children for _ in c]
        self.child_keys = [k for c in self.children for k in c]
        self.child_values = [v for c in self.children for v in c.values()]
        # The attributes a traced module's code may have read: its own, and those of the
        # modules below it that the graph calls (``dropout_p=self.drop.p`` beside
        # ``self.drop(x)``: the graph holds the number, where the called module reads its own
        # when it runs).
        read = [
            (name, m, _names_read(type(m)))  # type: ignore[arg-type]  # a class is hashable
            for name, m in traced
        ]
        # What a traced module's added attributes are compared by (``_attributes_added``),
        # worked out here: not under Dynamo, which cannot trace reading code.
        self.traced_names = [names for _, _, names in read]
        self.traced_watched = [
            names.loaded | _own_mentions(type(m))  # type: ignore[arg-type]  # hashable
            for (_, m, names) in read
        ]
        owners = read + [
            (f"{name}.{below}".lstrip("."), sub, names)
            for name, m, names in read
            for below, sub in m.named_modules()
            if id(sub) in inside_called
        ]
        self.attributes = [
            (f"{name}.{key}".lstrip("."), m.__dict__, key, _reference(value))
            for name, m, names in owners
            for key, value in vars(m).items()
            if _compared(m, key, value, names)
            # a called module calls its own callables (a leaf's attention processor, found by
            # review), unless the traced parent's call reads one (``self.leaf.act(...)``: the
            # graph holds that call)
            and not (
                id(m) in inside_called and _is_callable_object(value) and key not in names.loaded
            )
        ]
        # Values read from classes and module globals: a class's (``B.scale = 2.0``, or one
        # instance's ``block.scale = 2.0`` over it) compared through getattr, a global's in
        # its module's dict.
        outside = [(name, m, _read_outside(type(m))) for name, m, _ in owners]  # type: ignore[arg-type]
        self.class_attributes = [
            (f"{name}.{key}".lstrip("."), m, key, _reference(getattr(m, key)))
            for name, m, (keys, _) in outside
            for key in keys
        ]
        globals_read = {
            (id(space), key): (
                f"{space.get('__name__', '?')}.{key}",
                space,
                key,
                _reference(space[key]),
            )
            for _, _, (_, pairs) in outside
            for space, key in pairs
        }
        self.attributes += globals_read.values()
        # The forward a call of each traced module would run, by identity: its own
        # (``block.forward = ...`` on the instance: a patch, an adapter), else its class's
        # (``Block.forward = ...``, or another class). The graph holds the one traced. Read as
        # entries of dicts and attributes of classes: torch.compile traces that, and no bound
        # method is made on every call.
        self.forward_owners = [m for _, m in traced]
        self.forward_dicts = [m.__dict__ for _, m in traced]
        self.forward_keys = ["forward"] * len(traced)
        self.own_forwards = [m.__dict__.get("forward") for _, m in traced]
        self.class_forwards = [type(m).forward for _, m in traced]
        # The attributes each traced module held at planning: one its code names, set since
        # (FreeU's ``s1`` on diffusers' up blocks, read as ``getattr(self, "s1", None)``:
        # ``enable_freeu()`` after planning was ignored, found by a tester), changes the graph.
        self.traced_sizes = list(map(len, self.forward_dicts))
        self.traced_keys = [frozenset(d) for d in self.forward_dicts]
        # Hooks on a module the graph traced through would never run (the graph inlined it).
        # Hooks that never act on it (transformers' output recorders) are counted apart. A
        # container without a forward (``nn.ModuleList``) runs none in the model either.
        hooks = [
            (name, getattr(m, t))
            for name, m in traced
            if type(m).forward is not nn.Module.forward or "forward" in m.__dict__
            for t in HOOK_TABLES
            if hasattr(m, t)
        ]
        self.hook_owners = [name for name, _ in hooks]
        self.hook_dicts = [table for _, table in hooks]
        self.hook_counts = list(map(len, self.hook_dicts))  # as last checked: the quick test
        self.acting_hook_counts = list(map(acting_hooks, self.hook_dicts))
        # Where each parameter is held, read on every call: load_state_dict(assign=True) and
        # assignments (``layer.weight = nn.Parameter(...)``) put new objects there.
        slots = [name.rpartition(".") for name, _ in model.named_parameters()]
        self.parameter_dicts = [model.get_submodule(path)._parameters for path, _, _ in slots]
        self.parameter_keys = [key for _, _, key in slots]
        self.trainable = [p.requires_grad for p in self.parameters()]
        self.trainable_unchanged = True  # as of the last call (check_unchanged)
        self.warned_trainable = False
        # Slots sharing one parameter at planning (tied embeddings): one gradient between them.
        shared: dict[int, list[tuple[dict, str]]] = {}
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            path, _, key = name.rpartition(".")
            shared.setdefault(id(p), []).append((model.get_submodule(path)._parameters, key))
            names.setdefault(id(p), []).append(name)
        self.tied = [slots for slots in shared.values() if len(slots) > 1]
        self.warned_untied = False
        # Groups the graph reads as attributes: by one name for all their uses (torch.export;
        # symbolic_trace names a parameter read directly by the first module holding it), so
        # that, untied, it would compute with one tensor in the place of each.
        self.tied_names = [names[i] for i, slots in shared.items() if len(slots) > 1]
        self.read_as_one = [
            graph_reads is not None and not graph_reads.isdisjoint(group)
            for group in self.tied_names
        ]
        # Whether the plan counts gradients as held from the start of the step (plan_batch's
        # accumulation windows); a plan that counts them from backward on warns once when a
        # call starts with gradients held.
        self.gradients_held = False
        self.warned_gradients = False
        self.optimizer: weakref.ref[torch.optim.Optimizer] | None = None  # watch_optimizer
        self.optimizer_parameters = 0
        self.warned_optimizer = False
        self.earlier_calls: list[weakref.ref[_CallGraph]] = []  # the last call's graph, if any
        self.warned_two_forwards = False
        self.attribute_dicts = [a[1] for a in self.attributes]
        self.attribute_keys = [a[2] for a in self.attributes]
        self.attribute_values = [a[3] for a in self.attributes]
        self.class_owners = [a[1] for a in self.class_attributes]
        self.class_keys = [a[2] for a in self.class_attributes]
        self.class_values = [a[3] for a in self.class_attributes]
        self.tensor_arguments = tensor_arguments
        self.state_tables = _state_tables(model)
        if dtypes is None:  # a graph captured elsewhere: the model's dtypes now
            dtypes = CallDtypes(_state_dtypes(self.state_tables), {}, autocast_state(), {})
        self.state_dtypes = dtypes.state
        self.autocast = dtypes.autocast
        if not autocast_regions:  # a region turned off around the call changes nothing
            self.autocast = tuple(a for a in dtypes.autocast if a[1] is not None)
        self.argument_dtypes = tuple(dtypes.arguments.get(name) for name, _ in tensor_arguments)
        self.argument_layouts = tuple(dtypes.layouts.get(name) for name, _ in tensor_arguments)
        self.layouts_baked = bool(dtypes.layouts)
        self.devices = dtypes.devices
        # The shapes of each tensor argument's tensors at planning (``call_sizes``).
        self.argument_sizes = [(sizes or {}).get(name, ()) for name, _ in tensor_arguments]
        self.warned_larger = False
        # The model's root parameters and buffers as the planned module last took them: an
        # entry of the planned module's own that differs was swapped there since, without
        # __setattr__ (torch.func.functional_call), and wins for that call.
        self.synced = {t: dict(getattr(model, t)) for t in ("_parameters", "_buffers")}
        self.warned: set[tuple[bool, ...]] = set()  # training flags run_model warned of
        self.warned_forms: set[CallForm] = set()
        # ``plan_call(args, example_kwargs=kwargs)`` plans another call form with the options of
        # the planning call (set by ``planner.pipeline.plan``; None for loaded plans).
        self.plan_call: Callable | None = None
        self.call_forms: dict[CallForm, nn.Module | None] = {}

    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters now, in the order they had at planning."""
        now = map(dict.get, self.parameter_dicts, self.parameter_keys)
        return [p for p in now if p is not None]

    def training_flags(self) -> list[bool]:
        # A plain loop, not map(itemgetter): torch.compile traces this on every call.
        return [d["training"] for d in self.module_dicts]

    def mode_changed(self) -> bool:
        return self.training_flags() != self.flags

    def check_unchanged(self, planned_name: str) -> None:
        """Raise a PlanningError when a module or attribute the graph was traced from changed."""
        self.trainable_unchanged = [p.requires_grad for p in self.parameters()] == self.trainable
        if not self.trainable_unchanged:
            self._warn_trainable()
        if self.tied and (not self.warned_untied or any(self.read_as_one)):
            self._check_untied(planned_name)
        # Planning refused every process-wide hook that acts: any now came after it.
        if process_wide_hook_count() and process_wide_hooks():
            raise PlanningError(process_wide_hooks_message(f"after planning {planned_name}"))
        if self._unchanged():
            return
        acting = list(map(acting_hooks, self.hook_dicts))
        hooked = sorted(
            {
                name or "the model"
                for name, now, count in zip(self.hook_owners, acting, self.acting_hook_counts)
                if now != count
            }
        )
        if not hooked:  # hooks that never act came or went: count them as they are now
            self.hook_counts = list(map(len, self.hook_dicts))
            if self._unchanged():
                return
        if hooked and getattr(self.model, "is_gradient_checkpointing", False):
            raise PlanningError(
                f"gradient checkpointing was enabled on {type(self.model).__name__} after "
                "planning (model.gradient_checkpointing_enable() hooks the model, and the "
                f"graph traced through it). The plan already chooses what {planned_name} "
                f"recomputes: {checkpointing_disable_advice(self.model)} to train with the "
                "plan, or train the model itself with its own checkpointing."
            )
        if hooked:
            raise PlanningError(
                f"hooks were added to or removed from {', '.join(hooked[:4])} of "
                f"{type(self.model).__name__} after planning. The graph traced through "
                f"{'them' if len(hooked) > 1 else 'it'}, so {planned_name} would not run "
                "those hooks. Remove them, or keep the modules whole with leaf_modules=(...) "
                "and plan again (hooks on leaf modules run)."
            )
        added = self._attributes_added()
        settings = [a for a in added if not (_is_plain(a[3]) and not a[3])]
        if not settings and list(map(len, self.forward_dicts)) != self.traced_sizes:
            # Attributes the graph cannot have read came or went: take them as they are now.
            # One it read as absent, now None, False or 0 (``getattr(self, "s1", None)``;
            # transformers' ``gradient_checkpointing = False`` once its checkpointing is off),
            # is compared from now on (found by review: FreeU disabled, then enabled again).
            for name, d, key, value in added:
                self.attributes.append((name, d, key, _reference(value)))
                self.attribute_dicts.append(d)
                self.attribute_keys.append(key)
                self.attribute_values.append(_reference(value))
            self.traced_sizes = list(map(len, self.forward_dicts))
            self.traced_keys = [frozenset(d) for d in self.forward_dicts]
            if self._unchanged():
                return
        before: dict[int, dict] = {}
        for d, k, v in zip(self.child_dicts, self.child_keys, self.child_values):
            before.setdefault(id(d), {})[k] = v
        changes = (
            [
                f"{name} was set to {_described(v) if _is_callable_object(v) else _shown(v)}"
                for name, _, _, v in settings
            ]
            + [
                _module_change(name, before.get(id(now), {}), now)
                for name, now in zip(self.names, self.children)
                if before.get(id(now), {}) != now
            ]
            + [
                f"the forward of {name or 'the model'} was replaced"
                for name, m, own, of_class in zip(
                    self.names, self.forward_owners, self.own_forwards, self.class_forwards
                )
                if vars(m).get("forward") != own or type(m).forward != of_class
            ]
            + [
                _attribute_change(name, value, d.get(key))
                for name, d, key, value in self.attributes
                if not _still(value, d.get(key))
            ]
            + [
                _attribute_change(name, value, getattr(m, key))
                for name, m, key, value in self.class_attributes
                if not _still(value, getattr(m, key))
            ]
        )
        raise PlanningError(
            f"{type(self.model).__name__} changed after planning: {'; '.join(changes[:4])}"
            f"{'; ...' if len(changes) > 4 else ''}. {planned_name} runs the graph traced "
            "before the change and would compute something else. Plan again "
            "(planner.plan(model, ...), or planner.load(path, model) for a saved plan)."
        )

    def _unchanged(self) -> bool:
        return (
            list(map(len, self.children)) == self.sizes
            and list(map(dict.get, self.child_dicts, self.child_keys)) == self.child_values
            # The values at planning on the left: their ``__eq__`` decides (``_Held``).
            and self.attribute_values
            == list(map(dict.get, self.attribute_dicts, self.attribute_keys))
            and list(map(len, self.hook_dicts)) == self.hook_counts
            and list(map(len, self.forward_dicts)) == self.traced_sizes
            and self.class_values == list(map(getattr, self.class_owners, self.class_keys))
            and list(map(dict.get, self.forward_dicts, self.forward_keys)) == self.own_forwards
            and list(map(getattr, map(type, self.forward_owners), self.forward_keys))
            == self.class_forwards
        )

    def _attributes_added(self) -> list[tuple[str, dict, str, object]]:
        """``(name, dict, key, value)`` of what was set since planning on a traced module, of
        the public attributes that the code a call runs reads or the module's own class names
        (a setter beside a library's helper reading it; not what only a library's base classes
        name, ``model.name`` or ``model.tokenizer`` on a transformers model, found by review)
        and that the per-call check compares (``_compared``): the graph was traced without
        them. Private ones are a library's bookkeeping (transformers sets
        ``_output_capturing_hooks_installed`` at its first call asking for attentions)."""
        return [
            (f"{name}.{key}".lstrip("."), d, key, v)
            for name, m, d, keys, names, watched in zip(
                self.names,
                self.forward_owners,
                self.forward_dicts,
                self.traced_keys,
                self.traced_names,
                self.traced_watched,
            )
            for key, v in d.items()
            if key not in keys
            and not key.startswith("_")
            and key in watched
            and _compared(m, key, v, names)
        ]

    def _check_untied(self, planned_name: str) -> None:
        """Parameters tied at planning (an embedding and the output head) no longer are: a
        PlanningError where the graph reads them by one name, which would compute with one of
        them in the place of all; else a warning, once, that the step holds one more parameter
        and its gradient than the plan counts."""
        now = [
            {id(p): p for p in (d.get(k) for d, k in slots) if p is not None} for slots in self.tied
        ]
        for distinct, names, as_one in zip(now, self.tied_names, self.read_as_one):
            if as_one and len(distinct) > 1:
                raise PlanningError(
                    f"parameters of {type(self.model).__name__} tied at planning are no longer "
                    f"shared ({', '.join(names)}: untied since). The captured graph reads them "
                    "by one name (torch.export keeps one name for tied parameters, and "
                    "symbolic_trace names a parameter read directly by the first module "
                    f"holding it), so {planned_name} would compute with one of them in the "
                    "place of each. Plan again after untying."
                )
        if self.warned_untied or all(len(distinct) <= 1 for distinct in now):
            return
        self.warned_untied = True
        # Each parameter beyond the first of a group: its bytes, and as many for its gradient.
        extra = sum(2 * p.nbytes for distinct in now for p in list(distinct.values())[1:])
        warnings.warn(
            f"parameters of {type(self.model).__name__} tied at planning are no longer shared "
            f"(untied since): each now has a gradient of its own, and the step holds about "
            f"{mib(extra)} more than the plan counts (parameters and gradients), so its "
            "memory prediction no longer holds (gradients stay exact). Plan again after "
            "untying.",
            stacklevel=_callers_stacklevel(),
        )

    def _warn_trainable(self) -> None:
        """Once: the plan was made for other trainable parameters (staged fine-tuning): frozen
        parts save nothing for backward, so its memory no longer holds. Gradients stay exact."""
        if self.warned_trainable:
            return
        self.warned_trainable = True
        parameters = self.parameters()
        now = sum(p.requires_grad for p in parameters)
        if len(parameters) != len(self.trainable):
            what = (
                f"were removed from where they were at planning ({len(self.trainable)} then, "
                f"{len(parameters)} there now, {now} requiring grad; torch.nn.utils.prune and "
                "parametrizations move a weight)"
            )
        else:
            what = (
                "were frozen or unfrozen after planning, or replaced by tensors that differ in "
                f"requires_grad ({sum(self.trainable)} of {len(self.trainable)} required grad "
                f"then, {now} now)"
            )
        warnings.warn(
            f"parameters of {type(self.model).__name__} {what}: the plan's memory prediction "
            "was made for the others and no longer holds (gradients stay exact). Plan again "
            "after changing which parameters train.",
            stacklevel=_callers_stacklevel(),
        )

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember how many parameters ``optimizer``, the instance the plan counted, trains:
        one added later (``add_param_group``, staged fine-tuning) holds state the plan left
        out (found by a tester: 36% over the budget without a word)."""
        self.optimizer = weakref.ref(optimizer)
        self.optimizer_parameters = _trained_by(optimizer)

    def warn_if_optimizer_grew(self) -> None:
        """Once: a call after the optimizer the plan counted was given more parameters."""
        if self.optimizer is None or self.warned_optimizer or torch.compiler.is_compiling():
            return
        optimizer = self.optimizer()
        if optimizer is None or _trained_by(optimizer) <= self.optimizer_parameters:
            return
        self.warned_optimizer = True
        warnings.warn(
            f"the optimizer planner counted for the planned {type(self.model).__name__} trains "
            f"{_trained_by(optimizer)} parameters now, {self.optimizer_parameters} at planning "
            "(add_param_group): the state of the ones added is not in the plan, and the step "
            "can exceed the budget by its size. Plan again with the optimizer as it trains "
            "now.",
            UserWarning,
            stacklevel=_callers_stacklevel(),
        )

    def warn_if_gradients_held(self, args: tuple, kwargs: dict) -> None:
        """Once: a call with gradients starts while parameters or tensor arguments hold
        ``.grad`` (zeroed in place by ``zero_grad(set_to_none=False)``, accumulated by a
        hand-written loop, an input's kept from the last step), which the plan counts from
        backward on: the step holds about their size more than the budget."""
        if (
            self.gradients_held
            or self.warned_gradients
            or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()
        ):
            return
        arguments = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        # Others have no .grad: tensors computed from others, and the non-leaf tensors that
        # torch.func.functional_call puts in place of parameters during the call.
        leaves = [t for t in self.parameters() + arguments if t.is_leaf]
        held = sum(_gradient_bytes(t.grad) for t in leaves if t.grad is not None)
        if not held:
            return
        self.warned_gradients = True
        warnings.warn(
            f"the planned {type(self.model).__name__} is called while its parameters or "
            f"tensor arguments hold gradients ({mib(held)}, {held} bytes): the plan counts "
            "gradients from backward on, as a step that starts with .grad None makes them, so "
            "this step can exceed the budget by about their size. Free them before each step "
            "(optimizer.zero_grad(set_to_none=True), the default; x.grad = None for an input), "
            "or plan gradient accumulation with planner.plan_batch, which counts them from the "
            "start.",
            UserWarning,
            stacklevel=_callers_stacklevel(),
        )

    # Never compiled: called eagerly only, where Dynamo may still compile the frames an
    # eager frame calls (after a frame of the planned module fell back to eager).
    @torch.compiler.disable
    def warn_if_earlier_graph_waits(self) -> None:
        """Once: a call with gradients starts while the graph of an earlier call lives on and
        its backward has not begun (two forwards before one backward: contrastive pairs, a
        discriminator's real and fake batches; found trying the library, 74% over the
        budget without a word). Each call holds its own activations until its backward."""
        # Only the last call can wait: an earlier one was dead or reached when the last began.
        waiting = any((c := ref()) is not None and not c.reached for ref in self.earlier_calls)
        self.earlier_calls = []
        if not waiting:
            return
        self.warned_two_forwards = True  # nothing more to watch (a cell called 10,000 times)
        warnings.warn(
            f"the planned {type(self.model).__name__} is called while the graph of an earlier "
            "call (this thread's or another's) waits for its backward: each call holds its "
            "activations until its backward runs, and the plan counts one call's, so memory "
            "holds about one more call's than the budget. Concatenate the inputs into one "
            "call (plan at that size), or run backward between the calls.",
            UserWarning,
            stacklevel=_callers_stacklevel(),
        )

    @torch.compiler.disable  # as above
    def note_graph(self, output) -> None:
        """Remember the call that made ``output`` until backward reaches it or its graph dies
        (``warn_if_earlier_graph_waits``)."""
        if self.warned_two_forwards:
            return
        # output_tensors, not tree_leaves: a dataclass output is no pytree (found by a tester)
        functions = {grad_fn_of(t) for t in output_tensors(output)} - {None}
        if not functions:
            return
        call = _CallGraph()
        for grad_fn in functions:
            cast(dict, grad_fn.metadata)[_CallGraph] = call  # lives as long as the graph
            grad_fn.register_prehook(call.reach)
        self.earlier_calls.append(weakref.ref(call))

    def warn_if_saved_tensor_hooks(self) -> None:
        """Once: saved-tensor hooks around the call (activation compression) see only the
        tensors saved outside checkpointed segments, as checkpoint installs its own inside and
        recomputes those. Lossless ones (``save_on_cpu``) leave gradients as the model's;
        others give other gradients than the model under the same hooks."""
        if not self.checkpoints or self.warned_hooks or torch.compiler.is_compiling():
            return
        hooks = _top_saved_tensor_hooks()()
        # torch's own (save_on_cpu, an enclosing torch.utils.checkpoint) change nothing saved
        if hooks is None or getattr(hooks[0], "__module__", "").startswith("torch."):
            return
        self.warned_hooks = True
        warnings.warn(
            f"the planned {type(self.model).__name__} is called under saved-tensor hooks "
            f"({getattr(hooks[0], '__qualname__', hooks[0])}): the tensors its checkpointed "
            "segments save are recomputed in backward and never reach them. Hooks that change "
            "what they save (compression, quantisation) then give other gradients than the "
            "model under the same hooks; lossless ones (offloading, save_on_cpu) do not.",
            UserWarning,
            stacklevel=_callers_stacklevel(),
        )

    def warn_vmapped(self) -> None:
        """Once: under ``torch.func.vmap`` with gradients, the model runs itself. A checkpoint
        saves vmap's batched tensors, which backward, after vmap returned, cannot recompute
        from ("may have escaped from inside a function being vmapped")."""
        if self.warned_vmap:
            return
        self.warned_vmap = True
        warnings.warn(
            f"the planned {type(self.model).__name__} is called under torch.func.vmap with "
            "gradients enabled: its checkpointed segments could not be recomputed in backward "
            "once vmap returned, so the model itself runs (exact, memory not reduced). Plan "
            "the model for the batched inputs and call it without vmap to checkpoint.",
            UserWarning,
            stacklevel=_callers_stacklevel(),
        )

    def call_form(self, args: tuple, kwargs: dict) -> CallForm | None:
        """How this call differs from the planning call (None where it does not): tensor
        arguments left out (or passed as None), other dtypes of the model's parameters and
        buffers (``model.double()``) or of the tensor arguments, or another autocast."""
        values = [
            args[position] if position is not None and position < len(args) else kwargs.get(name)
            for name, position in self.tensor_arguments
        ]
        arguments = tuple([v.dtype if isinstance(v, torch.Tensor) else None for v in values])
        left_out = tuple([n for (n, _), v in zip(self.tensor_arguments, values) if v is None])
        layouts: tuple[tuple[bool, bool] | None, ...] = ()
        devices: tuple[torch.device, ...] = ()
        if self.layouts_baked:
            layouts = tuple([_layout(v) if isinstance(v, torch.Tensor) else None for v in values])
        if self.devices:  # recorded for export's graphs, with or without tensor arguments
            devices = _devices(self.state_tables, values)
        state = _state_dtypes(self.state_tables)
        autocast = autocast_state(self.autocast_regions)
        form = CallForm(left_out, state, arguments, autocast, layouts, devices)
        if (
            not left_out
            and not self._dtypes_moved(form)
            and not self._layouts_moved(form)
            and form.devices == self.devices
        ):
            return None  # (a value that is no tensor, a tracer's proxy, has no dtype)
        return form

    def remember_graph_tensors(self, planned: nn.Module, targets) -> None:
        """The tensors the planned graph reads as attributes (``targets``: parameters, buffers,
        constants), and whether each requires grad now, at planning (``replays_hold``)."""
        self.graph_tensors = [operator.attrgetter(target) for target in sorted(targets)]
        self.graph_tensor_grads = [_requires_grad(get(planned)) for get in self.graph_tensors]

    def replays_hold(self, planned: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether this call's recomputes may replay nodes (``planner.rewrite._Replaying``).

        The profile chose which ops of a replayed node to fake for the planning call: autograd
        saves an op's input only where another of its inputs requires grad (``scores * t``
        saves the scores for a ``t`` that trains), and a matmul copies its arguments or not by
        their strides. A call whose parameters or tensor arguments differ from it in
        ``requires_grad`` or in size recomputes those nodes instead: exact, a little slower. The
        tensors the graph reads as attributes count too (a buffer or constant made to require
        grad; a root parameter ``torch.func.functional_call`` swaps on the planned module).
        """
        if not (self.replays and self.trainable_unchanged):
            return False
        for get, planned_grad in zip(self.graph_tensors, self.graph_tensor_grads):
            if _requires_grad(get(planned)) != planned_grad:
                return False
        for (name, position), grads, sizes in zip(
            self.tensor_arguments, self.argument_grads, self.argument_sizes
        ):
            value = _argument(name, position, args, kwargs)
            if _grads(value) != grads or _shapes(value) != sizes:
                return False
        return True

    def watch_live_dicts(self, original: nn.Module, memo: dict) -> None:
        """After ``copy.deepcopy`` of a snapshot of ``original``: watch the copied modules'
        own ``__dict__``s. Deepcopy hands each module a copy of its ``__dict__``, which
        ``nn.Module.__setstate__`` merges into a new one, so the copied snapshot watched
        dicts no module uses (found by review: an EMA copy put in eval ran the training-mode
        graph, dropout on)."""
        live = {}
        for old, new in zip(original.modules(), self.model.modules()):
            stale = memo.get(id(old.__dict__))
            if stale is not None:
                live[id(stale)] = new.__dict__
        self.module_dicts = [live.get(id(d), d) for d in self.module_dicts]
        self.forward_dicts = [live.get(id(d), d) for d in self.forward_dicts]
        self.attribute_dicts = [live.get(id(d), d) for d in self.attribute_dicts]
        self.attributes = [(n, live.get(id(d), d), k, v) for n, d, k, v in self.attributes]

    def raise_if_ranks_changed(self, args: tuple, kwargs: dict, error: Exception) -> None:
        """A ``PlanningError`` for ``error`` where a tensor argument has another number of
        dimensions than at planning, in a graph torch.export captured: its graph holds the
        example's (found by a tester: a 0-d timestep for a (batch,) one raised a bare
        ``IndexError`` from the graph)."""
        changed = [
            f"{name} with {len(now)} dimensions, planned with {len(then)}"
            for (name, position), planned in zip(self.tensor_arguments, self.argument_sizes)
            for now, then in zip(_shapes(_argument(name, position, args, kwargs)), planned)
            if len(now) != len(then)
        ]
        if changed:
            raise PlanningError(
                f"the planned {type(self.model).__name__} is called with {'; '.join(changed)}: "
                "its graph, captured by torch.export, holds the example's number of dimensions "
                "(dynamic_shapes=True lets sizes vary, not ranks). Call it with tensors of the "
                "planning example's ranks (a timestep of shape (batch,), not a scalar), or plan "
                f"with the call you train with. The graph's error: {type(error).__name__}: "
                f"{error}"
            ) from error

    def warn_if_larger(self, args: tuple, kwargs: dict) -> None:
        """Once: a tensor argument is larger than when planning (a longer batch of a
        length-bucketed dataset, a batch size raised), so the step may exceed the budget, which
        holds up to the example's sizes. Smaller calls use less memory, and so do calls without
        gradients (validation)."""
        if self.warned_larger or not torch.is_grad_enabled():
            return
        for (name, position), planned in zip(self.tensor_arguments, self.argument_sizes):
            if _larger(_shapes(_argument(name, position, args, kwargs)), planned):
                break
        else:
            return
        self.warned_larger = True
        sizes = ", ".join(
            f"{name} {[list(s) for s in shapes] if len(shapes) > 1 else list(shapes[0])}"
            for (name, _), shapes in zip(self.tensor_arguments, self.argument_sizes)
            if shapes
        )
        warnings.warn(
            f"a call of the planned {type(self.model).__name__} has larger tensors than the "
            f"example it was planned for ({sizes}): its peak may exceed the budget, which "
            "holds up to the example's sizes. Plan with example inputs of the largest size "
            "you train with.",
            UserWarning,
            stacklevel=_callers_stacklevel(),
        )

    def _dtypes_moved(self, form: CallForm) -> bool:
        return (
            form.state != self.state_dtypes
            or form.autocast != self.autocast
            or any(map(_differs, self.argument_dtypes, form.arguments))
        )

    def _layouts_moved(self, form: CallForm) -> bool:
        return any(map(_differs, self.argument_layouts, form.layouts))

    def describe(self, form: CallForm) -> str:
        """What ``form`` changes, as the rest of a sentence that begins 'the planned Net'."""
        parts, moved = [], []
        if form.left_out:
            parts.append(f"was planned with {', '.join(form.left_out)} given and is called without")
        for label, before, now in (
            ("parameters and buffers", self.state_dtypes, form.state),
            ("tensor arguments", self.argument_dtypes, form.arguments),
        ):
            moves = {
                f"{_dtype_name(b)} -> {_dtype_name(a)}"
                for b, a in zip(before, now)
                if b is not None and a is not None and b != a
            }
            if len(before) != len(now):  # then the positions do not match either
                parts.append(f"has had {label} added or removed since planning")
            elif moves:
                moved.append(f"{label} {', '.join(sorted(moves))}")
        if moved:
            parts.append(f"is called with other dtypes than at planning ({'; '.join(moved)})")
        layouts = [
            f"{name}: {_layout_name(before)} then, {_layout_name(now)} now"
            for (name, _), before, now in zip(
                self.tensor_arguments, self.argument_layouts, form.layouts
            )
            if before is not None and now is not None and before != now
        ]
        if layouts:
            parts.append(
                "is called with tensor arguments that differ in requires_grad or contiguity "
                f"from the planning call's ({'; '.join(layouts)}), and torch.export bakes in "
                "forward's branches on them"
            )
        if form.devices != self.devices:
            parts.append(
                f"runs on {_device_names(form.devices)} and was planned on "
                f"{_device_names(self.devices)}, which torch.export bakes into its graph "
                "(torch.arange(n, device=x.device))"
            )
        if form.autocast != self.autocast:
            parts.append(
                f"is called under {_autocast_name(form.autocast)} and was planned under "
                f"{_autocast_name(self.autocast)}"
            )
        return " and ".join(parts)

    @torch.compiler.disable  # planning cannot run inside Dynamo's trace: the form runs eagerly
    def run_form(self, form: CallForm, args: tuple, kwargs: dict):
        """A call unlike the planning call (``call_form``): that call form's own plan (made
        the first time it is seen), else the model itself (exact, not planned). Under
        ``torch.compile`` it runs eagerly (found by a tester: planning the form inside the
        compiled call failed on an internal assertion of torch's dispatcher)."""
        if torch.is_grad_enabled() and self.plan_call is not None:
            planned = self._planned_form(form, args, kwargs)
            if planned is not None:
                return planned(*args, **kwargs)
        elif torch.is_grad_enabled() and form not in self.warned_forms:
            self.warned_forms.add(form)
            warnings.warn(
                f"the planned {type(self.model).__name__} {self.describe(form)}: its graph "
                "was captured for the planning call, so this call runs the model directly "
                "(results are exact, memory is not reduced). Plan with the call you train with "
                "(after a dtype move, plan the moved model) to checkpoint it.",
                stacklevel=_callers_stacklevel(),
            )
        return self.model(*args, **kwargs)

    def _planned_form(self, form: CallForm, args: tuple, kwargs: dict):
        """The planned module of the calls of ``form``, planned once with the planning call's
        budget, solver and options, at the planning example's sizes (``at_planned_sizes``):
        planned at the first call's, a smaller first call (a shorter batch) left every later,
        larger call of the form over the budget, and a size 1 there, which torch.export
        specialises, made every later call of another size fail its guard. A call those sizes
        do not suit (a size passed as a number: ``x.view(b, length, d)``) is planned at its
        own. None where no plan fits (the model runs)."""
        assert self.plan_call is not None
        with _PLANNING_CALL_FORM:
            if form in self.call_forms:
                return self.call_forms[form]
            name, difference = type(self.model).__name__, self.describe(form)
            example_args, example_kwargs = self.at_planned_sizes(args, kwargs)
            sizes = "at the planning example's sizes (this call's arguments, cut or repeated)"
            try:
                try:
                    planned = self.plan_call(example_args, example_kwargs=example_kwargs).module
                except PlanningError:
                    resized = tree_leaves((example_args, example_kwargs))
                    if all(map(operator.is_, resized, tree_leaves((args, kwargs)))):
                        raise
                    planned = self.plan_call(args, example_kwargs=kwargs).module
                    sizes = "at this call's sizes (the example's do not suit its arguments)"
            except PlanningError as error:
                planned = None
                message = (
                    f"the planned {name} {difference}; planning that call form failed "
                    f"({error}), so such calls run the model directly (exact, memory not "
                    "reduced)."
                )
            else:
                message = (
                    f"the planned {name} {difference}: planner planned this call form once, "
                    f"with the same budget, solver and options, {sizes}, and runs its plan for "
                    "every such call: its budget holds up to those sizes, as the plan's does."
                )
            if self._dtypes_moved(form):
                message += (
                    " A plan holds for the dtypes it was made with: forward may branch on "
                    "them (Hugging Face T5 clamps in float16 only), and memory follows them."
                )
            warnings.warn(message, UserWarning, stacklevel=_callers_stacklevel())
            self.call_forms[form] = planned
            return planned

    def at_planned_sizes(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call ``(args, kwargs)`` with each tensor of its tensor arguments at the size it
        had in the planning example: cut, or repeated along a dimension where smaller (values
        the call holds: ids stay in the vocabulary), in the call's dtype, device,
        requires_grad and contiguity (``_at_size``), tensors passed twice made once. The call
        itself where a tensor cannot be (another number of dimensions or of tensors than at
        planning, an empty dimension to grow, sizes not recorded)."""
        new_args, new_kwargs = list(args), dict(kwargs)
        made: dict[tuple[int, torch.Size], torch.Tensor] = {}
        for (name, position), planned in zip(self.tensor_arguments, self.argument_sizes):
            positional = position is not None and position < len(args)
            value = args[position] if positional else kwargs.get(name)
            leaves, spec = tree_flatten(value)
            tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
            if not tensors:  # left out: the form's
                continue
            if len(tensors) != len(planned):
                return args, kwargs
            shapes = iter(planned)
            for i, leaf in enumerate(leaves):
                if not isinstance(leaf, torch.Tensor):
                    continue
                key = (id(leaf), next(shapes))
                if key not in made:
                    resized = _at_size(leaf, key[1])
                    if resized is None:
                        return args, kwargs
                    made[key] = resized
                leaves[i] = made[key]
            value = tree_unflatten(leaves, spec)
            if positional:
                new_args[cast(int, position)] = value
            else:
                new_kwargs[name] = value
        return tuple(new_args), new_kwargs

    def call_model(self, args: tuple, kwargs: dict):
        return self.model(*args, **kwargs)

    def run_model(self, args: tuple, kwargs: dict):
        """The model itself, for a mode the plan was not made in."""
        flags = tuple(d["training"] for d in self.module_dicts)
        if torch.is_grad_enabled() and flags not in self.warned:
            self.warned.add(flags)  # once per set of flags (found by a tester: a whole-model
            # eval call used the warning up before the partial eval that overshot the budget)
            differing = [
                f"{name or 'the model'} {'train' if before else 'eval'} then, "
                f"{'train' if d['training'] else 'eval'} now"
                for name, d, before in zip(self.module_names, self.module_dicts, self.flags)
                if d["training"] != before
            ]
            warnings.warn(
                f"the planned {type(self.model).__name__} runs with other training flags than "
                f"it was planned with ({'; '.join(differing[:4])}"
                f"{'; ...' if len(differing) > 4 else ''}): it calls the "
                "model directly, so the plan's checkpointing is not applied (results are "
                "exact, memory is not reduced). Plan in this mode to checkpoint in it, or call "
                "it under torch.no_grad().",
                stacklevel=_callers_stacklevel(),
            )
        return self.call_model(args, kwargs)


class _CallGraph:
    """Stored on the backward functions of a call's outputs: alive while that graph is."""

    reached = False

    def reach(self, grad_outputs):
        self.reached = True


def _symbolically_traced(args: tuple, kwargs: dict) -> bool:
    """Whether ``torch.fx.symbolic_trace`` is recording this call, which would flatten the
    plan's checkpoints: by its arguments, as torch's flag is the process's, not the thread's (a
    capture planning another model in another thread is none of this call's business)."""
    return torch.fx._symbolic_trace._is_fx_tracing_flag and any(
        isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())
    )


def _under_vmap() -> bool:
    """Whether ``torch.func.vmap`` is running (checked first: whether any transform is)."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def _under_functorch_grad() -> bool:
    """Whether a ``torch.func`` transform that records gradients is running."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    # grad, vjp, jacrev and hessian all run under a Grad interpreter.
    return any(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters())


class CallForm(NamedTuple):
    """A call unlike the planning call: the tensor arguments it leaves out, the dtypes of the
    model's parameters and buffers and of its tensor arguments (None: not a tensor), the
    autocast in force, and, for a graph captured by torch.export, the tensor arguments'
    ``_layout`` and the call's devices (empty otherwise)."""

    left_out: tuple[str, ...]
    state: tuple[torch.dtype, ...]
    arguments: tuple[torch.dtype | None, ...]
    autocast: tuple[tuple[str, torch.dtype | None], ...]
    layouts: tuple[tuple[bool, bool] | None, ...] = ()
    devices: tuple[torch.device, ...] = ()


def _device_names(devices: tuple[torch.device, ...]) -> str:
    return ", ".join(map(str, devices)) or "no device"


def _at_size(tensor: torch.Tensor, size: torch.Size) -> torch.Tensor | None:
    """``tensor`` at ``size``, the planning example's: its values cut, or repeated along a
    dimension where it is smaller, with its dtype, device, requires_grad and contiguity;
    ``tensor`` itself at that size already; None where it cannot be (another number of
    dimensions, an empty dimension to grow)."""
    if tensor.shape == size:
        return tensor
    if tensor.dim() != len(size) or any(n and not m for n, m in zip(size, tensor.shape)):
        return None
    value = tensor.detach()
    for dim, (n, m) in enumerate(zip(size, value.shape)):
        if n != m:
            value = value.index_select(dim, torch.arange(n, device=value.device) % m)
    if not tensor.is_contiguous():
        value = _not_contiguous(value)
    return value.requires_grad_(tensor.requires_grad)


def _not_contiguous(value: torch.Tensor) -> torch.Tensor:
    """A copy of ``value`` that is not contiguous (every other element of a buffer twice its
    size): a call form is keyed by contiguity alone (``_layout``), which torch.export bakes in
    branches on, so any such layout stands for the form's calls."""
    return value.new_empty((*value.shape, 2))[..., 0].copy_(value)


def _differs(then, now) -> bool:
    """Whether an argument's dtype or layout at planning (``then``) and in a call (``now``)
    differ, both known (None: not a tensor there)."""
    return then is not None and now is not None and then != now


def _layout_name(layout: tuple[bool, bool]) -> str:
    requires_grad, contiguous = layout
    return f"{'requires' if requires_grad else 'no'} grad, {'' if contiguous else 'not '}contiguous"


def _trained_by(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def _autocast_name(state: tuple[tuple[str, torch.dtype | None], ...]) -> str:
    if not state:
        return "no autocast"
    if state == (("off", None),):
        return "an autocast region turned off (autocast keeps its weight casts until it exits)"
    return ", ".join(f"autocast({d!r}, {_dtype_name(dtype)})" for d, dtype in state if dtype)


def _argument(name: str, position: int | None, args: tuple, kwargs: dict):
    """The value of argument ``name`` (at ``position``, if positional) in a call."""
    return args[position] if position is not None and position < len(args) else kwargs.get(name)


def _disabled_hooks_message() -> str | None:
    """The message of the ``torch.autograd.graph.disable_saved_tensors_hooks`` block the call
    runs in, if any (None under torch.compile, which cannot call the getter)."""
    if torch.compiler.is_compiling():
        return None
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()


@functools.cache
def _top_saved_tensor_hooks():
    """A function that returns the innermost saved-tensor hooks (pack, unpack), or None:
    torch's getter takes an argument since some version before 2.13, none before."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        top(False)
    except TypeError:
        return top
    return functools.partial(top, False)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_INTERNAL = (os.path.dirname(__file__), os.path.dirname(torch.__file__))


def _gradient_bytes(grad: torch.Tensor) -> int:
    """The bytes ``grad`` holds: a sparse one (``nn.Embedding(sparse=True)``) in its indices
    and values, as it has no single storage."""
    if grad.layout is torch.sparse_coo:
        return grad._indices().nbytes + grad._values().nbytes
    return grad.nbytes


def _callers_stacklevel() -> int:
    """``stacklevel`` for a warning raised from the caller of this function: the first frame
    outside planner and torch, the user's line that called the planned module."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def _module_change(name: str, before: dict, now: dict) -> str:
    """Which children of the module ``name`` were replaced, added or removed."""
    where = f"{name}." if name else ""
    replaced = [k for k in before if k in now and now[k] is not before[k]]
    parts = [f"{where}{k} replaced" for k in replaced]
    parts += [f"{where}{k} added" for k in now if k not in before]
    parts += [f"{where}{k} removed" for k in before if k not in now]
    return ", ".join(parts)


class PlannedModule(ModelStateDict, fx.GraphModule):
    """The planned module: the rewritten graph, and checks that it still matches the model.

    Every call first compares the training flags of the model's modules with those at planning.
    In another mode (``model.eval()``, ``planned.eval()``) the traced graph would still behave as
    in the planning mode (dropout, ``if self.training:``), so the model itself runs instead,
    exactly, with a warning (once) when gradients are enabled. Otherwise a module replaced,
    added or removed, a plain attribute its code reads (``self.scale = ...``) changed, or a hook
    added or removed, in a part of the model the graph traced through raises a
    ``PlanningError``, as does a process-wide module hook registered since planning
    (``planner.hooks``); parameters frozen or unfrozen since planning warn (once) that the plan's
    memory no longer holds, and saved-tensor hooks around a plan with segments that they bypass
    them. A call that leaves out a tensor argument of the planning call (``attention_mask``)
    is a call form of its own: the first such call plans it (same budget, solver and options,
    at the planning example's sizes; a warning says so) and every later one runs that plan; a
    loaded plan, or a call form no plan fits, runs the model itself (exact, not planned). So
    is a call in other dtypes than at planning (``.double()`` after planning): the graph bakes
    in the branches forward took on dtypes, and, for a graph torch.export captured, of tensor
    arguments that differ in requires_grad or contiguity. Under ``no_grad`` the model itself
    runs where forward read grad mode while it was captured (the graph holds the branch it
    took). A call with gradients and a tensor larger than the example's in some dimension
    warns once: the budget holds up to the example's sizes; so does one that starts while
    parameters or tensor arguments hold gradients, unless the plan counts them
    (``plan_batch``'s accumulation).
    ``state_dict`` and ``load_state_dict`` save and load the root's own state through the
    model (``planner.model_state``).
    ``train()`` sets the model's mode (through the model's own ``train``); ``.to()``,
    ``.double()``... convert the model's tensors, root ones included.
    Pickling and ``copy.copy`` refuse: the module is tied to the model object it was planned
    from.
    """

    _planner: Snapshot  # set by rewrite

    def recompile(self):
        code = super().recompile()
        cls = type(self)
        graph_forward = cls.forward

        @functools.wraps(graph_forward)
        def forward(self, *args, **kwargs):
            return self._checked_call(graph_forward, args, kwargs)

        cls.forward = forward
        return code

    def _checked_call(self, graph_forward, args: tuple, kwargs: dict):
        snapshot = self._planner
        if snapshot.checkpoints and _symbolically_traced(args, kwargs):
            raise PlanningError(
                f"torch.fx.symbolic_trace cannot record {type(self).__name__}'s plan: its graph "
                "would hold the ops the checkpointed segments run, not the checkpoints (found "
                "by a tester: every activation held, 2.5x the budget). Trace the model itself, "
                "or use torch.compile on the planned module."
            )
        self._read_root_state(snapshot)
        if snapshot.mode_changed():
            return self._in_the_models_place(snapshot, snapshot.run_model, args, kwargs)
        snapshot.check_unchanged(type(self).__name__)
        if snapshot.reads_grad_mode and not torch.is_grad_enabled():
            # The graph holds the branch forward took on grad mode at planning, and there is
            # nothing to checkpoint: the model itself, exactly.
            return self._in_the_models_place(snapshot, snapshot.call_model, args, kwargs)
        if (
            snapshot.checkpoints
            and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and _under_vmap()
        ):
            snapshot.warn_vmapped()
            return self._in_the_models_place(snapshot, snapshot.call_model, args, kwargs)
        if (
            snapshot.checkpoints
            and torch.is_grad_enabled()
            and getattr(torch.utils.checkpoint, "_checkpoint_debug_enabled", None)
        ):
            raise PlanningError(  # torch's own error named neither planner nor a way out
                "torch.utils.checkpoint's debug mode (set_checkpoint_debug_enabled(True)) "
                f"cannot run {type(self).__name__}'s segments: each passes a context_fn of "
                "planner's (the buffers it restores, the nodes it keeps), which debug mode "
                "refuses. Debug the model itself with your own checkpoints, or turn debug mode "
                "off for the planned module."
            )
        if snapshot.checkpoints and torch.is_grad_enabled() and torch.jit.is_tracing():
            raise PlanningError(
                f"torch.jit.trace cannot record {type(self).__name__}'s plan: it records the "
                "ops its checkpointed segments run, not the checkpoints, so the traced module "
                "would hold every activation (found trying the library: 67% over the budget). "
                "Use torch.compile on the planned module, or trace the model itself."
            )
        form = snapshot.call_form(args, kwargs)
        if form is not None:
            return self._in_the_models_place(
                snapshot, functools.partial(snapshot.run_form, form), args, kwargs
            )
        snapshot.warn_if_gradients_held(args, kwargs)
        snapshot.warn_if_optimizer_grew()
        snapshot.warn_if_saved_tensor_hooks()
        # Under saved-tensor hooks (the user's own checkpoint around the call, offloading)
        # the activations may not be held: nothing to warn of.
        watch = (
            not snapshot.warned_two_forwards
            and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and _top_saved_tensor_hooks()() is None
        )
        if watch:
            snapshot.warn_if_earlier_graph_waits()
        compiling = torch.compiler.is_compiling()  # a compiled recompute replays nothing
        if not compiling:
            outer, _CALL.replays = replays_allowed(), snapshot.replays_hold(self, args, kwargs)
        # A region of forward (autocast, no_grad) left open by an exception through the graph
        # is exited, as the model's ``with`` would (found by review: the early stop of a
        # checkpoint around the call left autocast's nesting raised for the whole process).
        closing = (
            ClosingRegions()
            if snapshot.opens_regions and not compiling
            else contextlib.nullcontext()
        )
        try:
            with closing:
                output = graph_forward(self, *args, **kwargs)
        except AssertionError as error:
            if "has been specialized to have value" in str(error):
                # symbolic_trace's check of an argument it traced as a constant (None, a
                # flag); its bare assertion was all a user saw (found by a tester).
                raise ValueError(
                    f"{error}: this plan of {type(snapshot.model).__name__} was traced with "
                    "that argument's value at planning, and its graph computes with it. Plan "
                    "with the value you train with in example_inputs or example_kwargs."
                ) from error
            if "Guard failed" not in str(error):
                raise
            raise PlanningError(
                f"{error}: this plan of {type(snapshot.model).__name__} was captured by "
                "torch.export, whose graph holds the example's sizes (with dynamic_shapes=True, "
                "those the model fixes). Plan with dynamic_shapes=True and example inputs at "
                "the largest sizes you train with (a last, smaller batch; shorter sequences), "
                "or pad to the example's sizes; a size the model itself fixes needs a plan of "
                "its own."
            ) from error
        except RuntimeError as error:
            if "saved tensor hooks" in str(error) and _under_functorch_grad():
                raise PlanningError(
                    "torch.func.grad, vjp, jacrev and hessian cannot differentiate through the "
                    f"planned {type(snapshot.model).__name__}: its checkpointed segments use "
                    "saved-tensor hooks, which these transforms do not support yet. Apply them "
                    "to the model itself (it has the same parameters); torch.func.vmap and "
                    "functional_call work on the planned module."
                ) from error
            disabled = _disabled_hooks_message()
            if snapshot.checkpoints and disabled is not None and disabled in str(error):
                raise PlanningError(
                    "torch.autograd.graph.disable_saved_tensors_hooks is active, and the planned "
                    f"{type(snapshot.model).__name__}'s checkpointed segments need saved-tensor "
                    "hooks (torch.utils.checkpoint recomputes through them). Call it outside "
                    f"that block, or call the model itself there. The block's message: {error}"
                ) from error
            if "Inference tensors cannot be saved" in str(error) and _any_inference(args, kwargs):
                raise PlanningError(
                    f"An input of the planned {type(snapshot.model).__name__} is an inference "
                    "tensor (made under torch.inference_mode), and a checkpointed segment takes "
                    "it: checkpoint saves its inputs, which autograd refuses for inference "
                    "tensors. Clone it outside inference mode (x = x.clone()), make it under "
                    "torch.no_grad() instead, or plan with such a tensor as the example input "
                    f"(segments then never take it). PyTorch's message: {error}"
                ) from error
            if snapshot.layouts_baked and not compiling:
                snapshot.raise_if_ranks_changed(args, kwargs, error)
            raise
        except IndexError as error:
            if snapshot.layouts_baked and not compiling:
                snapshot.raise_if_ranks_changed(args, kwargs, error)
            raise
        finally:
            if not compiling:
                _CALL.replays = outer
        snapshot.warn_if_larger(args, kwargs)  # after: export's static graphs refuse other sizes
        if watch:
            snapshot.note_graph(output)
        return output

    def _in_the_models_place(self, snapshot: Snapshot, run, args: tuple, kwargs: dict):
        """``run(args, kwargs)``, which calls the model (or a call form's plan of it) in the
        planned module's place, with the root parameters and buffers ``functional_call``
        swapped on the planned module alone (found by review: a ``vmap`` ensemble of
        ``functional_call`` computed with the model's own; an EMA evaluated in eval mode
        through ``functional_call(p.module, ...)`` too)."""
        swaps = [
            (getattr(snapshot.model, table), key, value)
            for table in snapshot.synced
            for key, value in getattr(self, table).items()
            if getattr(snapshot.model, table).get(key) is not value
        ]
        if not swaps:
            return run(args, kwargs)
        before = [(d, key, d.get(key)) for d, key, _ in swaps]
        for d, key, value in swaps:
            d[key] = value
        try:
            return run(args, kwargs)
        finally:
            for d, key, value in before:
                d[key] = value

    def _read_root_state(self, snapshot: Snapshot) -> None:
        """Root parameters and buffers are entries of both modules' own dicts, and the graph
        reads the planned module's. The model's are the reference: what replaces them
        (``model.double()``, ``model.load_state_dict(..., assign=True)``, ``model.to_empty()``)
        is read here; what replaces the planned module's through ``__setattr__`` is written to
        the model at once. An entry swapped on the planned module alone (``functional_call``
        swaps ``_parameters`` entries, then puts them back) is left for the call to use."""
        for table, synced in snapshot.synced.items():
            own = getattr(self, table)
            for key, value in getattr(snapshot.model, table).items():
                if own.get(key) is synced.get(key):
                    own[key] = synced[key] = value

    def _load_from_state_dict(self, *args) -> None:
        super()._load_from_state_dict(*args)  # through the model (planner.model_state)
        self._read_root_state(self._planner)  # assign=True gave the model new root tensors

    def named_parameters(self, *args, **kwargs):
        self._read_root_state(self._planner)  # an optimizer made now gets the model's own
        return super().named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        """The model's buffers in its order, then the constants the graph holds (torch.export
        lifts ``torch.tensor(0.5)`` made in forward into one): code that pairs two modules'
        buffers by position (``AveragedModel(model, use_buffers=True)`` updated from the
        planned module) pairs the model's (found by a tester: running statistics averaged
        into each other's places, silently)."""
        self._read_root_state(self._planner)
        named = list(super().named_buffers(*args, **kwargs))
        own = self._buffers.keys() - self._planner.model._buffers.keys()
        constants = {id(self._buffers[key]) for key in own}
        return iter(
            [b for b in named if id(b[1]) not in constants]
            + [b for b in named if id(b[1]) in constants]
        )

    def __getattr__(self, name: str):
        """An attribute the model has and the graph does not (a Hugging Face ``config``,
        ``save_pretrained``) is missing here on purpose: the planned module is the model's
        forward only. The error says where it is instead of a bare "no attribute". A root
        parameter or buffer is the model's current one, replaced since or not (found by a
        tester: an optimizer made after ``to_empty`` trained a stale tensor)."""
        state = self.__dict__
        if name in state.get("_parameters", ()) or name in state.get("_buffers", ()):
            snapshot = state.get("_planner")
            if snapshot is not None:
                self._read_root_state(snapshot)
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            snapshot = self.__dict__.get("_planner")
            if snapshot is None or name.startswith("_") or not hasattr(snapshot.model, name):
                raise
            model = type(snapshot.model).__name__
            raise AttributeError(
                f"{error}: the planned module runs the model's forward only. {name!r} is the "
                f"model's ({model}): use it there (model.{name}); the planned module shares "
                "the model's parameters and buffers, so what the model saves, loads or "
                "generates is what the plan trains."
            ) from None

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        self._write_to_model(name)

    def register_buffer(self, name, tensor, persistent=True):
        super().register_buffer(name, tensor, persistent)
        self._write_to_model(name)

    def register_parameter(self, name, param):
        super().register_parameter(name, param)
        self._write_to_model(name)

    def _write_to_model(self, name: str) -> None:
        """Give the model the root parameter or buffer ``name`` just set on the planned module
        (``planned.shift = t``, ``planned.load_state_dict(sd, assign=True)``), if it has one."""
        snapshot = self.__dict__.get("_planner")  # None while the module is being built
        if snapshot is None:
            return
        for table in ("_parameters", "_buffers"):
            own, users = getattr(self, table), getattr(snapshot.model, table)
            if name in users and name in own:
                users[name] = snapshot.synced[table][name] = own[name]

    def train(self, mode: bool = True):
        model = self._planner.model
        model.train(mode)  # the model's own train(), which may keep some modules in eval
        self.training = mode
        for name, child in self._modules.items():
            if child is not None and name not in model._modules:  # only the captured graph's
                child.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        model = self._planner.model
        for table in ("_parameters", "_buffers"):
            own, users = getattr(self, table), getattr(model, table)
            for key in users.keys() & own.keys():
                users[key] = self._planner.synced[table][key] = own[key]
        return self

    def __deepcopy__(self, memo):
        for _, space, _, _ in self._planner.attributes:
            if _is_module_globals(space):  # shared, not copied (a module cannot be pickled)
                memo[id(space)] = space
        copied = cast(PlannedModule, super().__deepcopy__(memo))  # fx copies the class too
        type(copied).__name__ = type(self).__name__  # not fx's "GraphModule" (found by a tester)
        copied._planner = copy.deepcopy(self._planner, memo)
        copied._planner.watch_live_dicts(self._planner.model, memo)
        share_user_state(copied, copied._planner.model)
        # fx's copy starts with no module hooks: the copied call takes the model's calls again
        call = copied.meta.get(CALL_KEY)
        if call is not None:
            call.install(copied)
        return copied

    def __copy__(self):
        raise TypeError(
            f"copy.copy of a {type(self).__name__} is not supported: a shallow copy would share "
            "the model yet escape the planned module's checks. Use copy.deepcopy(planned) (it "
            "copies the model too), or plan the model again."
        )

    def __prepare_scriptable__(self):
        """``torch.jit.script`` calls this first: the planned module cannot be scripted."""
        raise PlanningError(
            f"torch.jit.script cannot compile {type(self).__name__}: its segments run under "
            "torch.utils.checkpoint, which TorchScript does not support (torch.jit.trace would "
            "record their ops without the checkpoints, and the plan's memory with them). Use "
            "torch.compile on the planned module, or script the model itself."
        )

    def __reduce__(self):
        raise PlanningError(
            f"{type(self).__name__} cannot be pickled (pickle.dumps, torch.save): it is tied to "
            "the model object it was planned from. Save the plan and the weights instead: "
            "plan.save(path) and torch.save(model.state_dict(), ...), then later "
            "planner.load(path, model) on the rebuilt model."
        )
