"""Capture: turn a model into a ``torch.fx.GraphModule`` the later passes can read and rewrite.

``torch.fx.symbolic_trace`` is tried first: it keeps leaf modules (``nn.Linear``...) as single
nodes, which makes plans readable. Models it cannot trace (data-dependent Python, Hugging Face
transformers) go through ``torch.export.export(strict=False)``, which records ATen-level nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import operator
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves, tree_map_only

from planner.attention import exact_attention
from planner.errors import PlanningError

log = logging.getLogger(__name__)

# Tracing patches process-wide objects (fx patches ``nn.Module.__call__`` and ``__getattr__``;
# capture patches ``torch.utils.checkpoint`` and the grad-mode and autocast context managers).
# One capture at a time; every patch acts only in the capturing thread (``_capturing``) and
# behaves as the original in every other thread.
_CAPTURE_LOCK = threading.RLock()
# Per thread: .active (capturing), .tracer (the LeafTracer while fx traces), .exporting (the
# _ExportedRegions while torch.export captures), .depth (inside a patched context manager).
_capturing = threading.local()


def _in_capturing_thread() -> bool:
    return getattr(_capturing, "active", False)


@dataclass(frozen=True)
class Captured:
    """A captured graph and how it was obtained.

    ``method`` is ``"symbolic_trace"`` or ``"export"``; ``graph_module`` shares its leaf modules
    (``symbolic_trace``) or its parameters (``export``) with the user's model.
    """

    graph_module: fx.GraphModule
    method: str

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of a call of the model, as ``graph_module`` takes them."""
        call = self.graph_module.meta.get(CALL_KEY)
        return call.inputs(args, kwargs) if call is not None else (args, kwargs)


CALL_KEY = "planner.call"  # GraphModule.meta key of a module's ModelCall


