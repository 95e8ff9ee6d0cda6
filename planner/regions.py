"""Grad-mode and autocast regions of forward, kept through capture; and the capturing thread.

``symbolic_trace`` runs a ``with torch.no_grad():`` (or ``torch.autocast(...)``) block once, on
proxies, and records no trace of the switch. While a capture runs, the context managers are
patched (``recording_regions``) so that entering and exiting one is recorded as a node calling
``enter_grad_mode``, ``enter_inference_mode``, ``enter_autocast`` or ``exit_region``, which do
at run time what the context manager does. ``torch.export`` records each switch as a node of its
own (``_set_grad_enabled``, ``_enter_autocast``, ``_exit_autocast``) before its passes fold the
regions into higher-order-op nodes, wrongly when one region lies inside ``torch.autocast``;
capture skips those passes and ``regions_from_export`` turns the switches into the same region
nodes. Every patch acts only in the capturing thread (``capturing``), one capture at a time
(``CAPTURE_LOCK``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading

import torch
from torch import fx
from torch.autograd import grad_mode

from planner.errors import PlanningError

# Tracing patches process-wide objects (fx patches ``nn.Module.__call__`` and ``__getattr__``;
# capture patches ``torch.utils.checkpoint`` and the grad-mode and autocast context managers).
# One capture at a time; every patch acts only in the capturing thread (``capturing``) and
# behaves as the original in every other thread.
CAPTURE_LOCK = threading.RLock()
# Per thread: .active (capturing), .tracer (the LeafTracer while fx traces), .exporting (the
# _ExportedRegions while torch.export captures), .depth (inside a patched context manager).
capturing = threading.local()


def in_capturing_thread() -> bool:
    return getattr(capturing, "active", False)


# Grad-mode and autocast regions. symbolic_trace runs a ``with torch.no_grad():`` (or
# ``torch.autocast(...)``) block of forward once, on proxies, and records no trace of the switch:
# the graph would compute with gradients (or in full precision) where the model does not. While
# tracing, entering and exiting such a context manager is recorded as a node calling one of the
# functions below, which do at run time what the context manager does: switch the mode, and on
# exit restore the mode that was current on entry (whatever mode the caller runs in).
#
# A region is ``(leave, state, autocast)``: ``leave(state)`` restores what was current on entry;
# ``autocast`` is ``(device_type, enabled)`` for an autocast region, else None. Each switch is a
# call torch.compile traces as the switch it is (``torch.set_grad_enabled`` called as a
# function, ``torch.amp._enter_autocast``, ``_enter_inference_mode``: the forms torch.export
# records); a context manager's ``__enter__``/``__exit__`` called outside a ``with`` statement
# is not, and left grad mode off after a compiled call.

_open = threading.local()  # .regions: regions entered by those nodes, not yet exited


def _open_regions() -> list:
    if not hasattr(_open, "regions"):
        _open.regions = []
    return _open.regions


def _entered(leave, state, autocast=None) -> tuple:
    """The region; remembered in eager mode only, for ``closing_regions`` (a compiled graph
    recomputes in a graph of its own, and does not trace the thread's list)."""
    region = leave, state, autocast
    if not torch.compiler.is_compiling():
        _open_regions().append(region)
    return region


def enter_grad_mode(enabled: bool) -> tuple:
    """Graph node for ``torch.no_grad()``, ``torch.enable_grad()``, ``set_grad_enabled(...)``."""
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(enabled)  # called as a function: switches now
    return _entered(torch.set_grad_enabled, previous)


def enter_inference_mode(mode: bool) -> tuple:
    """Graph node for ``torch.inference_mode(mode)``."""
    return _entered(grad_mode._exit_inference_mode, grad_mode._enter_inference_mode(mode))


def enter_autocast(
    device_type: str, dtype: torch.dtype, enabled: bool, cache_enabled: bool
) -> tuple:
    """Graph node for ``torch.autocast(...)`` (arguments as resolved when it was traced)."""
    if torch.compiler.is_compiling() and not hasattr(torch.amp.autocast_mode, "_UnmanagedAutocast"):
        raise PlanningError(_COMPILED_AUTOCAST + "This torch's Dynamo cannot trace the region.")
    mode = torch.amp.autocast_mode._enter_autocast(device_type, dtype, enabled, cache_enabled)
    return _entered(torch.amp.autocast_mode._exit_autocast, mode, (device_type, enabled))


_COMPILED_AUTOCAST = "torch.compile cannot run this plan's autocast region exactly: "


def exit_region(region: tuple) -> None:
    """Graph node for leaving a region entered by one of the ``enter_*`` nodes."""
    leave, state, autocast = region
    if not torch.compiler.is_compiling():
        regions = _open_regions()
        for i in range(len(regions) - 1, -1, -1):  # by identity: equal regions may be nested
            if regions[i] is region:
                del regions[i]
                break
    lost = autocast is not None and torch.is_autocast_enabled(autocast[0]) != autocast[1]
    leave(state)
    if lost:  # torch 2.13's Dynamo resumes after a graph break inside the region without it
        raise PlanningError(
            _COMPILED_AUTOCAST + "Dynamo lost it at a graph break inside it (a module or op "
            "it cannot trace), and computed the rest of the region in full precision. Compile "
            "with fullgraph=True (and make the region traceable), or run the plan without "
            "torch.compile. (The compiled part entered the region: autocast counts it as "
            "still open in this process, so its weight casts are kept until it exits.)"
        )


REGION_ENTRIES = (enter_grad_mode, enter_inference_mode, enter_autocast)


def autocast_region_open() -> bool:
    """Whether a ``torch.autocast`` region is open here, casting or not. Autocast empties its
    cache of weight casts when the outermost region exits, whether that region casts or not
    (``with torch.autocast("cpu", enabled=use_amp)``, ``use_amp=False``): inside one, the casts
    that forward's own regions make outlive the step."""
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth > 1


class ClosingRegions:
    """Exit the regions entered inside the block and left open by an exception (by any way out
    when ``always``), as the model's own ``with`` statements would have.

    A checkpointed segment needs it: non-reentrant checkpoint stops a recompute by raising once
    every saved tensor is back, possibly between a region's entry and exit nodes. A class whose
    methods Dynamo leaves to Python, not a generator: a frame that Dynamo runs eagerly (past its
    recompile limit) has the frames it calls traced, and a generator's cannot be (found by a
    rehearsal: "Attempt to trace generator"). Compiled code needs none: a compiled graph's
    regions are closed by the graph, and its recompute never stops early.
    """

    def __init__(self, *, always: bool = False):
        self.always = always

    @torch.compiler.disable
    def __enter__(self):
        self.depth = len(_open_regions())
        return self

    @torch.compiler.disable
    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None or self.always:
            _exit_regions_since(self.depth)


def _exit_regions_since(depth: int) -> None:
    regions = _open_regions()
    while len(regions) > depth:
        leave, state, _ = regions.pop()
        leave(state)


def region_spans(nodes: list[fx.Node]) -> list[tuple[int, int]]:
    """``(entry, exit)`` positions in ``nodes`` of each recorded region; a region never exited
    (``torch.set_grad_enabled(False)`` called as a function) lasts to the last node."""
    position = {node: i for i, node in enumerate(nodes)}
    spans = []
    for i, node in enumerate(nodes):
        if node.op == "call_function" and node.target in REGION_ENTRIES:
            exits = [position[u] for u in node.users if u.target is exit_region and u in position]
            spans.append((i, max(exits, default=len(nodes) - 1)))
    return spans


def _region_tracer():
    """The tracer to record a region switch in: only while fx traces in this thread, and only
    the forward's own switches (not those a patched context manager makes inside itself)."""
    if getattr(capturing, "depth", 0):
        return None
    return getattr(capturing, "tracer", None)


@contextlib.contextmanager
def _inside_patched_method():
    capturing.depth = getattr(capturing, "depth", 0) + 1
    try:
        yield
    finally:
        capturing.depth -= 1


GRAD_SWITCH = "planner.grad_switch"  # node.meta of an exported _set_grad_enabled: (role, key)


class _ExportedRegions:
    """What forward's own context managers did while torch.export captured it: which of the
    exported ``_set_grad_enabled`` nodes each grad-mode region's entry and exit made (tagged
    ``GRAD_SWITCH``: export's nodes name a mode, not the region), and whether forward entered
    a region export records no node for (``torch.inference_mode``: its graph computes the
    region with gradients, found by review)."""

    def __init__(self):
        self.open: list = []
        self.keys: dict[int, tuple[object, list[int]]] = {}  # id(manager) -> (it, open keys)
        self.count = 0
        self.inference = False

    def entered(self, manager, switches: list[fx.Node], by_fake_tensors: bool) -> None:
        inference = isinstance(manager, torch.autograd.grad_mode.inference_mode)
        if inference and manager.mode and not by_fake_tensors:
            self.inference = True
        self.open.append(manager)
        if switches:
            self.count += 1
            self.keys.setdefault(id(manager), (manager, []))[1].append(self.count)
            for node in switches:
                node.meta[GRAD_SWITCH] = ("enter", self.count)

    def exited(self, manager, switches: list[fx.Node]) -> None:
        if manager in self.open:
            self.open.remove(manager)
        keys = self.keys.get(id(manager), (None, []))[1]
        if switches and keys:
            key = keys.pop()
            for node in switches:
                node.meta[GRAD_SWITCH] = ("exit", key)


def _exported_regions() -> _ExportedRegions | None:
    return None if getattr(capturing, "depth", 0) else getattr(capturing, "exporting", None)


def _export_graph() -> fx.Graph | None:
    """The graph torch.export's pre-dispatch tracing is recording, if it is running."""
    from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode

    for mode in torch.overrides._get_current_function_mode_stack():
        if isinstance(mode, PreDispatchTorchFunctionMode):
            return mode.tracer.graph
    return None


@contextlib.contextmanager
def _grad_switches_made(exported: _ExportedRegions | None):
    """Yields a list, filled when the block ends, of the ``_set_grad_enabled`` nodes torch.export
    recorded during it (while ``exported`` watches a capture)."""
    graph = _export_graph() if exported is not None else None
    last = next(iter(reversed(graph.nodes)), None) if graph is not None else None
    made: list[fx.Node] = []
    yield made
    if graph is not None:
        for node in reversed(graph.nodes):
            if node is last:
                break
            if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
                made.insert(0, node)


def _recording_entry(original, node_of):
    @functools.wraps(original)
    def entry(manager, *args, **kwargs):
        tracer, exported = _region_tracer(), _exported_regions()
        with _inside_patched_method(), _grad_switches_made(exported) as switches:
            result = original(manager, *args, **kwargs)
        if tracer is not None:
            target, node_args = node_of(manager)
            node = tracer.create_node("call_function", target, node_args, {})
            tracer.open_regions[id(manager)] = (manager, node)
        if exported is not None:
            exported.entered(manager, switches, _by_fake_tensors(sys._getframe(1)))
        return result

    return entry


def _by_fake_tensors(frame) -> bool:
    """Whether a region is entered by torch's fake tensors, not by forward: a fake copy of an
    inference tensor (an input or buffer made in inference mode) is made in inference mode
    (found by review: export of such a model was refused as if forward entered one)."""
    return os.path.join("torch", "_subclasses") in frame.f_code.co_filename


def _recording_exit(original):
    @functools.wraps(original)
    def exit_(manager, *args, **kwargs):
        tracer = _region_tracer()
        if tracer is not None:
            entered = tracer.open_regions.pop(id(manager), None)
            if entered is None:  # any error here sends capture to torch.export
                raise RuntimeError(
                    f"a {type(manager).__name__} region entered outside forward ends inside it"
                )
            tracer.create_node("call_function", exit_region, (entered[1],), {})
        exported = _exported_regions()
        with _inside_patched_method(), _grad_switches_made(exported) as switches:
            result = original(manager, *args, **kwargs)
        if exported is not None:
            exported.exited(manager, switches)
        return result

    return exit_


def _region_patches() -> list[tuple[type, str, object]]:
    """(class, method name, replacement) for every grad-mode and autocast context manager."""
    grad = torch.autograd.grad_mode
    autocast = torch.amp.autocast_mode.autocast
    entries = [
        (grad.no_grad, "__enter__", lambda m: (enter_grad_mode, (False,))),
        (grad.enable_grad, "__enter__", lambda m: (enter_grad_mode, (True,))),
        (grad.set_grad_enabled, "__init__", lambda m: (enter_grad_mode, (m.mode,))),
        (grad.inference_mode, "__enter__", lambda m: (enter_inference_mode, (m.mode,))),
        (
            autocast,
            "__enter__",
            lambda m: (enter_autocast, (m.device, m.fast_dtype, m._enabled, m._cache_enabled)),
        ),
    ]
    exits = [
        (grad.no_grad, "__exit__"),
        (grad.enable_grad, "__exit__"),
        (grad.set_grad_enabled, "__exit__"),
        (grad.set_grad_enabled, "__call__"),  # as a decorator it restores the previous mode
        (grad.inference_mode, "__exit__"),
        (autocast, "__exit__"),
    ]
    # Only methods each class defines itself (a torch version without one inherits it).
    return [
        (cls, name, _recording_entry(cls.__dict__[name], node_of))
        for cls, name, node_of in entries
        if name in cls.__dict__
    ] + [
        (cls, name, _recording_exit(cls.__dict__[name]))
        for cls, name in exits
        if name in cls.__dict__
    ]


@contextlib.contextmanager
def recording_regions():
    """Patch the context managers for the duration of a capture (they act only when the
    capturing thread traces; see ``_region_tracer``)."""
    patches = _region_patches()
    originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in patches]
    for cls, name, replacement in patches:
        setattr(cls, name, replacement)
    try:
        yield
    finally:
        for cls, name, original in reversed(originals):
            setattr(cls, name, original)


