"""``torch.export`` keeping chosen submodules as calls of the user's own modules.

``torch.export`` inlines every submodule into one ATen graph that reads the parameters
directly, so hooks on a submodule (FSDP2's ``fully_shard`` per decoder layer: all-gather before
its forward, reshard after, its backward collectives) would never run in the planned module.
For ``leaf_modules`` the export here keeps their calls:

* the model is exported once, with ``preserve_module_call_signature`` for every outermost
  instance of a leaf class, and ``torch.export.unflatten`` turns the program into modules
  calling each other with the original arguments (``args``, ``kwargs``, tuples, ``None``);
* ``inline_unflattened`` inlines it back into two flat graphs (``export_keeping``). In the
  first every op is inlined, as in an ordinary export, and the nodes of each kept call are
  tagged ``LEAF_CALL``: planner profiles and plans this one, op by op, with no cut or keep
  inside a call (``planner.problem``). In the second each kept call is a ``call_module`` node
  of the user's own instance (same object, hooks and all): the plan is rewritten on this one,
  its positions moved by ``positions``. Pytree packing between the modules is resolved while
  inlining, so neither graph holds spec objects;
* ``hold_call_arguments`` ends each kept call of the first graph with a node reading all the
  call is given, which the call holds until it returns (and a checkpoint until its
  recompute), whether or not its ops read it;
* ``restore_eager_arguments`` gives a kept module the ``None`` eager mode passes where the
  graph computes a causal mask from sizes alone instead (Hugging Face decoders under export),
  the rule ``planner.attention`` applies to SDPA nodes: the module then runs as in eager mode
  and no B x S x S mask is built.

Both graphs take the exported module's inputs and run its guards (``torch.export``'s own flat
module gives both), so calls behave as for any exported plan.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from planner.attention import CausalMaskCheck, erase_unused, is_causal_mask, probe_masks, size_only
from planner.errors import PlanningError


def leaf_paths(model: nn.Module, leaf_modules: tuple[type, ...]) -> tuple[str, ...]:
    """Paths of the instances of ``leaf_modules`` in ``model`` that no other one holds (a leaf
    inside a leaf runs inside it), the model itself excluded."""
    paths: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{p}.") for p in paths)
        if name and not inside and isinstance(module, leaf_modules):
            paths.append(name)
    return tuple(paths)


LEAF_CALL = "planner.leaf_call"  # node.meta: which kept call (0, 1, ...) a node is in
_ORIGIN = "planner.origin"  # node.meta: the unflattened node it copies, the same in both graphs
CALLS_KEY = "planner.calls_graph"  # GraphModule.meta of the profiled graph: the one to rewrite
_ARGUMENTS_KEY = "planner.call_arguments"  # GraphModule.meta: per kept call, the nodes given


def export_keeping(
    model: nn.Module, args: tuple, kwargs: dict, paths: tuple[str, ...], dynamic
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``torch.export`` of ``model(*args, **kwargs)`` (``dynamic``: its ``dynamic_shapes``) as
    two flat GraphModules from one export: every op inlined (the graph planner profiles and
    plans, its nodes inside a kept module tagged ``LEAF_CALL``), and the modules at ``paths``
    kept as ``call_module`` nodes of the user's own instances (the graph the plan rewrites)."""
    program = torch.export.export(
        model,
        args,
        kwargs,
        dynamic_shapes=dynamic,
        strict=False,
        preserve_module_call_signature=paths,
    )
    flat = program.module()  # the exported module's calling convention and guards
    renamed = _rename_clashing_inputs(program, paths)
    unflat = torch.export.unflatten(program)
    called_again = [p for p in paths if _called_again(unflat, p)]
    if called_again:
        raise PlanningError(
            f"cannot keep {', '.join(called_again)} of {type(model).__name__} whole under "
            f"torch.export: forward calls {'each' if len(called_again) > 1 else 'it'} more "
            "than once (shared weights), and torch.export "
            "then keeps one module per call. Plan without leaf_modules (export traces through "
            "them, exactly), or make the model one symbolic_trace captures, which keeps such "
            "modules whole."
        )
    return (
        _graph_module(model, flat, *inline_unflattened(unflat, set(paths), renamed, True)),
        _graph_module(model, flat, *inline_unflattened(unflat, set(paths), renamed)),
    )