class ModelCall:
    """What a captured module needs to be called like the model it was captured from.

    ``torch.export`` gives a module whose ``forward`` takes exactly the example's arguments,
    positional and keyword as in the example, non-tensor ones included; ``symbolic_trace``
    rebuilds ``OrderedDict`` and ``ModelOutput`` outputs as plain ``dict``. A ``ModelCall``
    binds a call to the model's own signature (defaults, keywords given positionally, the
    arguments planner fixed such as ``use_cache=False``) and puts the output's container types
    back. Calls the captured graph cannot compute like the model (another non-tensor value, a
    tensor added) raise instead of computing something else; a tensor argument left out is
    passed on as None (the planned module then runs the model itself).
    """

    def __init__(
        self,
        model: nn.Module,
        args: tuple | None,
        kwargs: dict | None,
        *,
        fixed: dict | None = None,
        output=None,
        sizes: bool = False,
        checks=(),
    ):
        self.model_name = type(model).__name__
        self.signature = inspect.signature(model.forward)
        self.fixed = dict(fixed or {})
        self.output_types = output
        self.checks = list(checks)  # each is called with the inputs as the graph takes them
        self.binds = args is not None
        if args is not None:
            kwargs = {} if kwargs is None else kwargs
            passed = self._passed(args, kwargs)
            self.positional = tuple(self.signature.parameters)[: len(args)]
            self.keywords = tuple({**kwargs, **self.fixed})
            self.constants = {
                name: value
                for name, value in passed.items()
                if not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))
            }
            # Sizes the plan's budget was made for; larger calls get a warning.
            self.largest = _sizes(passed) if sizes else None
            self.warned = False

    def _passed(self, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name (``**kwargs`` ones too), planner's fixed ones added."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self.model_name}.forward{self.signature}: {error}") from None
        passed = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind == inspect.Parameter.VAR_KEYWORD:
                passed.update(value)
            elif kind != inspect.Parameter.VAR_POSITIONAL:
                passed[name] = value
        return {**self.fixed, **passed}

    def _default(self, name: str):
        parameter = self.signature.parameters.get(name)
        return (
            None
            if parameter is None or parameter.default is parameter.empty
            else (parameter.default)
        )

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call ``model(*args, **kwargs)`` as the captured module takes it."""
        if not self.binds:
            return args, kwargs
        passed = self._passed(args, kwargs)
        captured = (*self.positional, *self.keywords)
        added = [
            name
            for name, value in passed.items()
            if name not in captured and not _same(value, self._default(name))
        ]
        if added:
            raise TypeError(
                f"this plan of {self.model_name} was made for calls without "
                f"{', '.join(added)}: its graph has no input for them. Plan with them in "
                "example_inputs or example_kwargs to train with them."
            )
        values = {name: passed.get(name, self._default(name)) for name in captured}
        for name, value in values.items():
            if name in self.fixed and not _same(value, self.fixed[name]):
                raise ValueError(
                    f"planner plans {self.model_name} for training with {name}="
                    f"{self.fixed[name]!r}; this call passes {name}={value!r}. Leave {name} "
                    f"out (or pass {self.fixed[name]!r}), and use the model itself where you "
                    "need its cache (generation)."
                )
            if name in self.constants and not _same(value, self.constants[name]):
                raise ValueError(
                    f"this plan of {self.model_name} was captured with {name}="
                    f"{self.constants[name]!r} and computes with that value; this call passes "
                    f"{name}={value!r}. Plan again with {name}={value!r} in the example inputs."
                )
        if self.largest is not None and not self.warned and _larger(_sizes(values), self.largest):
            self.warned = True
            warnings.warn(
                f"a call of the plan of {self.model_name} has larger tensors than the example "
                f"it was planned for ({_describe_sizes(self.largest)}): its peak may exceed the "
                "budget. Plan with example inputs of the largest size you train with.",
                UserWarning,
                stacklevel=4,
            )
        graph_args = tuple(values[name] for name in self.positional)
        graph_kwargs = {name: values[name] for name in self.keywords}
        for check in self.checks:
            check(graph_args, graph_kwargs)
        return graph_args, graph_kwargs

    def output(self, value):
        """``value`` with the container types of the model's own output."""
        return _retyped(self.output_types, value) if self.output_types is not None else value

    def install(self, gm: fx.GraphModule) -> None:
        """Make ``gm`` take the model's calls and return its output types (module hooks)."""
        gm.meta[CALL_KEY] = self
        if self.binds:
            gm.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        if self.output_types is not None:
            gm.register_forward_hook(self._after_forward)

    def _before_forward(self, module, args, kwargs):
        return self.inputs(args, kwargs)

    def _after_forward(self, module, args, output):
        return self.output(output)


def _sizes(arguments: dict) -> dict:
    return {
        name: tuple(value.shape)
        for name, value in arguments.items()
        if isinstance(value, torch.Tensor)
    }


def _larger(sizes: dict, largest: dict) -> bool:
    return any(
        len(shape) == len(largest.get(name, shape))
        and any(a > b for a, b in zip(shape, largest.get(name, shape)))
        for name, shape in sizes.items()
    )


def _describe_sizes(sizes: dict) -> str:
    return ", ".join(f"{name} {list(shape)}" for name, shape in sizes.items())


def _same(value, expected) -> bool:
    if value is expected:
        return True
    if isinstance(value, torch.Tensor) or isinstance(expected, torch.Tensor):
        return False
    try:
        return bool(value == expected)
    except Exception:  # noqa: BLE001 - incomparable values are not the same
        return False


def _container_types(output):
    """The mapping types in ``output`` that fx rebuilds as plain ``dict`` (None if there are
    none), as a tree: ``(type, {key: subtree})`` or ``(type, [subtree, ...])``."""
    if isinstance(output, Mapping):
        children = {key: _container_types(value) for key, value in output.items()}
        keep = type(output) is not dict or any(c is not None for c in children.values())
        return (type(output), children) if keep else None
    if isinstance(output, (list, tuple)):
        elements = [_container_types(value) for value in output]
        return (type(output), elements) if any(c is not None for c in elements) else None
    return None


def _retyped(template, value):
    if template is None:
        return value
    kind, children = template
    if isinstance(children, dict):
        items = {key: _retyped(children.get(key), item) for key, item in value.items()}
        if kind is dict:
            return items
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):  # Hugging Face ModelOutput
            return kind(**items)
        return kind(items)
    values = [_retyped(child, item) for child, item in zip(children, value)]
    return kind(*values) if hasattr(kind, "_fields") else kind(values)


