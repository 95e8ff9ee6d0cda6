"""Capture: turn a model into a ``torch.fx.GraphModule`` the later passes can read and rewrite.

``torch.fx.symbolic_trace`` is tried first: it keeps leaf modules (``nn.Linear``...) as single
nodes, which makes plans readable. Models it cannot trace (data-dependent Python, Hugging Face
transformers) go through ``torch.export.export(strict=False)``, which records ATen-level nodes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import traceback
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from planner.attention import exact_attention
from planner.errors import (
    InputsRefused,
    PlanningError,
    checkpointing_disable_advice,
    input_require_grads_advice,
)
from planner.export_leaves import (
    CALLS_KEY,
    eager_none_arguments,
    export_keeping,
    hold_call_arguments,
    leaf_paths,
    restore_eager_arguments,
)
from planner.gcpause import paused_collection
from planner.hooks import (
    HOOK_TABLES,
    acting_hooks,
    process_wide_hooks,
    process_wide_hooks_message,
    restoring_output_recorders,
)
from planner.in_place import BufferProxy, InPlaceProxy, updates_in_place, write_back
from planner.model_call import CALL_KEY, ModelCall, container_types
from planner.model_code import global_loads, loaded_attributes
from planner.planned_module import PlannedModule
from planner.regions import (
    CAPTURE_LOCK,
    InexactRegions,
    capturing,
    in_capturing_thread,
    recording_regions,
    regions_from_export,
    watching_exported_regions,
)
from planner.side_effects import (
    generators,
    noting_grad_mode_reads,
    refusing_side_effects,
    same_bits,
)

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


def _non_tensor_arguments(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Arguments holding no tensor (flags, ints, None), defaults included: tracing specialises
    on their values, and the captured graph asserts them when it is called."""
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise PlanningError(
            f"example inputs do not match {type(model).__name__}.forward{signature}: {error}"
            f"{_binding_hint(signature, args, kwargs)}"
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


def _binding_hint(signature: inspect.Signature, args: tuple, kwargs: dict) -> str:
    """What likely went wrong in a call that does not bind: keywords forward does not take, or
    the positional arguments given as one list, dict or iterator instead of a tuple."""
    parameters = signature.parameters.values()
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        unknown = [key for key in kwargs if key not in signature.parameters]
        if unknown:
            return f" (example_kwargs names {', '.join(unknown)}, which forward does not take)"
    if len(args) == 1 and not isinstance(args[0], torch.Tensor):
        kind = type(args[0]).__name__
        if isinstance(args[0], Mapping):
            return (
                f" (example_inputs is one {kind}: keyword arguments go in example_kwargs, "
                "positional ones in the example_inputs tuple)"
            )
        if isinstance(args[0], (list, Iterator)):
            return (
                f" (example_inputs is one {kind}, taken as forward's first argument: the "
                "positional arguments go in a tuple, example_inputs=(x, y))"
            )
    return ""


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
            f"{checkpointing_disable_advice(model)}) and let planner choose what to recompute, "
            "or do not plan this model."
        )

    def refusing_generator(*args, **kwargs):
        if in_capturing_thread():
            refuse()
        return generator(*args, **kwargs)  # another thread's checkpoint: runs as always

    def refusing_apply(cls, *args, **kwargs):
        if in_capturing_thread():
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


