"""Saved plans: JSON round trip, fingerprint checks, no re-solving."""

import json

import pytest
import torch

import planner
from planner import serialize
from planner.errors import PlanningError


def small_gpt(**overrides):
    config = dict(layers=2, d_model=64, seq=32, batch=2, vocab=128)
    config.update(overrides)
    return planner.zoo.gpt(**config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, inputs = small_gpt()
    base = planner.plan(model, inputs, budget_gb=1)
    lowest = planner.pipeline.lowest_peak(base.problem).peak_bytes
    plan = planner.plan(model, inputs, budget_bytes=(lowest + base.baseline_peak_bytes) // 2)
    assert plan.segments
    path = tmp_path_factory.mktemp("plans") / "gpt.json"
    serialize.save(plan, path, inputs)
    return plan, path, inputs


def test_file_is_plain_json_with_what_it_promises(saved):
    plan, path, _ = saved
    data = json.loads(path.read_text())
    assert data["format"] == "planner.plan" and data["version"] == serialize.FORMAT_VERSION
    assert data["solver"] == plan.solver
    assert data["budget_bytes"] == plan.budget_bytes
    assert data["predictions"]["peak_bytes"] == plan.predicted_peak_bytes
    assert data["predictions"]["baseline_peak_bytes"] == plan.baseline_peak_bytes
    assert [(s["start"], s["stop"]) for s in data["segments"]] == list(plan.segments)
    names = plan.problem.names
    assert [(s["first"], s["last"]) for s in data["segments"]] == [
        (names[a], names[b - 1]) for a, b in plan.segments
    ]
    assert data["graph"]["fingerprint"] == serialize.fingerprint(plan)
    assert data["graph"]["nodes"] == plan.problem.size
    assert data["inputs"]["args"][0] == {
        "kind": "tensor", "shape": [2, 32], "dtype": "int64", "requires_grad": False,
    }  # fmt: skip


def test_round_trip_gives_the_same_plan_without_solving(saved, monkeypatch):
    plan, path, inputs = saved
    model, _ = small_gpt(seed=3)  # same architecture, other weights

    def no_solving(*args, **kwargs):
        raise AssertionError("load must not solve")

    monkeypatch.setattr(planner.pipeline, "choose", no_solving)
    loaded = serialize.load(path, model)
    assert loaded.segments == plan.segments
    assert loaded.solver == plan.solver and loaded.budget_bytes == plan.budget_bytes
    assert loaded.predicted_peak_bytes == plan.predicted_peak_bytes
    assert loaded.baseline_peak_bytes == plan.baseline_peak_bytes
    assert loaded.predicted_overhead == pytest.approx(plan.predicted_overhead)
    assert serialize.fingerprint(loaded) == serialize.fingerprint(plan)

    # The loaded module is the model's, checkpointed: same loss and gradients.
    torch.manual_seed(0)
    model(*inputs).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loaded.module(*inputs).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)
    assert "checkpoint" in loaded.module.code


def test_load_with_explicit_inputs(saved):
    plan, path, inputs = saved
    model, _ = small_gpt()
    assert serialize.load(path, model, inputs).segments == plan.segments


@pytest.mark.parametrize(
    "other, expected",
    [
        (lambda: small_gpt(layers=3), r"another graph .* first difference at node \d+"),
        (lambda: small_gpt(d_model=32), r"first difference at node \d+"),
        (lambda: planner.zoo.mlp_chain(depth=3), r"this Sequential captures to"),
    ],
)
def test_load_into_another_model_is_a_clear_error(saved, other, expected):
    _, path, _ = saved
    model, inputs = other()
    with pytest.raises(PlanningError, match=expected):
        serialize.load(path, model, inputs)


def test_load_with_other_input_shapes_is_an_error(saved):
    _, path, _ = saved
    model, inputs = small_gpt(batch=3)
    with pytest.raises(PlanningError, match="input shapes it was made for"):
        serialize.load(path, model, inputs)


def test_plan_saved_without_inputs_needs_them(saved, tmp_path):
    plan, _, inputs = saved
    path = serialize.save(plan, tmp_path / "bare.json")
    model, _ = small_gpt()
    if getattr(plan, "input_spec", None) is None:
        with pytest.raises(PlanningError, match="pass them"):
            serialize.load(path, model)
    assert serialize.load(path, model, inputs).segments == plan.segments


@pytest.mark.parametrize(
    "content, expected",
    [
        ("not json", "not JSON"),
        ('{"hello": 1}', "not a saved plan"),
        ('{"format": "planner.plan", "version": 99}', "version 99"),
        ('{"format": "planner.plan", "version": 1}', "no 'segments' field"),
    ],
)
def test_bad_files(tmp_path, content, expected):
    path = tmp_path / "bad.json"
    path.write_text(content)
    model, inputs = small_gpt()
    with pytest.raises(PlanningError, match=expected):
        serialize.load(path, model, inputs)


def test_missing_file(tmp_path):
    model, inputs = small_gpt()
    with pytest.raises(PlanningError, match="no saved plan"):
        serialize.load(tmp_path / "nothing.json", model, inputs)


def test_edited_segment_names_are_caught(saved, tmp_path):
    _, path, inputs = saved
    data = json.loads(path.read_text())
    data["segments"][0]["first"] = "somewhere_else"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    model, _ = small_gpt()
    with pytest.raises(PlanningError, match="does not name the nodes"):
        serialize.load(edited, model, inputs)


def test_fingerprint_depends_on_shapes_not_weights():
    _, first = planner.pipeline.prepare(*small_gpt(seed=0))
    _, second = planner.pipeline.prepare(*small_gpt(seed=1))
    _, wider = planner.pipeline.prepare(*small_gpt(batch=4))
    assert serialize.fingerprint(first) == serialize.fingerprint(second)
    assert serialize.fingerprint(first) != serialize.fingerprint(wider)
    assert serialize.fingerprint(first).startswith("sha256:")
