"""Specification of measured node times in the cost model (``planner.costs``): the times must be
those of the graph that is planned. A node without a time silently falling back to the roofline
estimate (a GPU's scale, far from a CPU measurement) would skew every plan, so planning warns
when the times cover part of the graph and refuses times of another graph."""

import warnings

import pytest
import torch

import planner
from planner import zoo
from planner.costs import node_seconds
from planner.pipeline import prepare


def small_gpt():
    torch.manual_seed(0)
    return zoo.gpt(layers=2, d_model=64, seq=32, batch=2)


def test_times_for_every_node_replace_the_estimate_without_a_warning():
    model, inputs = small_gpt()
    times = node_seconds(model, inputs, repeat=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, problem = prepare(model, inputs, cost_model=planner.CostModel(measured_seconds=times))
    assert list(problem.seconds) == [times[name] for name in problem.names]


def test_times_for_part_of_the_graph_warn_that_the_rest_uses_the_estimate():
    model, inputs = small_gpt()
    times = node_seconds(model, inputs, repeat=1)
    part = dict(list(times.items())[: len(times) // 2])
    with pytest.warns(UserWarning, match=f"{len(times) - len(part)} of its {len(times)} nodes"):
        prepare(model, inputs, cost_model=planner.CostModel(measured_seconds=part))


def test_times_with_names_of_no_node_warn_that_they_were_measured_on_another_graph():
    model, inputs = small_gpt()
    times = {**node_seconds(model, inputs, repeat=1), "linear_99": 1e-3}
    with pytest.warns(UserWarning, match="1 measured names are of no node here"):
        prepare(model, inputs, cost_model=planner.CostModel(measured_seconds=times))


def test_times_of_another_graph_are_refused():
    model, inputs = small_gpt()
    other = {f"elsewhere_{i}": 1e-3 for i in range(5)}
    with pytest.raises(planner.PlanningError, match=r"names none of the \d+ nodes"):
        prepare(model, inputs, cost_model=planner.CostModel(measured_seconds=other))


def test_planning_measures_the_graph_it_captured_once(monkeypatch):
    model, inputs = small_gpt()
    captures = []
    real_capture = planner.pipeline.capture

    def counting(*args, **kwargs):
        captures.append(1)
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(planner.pipeline, "capture", counting)
    _, roofline = prepare(model, inputs)
    _, measured = prepare(model, inputs, cost_model=planner.CostModel(measure_repeat=1))
    assert len(captures) == 2, "one capture per prepare, the measured one included"
    assert measured.names == roofline.names
    assert (measured.seconds > 0).all() and (measured.seconds != roofline.seconds).all()


def test_measuring_needs_real_tensors_and_one_source_of_times():
    with pytest.raises(ValueError, match="not both"):
        planner.CostModel(measured_seconds={}, measure_repeat=3)
    with pytest.raises(ValueError, match="measure_repeat >= 0"):
        planner.CostModel(measure_repeat=-1)
    with torch.device("meta"):
        model, inputs = small_gpt()
    with pytest.raises(ValueError, match="meta device"):
        prepare(model, inputs, cost_model=planner.CostModel(measure_repeat=1))