# torch.nn's composite modules: Python over Linear, LayerNorm, MultiheadAttention and dropout,
# which fx would keep whole (one node: no segment inside). Their fast path needs grad off.
TRACED_TORCH_MODULES = (
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


class LeafTracer(fx.Tracer):
    """``symbolic_trace``'s tracer, also keeping instances of ``leaf_modules`` as single nodes;
    with ``buffers_as_nodes``, reading buffers as graph nodes (``getattr``)."""

    def __init__(self, leaf_modules: tuple[type, ...], buffers_as_nodes: bool = False):
        super().__init__()
        self.leaf_modules = leaf_modules
        self.buffers_as_nodes = buffers_as_nodes
        self.thread = threading.get_ident()
        # Grad-mode and autocast regions entered while tracing: id -> (context manager, node).
        self.open_regions: dict[int, tuple[object, fx.Node]] = {}
        # The root, and for each of its parameters and buffers: id -> (the tensor, its name).
        # Holding the tensor keeps its id from being reused by another one while tracing.
        self.tensor_names: tuple[nn.Module | None, dict[int, tuple]] = (None, {})
        self.output_types = None

    def proxy(self, node: fx.Node) -> fx.Proxy:
        """Proxies that record ``h += 1`` in place (``planner.in_place``)."""
        return InPlaceProxy(node, self)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """Also note the container types of the traced output (``self.output_types``)."""
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        def noting_output_types(*inputs):
            output = fn(*inputs)
            self.output_types = container_types(output)
            return output

        return noting_output_types, args

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if isinstance(module, self.leaf_modules):
            return True
        if isinstance(module, TRACED_TORCH_MODULES) or "forward" in vars(module):
            # A forward set on the instance (LoRA, accelerate's hooks) is the model's code:
            # traced through, not run on the profile's stand-ins of another module.
            return False
        return super().is_leaf_module(module, qualified_name)

    def call_module(self, m, forward, args, kwargs):
        """fx patches ``nn.Module.__call__`` for the whole process while tracing: a module
        called from another thread runs as if nothing were patched."""
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        """With ``buffers_as_nodes``, a buffer read in forward becomes a ``get_attr`` node
        (``BufferProxy``), as a parameter does (fx's default leaves it a plain tensor): ops on
        it are then recorded and run on each call (a relative position index viewed for an
        attention bias), where fx would run them once at tracing and bake the result into the
        graph. Like ``call_module``, ``nn.Module.__getattr__`` from another thread is
        untouched."""
        if threading.get_ident() != self.thread:
            return attr_val
        if (
            self.buffers_as_nodes
            and isinstance(attr_val, torch.Tensor)
            and not isinstance(attr_val, nn.Parameter)
            and (name := self._name_of(attr_val)) is not None
        ):
            if name not in parameter_proxy_cache:
                parameter_proxy_cache[name] = self.create_proxy(
                    "get_attr",
                    name,
                    (),
                    {},
                    proxy_factory_fn=lambda node: BufferProxy(node, self, attr_val),
                )
            return parameter_proxy_cache[name]
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _name_of(self, tensor: torch.Tensor) -> str | None:
        """The name of ``tensor`` among the root's parameters and buffers, if it is still the
        root's under that name (forward may have replaced it), from a table made once per root:
        fx scans the whole module tree at every use, quadratic on deep models (1.5 s of capture
        at 9,000 nodes)."""
        if self.tensor_names[0] is not self.root:
            names: dict[int, tuple] = {}
            for name, t in (*self.root.named_parameters(), *self.root.named_buffers()):
                names.setdefault(id(t), (t, name))
            self.tensor_names = (self.root, names)
        held, name = self.tensor_names[1].get(id(tensor), (None, None))
        if held is not tensor:
            return None
        # Read through the modules' own tables: fx patches nn.Module.__getattr__ while tracing.
        *path, leaf = name.split(".")
        module: nn.Module | None = self.root
        for key in path:
            module = module._modules[key] if module is not None else None
        if module is None:
            return None
        return name if tensor is module._parameters.get(leaf, module._buffers.get(leaf)) else None

    def create_arg(self, a):
        """A parameter or buffer used as a plain tensor is named from ``_name_of``'s table. A
        numpy scalar becomes the Python number (fx would write ``np.float64(...)`` into code
        that has no ``np``). Anything else goes to fx as before."""
        if isinstance(a, fx.Proxy):  # a BufferProxy passes for a tensor with fx
            return a.node
        if isinstance(a, torch.Tensor) and (name := self._name_of(a)) is not None:
            return self.create_node("get_attr", name, (), {})
        if isinstance(a, np.generic):
            return a.item()
        return super().create_arg(a)


class _UntracedOps(TorchDispatchMode):
    """Notes the first op that runs for real while ``symbolic_trace`` runs forward (in this
    thread: dispatch modes are per thread) and whose result the graph would hold as a constant
    where the model computes it anew: a random op (traced ops never dispatch), or an op reading
    a tensor of the model (``self.queue.clone()``: fx gives a get_attr only to parameters, and
    to buffers under ``buffers_as_nodes``, so ops on a buffer, a plain tensor attribute or a
    parameter reached through ``self.parameters()`` alone run once, and the graph keeps the
    value they had at planning after forward, or the training loop, has updated the tensor).
    ``on_buffer`` says whether that tensor was a buffer."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.storages: dict[int | None, str] = {
            key: name for name, t in _model_tensors(model) if (key := _storage_key(t)) is not None
        }
        self.buffers = {_storage_key(b) for b in model.buffers()}
        self.found: str | None = None
        self.on_buffer = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None:
            if torch.Tag.nondeterministic_seeded in func.tags:
                self.found = f"ran {func} on no traced value: its draw would be baked"
            for t in tree_leaves((args, kwargs)):
                name = self.storages.get(key := _storage_key(t))
                if name:
                    self.on_buffer = key in self.buffers
                    self.found = (
                        f"ran {func} on {name}, a tensor of the model, outside the traced "
                        "values: the graph would hold the result as computed at planning"
                    )
                    break
        return func(*args, **kwargs)


def _storage_key(t) -> int | None:
    """The storage ``t`` reads, if a strided tensor with one it can give (a wrapper subclass,
    DTensor or a quantised weight, may have none)."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _model_tensors(model: nn.Module):
    """(name, tensor) for every parameter, buffer and plain tensor attribute of ``model``."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)
    for path, module in model.named_modules(remove_duplicate=False):
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                yield f"{path}.{key}" if path else key, value


class _BuffersUntraced(RuntimeError):
    """Tracing ran ops on buffers for real: traced again with ``buffers_as_nodes``."""


def _trace(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    leaf_modules: tuple,
    buffers_as_nodes: bool = False,
) -> fx.GraphModule:
    """The traced graph. Buffers are plain tensors at first, as fx reads them, so that forward's
    Python checks of them (``isinstance(self.mask, torch.Tensor)``) see what eager mode sees;
    where forward runs ops on a buffer alone (an index view, ``self.buf.add_(1)``), which a
    graph of plain tensors would bake in, ``_trace_or_export`` traces again with buffers as
    graph nodes (``LeafTracer.buffers_as_nodes``)."""
    if _variadic_tensors(model, args, kwargs, inspect.Parameter.VAR_KEYWORD):
        # fx makes one placeholder of **kwargs, which the profile cannot fill by name.
        raise TypeError("symbolic_trace cannot pass tensors through **kwargs")
    concrete = _non_tensor_arguments(model, args, kwargs)
    tracer = LeafTracer(leaf_modules, buffers_as_nodes)
    grad_enabled = torch.is_grad_enabled()
    capturing.tracer = tracer
    try:
        with _keeping_buffers(model) as changed, _UntracedOps(model) as untraced:
            with warnings.catch_warnings():
                # A value fx cannot assert (a generator, an enum): ModelCall checks it instead.
                warnings.filterwarnings("ignore", "Was not able to add assertion", UserWarning)
                graph = tracer.trace(model, concrete_args=concrete or None)
    finally:
        capturing.tracer = None
        torch._C._set_grad_enabled(grad_enabled)  # forward may switch it without restoring it
    retry = RuntimeError if buffers_as_nodes else _BuffersUntraced
    if untraced.found is not None:
        # torch.export records the op (a draw anew every step, the tensor's value at the call).
        raise (retry if untraced.on_buffer else RuntimeError)(f"forward {untraced.found}")
    if changed:
        # A buffer was a plain tensor: ``self.calls += 1`` ran once, for real, and the graph
        # would never repeat it. torch.export records such updates.
        raise retry(
            f"forward updates buffer {changed[0]!r} as a plain tensor, which symbolic_trace "
            "cannot record"
        )
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _restore_argument_names(gm, concrete)
    # fx asserts values of its base types (bool, int, str, dtype, ...) and None; others (a
    # config object, an enum, a generator) are baked in unchecked, so ModelCall checks them.
    unasserted = {
        name: value
        for name, value in concrete.items()
        if not all(leaf is None or type(leaf) in fx.node.base_types for leaf in tree_leaves(value))
    }
    if tracer.output_types is not None or unasserted:
        ModelCall(model, None, None, output=tracer.output_types, constants=unasserted).install(gm)
    return gm


def _any_size(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``dynamic_shapes`` for ``torch.export``: every dimension of every tensor argument may
    vary (``Dim.AUTO``: export keeps a dimension static where the model needs it to be)."""
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    through = {
        key: item
        for name, value in bound.arguments.items()
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD
        for key, item in value.items()
    }
    if through:
        # torch.export (2.11-2.13) checks the spec against ``**kwargs`` as one dict, then
        # builds its constraints with the keys of that dict beside it: no spec passes both.
        options = [key for key, item in through.items() if isinstance(item, bool)]  # flags
        raise PlanningError(
            f"torch.export cannot capture {type(model).__name__} with dynamic_shapes=True "
            f"when values reach its forward through **kwargs ({', '.join(through)}): it "
            "checks the sizes it may vary against **kwargs as one dict, then looks the values "
            "up by their own names, and no specification satisfies both. Plan with "
            "dynamic_shapes=False (the plan then takes the example's sizes), or leave "
            f"{', '.join(through)} out of the call"
            + (
                f" (a flag such as {options[0]} can be set on the model instead: for "
                f"Hugging Face, model.config.{options[0]} = {through[options[0]]!r})"
                if options
                else ""
            )
            + (
                " (a loss normalised by a count can be computed outside the model: loss_fn=, "
                "docs/pipeline.md)"
                if len(options) < len(through)
                else ""
            )
            + "."
        )
    return {
        name: tree_map_only(
            torch.Tensor, lambda t: {d: torch.export.Dim.AUTO for d in range(t.dim())}, value
        )
        if any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))
        else None
        for name, value in bound.arguments.items()
    }