def _non_tensor_arguments(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Arguments holding no tensor (flags, ints, None), defaults included: tracing specialises
    on their values, and the captured graph asserts them when it is called."""
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise PlanningError(
            f"example inputs do not match {type(model).__name__}.forward{signature}: {error}"
        ) from error
    # Defaults too: a parameter left out (``mask=None``) would otherwise be traced as a tensor
    # placeholder, and the graph would compute with a value the call never passes.
    bound.apply_defaults()
    return {
        name: value
        for name, value in bound.arguments.items()
        if signature.parameters[name].kind
        not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))
    }


def _restore_argument_names(gm: fx.GraphModule, concrete: dict) -> None:
    """Give specialised placeholders their parameter names back.

    ``symbolic_trace`` names the placeholder of a concrete argument ``scale`` ``scale_1``, so
    the traced module rejects ``scale=`` as a keyword. A concrete argument that is not a pytree
    container has exactly one such placeholder; it takes the parameter's name again (its
    specialisation assert stays, so another value still fails loudly).
    """
    if type(gm.graph._codegen) is not fx.graph.CodeGen:
        return  # pytree-flattened inputs: the spec maps names itself
    placeholders = {n.target: n for n in gm.graph.find_nodes(op="placeholder")}
    renamed = False
    for name in concrete:
        node = placeholders.get(f"{name}_1")
        if node is not None and name not in placeholders and f"{name}_2" not in placeholders:
            node.target = name
            renamed = True
    if renamed:
        gm.recompile()


def _disable_advice(model: nn.Module) -> str:
    """How to turn a library's own checkpointing off, in the name the installed version uses:
    transformers 5 deprecates ``gradient_checkpointing_disable`` for
    ``activation_checkpointing_disable``."""
    for method in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
        if callable(getattr(model, method, None)):
            return f"call model.{method}()"
    return "turn the library's gradient checkpointing off"


@contextlib.contextmanager
def _refusing_manual_checkpoints(model: nn.Module):
    """Raise a PlanningError if ``model``'s forward calls ``torch.utils.checkpoint`` while traced.

    Tracing runs the function a checkpoint wraps as ordinary code: ``symbolic_trace`` and
    ``torch.export`` would capture the segment inline and the user's checkpoint would silently
    vanish. Both variants (non-reentrant and reentrant) are intercepted at their entry points
    inside ``torch.utils.checkpoint``, which a ``from torch.utils.checkpoint import checkpoint``
    in the user's module still reaches.
    """
    from torch.utils import checkpoint as module

    generator = module._checkpoint_without_reentrant_generator
    function = module.CheckpointFunction
    had_apply = "apply" in function.__dict__
    original_apply = function.__dict__.get("apply")
    bound_apply = function.apply

    def refuse():
        raise PlanningError(
            f"{type(model).__name__}.forward already calls torch.utils.checkpoint (or "
            "checkpoint_sequential, or a library's gradient checkpointing such as Hugging Face "
            "model.gradient_checkpointing_enable()). planner cannot keep a manual checkpoint: "
            "tracing would inline it and drop it silently. Remove the manual checkpoint (or "
            f"{_disable_advice(model)}) and let planner choose what to recompute, or do not "
            "plan this model."
        )

    def refusing_generator(*args, **kwargs):
        if _in_capturing_thread():
            refuse()
        return generator(*args, **kwargs)  # another thread's checkpoint: runs as always

    def refusing_apply(cls, *args, **kwargs):
        if _in_capturing_thread():
            refuse()
        return bound_apply(*args, **kwargs)

    module._checkpoint_without_reentrant_generator = refusing_generator
    # apply is replaced on purpose and restored below; mypy rejects assigning to a method.
    function.apply = classmethod(refusing_apply)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        module._checkpoint_without_reentrant_generator = generator
        if had_apply:
            function.apply = original_apply  # type: ignore[method-assign, assignment]
        else:
            del function.apply


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
    if getattr(_capturing, "depth", 0):
        return None
    return getattr(_capturing, "tracer", None)


@contextlib.contextmanager
def _inside_patched_method():
    _capturing.depth = getattr(_capturing, "depth", 0) + 1
    try:
        yield
    finally:
        _capturing.depth -= 1


class _ExportedRegions:
    """Regions that forward enters while torch.export captures it, and the nestings torch.export
    (2.13) captures wrongly: a grad-mode region inside ``torch.autocast`` is dropped (the
    exported module computes gradients that the model does not), an autocast inside autocast
    fails when run."""

    def __init__(self):
        self.open: list = []
        self.inside_autocast: list[str] = []


def _exported_regions() -> _ExportedRegions | None:
    return None if getattr(_capturing, "depth", 0) else getattr(_capturing, "exporting", None)


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
def _recording_regions():
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


class LeafTracer(fx.Tracer):
    """``symbolic_trace``'s tracer, also keeping instances of ``leaf_modules`` as single nodes."""

    def __init__(self, leaf_modules: tuple[type, ...]):
        super().__init__()
        self.leaf_modules = leaf_modules
        self.thread = threading.get_ident()
        # Grad-mode and autocast regions entered while tracing: id -> (context manager, node).
        self.open_regions: dict[int, tuple[object, fx.Node]] = {}
        # The root, and for each of its parameters and buffers: id -> (the tensor, its name).
        # Holding the tensor keeps its id from being reused by another one while tracing.
        self.tensor_names: tuple[nn.Module | None, dict[int, tuple]] = (None, {})
        self.output_types = None

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """Also note the container types of the traced output (``self.output_types``)."""
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        def noting_output_types(*inputs):
            output = fn(*inputs)
            self.output_types = _container_types(output)
            return output

        return noting_output_types, args

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, self.leaf_modules) or super().is_leaf_module(
            module, qualified_name
        )

    def call_module(self, m, forward, args, kwargs):
        """fx patches ``nn.Module.__call__`` for the whole process while tracing: a module
        called from another thread runs as if nothing were patched."""
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        """Like ``call_module``: ``nn.Module.__getattr__`` from another thread is untouched."""
        if threading.get_ident() != self.thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_arg(self, a):
        """fx names a parameter or buffer used as a plain tensor by scanning the whole module
        tree at every use, quadratic on deep models (1.5 s of capture at 9,000 nodes); look the
        name up in a table made once per root instead. Anything else goes to fx as before."""
        if isinstance(a, torch.Tensor):
            if self.tensor_names[0] is not self.root:
                names: dict[int, tuple] = {}
                for name, tensor in (*self.root.named_parameters(), *self.root.named_buffers()):
                    names.setdefault(id(tensor), (tensor, name))
                self.tensor_names = (self.root, names)
            tensor, name = self.tensor_names[1].get(id(a), (None, None))
            # Still the root's under that name? forward may have replaced it since.
            if tensor is a and operator.attrgetter(name)(self.root) is a:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)


