"""Exact attention for exported models: SDPA calls put back in the form eager mode uses.

Hugging Face decoders (Llama, Mistral, Qwen2, Gemma, Mixtral, ...) called without an attention
mask run ``scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
enable_gqa=True)`` in eager mode. Under ``torch.export`` they cannot read the values that
decision depends on, so the exported graph builds a B x 1 x S x S causal mask, repeats the
key/value heads and passes both to SDPA: another kernel path, gradients that differ in the last
bits, and a mask held in memory.

``restore_causal_attention`` rewrites such a call back to eager's form only where both are
known to agree:

* one eager forward of the model (no grad, RNG state restored) records, call by call, the form
  eager mode uses; an exported SDPA node is paired with the eager call of the same position and
  head counts, and changed only if that call had no mask and ``is_causal=True``;
* the node's mask must depend on sizes only (no input value, no parameter, no random op), and
  evaluated it must be exactly the causal mask;
* repeated key/value heads are taken back to their source only where eager passed
  ``enable_gqa=True`` with that many heads.

A mask that depends on sizes only is one fixed tensor per shape. A graph with static shapes
takes one shape; with dynamic shapes, ``CausalMaskCheck`` evaluates the removed mask for every
new shape a call brings (once per shape) and raises where it is not the causal one.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import warnings
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from planner.errors import PlanningError

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SIZE = torch.ops.aten.sym_size.int
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
_REPEAT_VIEWS = (torch.ops.aten.reshape.default, torch.ops.aten.view.default)


@dataclass(frozen=True)
class EagerCall:
    """How eager mode called SDPA once: head counts and the form of the call."""

    query_heads: int
    key_heads: int
    without_mask: bool
    is_causal: bool
    enable_gqa: bool


class _RecordingAttention(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[EagerCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
            given = {**dict(zip(names, args)), **kwargs}
            self.calls.append(
                EagerCall(
                    query_heads=given["query"].shape[-3] if given["query"].dim() > 2 else 1,
                    key_heads=given["key"].shape[-3] if given["key"].dim() > 2 else 1,
                    without_mask=given.get("attn_mask") is None,
                    is_causal=bool(given.get("is_causal", False)),
                    enable_gqa=bool(given.get("enable_gqa", False)),
                )
            )
        return func(*args, **kwargs)


def eager_attention_calls(model: nn.Module, args: tuple, kwargs: dict) -> list[EagerCall]:
    """The SDPA calls of one eager forward of ``model``, in order (no gradients; the RNG state
    is restored, so that dropout draws stay those of the user's own step)."""
    devices = sorted({t.device.index or 0 for t in model.parameters() if t.is_cuda})
    with torch.random.fork_rng(devices=devices), torch.no_grad(), _RecordingAttention() as mode:
        model(*args, **kwargs)
    return mode.calls


def _mask_argument(node: fx.Node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _is_causal_argument(node: fx.Node) -> bool:
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))


