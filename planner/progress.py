"""Progress bars for long operations: a ``tqdm`` bar on a terminal, nothing anywhere else.

``bar`` is what the rest of the planner (budget sweeps, the CLI, benchmarks) wraps its loops in.
It shows a bar only when all of these hold, and otherwise returns the iterable untouched:

* ``tqdm`` is installed (it is optional: ``pip install tqdm``);
* standard error is a terminal (so CI logs, pipes and notebooks stay clean);
* the environment variable ``PLANNER_PROGRESS`` is not ``0`` (set it to ``1`` to force bars on,
  e.g. in a notebook, where ``tqdm.auto`` gives a widget when ``ipywidgets`` is installed).

Examples
--------
>>> from planner.progress import bar
>>> [x * 2 for x in bar(range(3), total=3, desc="doubling")]
[0, 2, 4]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["bar", "enabled"]

T = TypeVar("T")


def enabled(stream=None) -> bool:
    """Whether ``bar`` would show a bar now (``PLANNER_PROGRESS``, terminal, tqdm installed)."""
    setting = os.environ.get("PLANNER_PROGRESS", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def bar(
    iterable: Iterable[T],
    total: int | None = None,
    desc: str | None = None,
    *,
    leave: bool = False,
) -> Iterable[T] | Iterator[T]:
    """``iterable``, wrapped in a ``tqdm`` progress bar when one should be shown.

    Parameters
    ----------
    iterable
        What to iterate over; returned unchanged when no bar is shown.
    total
        Number of items, when ``len(iterable)`` is not available (generators).
    desc
        A short label shown before the bar (e.g. ``"profiling"``, ``"budgets"``).
    leave
        Keep the finished bar on screen (default: erase it, so the output stays readable).
    """
    if not enabled():
        return iterable
    import tqdm
    import tqdm.auto

    forced = os.environ.get("PLANNER_PROGRESS", "").strip().lower() in ("1", "true", "yes", "on")
    progress_bar: type[tqdm.tqdm] = tqdm.auto.tqdm if forced else tqdm.tqdm
    return progress_bar(
        iterable, total=total, desc=desc, leave=leave, file=sys.stderr, dynamic_ncols=True
    )
