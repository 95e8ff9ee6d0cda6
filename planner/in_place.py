"""In-place writes and views in captured graphs: traced as eager mode makes them, and
recognised where a segment must restore, or must not recompute, what they write.

fx's ``Proxy`` has no in-place operators, so under ``symbolic_trace`` Python runs ``h += 1`` as
``h = h + 1``, and the graph loses the write wherever ``h`` is a view (``v = h[:, :2]; v += 1``
changes ``h`` in eager mode, and nothing in the graph). ``InPlaceProxy`` records
``operator.iadd`` and its kin instead, which the graph's code writes back as ``v += 1``; and it
refuses ``proxy.data = ...``, which would set an attribute of the proxy and record nothing.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx

__all__ = ["BufferProxy", "InPlaceProxy", "buffer_read", "updates_in_place", "write_back"]

# Python's augmented assignments, as fx's code generation writes them back (``a += b``).
_AUGMENTED = tuple(
    getattr(operator, name)
    for name in (
        "iadd", "iand", "ifloordiv", "ilshift", "imod", "imul", "imatmul", "ior", "ipow",
        "irshift", "isub", "itruediv", "ixor",
    )
)  # fmt: skip
_PROXY_FIELDS = frozenset({"node", "tracer"})  # what fx.Proxy.__init__ sets


class InPlaceProxy(fx.Proxy):
    """A ``Proxy`` whose augmented assignments are recorded in place, as eager mode runs them."""

    def __setattr__(self, name: str, value) -> None:
        if name not in _PROXY_FIELDS:
            raise RuntimeError(
                f"forward sets .{name} of a traced tensor, which symbolic_trace cannot record"
            )
        super().__setattr__(name, value)


def _recording(function):
    def augmented(self, other):
        return self.tracer.create_proxy("call_function", function, (self, other), {})

    return augmented


for _function in _AUGMENTED:
    setattr(InPlaceProxy, f"__{_function.__name__}__", _recording(_function))


class BufferProxy(InPlaceProxy):
    """A buffer read as a graph node, which forward's Python checks see as eager mode sees the
    buffer: a tensor (``isinstance(self.mask, torch.Tensor)``, ``torch.is_tensor``), of the
    buffer's dtype and device as Python values (``self.scale.dtype is torch.float32``). A
    graph bakes such branches in; the planned module runs the model itself once the model's
    dtypes change."""

    _buffer: torch.Tensor

    def __init__(self, node: fx.Node, tracer, buffer: torch.Tensor):
        super().__init__(node, tracer)
        object.__setattr__(self, "_buffer", buffer)

    @property  # type: ignore[misc]
    def __class__(self):
        return type(self._buffer)

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
    if target is write_back or target in _AUGMENTED:
        return True
    name = _name(node)
    return name.endswith("_") and not name.startswith("_")


@functools.cache
def _view_op(name: str) -> bool:
    """Whether the ATen op ``name`` may return a view of its input: an overload whose result
    aliases an argument it does not write (``view``, ``transpose``, ``reshape``, ``detach``)."""
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(
        result.alias_info is not None and not result.alias_info.is_write
        for overload in packet.overloads()
        for result in getattr(packet, overload)._schema.returns
    )


def _views_first(node: fx.Node) -> bool:
    """Whether ``node``'s result may be a view of its first argument (``h[:, :2]``, ``.data``,
    ``x.view(...)``, ``aten.unsqueeze``)."""
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    if node.target in (operator.getitem, getattr):
        return True
    return _view_op(_name(node))


def buffer_read(module: torch.nn.Module, node, *, through_views: bool = False) -> str | None:
    """The target of the buffer (a tensor of ``module`` that is not a parameter) that ``node``
    is, or returns after in-place ops on it (``buffer.mul_(0.9)``: the buffer itself); with
    ``through_views``, also one ``node`` is a view of (``buffer[:4]``, ``buffer.unsqueeze(0)``)."""
    while isinstance(node, fx.Node) and (
        updates_in_place(node) or (through_views and _views_first(node))
    ):
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    target = str(node.target)
    value = operator.attrgetter(target)(module)
    is_buffer = isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
    return target if is_buffer else None
