"""What every view of a plan shares: colours, making and finishing a matplotlib figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# One colour per checkpointed segment (cycled), kept nodes grey; colour-blind-friendly enough.
SEGMENT_COLOURS = (
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948",
    "#76b7b2", "#ff9da7", "#9c755f", "#e15759", "#86bcb6",
)  # fmt: skip
KEPT_COLOUR = "#e6e6e6"
BOUNDARY_COLOUR = "#c0392b"
BASELINE_COLOUR = "#7f7f7f"
PLAN_COLOUR = "#1f77b4"
BUDGET_COLOUR = "#d62728"


def figure_maker():
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


def axes(ax, figsize):
    """(figure, axes, whether the figure is ours): a new figure unless ``ax`` is given."""
    if ax is not None:
        return ax.figure, ax, False
    figure = figure_maker()(figsize)
    return figure, figure.add_subplot(), True


def finish(figure, own_figure: bool, path):
    """Lay out a figure we made, and save it when asked."""
    if own_figure:
        figure.tight_layout()
    if path is not None:
        if Path(path).is_dir():  # matplotlib would write <folder>.png beside it (a tester's)
            example = Path(path) / "plan.png"
            raise ValueError(f"{path} is a directory; give a file path, e.g. {example}")
        figure.savefig(path, dpi=130, bbox_inches="tight")
    return figure


def segment_of_positions(size: int, segments) -> np.ndarray:
    segment_of = np.full(size, -1, dtype=np.int64)
    for k, (start, stop) in enumerate(segments):
        segment_of[start:stop] = k
    return segment_of
