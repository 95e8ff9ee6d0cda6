"""The documentation stays true to the code."""

from pathlib import Path

import planner

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_names_every_public_name():
    # mkdocstrings renders docs/api.md from the docstrings when the site is built (make docs);
    # the page itself only says which objects to render.
    page = (ROOT / "docs/api.md").read_text()
    missing = [name for name in planner.__all__ if f"planner.{name}" not in page]
    assert not missing, f"add ::: planner.NAME to docs/api.md for {missing}"


def test_the_changelog_tells_the_current_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"\n## {planner.__version__}\n" in changelog, "add a CHANGELOG.md entry for the version"


def test_every_public_name_has_a_docstring():
    for name in planner.__all__:
        obj = getattr(planner, name)
        if callable(obj) and not isinstance(obj, dict):
            assert obj.__doc__, f"planner.{name} has no docstring"


def test_the_readme_names_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci/run").read_text()
