"""The budget sweep: what every frontier guarantees, its two ends, its table and its plot."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import planner
from planner.errors import PlanningError
from planner.frontier import Frontier, frontier, frontier_of
from planner.pipeline import prepare
from planner.simulate import simulate
from planner.solvers.auto import lowest_peak

# The module, not the function of the same name that ``planner`` may export.
frontier_module = importlib.import_module("planner.frontier")


@pytest.fixture(scope="module")
def problem():
    model, inputs = planner.zoo.gpt(layers=2, d_model=32, seq=16, batch=2, vocab=64)
    return prepare(model, inputs)[1]


@pytest.fixture(scope="module", params=["auto", "optimal", "greedy"])
def swept(request, problem) -> Frontier:
    return frontier_of(problem, points=8, solver=request.param)


def test_every_point_fits_and_recompute_never_grows(swept):
    budgets = [p.budget_bytes for p in swept.points]
    assert budgets == sorted(set(budgets))
    for point in swept.points:
        assert point.peak_bytes <= point.budget_bytes
    costs = [p.recompute_seconds for p in swept.points]
    assert all(later <= earlier for earlier, later in zip(costs, costs[1:]))


def test_each_point_names_the_budget_that_gives_its_plan(swept, problem):
    """Found by a tester: ``plan`` at a point's own budget can give a costlier plan than the
    point's (the solvers are not monotone in the budget; the sweep keeps the cheaper plan of a
    smaller budget), so the point names the budget its plan was chosen at."""
    solver = swept.points[0].solver.partition(":")[0]
    for point in swept.points:
        assert point.plan_budget_bytes <= point.budget_bytes
        _, segments = planner.solvers.auto.choose(problem, point.plan_budget_bytes, solver)
        again = simulate(problem, segments)
        assert (again.peak_bytes, again.recompute_seconds) == (
            point.peak_bytes,
            point.recompute_seconds,
        )


def test_runs_from_the_lowest_peak_to_the_baseline(swept, problem):
    first, last = swept.points[0], swept.points[-1]
    assert swept.lowest_peak_bytes == lowest_peak(problem).peak_bytes
    assert first.budget_bytes >= swept.lowest_peak_bytes
    if first.solver.startswith("auto"):  # auto reaches the lowest peak, nested plans included;
        assert first.budget_bytes == swept.lowest_peak_bytes  # a flat solver starts at its own
    assert swept.baseline_peak_bytes == simulate(problem, ()).peak_bytes
    assert last.budget_bytes == last.peak_bytes == swept.baseline_peak_bytes
    assert (last.recompute_seconds, last.recompute_overhead, last.segments) == (0.0, 0.0, 0)
    assert first.recompute_overhead > 0
    assert len(swept.points) == 8


def test_overhead_is_recompute_over_three_forwards(swept, problem):
    step = 3 * float(problem.seconds.sum())
    assert problem.step_seconds == pytest.approx(step)
    for point in swept.points:
        assert point.recompute_overhead == pytest.approx(point.recompute_seconds / step)


def test_rows_and_table(swept):
    rows = swept.to_rows()
    assert len(rows) == len(swept.points)
    assert set(rows[0]) == {
        "budget_bytes",
        "peak_bytes",
        "recompute_seconds",
        "recompute_overhead",
        "recompute_flops",
        "segments",
        "solver",
        "plan_budget_bytes",
    }
    text = str(swept)
    assert text.startswith("Frontier: 8 budgets") and "budget MiB" in text
    # The header names where the sweep starts: the lowest peak, or above it (found by a tester:
    # a flat solver's sweep was said to start from the nested plans' lowest peak).
    first = swept.in_mib(swept.points[0].budget_bytes)
    if swept.points[0].budget_bytes == swept.lowest_peak_bytes:
        assert f"from the lowest peak {first} MiB to" in text
    else:
        assert f"from {first} MiB (lowest peak found: " in text
    assert len(text.splitlines()) == 2 + len(swept.points)
    # Each budget row is printed with enough decimals to tell the budgets apart.
    budgets = [line.split()[0] for line in text.splitlines()[2:]]
    assert len(set(budgets)) == len(budgets)


def test_given_budgets_and_a_budget_nothing_fits(problem):
    lowest = lowest_peak(problem).peak_bytes
    baseline = simulate(problem, ()).peak_bytes
    swept = frontier_of(problem, budgets=[baseline, (lowest + baseline) // 2])
    assert [p.budget_bytes for p in swept.points] == [(lowest + baseline) // 2, baseline]
    with pytest.raises(PlanningError, match="lowest peak found"):
        frontier_of(problem, budgets=[lowest - 4096, baseline])
    with pytest.raises(ValueError, match="points"):
        frontier_of(problem, points=0)


@pytest.mark.parametrize("points", [0, 2.5, True, "4"])
def test_a_count_of_points_that_is_not_a_whole_number_is_refused_before_capture(points):
    """Found trying the library: ``points=2.5`` raised numpy's TypeError after the capture."""
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"points must be a whole number"):
        frontier(model, (torch.randn(2, 5),), points=points)  # the wrong width: not captured


@pytest.mark.parametrize("budget", [float("nan"), -5, 0, "1e9"])
def test_a_budget_plan_would_refuse_is_a_value_error(problem, budget):
    """Found trying the library: NaN failed converting to an integer, -5 planned to a
    "budget of -0.0 MiB", 0 was a PlanningError: budgets are checked as plan() checks its."""
    with pytest.raises(ValueError, match="frontier budgets: budget_bytes must be"):
        frontier_of(problem, budgets=[budget])


def test_from_a_model_with_a_progress_bar(monkeypatch):
    wrapped = []

    def bar(iterable, total=None, desc=None, **kwargs):
        wrapped.append((total, desc))
        return iterable

    monkeypatch.setattr(frontier_module, "bar", bar)
    model, inputs = planner.zoo.mlp_chain(depth=6, width=16, batch=128)
    swept = frontier(model, inputs, points=3)
    assert wrapped == [(3, "budgets")]
    assert len(swept.points) == 3 and swept.points[-1].segments == 0
    with_state = frontier(model, inputs, points=2, optimizer_state_bytes=2**20)
    assert with_state.baseline_peak_bytes == swept.baseline_peak_bytes + 2**20


def test_plot_writes_a_png(swept, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "frontier.png"
    figure = swept.plot(path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = figure.axes[0]
    assert "MiB" in ax.get_xlabel() and "%" in ax.get_ylabel()
    assert swept.plot(ax=ax) is figure


def test_a_path_given_where_plot_takes_axes_says_to_use_path(swept, tmp_path):
    """Found trying the library: ``plot("frontier.png")``, as ``Plan.draw`` takes a path
    first, failed with "'str' object has no attribute 'figure'"."""
    path = tmp_path / "frontier.png"
    with pytest.raises(TypeError, match=r"plot\(path=\.\.\.\)"):
        swept.plot(str(path))
    assert not path.exists()


def test_plot_without_matplotlib_says_how_to_install_it(swept, monkeypatch):
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        swept.plot()
