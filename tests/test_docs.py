"""The documentation stays true to the code."""

import importlib.util
from pathlib import Path

import planner

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_is_generated_from_the_current_docstrings():
    spec = importlib.util.spec_from_file_location("make_api_docs", ROOT / "tools/make_api_docs.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert (ROOT / "docs/api.md").read_text() == tool.render(), (
        "docs/api.md is stale: run python tools/make_api_docs.py"
    )


def test_every_public_name_has_a_docstring():
    for name in planner.__all__:
        obj = getattr(planner, name)
        if callable(obj) and not isinstance(obj, dict):
            assert obj.__doc__, f"planner.{name} has no docstring"


def test_the_readme_names_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci/run").read_text()
