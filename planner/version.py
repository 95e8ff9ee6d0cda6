"""The planner's version: the one source (pyproject.toml reads it; saved plans record it)."""

__version__ = "0.1.0"
