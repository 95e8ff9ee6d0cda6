"""Rendering of plans: HTML summary, graph drawing, memory timeline, progress bars."""

import builtins
import io
import re

import numpy as np
import pytest

import planner
from planner import progress, viz
from planner.units import mib

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def gpt_plan():
    model, inputs = planner.zoo.gpt(layers=2, d_model=64, seq=32, batch=2, vocab=128)
    base = planner.plan(model, inputs, budget_gb=1)
    lowest = planner.solvers.auto.lowest_peak(base.problem).peak_bytes
    budget = (lowest + base.baseline_peak_bytes) // 2
    return planner.plan(model, inputs, budget_bytes=budget), model, inputs


def test_html_lists_summary_and_every_segment(gpt_plan):
    plan, _, _ = gpt_plan
    assert plan.segments, "the budget should force checkpointing"
    text = viz.plan_html(plan)
    assert text.startswith("<div") and text.rstrip().endswith("</div>")
    for needle in ("Predicted peak", "Recompute", "budget", "baseline", plan.solver):
        assert needle in text
    assert text.count("<tr>") >= len(plan.segments) + 1
    for start, _ in plan.segments:
        assert plan.problem.names[start] in text
    assert "<script" not in text


def test_print_and_html_show_the_same_segment_rows():
    """Regression: ``str(plan)`` counted every tensor crossing the cut, the HTML table the
    checkpoint's inputs (11 of 13 rows differed on zoo BERT). Both render segment_table, whose
    inputs are what the simulator keeps for each segment."""
    model, inputs = planner.zoo.bert(layers=2, d_model=64, seq=32, batch=2, vocab=128)
    plan = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n")
    rows = plan.segment_table()
    assert len(rows) > 2
    problem = plan.problem
    text, page = str(plan), viz.plan_html(plan)
    for row in rows:
        start, stop = row["start"], row["stop"]
        kept = [
            s
            for s in problem.storages
            if s.producer < start and any(start <= r < stop for r in s.readers)
        ]
        assert (row["input_tensors"], row["input_bytes"]) == (
            len(kept),
            sum(s.nbytes for s in kept),
        )
        assert f"{row['input_tensors']} &middot; {mib(row['input_bytes'])}" in page
        line = next(
            r
            for r in text.splitlines()
            if r.split()[:2] == [str(row["segment"]), str(row["nodes"])]
        )
        assert f"{row['input_bytes'] / 2**20:.1f} MiB" in line
    assert any(row["input_bytes"] != problem.cut_bytes[row["start"]] for row in rows)


@pytest.mark.parametrize("max_rows", [0, 1, 2, 4, 24])
def test_html_shortens_long_segment_lists_to_at_most_max_rows(max_rows):
    """Found by a tester: below 3, ``max_rows`` showed more rows than no limit, some twice."""
    model, inputs = planner.zoo.mlp_chain(depth=40, batch=64)
    plan = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n")
    assert len(plan.segments) > 4
    text = viz.plan_html(plan, max_rows=max_rows)
    shown = [int(n) for n in re.findall(r'margin-right:4px"></span>(\d+)</td>', text)]
    assert len(shown) == min(max_rows, len(plan.segments)) and len(set(shown)) == len(shown)
    if max_rows < len(plan.segments):
        assert f"{len(plan.segments) - len(shown)} more segments" in text
    with pytest.raises(ValueError, match="non-negative integer"):
        viz.plan_html(plan, max_rows=-1)
    assert viz.plan_html(plan, max_rows=np.int64(max_rows)) == text  # numpy's integers too


def test_html_of_a_plan_without_segments():
    model, inputs = planner.zoo.mlp_chain(depth=3)
    plan = planner.plan(model, inputs, budget_gb=1)
    assert plan.segments == ()
    assert "No segment is checkpointed" in viz.plan_html(plan)


@pytest.mark.parametrize("view", ["draw", "plot_memory"])
def test_a_figure_asked_into_a_directory_is_a_clear_error(gpt_plan, tmp_path, view):
    """Found by a tester: matplotlib wrote ``<folder>.png`` beside the folder given."""
    plan, _, _ = gpt_plan
    with pytest.raises(ValueError, match="is a directory; give a file path"):
        getattr(viz, view)(plan, path=tmp_path)
    assert not tmp_path.with_suffix(".png").exists()


