"""Smoke test of benchmarks/compare.py: the short mode on a tiny zoo MLP and a tiny Hugging Face
GPT-2, through its entry point.

Checks the structure and internal consistency of the results and that the page and plot are
written; never timings (the machine is shared and noisy).
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_benchmark(name: str):
    """benchmarks/NAME.py as a module, the way its entry point runs it."""
    spec = importlib.util.spec_from_file_location(
        f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_short_mode_on_tiny_models_writes_consistent_results_and_page(tmp_path):
    pytest.importorskip("transformers")
    compare = _load_benchmark("compare")
    out = tmp_path / "results.json"
    page = tmp_path / "docs" / "benchmarks.md"
    img = tmp_path / "docs" / "img"
    returned = compare.main(
        [
            "--mode",
            "short",
            "--models",
            "mlp",
            "hf-gpt2",
            "--set",
            "mlp:depth=6,width=16,batch=32",
            "--set",
            "hf-gpt2:layers=1,d_model=32,heads=2,seq=16,batch=2",
            "--reps",
            "2",
            "--out",
            str(out),
            "--page",
            str(page),
            "--img-dir",
            str(img),
        ]
    )

    results = json.loads(out.read_text())
    assert results["models"].keys() == {"mlp", "hf-gpt2"} == returned["models"].keys()
    assert results["mode"] == "short" and results["reps"] == 2
    assert results["machine"]["torch"] and results["command"].startswith(
        "python benchmarks/compare.py"
    )
    assert results["solvers"][0] == "auto" and {"greedy", "sqrt_n"} <= set(results["solvers"])

    for name, m in results["models"].items():
        check_model(results, name, m)

    text = page.read_text()
    assert (
        "## mlp" in text and "## hf-gpt2" in text and "torch" in text and results["command"] in text
    )
    assert (img / "benchmarks_mlp.png").stat().st_size > 0
    assert "img/benchmarks_mlp.png" in text

    # the page re-renders from the JSON alone
    page2 = page.parent / "again.md"
    compare.main(["--page-only", str(out), "--page", str(page2), "--img-dir", str(img)])
    assert page2.read_text() == text


def check_model(results: dict, name: str, m: dict) -> None:
    """One model's record: methods, ratios, plans and targets agree with each other."""
    v = m["variants"]
    methods = {r["method"] for r in v.values()}
    assert {"none", "per-block", "compile", "planner"} <= methods
    # checkpoint_sequential has adapters for the zoo models only
    assert ("ckpt-seq" in methods) == (not name.startswith("hf-"))
    compile_budgets = sorted(
        r["activation_memory_budget"] for r in v.values() if r["method"] == "compile"
    )
    assert compile_budgets == sorted(results["compile_budgets"])

    none = v["none"]
    assert none["peak_ratio"] == 1.0 and none["time_ratio"] == 1.0 and none["flops_ratio"] == 1.0
    fixed = m["fixed_bytes"] + m["gradient_bytes"]
    for key, r in v.items():
        assert len(r["times"]) == 2, key
        assert r["peak_bytes"] >= r["start_bytes"] > 0, key
        assert r["peak_ratio"] == pytest.approx(r["peak_bytes"] / none["peak_bytes"]), key
        assert r["activation_bytes"] == r["peak_bytes"] - fixed, key
        assert r["time_ratio_q1"] <= r["time_ratio"] <= r["time_ratio_q3"], key
        assert r["flops"] >= none["flops"] > 0, key  # recompute only adds FLOPs
        if r["method"] == "planner":
            err = (r["predicted_peak_bytes"] - r["peak_bytes"]) / r["peak_bytes"]
            assert r["prediction_error"] == pytest.approx(err), key
    # the FLOP instrument that sees compiled code agrees with planner.step on eager code
    check = m["flops_cross_check"]
    assert check["planner_measure_step_flops"] == check["instruments_step_flops"]
    # every feasible plan row points at a measured variant; infeasible ones are over budget
    solvers = {p["solver"] for p in m["plans"]}
    assert solvers == set(results["solvers"])
    for p in m["plans"]:
        if p["status"] == "ok":
            assert v[p["variant"]]["method"] == "planner"
            assert p["predicted_peak_bytes"] <= p["budget_bytes"]
        else:
            assert p["status"] == "infeasible" and p["predicted_peak_bytes"] > p["budget_bytes"]
    assert any(p["status"] == "ok" for p in m["plans"])

    t = results["targets"][name]
    assert {"dominated", "prediction", "at_compile_peaks"} <= t.keys()
    rows = t["at_compile_peaks"]["rows"]
    assert sorted(v[r["compile"]]["activation_memory_budget"] for r in rows) == compile_budgets
    for r in rows:  # each compile peak was given to planner auto as its budget
        assert r["planner"] is None or v[r["planner"]]["method"] == "planner"


@pytest.mark.slow
def test_objective_benchmark_plans_both_objectives_within_each_compiled_peak(tmp_path):
    pytest.importorskip("transformers")
    objective = _load_benchmark("objective")
    out = tmp_path / "objective.json"
    objective.main(
        [
            "--models",
            "hf-gpt2",
            "--set",
            "hf-gpt2:layers=1,d_model=32,heads=2,seq=16,batch=2",
            "--budgets",
            "0.4",
            "--reps",
            "2",
            "--out",
            str(out),
        ]
    )

    m = json.loads(out.read_text())["models"]["hf-gpt2"]
    v = m["variants"]
    assert {"none", "compile 1", "compile 0.4"} <= v.keys()
    (row,) = m["rows"]
    assert row["budget"] == 0.4 and row["peak_bytes"] == v["compile 0.4"]["peak_bytes"]
    for objective_name in ("time", "flops"):
        planned = row[objective_name]
        # each plan was made for the compiled peak, and its measured step stays within it
        assert planned["predicted_peak_bytes"] <= row["peak_bytes"], objective_name
        assert v[planned["variant"]]["peak_bytes"] <= row["peak_bytes"], objective_name
        assert v[planned["variant"]]["extra_flops"] >= 0, objective_name


@pytest.mark.slow
def test_floor_benchmark_reports_the_lowest_peak_between_the_floor_and_the_flat_plans(tmp_path):
    floors = _load_benchmark("floors")
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## How it is measured\n\n- text\n")
    results = floors.main(
        ["--models", "resnet", "--out", str(tmp_path / "floors.json"), "--page", str(page)]
    )

    (r,) = results["models"]
    assert r["floor_bytes"] <= r["lowest"]["predicted_bytes"] <= r["flat"]["predicted_bytes"]
    assert r["lowest"]["predicted_bytes"] < r["baseline_predicted_bytes"]
    # at 20% of its activations the ResNet is below its floor: no plan is claimed
    assert r["share_budget_bytes"] < r["floor_bytes"] and r["at_share"] is None
    text = page.read_text()
    assert text.index(floors.HEADING) < text.index("## How it is measured")
    assert "| resnet |" in text
    floors.write_section(page, floors.render(results))  # again: the section is replaced
    assert page.read_text().count(floors.HEADING) == 1