def _export(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    fixed: dict,
    leaf_modules: tuple,
    dynamic_shapes: bool,
) -> fx.GraphModule:
    kwargs_fixed = {**kwargs, **fixed}
    dynamic = _any_size(model, args, kwargs_fixed) if dynamic_shapes else None
    paths = leaf_paths(model, leaf_modules)
    traced_args, traced_kwargs = _unaliased((args, kwargs_fixed))
    calls = None  # with leaf_modules: the graph calling them, which the plan rewrites
    with (
        warnings.catch_warnings(),
        _without_stack_traces(),
        _without_symbolic_dispatch_cache(dynamic_shapes),
    ):
        warnings.simplefilter("ignore")
        if paths:  # see planner.export_leaves
            gm, calls = export_keeping(model, traced_args, traced_kwargs, paths, dynamic)
            gm.meta[CALLS_KEY] = calls
        else:
            program = torch.export.export(
                model, traced_args, traced_kwargs, dynamic_shapes=dynamic, strict=False
            )
            gm = program.module()
    for graph_module in (gm, calls) if calls is not None else (gm,):
        # torch.export traces with autocast's cache off and records that; the model runs with it.
        regions_from_export(graph_module, cache_enabled=torch.is_autocast_cache_enabled())
        _guard_write_backs(graph_module)
    if dynamic_shapes and calls is None:  # not where the plan maps two graphs node by node
        _checking_batch_norm_sizes(gm)
    causal = [exact_attention(gm, model, args, kwargs_fixed)]
    if calls is not None and not _on_meta(model, args, kwargs_fixed):
        none = eager_none_arguments(model, args, kwargs_fixed, paths)
        causal.append(restore_eager_arguments(calls, none, args, kwargs_fixed))
    if calls is not None:
        hold_call_arguments(gm, calls)
    checks = [c for c in causal if c is not None] if dynamic_shapes else []
    ModelCall(model, args, kwargs, fixed=fixed, checks=checks).install(gm)
    return gm


