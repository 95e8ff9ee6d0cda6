"""In-place writes and buffers in captured graphs: traced as eager mode runs them, and
recognised where a segment must restore, or must not recompute, what they write.

* fx's ``Proxy`` has no in-place operators, so under ``symbolic_trace`` Python runs ``h += 1``
  as ``h = h + 1``, and the graph loses the write wherever ``h`` is a view
  (``v = h[:, :2]; v += 1`` changes ``h`` in eager mode, and nothing in the graph).
  ``InPlaceProxy`` records a node ``iadd(v, 1)`` (and its kin) that runs ``operator.iadd``;
  it refuses ``proxy.data = ...``, which would set an attribute of the proxy and record nothing.
  Item assignments (``h[:, :k] = 0``), which fx's ``Proxy`` refuses, are recorded as ``setitem``
  nodes.
* ``BufferProxy``: a buffer read as a graph node (``planner.capture`` traces so where forward
  runs ops on a buffer alone).
* ``updates_in_place`` and ``BufferReads``: which nodes write their first argument, and which
  buffer a node is or was computed from (``planner.problem``'s pins, ``planner.rewrite``'s
  restores); ``write_back``: torch.export's write-back of a buffer, skipped onto itself.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["BufferProxy", "BufferReads", "InPlaceProxy", "updates_in_place", "write_back"]


def _augmented(operation):
    """``operation`` (``operator.iadd``...) as a graph node of its own name: fx writes its
    ``operator`` nodes back as statements (``a += b``), which would rebind the variable ``a``
    where it holds a size or a tuple, which Python never changes in place."""

    def assign(target, value):
        return operation(target, value)

    assign.__name__ = assign.__qualname__ = operation.__name__
    return assign


# Python's augmented assignments: the operator, and the node that runs it.
_AUGMENTED = {
    name: _augmented(getattr(operator, name))
    for name in (
        "iadd", "iand", "ifloordiv", "ilshift", "imod", "imul", "imatmul", "ior", "ipow",
        "irshift", "isub", "itruediv", "ixor",
    )
}  # fmt: skip
globals().update(_AUGMENTED)  # importable by name, as fx names a node's function
_PROXY_FIELDS = frozenset({"node", "tracer"})  # what fx.Proxy.__init__ sets


def setitem(target, index, value):
    """``target[index] = value`` as a graph node, which returns ``target``: fx writes
    ``operator.setitem`` back as the statement, and the node's value would then be None."""
    target[index] = value
    return target


class InPlaceProxy(fx.Proxy):
    """A ``Proxy`` whose augmented and item assignments are recorded in place, as eager mode
    runs them."""

    def __setitem__(self, index, value) -> None:
        self.tracer.create_proxy("call_function", setitem, (self, index, value), {})

    def __setattr__(self, name: str, value) -> None:
        if name not in _PROXY_FIELDS:
            raise RuntimeError(
                f"forward sets .{name} of a traced tensor, which symbolic_trace cannot record"
            )
        super().__setattr__(name, value)


def _recording(node_function):
    def augmented(self, other):
        return self.tracer.create_proxy("call_function", node_function, (self, other), {})

    return augmented


for _operation, _node_function in _AUGMENTED.items():
    setattr(InPlaceProxy, f"__{_operation}__", _recording(_node_function))
_AUGMENTED_NODES = frozenset(_AUGMENTED.values())


class BufferProxy(InPlaceProxy):
    """A buffer read as a graph node, which forward's Python checks see as eager mode sees the
    buffer: a tensor (``isinstance(self.mask, torch.Tensor)``, ``torch.is_tensor``), of the
    buffer's dtype, device and number of dimensions as Python values (``self.scale.dtype is
    torch.float32``). A graph bakes such branches in; the planned module runs the model itself
    once the model's dtypes change."""

    _buffer: torch.Tensor
    _is_param = False  # what nn.Parameter's and nn.Buffer's isinstance checks read
    _is_buffer = False  # (a registered buffer is a plain tensor)

    def __init__(self, node: fx.Node, tracer, buffer: torch.Tensor):
        super().__init__(node, tracer)
        object.__setattr__(self, "_buffer", buffer)

    @property  # type: ignore[misc]
    def __class__(self):
        return type(self._buffer)

    @property
    def ndim(self) -> int:
        return self._buffer.ndim

    def dim(self) -> int:
        return self._buffer.dim()

    @property
    def dtype(self) -> torch.dtype:
        return self._buffer.dtype

    @property
    def device(self) -> torch.device:
        return self._buffer.device