def _called_again(unflat: nn.Module, path: str) -> bool:
    """Whether ``torch.export.unflatten`` made the module at ``path`` one dispatching among
    several calls (the module is called more than once)."""
    module = sys.modules.get("torch.export.unflatten")  # torch.export.unflatten: the function
    dispatcher = getattr(module, "InterpreterModuleDispatcher", ())
    try:
        return isinstance(unflat.get_submodule(path), dispatcher)
    except AttributeError:
        return False


def _leaves(value) -> list:
    """The leaves of a structure of arguments (nodes and constants), in order: the two graphs'
    arguments of the same call match leaf by leaf."""
    return pytree.tree_leaves(value)


def call_holds_arguments(*arguments) -> None:
    """Nothing: in the profiled graph, the node after a kept call's last op, reading what the
    call was given (see ``hold_call_arguments``)."""


def hold_call_arguments(profiled: fx.GraphModule, calls: fx.GraphModule) -> None:
    """End each kept call of ``profiled`` with a ``call_holds_arguments`` node reading every
    node the module is given in ``calls``: the caller holds its arguments until the call
    returns, and a checkpoint holds its segment's inputs until the recompute, even those the
    module's ops never read (Llama's layers take ``position_ids`` and ``cache_position`` and
    use neither). Without it the profile freed them at their last use by an op, or never held
    them, and predicted a plan 128-256 bytes under its measured peak. Run after the passes that
    change what a call is given (``restore_eager_arguments``)."""
    given = calls.meta[_ARGUMENTS_KEY]
    inlined = profiled.meta[_ARGUMENTS_KEY]
    live = set(profiled.graph.nodes)
    last: dict[int, fx.Node] = {}
    for node in profiled.graph.nodes:
        if LEAF_CALL in node.meta:
            last[node.meta[LEAF_CALL]] = node
    for node in calls.graph.find_nodes(op="call_module"):
        if LEAF_CALL not in node.meta:
            continue
        call = node.meta[LEAF_CALL]
        if call not in last:
            continue  # a call running no op (an identity): nothing to follow
        passed = set(node.all_input_nodes)
        if len(inlined[call]) != len(given[call]):
            raise PlanningError(
                f"the kept module {node.target} is given {len(given[call])} values in one graph "
                f"and {len(inlined[call])} in the other, so its arguments cannot be matched: "
                "plan without leaf_modules, or keep modules that take tensors, tuples or dicts"
            )
        held = {
            mine: None
            for mine, theirs in zip(inlined[call], given[call])
            if isinstance(mine, fx.Node)
            and isinstance(theirs, fx.Node)
            and mine in live
            and theirs in passed
        }
        with profiled.graph.inserting_after(last[call]):
            holds = profiled.graph.call_function(call_holds_arguments, tuple(held))
        holds.meta = {LEAF_CALL: call, _ORIGIN: f"{node.meta[_ORIGIN]}.holds"}
    profiled.graph.lint()
    profiled.recompile()


def _rename_clashing_inputs(program: torch.export.ExportedProgram, paths) -> dict[str, str]:
    """Rename the model inputs of ``program`` that share a name with an argument of a kept
    module; return the new names' old names.

    Works around ``torch.export.unflatten`` (torch 2.13): a kept module whose ops read sizes
    of a model input under dynamic shapes (Llama's layers read the batch and length from
    ``input_ids`` and ``attention_mask``) gets that input as an extra placeholder under the
    input's name, beside placeholders named after its own keyword arguments; when the names
    are equal (``attention_mask``) its generated code fails with ``SyntaxError: duplicate
    argument``. Only names change: the graph, the signatures' structure and every value are
    the same."""
    taken: set[str] = set()
    for entry in program.module_call_graph:
        if entry.fqn in paths and entry.signature is not None:
            args_spec, kwargs_spec = entry.signature.in_spec.children()
            taken.update(f"_positional_arg_{i}" for i in range(args_spec.num_children))
            taken.update(kwargs_spec.context)
    names = {node.name for node in program.graph.nodes}
    new_names: dict[str, str] = {}
    for node in program.graph.find_nodes(op="placeholder"):
        if node.name in taken:
            new = f"{node.name}_input"
            while new in names or new in taken:
                new += "_"
            names.add(new)
            new_names[node.name] = new
            node.name = node.target = new  # the names fx generates code with: unique now
    if not new_names:
        return {}
    signature = program.graph_signature
    arguments = [spec.arg for spec in signature.input_specs]
    for entry in program.module_call_graph:
        if entry.signature is not None:
            arguments += [*entry.signature.inputs, *entry.signature.outputs]
    for argument in arguments:
        if getattr(argument, "name", None) in new_names:
            argument.name = new_names[argument.name]
    for spec in signature.output_specs:  # a mutated input names the input it writes
        if spec.target in new_names:
            spec.target = new_names[spec.target]
    return {new: old for old, new in new_names.items()}


