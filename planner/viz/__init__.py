"""Seeing a plan: an HTML table for notebooks, a drawing of the graph, a memory timeline.

Three views of a :class:`planner.Plan`, each a plain function (``Plan._repr_html_``,
``Plan.draw`` and ``Plan.plot_memory`` delegate to them), and one of a ``Frontier``
(``Frontier.plot``):

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

from planner.viz.graph import Layout, draw, layout, module_paths
from planner.viz.html import plan_html
from planner.viz.memory import MemoryCurve, memory_timeline, plot_frontier, plot_memory

__all__ = [
    "Layout",
    "MemoryCurve",
    "draw",
    "layout",
    "memory_timeline",
    "module_paths",
    "plan_html",
    "plot_frontier",
    "plot_memory",
]
