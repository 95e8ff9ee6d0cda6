"""What a forward does beside tensor operations, which a captured graph cannot replay.

Capture runs ``forward`` once and records its tensor operations. The planned module then runs
that record, so anything else the forward did happened once, at planning time, and never again:

* a custom ``torch.autograd.Function``: the graph records its forward's operations and loses
  its own backward (a gradient-reversal layer becomes a view, a straight-through estimator a
  ``sign``), so gradients silently differ even with no segment; a tensor hook registered in
  forward (``h.register_hook(...)``) is lost the same way;
* a draw from Python's or numpy's random generators (LayerDrop written with ``random.random()``):
  the trace-time draw is baked into the graph;
* a call that sets torch's random state (``torch.manual_seed``, ``torch.set_rng_state``,
  ``torch.random.fork_rng``) or that of a generator a module holds (``self.g.manual_seed(0)``):
  it ran once, at capture, and the graph, which records ops, draws on from wherever the
  generator stands (outputs 0.94 and gradients 17.6 off, with no segment);
* an attribute the forward sets on a module (an MoE layer's ``self.aux_loss``, a call counter):
  the planned module never sets it, and the value left by capture is a tracing placeholder;
* values the forward puts into a container a module attribute or a global holds
  (``self.aux.append(loss)``, ``AUX_LOSSES.append(loss)``: MoE balancing losses, deep
  supervision): the planned module never puts them there, and capture left tracing
  placeholders in it, with which a loss built from them computes nothing;
* an in-place update of a parameter (a momentum encoder): applied once, by planning.

``refusing_side_effects`` watches a capture for them, puts back what it can (module attributes
and what their containers hold, the random generators' states, the model's own generators')
and raises a ``PlanningError``
that names each and what to do.
"""

from __future__ import annotations

import collections
import contextlib
import random
import re
import sys
import threading
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from planner.errors import PlanningError
from planner.hooks import HOOK_TABLES, process_wide_hook_count
from planner.model_code import global_loads
from planner.regions import CAPTURE_LOCK

__all__ = [
    "generators",
    "keeping_random_states",
    "refusing_side_effects",
    "repeated_effects",
    "same_bits",
]

_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules"})
# Where torch.fx's tracer stows a constant the graph reads (``Tracer.create_arg``): on the
# traced module itself. Put back like the rest, but the forward did not set them.
_TRACER_CONSTANT = re.compile(
    r"_(tensor_constant|torchbind_obj|tree_spec_constant|opaque_obj)\d*|_\w+_constant_\d*"
)
_APPLY = torch.autograd.Function.__dict__["apply"]
_REGISTER_HOOK = torch.Tensor.register_hook
_ENTER_SAVED_HOOKS = torch.autograd.graph.saved_tensors_hooks.__enter__
_CHECKPOINT = torch.utils.checkpoint.__name__


def _attributes(model: nn.Module) -> dict[tuple[str, str], object]:
    """Every plain attribute of every module, by (module path, name)."""
    return {
        (path, key): value
        for path, module in model.named_modules(remove_duplicate=False)
        for key, value in vars(module).items()
        if key not in _MODULE_STATE
    }


_CONTAINERS = (list, dict, set, collections.deque)
# nn.Module's own bookkeeping (children, tensors, hooks), which other checks watch.
_TORCH_STATE = frozenset(vars(nn.Module()))