def _graph_module(
    model: nn.Module, flat: fx.GraphModule, graph: fx.Graph, attributes: dict, arguments: dict
) -> fx.GraphModule:
    """``graph`` as a GraphModule taking the inputs of ``flat`` (the exported module) and
    checking its guards."""
    inputs = list(graph.find_nodes(op="placeholder"))
    if len(inputs) != len(flat.graph.find_nodes(op="placeholder")):
        raise PlanningError(
            f"torch.export's unflattened {type(model).__name__} takes other inputs than its flat "
            "module, so its leaf_modules cannot be kept as calls. Plan without leaf_modules."
        )
    graph._codegen = flat.graph._codegen
    if hasattr(flat, "_guards_fn"):
        attributes["_guards_fn"] = flat._guards_fn
        with graph.inserting_after(inputs[-1]):
            graph.call_module("_guards_fn", tuple(inputs)).meta[_ORIGIN] = "_guards_fn"
    gm = fx.GraphModule(_root(model, graph, attributes), graph, type(model).__name__)
    gm.meta[_ARGUMENTS_KEY] = arguments
    gm.graph.lint()
    return gm


def _root(model: nn.Module, graph: fx.Graph, attributes: dict) -> dict:
    """What the graph's ``get_attr`` and ``call_module`` nodes read, by target: the user's own
    module or tensor where the model has that path, else the exported one (constants, the
    subgraphs of higher-order ops) under a top-level name, since the planned module holds the
    user's own children at those paths."""
    root: dict = {}
    for node in [*graph.find_nodes(op="get_attr"), *graph.find_nodes(op="call_module")]:
        target = str(node.target)
        try:
            root[target] = operator.attrgetter(target)(model)
        except AttributeError:
            node.target = target.replace(".", "_")
            root[node.target] = attributes[target]
    return root


