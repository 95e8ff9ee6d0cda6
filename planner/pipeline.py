"""``plan()``: the pipeline capture -> profile -> analyse -> solve -> simulate -> rewrite."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
import warnings
from collections.abc import Mapping
from typing import cast

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from planner.capture import capture
from planner.costs import CostModel, captured_node_seconds
from planner.errors import PlanningError, non_negative_int, short_repr
from planner.nested import NestedChoice
from planner.optimizer import optimizer_memory
from planner.options import CaptureOptions
from planner.planned_module import (
    PlannedModule,
    call_dtypes,
    call_grads,
    call_sizes,
    tensor_arguments,
)
from planner.plans import Plan
from planner.problem import Problem, build_problem
from planner.profile import profile
from planner.rewrite import rewrite
from planner.serialize import input_spec
from planner.simulate import Choice, Simulation, as_choice, simulate
from planner.solvers.auto import choose, lowest_peak
from planner.solvers.rotor import replay
from planner.step import grad_fn_of
from planner.units import GIB, mib

MAX_BUDGET_BYTES = 2**63  # byte counts are int64


def budget_in_bytes(budget_gb, budget_bytes) -> int:
    """The budget in bytes from exactly one of ``budget_gb`` (GiB) and ``budget_bytes``."""
    if (budget_gb is None) == (budget_bytes is None):
        raise ValueError("give exactly one of budget_gb= (GiB, 2**30 bytes) and budget_bytes=")
    name, value = (
        ("budget_gb", budget_gb) if budget_gb is not None else ("budget_bytes", budget_bytes)
    )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    number = value if isinstance(value, int) else float(value)
    nbytes = number * GIB if name == "budget_gb" else number
    if not nbytes < MAX_BUDGET_BYTES:
        raise ValueError(
            f"{name}={value!r} is more bytes than planner counts (below 2**63, "
            f"budget_gb={MAX_BUDGET_BYTES / GIB:.3g}); for no limit, give the baseline peak "
            "or any budget larger than it"
        )
    if nbytes < 1:
        raise ValueError(f"{name}={value!r} is less than one byte")
    return int(nbytes)  # a fraction of a byte is dropped: the budget is a limit


def _check_type(name: str, value, expected: type) -> None:
    """An option of the wrong kind (``cost_model="roofline"``) is a TypeError saying which."""
    if value is not None and not isinstance(value, expected):
        raise TypeError(
            f"{name} must be a planner.{expected.__name__} or None, got {type(value).__name__} "
            f"{value!r}"
        )


def _cut_from_their_graph(example):
    """``example`` with each tensor that an autograd graph made (an encoder's output given to
    the head planned, a generator's to a discriminator) detached, ``requires_grad`` kept: the
    plan is of the model's step, and the fake profile cannot differentiate into a graph it
    was not given. One tensor passed twice stays one tensor."""
    leaves, spec = tree_flatten(example)
    cut: dict[int, torch.Tensor] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and grad_fn_of(leaf) is not None:
            if id(leaf) not in cut:
                cut[id(leaf)] = leaf.detach().requires_grad_(leaf.requires_grad)
            leaves[i] = cut[id(leaf)]
    return tree_unflatten(leaves, spec) if cut else example


def _is_scripted(module: nn.Module) -> bool:
    return isinstance(module, (torch.jit.ScriptModule, torch.jit.RecursiveScriptModule))


def _check_model(model: nn.Module, args: tuple, kwargs: dict) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, PlannedModule):
        raise PlanningError(
            f"{type(model).__name__} is already a plan (the module planner.plan returns as "
            "plan.module). Plan the model it was planned from instead, with the new budget: "
            "plan.module shares that model's parameters, so the new plan trains the same "
            "weights."
        )
    inner = [name for name, m in model.named_modules() if name and isinstance(m, PlannedModule)]
    if inner:
        raise PlanningError(
            f"{', '.join(inner)} of {type(model).__name__} "
            f"{'is a plan' if len(inner) == 1 else 'are plans'} (the module planner.plan returns "
            "as plan.module): a model is planned whole, once. Put back the module each was "
            f"planned from (plan.module shares its parameters) and plan {type(model).__name__}: "
            "the plan chooses segments inside it too."
        )
    scripted: list[str] = []  # the outermost ones
    for name, m in model.named_modules():
        inside = any(not s or name.startswith(s + ".") for s in scripted)
        if _is_scripted(m) and not inside:
            scripted.append(name)
    if scripted:  # found by a tester: a bare KeyError, or advice about the inputs' shapes
        what = (
            f"the model ({type(model).__name__})"
            if scripted == [""]
            else f"{', '.join(scripted[:4])} of {type(model).__name__}"
        )
        raise PlanningError(
            f"{what} {'is' if len(scripted) == 1 else 'are'} TorchScript (torch.jit.script or "
            "trace), "
            "which planning cannot capture or run on the stand-in tensors it profiles with. "
            "Plan the nn.Module before scripting it, and script or trace something else, or "
            "train the scripted model without a plan."
        )
    lazy = [
        name
        for name, p in [*model.named_parameters(), *model.named_buffers()]
        if isinstance(p, (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer))
    ]
    if lazy:
        raise PlanningError(
            f"{type(model).__name__} has lazy parameters not yet initialised "
            f"({', '.join(lazy[:4])}{', ...' if len(lazy) > 4 else ''}: nn.LazyLinear and "
            "kin take their sizes from their first call). Call the model once on an example "
            "input (model(*example_inputs)) before planning."
        )
    inputs_need_grad = any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs))
    )  # a frozen model differentiated for its input: adversarial examples, feature visualisation
    if not inputs_need_grad and not any(p.requires_grad for p in model.parameters()):
        raise PlanningError(
            f"{type(model).__name__} has no parameter that requires grad, and no input does: a "
            "training step would compute no gradients, so there are no activations to keep or "
            "recompute. Unfreeze some parameters (requires_grad_(True)) before planning, or "
            "pass inputs that require grad if you differentiate for them."
        )
    if not model.training:
        warnings.warn(
            f"{type(model).__name__} is in eval mode: the plan is made for eval-mode behaviour "
            "(no dropout, BatchNorm using running statistics). Call model.train() first if you "
            "will train it in train mode.",
            stacklevel=3,
        )
    devices = {t.device for t in _tensors((args, kwargs))}
    devices |= {p.device for p in model.parameters()} - {torch.device("meta")}
    if len(devices) > 1:
        raise PlanningError(
            f"the model's parameters and the example inputs are on different devices "
            f"({', '.join(sorted(map(str, devices)))}); move them to one device before planning."
        )


def _keyword_arguments(example_kwargs) -> dict:
    if example_kwargs is None:
        return {}
    if not isinstance(example_kwargs, Mapping) or not all(
        isinstance(key, str) for key in example_kwargs
    ):
        raise TypeError(
            f"example_kwargs must be a dict of keyword arguments by name, as in "
            f"model(*example_inputs, **example_kwargs); got {short_repr(example_kwargs)}. "
            "Positional arguments go in the example_inputs tuple."
        )
    return dict(example_kwargs)


# Outputs summed as the loss, as a share of the budget, from which planning warns that a loss
# computed from them is not planned for (its log-softmax and gradient: about twice the outputs).
LOSS_WARNING_SHARE = 0.01


def _warn_unplanned_loss(model: nn.Module, problem: Problem, budget: int) -> None:
    """Warn when the model returns no 0-dim loss, no ``loss_fn`` was given and its outputs are
    large enough that a loss computed from them would take the step over the budget: found
    trying the library, a cross-entropy over the logits of a model planned as README's quick
    start shows went 99.8% over, without a word."""
    summed = problem.summed_output_bytes
    if 2 * summed < LOSS_WARNING_SHARE * budget:
        return
    warnings.warn(
        f"{type(model).__name__} returns {mib(summed)} of outputs and no 0-dim loss, and no "
        "loss_fn= was given: the plan takes the sum of the outputs as the step's loss. A loss "
        "computed from them in the training loop (a cross-entropy over logits: a log-softmax "
        f"as large as them and its gradient, about {mib(2 * summed)}) holds memory the plan "
        "does not count and can take the step over the budget. Pass that loss as loss_fn= "
        "(e.g. lambda out: F.cross_entropy(out.flatten(0, 1), labels.flatten())) to plan for "
        "it; a loss that is the sum of the outputs needs nothing more (on the CPU some backward "
        "kernels copy its expanded gradient whole: docs/guarantees.md, CPU kernels' own "
        "buffers).",
        stacklevel=3,
    )


def _floor_advice(problem: Problem, lowest: int) -> str:
    """What takes the memory no plan removes, and what can lower the peak: at 90% or more of
    the lowest peak, parameters, their gradients and optimizer state set the floor, and a
    smaller batch barely helps."""
    optimizer = problem.optimizer_state_bytes
    state = problem.fixed_bytes - optimizer
    floor = problem.fixed_bytes + problem.gradient_bytes
    parts = f"parameters, buffers and inputs take {mib(state)}, parameter gradients " + (
        f"{mib(problem.gradient_bytes)} and optimizer state {mib(optimizer)}"
        if optimizer
        else f"{mib(problem.gradient_bytes)} and optimizer state none (optimizer_state_bytes=0)"
    )
    raise_to = f"Raise the budget to at least budget_bytes={lowest}"
    if floor >= 0.9 * lowest:
        return (
            f"Of that, {parts}: together {mib(floor)}, which no checkpointing removes, so a "
            f"smaller batch or input barely helps. {raise_to}, or train fewer parameters "
            "(requires_grad_(False) on some), keep parameters and gradients in a smaller dtype "
            "(bfloat16), or shard parameters, gradients and optimizer state across devices "
            "(FSDP)."
        )
    return (
        f"Of that, {parts}; activations take the rest. {raise_to}, or use a smaller batch or "
        "shorter inputs."
    )


def _never_recomputed(graph: fx.Graph) -> str:
    """Names the nodes no plan recomputes because running them again would repeat what they
    do beside tensor operations (``planner.repeated_effects``): they may set the floor."""
    found = [
        f"{node.name} ({', '.join(node.meta['planner.repeated_effects'])})"
        for node in graph.nodes
        if node.meta.get("planner.repeated_effects")
    ]
    if not found:
        return ""
    return (
        f" {len(found)} node{'s are' if len(found) > 1 else ' is'} never recomputed, since "
        f"running {'them' if len(found) > 1 else 'it'} again would repeat what "
        f"{'they do' if len(found) > 1 else 'it does'} beside tensor operations: "
        f"{', '.join(found[:4])}{f' and {len(found) - 4} more' if len(found) > 4 else ''}. "
        "For plans that may recompute them, set no attributes in forward (return such "
        "values) and draw random numbers from torch's default generator."
    )


def _check_loss_fn(loss_fn) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be a callable from the model's output to a scalar loss, got "
            f"{type(loss_fn).__name__}"
        )


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def prepare(
    model: nn.Module,
    example_inputs,
    example_kwargs: dict | None = None,
    *,
    cost_model: CostModel | None = None,
    optimizer_state_bytes: int | None = None,
    capture_options: CaptureOptions | None = None,
    loss_fn=None,
    optimizer=None,
):
    """Capture, profile and analyse once: (captured, Problem). Reused by sweeps over budgets.

    ``capture_options`` (default ``CaptureOptions()``) decide the captured graph; the other
    arguments are as for ``plan``.
    """
    _check_type("cost_model", cost_model, CostModel)
    _check_type("capture_options", capture_options, CaptureOptions)
    options = capture_options or CaptureOptions()
    if optimizer_state_bytes is not None:  # a negative one hid memory from the budget
        optimizer_state_bytes = non_negative_int("optimizer_state_bytes", optimizer_state_bytes)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = _keyword_arguments(example_kwargs)
    _check_model(model, args, kwargs)
    args, kwargs = _cut_from_their_graph((args, kwargs))
    captured = capture(
        model,
        args,
        kwargs,
        leaf_modules=options.leaf_modules,
        dynamic_shapes=options.dynamic_shapes,
    )
    # The planned module checks that calls pass these again, with these dtypes (see
    # planner.planned_module.Snapshot.call_form).
    captured.graph_module.meta["planner.tensor_arguments"] = tensor_arguments(model, args, kwargs)
    captured.graph_module.meta["planner.call_dtypes"] = call_dtypes(
        model, args, kwargs, layouts=captured.method == "export"
    )
    captured.graph_module.meta["planner.call_sizes"] = call_sizes(model, args, kwargs)
    captured.graph_module.meta["planner.call_grads"] = call_grads(model, args, kwargs)
    _check_loss_fn(loss_fn)
    prof = profile(
        captured.graph_module, *captured.inputs(args, kwargs), loss_fn=loss_fn, model=model
    )
    counted = None if optimizer is None else optimizer_memory(optimizer, model, prof.gradless)
    if optimizer_state_bytes is None:
        optimizer_state_bytes = counted.state_bytes if counted is not None else 0
    if cost_model is not None and cost_model.measure_repeat:
        times = captured_node_seconds(
            captured, model, args, kwargs, repeat=cost_model.measure_repeat
        )
        cost_model = dataclasses.replace(cost_model, measured_seconds=times, measure_repeat=0)
    problem = build_problem(
        captured.graph_module,
        prof,
        cost_model=cost_model,
        optimizer_state_bytes=optimizer_state_bytes,
        optimizer_step_bytes=counted.step_bytes if counted is not None else 0,
    )
    if cost_model is not None and cost_model.measured_seconds is not None:
        graph_nodes = problem.names[: problem.size - (prof.loss is not None)]  # the loss: not timed
        _check_measured_names(cost_model.measured_seconds, graph_nodes, options)
    return captured, problem


def _check_measured_names(measured: Mapping, names: tuple[str, ...], options) -> None:
    """Measured times must be those of this graph's nodes: a node without one falls back to
    the roofline estimate, whose scale (a GPU's) differs from the measurement's, and names of
    another capture (other leaf_modules or dynamic_shapes) may name other nodes here."""
    unmeasured = [name for name in names if name not in measured]
    strangers = len(set(measured) - set(names))
    if not names or (not unmeasured and not strangers):
        return
    advice = (
        "Measure the times with the plan's own capture options: planner.costs.node_seconds("
        f"model, args, kwargs, capture_options={options!r}), or let planning measure them on "
        "the graph it captures: CostModel(measure_repeat=3)."
    )
    if len(unmeasured) == len(names):
        raise PlanningError(
            f"CostModel.measured_seconds names none of the {len(names)} nodes of the captured "
            f"graph (it has {len(measured)} times, for nodes such as {next(iter(measured), '')!r}"
            f"; the graph's first node is {names[0]!r}): they were measured on another graph. "
            + advice
        )
    mismatch = []
    if unmeasured:
        mismatch.append(
            f"{len(unmeasured)} of its {len(names)} nodes have no measured time and use the "
            f"roofline estimate (e.g. {unmeasured[:3]})"
        )
    if strangers:
        mismatch.append(f"{strangers} measured names are of no node here")
    warnings.warn(
        f"CostModel.measured_seconds does not match the captured graph: {' and '.join(mismatch)}"
        ". " + advice,
        stacklevel=3,
    )


def plan(
    model: nn.Module,
    example_inputs,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    example_kwargs: dict | None = None,
    solver="auto",
    optimizer_state_bytes: int | None = None,
    cost_model: CostModel | None = None,
    leaf_modules: tuple = (),
    dynamic_shapes: bool = False,
    loss_fn=None,
    optimizer=None,
) -> Plan:
    """Plan which activations of ``model`` to recompute so that a training step fits a budget.

    Parameters
    ----------
    model
        The model, in train mode. It is never modified: the plan's module shares its parameters.
    example_inputs
        A tensor or a tuple of positional arguments, as in ``model(*example_inputs)``.
    budget_gb, budget_bytes
        Exactly one: the memory of the whole training step, in GiB (2**30 bytes) or bytes:
        parameters + gradients + optimizer state + activations + working memory of the largest
        operation; or, when higher, what ``optimizer.step()`` holds (parameters, gradients,
        state and its temporaries). Gradients count from backward on: the step starts with
        ``.grad`` None (``zero_grad(set_to_none=True)``, the default); zeroed in place, they
        are held through the step, about their size more (``plan_batch`` plans accumulation).
    example_kwargs
        Keyword arguments of the call.
    solver
        ``"auto"`` (default: the cheapest fitting plan of all strategies), a registered name
        (``"sqrt_n"``, ``"greedy"``, ...), or a callable ``solve(problem, budget_bytes)``.
    leaf_modules
        Module classes to keep whole (e.g. a transformer block class): segments then start and
        end at their boundaries, and hooks on them, such as FSDP2 sharding per block, keep
        running, in recompute too. Under ``symbolic_trace`` and ``torch.export`` alike.
    dynamic_shapes
        For models captured by ``torch.export`` (Hugging Face transformers): let the planned
        module take other batch sizes and sequence lengths than the example's (capture is
        slower). The budget holds for the example's sizes: give the largest you train with;
        a larger call warns. Models ``symbolic_trace`` captures take other sizes without it;
        their budget also holds up to the example's sizes (a larger call warns too).
    loss_fn
        The training step's loss: ``loss_fn(output)`` returns a 0-dim tensor from what the
        model returns; labels come through its closure, e.g.
        ``lambda out: F.cross_entropy(out.flatten(0, 1), labels.flatten())``. Its memory (a
        float copy of the logits, a log-softmax, their gradients) is planned for. Measure with
        the same ``loss_fn`` (``planner.step.peak_memory(..., loss_fn=...)``). Default: the
        sum of the outputs (``planner.step.training_loss``), or the output itself when the
        model returns a 0-dim loss.
    optimizer
        The optimizer the step ends with: an instance (it counts the parameters it was given),
        its class or a factory (``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``,
        given the trainable parameters). Its state (Adam: two tensors per trainable parameter)
        and the temporaries of its ``step()`` are counted, by one meta run of the same
        optimizer (``planner.optimizer.optimizer_memory``). An instance over float32 master
        copies of a low-precision model's parameters counts the copies too. Under
        ``torch.autocast``, plan inside the same region as the step (see docs/pipeline.md).
    optimizer_state_bytes
        Bytes of optimizer state, counted by hand and held through the whole step; overrides
        the state ``optimizer`` counts (the temporaries of its ``step()`` are still counted).
        Alone, no temporaries are counted: add the most ``step()`` allocates at once (a
        ``foreach`` step: a few copies of the gradients) to count them, on the safe side.

    Raises
    ------
    ValueError
        For a budget that is missing, given twice, not a number, not finite or not positive.
    PlanningError
        When no plan fits the budget (the message gives the minimum achievable and the
        baseline), or when the model cannot be captured or run on the example inputs.

    Examples
    --------
    >>> import planner
    >>> model, inputs = planner.zoo.gpt(layers=2)
    >>> p = planner.plan(model, inputs, budget_bytes=10 * 2**20)
    >>> p.predicted_peak_bytes <= p.budget_bytes
    True
    """
    budget = budget_in_bytes(budget_gb, budget_bytes)
    options = CaptureOptions(leaf_modules, dynamic_shapes)
    start = time.perf_counter()
    captured, problem = prepare(
        model,
        example_inputs,
        example_kwargs,
        cost_model=cost_model,
        optimizer_state_bytes=optimizer_state_bytes,
        capture_options=options,
        loss_fn=loss_fn,
        optimizer=optimizer,
    )
    _warn_unplanned_loss(model, problem, budget)
    baseline = simulate(problem, ())
    solve_start = time.perf_counter()
    name, segments = choose(problem, budget, solver)
    solve_seconds = time.perf_counter() - solve_start
    result = replay(problem, segments)  # auto replayed a nested plan already
    if result.peak_bytes > budget:
        lowest = lowest_peak(problem)
        if lowest.peak_bytes <= budget:  # only a named solver can miss a budget auto meets
            raise PlanningError(
                f"solver {name!r} returned a plan whose predicted peak is "
                f"{mib(result.peak_bytes)} ({result.peak_bytes} bytes), over the budget of "
                f"{mib(budget)} ({budget} bytes); plans down to {mib(lowest.peak_bytes)} "
                f"({lowest.peak_bytes} bytes, the lowest peak found) exist: use solver='auto', "
                f"which finds one within this budget, or give {name!r} a larger budget."
            )
        raise PlanningError(
            f"no plan fits a budget of {mib(budget)} ({budget} bytes): the lowest predicted "
            f"peak found is {mib(lowest.peak_bytes)} ({lowest.peak_bytes} bytes) and the "
            f"baseline without checkpointing is {mib(baseline.peak_bytes)}. "
            + _floor_advice(problem, lowest.peak_bytes)
            + (
                f" Solver {name!r} found no plan below {mib(result.peak_bytes)} "
                f"({result.peak_bytes} bytes): with it, give budget_bytes={result.peak_bytes} or "
                "more; solver='auto' reaches the lowest above."
                if solver != "auto" and result.peak_bytes > lowest.peak_bytes
                else ""
            )
            + _never_recomputed(captured.graph_module.graph)
        )
    planned = assemble(
        model,
        captured,
        problem,
        segments,
        solver=name,
        budget_bytes=budget,
        solve_seconds=solve_seconds,
        started=start,
        input_spec=input_spec(example_inputs, example_kwargs),
        capture_options=options,
        simulated=result,
    )
    # A call leaving out a tensor argument (attention_mask) is planned like this one when first
    # seen (see planner.planned_module.Snapshot.run_form).
    cast(PlannedModule, planned.module)._planner.plan_call = functools.partial(
        plan,
        model,
        budget_bytes=budget,
        solver=solver,
        optimizer_state_bytes=optimizer_state_bytes,
        cost_model=cost_model,
        leaf_modules=leaf_modules,
        dynamic_shapes=dynamic_shapes,
        loss_fn=loss_fn,
        optimizer=optimizer,
    )
    if isinstance(optimizer, torch.optim.Optimizer):
        cast(PlannedModule, planned.module)._planner.watch_optimizer(optimizer)
    return planned


def assemble(
    model: nn.Module,
    captured,
    problem: Problem,
    segments,
    *,
    solver: str,
    budget_bytes: int,
    solve_seconds: float,
    started: float,
    input_spec: dict | None = None,
    capture_options: CaptureOptions | None = None,
    simulated: Simulation | None = None,
    accumulation_bytes: int | None = None,
) -> Plan:
    """Simulate, rewrite and package a choice (segments, or a ``Choice``; shared by plan, load
    and plan_batch). ``simulated``: its simulation, when the caller has it (a nested plan's
    replay is slow). ``accumulation_bytes``: see ``Plan`` (``problem`` already counts them)."""
    nesting = segments if isinstance(segments, NestedChoice) and segments.flat() is None else None
    if nesting is not None:
        flat = Choice(tuple((s.start, s.stop) for s in nesting.segments))
    else:
        flat = as_choice(segments.flat() if isinstance(segments, NestedChoice) else segments)
    choice = nesting or flat
    baseline = simulate(problem, ())
    result = simulated if simulated is not None else simulate(problem, choice)
    step_seconds = problem.step_seconds
    module = rewrite(captured.graph_module, model, choice, problem=problem)
    # Later micro-batches of a window start with the gradients held: counted, so no warning.
    module._planner.gradients_held = accumulation_bytes is not None
    return Plan(
        segments=flat.segments,
        keep=flat.keep,
        nesting=nesting,
        solver=solver,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=result.peak_bytes,
        baseline_peak_bytes=baseline.peak_bytes,
        predicted_overhead=result.recompute_seconds / step_seconds if step_seconds else 0.0,
        recompute_flops=result.recompute_flops,
        capture_method=captured.method,
        solve_seconds=solve_seconds,
        planning_seconds=time.perf_counter() - started,
        module=module,
        problem=problem,
        input_spec=input_spec,
        capture_options=capture_options or CaptureOptions(),
        training=model.training,
        accumulation_bytes=accumulation_bytes,
    )