def generators(model: nn.Module) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` a module attribute holds, by name: the model's own streams."""
    return _generators_in(_attributes(model))


def _generators_in(attributes: dict[tuple[str, str], object]) -> dict[str, torch.Generator]:
    """The ``torch.Generator`` values of ``_attributes``, by name. Tested by type:
    ``isinstance`` goes through the metaclass of torch's opaque objects, five times slower, and
    this looks at every attribute of every module."""
    return {
        _dotted(path, key): value
        for (path, key), value in attributes.items()
        if type(value) is torch.Generator
    }


def _dotted(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_DRAWN_FROM = (random.Random, np.random.Generator, np.random.RandomState)


class _RandomStates:
    """Python's and numpy's generators that a forward may draw from, with their states now: the
    global ones (``random.random()``, ``np.random.rand()``) and those among ``values`` (module
    attributes: ``self.rng = np.random.default_rng(0)``). A draw from any is baked into a
    captured graph, and a recompute would make it again; ``torch.utils.checkpoint`` restores
    none of them."""

    def __init__(self, values):
        held = {id(v): v for v in values if isinstance(v, _DRAWN_FROM)}
        self.access = [_state_access(g) for g in (random, np.random, *held.values())]
        self.states = [get() for get, _ in self.access]

    def drew(self) -> bool:
        return not all(
            _same_state(state, get()) for state, (get, _) in zip(self.states, self.access)
        )

    def restore(self) -> None:
        for state, (_, put) in zip(self.states, self.access):
            put(state)


def _state_access(generator):
    """(get, set) of ``generator``'s state: a numpy ``Generator`` keeps it on its bit
    generator; Python's (``random``, a ``Random``) have ``getstate``/``setstate``; numpy's
    global one and a ``RandomState``, ``get_state``/``set_state``."""
    if isinstance(generator, np.random.Generator):
        bits = generator.bit_generator
        return (lambda: bits.state), (lambda state: setattr(bits, "state", state))
    if hasattr(generator, "getstate"):
        return generator.getstate, generator.setstate
    return generator.get_state, generator.set_state


def _held(container) -> list:
    """What ``container`` holds, one level deep (keys and values alternating, for a dict)."""
    if isinstance(container, dict):
        return [x for pair in container.items() for x in pair]
    return list(container)


def _identities(container, held: list) -> list[int]:
    """Which objects ``container`` holds, by id, in order (sorted for a set: no order there)."""
    ids = [id(x) for x in held]
    return sorted(ids) if isinstance(container, set) else ids


def _containers(model: nn.Module) -> list[tuple[str, Any, list, bool]]:
    """Every list, dict, set and deque a module attribute holds, or a global that the model's
    code loads (``planner.model_code``: a module-level list of auxiliary losses), directly or
    inside another (or a tuple): (the attribute's or global's name, the container, a copy of
    what it holds, whether it is a module's)."""
    found: list[tuple[str, Any, list, bool]] = []
    seen: set[int] = set()
    roots = [
        (_dotted(path, key), value, True)
        for path, module in model.named_modules(remove_duplicate=False)
        for key, value in vars(module).items()
        if key not in _TORCH_STATE
    ]
    classes = {type(m) for m in model.modules() if type(m).__module__.split(".")[0] != "torch"}
    roots += [
        (f"{space.get('__name__', '')}.{key}", space[key], False)
        for cls in classes
        for space, key in global_loads(cls)  # type: ignore[arg-type]  # a class is hashable
        if isinstance(space.get(key), _CONTAINERS)
    ]
    for name, value, modules in roots:
        stack = [value]
        while stack:
            value = stack.pop()
            if isinstance(value, tuple):
                stack.extend(value)
            elif isinstance(value, _CONTAINERS) and id(value) not in seen:
                seen.add(id(value))
                found.append((name, value, _held(value), modules))
                stack.extend(found[-1][2])
    return found


def _carries_gradient(value, parameters: set[str]) -> bool:
    """Whether ``value``, put into a container while capturing, is one that a gradient flows
    through: a tensor that requires grad (torch.export's fakes), or a tracing placeholder
    computed from a parameter (named in ``parameters``) or a module call (an auxiliary loss).
    A table computed from sizes alone (a memoised positional encoding) is a cache."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if not isinstance(value, torch.fx.Proxy):
        return False
    seen, pending = set(), [value.node]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_module" or (node.op == "get_attr" and node.target in parameters):
            return True
        pending.extend(node.all_input_nodes)
    return False


@contextlib.contextmanager
def _putting_back_containers(model: nn.Module):
    """Put back what each container of ``_containers`` held when the block ends; yield a list,
    filled then, naming the attributes whose containers the block filled with what a forward
    means to carry out through them: anything in a public one of a module, in a private one or
    a global a value a gradient flows through (``_carries_gradient``). Other changes are a
    module's own scratch or cache (as in ``_set_by_forward``; a global registry of warnings
    given, a memo of masks), put back all the same."""
    kept = _containers(model)
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    filled: list[str] = []
    try:
        yield filled
    finally:
        for name, container, held, of_module in kept:
            now = _held(container)
            if _identities(container, now) == _identities(container, held):
                continue
            old = {id(x) for x in held}
            added = tree_leaves([x for x in now if id(x) not in old])
            public = of_module and not name.rsplit(".", 1)[-1].startswith("_")
            traced = any(_carries_gradient(x, parameters) for x in added)
            if (public or traced) and name not in filled:
                filled.append(name)
            container.clear()
            if isinstance(container, dict):
                container.update(zip(held[::2], held[1::2]))
            elif isinstance(container, set):
                container.update(held)
            else:
                container.extend(held)


def _is_users(function: type) -> bool:
    """A Function defined outside torch, whose backward a graph of its forward would lose."""
    return not function.__module__.startswith("torch.")


@contextlib.contextmanager
def _noting_saved_tensor_hooks(entered: list[str]):
    """Note each saved-tensor hook context (``torch.autograd.graph.saved_tensors_hooks``,
    ``save_on_cpu``) the model's code in this thread enters meanwhile. No graph records one, and
    inside a module kept whole it takes the place of the hooks the profile and checkpoint save
    through (found trying the library: gradients silently wrong, or 46% over the budget)."""
    thread = threading.get_ident()

    def entering(manager):
        # planner's own profile and torch's checkpoint enter hooks of their own (a checkpoint
        # is refused apart while capturing, measured in a module kept whole); any other, the
        # model's or a wrapper's (torch's offload_wrapper enters save_on_cpu), is noted.
        caller = sys._getframe(1).f_globals.get("__name__", "").split(".")[0]
        ours = caller == _OURS[1] or type(manager).__module__ == _CHECKPOINT
        if threading.get_ident() == thread and not ours:
            entered.append(type(manager).__name__)
        return _ENTER_SAVED_HOOKS(manager)

    hooks = torch.autograd.graph.saved_tensors_hooks
    hooks.__enter__ = entering  # type: ignore[method-assign]
    try:
        yield
    finally:
        hooks.__enter__ = _ENTER_SAVED_HOOKS  # type: ignore[method-assign]


def saved_tensor_hooks_refusal(who: str, entered: list[str]) -> PlanningError:
    names = ", ".join(sorted(set(entered)))
    return PlanningError(
        f"cannot plan: the forward of {who} enters saved-tensor hooks ({names}: "
        "torch.autograd.graph.saved_tensors_hooks or save_on_cpu). A captured graph does not "
        "record them, and inside a module kept whole they take the place of the hooks through "
        "which planner measures and checkpointing drops saved tensors. Enter them around the "
        "training step instead (they then apply to the tensors saved outside checkpointed "
        "segments; docs/guarantees.md), or do not plan this model"
    )


@contextlib.contextmanager
def _recording_what_graphs_lose(applied: list[type], hooked: list[bool], entered: list[str]):
    """Note every user-defined ``autograd.Function`` this thread applies meanwhile, every
    tensor hook it registers (``h.register_hook(...)``, which no graph records) and every
    saved-tensor hook context it enters."""
    thread = threading.get_ident()
    apply = _APPLY.__func__

    def recording(cls, *args, **kwargs):
        if threading.get_ident() == thread and _is_users(cls):
            applied.append(cls)
        return apply(cls, *args, **kwargs)

    def registering(tensor, hook):
        if threading.get_ident() == thread:
            hooked.append(True)
        return _REGISTER_HOOK(tensor, hook)

    torch.autograd.Function.apply = classmethod(recording)  # type: ignore[method-assign,assignment]
    torch.Tensor.register_hook = registering  # type: ignore[method-assign]
    try:
        with _noting_saved_tensor_hooks(entered):
            yield
    finally:
        torch.autograd.Function.apply = _APPLY  # type: ignore[method-assign]
        torch.Tensor.register_hook = _REGISTER_HOOK  # type: ignore[method-assign]


# The functions that set torch's random state, under the names forward calls them by.
_SEEDING = {
    torch: "manual_seed seed set_rng_state".split(),
    torch.random: "manual_seed seed set_rng_state fork_rng".split(),
    torch.cuda: "manual_seed manual_seed_all seed seed_all set_rng_state set_rng_state_all".split(),
}


_OURS = ("torch", __name__.split(".")[0])


def _models_code(thread: int, frame) -> bool:
    """Whether ``frame`` runs in ``thread`` and in the model's code: not torch's
    (``torch.export``; ``fork_rng``, which sets the state back) nor planner's (forwards run
    eagerly under ``fork_rng`` while capturing)."""
    caller = frame.f_globals.get("__name__", "")
    return threading.get_ident() == thread and caller.split(".")[0] not in _OURS


@contextlib.contextmanager
def _refusing_reseeding(model: nn.Module):
    """Raise a PlanningError when the model's code in this thread calls one of ``_SEEDING``
    meanwhile (``_models_code``). It raises before the call runs, so the random state is never
    changed."""
    thread = threading.get_ident()

    def refusing(name: str, function):
        def call(*args, **kwargs):
            if _models_code(thread, sys._getframe(1)):
                raise _refusal(model, [_reseeding_reason(name)])
            return function(*args, **kwargs)

        return call

    originals = [(n, key, getattr(n, key)) for n, keys in _SEEDING.items() for key in keys]
    for namespace, key, function in originals:
        setattr(namespace, key, refusing(f"{namespace.__name__}.{key}", function))
    try:
        yield
    finally:
        for namespace, key, function in originals:
            setattr(namespace, key, function)


@contextlib.contextmanager
def noting_grad_mode_reads(read: list[bool]):
    """Note in ``read`` whether the model's code in this thread calls
    ``torch.is_grad_enabled()`` meanwhile (``_models_code``): the graph holds the branch
    forward took on it, so the planned module runs the model itself under ``no_grad``
    (``planner.planned_module``)."""
    thread, original = threading.get_ident(), torch.is_grad_enabled

    def noting() -> bool:
        if _models_code(thread, sys._getframe(1)):
            read.append(True)
        return original()

    torch.is_grad_enabled = noting
    try:
        yield
    finally:
        torch.is_grad_enabled = original


def _reseeding_reason(name: str) -> str:
    return (
        f"it calls {name}, which sets torch's random state: the graph records ops, not that "
        "call, so the planned module would draw other dropout masks and noise than the model, "
        "and leave the generator elsewhere. Seed outside forward (torch.manual_seed before "
        "each step); make noise that must stay the same once, outside forward (a buffer: "
        "self.register_buffer('noise', ..., persistent=False)); draw what must not move the "
        "global generator from a torch.Generator made in __init__ (torch.randn(..., "
        "generator=self.generator))"
    )


def _own_reseeding_reason(name: str) -> str:
    return (
        f"it seeds {name}, a generator of its own (manual_seed, seed or set_state): the graph "
        "records ops, not that call, so the planned module would draw on from where the "
        "generator stands, other noise than the model's. Seed it outside forward (before each "
        "step), or make noise that must stay the same once, outside forward (a buffer: "
        "self.register_buffer('noise', ..., persistent=False))"
    )


def _refusal(model: nn.Module, reasons: list[str]) -> PlanningError:
    return PlanningError(
        f"cannot plan {type(model).__name__}: its forward does more than tensor operations, "
        "and a captured graph cannot replay the rest: " + "; and ".join(reasons) + "."
    )


def _restore(model: nn.Module, before: dict, changed: list[tuple[str, str]]) -> None:
    for path, key in changed:
        module = model.get_submodule(path)
        if (path, key) in before:
            object.__setattr__(module, key, before[path, key])
        else:
            delattr(module, key)


def _plain_tensors(attributes: dict[tuple[str, str], object]) -> dict[str, tuple]:
    """Tensor attributes that are not parameters or buffers, by the first name each has:
    (tensor, version, copy)."""
    kept: dict[int, tuple] = {}
    for (path, key), value in attributes.items():
        if isinstance(value, torch.Tensor) and not value.is_inference() and id(value) not in kept:
            kept[id(value)] = (_dotted(path, key), value, value._version, value.detach().clone())
    return {entry[0]: entry[1:] for entry in kept.values()}


def _put_back_tensors(kept: dict[str, tuple]) -> list[str]:
    """The names of ``_plain_tensors`` whose values moved, each put back."""
    written = []
    for name, (tensor, version, value) in kept.items():
        if tensor._version != version and not same_bits(tensor, value):
            written.append(name)
            with torch.no_grad():
                tensor.copy_(value)
    return written


@contextlib.contextmanager
def refusing_side_effects(model: nn.Module):
    """Run a capture of ``model``; raise a ``PlanningError`` if its forward did more than tensor
    operations (see the module's docstring). Module attributes and the random generators'
    states are put back whether the capture succeeds or not. Callers hold
    ``planner.regions.CAPTURE_LOCK``: the random states are process-wide."""
    before = _attributes(model)
    draws = _RandomStates(before.values())
    streams = {name: (g, g.get_state()) for name, g in _generators_in(before).items()}
    versions = {n: p._version for n, p in model.named_parameters(remove_duplicate=False)}
    tensors = _plain_tensors(before)
    applied: list[type] = []
    hooked: list[bool] = []
    entered: list[str] = []
    try:
        with (
            _recording_what_graphs_lose(applied, hooked, entered),
            _refusing_reseeding(model),
            _putting_back_containers(model) as filled,
        ):
            yield
    finally:
        after = _attributes(model)
        changed = sorted(
            k
            for k in before.keys() | after.keys()
            if before.get(k, _MISSING) is not after.get(k, _MISSING)
        )
        drew = draws.drew()
        draws.restore()
        _restore(model, before, changed)
        written = _put_back_tensors(tensors)
        reseeded = [n for n, (g, state) in streams.items() if not torch.equal(g.get_state(), state)]
        for g, state in streams.values():
            g.set_state(state)
    updated = [
        n for n, p in model.named_parameters(remove_duplicate=False) if p._version != versions[n]
    ]
    set_by_forward = [
        (p, k)
        for p, k in changed
        if _set_by_forward(k, before.get((p, k), _MISSING), after.get((p, k), _MISSING), root=not p)
    ]
    if entered:
        raise saved_tensor_hooks_refusal(type(model).__name__, entered)
    reasons = _reasons(applied, bool(hooked), drew, set_by_forward, filled, updated)
    if written:
        reasons.append(
            f"it updates tensor attributes in place ({', '.join(written[:4])}"
            f"{', ...' if len(written) > 4 else ''}), which are not buffers: planning ran that "
            "update (it is undone) and a graph holds such a tensor as a constant. Register "
            "each as a buffer, whose updates the graph records: self.register_buffer('step', "
            "torch.zeros(()))"
        )
    installed = sorted(
        {_installed_package(type(model.get_submodule(p))) for p, _ in set_by_forward}
    )
    if set_by_forward and all(installed):
        reasons.append(
            f"those modules are code of an installed package ({', '.join(installed)}), not "
            "yours to change: this model cannot be planned as it is (plan the parts of it "
            "that do not set attributes)"
        )
    if drew and (augment := _spec_augment(model)):
        reasons.append(
            f"here that is likely SpecAugment ({augment}), whose time and feature masks "
            "Hugging Face's audio models draw with numpy in training: plan and train with "
            "config.apply_spec_augment = False (or mask_time_prob and mask_feature_prob 0.0)"
        )
    reasons += [_own_reseeding_reason(name) for name in reseeded]
    if reasons:
        raise _refusal(model, reasons)


@contextlib.contextmanager
def keeping_random_states(module: nn.Module):
    """Put Python's and numpy's generators, the global ones and those ``module``'s modules
    hold, back as they were when the block ends."""
    draws = _RandomStates(_attributes(module).values())
    try:
        yield
    finally:
        draws.restore()


@contextlib.contextmanager
def repeated_effects(module: nn.Module):
    """Run ``module``'s forward (one kept whole, a leaf of the captured graph, which runs
    again in every recompute); yield a list that then names what that run did which running it
    again would repeat: attributes it set (a call counter), values it put into containers
    (``_putting_back_containers``: a list of auxiliary losses would get them twice) and draws
    from Python's or numpy's random generators (which ``torch.utils.checkpoint`` does not
    restore). Attributes and containers are put back; the generators are left drawn from, so
    that each module kept whole draws on from the last, as in the model's forward (callers put
    them back once, ``keeping_random_states``). Modules made only of torch's own, without
    hooks (``nn.Linear``...), are not watched: their forward does none of these."""
    found: list[str] = []
    if _torch_modules_only(module):
        yield found
        return
    before = _attributes(module)
    draws = _RandomStates(before.values())
    entered: list[str] = []
    try:
        # The patch is process-wide: one thread at a time (see planner.regions).
        with (
            CAPTURE_LOCK,
            _noting_saved_tensor_hooks(entered),
            _putting_back_containers(module) as filled,
        ):
            yield found
    finally:
        after = _attributes(module)
        changed = [
            k
            for k in before.keys() | after.keys()
            if before.get(k, _MISSING) is not after.get(k, _MISSING)
        ]
        if draws.drew():
            found.append("random draws")
        _restore(module, before, changed)
    if entered:
        raise saved_tensor_hooks_refusal(f"{type(module).__name__} (a module kept whole)", entered)
    found += [f"values put into {name}" for name in filled]
    found += sorted(
        _dotted(path, key)
        for path, key in changed
        if _set_by_forward(
            key, before.get((path, key), _MISSING), after.get((path, key), _MISSING), root=False
        )
    )


def _torch_modules_only(module: nn.Module) -> bool:
    """Whether calling ``module`` runs only the forwards of ``torch.nn``'s modules, with no
    hook (torch's wrappers elsewhere, such as ``offload_wrapper``, may enter saved-tensor
    hooks)."""
    if process_wide_hook_count():
        return False
    return all(
        type(sub).__module__.startswith("torch.nn.")
        and not any(getattr(sub, table, None) for table in HOOK_TABLES)
        for sub in module.modules()
    )


def _installed_package(cls: type) -> str:
    """The installed package (``transformers``) that defines ``cls``; empty for other code."""
    package = cls.__module__.split(".")[0]
    where = getattr(sys.modules.get(package), "__file__", None) or ""
    return package if "site-packages" in where or "dist-packages" in where else ""


def _spec_augment(model: nn.Module) -> str:
    """The Hugging Face SpecAugment settings ``model``'s config turns on, named; empty if none."""
    config = getattr(model, "config", None)
    if not getattr(config, "apply_spec_augment", False):
        return ""
    on = [
        f"config.{key}={value}"
        for key in ("mask_time_prob", "mask_feature_prob")
        if isinstance(value := getattr(config, key, 0), (int, float)) and value > 0
    ]
    return ", ".join(on)


def _reasons(
    applied: list[type], hooked: bool, drew: bool, changed: list, filled: list, updated: list[str]
) -> list[str]:
    reasons = []
    if hooked:
        reasons.append(
            "it registers tensor hooks (tensor.register_hook): the graph would not register "
            "them, so the gradients they change would differ. Make the hook an op (a custom "
            "autograd op with torch.library.custom_op and register_autograd)"
        )
    if applied:
        names = sorted({f"{f.__module__}.{f.__qualname__}" for f in applied})
        reasons.append(
            f"it applies custom autograd functions ({', '.join(names)}): the graph would record "
            "their forward's operations and lose their backward, so gradients would differ. "
            "Make each a custom op (torch.library.custom_op with register_autograd), which is "
            "captured whole, or (for a model symbolic_trace captures) keep the module that "
            "applies it whole with leaf_modules=(...)"
        )
    if drew:
        reasons.append(
            "it draws from Python's or numpy's random generator, the global one or one a "
            "module holds (e.g. LayerDrop written with random.random(), a span mask drawn "
            "with self.rng = np.random.default_rng()): the draw made while capturing would be "
            "baked into the graph. "
            "Draw with torch (torch.rand) and use the result as a tensor, or turn it off to plan"
        )
    if changed:
        names = [_dotted(path, key) for path, key in changed]
        reasons.append(
            f"it sets module attributes ({', '.join(names)}): the planned module would never "
            "set them. Return such values from forward instead (e.g. an auxiliary loss as an "
            "output); keep a counter in a buffer updated in place, which the graph records "
            "(self.register_buffer('calls', torch.zeros((), dtype=torch.long)), then "
            "self.calls += 1)"
        )
    if filled:
        reasons.append(
            f"it puts values into containers held by module attributes or globals "
            f"({', '.join(filled)}): "
            "the graph has no way to carry values out through them, so the planned module "
            "would never put them there. Return such values from forward instead (e.g. the "
            "auxiliary losses as an output: return out, torch.stack(aux)); a setting forward "
            "applies for the call and restores (diffusers' cross_attention_kwargs={'scale': "
            "s} scales the LoRA layers' scaling dicts) is set outside forward instead "
            "(set_adapters(..., weights=...)) and left out of the call"
        )
    if updated:
        reasons.append(
            f"it updates parameters in place ({', '.join(updated[:4])}"
            f"{', ...' if len(updated) > 4 else ''}): planning ran that update once (their "
            "values have moved by one update) and the planned module would never run it. Make "
            "the update outside forward, e.g. after optimizer.step(). (Or another thread "
            "updated them while this one planned: plan between training steps.)"
        )
    return reasons


def same_bits(tensor: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds ``value``, its copy (NaN equal to NaN; a meta tensor
    holds no values). Kinds ``torch.equal`` does not take (sparse, nested, complex32) count as
    unchanged: their version alone tells."""
    if tensor.is_meta:
        return True
    try:
        if torch.equal(tensor, value):
            return True
        if tensor.shape != value.shape or not (tensor.is_floating_point() or tensor.is_complex()):
            return False
        return bool(((tensor == value) | (tensor.isnan() & value.isnan())).all())
    except (RuntimeError, NotImplementedError):
        return True


_MISSING = object()


def _set_by_forward(key: str, old, new, *, root: bool) -> bool:
    """Whether a changed attribute is one the planned module would fail to set: a tensor (an
    auxiliary loss; a tracing placeholder after capture), or a public value the model held
    before and that capture changed (a call counter). A new plain value is scratch the forward
    sets before it reads it (a layer index reset on every call); private ones are torch's own
    (``torch.export`` rebuilds an LSTM's ``_flat_weights``), as are the tracer's constants on
    the traced module. All are put back."""
    if root and _TRACER_CONSTANT.fullmatch(key):
        return False
    if isinstance(new, (torch.Tensor, torch.fx.Proxy)):
        return True
    return not key.startswith("_") and old is not _MISSING and not _equal(old, new)


def _equal(old, new) -> bool:
    """Whether a replaced attribute holds what it held: tracing copies some (torch.export
    replaces Hugging Face's plan dicts and a LayerNorm's ``normalized_shape`` by equal ones,
    an LSTM its lists of weights). A tensor or a tracing placeholder equals only itself."""
    if old is new:
        return True
    if isinstance(old, weakref.ref) and isinstance(new, weakref.ref):
        return old() is new()
    if any(isinstance(v, (torch.Tensor, torch.fx.Proxy)) or v is _MISSING for v in (old, new)):
        return False
    if type(old) is not type(new):
        return False
    if isinstance(old, (list, tuple)):
        return len(old) == len(new) and all(map(_equal, old, new))
    if isinstance(old, dict):
        return old.keys() == new.keys() and all(_equal(old[k], new[k]) for k in old)
    try:
        return bool(old == new)
    except (TypeError, ValueError, RuntimeError):  # no boolean equality (arrays, ...)
        return False


def _same_state(a, b) -> bool:
    """Whether two states of a Python or numpy generator are equal (numpy's hold arrays)."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(_same_state, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b