def _trace(model: nn.Module, args: tuple, kwargs: dict, leaf_modules: tuple) -> fx.GraphModule:
    concrete = _non_tensor_arguments(model, args, kwargs)
    tracer = LeafTracer(leaf_modules)
    grad_enabled = torch.is_grad_enabled()
    _capturing.tracer = tracer
    try:
        with _keeping_buffers(model) as changed:
            graph = tracer.trace(model, concrete_args=concrete or None)
    finally:
        _capturing.tracer = None
        torch._C._set_grad_enabled(grad_enabled)  # forward may switch it without restoring it
    if changed:
        # A buffer is a plain tensor while tracing: ``self.calls += 1`` ran once, for real, and
        # the graph would never repeat it. torch.export records such updates.
        raise RuntimeError(
            f"forward updates buffer {changed[0]!r} as a plain tensor, which symbolic_trace "
            "cannot record"
        )
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _restore_argument_names(gm, concrete)
    if tracer.output_types is not None:
        ModelCall(model, None, None, output=tracer.output_types).install(gm)
    return gm


def _any_size(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``dynamic_shapes`` for ``torch.export``: every dimension of every tensor argument may
    vary (``Dim.AUTO``: export keeps a dimension static where the model needs it to be)."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {
        name: tree_map_only(
            torch.Tensor, lambda t: {d: torch.export.Dim.AUTO for d in range(t.dim())}, value
        )
        if any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))
        else None
        for name, value in bound.arguments.items()
    }


def _export(
    model: nn.Module, args: tuple, kwargs: dict, fixed: dict, dynamic_shapes: bool
) -> fx.GraphModule:
    kwargs_fixed = {**kwargs, **fixed}
    dynamic = _any_size(model, args, kwargs_fixed) if dynamic_shapes else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(
            model, args, kwargs_fixed, dynamic_shapes=dynamic, strict=False
        )
    gm = program.module()
    # torch.export traces with autocast's cache off and records that; the model runs with it.
    _inline_autocast(gm, cache_enabled=torch.is_autocast_cache_enabled())
    _guard_write_backs(gm)
    causal = exact_attention(gm, model, args, kwargs_fixed)
    checks = [causal] if causal is not None and dynamic_shapes else []
    ModelCall(model, args, kwargs, fixed=fixed, sizes=dynamic_shapes, checks=checks).install(gm)
    return gm


def _inline_autocast(gm: fx.GraphModule, *, cache_enabled: bool) -> None:
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
        _inline_autocast(block, cache_enabled=cache_enabled)  # regions nested in the block
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