def write_back(buffer: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Graph node: ``buffer.copy_(value)``, skipped when ``value`` is ``buffer`` itself.

    torch.export writes back ``self.calls += 1`` (an in-place add) by copying the result, the
    buffer, into the buffer. The copy changes no value but bumps the buffer's version, and
    backward would then refuse the buffer that autograd saved, where the model trains.
    """
    same = (
        value.untyped_storage()._cdata == buffer.untyped_storage()._cdata
        and value.storage_offset() == buffer.storage_offset()
        and value.shape == buffer.shape
        and value.stride() == buffer.stride()
        and value.dtype == buffer.dtype
    )
    return buffer if same else buffer.copy_(value)


def _name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def updates_in_place(node) -> bool:
    """Whether ``node`` writes its first argument in place and returns it: an ATen in-place op
    or a write-back (a ``torch.export`` graph), or under ``symbolic_trace`` a tensor method or
    torch function named so (``buffer.mul_(0.9)``, ``torch.relu_(x)``) or an augmented
    assignment."""
    if not isinstance(node, fx.Node) or not node.args or node.op == "call_module":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        result = schema.returns[0].alias_info if len(schema.returns) == 1 else None
        return bool(first and first.is_write and result and result.before_set == first.before_set)
    if target is write_back or target is setitem or target in _AUGMENTED_NODES:
        return True
    name = _name(node)
    return name.endswith("_") and not name.startswith("_")


class BufferReads:
    """Which buffer of ``module`` each node of its graph is, or reads, each chain of in-place
    nodes walked once (a residual stream written ``h += block(h)`` is a chain as long as the
    model, which every node's question would walk again), and which of the modules it calls
    hold buffers."""

    def __init__(self, module: torch.nn.Module, storages: dict[int, str] | None = None):
        self.module = module
        # Storage -> buffer name, ``gm.meta["planner.buffer_storages"]`` from the profile, read
        # with each node's ``planner.output_storages``; None without a profile.
        self.storages = storages
        self.roots: dict[tuple[fx.Node, bool], fx.Node | None] = {}
        self.holders: dict[str, bool] = {}

    def __call__(self, node, *, derived: bool = False) -> str | None:
        """The target of the buffer (a tensor of the module that is not a parameter) ``node``
        is, or returns after in-place ops on it (``buffer.mul_(0.9)``: the buffer itself); with
        ``derived``, also one ``node`` is computed from through first arguments (a view of it,
        ``buffer[:4]``, ``buffer.unsqueeze(0)``, or ``buffer.type_as(x)``, which may be the
        buffer itself)."""
        path = []
        while isinstance(node, fx.Node) and (
            updates_in_place(node)
            or (derived and node.op in ("call_method", "call_function") and node.args)
        ):
            if (node, derived) in self.roots:
                node = self.roots[node, derived]
                break
            path.append(node)
            node = node.args[0]
        root = node if isinstance(node, fx.Node) and node.op == "get_attr" else None
        self.roots.update(dict.fromkeys([(step, derived) for step in path], root))
        if root is None:
            return None
        target = str(root.target)
        value = operator.attrgetter(target)(self.module)
        is_buffer = isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
        return target if is_buffer else None

    def restored(self, node) -> str | None:
        """The buffer a segment taking ``node`` as an input restores around its recompute and
        passes by reference: the one ``node`` is (directly, or after in-place ops on it), or
        whose storage its output lives in, as the profile saw it (a view, ``buffer.type_as(x)``
        returning the buffer itself, ``nn.Identity()(buffer)``, an item of
        ``torch.broadcast_tensors``); without a profile, one ``node`` was computed from."""
        if (target := self(node)) is not None:
            return target
        keys = node.meta.get("planner.output_storages") if isinstance(node, fx.Node) else None
        if self.storages is None or keys is None:
            return self(node, derived=True)
        return next((self.storages[key] for key in sorted(keys) if key in self.storages), None)

    def holds_buffers(self, target: str) -> bool:
        """Whether the module called as ``target`` holds buffers (its own, or its children's)."""
        if target not in self.holders:
            module = self.module.get_submodule(target)
            self.holders[target] = next(module.buffers(), None) is not None
        return self.holders[target]
