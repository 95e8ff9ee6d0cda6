"""``plan()``: the pipeline capture -> profile -> analyse -> solve -> simulate -> rewrite."""

from __future__ import annotations

import math
import numbers
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from planner.capture import capture, module_classes
from planner.costs import CostModel
from planner.errors import PlanningError
from planner.optimizer import optimizer_memory
from planner.problem import Problem, build_problem
from planner.profile import profile
from planner.rewrite import rewrite, tensor_arguments
from planner.serialize import input_spec
from planner.simulate import (
    Choice,
    Segments,
    Simulation,
    as_choice,
    simulate,
    validate_choice,
    validate_segments,
)
from planner.solvers import SOLVERS, get_solver
from planner.solvers.sqrt_n import segments_between

GIB = 2**30
MAX_BUDGET_BYTES = 2**63  # byte counts are int64
AUTO_OPTIMAL_MAX_NODES = 50_000
AUTO_OPTIMAL_SECONDS = 30.0  # auto's time limit for optimal (its best plan by then is kept)


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan and the module that carries it out.

    ``module`` is a drop-in replacement for the model (same call signature, outputs, parameters
    and ``state_dict`` keys). Peaks are bytes of the whole training step (parameters, gradients,
    optimizer state when given, activations, working memory); ``predicted_overhead`` is the
    recompute time as a fraction of a step without checkpointing (forward + backward, taken as
    three forwards), under the cost model. ``leaf_modules`` and ``training`` record how the
    model was captured (``save`` writes them, so that ``load`` captures it the same way).
    """

    segments: Segments
    solver: str
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    predicted_overhead: float
    recompute_flops: float
    capture_method: str
    solve_seconds: float
    planning_seconds: float
    module: fx.GraphModule = field(repr=False, compare=False)
    problem: Problem = field(repr=False, compare=False)
    input_spec: dict | None = field(default=None, repr=False, compare=False)
    leaf_modules: tuple = field(default=(), repr=False, compare=False)
    training: bool = field(default=True, repr=False, compare=False)

    keep: frozenset[int] = frozenset()  # positions of kept nodes inside segments

    @property
    def choice(self) -> Choice:
        """The segments and kept nodes, as solvers and ``simulate`` take them."""
        return Choice(self.segments, self.keep)

    @property
    def baseline_fixed_bytes(self) -> int:
        """Parameters, buffers, inputs and optimizer state: memory no plan can remove."""
        return self.problem.fixed_bytes

    def segment_table(self) -> list[dict]:
        """One row per checkpointed segment: positions, node names, inputs and dropped bytes.

        ``input_tensors`` and ``input_bytes`` are the activation storages made before the
        segment and read inside it: the checkpoint's inputs, which it holds until its backward
        (as ``simulate`` counts them). Tensors that merely cross the cut on their way to later
        nodes are not among them. Every rendering of the plan (``str``, the notebook HTML, the
        graph drawing) shows these rows. Kept nodes (``keep``) are neither dropped nor
        recomputed: ``kept`` names them and ``kept_bytes`` is what their cache holds from the
        forward to the recompute.
        """
        saved = self.problem.saved_bytes_per_node()
        seconds = self.problem.seconds.copy()
        saved[list(self.keep)], seconds[list(self.keep)] = 0, 0.0
        rows = []
        for k, (start, stop) in enumerate(self.segments):
            tensors, nbytes = _segment_inputs(self.problem, start, stop)
            rows.append(
                {
                    "segment": k,
                    "start": start,
                    "stop": stop,
                    "nodes": stop - start,
                    "first": self.problem.names[start],
                    "last": self.problem.names[stop - 1],
                    "input_tensors": tensors,
                    "input_bytes": nbytes,
                    "dropped_bytes": int(saved[start:stop].sum()),
                    "recompute_seconds": float(seconds[start:stop].sum()),
                    "kept": [self.problem.names[i] for i in sorted(self.keep) if start <= i < stop],
                    "kept_bytes": int(
                        sum(int(self.problem.kept_bytes[i]) for i in self.keep if start <= i < stop)
                    ),
                }
            )
        return rows

    def __str__(self) -> str:
        kept = f", {len(self.keep)} nodes kept inside them" if self.keep else ""
        lines = [
            f"Plan: {len(self.segments)} checkpointed segments{kept} over {self.problem.size} "
            f"nodes (solver {self.solver}, captured by {self.capture_method})",
            f"  budget          {_mib(self.budget_bytes):>12}",
            f"  predicted peak  {_mib(self.predicted_peak_bytes):>12}"
            f"   (baseline {_mib(self.baseline_peak_bytes)}, "
            f"fixed {_mib(self.problem.fixed_bytes)})",
            f"  recompute       {self.predicted_overhead:>11.1%}   of a step "
            f"({self.recompute_flops:.3g} FLOPs)",
            f"  planning time   {self.planning_seconds:>10.2f} s   "
            f"(solve {self.solve_seconds:.3f} s)",
            *self._step_lines(),
        ]
        rows = self.segment_table()
        if rows:
            header = (
                f"  {'seg':>4} {'nodes':>6} {'from':<24} {'to':<24} {'inputs':>10} {'dropped':>10}"
            )
            lines.append(header + (f" {'kept':>5} {'kept bytes':>10}" if self.keep else ""))
            for r in rows:
                line = (
                    f"  {r['segment']:>4} {r['nodes']:>6} {r['first']:<24.24} "
                    f"{r['last']:<24.24} {_mib(r['input_bytes']):>10} "
                    f"{_mib(r['dropped_bytes']):>10}"
                )
                if self.keep:
                    line += f" {len(r['kept']):>5} {_mib(r['kept_bytes']):>10}"
                lines.append(line)
        return "\n".join(lines)

    def _step_lines(self) -> list[str]:
        """The loss and optimizer parts of the step, when the plan was given them."""
        problem, lines = self.problem, []
        if problem.has_loss:
            lines.append(
                f"  loss_fn         {_mib(problem.created_bytes[-1]):>12}   kept for its backward, "
                f"which allocates {_mib(problem.activation_grad_alloc[-1])}"
            )
        if problem.optimizer_state_bytes or problem.optimizer_step_bytes:
            step = simulate(problem, self.choice).optimizer_step_bytes
            peak = "; the step's peak" if step >= self.predicted_peak_bytes else ""
            lines.append(
                f"  optimizer       {_mib(problem.optimizer_state_bytes):>12}   state; step() "
                f"holds {_mib(step)} with {_mib(problem.optimizer_step_bytes)} of "
                f"temporaries{peak}"
            )
        return lines

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from planner import viz

        return viz.plan_html(self)

    def draw(self, path=None, ax=None, **options):
        """Draw the graph, segments coloured, boundaries highlighted; see planner.viz.draw."""
        from planner import viz

        return viz.draw(self, path=path, ax=ax, **options)

    def plot_memory(self, measured=None, ax=None, **options):
        """Predicted memory over the step, baseline vs plan vs budget; see viz.plot_memory."""
        from planner import viz

        return viz.plot_memory(self, measured, ax=ax, **options)

    def save(self, path, example_inputs=None, example_kwargs=None):
        """Write the plan as JSON (no pickle); load it with ``planner.load(path, model)``."""
        from planner import serialize

        return serialize.save(self, path, example_inputs, example_kwargs)


def _segment_inputs(problem: Problem, start: int, stop: int) -> tuple[int, int]:
    """(count, bytes) of the activation storages made before ``start`` and read in the segment."""
    a = problem.storage_arrays
    inside = (a.read_node >= start) & (a.read_node < stop)
    kept = np.unique(a.read_storage[inside & (a.producer[a.read_storage] < start)])
    return int(kept.size), int(a.nbytes[kept].sum())


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


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
    return int(nbytes)


def _check_model(model: nn.Module, args: tuple, kwargs: dict) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise PlanningError(
            f"{type(model).__name__} has no parameter that requires grad: a training step would "
            "compute no gradients, so there are no activations to keep or recompute. Unfreeze "
            "some parameters (requires_grad_(True)) before planning."
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
            f"model(*example_inputs, **example_kwargs); got {_short_repr(example_kwargs)}. "
            "Positional arguments go in the example_inputs tuple."
        )
    return dict(example_kwargs)


def _floor_advice(problem: Problem, lowest: int) -> str:
    """What takes the memory no plan removes, and what can lower the peak: at 90% or more of
    the lowest peak, parameters, their gradients and optimizer state set the floor, and a
    smaller batch barely helps."""
    optimizer = problem.optimizer_state_bytes
    state = problem.fixed_bytes - optimizer
    floor = problem.fixed_bytes + problem.gradient_bytes
    parts = f"parameters, buffers and inputs take {_mib(state)}, parameter gradients " + (
        f"{_mib(problem.gradient_bytes)} and optimizer state {_mib(optimizer)}"
        if optimizer
        else f"{_mib(problem.gradient_bytes)} and optimizer state none (optimizer_state_bytes=0)"
    )
    raise_to = f"Raise the budget to at least budget_bytes={lowest}"
    if floor >= 0.9 * lowest:
        return (
            f"Of that, {parts}: together {_mib(floor)}, which no checkpointing removes, so a "
            f"smaller batch or input barely helps. {raise_to}, or train fewer parameters "
            "(requires_grad_(False) on some), keep parameters and gradients in a smaller dtype "
            "(bfloat16), or shard parameters, gradients and optimizer state across devices "
            "(FSDP)."
        )
    return (
        f"Of that, {parts}; activations take the rest. {raise_to}, or use a smaller batch or "
        "shorter inputs."
    )


def _check_loss_fn(loss_fn) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be a callable from the model's output to a scalar loss, got "
            f"{type(loss_fn).__name__}"
        )


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def lowest_peak_plan(problem: Problem) -> tuple[Segments | Choice, Simulation]:
    """The candidate plan with the lowest simulated peak, among those the strategies consider."""
    candidates = [
        SOLVERS["greedy"](problem, 0),
        segments_between(problem, problem.articulation_cuts),
        segments_between(problem, [c for c in range(problem.size) if problem.cut_allowed[c]]),
    ]
    if "optimal" in SOLVERS and problem.size <= AUTO_OPTIMAL_MAX_NODES:
        candidates.append(SOLVERS["optimal"](problem, 0, time_limit=AUTO_OPTIMAL_SECONDS))
    return min(((c, simulate(problem, c)) for c in candidates), key=lambda r: r[1].peak_bytes)


def lowest_peak(problem: Problem) -> Simulation:
    """The lowest simulated peak found: the minimum budget ``plan`` reports and accepts."""
    return lowest_peak_plan(problem)[1]


def _solver_result(name: str, result, problem: Problem) -> Segments | Choice:
    """A solver's segments, sorted, as ints (or its ``Choice``, when it keeps nodes inside
    them); a clear error naming the solver when they are not the ``(start, stop)`` pairs of int
    positions every solver must return."""
    if isinstance(result, Choice):
        try:
            choice = validate_choice(problem, result)
        except ValueError as error:
            raise ValueError(f"solver {name!r} returned an invalid plan: {error}") from None
        return choice if choice.keep else choice.segments
    try:
        pairs = None if isinstance(result, (str, bytes)) else [tuple(pair) for pair in result]
    except TypeError:  # not iterable, or items that are not
        pairs = None
    if pairs is None or not all(
        len(pair) == 2
        and all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in pair)
        for pair in pairs
    ):
        raise TypeError(
            f"solver {name!r} returned {_short_repr(result)}; a solver must return a tuple of "
            "(start, stop) pairs of int positions, the half-open segments to checkpoint "
            "(() for none)"
        )
    try:
        return validate_segments(problem, pairs)
    except ValueError as error:
        raise ValueError(f"solver {name!r} returned an invalid plan: {error}") from None


def _short_repr(value) -> str:
    text, kind = repr(value), type(value).__name__
    if len(text) <= 60:
        return f"{kind} {text}"
    return f"a {kind}" + (f" of {len(value)} items" if hasattr(value, "__len__") else "")


def choose(
    problem: Problem, budget: int, solver="auto", **options
) -> tuple[str, Segments | Choice]:
    """Run ``solver`` (a name, ``"auto"``, or a callable) and return (name that ran, choice):
    plain segments, or a ``Choice`` when the solver keeps nodes inside them.

    ``"auto"`` runs ``optimal`` on graphs of at most ``AUTO_OPTIMAL_MAX_NODES`` nodes (its
    search takes about 1-3 s at 10,000-20,000 nodes on two CPU cores, growing about linearly;
    past ``AUTO_OPTIMAL_SECONDS`` it stops with the best plan found by then), then ``greedy``
    and ``sqrt_n``, and keeps the cheapest plan that fits the budget. Name ``solver="optimal"``
    to run it on larger graphs, without a time limit, anyway.
    """
    if solver != "auto":
        name, solve = get_solver(solver)
        return name, _solver_result(name, solve(problem, budget, **options), problem)
    best: tuple[tuple[bool, float], str, Segments | Choice] | None = None
    for name in ("optimal", "greedy", "sqrt_n"):
        if name not in SOLVERS or (name == "optimal" and problem.size > AUTO_OPTIMAL_MAX_NODES):
            continue
        limit = {"time_limit": AUTO_OPTIMAL_SECONDS} if name == "optimal" else {}
        segments = _solver_result(
            name, SOLVERS[name](problem, budget, **{**limit, **options}), problem
        )
        result = simulate(problem, segments)
        fits = result.peak_bytes <= budget
        key = (not fits, result.recompute_seconds if fits else result.peak_bytes)
        if best is None or key < best[0]:
            best = (key, f"auto:{name}", segments)
    if best is None:
        raise PlanningError(
            "solver='auto' runs optimal, greedy and sqrt_n, and none of them is in "
            "planner.SOLVERS: name a registered solver with solver="
        )
    if best[0][0]:  # nothing fits: the plan with the lowest peak may still (the stated minimum)
        segments, result = lowest_peak_plan(problem)
        if result.peak_bytes <= budget:
            return "auto:lowest_peak", segments
    return best[1], best[2]


def prepare(
    model: nn.Module,
    example_inputs,
    example_kwargs: dict | None = None,
    *,
    cost_model: CostModel | None = None,
    optimizer_state_bytes: int | None = None,
    leaf_modules: tuple = (),
    dynamic_shapes: bool = False,
    loss_fn=None,
    optimizer=None,
):
    """Capture, profile and analyse once: (captured, Problem). Reused by sweeps over budgets."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = _keyword_arguments(example_kwargs)
    _check_model(model, args, kwargs)
    captured = capture(
        model, args, kwargs, leaf_modules=leaf_modules, dynamic_shapes=dynamic_shapes
    )
    # The planned module checks that calls pass these again (see planner.rewrite).
    captured.graph_module.meta["planner.tensor_arguments"] = tensor_arguments(model, args, kwargs)
    _check_loss_fn(loss_fn)
    prof = profile(captured.graph_module, *captured.inputs(args, kwargs), loss_fn=loss_fn)
    counted = optimizer_memory(optimizer, model) if optimizer is not None else None
    if optimizer_state_bytes is None:
        optimizer_state_bytes = counted.state_bytes if counted is not None else 0
    problem = build_problem(
        captured.graph_module,
        prof,
        cost_model=cost_model,
        optimizer_state_bytes=optimizer_state_bytes,
        optimizer_step_bytes=counted.step_bytes if counted is not None else 0,
    )
    return captured, problem


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
        state and its temporaries).
    example_kwargs
        Keyword arguments of the call.
    solver
        ``"auto"`` (default: the cheapest fitting plan of all strategies), a registered name
        (``"sqrt_n"``, ``"greedy"``, ...), or a callable ``solve(problem, budget_bytes)``.
    leaf_modules
        Module classes to keep whole (e.g. a transformer block class): segments then start and
        end at their boundaries, and hooks on them, such as FSDP2 sharding per block, keep
        running. Only for models ``symbolic_trace`` captures.
    dynamic_shapes
        For models captured by ``torch.export`` (Hugging Face transformers): let the planned
        module take other batch sizes and sequence lengths than the example's (capture is
        slower). The budget holds for the example's sizes: give the largest you train with;
        a larger call warns. Models ``symbolic_trace`` captures take any size anyway.
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
        optimizer (``planner.optimizer.optimizer_memory``).
    optimizer_state_bytes
        Bytes of optimizer state, counted by hand; overrides what ``optimizer`` counts.

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
    start = time.perf_counter()
    captured, problem = prepare(
        model,
        example_inputs,
        example_kwargs,
        cost_model=cost_model,
        optimizer_state_bytes=optimizer_state_bytes,
        leaf_modules=leaf_modules,
        dynamic_shapes=dynamic_shapes,
        loss_fn=loss_fn,
        optimizer=optimizer,
    )
    baseline = simulate(problem, ())
    solve_start = time.perf_counter()
    name, segments = choose(problem, budget, solver)
    solve_seconds = time.perf_counter() - solve_start
    result = simulate(problem, segments)
    if result.peak_bytes > budget:
        lowest = lowest_peak(problem)
        if lowest.peak_bytes <= budget:  # only a named solver can miss a budget auto meets
            raise PlanningError(
                f"solver {name!r} returned a plan whose predicted peak is "
                f"{_mib(result.peak_bytes)} ({result.peak_bytes} bytes), over the budget of "
                f"{_mib(budget)} ({budget} bytes); plans down to {_mib(lowest.peak_bytes)} "
                f"({lowest.peak_bytes} bytes, the lowest peak found) exist: use solver='auto', "
                f"which finds one within this budget, or give {name!r} a larger budget."
            )
        raise PlanningError(
            f"no plan fits a budget of {_mib(budget)} ({budget} bytes): the lowest predicted "
            f"peak found is {_mib(lowest.peak_bytes)} ({lowest.peak_bytes} bytes) and the "
            f"baseline without checkpointing is {_mib(baseline.peak_bytes)}. "
            + _floor_advice(problem, lowest.peak_bytes)
            + (f" (solver {name} found {_mib(result.peak_bytes)})" if solver != "auto" else "")
        )
    return assemble(
        model,
        captured,
        problem,
        segments,
        solver=name,
        budget_bytes=budget,
        solve_seconds=solve_seconds,
        started=start,
        input_spec=input_spec(example_inputs, example_kwargs),
        leaf_modules=leaf_modules,
    )


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
    leaf_modules: tuple = (),
) -> Plan:
    """Simulate, rewrite and package a choice (segments, or a ``Choice``; shared by plan, load
    and plan_batch)."""
    choice = as_choice(segments)
    baseline = simulate(problem, ())
    result = simulate(problem, choice)
    step_seconds = 3 * float(problem.seconds.sum())
    return Plan(
        segments=choice.segments,
        keep=choice.keep,
        solver=solver,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=result.peak_bytes,
        baseline_peak_bytes=baseline.peak_bytes,
        predicted_overhead=result.recompute_seconds / step_seconds if step_seconds else 0.0,
        recompute_flops=result.recompute_flops,
        capture_method=captured.method,
        solve_seconds=solve_seconds,
        planning_seconds=time.perf_counter() - started,
        module=rewrite(captured.graph_module, model, choice),
        problem=problem,
        input_spec=input_spec,
        leaf_modules=module_classes(leaf_modules),
        training=model.training,
    )