def size_only(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes computing ``mask`` in graph order if it depends on tensor sizes only (reads
    no input value, parameter, buffer or random op); else None."""
    found: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        if node.op != "call_function":
            return None
        if node.target is _SIZE:
            found.add(node)  # a size of an input: the only way in from an input
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            if torch.Tag.nondeterministic_seeded in target.tags:
                return None
        elif getattr(target, "__module__", None) not in ("_operator", "operator"):
            return None  # anything else might read values: leave the mask as it is
        found.add(node)
        stack.extend(node.all_input_nodes)
    return [node for node in mask.graph.nodes if node in found]


def _whole_slice(node) -> bool:
    """Whether ``node`` is ``x[..., :, ...]``: an ``aten.slice`` that keeps everything."""
    return (
        isinstance(node, fx.Node)
        and node.target is torch.ops.aten.slice.Tensor
        and tuple(node.args[2:]) in ((0, sys.maxsize), (0, sys.maxsize, 1), ())
    )


def _through_whole_slices(node, chain: list[fx.Node]):
    while _whole_slice(node):
        chain.append(node)
        node = node.args[0]
    return node


def _repeat_chain(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(x, nodes)`` if ``node`` is ``x`` with its heads repeated (Hugging Face's
    ``repeat_kv``: ``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)``) by
    ``nodes``, else None."""
    if not (node.op == "call_function" and node.target in _REPEAT_VIEWS):
        return None
    chain = [node]
    expand = _through_whole_slices(node.args[0], chain)
    if not (isinstance(expand, fx.Node) and expand.target is torch.ops.aten.expand.default):
        return None
    chain.append(expand)
    unsqueeze = _through_whole_slices(expand.args[0], chain)
    if not (
        isinstance(unsqueeze, fx.Node)
        and unsqueeze.target is torch.ops.aten.unsqueeze.default
        and unsqueeze.args[1] == 2
    ):
        return None
    chain.append(unsqueeze)
    source = _through_whole_slices(unsqueeze.args[0], chain)
    if not (isinstance(source, fx.Node) and source.meta["val"].dim() == 4):
        return None
    b, h, s, d = source.meta["val"].shape
    expanded, repeated = expand.meta["val"].shape, node.meta["val"].shape
    n = expanded[2] if len(expanded) == 5 and len(repeated) == 4 else None
    if n is None or not all(
        _same_size(x, y)
        for x, y in zip((*expanded, *repeated), (b, h, n, s, d, b, h * n, s, d), strict=True)
    ):
        return None  # not each head repeated n times in place, as enable_gqa does
    return source, chain


def _heads(node: fx.Node) -> int:
    return int(node.meta["val"].shape[-3])


def is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether ``mask`` is SDPA's ``is_causal`` mask (lower triangle, upper-left aligned)."""
    if mask.dtype != torch.bool or mask.dim() < 2:
        return False
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return torch.equal(mask, causal.expand_as(mask))


def _same_size(a, b) -> bool:
    """Whether two sizes (ints, or symbolic sizes of a dynamic-shape graph) are equal for
    every input."""
    return bool(statically_known_true(a == b))


class CausalMaskCheck:
    """The masks a rewrite removed, as a function of the input sizes they were computed from:
    called with a call's inputs (as the captured graph takes them), it raises unless every
    mask is the causal one. Each shape is evaluated once."""

    def __init__(self, probe: fx.GraphModule, sizes: list[tuple[int, int]], in_spec):
        self.probe = probe  # input sizes -> the removed masks
        self.sizes = sizes  # (flat input position, dimension) of each probe input
        self.in_spec = in_spec
        self.checked: set[tuple[int, ...]] = set()

    def sizes_of(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        """The sizes the masks are computed from, in this call; None if it lacks a tensor
        they come from (such a call runs the model itself, see ``planner.rewrite``)."""
        flat = fx_pytree.tree_flatten_spec((args, kwargs), self.in_spec)
        tensors = [flat[position] for position, _ in self.sizes]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            return None
        return tuple(int(t.shape[dim]) for t, (_, dim) in zip(tensors, self.sizes))

    def check(self, sizes: tuple[int, ...]) -> None:
        if sizes in self.checked:
            return
        with torch.no_grad():
            masks = self.probe(*sizes)
        if not all(is_causal_mask(mask) for mask in masks):
            raise PlanningError(
                "at these input sizes the model masks attention with more than the causal "
                "mask (a sliding window, for instance), and the plan computes attention with "
                "SDPA's is_causal form instead of that mask: plan again with example inputs "
                "of these sizes."
            )
        self.checked.add(sizes)

    def __call__(self, args: tuple, kwargs: dict) -> None:
        sizes = self.sizes_of(args, kwargs)
        if sizes is not None:
            self.check(sizes)


@dataclass(frozen=True)
class _Rewrite:
    node: fx.Node
    mask: fx.Node
    computing: list[fx.Node]
    key: fx.Node  # the key and value eager mode passes
    value: fx.Node
    repeats: tuple[fx.Node, ...]  # the nodes that repeated their heads, if eager did not

    @property
    def enable_gqa(self) -> bool:
        return bool(self.repeats)


def _chosen(gm: fx.GraphModule, calls: list[EagerCall]) -> list[_Rewrite]:
    """The SDPA nodes of ``gm`` that eager mode calls without a mask and with ``is_causal``,
    whose mask is computed from sizes only, with the key and value eager mode passes."""
    nodes = list(gm.graph.find_nodes(op="call_function", target=SDPA))
    if len(nodes) != len(calls):
        return []  # eager and the graph do not call attention alike: pair nothing
    chosen = []
    for node, call in zip(nodes, calls):
        query, key, value = node.args[:3]
        mask = _mask_argument(node)
        if not (call.without_mask and call.is_causal and isinstance(mask, fx.Node)):
            continue
        if _heads(query) != call.query_heads or _is_causal_argument(node):
            continue
        computing = size_only(mask)
        dropped: tuple[fx.Node, ...] = ()
        if call.enable_gqa:
            key_chain, value_chain = _repeat_chain(key), _repeat_chain(value)
            if key_chain is None or value_chain is None:
                continue
            (key, key_repeats), (value, value_repeats) = key_chain, value_chain
            dropped = (*key_repeats, *value_repeats)
        if computing is None or _heads(key) != call.key_heads:
            continue
        sizes = mask.meta["val"].shape[-2:]
        lengths = (query.meta["val"].shape[-2], key.meta["val"].shape[-2])
        if all(_same_size(a, b) for a, b in zip(sizes, lengths)):
            chosen.append(_Rewrite(node, mask, computing, key, value, dropped))
    return chosen


def probe_masks(
    gm: fx.GraphModule, masks: list[fx.Node], computing: set[fx.Node]
) -> CausalMaskCheck:
    """A ``CausalMaskCheck`` computing ``masks`` (from the nodes ``computing``, in ``gm``)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    sizes: list[tuple[int, int]] = []
    for node in gm.graph.nodes:
        if node not in computing:
            continue
        if node.target is _SIZE:
            env[node] = graph.placeholder(f"size_{len(sizes)}")
            sizes.append((placeholders.index(node.args[0]), node.args[1]))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[mask] for mask in masks))
    in_spec = gm.graph._codegen.pytree_info.in_spec  # type: ignore[attr-defined]
    return CausalMaskCheck(fx.GraphModule(nn.Module(), graph), sizes, in_spec)


def restore_causal_attention(
    gm: fx.GraphModule, calls: list[EagerCall], args: tuple, kwargs: dict
) -> CausalMaskCheck | None:
    """Rewrite the SDPA nodes of ``gm`` (an exported module, called as ``gm(*args,
    **kwargs)``) that eager mode calls without a mask and with ``is_causal=True`` back to that
    form (see the module docstring). Returns the check that a call's sizes keep every removed
    mask causal, or None when nothing was rewritten."""
    if not hasattr(gm.graph._codegen, "pytree_info"):
        return None
    chosen = _chosen(gm, calls)
    if chosen:  # only masks that are causal at the example's sizes
        check = probe_masks(gm, [c.mask for c in chosen], {n for c in chosen for n in c.computing})
        example = check.sizes_of(args, kwargs)
        with torch.no_grad():
            masks = check.probe(*example) if example is not None else ()
        chosen = [c for c, mask in zip(chosen, masks) if is_causal_mask(mask)]
    if not chosen:
        return None
    check = probe_masks(gm, [c.mask for c in chosen], {n for c in chosen for n in c.computing})
    for c in chosen:
        dropout = c.node.args[4] if len(c.node.args) > 4 else c.node.kwargs.get("dropout_p", 0.0)
        kwargs_kept = {
            k: v
            for k, v in c.node.kwargs.items()
            if k not in ("attn_mask", "dropout_p", "is_causal", "enable_gqa")
        }
        c.node.args = (c.node.args[0], c.key, c.value, None, dropout, True)
        c.node.kwargs = {**kwargs_kept, **({"enable_gqa": True} if c.enable_gqa else {})}
    removed = {n for c in chosen for n in (*c.computing, *c.repeats)}
    erase_unused(gm, removed | _unused_size_only(gm))
    gm.graph.lint()
    gm.recompile()
    if example is not None:  # it is: the masks were evaluated at it
        check.checked.add(example)
    return check


def _unused_size_only(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computing tensors from sizes only that nothing uses, with what computes them
    (export leaves masks a model builds and does not use, such as a sliding-window mask for
    layers that all attend fully)."""
    unused: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor):
            if all(u.target is _ASSERT_METADATA for u in node.users):
                unused.update(size_only(node) or ())
    return unused


def erase_unused(gm: fx.GraphModule, candidates: set[fx.Node]) -> None:
    """Erase the nodes of ``candidates`` left without users, last first (with the metadata
    asserts export adds on them)."""
    asserts = {u for n in candidates for u in n.users if u.target is _ASSERT_METADATA}
    candidates = candidates | asserts
    for node in reversed(list(gm.graph.nodes)):
        if node in candidates and not node.users:
            gm.graph.erase_node(node)


def _bound(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """The names of the tensor arguments of ``model(*args, **kwargs)``."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = dict(kwargs)
    return [name for name, value in bound.items() if isinstance(value, torch.Tensor)]


# Set on this thread while ``planner.load`` captures from inputs it rebuilt (filled with ones):
# their mask masks nothing by construction, and the advice to leave it out would be wrong for
# the user's own padded mask (found by a tester).
_REBUILT = threading.local()


@contextlib.contextmanager
def rebuilt_inputs():
    outer, _REBUILT.on = getattr(_REBUILT, "on", False), True
    try:
        yield
    finally:
        _REBUILT.on = outer


def exact_attention(
    gm: fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict
) -> CausalMaskCheck | None:
    """``restore_causal_attention`` on ``gm``, exported from ``model(*args, **kwargs)``, with
    the calls of one eager forward, run only when an SDPA node has a mask. Warns where eager
    mode skips a mask that the graph computes from input values (an attention mask that masks
    nothing): there the graph cannot take eager's form. On the meta device eager mode cannot
    run: SDPA nodes keep the exported form."""
    masked = [
        node
        for node in gm.graph.find_nodes(op="call_function", target=SDPA)
        if isinstance(_mask_argument(node), fx.Node)
    ]
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs))]
    if not masked or any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        return None
    calls = eager_attention_calls(model, args, kwargs)
    check = restore_causal_attention(gm, calls, args, kwargs)
    nodes = list(gm.graph.find_nodes(op="call_function", target=SDPA))
    if (
        len(nodes) == len(calls)
        and not getattr(_REBUILT, "on", False)
        and any(
            call.without_mask and isinstance(_mask_argument(node), fx.Node)
            for node, call in zip(nodes, calls)
        )
    ):
        tensors = _bound(model, args, kwargs)
        passed = [name for name in tensors if "mask" in name]
        advice = (
            f"Leave an attention mask that masks nothing ({', '.join(passed)}) out of the "
            "example and the calls to get eager's exact form."
            if passed
            else "No argument of the call gives that mask: the model computes it itself, "
            f"from its other arguments ({', '.join(tensors)}); plan with example values at "
            "which it masks something (a padded row, packed sequences) if you train with "
            "such, or accept the last bits."
        )
        warnings.warn(
            f"{type(model).__name__} in eager mode calls attention without a mask at these "
            "example values (it skips a mask that masks nothing), while the captured graph "
            "applies the mask it computes from them: the planned module's results may differ "
            f"from the model's in the last bits (and it holds the mask). {advice}",
            UserWarning,
            stacklevel=5,
        )
    return check
