"""Capture: turn a model into a ``torch.fx.GraphModule`` the later passes can read and rewrite.

``torch.fx.symbolic_trace`` is tried first: it keeps leaf modules (``nn.Linear``...) as single
nodes, which makes plans readable. Models it cannot trace (data-dependent Python, Hugging Face
transformers) go through ``torch.export.export(strict=False)``, which records ATen-level nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import operator
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves, tree_map_only

from planner.errors import PlanningError

log = logging.getLogger(__name__)


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
    tensor left out or added) raise instead of computing something else.
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
    ):
        self.model_name = type(model).__name__
        self.signature = inspect.signature(model.forward)
        self.fixed = dict(fixed or {})
        self.output_types = output
        self.binds = args is not None
        if self.binds:
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
        return None if parameter is None or parameter.default is parameter.empty else (
            parameter.default
        )

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call ``model(*args, **kwargs)`` as the captured module takes it."""
        if not self.binds:
            return args, kwargs
        passed = self._passed(args, kwargs)
        captured = (*self.positional, *self.keywords)
        added = [
            name for name, value in passed.items()
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
            if name not in self.constants and value is None:
                raise PlanningError(
                    f"the planned {self.model_name} needs the tensor argument {name!r}: the plan "
                    f"was made with {name}= given, and its graph computes with it. Pass it, or "
                    f"plan again without {name}= to call the model without it."
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
        return (
            tuple(values[name] for name in self.positional),
            {name: values[name] for name in self.keywords},
        )

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
        children = [_container_types(value) for value in output]
        return (type(output), children) if any(c is not None for c in children) else None
    return None


def _retyped(template, value):
    if template is None:
        return value
    kind, children = template
    if isinstance(children, dict):
        items = {key: _retyped(children.get(key), item) for key, item in value.items()}
        if kind is dict:
            return items
        if dataclasses.is_dataclass(kind):  # Hugging Face ModelOutput
            return kind(**items)
        return kind(items)
    items = [_retyped(child, item) for child, item in zip(children, value)]
    return kind(*items) if hasattr(kind, "_fields") else kind(items)


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

    def refuse(*args, **kwargs):
        raise PlanningError(
            f"{type(model).__name__}.forward already calls torch.utils.checkpoint (or "
            "checkpoint_sequential, or a library's gradient checkpointing such as Hugging Face "
            "model.gradient_checkpointing_enable()). planner cannot keep a manual checkpoint: "
            "tracing would inline it and drop it silently. Remove the manual checkpoint (or "
            f"{_disable_advice(model)}) and let planner choose what to recompute, or do not "
            "plan this model."
        )

    generator = module._checkpoint_without_reentrant_generator
    had_apply = "apply" in module.CheckpointFunction.__dict__
    original_apply = module.CheckpointFunction.__dict__.get("apply")
    module._checkpoint_without_reentrant_generator = refuse
    module.CheckpointFunction.apply = classmethod(lambda cls, *a, **k: refuse())
    try:
        yield
    finally:
        module._checkpoint_without_reentrant_generator = generator
        if had_apply:
            module.CheckpointFunction.apply = original_apply
        else:
            del module.CheckpointFunction.apply


class _Tracer(fx.Tracer):
    """``symbolic_trace``'s tracer, also keeping instances of ``leaf_modules`` as single nodes."""

    def __init__(self, leaf_modules: tuple[type, ...]):
        super().__init__()
        self.leaf_modules = leaf_modules
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
    tracer = _Tracer(leaf_modules)
    graph = tracer.trace(model, concrete_args=concrete or None)
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
    ModelCall(model, args, kwargs, fixed=fixed, sizes=dynamic_shapes).install(gm)
    return gm


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
    kept = {
        node.target
        for node in captured.graph_module.graph.find_nodes(op="call_module")
    } if captured.method == "symbolic_trace" else set()
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
    fixed = _without_cache(model, args, kwargs)
    with _refusing_manual_checkpoints(model):
        try:
            captured = Captured(
                _trace(model, args, {**kwargs, **fixed}, tuple(leaf_modules)), "symbolic_trace"
            )
        except PlanningError:
            raise
        except Exception as trace_error:  # noqa: BLE001 - any tracing failure means: try export
            log.info("symbolic_trace failed (%s); trying torch.export", trace_error)
            try:
                captured = Captured(
                    _export(model, args, kwargs, fixed, dynamic_shapes), "export"
                )
            except PlanningError:
                raise
            except Exception as export_error:  # noqa: BLE001
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
    _refuse_dropped_hooks(model, captured)
    return captured
