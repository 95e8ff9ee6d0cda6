"""Planning without pauses for Python's cyclic garbage collector.

Capture, profile and the solvers create hundreds of thousands of short-lived objects (graph
nodes, fake tensors, fronts), and every so many allocations the collector walks all tracked
objects, the growing graph included: on a 10,000-node model that was about a fifth of the
time of capture and profile (measured with ``gc.callbacks``; ``benchmarks/planning_time.py``).
Reference counting still frees everything that is not in a cycle as soon as it dies; cycles
wait until the stage ends, when the collector runs again. The stages are decorated with
``paused_collection``; nesting is fine, and a collector the caller switched off stays off.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_collection() -> Iterator[None]:
    """Switch the cyclic garbage collector off inside the block (or decorated function)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
