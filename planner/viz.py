"""Seeing a plan: an HTML table for notebooks, a drawing of the graph, a memory timeline.

Three views of a :class:`planner.Plan`, each a plain function (``Plan._repr_html_``,
``Plan.draw`` and ``Plan.plot_memory`` delegate to them):

``plan_html(plan)``
    A compact HTML summary: predicted peak against budget and baseline (with bars), saved and
    recomputed activation bytes, recompute overhead, solver, and one row per checkpointed segment
    (its boundary tensors, what it drops and what recomputing it costs).
``draw(plan)``
    The captured graph, collapsed by module path (``blocks.3.attn``...) into at most
    ``max_groups`` boxes laid out in reading order, each checkpointed segment in its own colour
    and the tensors that cross into a segment (kept in memory as its checkpoint inputs) drawn as
    thick red arrows. Needs matplotlib only (no Graphviz).
``plot_memory(plan)``
    Predicted live memory over one training step, forward then backward (with recomputation),
    for the model without checkpointing and with the plan, on one axis, with the budget as a
    line; optionally a measured trace (``planner.step.peak_memory(..., record_timeline=True)``).

matplotlib is optional: ``pip install matplotlib`` (or
``pip install 'torch-activation-planner[viz]'``). Figures are closed in ``pyplot`` as soon as
they are made (nothing accumulates, nothing is shown twice): the functions return the
``matplotlib.figure.Figure``, which Jupyter displays as the cell's value, and write it to
``path`` when one is given.
"""

from __future__ import annotations

import html
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.simulate import as_choice, simulate

__all__ = ["draw", "memory_timeline", "module_paths", "plan_html", "plot_memory"]

MIB = 2**20
_COMPUTE_OPS = ("call_function", "call_method", "call_module")

# One colour per checkpointed segment (cycled), kept nodes grey; colour-blind-friendly enough.
_SEGMENT_COLOURS = (
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948",
    "#76b7b2", "#ff9da7", "#9c755f", "#e15759", "#86bcb6",
)  # fmt: skip
_KEPT_COLOUR = "#e6e6e6"
_BOUNDARY_COLOUR = "#c0392b"
_BASELINE_COLOUR = "#7f7f7f"
_PLAN_COLOUR = "#1f77b4"
_BUDGET_COLOUR = "#d62728"


