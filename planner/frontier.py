"""The memory/recompute trade-off of one model: the best plan at each of a sweep of budgets.

``frontier(model, inputs)`` captures and profiles the model once, then solves for budgets from
the lowest peak the planner can reach to the peak without checkpointing, so that a user can
pick a budget by looking at what each one costs, rather than guessing one and re-planning.

What the sweep guarantees, whatever the solver:

* every point's simulated peak is within its budget (a budget no plan fits raises
  ``PlanningError`` with the lowest peak found);
* recompute never grows with the budget: a plan that fits a smaller budget fits every larger
  one, so each point keeps the cheaper of its solver's plan and the previous point's;
* the first default point is the lowest peak found by any strategy (``solvers.auto.lowest_peak``),
  or, for a named solver that cannot reach it, the lowest peak that solver reaches;
* the last default point is the baseline: nothing checkpointed, no recompute.

Peaks are *not* monotone in the budget (a larger budget buys less recompute with a higher
peak, or finds the same plan); only ``peak <= budget`` holds.
"""

from __future__ import annotations

import operator
import os
from dataclasses import asdict, dataclass

import numpy as np

from planner.costs import CostModel
from planner.errors import PlanningError
from planner.nested import NestedChoice
from planner.options import CaptureOptions
from planner.pipeline import budget_in_bytes, prepare
from planner.problem import Problem
from planner.progress import bar
from planner.simulate import as_choice, simulate
from planner.solvers.auto import choose, lowest_peak
from planner.units import MIB
from planner.viz import plot_frontier

__all__ = ["Frontier", "FrontierPoint", "frontier", "frontier_of"]


def _decimals(nbytes) -> int:
    """Fewest decimals (1 to 4) that keep distinct sizes distinct when printed in MiB."""
    distinct = sorted(set(nbytes))
    for decimals in range(1, 4):
        if len({f"{b / MIB:.{decimals}f}" for b in distinct}) == len(distinct):
            return decimals
    return 4


@dataclass(frozen=True)
class FrontierPoint:
    """The plan chosen for one budget, as ``simulate`` judges it.

    ``recompute_overhead`` is the recompute time as a fraction of a step without checkpointing
    (forward + backward, taken as three forwards), as in ``Plan.predicted_overhead``.
    ``plan_budget_bytes`` is the budget at which the solver chose this plan, at or below
    ``budget_bytes`` (a cheaper plan of a smaller budget is kept: the solvers are not monotone
    in the budget): ``planner.plan(model, inputs, budget_bytes=plan_budget_bytes)`` gives it.
    """

    budget_bytes: int
    peak_bytes: int
    recompute_seconds: float
    recompute_overhead: float
    recompute_flops: float
    segments: int
    solver: str
    plan_budget_bytes: int = 0


@dataclass(frozen=True)
class Frontier:
    """Points of the trade-off, by increasing budget, with the two ends for reference."""

    points: tuple[FrontierPoint, ...]
    baseline_peak_bytes: int
    lowest_peak_bytes: int

    def to_rows(self) -> list[dict]:
        """One plain dict per point (for ``pandas.DataFrame``, CSV or JSON)."""
        return [asdict(point) for point in self.points]

    def in_mib(self, nbytes: int) -> str:
        """``nbytes`` in MiB, with as many decimals as tell this frontier's points apart."""
        sizes = [self.baseline_peak_bytes, self.lowest_peak_bytes]
        sizes += [b for p in self.points for b in (p.budget_bytes, p.peak_bytes)]
        return f"{nbytes / MIB:,.{_decimals(sizes)}f}"

    def __str__(self) -> str:
        # A sweep of a solver that cannot reach the lowest peak (or of budgets given) starts
        # above it (found by a tester: the header named the lowest peak as its start).
        first = self.points[0].budget_bytes if self.points else self.lowest_peak_bytes
        start = (
            f"the lowest peak {self.in_mib(first)} MiB"
            if first == self.lowest_peak_bytes
            else f"{self.in_mib(first)} MiB (lowest peak found: "
            f"{self.in_mib(self.lowest_peak_bytes)} MiB)"
        )
        lines = [
            f"Frontier: {len(self.points)} budgets from {start} to the baseline "
            f"{self.in_mib(self.baseline_peak_bytes)} MiB",
            f"  {'budget MiB':>12} {'peak MiB':>12} {'recompute':>10} {'FLOPs':>10} "
            f"{'segments':>8}  solver",
        ]
        for p in self.points:
            lines.append(
                f"  {self.in_mib(p.budget_bytes):>12} {self.in_mib(p.peak_bytes):>12} "
                f"{p.recompute_overhead:>10.1%} {p.recompute_flops:>10.3g} {p.segments:>8}  "
                f"{p.solver}"
            )
        return "\n".join(lines)

    __repr__ = __str__

    def plot(self, ax=None, path=None):
        """Recompute overhead against peak memory, one marker per budget; see
        ``planner.viz.plot_frontier``."""
        if isinstance(ax, (str, os.PathLike)):  # Plan.draw(path) takes a path first; this not
            raise TypeError(
                f"Frontier.plot's first argument is a matplotlib Axes, not a path ({ax!r}): "
                "write the figure with plot(path=...)"
            )
        return plot_frontier(self, ax=ax, path=path)


def _check_points(points) -> None:
    """Before any capture: a count of budgets is a whole number from 1 (``2.5`` raised a
    ``TypeError`` from numpy after the capture and profile)."""
    try:
        count = operator.index(points)  # ints and numpy's
    except TypeError:
        count = 0
    if isinstance(points, bool) or count < 1:
        raise ValueError(f"points must be a whole number of budgets, at least 1, got {points!r}")


