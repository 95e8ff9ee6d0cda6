"""The notebooks in notebooks/ run top to bottom on CPU and are committed without outputs."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

import planner  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {
        "quickstart.ipynb",
        "huggingface.ipynb",
        "budget_sweep.ipynb",
    }


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} has stale outputs: clear them (jupyter nbconvert --clear-output "
                "--inplace notebooks/*.ipynb)"
            )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_top_to_bottom(path, monkeypatch):
    if path.stem == "huggingface":
        pytest.importorskip("transformers")
    if path.stem == "budget_sweep" and not hasattr(planner, "frontier"):
        pytest.skip("planner.frontier is not available yet")
    monkeypatch.setenv("PLANNER_PROGRESS", "0")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    images = sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert images >= 2, f"{path.name} should show its pictures"
    html = sum(
        "text/html" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    if path.stem in ("quickstart", "huggingface"):
        assert html >= 1, f"{path.name} should display a plan as HTML"
