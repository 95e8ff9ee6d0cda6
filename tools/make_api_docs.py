"""Write docs/api.md from the docstrings of planner's public API (``python tools/make_api_docs.py``).

tests/test_docs.py checks that the committed page is up to date.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import planner

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
EXTRA = {
    "planner.measure": ["training_loss", "training_step", "peak_memory", "MemoryReport",
                        "step_time", "step_flops", "node_seconds"],
    "planner.simulate": ["simulate", "Simulation"],
    "planner.rewrite": ["rewrite", "Segment"],
    "planner.pipeline": ["prepare", "choose", "lowest_peak"],
    "planner.graph": ["build_problem", "articulation_nodes"],
    "planner.profile": ["profile"],
    "planner.optimizer": ["optimizer_memory", "OptimizerMemory"],
    "planner.capture": ["capture"],
}


def _entry(qualified: str, obj) -> str:
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        signature = ""
    doc = inspect.getdoc(obj) or "(no docstring)"
    return f"### `{qualified}{signature}`\n\n```text\n{doc}\n```\n"


def render() -> str:
    parts = [
        "# API reference\n",
        "Generated from the docstrings by `python tools/make_api_docs.py`; do not edit.\n",
        "## `planner`\n",
    ]
    for name in sorted(planner.__all__):
        obj = getattr(planner, name)
        if inspect.ismodule(obj) or isinstance(obj, dict):
            continue
        parts.append(_entry(f"planner.{name}", obj))
    for module_name, names in EXTRA.items():
        module = sys.modules.get(module_name) or __import__(module_name, fromlist=["_"])
        parts.append(f"## `{module_name}`\n")
        parts.extend(_entry(f"{module_name}.{n}", getattr(module, n)) for n in names)
    return "\n".join(parts)


if __name__ == "__main__":
    PAGE.write_text(render())