def _budgets(lowest: int, baseline: int, points: int) -> list[int]:
    """``points`` budgets evenly spaced from ``lowest`` to ``baseline``, both included."""
    if points == 1 or baseline <= lowest:
        return [baseline]
    return sorted({round(b) for b in np.linspace(lowest, baseline, points)})


def frontier_of(
    problem: Problem, *, budgets=None, points: int = 12, solver="auto", **options
) -> Frontier:
    """The frontier of a prepared ``problem``; see :func:`frontier`.

    Parameters
    ----------
    problem
        From ``planner.pipeline.prepare`` (reused across sweeps and benchmarks).
    budgets
        Budgets in bytes (whole step, as ``simulate`` counts it); default: ``points`` budgets
        evenly spaced from the lowest peak found (``solvers.auto.lowest_peak``; for a solver that
        cannot reach it, the lowest peak that solver reaches) to the baseline peak.
    points
        Number of default budgets.
    solver
        ``"auto"``, a registered name or a callable, as for ``planner.plan``.
    **options
        Passed to the solver.

    Raises
    ------
    PlanningError
        When the solver's plan does not fit one of ``budgets``.
    """
    if not isinstance(problem, Problem):
        raise TypeError(
            "frontier_of takes the Problem that planner.prepare(model, inputs) returns second, "
            f"got {type(problem).__name__}; for a model, call planner.frontier(model, inputs)"
        )
    _check_points(points)
    baseline = simulate(problem, ()).peak_bytes
    lowest = lowest_peak(problem).peak_bytes
    if budgets is None:
        # A heuristic may not reach the lowest peak (found by any strategy): start its sweep
        # where it can, at the peak of the plan it returns for the lowest peak.
        start = simulate(problem, choose(problem, lowest, solver, **options)[1]).peak_bytes
        budgets = _budgets(min(max(lowest, start), baseline), baseline, points)
    try:  # as plan() checks its budget
        budgets = sorted(budget_in_bytes(None, budget) for budget in budgets)
    except ValueError as error:
        raise ValueError(f"frontier budgets: {error}") from None
    step_seconds = problem.step_seconds
    found: list[FrontierPoint] = []
    previous = None  # (simulation, segment count, solver, budget) of the last point
    for budget in bar(budgets, total=len(budgets), desc="budgets"):
        name, segments = choose(problem, budget, solver, **options)
        result = simulate(problem, segments)
        if result.peak_bytes > budget:
            raise PlanningError(
                f"no plan fits a budget of {budget / MIB:,.1f} MiB ({budget} bytes): solver "
                f"{name} reaches {result.peak_bytes / MIB:,.1f} MiB and the lowest peak found "
                f"is {lowest / MIB:,.1f} MiB (budget_bytes={lowest}); drop the smaller budgets."
            )
        top = segments if isinstance(segments, NestedChoice) else as_choice(segments)
        chosen = (result, len(top.segments), name, budget)
        if previous is not None and previous[0].recompute_seconds < result.recompute_seconds:
            chosen = previous  # it fits this larger budget too, and costs less
        previous = chosen
        result, count, name, found_at = chosen
        found.append(
            FrontierPoint(
                budget_bytes=budget,
                peak_bytes=result.peak_bytes,
                recompute_seconds=result.recompute_seconds,
                recompute_overhead=result.recompute_seconds / step_seconds if step_seconds else 0.0,
                recompute_flops=result.recompute_flops,
                segments=count,
                solver=name,
                plan_budget_bytes=found_at,
            )
        )
    return Frontier(points=tuple(found), baseline_peak_bytes=baseline, lowest_peak_bytes=lowest)


def frontier(
    model,
    example_inputs,
    *,
    example_kwargs: dict | None = None,
    budgets=None,
    points: int = 12,
    solver="auto",
    optimizer_state_bytes: int | None = None,
    cost_model: CostModel | None = None,
    leaf_modules: tuple = (),
    dynamic_shapes: bool = False,
    loss_fn=None,
    optimizer=None,
) -> Frontier:
    """Sweep budgets for ``model``: the least recompute at each, from the lowest peak to none.

    One capture and profile (``planner.pipeline.prepare``), then one solve per budget, so a
    sweep costs little more than one ``plan``. Pick a point and call ``planner.plan(model,
    inputs, budget_bytes=point.plan_budget_bytes)``: that gives its plan (its own
    ``budget_bytes`` may give a costlier one, found by a tester: the solvers are not monotone
    in the budget, where the sweep keeps the cheaper plan of a smaller budget).

    Parameters
    ----------
    model, example_inputs, example_kwargs, optimizer_state_bytes, cost_model, leaf_modules,
    dynamic_shapes, loss_fn, optimizer
        As for ``planner.plan``.
    budgets
        Budgets in bytes; default: ``points`` budgets evenly spaced from the lowest peak found
        to the peak without checkpointing (both included).
    points
        Number of default budgets.
    solver
        ``"auto"`` (default), a registered name or a callable.

    Returns
    -------
    Frontier
        ``print`` it for a table, ``.plot()`` it, or ``.to_rows()`` for data.

    Examples
    --------
    >>> import planner
    >>> model, inputs = planner.zoo.mlp_chain(depth=6, width=16, batch=128)
    >>> f = frontier(model, inputs, points=4)
    >>> f.points[-1].recompute_seconds, f.points[-1].peak_bytes == f.baseline_peak_bytes
    (0.0, True)
    """
    _check_points(points)
    _, problem = prepare(
        model,
        example_inputs,
        example_kwargs,
        cost_model=cost_model,
        optimizer_state_bytes=optimizer_state_bytes,
        capture_options=CaptureOptions(leaf_modules, dynamic_shapes),
        loss_fn=loss_fn,
        optimizer=optimizer,
    )
    return frontier_of(problem, budgets=budgets, points=points, solver=solver)
