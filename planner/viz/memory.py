"""Memory over a training step (predicted, and measured when given), and the frontier of
memory against recompute."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from planner.nested import NestedChoice
from planner.serialize import model_name
from planner.simulate import as_choice, recomputed_nodes, simulate
from planner.units import MIB, mib
from planner.viz.style import (
    BASELINE_COLOUR,
    BUDGET_COLOUR,
    PLAN_COLOUR,
    axes,
    figure_maker,
    finish,
)

__all__ = ["MemoryCurve", "memory_timeline", "plot_frontier", "plot_memory"]


@dataclass(frozen=True)
class MemoryCurve:
    """Live bytes over one simulated step.

    ``x`` is time under the cost model, as a fraction of a step without checkpointing (forward
    plus backward); ``y`` the live bytes (fixed memory included) after each event, held since the
    previous x (step plot); ``phases`` the phase of each event; ``peak_bytes`` the simulated peak
    (which also counts each operation's transient workspace, not visible in ``y``).
    """

    x: np.ndarray
    y: np.ndarray
    phases: tuple[str, ...]
    peak_bytes: int
    forward_end: float


def _curve(problem, choice, step_seconds: float) -> MemoryCurve:
    nested = isinstance(choice, NestedChoice)  # its recompute steps all count as run
    choice = choice if nested else as_choice(choice)
    result = simulate(problem, choice, record=True)
    assert result.timeline is not None  # record=True keeps it
    seconds = problem.seconds if step_seconds > 0 else np.ones(problem.size)
    runs = np.ones(problem.size, bool) if nested else recomputed_nodes(problem, choice)
    scale = step_seconds if step_seconds > 0 else 3.0 * problem.size
    xs, ys, phases = [0.0], [problem.fixed_bytes], ["start"]
    t = 0.0
    forward_end = 0.0
    for phase, position, live in result.timeline:
        if phase != "recompute" or runs[position]:  # kept nodes and the early stop cost nothing
            t += float(seconds[position]) * (2.0 if phase == "backward" else 1.0)
        xs.append(t / scale)
        ys.append(problem.fixed_bytes + live)
        phases.append(phase)
        if phase == "forward":
            forward_end = t / scale
    if problem.optimizer_step_bytes:  # optimizer.step(), on what backward leaves
        xs.append(xs[-1] * 1.02)
        ys.append(result.optimizer_step_bytes)
        phases.append("optimizer")
    return MemoryCurve(
        np.asarray(xs), np.asarray(ys, dtype=np.float64), tuple(phases), result.peak_bytes,
        forward_end,
    )  # fmt: skip


def memory_timeline(plan) -> dict[str, MemoryCurve]:
    """The simulated memory curves ``{"baseline": ..., "plan": ...}`` that ``plot_memory`` draws."""
    problem = plan.problem
    step_seconds = problem.step_seconds
    return {
        "baseline": _curve(problem, (), step_seconds),
        "plan": _curve(problem, getattr(plan, "choice", plan.segments), step_seconds),
    }


def _trace(measured) -> np.ndarray | None:
    if measured is None:
        return None
    values = getattr(measured, "timeline", measured)
    if values is None:
        raise ValueError(
            "the measurement has no timeline: measure it with "
            "planner.step.peak_memory(module, args, record_timeline=True) (CPU only)"
        )
    return np.asarray(values, dtype=np.float64)


def _fixed_bands(ax, problem, unit: float, end: float) -> None:
    """Fixed memory as stacked bands: parameters, buffers and inputs; optimizer state; the
    low-precision weight copies that autocast caches all step."""
    parts = [
        ("optimizer state", problem.optimizer_state_bytes, "#e4e4f4"),
        ("autocast cache", problem.autocast_cache_bytes, "#f4ece0"),
    ]
    base = problem.fixed_bytes - sum(nbytes for _, nbytes, _ in parts)
    bottom = 0.0
    for label, nbytes, colour in [("parameters, buffers, inputs", base, "#f0f0f0"), *parts]:
        if nbytes <= 0:
            continue
        top = bottom + nbytes / unit
        ax.axhspan(bottom, top, color=colour, zorder=0)
        ax.text(end * 0.995, (bottom + top) / 2, label, ha="right", va="center", fontsize=7,
                color="#777777")  # fmt: skip
        bottom = top


def plot_memory(plan, measured=None, ax=None, *, measured_baseline=None, path=None):
    """Plot predicted memory over one training step: baseline and plan on one axis.

    The x axis is time through the step under the cost model, as a fraction of a step without
    checkpointing: forward, then backward, where the plan's recomputation makes its backward
    longer by the recompute overhead, then ``optimizer.step()`` when the plan counts one. The y
    axis is live memory in MiB, fixed memory included (bands: parameters, buffers and inputs;
    optimizer state; autocast's cached weight copies), so the budget is directly comparable.
    Without checkpointing memory rises through the forward and falls through the backward; with
    the plan it rises less and, in backward, rises and falls again as each segment is recomputed
    (a saw-tooth).

    Parameters
    ----------
    plan : planner.Plan
    measured : MemoryReport or sequence of int, optional
        A measured trace of the planned module
        (``planner.step.peak_memory(plan.module, inputs, record_timeline=True)``), drawn over
        the plan's curve, rescaled to its x range (events are not timed, only ordered).
    ax : matplotlib Axes, optional
        Draw into it instead of a new figure.
    measured_baseline : MemoryReport or sequence of int, optional
        A measured trace of the original model, rescaled to the baseline's x range.
    path : str or path-like, optional
        Also write the figure there.

    Returns
    -------
    matplotlib.figure.Figure
    """
    if isinstance(measured, (str, os.PathLike)):  # draw(path) takes a path first; this does not
        raise TypeError(
            f"plot_memory's first argument is a measured trace, not a path ({measured!r}): "
            "write the figure with plot_memory(path=...)"
        )
    figure_maker()  # fail early, before any work, when matplotlib is missing
    curves = memory_timeline(plan)
    base, planned = curves["baseline"], curves["plan"]
    peak = max(plan.budget_bytes, base.peak_bytes, planned.peak_bytes)
    unit, unit_name = (2**30, "GiB") if peak >= 10 * 2**30 else (MIB, "MiB")

    figure, ax, own_figure = axes(ax, (9.0, 4.8))

    end = max(base.x[-1], planned.x[-1])
    _fixed_bands(ax, plan.problem, unit, end)
    if plan.problem.has_loss:  # the loss is the forward's last node, the backward's first
        ax.text(base.forward_end, 0.0, "loss", transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=7, color="#555555")  # fmt: skip
    if plan.problem.optimizer_step_bytes:
        ax.text(end, 0.0, "step()", transform=ax.get_xaxis_transform(), ha="right",
                va="bottom", fontsize=7, color="#555555")  # fmt: skip
    ax.axvline(base.forward_end, color="#999999", lw=0.8, ls=":")
    ax.text(base.forward_end / 2, 1.0, "forward", transform=ax.get_xaxis_transform(),
            ha="center", va="bottom", fontsize=8, color="#555555")  # fmt: skip
    ax.text((base.forward_end + end) / 2, 1.0, "backward (with recompute for the plan)",
            transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8,
            color="#555555")  # fmt: skip

    # Shade the plan's recompute phases.
    recompute = np.array([p == "recompute" for p in planned.phases])
    shaded = False
    i = 1
    while i < len(recompute):
        if recompute[i]:
            j = i
            while j + 1 < len(recompute) and recompute[j + 1]:
                j += 1
            ax.axvspan(planned.x[i - 1], planned.x[j], color=PLAN_COLOUR, alpha=0.09, lw=0,
                       label=None if shaded else "recompute (plan)")  # fmt: skip
            shaded = True
            i = j + 1
        else:
            i += 1

    ax.plot(base.x, base.y / unit, drawstyle="steps-pre", color=BASELINE_COLOUR, lw=1.6,
            label=f"no checkpointing (peak {mib(base.peak_bytes)})")  # fmt: skip
    ax.plot(
        planned.x,
        planned.y / unit,
        drawstyle="steps-pre",
        color=PLAN_COLOUR,
        lw=1.6,
        label=f"plan: {len(plan.segments)} segments"
        + (f", {len(plan.keep)} kept nodes" if getattr(plan, "keep", ()) else "")
        + (f", {len(plan.replayed)} replayed" if getattr(plan, "replayed", ()) else "")
        + f" (peak {mib(planned.peak_bytes)})",
    )
    ax.axhline(plan.budget_bytes / unit, color=BUDGET_COLOUR, ls="--", lw=1.4,
               label=f"budget ({mib(plan.budget_bytes)})")  # fmt: skip
    for curve, colour in ((base, BASELINE_COLOUR), (planned, PLAN_COLOUR)):
        ax.plot([curve.x[0], curve.x[-1]], [curve.peak_bytes / unit] * 2, color=colour, ls=":",
                lw=0.9)  # fmt: skip

    for trace, x_end, colour, label in (
        (_trace(measured_baseline), base.x[-1], "#2ca02c", "measured, no checkpointing"),
        (_trace(measured), planned.x[-1], "#ff7f0e", "measured, plan"),
    ):
        if trace is not None and len(trace):
            x = np.linspace(0.0, x_end, len(trace))
            ax.plot(x, trace / unit, color=colour, lw=0.9, alpha=0.85,
                    label=f"{label} (peak {mib(trace.max())})")  # fmt: skip

    ax.set_xlim(0, end * 1.005)
    ax.set_ylim(0, peak / unit * 1.12)
    ax.set_xlabel("progress through one training step (cost-model time; 1.0 = a step without "
                  "checkpointing)")  # fmt: skip
    ax.set_ylabel(f"live memory ({unit_name})")
    ax.set_title(
        f"{model_name(plan)}: predicted memory over one training step "
        f"(recompute +{plan.predicted_overhead:.1%})",
        fontsize=10,
        pad=16,
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    return finish(figure, own_figure, path)


def plot_frontier(frontier, ax=None, path=None):
    """Recompute overhead against peak memory, one marker per budget (``Frontier.plot``).

    Each plan is drawn at its simulated peak, joined to the budget it was asked for (a hollow
    tick) by a thin line: the gap is memory the budget allowed and the plan left unused. The
    baseline (no checkpointing) and the lowest reachable peak are marked.

    Parameters
    ----------
    frontier : planner.Frontier
    ax : matplotlib Axes, optional
        Draw into it instead of a new figure.
    path : str or path-like, optional
        Also write the figure there (PNG, SVG, PDF: by the extension).

    Returns
    -------
    matplotlib.figure.Figure
    """
    figure, ax, own_figure = axes(ax, (8.0, 4.6))
    peaks = np.array([p.peak_bytes for p in frontier.points]) / MIB
    asked = np.array([p.budget_bytes for p in frontier.points]) / MIB
    overhead = np.array([p.recompute_overhead for p in frontier.points]) * 100
    for x0, x1, y in zip(peaks, asked, overhead):
        ax.plot([x0, x1], [y, y], color=BUDGET_COLOUR, lw=0.8, alpha=0.5)
    ax.plot(
        asked,
        overhead,
        ls="none",
        marker="|",
        ms=12,
        mew=1.5,
        color=BUDGET_COLOUR,
        label="budget asked",
    )
    ax.plot(
        peaks,
        overhead,
        marker="o",
        ms=6,
        lw=1.8,
        color=PLAN_COLOUR,
        label="plan (simulated peak)",
    )
    ax.axvline(frontier.lowest_peak_bytes / MIB, color=BASELINE_COLOUR, ls=":", lw=1.0)
    ax.annotate(
        f"lowest peak\n{frontier.in_mib(frontier.lowest_peak_bytes)} MiB",
        (frontier.lowest_peak_bytes / MIB, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(4, -4),
        textcoords="offset points",
        ha="left",
        va="top",
        fontsize=8,
        color="#555555",
    )
    ax.plot(
        [frontier.baseline_peak_bytes / MIB],
        [0.0],
        marker="*",
        ms=15,
        ls="none",
        color=BASELINE_COLOUR,
        zorder=5,
        label=f"no checkpointing ({frontier.in_mib(frontier.baseline_peak_bytes)} MiB)",
    )
    span = frontier.baseline_peak_bytes - frontier.lowest_peak_bytes
    margin = max(span * 0.06, frontier.baseline_peak_bytes * 0.005) / MIB
    ax.set_xlim(
        frontier.lowest_peak_bytes / MIB - margin, frontier.baseline_peak_bytes / MIB + margin
    )
    ax.set_ylim(
        -max(overhead.max(initial=0.0), 1.0) * 0.06, max(overhead.max(initial=0.0), 1.0) * 1.15
    )
    ax.set_xlabel("peak memory of a training step (MiB, parameters and gradients included)")
    ax.set_ylabel("recompute overhead (% of a step)")
    ax.set_title("Memory against recompute: the best plan at each budget", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    return finish(figure, own_figure, path)
