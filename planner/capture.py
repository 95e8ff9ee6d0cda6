"""Capture: turn a model into a ``torch.fx.GraphModule`` the later passes can read and rewrite.

``torch.fx.symbolic_trace`` is tried first: it keeps leaf modules (``nn.Linear``...) as single
nodes, which makes plans readable. Models it cannot trace (data-dependent Python, Hugging Face
transformers) go through ``torch.export.export(strict=False)``, which records ATen-level nodes.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import warnings
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

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
            "call gradient_checkpointing_disable()) and let planner choose what to recompute, "
            "or do not plan this model."
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
    return gm


def _export(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(model, args, kwargs, strict=False)
    return program.module()


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
    model: nn.Module, args: tuple, kwargs: dict | None = None, *, leaf_modules: tuple = ()
) -> Captured:
    """Capture ``model`` called as ``model(*args, **kwargs)`` as a GraphModule.

    ``leaf_modules`` (module classes) stay single ``call_module`` nodes under ``symbolic_trace``
    instead of being traced through: plans then checkpoint whole blocks, and hooks on those
    blocks (e.g. FSDP2's ``fully_shard`` per block) keep running. ``torch.export`` ignores it.

    Raises
    ------
    PlanningError
        When neither ``symbolic_trace`` nor ``torch.export`` can capture the model; the message
        gives both reasons and what to try.
    """
    kwargs = kwargs or {}
    with _refusing_manual_checkpoints(model):
        try:
            captured = Captured(_trace(model, args, kwargs, tuple(leaf_modules)), "symbolic_trace")
        except PlanningError:
            raise
        except Exception as trace_error:  # noqa: BLE001 - any tracing failure means: try export
            log.info("symbolic_trace failed (%s); trying torch.export", trace_error)
            try:
                captured = Captured(_export(model, args, kwargs), "export")
            except PlanningError:
                raise
            except Exception as export_error:  # noqa: BLE001
                raise PlanningError(
                    f"cannot capture {type(model).__name__} as a graph.\n"
                    f"  torch.fx.symbolic_trace: {type(trace_error).__name__}: {trace_error}\n"
                    f"  torch.export (strict=False): {type(export_error).__name__}: "
                    f"{export_error}\n"
                    "What to try: pass flags and sizes as plain Python values in "
                    "example_inputs or example_kwargs, so that tracing specialises on them; make "
                    "torch.export.export(model, example_inputs, example_kwargs, strict=False) "
                    "work (the fallback path: its error above names the data-dependent line; "
                    "replace a Python `if` on tensor values by torch.where or torch.cond); or "
                    "plan the traceable submodules (leaf blocks) separately and call them from "
                    "your own forward."
                ) from export_error
    _refuse_dropped_hooks(model, captured)
    return captured