def _raised_by_model_code(error: Exception) -> str | None:
    """``file:line`` where ``error`` was raised when that is a ``raise`` or ``assert`` statement
    of the model's own code (or its library's, or ``torch.nn``'s checks of a module's inputs),
    not torch's or planner's: a check of the inputs in forward, which fails on the example
    whatever captures it. (A kernel of the
    model's that fails under tracing raises below a line of the model's too, but that line is
    a call: a capture failure.)"""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return None
    last = frames[-1]
    where = Path(last.filename).resolve()
    checks = where.is_relative_to(_TORCH_NN)  # torch.nn's own checks of a module's inputs
    if not checks and any(where.is_relative_to(package) for package in _OWN_PACKAGES):
        return None
    statement = (last.line or "").lstrip()
    if not statement.startswith(("raise", "assert")):
        return None
    return f"{where.name}:{last.lineno}"


_OWN_PACKAGES = (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parent)
# BatchNorm refusing one value per channel raises in torch.nn.functional (found by review:
# plan_batch stopped at a micro-batch of one of an exported model).
_TORCH_NN = Path(torch.nn.__file__).resolve().parent


def _unaliased(tree):
    """``tree`` with each tensor that shares storage with an earlier one replaced by a copy.

    torch.export gives one tensor passed twice a single graph input: captured from
    ``model(ids, labels=ids)`` (Hugging Face's language-modelling example), the graph read
    ``ids`` for ``labels`` in every later call, silently. Traced on copies, each argument has an
    input of its own; a call that passes one tensor twice still shares it, in-place writes
    included, as the graph runs its ops in the model's order.
    """
    seen: set[int] = set()

    def distinct(t: torch.Tensor) -> torch.Tensor:
        if t.layout is not torch.strided:
            return t
        storage = t.untyped_storage()._cdata
        if storage not in seen:
            seen.add(storage)
            return t
        return t.detach().clone().requires_grad_(t.requires_grad)

    return tree_map_only(torch.Tensor, distinct, tree)


@contextlib.contextmanager
def _without_stack_traces():
    """torch.export records the Python stack of every node it traces (``node.meta
    ["stack_trace"]``), a tenth of its time; planner never reads them."""
    config = torch.fx.config
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _without_symbolic_dispatch_cache(dynamic_shapes: bool):
    """With dynamic shapes, turn off the dispatch cache of the ``FakeTensorMode`` that
    torch.export traces under: it costs more than it saves there.

    Each entry it makes is checked by rebuilding the output from the entry, symbolic sizes and
    all (sympy), and each hit rebuilds them again. Off, dynamic exports of the Hugging Face
    families took 0.55-0.9x the time (ViT: the same) and recorded the same ops in the same
    order; only the numbers in some node names differ. Static exports hit the cache cheaply
    and took 1.2-1.6x the time without it: it stays on for them.
    """
    if not dynamic_shapes:
        yield
        return
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        yield


