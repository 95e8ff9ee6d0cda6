"""The model matrix as one table: every Hugging Face family (tests/hf_families.py) and vision
model (tests/vision_models.py), without and with labels, planned as tests/test_huggingface.py
and tests/test_vision.py plan them (a budget halfway between the lowest peak and the baseline;
Hugging Face models captured with ``dynamic_shapes=True`` at batch 3, length 16).

Per case: nodes, capture method, the seconds of each stage (capture, profile, analyse, the
lowest peak and baseline that set the budget, solve with ``auto``), the budget, the predicted
and the measured peak (CPU live-storage tracker), the error (predicted - measured) / measured,
whether one step equals the model's exactly (``strategies.assert_equivalent``), and whether the
tests' second shape trains within the budget, equal to the model; and the seconds the case took,
checks included. Vision models need torchvision and timm (docs/huggingface.md). Times are wall
seconds on whatever machine runs it.

    .venv/bin/python benchmarks/model_matrix.py                  # everything
    .venv/bin/python benchmarks/model_matrix.py --only bart resnet18
"""

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.simplefilter("ignore")

from torchvision_shim import define_torchvision_operators  # noqa: E402

define_torchvision_operators()  # before anything imports torchvision

import torch  # noqa: E402
import transformers  # noqa: E402

from hf_families import FAMILIES  # noqa: E402
from planner.capture import capture  # noqa: E402
from planner.pipeline import assemble  # noqa: E402
from planner.planned_module import tensor_arguments  # noqa: E402
from planner.problem import build_problem  # noqa: E402
from planner.profile import profile  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.solvers.auto import choose, lowest_peak  # noqa: E402
from planner.step import peak_memory  # noqa: E402
from strategies import assert_equivalent  # noqa: E402
from test_huggingface import model_call, shapes  # noqa: E402

MIB = 2**20


def _vision_models():
    import pytest

    try:
        from test_vision import FIXED_SIZE, labels_loss
        from vision_models import MODELS
    except (Exception, pytest.skip.Exception):  # noqa: BLE001 - importorskip: no torchvision/timm
        return {}, set(), None
    return MODELS, FIXED_SIZE, labels_loss


def equal(reference, model, module, args, kwargs, loss_fn=None) -> bool:
    try:
        assert_equivalent(reference, model, module, args, kwargs, loss_fn=loss_fn)
    except AssertionError:
        return False
    return True


def timed_plan(model, args, kwargs, loss_fn, dynamic):
    """The plan the tests make, each stage timed: (plan, problem, seconds per stage)."""
    seconds = {}
    start = time.perf_counter()
    captured = capture(model, args, kwargs, dynamic_shapes=dynamic)
    captured.graph_module.meta["planner.tensor_arguments"] = tensor_arguments(model, args, kwargs)
    seconds["capture"] = time.perf_counter() - start
    start = time.perf_counter()
    profiled = profile(captured.graph_module, *captured.inputs(args, kwargs), loss_fn=loss_fn)
    seconds["profile"] = time.perf_counter() - start
    start = time.perf_counter()
    problem = build_problem(captured.graph_module, profiled)
    seconds["analyse"] = time.perf_counter() - start
    start = time.perf_counter()
    budget = (lowest_peak(problem).peak_bytes + simulate(problem, ()).peak_bytes) // 2
    seconds["budget"] = time.perf_counter() - start
    start = time.perf_counter()
    solver, segments = choose(problem, budget, "auto")
    seconds["solve"] = time.perf_counter() - start
    p = assemble(
        model, captured, problem, segments, solver=solver, budget_bytes=budget,
        solve_seconds=seconds["solve"], started=0.0,
    )  # fmt: skip
    return p, problem, seconds


def hf_case(name, labels):
    planned_shape, second_shape = shapes(name, labels)
    torch.manual_seed(0)
    model, args, kwargs = FAMILIES[name](labels=labels, **planned_shape)
    reference = copy.deepcopy(model)
    p, problem, seconds = timed_plan(model, args, kwargs, None, dynamic=True)
    measured = peak_memory(p.module, args, kwargs).peak_bytes
    equal_step = equal(reference, model, p.module, args, model_call(model, kwargs))
    torch.manual_seed(0)
    _, other_args, other_kwargs = FAMILIES[name](labels=labels, **second_shape)
    other = peak_memory(p.module, other_args, other_kwargs).peak_bytes
    second = other <= p.budget_bytes and equal(
        reference, model, p.module, other_args, model_call(model, other_kwargs)
    )
    shape = "x".join(map(str, second_shape.values()))
    shape = shape if "length" in second_shape else f"batch {shape}"
    return p, problem, seconds, measured, equal_step, second, shape


def vision_case(name, labels):
    models, fixed_size, labels_loss = _vision_models()
    model, args, _ = models[name]()
    loss_fn = labels_loss(args) if labels else None
    p, problem, seconds = timed_plan(model, args, {}, loss_fn, dynamic=False)
    measured = peak_memory(p.module, args, loss_fn=loss_fn).peak_bytes
    # the measured step updated BatchNorm statistics: compare with the model as it is now
    equal_step = equal(copy.deepcopy(model), model, p.module, args, {}, loss_fn=loss_fn)
    second_shape = {"batch": 1} if name in fixed_size else {"size": 48}
    _, other_args, _ = models[name](**second_shape)
    other = peak_memory(p.module, other_args, loss_fn=loss_fn).peak_bytes
    second = other <= p.budget_bytes and equal(
        copy.deepcopy(model), model, p.module, other_args, {}, loss_fn=loss_fn
    )
    shape = f"batch {second_shape['batch']}" if "batch" in second_shape else "48 px"
    return p, problem, seconds, measured, equal_step, second, shape


HEADER = (
    "| model | labels | nodes | capture | capture s | profile s | analyse s | budget s | solve s "
    "| solver, segments | budget B | predicted B | measured B | error | step equal "
    "| second shape | case s |\n" + "|---" * 17 + "|"
)


def row(name, labels, case) -> str:
    p, problem, seconds, measured, equal_step, second, shape = case
    times = " | ".join(
        f"{seconds[k]:.2f}" for k in ("capture", "profile", "analyse", "budget", "solve")
    )
    error = (p.predicted_peak_bytes - measured) / measured
    fits = "" if measured <= p.budget_bytes else " (over budget)"
    return (
        f"| {name} | {'yes' if labels else 'no'} | {problem.size} | {p.capture_method} | {times} "
        f"| {p.solver}, {len(p.segments)} | {p.budget_bytes:,} | {p.predicted_peak_bytes:,} "
        f"| {measured:,}{fits} | {error:+.3%} | {'yes' if equal_step else 'NO'} "
        f"| {shape}: {'yes' if second else 'NO'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="model names (default: every one)")
    options = parser.parse_args()
    transformers.logging.set_verbosity_error()
    vision = _vision_models()[0]
    names = options.only or [*FAMILIES, *vision]
    print(HEADER, flush=True)
    for name in names:
        case = hf_case if name in FAMILIES else vision_case
        for labels in (False, True):
            start = time.perf_counter()
            line = row(name, labels, case(name, labels))
            print(f"{line} {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
