"""Grad-mode and autocast regions of forward, kept through capture; and the capturing thread.

``symbolic_trace`` runs a ``with torch.no_grad():`` (or ``torch.autocast(...)``) block once, on
proxies, and records no trace of the switch. While a capture runs, the context managers are
patched (``recording_regions``) so that entering and exiting one is recorded as a node calling
``enter_grad_mode``, ``enter_inference_mode``, ``enter_autocast`` or ``exit_region``, which do
at run time what the context manager does. ``torch.export`` records an autocast block as one
``wrap_with_autocast`` node, which ``inline_autocast`` turns back into such a region.
Every patch acts only in the capturing thread (``capturing``), one capture at a time
(``CAPTURE_LOCK``).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch import fx

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

_open = threading.local()  # .regions: context managers entered by those nodes, not yet exited


def _open_regions() -> list:
    if not hasattr(_open, "regions"):
        _open.regions = []
    return _open.regions


def _entered(region):
    _open_regions().append(region)
    return region


def enter_grad_mode(enabled: bool):
    """Graph node for ``torch.no_grad()``, ``torch.enable_grad()``, ``set_grad_enabled(...)``."""
    return _entered(torch.set_grad_enabled(enabled))  # switches now; its __exit__ restores


def enter_inference_mode(mode: bool):
    """Graph node for ``torch.inference_mode(mode)``."""
    region = torch.inference_mode(mode)
    region.__enter__()
    return _entered(region)


def enter_autocast(device_type: str, dtype: torch.dtype, enabled: bool, cache_enabled: bool):
    """Graph node for ``torch.autocast(...)`` (arguments as resolved when it was traced)."""
    region = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    region.__enter__()
    return _entered(region)


def exit_region(region) -> None:
    """Graph node for leaving a region entered by one of the ``enter_*`` nodes."""
    regions = _open_regions()
    if region in regions:
        regions.remove(region)
    region.__exit__(None, None, None)


REGION_ENTRIES = (enter_grad_mode, enter_inference_mode, enter_autocast)


@contextlib.contextmanager
def closing_regions(*, always: bool):
    """Exit the regions entered inside the block and left open by an exception (by any way out
    when ``always``), as the model's own ``with`` statements would have.

    A checkpointed segment needs it: non-reentrant checkpoint stops a recompute by raising once
    every saved tensor is back, possibly between a region's entry and exit nodes.
    """
    depth = len(_open_regions())
    try:
        yield
    except BaseException:
        _exit_regions_since(depth)
        raise
    if always:
        _exit_regions_since(depth)


def _exit_regions_since(depth: int) -> None:
    regions = _open_regions()
    while len(regions) > depth:
        regions.pop().__exit__(None, None, None)


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


class _ExportedRegions:
    """Regions that forward enters while torch.export captures it, and the nestings torch.export
    (2.13) captures wrongly: a grad-mode region inside ``torch.autocast`` is dropped (the
    exported module computes gradients that the model does not), an autocast inside autocast
    fails when run."""

    def __init__(self):
        self.open: list = []
        self.inside_autocast: list[str] = []


def _exported_regions() -> _ExportedRegions | None:
    return None if getattr(capturing, "depth", 0) else getattr(capturing, "exporting", None)


def _recording_entry(original, node_of):
    @functools.wraps(original)
    def entry(manager, *args, **kwargs):
        tracer, exported = _region_tracer(), _exported_regions()
        with _inside_patched_method():
            result = original(manager, *args, **kwargs)
        if tracer is not None:
            target, node_args = node_of(manager)
            node = tracer.create_node("call_function", target, node_args, {})
            tracer.open_regions[id(manager)] = (manager, node)
        if exported is not None:
            if any(isinstance(m, torch.amp.autocast_mode.autocast) for m in exported.open):
                exported.inside_autocast.append(type(manager).__name__)
            exported.open.append(manager)
        return result

    return entry


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
        if exported is not None and manager in exported.open:
            exported.open.remove(manager)
        with _inside_patched_method():
            return original(manager, *args, **kwargs)

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


def inline_autocast(gm: fx.GraphModule, *, cache_enabled: bool) -> None:
    """Replace each ``wrap_with_autocast`` node of an exported graph (one node that runs a
    whole ``torch.autocast`` block of forward as a submodule) by the block's own nodes between
    ``enter_autocast`` and ``exit_region`` nodes, as ``symbolic_trace`` records a region.

    As one node, the block could not be cut: a forward run entirely under autocast had no
    segment to checkpoint. ``cache_enabled`` replaces the weight-cast cache setting that
    torch.export recorded (off: it traces without the cache), so that the module caches as the
    model does (a region that turns the cache off itself is not told apart).
    """
    from torch._higher_order_ops.wrap import wrap_with_autocast

    graph = gm.graph
    for node in graph.find_nodes(op="call_function", target=wrap_with_autocast):
        device, dtype, enabled, _, body, *operands = node.args
        block = getattr(gm, body.target)
        inline_autocast(block, cache_enabled=cache_enabled)  # regions nested in the block
        env: dict[fx.Node, fx.node.Argument] = dict(
            zip(block.graph.find_nodes(op="placeholder"), operands, strict=True)
        )
        with graph.inserting_before(node):
            entry = graph.call_function(enter_autocast, (device, dtype, enabled, cache_enabled))
            for inner in block.graph.nodes:
                if inner.op == "get_attr":
                    name = f"{body.target}_{inner.target}".replace(".", "_")
                    setattr(gm, name, getattr(block, inner.target))
                    env[inner] = graph.get_attr(name)
                elif inner.op == "output":
                    results = fx.map_arg(inner.args[0], env.__getitem__)
                elif inner.op != "placeholder":
                    env[inner] = graph.node_copy(inner, env.__getitem__)
            graph.call_function(exit_region, (entry,))
        for user in list(node.users):  # getitem nodes: the block returns a tuple
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not body.users:
            graph.erase_node(body)
            delattr(gm, body.target)
    graph.lint()
    gm.recompile()


@contextlib.contextmanager
def watching_exported_regions():
    regions = _ExportedRegions()
    capturing.exporting = regions
    try:
        yield regions
    finally:
        capturing.exporting = None