def _on_meta(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a tensor of the model or the call is on the meta device (eager cannot run)."""
    tensors = [*model.parameters(), *model.buffers(), *tree_leaves((args, kwargs))]
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


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
            # A batch norm's kernel updates its running statistics without bumping their
            # version (eager runs of the model here: planner.attention, export_leaves).
            rewritten = tensor._version != version or not same_bits(tensor, value)
            now = module._buffers.get(name)
            if now is not tensor and _updates_itself(now, qualified):
                module._buffers[name] = tensor  # ``self.calls += 1`` traced: recorded in place
            elif now is not tensor or rewritten:
                changed.append(qualified)
                module._buffers[name] = tensor
                if rewritten:
                    with torch.no_grad():
                        tensor.copy_(value)


def _updates_itself(value, target: str) -> bool:
    """Whether ``value``, set as buffer ``target`` while tracing, is what in-place ops on that
    buffer's graph node returned: ``self.calls += 1`` sets the buffer to itself in eager mode."""
    node = value.node if isinstance(value, fx.Proxy) else None
    while node is not None and updates_in_place(node):
        node = node.args[0] if isinstance(node.args[0], fx.Node) else None
    return node is not None and node.op == "get_attr" and node.target == target


def more_than_one_value_per_channel(x: torch.Tensor) -> None:
    """The check ``F.batch_norm`` makes in Python before a batch norm in training, which
    torch.export does not record: with one value per channel the variance is not defined."""
    values = x.shape[0]
    for size in x.shape[2:]:
        values *= size
    if values == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {x.shape}"
        )


def _checking_batch_norm_sizes(gm: fx.GraphModule) -> None:
    """Put ``more_than_one_value_per_channel`` back before each batch norm in training of a
    graph that takes other sizes (``dynamic_shapes``). Without it a batch of one (the last of
    a loader) ran where the model raises, and wrote NaN into the running variance (found
    trying the library)."""
    batch_norms = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.batch_norm.default)
    for node in batch_norms:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
        if training is True:
            with gm.graph.inserting_before(node):
                gm.graph.call_function(more_than_one_value_per_channel, (node.args[0],))
    if batch_norms:
        gm.recompile()


def _guard_write_backs(gm: fx.GraphModule) -> None:
    """Make torch.export's write-backs of buffers updated in forward (``copy_(buffer, new
    value)`` nodes, last in the graph) skip the copy when the new value is the buffer itself."""
    guarded = False
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
        if not node.users and node.args[0].op == "get_attr" and len(node.args) == 2:
            node.target = write_back
            guarded = True
    if guarded:  # regenerating the code costs about 0.05 s on a 200-node graph
        gm.recompile()


def _refuse_dropped_hooks(model: nn.Module, captured: Captured) -> None:
    """Raise a PlanningError for module hooks that the captured graph would not run.

    ``symbolic_trace`` traces ``model.forward``, not ``model.__call__``: hooks on the model
    itself are dropped (a forward hook that changes the output would silently change it). Hooks
    of a submodule that tracing inlines (every one but the instances of ``leaf_modules``) run
    once while capturing and never again: their tensor effects are frozen into the graph and
    their Python side effects vanish. Hooks of a module that stays a ``call_module`` node keep
    running (again when a checkpointed segment is recomputed). Under ``torch.export`` even
    those are refused while planning: export records a kept module's call after its pre-hooks
    ran, and the planned module, calling the module, would run them a second time. Hooks
    registered after planning (``fully_shard``) run once, as in the model. Process-wide hooks
    are refused; hooks that never act on the planned module are not (``planner.hooks``).
    """
    if process_wide_hooks():
        raise PlanningError(process_wide_hooks_message("while planning"))
    kept = (
        {node.target for node in captured.graph_module.graph.find_nodes(op="call_module")}
        if captured.method == "symbolic_trace"
        else set()
    )
    dropped = [
        f"{name or '<the model itself>'}.{kind}"
        for name, module in model.named_modules()
        for kind in HOOK_TABLES
        if acting_hooks(getattr(module, kind, {})) and (name == "" or name not in kept)
    ]
    if dropped:
        raise PlanningError(
            f"{type(model).__name__} has module hooks that the planned module would not run "
            f"({', '.join(dropped[:6])}{', ...' if len(dropped) > 6 else ''}): capture by "
            f"{captured.method} traces through them, so a hook that changes a value would be "
            "frozen or lost and one with side effects would stop running. Remove the hooks "
            "before planning (handle.remove()) and put that logic in forward, or keep the "
            "modules they are on whole (pass their classes as leaf_modules) and register the "
            "hooks after planning."
            + (
                " The hook making the input embeddings require grad, which Hugging Face's "
                "gradient checkpointing installs and leaves when disabled, goes with "
                "model.disable_input_require_grads()."
                if input_require_grads_advice(model)
                else _leftover_require_grads_advice(model)
            )
        )


