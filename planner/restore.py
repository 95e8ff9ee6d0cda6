"""``load``: apply a saved plan to a model again, without solving.

``load`` captures and profiles the model again (cheap: fake tensors), checks the mode and the
fingerprint, recomputes the predictions with the simulator and rebuilds the module with
``planner.rewrite.rewrite``; it never runs a solver. A plan applied to another model, or to the
same model with inputs of other shapes, is a ``PlanningError`` naming the first difference. The
file format itself is ``planner.serialize``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from contextlib import contextmanager

from torch import nn

from planner.attention import rebuilt_inputs
from planner.batch import accumulation_problem
from planner.errors import PlanningError
from planner.nested import Nest, NestedChoice, validate_nested
from planner.options import CaptureOptions
from planner.pipeline import assemble, prepare
from planner.planned_module import autocast_state
from planner.serialize import (
    build_inputs,
    fingerprint,
    graph_signature,
    model_device,
    qualified_name,
    read,
)
from planner.simulate import Choice, validate_choice

__all__ = ["load"]


def _first_difference(saved: list, now: list, saved_fixed, now_fixed: int) -> str:
    for i, (a, b) in enumerate(zip(saved, now)):
        if list(a) != list(b):
            hint = (
                " (the same operation on tensors of other shapes or dtype, or under another "
                "autocast; or a setting that changes what it computes, a dropout's p)"
            )
            return (
                f"first difference at node {i}: the plan has {a[0]!r} ({a[1]}, {a[2]} bytes), "
                f"the model has {b[0]!r} ({b[1]}, {b[2]} bytes)"
                + (hint if list(a[:2]) == list(b[:2]) else "")
            )
    if len(saved) != len(now):
        return f"the plan has {len(saved)} nodes, the model {len(now)}"
    if saved_fixed is not None and int(saved_fixed) != now_fixed:
        return (
            f"the nodes match, but the model's parameters, buffers and inputs take {now_fixed:,} "
            f"bytes where the plan's took {int(saved_fixed):,} (a parameter or buffer added or "
            "removed, one no node reads included: an EMA copy, an unused head)"
        )
    return (
        "the nodes match by name and operation but differ in FLOPs, bytes moved or parameters "
        "(a parameter frozen or unfrozen since: its gradient's FLOPs and bytes come or go)"
    )


@contextmanager
def _reading(path):
    """Fields of the wrong type or shape (an edited file) raise ``PlanningError``, not errors
    from deep inside ``load``."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
        raise PlanningError(
            f"{path} is not a well-formed saved plan ({type(error).__name__}: {error}); the file "
            "was edited or corrupted: save the plan again"
        ) from None


def _mode(training: bool) -> str:
    return "train" if training else "eval"


def _check_mode(path, data: dict, model, training) -> None:
    """A plan applies to the mode it was captured in (dropout, BatchNorm statistics)."""
    if training is None or bool(training) == model.training:
        return
    raise PlanningError(
        f"the plan in {path} was made for {data.get('model', 'a model')} in "
        f"{_mode(training)} mode, and this {type(model).__name__} is in "
        f"{_mode(model.training)} mode: call model.{'train' if training else 'eval'}() before "
        "planner.load (the mode changes the captured graph: dropout, BatchNorm statistics)."
    )


def _unrecorded_options_hint(model, recorded: dict) -> str:
    """For files of version 1, which recorded neither the mode nor ``leaf_modules``."""
    if "training" in recorded:
        return ""
    hint = " This file does not record how the model was captured:"
    if not model.training:
        hint += (
            " the model is in eval mode; if the plan was made in train mode, call model.train();"
        )
    return hint + " if it was made with leaf_modules=..., pass the same to planner.load."


def _autocast_hint(recorded: dict) -> str:
    """Where the autocast in force differs from the one the plan was made under (found by a
    tester: a plan made under bf16 autocast, loaded outside it, was refused as made for
    tensors of other shapes or dtypes, autocast unsaid)."""
    then = [tuple(entry) for entry in recorded.get("autocast", ())]
    now = [(d, str(t).removeprefix("torch.")) for d, t in autocast_state(off_regions=False)]
    if "autocast" not in recorded or then == now:
        return ""
    made = (
        " and ".join(f"torch.autocast({d!r}, dtype=torch.{t})" for d, t in then)
        if then
        else "no autocast"
    )
    return (
        f" The plan was made under {made}, and the autocast in force now differs: load it "
        "where it runs, as it was made."
    )