class _Inlining:
    """One flat graph being built from an unflattened module (see ``inline_unflattened``)."""

    def __init__(self, keep: set[str], inline_all: bool, positional: dict[str, int]):
        self.graph = fx.Graph()
        self.keep = keep
        self.positional = positional  # path -> how many positional arguments the model passes
        self.inline_all = inline_all
        self.attributes: dict = {}
        self.calls = 0  # kept calls met so far
        self.arguments: dict[int, list] = {}  # per kept call, the leaves of what it is given

    def copy(self, node: fx.Node, target, args, kwargs, origin: str, call) -> fx.Node:
        new = self.graph.create_node(node.op, target, args, kwargs, name=node.name)
        new.meta = {**node.meta, _ORIGIN: origin}
        if call is not None:
            new.meta[LEAF_CALL] = call
        return new

    def inline(self, module, prefix: str, inputs: list, call: int | None):
        """Copy ``module``'s graph with ``inputs`` for its placeholders; return what its output
        node returns (nodes of the new graph, or plain values). ``call``: the kept call these
        nodes belong to."""
        env: dict[fx.Node, object] = {}
        placeholders = iter(inputs)

        def mapped(value):
            # Values may be pytree structures (a kept call's packed arguments), not only nodes.
            return fx.node.map_aggregate(value, lambda a: env[a] if isinstance(a, fx.Node) else a)  # type: ignore[arg-type, return-value]

        for node in module.graph.nodes:
            origin = f"{prefix}{node.name}"
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "output":
                return mapped(node.args[0])
            elif node.op == "get_attr":
                value = operator.attrgetter(node.target)(module)
                if isinstance(value, pytree.TreeSpec):
                    env[node] = value  # read by the pytree calls below, resolved here
                else:
                    target = f"{prefix}{node.target}"
                    self.attributes[target] = value
                    env[node] = self.copy(node, target, (), {}, origin, call)
            elif node.op == "call_module":
                env[node] = self.call_module(module, node, prefix, mapped, call)
            elif node.target is pytree.tree_unflatten:  # packs a kept call's arguments
                leaves, spec = mapped(node.args)
                env[node] = pytree.tree_unflatten(list(leaves), spec)
            elif node.target is fx_pytree.tree_flatten_spec:  # unpacks them, or its output
                value, spec = mapped(node.args)
                if isinstance(value, fx.Node):
                    env[node] = self.flattened(value, spec, node, origin, call)
                else:
                    env[node] = fx_pytree.tree_flatten_spec(value, spec)
            elif node.target is operator.getitem and not isinstance(env[node.args[0]], fx.Node):
                env[node] = env[node.args[0]][node.args[1]]  # type: ignore[index]
            else:
                args, kwargs = mapped(node.args), mapped(node.kwargs)
                env[node] = self.copy(node, node.target, args, kwargs, origin, call)
        raise PlanningError(f"unflattened module {prefix or 'root'} has no output")

    def call_module(self, module, node: fx.Node, prefix: str, mapped, call):
        path = f"{prefix}{node.target}"
        args, kwargs = mapped(node.args), mapped(node.kwargs)
        kept = path.split("@")[0] in self.keep  # "@1": the second call of the same module
        if kept and call is None:
            call = self.calls
            self.calls += 1
            target = path.split("@")[0]
            # Under dynamic shapes unflatten passes inputs whose sizes the module reads first;
            # the user's module takes the model's own arguments only.
            own = args[len(args) - self.positional[target] :]
            self.arguments[call] = _leaves((own, kwargs))
            if not self.inline_all:
                return self.copy(node, target, own, kwargs, f"{prefix}{node.name}", call)
        inner = module.get_submodule(str(node.target))
        placeholders = [p.target for p in inner.graph.find_nodes(op="placeholder")]
        inputs = list(args) + [kwargs[name] for name in placeholders[len(args) :]]
        return self.inline(inner, f"{path}.", inputs, call)

    def flattened(self, value: fx.Node, spec: pytree.TreeSpec, node, origin, call) -> list:
        """The leaves of a kept call's output ``value`` in the order of ``spec``, as nodes."""
        if spec.is_leaf():
            return [value]
        if spec.type in (tuple, list) or pytree.is_namedtuple_class(spec.type):
            keys: list = list(range(spec.num_children))
        elif spec.type is dict or isinstance(spec.context, list):  # dicts, ModelOutput
            keys = list(spec.context)
        else:
            raise PlanningError(
                f"a kept module returns a {spec.type.__name__}, which planner cannot unpack in "
                "its graph: keep modules that return tensors, tuples or dicts"
            )
        leaves = []
        for key, child in zip(keys, spec.children(), strict=True):
            item = self.copy(node, operator.getitem, (value, key), {}, f"{origin}.{key}", call)
            item.meta.pop("val", None)
            leaves += self.flattened(item, child, node, f"{origin}.{key}", call)
        return leaves


def inline_unflattened(
    unflat: nn.Module, keep: set[str], renamed: dict[str, str], inline_all: bool = False
) -> tuple[fx.Graph, dict, dict[int, list]]:
    """One graph computing what ``unflat`` (from ``torch.export.unflatten``) computes, with
    every submodule inlined but the calls of those at the paths in ``keep``, which stay
    ``call_module`` nodes (``inline_all``: inlined too, their nodes tagged ``LEAF_CALL``);
    the attributes its ``get_attr`` nodes read, by target; and per kept call, the leaves of
    what the module is given. ``renamed``: the inputs' names before
    ``_rename_clashing_inputs``, which the graph takes again."""
    positional = {
        entry.fqn: entry.signature.in_spec.child(0).num_children
        for entry in unflat.module_call_graph  # type: ignore[union-attr]
        if entry.signature is not None and entry.fqn in keep
    }
    inlining = _Inlining(keep, inline_all, positional)
    inputs = []
    for node in unflat.graph.find_nodes(op="placeholder"):  # type: ignore[operator, union-attr]
        inputs.append(inlining.graph.placeholder(renamed.get(node.target, node.target)))
        inputs[-1].meta = dict(node.meta)
    inlining.graph.output(inlining.inline(unflat, "", inputs, None))
    return inlining.graph, inlining.attributes, inlining.arguments