def _leftover_require_grads_advice(model: nn.Module) -> str:
    """Where a ``make_inputs_require_grads`` hook is left after
    ``disable_input_require_grads()``: PEFT has the model register a second one, and the
    method removes only the last (found by a tester)."""
    holders = [
        name
        for name, module in model.named_modules()
        if any(
            getattr(hook, "__name__", "").startswith("make_inputs_require_grad")
            for hook in getattr(module, "_forward_hooks", {}).values()
        )
    ]
    if not holders:
        return ""
    return (
        f" The hook on {holders[0]} (make_inputs_require_grads: PEFT has the model register it "
        "twice, and disable_input_require_grads() removes one) only serves reentrant "
        "checkpointing: remove it with model.get_input_embeddings()._forward_hooks.clear()."
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
def _capturing_thread():
    capturing.active = True
    try:
        yield
    finally:
        capturing.active = False


def _trace_or_export(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    fixed: dict,
    leaf_modules: tuple,
    dynamic_shapes: bool,
) -> Captured:
    streams = [(g, g.get_state()) for g in generators(model).values()]
    try:
        try:
            gm = _trace(model, args, {**kwargs, **fixed}, leaf_modules)
        except _BuffersUntraced as untraced:
            log.info("%s; tracing again with buffers as graph nodes", untraced)
            for generator, state in streams:
                generator.set_state(state)
            gm = _trace(model, args, {**kwargs, **fixed}, leaf_modules, buffers_as_nodes=True)
        return Captured(gm, "symbolic_trace")
    except PlanningError:
        raise
    except Exception as trace_error:  # any tracing failure means: try export
        log.info("symbolic_trace failed (%s); trying torch.export", trace_error)
        for generator, state in streams:  # a draw the trace made for real (then refused)
            generator.set_state(state)
        try:
            with _keeping_buffers(model), watching_exported_regions() as regions:
                gm = _export(model, args, kwargs, fixed, leaf_modules, dynamic_shapes)
                captured = Captured(gm, "export")
        except PlanningError:
            raise
        except InexactRegions as inexact:
            raise _inexact(
                model,
                trace_error,
                str(inexact),
                "switch grad mode with torch.no_grad(), torch.enable_grad() or "
                "torch.set_grad_enabled(...) instead",
            ) from inexact
        except Exception as export_error:
            if (line := _raised_by_model_code(export_error)) is not None:
                raise InputsRefused(
                    f"{type(model).__name__}'s forward raised {type(export_error).__name__}: "
                    f"{export_error} (at {line}) on the example inputs, while torch.export "
                    "ran it: the model refuses them, capture is not at fault. Check the "
                    "example inputs and keyword arguments against what the model expects: "
                    "they must be those of a training step."
                ) from export_error
            labels = [k for k in kwargs if k == "labels" or k.endswith("_labels")]
            raise PlanningError(
                f"cannot capture {type(model).__name__} as a graph.\n"
                f"  torch.fx.symbolic_trace: {type(trace_error).__name__}: {trace_error}\n"
                f"  torch.export (strict=False): {type(export_error).__name__}: "
                f"{export_error}\n"
                "What to try: "
                + _packing_advice(model)
                + _causal_mask_advice(model, export_error)
                + (
                    # A wrapper passing **kwargs through (PEFT's) hides use_cache from
                    # _without_cache (found by a tester: the advice began with the loss).
                    "the model returns a key/value cache object: set model.config.use_cache "
                    "= False (a wrapper such as PEFT's passes its keywords through to the "
                    "model, which then reads its config), or pass use_cache=False in "
                    "example_kwargs and in every call; "
                    if "Cache" in str(export_error)
                    else ""
                )
                + (
                    f"the loss the model computes from {', '.join(labels)} may be what cannot "
                    "be captured: plan without it and pass the loss as loss_fn= (a function "
                    "of the output, e.g. lambda out: F.cross_entropy(out.logits.flatten(0, 1), "
                    "labels.flatten()); docs/pipeline.md); "
                    if labels
                    else ""
                )
                + "pass flags and sizes as plain Python values in "
                "example_inputs or example_kwargs, so that tracing specialises on them; make "
                "torch.export.export(model, example_inputs, example_kwargs, strict=False) "
                "work (the fallback path: its error above names the data-dependent line; "
                "replace a Python `if` on tensor values by torch.where or torch.cond); or "
                "plan the traceable submodules (leaf blocks) separately and call them from "
                "your own forward."
            ) from export_error
        if regions.inference:
            raise _inexact(
                model,
                trace_error,
                "torch.export records no node for a torch.inference_mode region of forward, "
                "and its graph would compute that region with gradients",
                "use torch.no_grad() for that region",
            ) from trace_error
        return captured


_PACKING = frozenset({"pack_padded_sequence", "pack_sequence"})
_TORCH_TRANSFORMERS = (
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


def _causal_mask_advice(model: nn.Module, export_error: Exception) -> str:
    """torch's own transformer modules read a mask's values to see whether it is causal
    (``_detect_is_causal_mask``), which no capture can follow (found by a tester: the advice
    was generic)."""
    if "DataDependent" not in type(export_error).__name__ + str(export_error):
        return ""
    if not any(isinstance(m, _TORCH_TRANSFORMERS) for m in model.modules()):
        return ""
    return (
        "torch's nn.Transformer modules read a causal mask's values to check that it is "
        "causal: pass is_causal=True (tgt_is_causal=True for a decoder) with the mask, which "
        "skips the check, or leave the mask out; "
    )


def _packing_advice(model: nn.Module) -> str:
    """What to try for a model that packs sequences (``pack_padded_sequence``): where neither
    tracer can follow it, its error says nothing of packing."""
    classes: set[type] = {type(m) for m in model.modules()}
    for cls in classes:
        names = loaded_attributes(cls) | {name for _, name in global_loads(cls)}
        if not _PACKING.isdisjoint(names):
            return (
                f"{cls.__name__} packs sequences (torch.nn.utils.rnn.pack_padded_sequence): "
                "a PackedSequence's sizes come from the values of the lengths, which neither "
                "tracer can know. Plan the layers before the packing, or after the unpacking, "
                "as a module of their own, and pack around the planned module; or run the "
                "recurrent layer on the padded batch (masking what lies past each length). "
                "Otherwise: "
            )
    return ""


def _inexact(model: nn.Module, trace_error: Exception, why: str, advice: str) -> PlanningError:
    """The refusal of an exported graph that would not compute as ``model`` does."""
    return PlanningError(
        f"cannot capture {type(model).__name__} exactly. torch.fx.symbolic_trace failed "
        f"({type(trace_error).__name__}: {trace_error}), and the graph of torch.export, the "
        f"fallback, would not compute as forward does: {why}. Make forward symbolically "
        f"traceable (symbolic_trace keeps grad-mode and autocast regions exactly), or {advice}."
    )


@functools.cache
def _graph_module_names() -> frozenset[str]:
    """Attributes the planned module (an ``fx.GraphModule``) has and a plain module has not."""
    graph_module = fx.GraphModule(nn.Module(), fx.Graph())
    plain = nn.Module()
    return frozenset((set(dir(PlannedModule)) | set(vars(graph_module))) - set(dir(plain)))


def _refuse_graph_module_names(model: nn.Module) -> None:
    """Raise a PlanningError for a child, parameter or buffer of the model itself named like
    an attribute of the planned module (``code``, ``graph``, ``meta``): the planned module
    owns the model's own, under the same names, and would resolve the name to its own."""
    reserved = _graph_module_names()
    clashes = [
        name
        for table in ("_modules", "_parameters", "_buffers")
        for name in getattr(model, table)
        if name in reserved
    ]
    if clashes:
        name = type(model).__name__
        raise PlanningError(
            f"{name} has {', '.join(repr(c) for c in clashes)} at its top level, named like an "
            "attribute of the torch.fx.GraphModule that planner builds (code, graph, meta, "
            "...): the planned module, which holds the model's own under the same names, "
            "would find its own attribute instead. Rename "
            f"{'them' if len(clashes) > 1 else 'it'} (self.{clashes[0]}_ = ...; a "
            "state_dict pre-hook can map old checkpoints' keys), or plan a submodule of "
            f"{name} that holds it under its own name."
        )


def _refuse_layerdrop(model: nn.Module) -> None:
    """Raise a PlanningError for a model in training with LayerDrop on (Hugging Face's
    ``*layerdrop`` config options, a module's ``layerdrop``): its forward skips each layer when
    a random draw falls below it, a choice made anew at every step, which one captured graph
    cannot replay (torch.export fails on the branch with a data-dependent guard)."""
    if not model.training:
        return  # LayerDrop draws only in training
    config = getattr(model, "config", None)
    # Hugging Face configs are objects; other code keeps dicts (or slotted objects) there.
    fields = config if isinstance(config, dict) else getattr(config, "__dict__", {})
    options = {
        key: value
        for key, value in fields.items()
        if isinstance(key, str)
        and key.endswith("layerdrop")
        and isinstance(value, (int, float))
        and value > 0
    }
    modules = [
        name or "the model"
        for name, m in model.named_modules()
        if isinstance(getattr(m, "layerdrop", None), (int, float)) and m.layerdrop > 0
    ]
    if not options and not modules:
        return
    found = [f"config.{k}={v}" for k, v in options.items()]
    found += [f"{name}.layerdrop" for name in modules[:3]] + ["..."] * (len(modules) > 3)
    turn_off = [f"config.{k} = 0.0" for k in options] + [
        f"{name}.layerdrop = 0.0" for name in modules[:3]
    ]
    raise PlanningError(
        f"{type(model).__name__} uses LayerDrop ({', '.join(found)}): in training, its forward "
        "skips each layer when a random draw falls below that probability, a choice made anew "
        "at every step, which a captured graph cannot replay. Plan and train with LayerDrop "
        f"off: {'; '.join(turn_off)} (modules copy the config's value when built: set it in "
        "the config before building the model, or on the modules)."
    )


def _variadic_tensors(model: nn.Module, args: tuple, kwargs: dict, kind) -> bool:
    """Whether the call passes a tensor through ``forward``'s parameter of ``kind`` (``*args``:
    ``inspect.Parameter.VAR_POSITIONAL``, ``**kwargs``: ``VAR_KEYWORD``)."""
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return False  # capture reports the mismatch
    return any(
        signature.parameters[key].kind == kind
        and any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))
        for key, value in bound.arguments.items()
    )