class InexactRegions(RuntimeError):
    """An exported graph switches grad mode where no region of forward begins or ends."""


def regions_from_export(gm: fx.GraphModule, *, cache_enabled: bool) -> None:
    """Turn torch.export's switch nodes into the region nodes ``symbolic_trace`` records.

    ``_enter_autocast``/``_exit_autocast`` (the exit reads its entry) become ``enter_autocast``
    and ``exit_region``; ``cache_enabled`` replaces the weight-cast cache setting export recorded
    (off: it traces without the cache), so that the module caches as the model does (a region
    that turns the cache off itself is not told apart). A ``_set_grad_enabled`` node names a
    mode, not a region: the tags ``GRAD_SWITCH`` that capture put on it say which region's entry
    or exit made it, so that the exit restores the mode current on entry (the caller's, say)
    rather than the mode export traced under. An untagged switch to the mode just entered (the
    ``__enter__`` of ``torch.set_grad_enabled(b)`` after its ``__init__``) changes nothing and
    goes; any other raises ``InexactRegions``.
    """
    graph = gm.graph
    entries: dict[int, fx.Node] = {}
    entered_mode = None  # the grad mode the last switch entered, while no exit followed

    def replace(node: fx.Node, target, args: tuple) -> fx.Node:
        with graph.inserting_before(node):
            region = graph.call_function(target, args)  # named after its target, as traced
        node.replace_all_uses_with(region)
        graph.erase_node(node)
        return region

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.amp.autocast_mode._enter_autocast:
            device, dtype, enabled, _ = node.args
            replace(node, enter_autocast, (device, dtype, enabled, cache_enabled))
        elif node.target is torch.amp.autocast_mode._exit_autocast:
            replace(node, exit_region, node.args)
        elif node.target is torch._C._set_grad_enabled:
            (mode,) = node.args
            role, key = node.meta.get(GRAD_SWITCH, (None, None))
            if role == "enter":
                entries[key], entered_mode = replace(node, enter_grad_mode, (mode,)), mode
            elif role == "exit" and key in entries:
                replace(node, exit_region, (entries.pop(key),))
                entered_mode = None
            elif role is None and mode == entered_mode:
                graph.erase_node(node)
            else:
                raise InexactRegions(
                    f"the exported graph switches grad mode to {mode} at {node.format_node()} "
                    "where no grad-mode region of forward begins or ends (a direct "
                    "torch._C._set_grad_enabled call?)"
                )
    graph.lint()
    gm.recompile()


def _skipped_when_exporting(name: str):
    """torch.export's pass ``name``, made to leave the graph as it is in the capturing thread;
    None where this torch has no such pass (then export does not run it either)."""
    import importlib

    try:
        module = importlib.import_module(f"torch._export.passes.{name}")
    except ImportError:
        return None
    original = getattr(module, name)

    @functools.wraps(original)
    def skipped(gm, signature):
        return (gm, signature) if _exported_regions() is not None else original(gm, signature)

    return module, name, original, skipped


@contextlib.contextmanager
def watching_exported_regions():
    """Watch the regions of a torch.export capture in this thread, and keep its switch nodes:
    its passes would fold each region into one higher-order-op node, and (torch 2.13) drop a
    grad-mode region inside ``torch.autocast`` while doing so."""
    found = (
        _skipped_when_exporting(name)
        for name in ("replace_set_grad_with_hop_pass", "replace_autocast_with_hop_pass")
    )
    passes = [patch for patch in found if patch is not None]
    regions = _ExportedRegions()
    capturing.exporting = regions
    for module, name, _, skipped in passes:
        setattr(module, name, skipped)
    try:
        yield regions
    finally:
        for module, name, original, _ in reversed(passes):
            setattr(module, name, original)
        capturing.exporting = None