def _matplotlib():
    """A function making a new figure; a clear error when matplotlib is missing."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "drawing plans needs matplotlib: pip install matplotlib "
            "(or pip install 'torch-activation-planner[viz]')"
        ) from error

    def new_figure(figsize):
        # Made by pyplot (so that Jupyter's inline backend knows how to display it), then closed
        # at once: pyplot keeps no reference and does not show it a second time at the end of
        # the cell; the returned figure is displayed once, as the cell's value.
        figure = plt.figure(figsize=figsize)
        plt.close(figure)
        return figure

    return new_figure


def _axes(ax, figsize):
    """(figure, axes, whether the figure is ours): a new figure unless ``ax`` is given."""
    if ax is not None:
        return ax.figure, ax, False
    figure = _matplotlib()(figsize)
    return figure, figure.add_subplot(), True


def _finish(figure, own_figure: bool, path):
    """Lay out a figure we made, and save it when asked."""
    if own_figure:
        figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=130, bbox_inches="tight")
    return figure


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.1f} MiB"


def _segment_of(size: int, segments) -> np.ndarray:
    segment_of = np.full(size, -1, dtype=np.int64)
    for k, (start, stop) in enumerate(segments):
        segment_of[start:stop] = k
    return segment_of


# --------------------------------------------------------------------------------------------
# HTML


@dataclass(frozen=True)
class _Row:
    segment: int
    start: int
    stop: int
    first: str
    last: str
    boundary_tensors: int
    boundary_bytes: int
    dropped_bytes: int
    recompute_share: float
    kept_nodes: int = 0  # nodes kept inside the segment (selective checkpointing)
    kept_bytes: int = 0


def _segment_rows(plan) -> list[_Row]:
    """``plan.segment_table()``, the one source of segment rows, for the HTML table."""
    step_seconds = 3 * float(plan.problem.seconds.sum()) or 1.0
    return [
        _Row(
            segment=row["segment"],
            start=row["start"],
            stop=row["stop"],
            first=row["first"],
            last=row["last"],
            boundary_tensors=row["input_tensors"],
            boundary_bytes=row["input_bytes"],
            dropped_bytes=row["dropped_bytes"],
            recompute_share=row["recompute_seconds"] / step_seconds,
            kept_nodes=len(row["kept"]),
            kept_bytes=row["kept_bytes"],
        )
        for row in plan.segment_table()
    ]


def _bar(value: float, scale: float, colour: str, label: str) -> str:
    width = 0.0 if scale <= 0 else min(100.0, 100.0 * value / scale)
    return (
        f'<div style="display:flex;align-items:center;gap:6px;margin:1px 0">'
        f'<div style="width:9em;text-align:right;color:#555">{html.escape(label)}</div>'
        f'<div style="flex:1;max-width:22em;background:#f3f3f3;height:0.9em;position:relative">'
        f'<div style="width:{width:.1f}%;background:{colour};height:100%"></div></div>'
        f'<div style="width:7em">{_mib(value)}</div></div>'
    )


def plan_html(plan, *, max_rows: int = 24) -> str:
    """A compact HTML summary of ``plan`` for notebooks (what ``Plan._repr_html_`` shows).

    Parameters
    ----------
    plan : planner.Plan
    max_rows : int
        Show at most this many segment rows (the first ones and the last few), with a note on
        how many were left out.

    Returns
    -------
    str
        A self-contained ``<div>`` (inline styles only, no scripts).
    """
    problem = plan.problem
    e = html.escape
    saved = problem.saved_bytes_per_node()
    rows = _segment_rows(plan)
    dropped = sum(r.dropped_bytes for r in rows)
    boundary = sum(r.boundary_bytes for r in rows)
    covered = sum(stop - start for start, stop in plan.segments)
    fits = plan.predicted_peak_bytes <= plan.budget_bytes
    verdict = (
        '<span style="color:#2e7d32">fits</span>'
        if fits
        else '<span style="color:#c62828">over budget</span>'
    )
    scale = max(plan.budget_bytes, plan.baseline_peak_bytes, plan.predicted_peak_bytes)
    summary = [
        ("Solver", f"{e(str(plan.solver))} &middot; solved in {plan.solve_seconds:.3f} s "
         f"(planning {plan.planning_seconds:.2f} s, captured by {e(str(plan.capture_method))})"),
        ("Graph", f"{problem.size} nodes; {len(plan.segments)} checkpointed segments "
         f"cover {covered} of them"
         + (f", keeping {len(plan.keep)} nodes inside them" if getattr(plan, "keep", ())
            else "")),
        ("Predicted peak", f"<b>{_mib(plan.predicted_peak_bytes)}</b> of a "
         f"{_mib(plan.budget_bytes)} budget: {verdict} "
         f"(baseline {_mib(plan.baseline_peak_bytes)}, "
         f"{plan.predicted_peak_bytes / plan.baseline_peak_bytes - 1:+.0%} vs baseline)"
         if plan.baseline_peak_bytes else f"<b>{_mib(plan.predicted_peak_bytes)}</b>"),
        ("Fixed memory", f"{_mib(problem.fixed_bytes)} (parameters, buffers, inputs"
         + (", optimizer state" if problem.optimizer_state_bytes else "") + f"); gradients "
         f"{_mib(problem.gradient_bytes)}"),
        ("Activations", f"{_mib(int(saved.sum()))} saved for backward without checkpointing; "
         f"the plan recomputes {_mib(dropped)} of them and keeps {_mib(boundary)} of segment "
         "inputs"),
        ("Recompute", f"<b>{plan.predicted_overhead:.1%}</b> of a step "
         f"({plan.recompute_flops:.3g} FLOPs)"),
    ]  # fmt: skip
    out = [
        '<div class="planner-plan" style="font-family:system-ui,sans-serif;font-size:13px;'
        'line-height:1.35">',
        '<div style="font-weight:600;margin-bottom:4px">Checkpointing plan</div>',
        '<table style="border-collapse:collapse;margin-bottom:6px">',
    ]
    for key, value in summary:
        out.append(
            f'<tr><td style="text-align:left;padding:1px 10px 1px 0;color:#555;'
            f'vertical-align:top;white-space:nowrap">{key}</td>'
            f'<td style="text-align:left;padding:1px 0">{value}</td></tr>'
        )
    out.append("</table>")
    out.append(_bar(plan.baseline_peak_bytes, scale, _BASELINE_COLOUR, "baseline peak"))
    out.append(_bar(plan.predicted_peak_bytes, scale, _PLAN_COLOUR, "planned peak"))
    out.append(_bar(plan.budget_bytes, scale, _BUDGET_COLOUR, "budget"))
    if rows:
        shown: list[_Row | None] = list(rows)  # None: the "..." row
        if len(rows) > max_rows:
            tail = max(3, max_rows // 5)
            shown = [*rows[: max_rows - tail], None, *rows[-tail:]]
        open_attr = " open" if len(rows) <= 12 else ""
        selective = bool(getattr(plan, "keep", ()))
        titles = [
            ("seg", "right"), ("nodes", "right"), ("from", "left"), ("to", "left"),
            ("boundary tensors", "right"), ("recomputed", "right"), ("recompute cost", "right"),
        ] + ([("kept nodes", "right")] if selective else [])  # fmt: skip
        head = "".join(
            f'<th style="text-align:{align};padding:2px 8px;border-bottom:1px solid #ccc">'
            f"{title}</th>"
            for title, align in titles
        )
        out.append(
            f'<details{open_attr} style="margin-top:6px"><summary>{len(rows)} checkpointed '
            "segments (boundary tensors are kept; the rest is recomputed in backward"
            + (", but for the kept nodes' outputs" if selective else "")
            + ")</summary>"
            f'<table style="border-collapse:collapse;font-size:12px"><tr>{head}</tr>'
        )
        for r in shown:
            if r is None:
                out.append(
                    f'<tr><td colspan="{len(titles)}" '
                    'style="text-align:center;color:#777">&hellip; '
                    f"{len(rows) - len(shown) + 1} more segments &hellip;</td></tr>"
                )
                continue
            swatch = _SEGMENT_COLOURS[r.segment % len(_SEGMENT_COLOURS)]
            cells = [
                (f'<span style="display:inline-block;width:0.8em;height:0.8em;'
                 f'background:{swatch};margin-right:4px"></span>{r.segment}', "right"),
                (str(r.stop - r.start), "right"),
                (f"<code>{e(r.first)}</code>", "left"),
                (f"<code>{e(r.last)}</code>", "left"),
                (f"{r.boundary_tensors} &middot; {_mib(r.boundary_bytes)}", "right"),
                (_mib(r.dropped_bytes), "right"),
                (f"{r.recompute_share:.1%}", "right"),
            ] + ([(f"{r.kept_nodes} &middot; {_mib(r.kept_bytes)}", "right")]
                 if selective else [])  # fmt: skip
            out.append(
                "<tr>"
                + "".join(
                    f'<td style="text-align:{align};padding:1px 8px">{cell}</td>'
                    for cell, align in cells
                )
                + "</tr>"
            )
        out.append("</table></details>")
    else:
        out.append(
            '<div style="margin-top:6px;color:#555">No segment is checkpointed: the model fits '
            "the budget as it is.</div>"
        )
    out.append("</div>")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Module paths and collapsing


def _graph_nodes(module) -> dict:
    """Original graph nodes of a planned module by name, segment bodies included."""
    found: dict = {}
    graph = getattr(module, "graph", None)
    if graph is None:
        return found
    bodies = []
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            value = operator.attrgetter(node.target)(module)
        except AttributeError:
            continue
        body = getattr(value, "body", value)
        if hasattr(body, "graph") and body is not module:
            bodies.append(body.graph)
    for g in bodies:
        for node in g.nodes:
            if node.op in _COMPUTE_OPS:
                found.setdefault(node.name, node)
    for node in graph.nodes:
        if node.op in _COMPUTE_OPS:
            found.setdefault(node.name, node)
    return found


def _normalise_path(path: str) -> str:
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"^L__self___?", "", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def _own_path(node) -> str | None:
    stack = node.meta.get("nn_module_stack") if node is not None else None
    if stack:
        entry = list(stack.values())[-1]
        path = entry[0] if isinstance(entry, tuple) else str(entry)
        return _normalise_path(str(path))
    if node is not None and node.op == "call_module":
        return str(node.target)
    return None


def _common_prefix(a: str, b: str) -> str:
    parts = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts)


def module_paths(plan) -> list[str]:
    """The module path (``"blocks.3.attn"``; ``""`` for the top level) of every graph position.

    Read from ``node.meta["nn_module_stack"]`` (``torch.export`` records it for every node,
    ``symbolic_trace`` for calls of leaf modules) or a ``call_module`` target. A function node
    without one (``symbolic_trace``) gets the common prefix of the modules called just before and
    just after it: the ``matmul`` between ``attn.qkv`` and ``attn.proj`` belongs to ``attn``.
    """
    nodes = _graph_nodes(plan.module)
    own = [_own_path(nodes.get(name)) for name in plan.problem.names]
    n = len(own)
    before: list[str | None] = [None] * n
    after: list[str | None] = [None] * n
    last = None
    for i in range(n):
        last = own[i] if own[i] is not None else last
        before[i] = last
    last = None
    for i in range(n - 1, -1, -1):
        last = own[i] if own[i] is not None else last
        after[i] = last
    paths = []
    for i, path in enumerate(own):
        if path is None:
            a, b = before[i], after[i]
            if a is not None and b is not None:
                path = _common_prefix(a, b)
            else:
                path = ""
        paths.append(path)
    return paths


@dataclass(frozen=True)
class _Group:
    key: str
    start: int
    stop: int
    segment: int  # -1: not checkpointed


def _runs(keys: Sequence[str], segment_of: np.ndarray) -> list[_Group]:
    groups = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start] or segment_of[i] != segment_of[start]:
            groups.append(_Group(keys[start], start, i, int(segment_of[start])))
            start = i
    return groups


def _collapse(paths: list[str], segment_of: np.ndarray, max_groups: int):
    """Consecutive positions with the same module prefix (and segment) as one group, at the
    deepest module depth that gives at most ``max_groups`` groups."""
    split = [p.split(".") if p else [] for p in paths]
    deepest = max((len(s) for s in split), default=0)
    best = None
    for depth in range(0, deepest + 1):
        keys = [".".join(s[:depth]) for s in split]
        groups = _runs(keys, segment_of)
        if best is None or len(groups) <= max_groups:
            best = (depth, groups)
        if len(groups) > max_groups:
            break
    return best


def _short(key: str, parts: int = 3) -> str:
    if not key:
        return "(top level)"
    pieces = key.split(".")
    return key if len(pieces) <= parts else "…" + ".".join(pieces[-parts:])


# --------------------------------------------------------------------------------------------
# Graph drawing


def draw(plan, path=None, ax=None, *, max_groups: int = 60, columns: int | None = None):
    """Draw the captured graph with checkpointed segments coloured and boundaries highlighted.

    Consecutive nodes of one module (and one segment) are collapsed into one box, at the deepest
    module depth that gives at most ``max_groups`` boxes, so graphs of hundreds or thousands of
    nodes stay readable. Boxes are laid out in reading order (rows of boxes, left to right, top
    to bottom); each shows the module path, its number of nodes and the activation bytes autograd
    saves in it, and a segment's first box also the bytes of its inputs. Checkpointed segments
    are filled with one colour each (the palette repeats after ten); boxes kept as usual are grey.
    Red arrows are tensors that cross into a checkpointed segment (its inputs, kept in memory
    until its backward); grey arrows are the other data dependencies. Arcs are drawn within a
    row; an input from an earlier row is shown as a short red stub at the box it enters.

    Parameters
    ----------
    plan : planner.Plan
    path : str or path-like, optional
        Also write the figure there (format from the suffix: ``.png``, ``.svg``, ``.pdf``).
    ax : matplotlib Axes, optional
        Draw into it instead of a new figure.
    max_groups : int
        The most boxes to draw.
    columns : int, optional
        Boxes per row (default: about ``sqrt(2 * boxes)``).

    Returns
    -------
    matplotlib.figure.Figure
    """
    import networkx as nx

    _matplotlib()  # fail early, before any work, when matplotlib is missing
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    problem = plan.problem
    segment_of = _segment_of(problem.size, plan.segments)
    depth, groups = _collapse(module_paths(plan), segment_of, max_groups)
    group_of = np.empty(problem.size, dtype=np.int64)
    for g, group in enumerate(groups):
        group_of[group.start : group.stop] = g
    saved = problem.saved_bytes_per_node()
    keep: frozenset[int] = getattr(plan, "keep", frozenset())
    kept = np.zeros(problem.size, dtype=bool)
    kept[list(keep)] = True

    graph: nx.DiGraph[int] = nx.DiGraph()
    graph.add_nodes_from(range(len(groups)))
    for g in range(len(groups) - 1):
        graph.add_edge(g, g + 1, boundary=False, nbytes=0)
    for s in problem.storages:
        for reader in s.readers:
            a, b = int(group_of[s.producer]), int(group_of[reader])
            if a == b:
                continue
            crossing = segment_of[reader] >= 0 and segment_of[reader] != segment_of[s.producer]
            data = graph.get_edge_data(a, b, {"boundary": False, "nbytes": 0})
            graph.add_edge(a, b, boundary=data["boundary"] or bool(crossing),
                           nbytes=data["nbytes"] + s.nbytes)  # fmt: skip

    count = len(groups)
    columns = columns or max(1, min(count, round(math.sqrt(1.6 * count)) + 1))
    rows = math.ceil(count / columns)
    position = {g: ((g % columns) * 1.6, -(g // columns) * 1.5) for g in range(count)}
    row_of = {g: g // columns for g in range(count)}

    figure, ax, own_figure = _axes(ax, (max(6.5, 1.55 * columns + 0.6), 1.2 * rows + 2.0))

    inputs_from_afar: dict[int, int] = {}  # group -> bytes of boundary edges not drawn
    for a, b, data in graph.edges(data=True):
        (xa, ya), (xb, yb) = position[a], position[b]
        if row_of[a] != row_of[b]:
            if data["boundary"] and b - a > 1:
                inputs_from_afar[b] = inputs_from_afar.get(b, 0) + data["nbytes"]
            if b - a == 1:  # the reading order continues on the next row
                ax.annotate("", xy=(xa + 1.15, ya), xytext=(xa + 0.85, ya),
                            arrowprops=dict(arrowstyle="-|>", color="#9a9a9a", lw=0.8,
                                            mutation_scale=9), zorder=1)  # fmt: skip
                ax.annotate("", xy=(xb - 0.85, yb), xytext=(xb - 1.15, yb),
                            arrowprops=dict(arrowstyle="-|>", color="#9a9a9a", lw=0.8,
                                            mutation_scale=9), zorder=1)  # fmt: skip
            continue
        rad = 0.0 if b - a == 1 else -min(0.5, 0.12 + 0.04 * (b - a))
        ax.annotate(
            "",
            xy=(xb, yb),
            xytext=(xa, ya),
            arrowprops=dict(
                arrowstyle="-|>",
                color=_BOUNDARY_COLOUR if data["boundary"] else "#9a9a9a",
                lw=2.0 if data["boundary"] else 0.8,
                alpha=0.95 if data["boundary"] else 0.7,
                shrinkA=16,
                shrinkB=16,
                connectionstyle=f"arc3,rad={rad}",
                mutation_scale=9,
            ),
            zorder=2 if data["boundary"] else 1,
        )
    segment_inputs = [row["input_bytes"] for row in plan.segment_table()]
    for g, group in enumerate(groups):
        colour = (
            _SEGMENT_COLOURS[group.segment % len(_SEGMENT_COLOURS)]
            if group.segment >= 0
            else _KEPT_COLOUR
        )
        nodes = group.stop - group.start
        label = (
            f"{_short(group.key)}\n{nodes} node{'s' if nodes != 1 else ''}"
            f" · {saved[group.start : group.stop].sum() / MIB:.2f} MiB"
        )
        starts_segment = group.segment >= 0 and plan.segments[group.segment][0] == group.start
        if group.segment >= 0:
            label += f"\nsegment {group.segment}"
            if kept[group.start : group.stop].any():
                label += f" · {int(kept[group.start : group.stop].sum())} kept"
        if starts_segment:
            label += f" · in {segment_inputs[group.segment] / MIB:.2f} MiB"
        ax.text(
            *position[g],
            label,
            ha="center",
            va="center",
            fontsize=7,
            zorder=3,
            bbox=dict(
                boxstyle="round,pad=0.35",
                facecolor=colour,
                edgecolor=_BOUNDARY_COLOUR if starts_segment else "#555555",
                linewidth=2.0 if starts_segment else 0.6,
            ),
        )
        if g in inputs_from_afar:
            x, y = position[g]
            ax.annotate("", xy=(x - 0.3, y + 0.3), xytext=(x - 0.6, y + 0.62),
                        arrowprops=dict(arrowstyle="-|>", color=_BOUNDARY_COLOUR, lw=2.0,
                                        mutation_scale=9), zorder=2)  # fmt: skip
    xs = [p[0] for p in position.values()] or [0.0]
    ys = [p[1] for p in position.values()] or [0.0]
    ax.set_xlim(min(xs) - 1.2, max(xs) + 1.2)
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.95)
    ax.set_axis_off()

    handles: list[Artist] = [
        Patch(facecolor=_KEPT_COLOUR, edgecolor="#555555", label="kept (not checkpointed)")
    ]
    shown = min(len(plan.segments), 6)
    for k in range(shown):
        handles.append(
            Patch(
                facecolor=_SEGMENT_COLOURS[k % len(_SEGMENT_COLOURS)],
                edgecolor="#555555",
                label=f"checkpointed segment {k}",
            )
        )
    if len(plan.segments) > shown:
        handles.append(Patch(facecolor="white", edgecolor="white",
                             label=f"… {len(plan.segments) - shown} more segments"))  # fmt: skip
    handles += [
        Patch(facecolor="white", edgecolor=_BOUNDARY_COLOUR, linewidth=2,
              label="first box of a segment"),
        Line2D([], [], color=_BOUNDARY_COLOUR, lw=2,
               label="segment input (kept for backward); a stub: from an earlier row"),
        Line2D([], [], color="#9a9a9a", lw=1, label="other data flow (within a row)"),
    ]  # fmt: skip
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.01),
        ncol=min(4, len(handles)),
        fontsize=7,
        frameon=False,
    )
    ax.set_title(
        f"{_model_name(plan)}: {problem.size} nodes in {count} boxes "
        f"(modules collapsed to depth {depth}); {len(plan.segments)} checkpointed segments"
        + (f", {len(keep)} nodes kept inside them" if keep else "")
        + "\n"
        f"predicted peak {_mib(plan.predicted_peak_bytes)} of a {_mib(plan.budget_bytes)} "
        f"budget (baseline {_mib(plan.baseline_peak_bytes)}); recompute "
        f"{plan.predicted_overhead:.1%} of a step; solver {plan.solver}",
        fontsize=9,
    )
    return _finish(figure, own_figure, path)


def _model_name(plan) -> str:
    name = type(plan.module).__name__
    return name[len("Planned") :] if name.startswith("Planned") and len(name) > 7 else name


# --------------------------------------------------------------------------------------------
# Memory over the step


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
    choice = as_choice(choice)
    result = simulate(problem, choice, record=True)
    assert result.timeline is not None  # record=True keeps it
    seconds = problem.seconds if step_seconds > 0 else np.ones(problem.size)
    kept = np.zeros(problem.size, dtype=bool)
    kept[list(choice.keep)] = True
    scale = step_seconds if step_seconds > 0 else 3.0 * problem.size
    xs, ys, phases = [0.0], [problem.fixed_bytes], ["start"]
    t = 0.0
    forward_end = 0.0
    for phase, position, live in result.timeline:
        if not (phase == "recompute" and kept[position]):  # a kept node's recompute is free
            t += float(seconds[position]) * (2.0 if phase == "backward" else 1.0)
        xs.append(t / scale)
        ys.append(problem.fixed_bytes + live)
        phases.append(phase)
        if phase == "forward":
            forward_end = t / scale
    return MemoryCurve(
        np.asarray(xs), np.asarray(ys, dtype=np.float64), tuple(phases), result.peak_bytes,
        forward_end,
    )  # fmt: skip


def memory_timeline(plan) -> dict[str, MemoryCurve]:
    """The simulated memory curves ``{"baseline": ..., "plan": ...}`` that ``plot_memory`` draws."""
    problem = plan.problem
    step_seconds = 3.0 * float(problem.seconds.sum())
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


def plot_memory(plan, measured=None, ax=None, *, measured_baseline=None, path=None):
    """Plot predicted memory over one training step: baseline and plan on one axis.

    The x axis is time through the step under the cost model, as a fraction of a step without
    checkpointing: forward, then backward, where the plan's recomputation makes its backward
    longer by the recompute overhead. The y axis is live memory in MiB, fixed memory (parameters,
    buffers, inputs) included, so the budget is directly comparable. Without checkpointing
    memory rises through the forward and falls through the backward; with the plan it rises less
    and, in backward, rises and falls again as each segment is recomputed (a saw-tooth).

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
    _matplotlib()  # fail early, before any work, when matplotlib is missing
    curves = memory_timeline(plan)
    base, planned = curves["baseline"], curves["plan"]
    peak = max(plan.budget_bytes, base.peak_bytes, planned.peak_bytes)
    unit, unit_name = (2**30, "GiB") if peak >= 10 * 2**30 else (MIB, "MiB")

    figure, ax, own_figure = _axes(ax, (9.0, 4.8))

    end = max(base.x[-1], planned.x[-1])
    fixed = plan.problem.fixed_bytes / unit
    ax.axhspan(0, fixed, color="#f0f0f0", zorder=0)
    ax.text(end * 0.995, fixed * 0.5, "parameters, buffers, inputs", ha="right", va="center",
            fontsize=7, color="#777777")  # fmt: skip
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
            ax.axvspan(planned.x[i - 1], planned.x[j], color=_PLAN_COLOUR, alpha=0.09, lw=0,
                       label=None if shaded else "recompute (plan)")  # fmt: skip
            shaded = True
            i = j + 1
        else:
            i += 1

    ax.plot(base.x, base.y / unit, drawstyle="steps-pre", color=_BASELINE_COLOUR, lw=1.6,
            label=f"no checkpointing (peak {_mib(base.peak_bytes)})")  # fmt: skip
    ax.plot(
        planned.x,
        planned.y / unit,
        drawstyle="steps-pre",
        color=_PLAN_COLOUR,
        lw=1.6,
        label=f"plan: {len(plan.segments)} segments"
        + (f", {len(plan.keep)} kept nodes" if getattr(plan, "keep", ()) else "")
        + f" (peak {_mib(planned.peak_bytes)})",
    )
    ax.axhline(plan.budget_bytes / unit, color=_BUDGET_COLOUR, ls="--", lw=1.4,
               label=f"budget ({_mib(plan.budget_bytes)})")  # fmt: skip
    for curve, colour in ((base, _BASELINE_COLOUR), (planned, _PLAN_COLOUR)):
        ax.plot([curve.x[0], curve.x[-1]], [curve.peak_bytes / unit] * 2, color=colour, ls=":",
                lw=0.9)  # fmt: skip

    for trace, x_end, colour, label in (
        (_trace(measured_baseline), base.x[-1], "#2ca02c", "measured, no checkpointing"),
        (_trace(measured), planned.x[-1], "#ff7f0e", "measured, plan"),
    ):
        if trace is not None and len(trace):
            x = np.linspace(0.0, x_end, len(trace))
            ax.plot(x, trace / unit, color=colour, lw=0.9, alpha=0.85,
                    label=f"{label} (peak {_mib(trace.max())})")  # fmt: skip

    ax.set_xlim(0, end * 1.005)
    ax.set_ylim(0, peak / unit * 1.12)
    ax.set_xlabel("progress through one training step (cost-model time; 1.0 = a step without "
                  "checkpointing)")  # fmt: skip
    ax.set_ylabel(f"live memory ({unit_name})")
    ax.set_title(
        f"{_model_name(plan)}: predicted memory over one training step "
        f"(recompute +{plan.predicted_overhead:.1%})",
        fontsize=10,
        pad=16,
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    return _finish(figure, own_figure, path)