def _wrappers() -> list[tuple[type, str, str, str, str]]:
    """Modules wrapping the user's: (class, what it is, what it does to the module it holds,
    the attribute holding it, how to wrap the planned module instead)."""
    return [
        (
            torch._dynamo.eval_frame.OptimizedModule,
            "a torch.compile'd module",
            "compiles",
            "_orig_mod",
            "compile the planned module (torch.compile(plan.module))",
        ),
        (
            nn.DataParallel,
            "an nn.DataParallel wrapper",
            "wraps",
            "module",
            "wrap the planned module in DistributedDataParallel(plan.module, ...) (on several "
            "GPUs nn.DataParallel replicates modules by a shallow copy, which a planned module "
            "refuses: it would share the model yet escape its checks)",
        ),
        (
            nn.parallel.DistributedDataParallel,
            "a DistributedDataParallel wrapper",
            "wraps",
            "module",
            "wrap the planned module (DistributedDataParallel(plan.module, ...))",
        ),
    ]


def _refuse_variadic_calls(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise a PlanningError for a ``torch.compile``d, ``DataParallel`` or DDP module (each
    says what to plan instead), or a call whose tensors reach ``forward`` through ``*args`` (a
    pass-through wrapper): neither capture can give those inputs names, which the planned
    module's calls and checks need."""
    name = type(model).__name__
    for wrapper, what, does, inner, then in _wrappers():
        if isinstance(model, wrapper):
            raise PlanningError(
                f"{name} is {what}: plan the module it {does} "
                f"(planner.plan(model.{inner}, ...)), then {then}."
            )
    if _variadic_tensors(model, args, kwargs, inspect.Parameter.VAR_POSITIONAL):
        raise PlanningError(
            f"{name}.forward takes the example's tensors through *args, which planner cannot "
            "capture (the graph's inputs need names). Plan the module it passes them to (a "
            f"wrapper's inner model: planner.plan(wrapper.model, ...)), or give {name}.forward "
            "named parameters (forward(self, x, mask=None, **kwargs))."
        )


@paused_collection()
def capture(
    model: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    leaf_modules: tuple = (),
    dynamic_shapes: bool = False,
) -> Captured:
    """Capture ``model`` called as ``model(*args, **kwargs)`` as a GraphModule.

    Instances of ``leaf_modules`` (module classes) stay single ``call_module`` nodes of the
    user's own modules instead of being traced through, under ``symbolic_trace`` and
    ``torch.export`` alike (see ``planner.export_leaves``): plans then checkpoint whole blocks,
    and hooks on those blocks (e.g. FSDP2's ``fully_shard`` per block) keep running.
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
    _refuse_variadic_calls(model, args, kwargs)
    _refuse_graph_module_names(model)
    _refuse_layerdrop(model)
    fixed = _without_cache(model, args, kwargs)
    grad_mode_read: list[bool] = []
    with (
        CAPTURE_LOCK,
        _capturing_thread(),
        _refusing_manual_checkpoints(model),
        recording_regions(),
        refusing_side_effects(model),
        restoring_output_recorders(model),
        noting_grad_mode_reads(grad_mode_read),
    ):
        captured = _trace_or_export(model, args, kwargs, fixed, leaf_modules, dynamic_shapes)
    _refuse_dropped_hooks(model, captured)
    captured.graph_module.meta["planner.reads_grad_mode"] = bool(grad_mode_read)
    return captured