def _without_cache(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``{"use_cache": False}`` for a model that would return a key/value cache, else ``{}``.

    Hugging Face decoders and encoder-decoders default to ``use_cache=True`` and then return a
    cache object, which serves generation, not training, and which no graph capture can
    return. Their own gradient checkpointing turns it off in training with a warning; so does
    planner when the call leaves ``use_cache`` out and the model's config enables it.
    """
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    if "use_cache" not in inspect.signature(model.forward).parameters:
        return {}
    if "use_cache" in bound.arguments:  # the user's choice; False holds for calls without it
        return {"use_cache": False} if bound.arguments["use_cache"] is False else {}
    if not getattr(getattr(model, "config", None), "use_cache", False):
        return {}
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):  # an encoder: use_cache changes nothing
        return {"use_cache": False}
    warnings.warn(
        f"{type(model).__name__} is planned with use_cache=False: a key/value cache serves "
        "generation, not training, and cannot be captured. The planned module computes as the "
        "model does with use_cache=False and returns no past_key_values (as Hugging Face's own "
        "gradient checkpointing does in training). Pass use_cache=False in example_kwargs, or "
        "set model.config.use_cache = False, to silence this warning.",
        UserWarning,
        stacklevel=4,
    )
    return {"use_cache": False}


@contextlib.contextmanager
def _keeping_buffers(model: nn.Module):
    """Put every buffer of ``model`` back as it was (the same tensor, the same values) when the
    block ends; yields a list, filled then, of the names of those the block changed."""
    kept = [
        (
            module,
            f"{prefix}.{name}" if prefix else name,
            name,
            tensor,
            tensor._version,
            tensor.detach().clone(),
        )
        for prefix, module in model.named_modules(remove_duplicate=False)
        for name, tensor in module._buffers.items()
        if tensor is not None and not tensor.is_inference()
    ]
    changed: list[str] = []
    try:
        yield changed
    finally:
        for module, qualified, name, tensor, version, value in kept:
            if module._buffers.get(name) is not tensor or tensor._version != version:
                changed.append(qualified)
                module._buffers[name] = tensor
                if tensor._version != version:
                    with torch.no_grad():
                        tensor.copy_(value)


def _guard_write_backs(gm: fx.GraphModule) -> None:
    """Make torch.export's write-backs of buffers updated in forward (``copy_(buffer, new
    value)`` nodes, last in the graph) skip the copy when the new value is the buffer itself."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
        if not node.users and node.args[0].op == "get_attr" and len(node.args) == 2:
            node.target = write_back
    gm.recompile()


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


def updates_in_place(node) -> bool:
    """Whether ``node`` is an ATen op that writes its first argument and returns it."""
    if not (isinstance(node, fx.Node) and isinstance(node.target, torch._ops.OpOverload)):
        return False
    schema = node.target._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    result = schema.returns[0].alias_info if len(schema.returns) == 1 else None
    return bool(first and first.is_write and result and result.before_set == first.before_set)


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _refuse_dropped_hooks(model: nn.Module, captured: Captured) -> None:
    """Raise a PlanningError for module hooks that the captured graph would not run.

    ``symbolic_trace`` traces ``model.forward``, not ``model.__call__``: hooks on the model
    itself are dropped (a forward hook that changes the output would silently change it). Hooks
    of a submodule that tracing inlines (every submodule under ``torch.export``, non-leaf ones
    under ``symbolic_trace``) run once while capturing and never again: their tensor effects are
    frozen into the graph and their Python side effects vanish. Hooks of a leaf module that stays
    a ``call_module`` node keep running (again when a checkpointed segment is recomputed).
    """
    kept = (
        {node.target for node in captured.graph_module.graph.find_nodes(op="call_module")}
        if captured.method == "symbolic_trace"
        else set()
    )
    dropped = [
        f"{name or '<the model itself>'}.{kind}"
        for name, module in model.named_modules()
        for kind in _HOOK_DICTS
        if getattr(module, kind, None) and (name == "" or name not in kept)
    ]
    if dropped:
        raise PlanningError(
            f"{type(model).__name__} has module hooks that the planned module would not run "
            f"({', '.join(dropped[:6])}{', ...' if len(dropped) > 6 else ''}): capture by "
            f"{captured.method} traces through them, so a hook that changes a value would be "
            "frozen or lost and one with side effects would stop running. Remove the hooks "
            "before planning (handle.remove()) and put that logic in forward, or register "
            "them on leaf modules (nn.Linear, ...) of a symbolically traceable model."
        )