def test_draw_writes_a_png(gpt_plan, tmp_path):
    plan, _, _ = gpt_plan
    figure = viz.draw(plan, path=tmp_path / "graph.png")
    assert (tmp_path / "graph.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "checkpointed segments" in figure.axes[0].get_title()


def test_draw_collapses_large_graphs(tmp_path):
    model, inputs = planner.zoo.gpt(layers=8, d_model=32, seq=16, batch=1, vocab=64)
    plan = planner.plan(model, inputs, budget_gb=1, solver="sqrt_n")
    assert plan.problem.size > 250
    figure = viz.draw(plan, path=tmp_path / "big.svg", max_groups=40)
    boxes = [t for t in figure.axes[0].texts if t.get_bbox_patch() is not None]
    assert 1 <= len(boxes) <= 40 + len(plan.segments)
    assert (tmp_path / "big.svg").stat().st_size > 0


def test_module_paths_follow_the_modules(gpt_plan):
    plan, _, _ = gpt_plan
    paths = viz.module_paths(plan)
    assert len(paths) == plan.problem.size
    by_name = dict(zip(plan.problem.names, paths))
    assert by_name["blocks_0_attn_qkv"] == "blocks.0.attn.qkv"
    assert by_name["softmax"] == "blocks.0.attn"  # a function node between attn's modules


def test_memory_timeline_matches_the_predictions(gpt_plan):
    plan, _, _ = gpt_plan
    curves = viz.memory_timeline(plan)
    base, planned = curves["baseline"], curves["plan"]
    assert base.peak_bytes == plan.baseline_peak_bytes
    assert planned.peak_bytes == plan.predicted_peak_bytes
    assert base.y.max() <= base.peak_bytes and planned.y.max() <= planned.peak_bytes
    assert base.x[-1] == pytest.approx(1.0)
    assert planned.x[-1] == pytest.approx(1.0 + plan.predicted_overhead)
    assert "recompute" in planned.phases


def test_plot_memory_with_measured_traces(gpt_plan, tmp_path):
    from planner.step import peak_memory

    plan, model, inputs = gpt_plan
    measured = peak_memory(plan.module, inputs, record_timeline=True)
    baseline = peak_memory(model, inputs, record_timeline=True)
    figure = viz.plot_memory(plan, measured, measured_baseline=baseline,
                             path=tmp_path / "memory.png")  # fmt: skip
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    ax = figure.axes[0]
    assert "MiB" in ax.get_ylabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("budget") for label in labels)
    assert any(label.startswith("measured, plan") for label in labels)


def test_plot_memory_needs_a_recorded_timeline(gpt_plan):
    from planner.tracker import MemoryReport

    plan, _, _ = gpt_plan
    with pytest.raises(ValueError, match="record_timeline=True"):
        viz.plot_memory(plan, MemoryReport(1, 0, 0, "cpu", None))


def test_a_path_given_where_plot_memory_takes_a_trace_says_to_use_path(gpt_plan, tmp_path):
    """``plan.draw(path)`` takes the path first; ``plot_memory``'s first argument is a measured
    trace (found trying the library: a numpy conversion error named the path)."""
    plan, _, _ = gpt_plan
    with pytest.raises(TypeError, match=r"plot_memory\(path=\.\.\.\)"):
        plan.plot_memory(tmp_path / "memory.png")
    assert not (tmp_path / "memory.png").exists()


def test_draw_into_a_given_axes(gpt_plan):
    from matplotlib.figure import Figure

    plan, _, _ = gpt_plan
    figure = Figure()
    left, right = figure.subplots(1, 2)
    assert viz.plot_memory(plan, ax=left) is figure
    assert viz.draw(plan, ax=right) is figure


def test_missing_matplotlib_is_a_clear_error(gpt_plan, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        viz.plot_memory(gpt_plan[0])


def test_progress_bar_is_silent_without_a_terminal(monkeypatch):
    monkeypatch.delenv("PLANNER_PROGRESS", raising=False)
    items = [1, 2, 3]
    assert progress.bar(items, total=3, desc="x") is items  # pytest captures stderr: no tty
    monkeypatch.setenv("PLANNER_PROGRESS", "0")
    assert not progress.enabled()


def test_progress_bar_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("PLANNER_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr", Terminal())
    assert progress.enabled()
    assert list(progress.bar(range(3), total=3, desc="counting")) == [0, 1, 2]


def test_progress_bar_without_tqdm(monkeypatch):
    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setenv("PLANNER_PROGRESS", "1")
    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    items = (x for x in range(2))
    assert progress.bar(items) is items


def test_layout_places_every_position_in_one_box_in_reading_order(gpt_plan):
    plan, _, _ = gpt_plan
    placed = viz.layout(plan, max_groups=12)
    boxes = placed.boxes
    assert boxes[0].start == 0 and boxes[-1].stop == plan.problem.size
    assert all(a.stop == b.start for a, b in zip(boxes, boxes[1:]))
    assert 1 <= len(boxes) <= 12 + len(plan.segments)
    assert len(placed.position) == len(boxes)
    assert any(data["boundary"] for _, _, data in placed.edges)  # segments have inputs
