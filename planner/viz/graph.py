"""The drawing of a plan's graph: boxes of modules, segments coloured, their inputs in red.

``layout`` collapses the graph into boxes and places them; ``draw`` paints a layout with
matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.serialize import model_name
from planner.units import MIB, mib
from planner.viz.style import (
    BOUNDARY_COLOUR,
    KEPT_COLOUR,
    SEGMENT_COLOURS,
    axes,
    figure_maker,
    finish,
    segment_of_positions,
)

__all__ = ["Layout", "draw", "layout", "module_paths"]


def module_paths(plan) -> list[str]:
    """The module path (``"blocks.3.attn"``; ``""`` for the top level) of every graph position,
    as ``build_problem`` recorded it (``Problem.module_paths``; all top level when not recorded)."""
    return list(plan.problem.module_paths) or [""] * plan.problem.size


@dataclass(frozen=True)
class Box:
    """Consecutive positions of one module (at the layout's depth) and one segment."""

    key: str
    start: int
    stop: int
    segment: int  # -1: not checkpointed
    level: int = 0  # checkpoints around it: 1 in a top-level segment, 2 in one nested in it...


def _nesting(plan) -> tuple[np.ndarray, np.ndarray]:
    """Per position: the innermost nested segment holding it (-1: none) and how many hold it."""
    n = plan.problem.size
    innermost, level = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
    nesting = getattr(plan, "nesting", None)
    pending = [(nest, 1) for nest in (nesting.segments if nesting is not None else ())]
    index = 0
    while pending:  # parents before children: the innermost is written last
        nest, depth = pending.pop()
        innermost[nest.start : nest.stop], level[nest.start : nest.stop] = index, depth
        pending.extend((child, depth + 1) for child in nest.inner)
        index += 1
    return innermost, level


def _runs(keys: Sequence[str], segment_of: np.ndarray, nesting) -> list[Box]:
    innermost, level = nesting
    groups = []
    start = 0
    for i in range(1, len(keys) + 1):
        if (
            i == len(keys)
            or keys[i] != keys[start]
            or segment_of[i] != segment_of[start]
            or innermost[i] != innermost[start]
        ):
            groups.append(Box(keys[start], start, i, int(segment_of[start]), int(level[start])))
            start = i
    return groups


def _collapse(paths: list[str], segment_of: np.ndarray, max_groups: int, nesting):
    """Consecutive positions with the same module prefix (and segment, and nested segment) as
    one group, at the deepest module depth that gives at most ``max_groups`` groups."""
    split = [p.split(".") if p else [] for p in paths]
    deepest = max((len(s) for s in split), default=0)
    best = None
    for depth in range(0, deepest + 1):
        keys = [".".join(s[:depth]) for s in split]
        groups = _runs(keys, segment_of, nesting)
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


@dataclass(frozen=True)
class Layout:
    """Where ``draw`` puts things: the boxes in reading order, their centres, and the data flow
    between them (``edges``: (from box, to box, {"boundary": enters a segment, "nbytes"})).
    ``saved``, ``kept`` and ``replayed`` are per position: bytes autograd saves, whether the
    node is kept inside its segment, and whether its recompute replays it."""

    boxes: list[Box]
    depth: int  # module depth the paths were collapsed to
    columns: int
    rows: int
    position: dict[int, tuple[float, float]]
    edges: list[tuple[int, int, dict]]
    saved: np.ndarray
    kept: np.ndarray
    keep: frozenset[int]
    replayed: np.ndarray


def layout(plan, *, max_groups: int = 60, columns: int | None = None) -> Layout:
    """Collapse ``plan``'s graph into at most ``max_groups`` boxes and place them in rows
    (``columns`` boxes each, by default about ``sqrt(1.6 * boxes)``); no drawing."""
    import networkx as nx

    problem = plan.problem
    segment_of = segment_of_positions(problem.size, plan.segments)
    depth, groups = _collapse(module_paths(plan), segment_of, max_groups, _nesting(plan))
    group_of = np.empty(problem.size, dtype=np.int64)
    for g, group in enumerate(groups):
        group_of[group.start : group.stop] = g
    keep: frozenset[int] = getattr(plan, "keep", frozenset())
    kept = np.zeros(problem.size, dtype=bool)
    kept[list(keep)] = True
    replayed = np.zeros(problem.size, dtype=bool)
    replayed[list(getattr(plan, "replayed", ()))] = True

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
    return Layout(
        boxes=groups,
        depth=depth,
        columns=columns,
        rows=math.ceil(count / columns),
        position={g: ((g % columns) * 1.6, -(g // columns) * 1.5) for g in range(count)},
        edges=list(graph.edges(data=True)),
        saved=problem.saved_bytes_per_node(),
        kept=kept,
        keep=keep,
        replayed=replayed,
    )


def draw(plan, path=None, ax=None, *, max_groups: int = 60, columns: int | None = None):
    """Draw the captured graph with checkpointed segments coloured and boundaries highlighted.

    Consecutive nodes of one module (and one segment) are collapsed into one box, at the deepest
    module depth that gives at most ``max_groups`` boxes, so graphs of hundreds or thousands of
    nodes stay readable. Boxes are laid out in reading order (rows of boxes, left to right, top
    to bottom); each shows the module path, its number of nodes and the activation bytes autograd
    saves in it, and a segment's first box also the bytes of its inputs. Checkpointed segments
    are filled with one colour each (the palette repeats after ten); boxes kept as usual are grey.
    Segments nested in a segment (``Plan.nesting``) start boxes of their own, labelled with
    their depth (2: inside one other segment).
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
    figure_maker()  # fail early, before any work, when matplotlib is missing
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    problem = plan.problem
    placed = layout(plan, max_groups=max_groups, columns=columns)
    groups, depth, columns, position = placed.boxes, placed.depth, placed.columns, placed.position
    saved, kept, keep = placed.saved, placed.kept, placed.keep
    count, rows = len(groups), placed.rows
    row_of = {g: g // columns for g in range(count)}

    figure, ax, own_figure = axes(ax, (max(6.5, 1.55 * columns + 0.6), 1.2 * rows + 2.0))

    inputs_from_afar: dict[int, int] = {}  # group -> bytes of boundary edges not drawn
    for a, b, data in placed.edges:
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
                color=BOUNDARY_COLOUR if data["boundary"] else "#9a9a9a",
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
            SEGMENT_COLOURS[group.segment % len(SEGMENT_COLOURS)]
            if group.segment >= 0
            else KEPT_COLOUR
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
            if placed.replayed[group.start : group.stop].any():
                label += f" · {int(placed.replayed[group.start : group.stop].sum())} replayed"
        if starts_segment:
            label += f" · in {segment_inputs[group.segment] / MIB:.2f} MiB"
        if group.level > 1:  # inside a segment nested in another: recomputed once per level
            label += f"\nnested, depth {group.level}"
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
                edgecolor=BOUNDARY_COLOUR if starts_segment else "#555555",
                linewidth=2.0 if starts_segment else 0.6,
            ),
        )
        if g in inputs_from_afar:
            x, y = position[g]
            ax.annotate("", xy=(x - 0.3, y + 0.3), xytext=(x - 0.6, y + 0.62),
                        arrowprops=dict(arrowstyle="-|>", color=BOUNDARY_COLOUR, lw=2.0,
                                        mutation_scale=9), zorder=2)  # fmt: skip
    xs = [p[0] for p in position.values()] or [0.0]
    ys = [p[1] for p in position.values()] or [0.0]
    ax.set_xlim(min(xs) - 1.2, max(xs) + 1.2)
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.95)
    ax.set_axis_off()

    handles: list[Artist] = [
        Patch(facecolor=KEPT_COLOUR, edgecolor="#555555", label="kept (not checkpointed)")
    ]
    shown = min(len(plan.segments), 6)
    for k in range(shown):
        handles.append(
            Patch(
                facecolor=SEGMENT_COLOURS[k % len(SEGMENT_COLOURS)],
                edgecolor="#555555",
                label=f"checkpointed segment {k}",
            )
        )
    if len(plan.segments) > shown:
        handles.append(Patch(facecolor="white", edgecolor="white",
                             label=f"… {len(plan.segments) - shown} more segments"))  # fmt: skip
    handles += [
        Patch(facecolor="white", edgecolor=BOUNDARY_COLOUR, linewidth=2,
              label="first box of a segment"),
        Line2D([], [], color=BOUNDARY_COLOUR, lw=2,
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
        f"{model_name(plan)}: {problem.size} nodes in {count} boxes "
        f"(modules collapsed to depth {depth}); {len(plan.segments)} checkpointed segments"
        + (f", {len(keep)} nodes kept inside them" if keep else "")
        + (f", {int(placed.replayed.sum())} replayed" if placed.replayed.any() else "")
        + "\n"
        f"predicted peak {mib(plan.predicted_peak_bytes)} of a {mib(plan.budget_bytes)} "
        f"budget (baseline {mib(plan.baseline_peak_bytes)}); recompute "
        f"{plan.predicted_overhead:.1%} of a step; solver {plan.solver}",
        fontsize=9,
    )
    return finish(figure, own_figure, path)