def module_classes(leaf_modules) -> tuple[type, ...]:
    """``leaf_modules`` as a tuple of module classes (one class alone is accepted too)."""
    classes = (leaf_modules,) if isinstance(leaf_modules, type) else leaf_modules
    try:
        classes = tuple(classes)
    except TypeError:
        classes = None
    if classes is None or not all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in classes
    ):
        raise TypeError(
            "leaf_modules must be an nn.Module subclass or a tuple of them (e.g. "
            f"leaf_modules=(nn.TransformerEncoderLayer,)), got {leaf_modules!r}"
        )
    return classes


@contextlib.contextmanager
def _watching_exported_regions():
    regions = _ExportedRegions()
    _capturing.exporting = regions
    try:
        yield regions
    finally:
        _capturing.exporting = None


@contextlib.contextmanager
def _capturing_thread():
    _capturing.active = True
    try:
        yield
    finally:
        _capturing.active = False


def _trace_or_export(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    fixed: dict,
    leaf_modules: tuple,
    dynamic_shapes: bool,
) -> Captured:
    try:
        return Captured(_trace(model, args, {**kwargs, **fixed}, leaf_modules), "symbolic_trace")
    except PlanningError:
        raise
    except Exception as trace_error:  # any tracing failure means: try export
        log.info("symbolic_trace failed (%s); trying torch.export", trace_error)
        try:
            with _keeping_buffers(model), _watching_exported_regions() as regions:
                captured = Captured(_export(model, args, kwargs, fixed, dynamic_shapes), "export")
        except PlanningError:
            raise
        except Exception as export_error:
            raise PlanningError(
                f"cannot capture {type(model).__name__} as a graph.\n"
                f"  torch.fx.symbolic_trace: {type(trace_error).__name__}: {trace_error}\n"
                f"  torch.export (strict=False): {type(export_error).__name__}: "
                f"{export_error}\n"
                "What to try: for a model that returns a cache object (Hugging Face "
                "use_cache=True), pass use_cache=False in example_kwargs; pass flags and "
                "sizes as plain Python values in "
                "example_inputs or example_kwargs, so that tracing specialises on them; make "
                "torch.export.export(model, example_inputs, example_kwargs, strict=False) "
                "work (the fallback path: its error above names the data-dependent line; "
                "replace a Python `if` on tensor values by torch.where or torch.cond); or "
                "plan the traceable submodules (leaf blocks) separately and call them from "
                "your own forward."
            ) from export_error
        if regions.inside_autocast:
            raise PlanningError(
                f"cannot capture {type(model).__name__} exactly. torch.fx.symbolic_trace "
                f"failed ({type(trace_error).__name__}: {trace_error}), and torch.export, the "
                f"fallback, does not keep a region nested inside torch.autocast "
                f"({', '.join(dict.fromkeys(regions.inside_autocast))} inside autocast in "
                f"forward; torch {torch.__version__} drops a no_grad there). Make forward "
                "symbolically traceable (symbolic_trace keeps such regions exactly), or move "
                "that region out of the autocast block."
            ) from trace_error
        return captured


def capture(
    model: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    leaf_modules: tuple = (),
    dynamic_shapes: bool = False,
) -> Captured:
    """Capture ``model`` called as ``model(*args, **kwargs)`` as a GraphModule.

    ``leaf_modules`` (module classes) stay single ``call_module`` nodes under ``symbolic_trace``
    instead of being traced through: plans then checkpoint whole blocks, and hooks on those
    blocks (e.g. FSDP2's ``fully_shard`` per block) keep running. ``torch.export`` ignores it.
    ``dynamic_shapes`` lets a ``torch.export`` graph take other sizes of the tensor arguments
    (batch, sequence length) than the example's; ``symbolic_trace`` graphs always do.

    Raises
    ------
    PlanningError
        When neither ``symbolic_trace`` nor ``torch.export`` can capture the model; the message
        gives both reasons and what to try.
    """
    kwargs = kwargs or {}
    leaf_modules = module_classes(leaf_modules)
    fixed = _without_cache(model, args, kwargs)
    with (
        _CAPTURE_LOCK,
        _capturing_thread(),
        _refusing_manual_checkpoints(model),
        _recording_regions(),
    ):
        captured = _trace_or_export(model, args, kwargs, fixed, leaf_modules, dynamic_shapes)
    _refuse_dropped_hooks(model, captured)
    return captured