def _unmatched_leaf_hint(unmatched) -> str:
    """For recorded ``leaf_modules`` names that no class of the model has (renamed, moved)."""
    if not unmatched:
        return ""
    return (
        f" The plan was made with leaf_modules {', '.join(unmatched)}, which no module of this "
        "model is an instance of (a class renamed or moved?): pass leaf_modules=... to "
        "planner.load."
    )


def _leaf_classes(model: nn.Module, names) -> tuple[type, ...]:
    """The classes among ``model``'s modules (and their bases) with these qualified names.

    A recorded class that no module of ``model`` is an instance of kept nothing whole, so
    leaving it out captures the same graph.
    """
    wanted = set(names)
    found = {
        cls
        for module in model.modules()
        for cls in type(module).__mro__
        if qualified_name(cls) in wanted
    }
    return tuple(sorted(found, key=qualified_name))


def load(
    path,
    model,
    example_inputs=None,
    example_kwargs=None,
    *,
    cost_model=None,
    leaf_modules=None,
    dynamic_shapes=None,
    loss_fn=None,
):
    """Apply a saved plan to ``model``: capture, profile, check, rewrite; no solving.

    Parameters
    ----------
    path : str or path-like
        A file written by ``save`` (``Plan.save``).
    model : torch.nn.Module
        The model the plan was made for (same architecture and sizes), in the mode it was made
        in (train mode, as a rule: the file records it). It is not modified: the plan's module
        shares its parameters.
    example_inputs, example_kwargs : optional
        Inputs of the shapes the plan was made for. When omitted, inputs are built from the
        shapes and dtypes recorded in the file (filled with ones).
    cost_model : planner.CostModel, optional
        For the recompute overhead reported by the loaded plan (default: ``CostModel()``).
    leaf_modules : tuple of module classes, optional
        As given to ``planner.plan``. By default the classes the file records (by qualified
        name) among the classes of ``model``'s modules; needed only for files of format
        version 1, which did not record them.
    dynamic_shapes : bool, optional
        As given to ``planner.plan``; by default what the file records (false when it records
        nothing). With ``leaf_modules``, the ``CaptureOptions`` the model is captured with.
    loss_fn : callable, optional
        The loss the plan was made with (``planner.plan(..., loss_fn=)``), needed again to
        predict the step's memory; plans made without one must be loaded without one.

    Returns
    -------
    planner.Plan
        Its predictions are recomputed by the simulator; ``solver``, ``budget_bytes`` and
        ``solve_seconds`` are those saved; ``planning_seconds`` is the time ``load`` took.

    Raises
    ------
    PlanningError
        When the file is not a saved plan, was written by a newer format, was saved without
        input shapes and no inputs are given, when the model is not in the mode (train or eval)
        the plan was made in, or when the model's graph differs from the one the plan was made
        for (the message names the first differing node).
    """
    data = read(path)
    start_time = time.perf_counter()
    with _reading(path):
        recorded = data.get("capture") or {}
        _check_mode(path, data, model, recorded.get("training"))
        unmatched: list[str] = []
        if leaf_modules is None:
            leaf_modules = _leaf_classes(model, recorded.get("leaf_modules", ()))
            found = {qualified_name(cls) for cls in leaf_modules}
            unmatched = [name for name in recorded.get("leaf_modules", ()) if name not in found]
        if dynamic_shapes is None:
            dynamic_shapes = bool(recorded.get("dynamic_shapes", False))
        recorded_inputs = example_inputs is None
        if example_inputs is None:
            spec = data.get("inputs")
            if spec is None:
                raise PlanningError(
                    f"{path} was saved without the shapes of its example inputs (none were "
                    "given, or they hold a value the file cannot describe: an object other "
                    "than tensors, numbers, strings, dtypes and lists, tuples and dicts of "
                    "them): pass them, planner.load(path, model, example_inputs, "
                    "example_kwargs=...), as given to planner.plan"
                )
            example_inputs, example_kwargs = build_inputs(spec, model_device(model))
        optimizer_state_bytes = int(data.get("optimizer_state_bytes", 0))
        optimizer_step_bytes = int(data.get("optimizer_step_bytes", 0))
        accumulation = data.get("accumulation_bytes")  # plan_batch's plans under accumulation
        if accumulation is not None and (
            isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 0
        ):
            raise ValueError(f"accumulation_bytes {accumulation!r} is no byte count")
        graph = dict(data["graph"])
        saved_signature = [list(row) for row in graph.get("signature", [])]
        solve_seconds = float(data.get("timings", {}).get("solve_seconds", 0.0))
    options = CaptureOptions(leaf_modules, dynamic_shapes)

    if bool(data.get("loss_fn", False)) != (loss_fn is not None):
        raise PlanningError(
            f"the plan in {path} was made "
            + (
                "with a loss_fn: pass the same one, planner.load(path, model, loss_fn=...)"
                if loss_fn is None
                else "without a loss_fn: load it without one"
            )
        )
    try:
        with rebuilt_inputs() if recorded_inputs else contextlib.nullcontext():
            captured, problem = prepare(
                model,
                example_inputs,
                example_kwargs,
                cost_model=cost_model,
                optimizer_state_bytes=optimizer_state_bytes,
                capture_options=options,
                loss_fn=loss_fn,
            )
    except PlanningError as error:
        if not recorded_inputs:
            raise
        raise PlanningError(
            f"{error} (The example inputs were made from the shapes and dtypes {path} recorded: "
            "a model in another dtype, or one whose inputs changed, needs its own inputs, "
            "planner.load(path, model, example_inputs), or a new plan.)"
        ) from error
    problem = dataclasses.replace(problem, optimizer_step_bytes=optimizer_step_bytes)
    if accumulation is not None:
        problem = accumulation_problem(problem, accumulation)
    if fingerprint(problem) != graph.get("fingerprint"):
        raise PlanningError(
            f"the plan in {path} was made for another graph ({data.get('model', '?')}, "
            f"{graph.get('nodes', '?')} nodes; this {type(model).__name__} captures to "
            f"{problem.size} nodes): "
            + _first_difference(
                saved_signature,
                graph_signature(problem),
                data.get("predictions", {}).get("fixed_bytes"),
                int(problem.fixed_bytes),
            )
            + ". A plan applies only to the model and input shapes it was made for; "
            "make a new one with planner.plan(model, example_inputs, budget_gb=...)."
            + _unrecorded_options_hint(model, recorded)
            + _unmatched_leaf_hint(unmatched)
            + _autocast_hint(recorded)
        )

    def read_segment(entry) -> Nest:
        begin, stop = int(entry["start"]), int(entry["stop"])
        if not (0 <= begin < stop <= problem.size) or (
            problem.names[begin],
            problem.names[stop - 1],
        ) != (entry.get("first"), entry.get("last")):
            raise PlanningError(
                f"segment {entry} of {path} does not name the nodes at its positions; the file "
                "was edited or corrupted"
            )
        return Nest(begin, stop, tuple(read_segment(e) for e in entry.get("inner", ())))

    with _reading(path):
        nests = tuple(read_segment(entry) for entry in data["segments"])
        keep = []
        for entry in data.get("keep", []):  # versions 1 and 2 keep nothing
            position = entry.get("position") if isinstance(entry, dict) else None
            if not (
                isinstance(position, int)
                and 0 <= position < problem.size
                and problem.names[position] == entry.get("name")
            ):
                raise PlanningError(
                    f"kept node {entry} of {path} does not name the node at its position; the "
                    "file was edited or corrupted"
                )
            keep.append(position)
    segments = [(s.start, s.stop) for s in nests]
    try:
        if any(s.inner for s in nests):  # version 4: nested segments, nothing kept inside
            if keep:
                raise ValueError(
                    "it nests segments and keeps nodes, which no plan does; the file was "
                    "edited or corrupted"
                )
            choice: Choice | NestedChoice = validate_nested(problem, NestedChoice(nests))
        else:
            choice = validate_choice(problem, Choice(tuple(segments), frozenset(keep)))
    except ValueError as error:
        raise PlanningError(f"{path}: {error}") from None

    budget = data["budget_bytes"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise PlanningError(
            f"budget_bytes {budget!r} of {path} is not a positive integer; the file was edited "
            "or corrupted"
        )
    plan = assemble(
        model,
        captured,
        problem,
        choice,
        solver=data["solver"],
        budget_bytes=budget,
        solve_seconds=solve_seconds,
        started=start_time,
        input_spec=data.get("inputs"),
        capture_options=options,
        accumulation_bytes=accumulation,
    )
    if plan.predicted_peak_bytes > budget:
        warnings.warn(
            f"the plan in {path} now predicts a peak of {plan.predicted_peak_bytes} bytes, over "
            f"the budget of {budget} bytes it was saved with: the model changed since in a way "
            "its graph's fingerprint does not see (the fingerprint covers each node's name, "
            "operation and sizes, not which nodes read which: a skip connection taken from "
            "another layer), or the file was edited, or the profile changed with torch: plan "
            f"again, planner.plan(model, example_inputs, budget_bytes={budget})",
            UserWarning,
            stacklevel=2,
        )
    return plan