def positions(profiled: list[fx.Node], calls: list[fx.Node]) -> tuple[list[int], list[int]]:
    """For each position of ``profiled`` (compute nodes of the graph with every op inlined),
    the first and the last position of ``calls`` (those of the graph calling the kept
    modules) that compute it: a kept call's nodes map to the call and the items of its
    output."""
    by_origin = {
        n.meta[_ORIGIN]: i
        for i, n in enumerate(calls)
        if _ORIGIN in n.meta and LEAF_CALL not in n.meta
    }
    by_call: dict[int, list[int]] = {}
    for i, n in enumerate(calls):
        if LEAF_CALL in n.meta:
            by_call.setdefault(n.meta[LEAF_CALL], []).append(i)
    spans: list[tuple[int, int] | None] = []
    for n in profiled:
        if LEAF_CALL in n.meta:
            span = by_call[n.meta[LEAF_CALL]]
            spans.append((span[0], span[-1]))
        else:
            at = by_origin.get(n.meta.get(_ORIGIN))
            spans.append(None if at is None else (at, at))
    # A node one graph dropped (a mask only the other still computes): its neighbours' places.
    first, last = [0] * len(spans), [0] * len(spans)
    after = len(calls)
    for j in reversed(range(len(spans))):
        after = first[j] = after if spans[j] is None else spans[j][0]  # type: ignore[index]
    before = -1
    for j in range(len(spans)):
        before = last[j] = before if spans[j] is None else spans[j][1]  # type: ignore[index]
    return first, last


class _RecordingCalls:
    """Forward pre-hooks noting, per module path, which arguments each call passes as None."""

    def __init__(self, model: nn.Module, paths: tuple[str, ...]):
        self.calls: dict[str, list[tuple[tuple, dict]]] = {path: [] for path in paths}
        self.handles = [
            model.get_submodule(path).register_forward_pre_hook(self._hook(path), with_kwargs=True)
            for path in paths
        ]

    def _hook(self, path: str) -> Callable:
        def note(module, args, kwargs):
            none = lambda values: [v is None for v in values]  # noqa: E731
            self.calls[path].append((tuple(none(args)), dict(zip(kwargs, none(kwargs.values())))))

        return note

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def eager_none_arguments(
    model: nn.Module, args: tuple, kwargs: dict, paths: tuple[str, ...]
) -> dict[str, list[tuple[tuple, dict]]]:
    """Per path in ``paths``, for each call of that module in one eager forward of ``model``
    (no gradients, RNG state restored): which positional and keyword arguments were None."""
    recording = _RecordingCalls(model, paths)
    devices = sorted({t.device.index or 0 for t in model.parameters() if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model(*args, **kwargs)
    finally:
        recording.remove()
    return recording.calls


def restore_eager_arguments(
    gm: fx.GraphModule, calls: dict[str, list[tuple[tuple, dict]]], args: tuple, kwargs: dict
) -> CausalMaskCheck | None:
    """Pass None to a kept module where eager mode does (``calls``, from
    ``eager_none_arguments``) and the graph passes a mask computed from sizes alone that is
    exactly the causal mask at the example's sizes (``gm`` is called as ``gm(*args,
    **kwargs)``). Returns the check that a call's sizes keep every such mask causal, or None
    when nothing changed."""
    seen: dict[str, int] = {}
    chosen: list[tuple[fx.Node, int | str, fx.Node, list[fx.Node]]] = []
    for node in gm.graph.find_nodes(op="call_module"):
        eager = calls.get(str(node.target), [])
        index = seen[str(node.target)] = seen.get(str(node.target), -1) + 1
        if index >= len(eager):
            continue
        none_args, none_kwargs = eager[index]
        given = [*enumerate(node.args), *node.kwargs.items()]
        for key, value in given:
            if isinstance(key, int):
                was_none = key < len(none_args) and none_args[key]
            else:
                was_none = none_kwargs.get(key, False)
            if was_none and isinstance(value, fx.Node):
                computing = size_only(value)
                if computing is not None and value.meta["val"].dtype == torch.bool:
                    chosen.append((node, key, value, computing))
    if not chosen:
        return None
    check = probe_masks(gm, [mask for *_, mask, _ in chosen], {n for *_, c in chosen for n in c})
    example = check.sizes_of(args, kwargs)
    if example is None:
        return None
    with torch.no_grad():
        masks = check.probe(*example)
    chosen = [c for c, mask in zip(chosen, masks, strict=True) if is_causal_mask(mask)]
    if not chosen:
        return None
    check = probe_masks(gm, [mask for *_, mask, _ in chosen], {n for *_, c in chosen for n in c})
    for node, key, _, _ in chosen:
        if isinstance(key, int):
            node.args = (*node.args[:key], None, *node.args[key + 1 :])
        else:
            node.kwargs = {**node.kwargs, key: None}
    erase_unused(gm, {n for *_, computing in chosen for n in computing})
    gm.graph.lint()
    gm.recompile()
    check.checked.add(example)
    return check
