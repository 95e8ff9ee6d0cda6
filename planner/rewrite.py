"""Rewrite: build the planned module, in which each chosen segment runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

The planned module is an ``fx.GraphModule`` whose children, parameters and buffers are the user's
own objects, so its ``state_dict`` has the same keys and trains the same tensors. Each segment is
a small GraphModule kept in a plain attribute ``segment_<k>`` (not registered as a child, so
parameter and ``state_dict`` listings stay unchanged); it reaches the same leaf modules, and takes
parameters read through ``get_attr`` as explicit inputs so that ``.to()`` never leaves it stale.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from planner.graph import compute_nodes


class Segment:
    """A checkpointed piece of the graph: callable, plus the buffers its recompute must restore.

    A BatchNorm in training mode updates its running statistics on every call, so recomputing
    it would update them twice; ``contexts`` snapshots those buffers before a recompute and puts
    them back after, leaving them exactly as one forward leaves them.
    """

    def __init__(self, body: fx.GraphModule, buffers: tuple[torch.Tensor, ...]):
        self.body = body
        self.buffers = buffers

    def __call__(self, *args):
        return self.body(*args)

    def contexts(self):
        return contextlib.nullcontext(), self._restoring_buffers()

    @contextlib.contextmanager
    def _restoring_buffers(self):
        with torch.no_grad():
            saved = [b.clone() for b in self.buffers]
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in zip(self.buffers, saved):
                    buffer.copy_(value)

    def __repr__(self):
        return f"Segment({len(self.body.graph.nodes)} nodes, restores {len(self.buffers)} buffers)"


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


def _box(value):
    return _Box(value)


def _unbox(box):
    return box.value


def _share_user_state(planned: nn.Module, model: nn.Module) -> None:
    """Make ``planned`` own the user's children, parameters and buffers (same objects, same
    order, so that ``state_dict`` keys come out identical); anything only the captured graph
    has (constants, export's guards) follows them."""
    for table in ("_modules", "_parameters", "_buffers"):
        own, users = getattr(planned, table), getattr(model, table)
        merged = {**users, **{k: v for k, v in own.items() if k not in users}}
        own.clear()
        own.update(merged)
    planned._non_persistent_buffers_set |= model._non_persistent_buffers_set


def _holder(captured: fx.GraphModule, model: nn.Module) -> nn.Module:
    """A module holding the user's state, plus what only the captured graph has (constants)."""
    holder = nn.Module()
    _share_user_state(holder, model)
    for node in captured.graph.find_nodes(op="get_attr") + captured.graph.find_nodes(
        op="call_module"
    ):
        top = node.target.split(".")[0]
        if not hasattr(holder, top):
            setattr(holder, top, getattr(captured, top))
    return holder


def _is_buffer(holder: nn.Module, node: fx.Node) -> bool:
    """Whether ``node`` reads a tensor of ``holder`` that is not a parameter (a buffer)."""
    if node.op != "get_attr":
        return False
    value = operator.attrgetter(node.target)(holder)
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)


def _segment_buffers(holder: nn.Module, members: list[fx.Node], inputs: list[fx.Node]):
    """Buffers a segment can write: those of the modules it calls and those it reads directly."""
    buffers = {}
    for node in members:
        if node.op == "call_module":
            for b in holder.get_submodule(node.target).buffers():
                buffers[id(b)] = b
    for node in inputs:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(holder)
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                buffers[id(value)] = value
    return tuple(buffers.values())


def rewrite(captured: fx.GraphModule, model: nn.Module, segments) -> fx.GraphModule:
    """A GraphModule computing what ``captured`` computes, with ``segments`` checkpointed.

    ``segments`` are ``(start, stop)`` positions over ``planner.graph.compute_nodes(captured)``.
    """
    holder = _holder(captured, model)
    nodes = compute_nodes(captured)
    first = {nodes[start]: (k, nodes[start:stop]) for k, (start, stop) in enumerate(segments)}
    inside = {node for _, members in first.values() for node in members}

    graph = fx.Graph()
    graph._codegen = captured.graph._codegen  # keeps torch.export's input/output pytree handling
    env: dict[fx.Node, fx.Node] = {}
    for node in captured.graph.nodes:
        if node in first:
            k, members = first[node]
            _checkpoint_segment(graph, env, holder, f"segment_{k}", members)
        elif node not in inside and node not in env:
            env[node] = graph.node_copy(node, lambda n: env[n])

    planned = fx.GraphModule(holder, graph, class_name=f"Planned{type(model).__name__}")
    _share_user_state(planned, model)
    # Only the flag, not .train()/.eval(): those would recurse into the user's own children.
    planned.training = holder.training = model.training
    planned.graph.lint()
    planned.recompile()
    return planned


def _checkpoint_segment(graph, env, holder, name: str, members: list[fx.Node]) -> None:
    """Append to ``graph`` a checkpoint call of ``members`` as a ``Segment`` named ``name``."""
    member_set = set(members)
    inputs = list(
        dict.fromkeys(a for m in members for a in m.all_input_nodes if a not in member_set)
    )
    outputs = [m for m in members if any(u not in member_set for u in m.users)]
    boxed = {a for a in inputs if _is_buffer(holder, a)}
    body = fx.Graph()
    body_env = {a: body.placeholder(a.name) for a in inputs}
    for a in inputs:
        if a in boxed:
            body_env[a] = body.call_function(_unbox, (body_env[a],))
    for m in members:
        body_env[m] = body.node_copy(m, lambda n: body_env[n])
    body.output(tuple(body_env[m] for m in outputs))
    segment = Segment(fx.GraphModule(holder, body), _segment_buffers(holder, members, inputs))
    holder.__dict__[name] = segment  # a plain attribute, not a child: state_dict stays the user's

    for a in inputs:
        if a not in env:  # a get_attr that the graph lists after the segment's first node
            env[a] = graph.node_copy(a, lambda n: env[n])
    callee = graph.get_attr(name)
    kwargs = {"use_reentrant": False, "preserve_rng_state": True}
    if segment.buffers:
        kwargs["context_fn"] = graph.call_function(getattr, (callee, "contexts"))
    args = (
        callee,
        *[graph.call_function(_box, (env[a],)) if a in boxed else env[a] for a in inputs],
    )
    call = graph.create_node("call_function", checkpoint, args, kwargs, name=f"{name}_outputs")
    for index, m in enumerate(outputs):
        env[m] = graph.create_node("call_function", operator.getitem, (call, index), name=m.name)
