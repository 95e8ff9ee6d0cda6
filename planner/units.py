"""Byte units and the one way the planner writes a byte count for people."""

from __future__ import annotations

MIB = 2**20
GIB = 2**30


def mib(nbytes: float) -> str:
    """``nbytes`` in MiB with one decimal, as every report, table and error message shows it."""
    return f"{nbytes / MIB:,.1f} MiB"
