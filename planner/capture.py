"""Capture: turn a model into a ``torch.fx.GraphModule`` the later passes can read and rewrite.

``torch.fx.symbolic_trace`` is tried first: it keeps leaf modules (``nn.Linear``...) as single
nodes, which makes plans readable. Models it cannot trace (data-dependent Python, Hugging Face
transformers) go through ``torch.export.export(strict=False)``, which records ATen-level nodes.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass

import torch
from torch import fx, nn

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
    """Arguments that are not tensors (flags, ints, None): tracing specialises on their values."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as error:
        raise PlanningError(
            f"example inputs do not match {type(model).__name__}.forward"
            f"{inspect.signature(model.forward)}: {error}"
        ) from error
    return {
        name: value
        for name, value in bound.arguments.items()
        if not isinstance(value, torch.Tensor)
        and inspect.signature(model.forward).parameters[name].kind
        not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }


def _trace(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    concrete = _non_tensor_arguments(model, args, kwargs)
    return fx.symbolic_trace(model, concrete_args=concrete or None)


def _export(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(model, args, kwargs, strict=False)
    return program.module()


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None) -> Captured:
    """Capture ``model`` called as ``model(*args, **kwargs)`` as a GraphModule.

    Raises
    ------
    PlanningError
        When neither ``symbolic_trace`` nor ``torch.export`` can capture the model; the message
        gives both reasons and what to try.
    """
    kwargs = kwargs or {}
    try:
        return Captured(_trace(model, args, kwargs), "symbolic_trace")
    except PlanningError:
        raise
    except Exception as trace_error:  # noqa: BLE001 - any tracing failure means: try export
        log.info("symbolic_trace failed (%s); trying torch.export", trace_error)
        try:
            return Captured(_export(model, args, kwargs), "export")
        except Exception as export_error:  # noqa: BLE001
            raise PlanningError(
                f"cannot capture {type(model).__name__} as a graph.\n"
                f"  torch.fx.symbolic_trace: {type(trace_error).__name__}: {trace_error}\n"
                f"  torch.export (strict=False): {type(export_error).__name__}: {export_error}\n"
                "What to try: pass non-tensor arguments through example_kwargs so that tracing can "
                "specialise on them; make the data-dependent part of forward a leaf module; or "
                "check that the model runs with these example inputs."
            ) from export_error
