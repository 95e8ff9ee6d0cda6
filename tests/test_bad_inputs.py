"""Bad input, end to end: what each mistake gets, and the user's model left untouched.

"Untouched" is checked by ``strategies.model_state``: parameter values, identities,
``requires_grad`` and ``.grad``; buffers; every module's ``training`` flag; hook dicts.
See docs/guarantees.md for the table these tests pin down.
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import planner
from planner.errors import PlanningError
from planner.pipeline import prepare
from planner.simulate import simulate
from planner.solvers.auto import lowest_peak
from planner.step import peak_memory, training_loss
from strategies import ModelSpec, assert_equivalent, assert_same_state, build, inputs, model_state


def small(untraceable=False, output="tensor"):
    spec = ModelSpec(
        kind="dense",
        width=8,
        batch=4,
        spatial=3,
        ops=(
            ("layer", True),
            ("norm", "bn"),
            ("dropout", 0.5),
            ("push",),
            ("layer", False),
            ("act", "gelu"),
            ("add",),
            ("scale",),
            ("flag",),
        ),
        frozen=1,
        tie=False,
        output=output,
        extra_input=True,
        scale=0.5,
        flag=True,
        untraceable=untraceable,
        input_requires_grad=True,
        seed=3,
    )
    model = build(spec)
    model.layers[0].weight.grad = torch.ones_like(model.layers[0].weight)  # a stale .grad
    args, kwargs = inputs(spec)
    return model, args, kwargs


def plan_of(model, args, kwargs, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return planner.plan(model, args, example_kwargs=kwargs, **options)


@pytest.mark.parametrize(
    "budget",
    [
        {},
        {"budget_gb": 1.0, "budget_bytes": 2**30},
        {"budget_bytes": 0},
        {"budget_bytes": -5},
        {"budget_gb": math.nan},
        {"budget_gb": math.inf},
        {"budget_bytes": "1GB"},
        {"budget_bytes": True},
        {"budget_gb": 1e300},
        {"budget_bytes": 2**63},
        {"budget_gb": 1e-300},
    ],
    ids=[
        "none",
        "both",
        "zero",
        "negative",
        "nan",
        "inf",
        "string",
        "bool",
        "huge gb",
        "huge bytes",
        "under a byte",
    ],
)
def test_invalid_budget_is_a_value_error(budget):
    model, args, kwargs = small()
    before = model_state(model)
    with pytest.raises(ValueError, match="budget"):
        plan_of(model, args, kwargs, **budget)
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("state", [-3_000_000, float("nan"), "8", 1.5, True])
def test_invalid_optimizer_state_bytes_is_a_value_error(state):
    """Found trying the library: a negative count was accepted and hid memory from the budget
    (measured 6.9 MB against a budget of 4 MB); NaN and strings failed deep inside."""
    model, args, kwargs = small()
    before = model_state(model)
    with pytest.raises(ValueError, match="optimizer_state_bytes must be a non-negative integer"):
        planner.plan(model, args, budget_gb=1, example_kwargs=kwargs, optimizer_state_bytes=state)
    assert_same_state(before, model_state(model))


OPTIONS_OF_THE_WRONG_KIND = {
    "cost_model as a string": (
        lambda m, a, k: planner.plan(m, a, budget_gb=1, cost_model="roofline"),
        TypeError,
        r"cost_model must be a planner\.CostModel or None, got str",
    ),
    "capture_options as a string": (
        lambda m, a, k: planner.prepare(m, a, capture_options="x"),
        TypeError,
        r"capture_options must be a planner\.CaptureOptions",
    ),
    "a CostModel of no speed": (
        lambda m, a, k: planner.CostModel(flops_per_second=float("nan")),
        ValueError,
        r"flops_per_second > 0",
    ),
    "a folder to load": (
        lambda m, a, k: planner.load("/", m),
        PlanningError,
        r"is a folder, not a saved plan",
    ),
    "frontier_of of a model": (
        lambda m, a, k: planner.frontier_of(m),
        TypeError,
        r"frontier_of takes the Problem",
    ),
    "a string of micro-batch sizes": (
        lambda m, a, k: planner.plan_batch(
            m, lambda b: (torch.randn(b, 8),), budget_gb=1, global_batch=8, micro_batches="24"
        ),
        TypeError,
        r"micro_batches must be a list",
    ),
    "one micro-batch size, not a list": (
        lambda m, a, k: planner.plan_batch(
            m, lambda b: (torch.randn(b, 8),), budget_gb=1, global_batch=8, micro_batches=4
        ),
        TypeError,
        r"micro_batches must be a list",
    ),
}


@pytest.mark.parametrize("case", OPTIONS_OF_THE_WRONG_KIND)
def test_an_option_of_the_wrong_kind_says_which_and_what_it_takes(case):
    """Found trying the library: each was a raw AttributeError, IsADirectoryError or numpy
    TypeError from deep inside, or (a CostModel of NaN FLOP/s) a plan whose overhead was NaN."""
    call, error, match = OPTIONS_OF_THE_WRONG_KIND[case]
    model, args, kwargs = small()
    before = model_state(model)
    with pytest.raises(error, match=match):
        call(model, args, kwargs)
    assert_same_state(before, model_state(model))


def test_infeasible_budget_states_the_minimum():
    model, args, kwargs = small()
    before = model_state(model)
    _, problem = prepare(model, args, kwargs)
    lowest = lowest_peak(problem).peak_bytes
    with pytest.raises(PlanningError, match=f"budget_bytes={lowest}"):
        plan_of(model, args, kwargs, budget_bytes=lowest - 1)
    assert_same_state(before, model_state(model))


class ReturnsItsInput(nn.Module):
    def forward(self, x):
        return x


def test_a_graph_of_no_op_below_its_minimum_states_the_minimum():
    """Found trying the library: the nested solver's tables failed on an empty graph with
    numpy's "zero-size array to reduction operation maximum"."""
    x = torch.randn(8, 32, requires_grad=True)
    with pytest.raises(PlanningError, match=r"budget_bytes=\d+"):
        plan_of(ReturnsItsInput(), (x,), {}, budget_bytes=1)


def test_infeasible_budget_names_gradients_and_what_helps_when_they_set_the_floor():
    """A wide layer on a tiny batch: parameters and their gradients are nearly all the peak, so
    a smaller batch cannot help; the message says what can."""
    model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512))
    with pytest.raises(PlanningError) as info:
        plan_of(model, (torch.randn(1, 512),), {}, budget_bytes=100)
    message = str(info.value)
    assert "parameter gradients 2.0 MiB" in message and "optimizer state" in message
    assert "smaller batch or input barely helps" in message and "FSDP" in message


def test_infeasible_budget_counts_the_optimizer_state_given():
    model, args, kwargs = small()
    with pytest.raises(PlanningError, match=r"optimizer state 1\.0 MiB"):
        plan_of(model, args, kwargs, budget_bytes=100, optimizer_state_bytes=2**20)


def test_the_minimum_the_error_states_is_accepted():
    model, args, kwargs = small()
    _, problem = prepare(model, args, kwargs)
    lowest = lowest_peak(problem).peak_bytes
    assert plan_of(model, args, kwargs, budget_bytes=lowest).predicted_peak_bytes <= lowest


def test_a_named_solver_is_told_the_minimum_it_can_meet_itself():
    """Found trying the library: ``solver="greedy"`` was told to raise the budget to the
    lowest peak of any solver, then refused again at that budget."""
    model, args = planner.zoo.build("mlp", depth=12, width=64, batch=1024)
    with pytest.raises(PlanningError, match=r"Solver 'greedy' found no plan below") as error:
        planner.plan(model, args, budget_bytes=100, solver="greedy")
    minimum = int(re.search(r"give budget_bytes=(\d+) or more", str(error.value)).group(1))
    assert planner.plan(model, args, budget_bytes=minimum, solver="greedy").segments
    with pytest.raises(PlanningError):
        planner.plan(model, args, budget_bytes=minimum - 1, solver="greedy")


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # a Python branch on a tensor value: neither fx nor export can capture
            h = h * 2
        return h


def test_untraceable_model_says_why_and_what_to_try():
    model = DataDependent()
    before = model_state(model)
    with pytest.raises(PlanningError) as info:
        plan_of(model, (torch.randn(3, 4),), {}, budget_gb=1)
    message = str(info.value)
    assert "symbolic_trace" in message and "torch.export" in message  # both reasons
    assert "example_kwargs" in message and "leaf" in message and "strict=False" in message
    assert_same_state(before, model_state(model))


class RefusesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[-1] != 16:
            raise ValueError(f"expected 16 features, got {x.shape[-1]}")
        return self.linear(x)


def test_a_forward_refusing_the_example_says_so_without_capture_advice():
    """Capture reported the model's own ValueError as a capture failure, with advice about
    caches and torch.cond that cannot help."""
    model = RefusesItsInput()
    before = model_state(model)
    with pytest.raises(PlanningError) as info:
        plan_of(model, (torch.randn(4, 8),), {}, budget_gb=1)
    message = str(info.value)
    assert message.startswith("RefusesItsInput's forward raised ValueError: expected 16")
    assert "test_bad_inputs.py:" in message and "example inputs" in message
    assert "use_cache" not in message and "torch.cond" not in message
    assert isinstance(info.value.__cause__, ValueError)
    assert_same_state(before, model_state(model))


class LooksUpBySize(nn.Module):
    """Fails on a line that calls (a lookup, as a kernel bound from C++ fails under tracing),
    not on a raise statement: capture cannot tell the model's fault from its own there."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scales = {16: 0.5}

    def forward(self, x):
        return self.linear(x) * self.scales[x.shape[-1]]


def test_an_error_on_a_line_that_calls_keeps_both_capture_reasons_and_the_advice():
    with pytest.raises(PlanningError, match="cannot capture LooksUpBySize") as info:
        plan_of(LooksUpBySize(), (torch.randn(4, 8),), {}, budget_gb=1)
    assert "KeyError" in str(info.value) and "What to try" in str(info.value)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class ManualCheckpoint(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        if self.how == "non-reentrant":
            return checkpoint(self.blocks, x, use_reentrant=False)
        if self.how == "reentrant":
            return checkpoint(self.blocks, x, use_reentrant=True)
        return checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "sequential"])
def test_manual_checkpoint_is_detected_not_dropped(how):
    model = ManualCheckpoint(how)
    x = torch.randn(3, 4, requires_grad=True)
    before = model_state(model)
    with pytest.raises(PlanningError, match=r"already calls torch\.utils\.checkpoint"):
        plan_of(model, (x,), {}, budget_gb=1)
    assert_same_state(before, model_state(model))
    model(x).sum().backward()  # torch.utils.checkpoint is intact after the refusal
    assert all(p.grad is not None for p in model.parameters())


class DiffusersStyleCheckpointing(ManualCheckpoint):
    """diffusers' models turn their checkpointing off by this name."""

    def disable_gradient_checkpointing(self):
        self.how = "none"


def test_the_advice_names_the_method_a_diffusers_model_turns_checkpointing_off_with():
    """Found by a tester: the message named Hugging Face's method, which diffusers lacks."""
    model = DiffusersStyleCheckpointing("non-reentrant")
    with pytest.raises(PlanningError, match=r"call model\.disable_gradient_checkpointing\(\)"):
        plan_of(model, (torch.randn(3, 4),), {}, budget_gb=1)


@pytest.mark.parametrize("solver", ["sqrt_n", "auto"])  # with segments, and none
def test_a_planned_module_cannot_be_planned_again(solver):
    """Planning it again would drop the plan, or plan a graph of a graph: the message says to
    plan the model instead (it said the module calls torch.utils.checkpoint)."""
    model, args, kwargs = small()
    p = plan_of(model, args, kwargs, budget_gb=1, solver=solver)
    assert bool(p.segments) == (solver == "sqrt_n")
    with pytest.raises(PlanningError, match=r"already a plan .*Plan the model it was planned"):
        plan_of(p.module, args, kwargs, budget_gb=1)


def test_a_model_holding_a_planned_module_is_refused_by_its_name():
    """Found by a tester: the message said the model calls torch.utils.checkpoint."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    x = torch.randn(4, 8)
    model[1] = planner.plan(model[1], (x,), budget_gb=1, solver="sqrt_n").module
    with pytest.raises(PlanningError, match=r"^1 of Sequential is a plan .*Put back the module"):
        planner.plan(model, (x,), budget_gb=1)


@pytest.mark.parametrize("where", ["root", "inlined submodule"])
def test_hooks_the_planned_module_would_drop_are_refused(where):
    model = nn.Sequential(Block(), nn.Linear(4, 4))
    target = model if where == "root" else model[0]
    target.register_forward_hook(lambda module, args, out: out * 2)
    before = model_state(model)
    with pytest.raises(PlanningError, match="hooks"):
        plan_of(model, (torch.randn(3, 4),), {}, budget_gb=1)
    assert_same_state(before, model_state(model))


def test_hooks_on_leaf_modules_keep_running():
    model = nn.Sequential(Block(), nn.Linear(4, 4))
    calls = []
    model[1].register_forward_hook(lambda module, args, out: calls.append(1) or out * 2)
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    p = plan_of(model, (x,), {}, budget_gb=1, solver="sqrt_n")
    calls.clear()
    assert_equivalent(reference, model, p.module, (x,), {})
    assert calls  # the hook ran on the planned module's calls


def test_eval_mode_warns_and_plans_eval_behaviour():
    model, args, kwargs = small()
    model.eval()
    reference = copy.deepcopy(model)
    before = model_state(model)
    with pytest.warns(UserWarning, match="eval mode"):
        p = plan_of(model, args, kwargs, budget_gb=1, solver="sqrt_n")
    assert_same_state(before, model_state(model))
    assert not p.module.training
    assert_equivalent(reference, model, p.module, args, kwargs)


def test_no_trainable_parameters_is_refused():
    model, args, kwargs = small()
    model.requires_grad_(False)
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    before = model_state(model)
    with pytest.raises(PlanningError, match="no parameter that requires grad, and no input"):
        plan_of(model, args, kwargs, budget_gb=1)
    assert_same_state(before, model_state(model))


def test_a_model_whose_output_needs_no_gradient_is_refused_as_a_planning_error():
    """Found trying the library: a detached output raised ``training_loss``'s ValueError,
    naming a ``FakeTensor`` (the profile's stand-in), not the PlanningError plan() promises."""

    class Detached(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x).detach() * 2

    with pytest.raises(PlanningError, match="nothing to differentiate") as error:
        planner.plan(Detached(), (torch.randn(3, 4),), budget_gb=1)
    assert "FakeTensor" not in str(error.value)


def test_a_frozen_model_differentiated_for_its_input_is_planned_exactly():
    """Adversarial examples, feature visualisation: no parameter trains, but the input's
    gradient needs the activations. Found trying the library: refused, saying that no
    gradients would be computed."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)))
    model.requires_grad_(False)
    x = torch.randn(16, 32, requires_grad=True)
    reference = copy.deepcopy(model)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n")
    assert p.segments
    assert_equivalent(reference, model, p.module, (x,), {})
    x.grad = None
    assert peak_memory(p.module, (x,)).peak_bytes == p.predicted_peak_bytes


def test_inputs_on_different_devices_are_refused():
    model, args, kwargs = small()
    kwargs = dict(kwargs, y=kwargs["y"].to("meta"))  # the meta device stands in for a GPU
    before = model_state(model)
    with pytest.raises(PlanningError, match="different devices"):
        plan_of(model, args, kwargs, budget_gb=1)
    assert_same_state(before, model_state(model))


def test_non_tensor_arguments_keep_their_names_and_are_checked():
    """Regression: symbolic_trace renamed ``flag`` to ``flag_1``, so planning a model called with
    ``flag=True`` failed, and a parameter left at its default (``y=None``) was traced as a
    tensor input."""
    model, args, kwargs = small()
    reference = copy.deepcopy(model)
    kwargs.pop("y")  # left at its default, None
    p = plan_of(model, args, kwargs, budget_gb=1, solver="sqrt_n")
    assert_equivalent(reference, model, p.module, args, kwargs)
    for changed in ({"flag": False}, {"scale": 3.0}, {"y": args[0]}):
        with pytest.raises(ValueError, match=r"specialized.*Plan with the value you train with"):
            p.module(*args, **{**kwargs, **changed})


def test_traced_plan_on_another_batch_size_is_exact():
    """A symbolically traced plan is shape-generic: it computes the same ops on other shapes."""
    model, args, kwargs = small()
    reference = copy.deepcopy(model)
    p = plan_of(model, args, kwargs, budget_gb=1, solver="sqrt_n")
    assert p.capture_method == "symbolic_trace" and p.segments
    other = (torch.randn(7, 8, requires_grad=True),)
    assert_equivalent(reference, model, p.module, other, dict(kwargs, y=torch.randn(7, 8)))


def test_exported_plan_on_another_shape_fails_clearly():
    model, args, kwargs = small(untraceable=True)
    p = plan_of(model, args, kwargs, budget_gb=1, solver="sqrt_n")
    assert p.capture_method == "export"
    x, y = torch.randn(7, 8, requires_grad=True), torch.randn(7, 8)  # as at planning, but 7
    assert (args[0].requires_grad, kwargs["y"].requires_grad) == (True, False)
    with pytest.raises(PlanningError, match=r"Guard failed.*Plan with dynamic_shapes=True"):
        p.module(x, **dict(kwargs, y=y))
    with pytest.raises(ValueError, match="captured with flag=True"):
        p.module(*args, **dict(kwargs, flag=False))


def test_lazy_modules_not_yet_called_are_refused_with_what_to_do():
    model = nn.Sequential(nn.LazyLinear(8), nn.LazyBatchNorm1d())
    with pytest.raises(PlanningError, match=r"lazy parameters not yet initialised \(0\.weight"):
        planner.plan(model, (torch.randn(4, 3),), budget_gb=1)
    model(torch.randn(4, 3))  # as the message says
    assert planner.plan(model, (torch.randn(4, 3),), budget_gb=1).module is not None


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x, y):
        return self.scale * x + y


@pytest.mark.parametrize(
    "example_inputs, example_kwargs, hint",
    [
        ([torch.ones(2), torch.ones(2)], None, r"one list, .* in a tuple, example_inputs=\(x, y\)"),
        ({"x": torch.ones(2), "y": torch.ones(2)}, None, "one dict: keyword arguments go in"),
        ((torch.ones(2),), {"z": torch.ones(2)}, "example_kwargs names z, which forward does"),
    ],
    ids=["a list", "a dict", "an unknown keyword"],
)
def test_example_inputs_that_do_not_bind_say_what_was_likely_meant(
    example_inputs, example_kwargs, hint
):
    with pytest.raises(PlanningError, match=f"missing a required argument: 'y' .*{hint}"):
        planner.plan(_TwoInputs(), example_inputs, budget_gb=1, example_kwargs=example_kwargs)


class _SumOverViews(nn.Module):
    """One body applied to each tensor of a list or dict (multi-crop views, pyramid levels):
    the loop over the argument is unrolled into the graph at capture (torch.export)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, views):
        items = views.values() if isinstance(views, dict) else views
        return sum(self.body(v) for v in items)


@pytest.mark.parametrize(
    "example, other, message",
    [
        ([0, 1], [0, 1, 2], "a list of 2 items; this call passes a list of 3 items"),
        ({"a": 0, "b": 1}, {"a": 0, "b": 1, "c": 2}, r"keys \['a', 'b'\]; .* \['a', 'b', 'c'\]"),
        ({"a": 0, "b": 1}, {"a": 0, "c": 1}, r"keys \['a', 'b'\]; .* keys \['a', 'c'\]"),
    ],
    ids=["a view more", "a key more", "a key renamed"],
)
def test_another_structure_of_a_list_or_dict_argument_is_refused(example, other, message):
    """The graph takes the example's tensors one by one: a third view would be left out of
    the sum (0.47 apart, silently, before this check)."""
    model = _SumOverViews()
    views = [torch.randn(4, 8) for _ in range(3)]

    def argument(structure):
        if isinstance(structure, dict):
            return {key: views[i] for key, i in structure.items()}
        return [views[i] for i in structure]

    p = planner.plan(model, (argument(example),), budget_gb=1)
    assert p.capture_method == "export"
    assert torch.equal(p.module(argument(example)), model(argument(example)))
    with pytest.raises(TypeError, match=f"captured with views holding .*{message}"):
        p.module(argument(other))


@pytest.mark.parametrize(
    "result",
    [None, "0,2", ((0.0, 2.0),), (0, 2), ((0, 1, 2),), ((True, 2),)],
    ids=["None", "str", "float bounds", "flat pair", "triple", "bool"],
)
def test_a_custom_solver_returning_no_segments_is_named(result):
    """Regression: these reached rewrite.py and raised a raw TypeError there."""
    model, args, kwargs = small()
    before = model_state(model)

    def my_solver(problem, budget_bytes):
        return result

    with pytest.raises(
        TypeError,
        match=r"solver 'my_solver' returned .*; a solver must return "
        r"a tuple of \(start, stop\) pairs of int positions",
    ):
        plan_of(model, args, kwargs, budget_gb=1, solver=my_solver)
    assert_same_state(before, model_state(model))


def test_a_custom_solver_returning_invalid_segments_is_named():
    model, args, kwargs = small()

    def my_solver(problem, budget_bytes):
        return ((0, 999),)

    with pytest.raises(
        ValueError,
        match=r"solver 'my_solver' returned an invalid plan: "
        r"segment \(0, 999\) is not valid",
    ):
        plan_of(model, args, kwargs, budget_gb=1, solver=my_solver)


def test_a_solver_plan_over_a_feasible_budget_does_not_ask_for_that_budget():
    """Regression: the message told the user to raise the budget "to at least" a budget no
    larger than the one given. It says what is true: the solver's plan needs more, and plans
    within the budget exist."""
    model, args, kwargs = small()
    _, problem = prepare(model, args, kwargs)
    lowest = lowest_peak(problem).peak_bytes
    with pytest.raises(PlanningError) as info:
        plan_of(model, args, kwargs, budget_bytes=lowest, solver=lambda p, b: ())
    message = str(info.value)
    baseline = simulate(problem, ()).peak_bytes
    assert f"({baseline} bytes), over the budget of" in message
    assert f"plans down to {lowest / 2**20:.1f} MiB ({lowest} bytes, the lowest peak" in message
    assert "solver='auto'" in message and "at least" not in message


@pytest.mark.parametrize(
    "example_kwargs",
    [[torch.randn(4, 8)], [("y", torch.randn(4, 8))], (), {1: 2.0}],
    ids=["list of tensors", "list of pairs", "empty tuple", "int key"],
)
def test_example_kwargs_must_be_a_dict_by_name(example_kwargs, monkeypatch):
    """Regression: a list of pairs planned the whole model, then failed in serialize.py."""
    model, args, _ = small()
    monkeypatch.setattr(planner.pipeline, "capture", None)  # refused before any capture
    with pytest.raises(TypeError, match="example_kwargs must be a dict of keyword arguments"):
        plan_of(model, args, example_kwargs, budget_gb=1)


# --------------------------------------------------------------------------------------------
# forwards taking tensors through *args / **kwargs, and torch.compile'd models


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, scale):
        x = x * scale
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class PassThrough(nn.Module):
    """The usual wrapper: ``forward(self, *args, **kwargs)`` calls the inner model."""

    def __init__(self):
        super().__init__()
        self.model = Inner()

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class KeywordTensors(Inner):
    """``scale`` reaches forward through ``**kwargs``."""

    def forward(self, x, **kwargs):
        return super().forward(x, kwargs["scale"])


X, SCALE = torch.randn(8, 16), torch.randn(16)


@pytest.mark.parametrize(
    "make, args, kwargs, match",
    [
        (PassThrough, (X, SCALE), {}, r"PassThrough.forward takes .* through \*args.*inner model"),
        (PassThrough, (X,), {"scale": SCALE}, r"through \*args"),
        (
            lambda: torch.compile(Inner(), backend="eager"),
            (X, SCALE),
            {},
            r"torch.compile'd module: plan the module it compiles \(planner.plan\(model._orig_mod",
        ),
    ],
    ids=["*args", "*args and **kwargs", "torch.compile"],
)
def test_tensors_passed_through_star_args_are_refused_with_what_to_plan(make, args, kwargs, match):
    """Found trying the library: the error blamed the inputs' shapes ('_guards_fn':
    'NoneType' object has no attribute 'size') or was a bare TypeError."""
    model = make()
    before = model_state(model)
    with pytest.raises(PlanningError, match=match):
        planner.plan(model, args, budget_gb=1, example_kwargs=kwargs)
    assert_same_state(before, model_state(model))


def test_tensors_passed_through_keyword_varargs_plan_exactly():
    """symbolic_trace makes one placeholder of ``**kwargs``, which failed in the profile;
    torch.export names each keyword."""
    torch.manual_seed(0)
    model = KeywordTensors()
    reference = copy.deepcopy(model)
    p = planner.plan(model, (X,), budget_gb=1, solver="sqrt_n", example_kwargs={"scale": SCALE})
    assert p.segments and p.capture_method == "export"
    assert_equivalent(reference, model, p.module, (X,), {"scale": SCALE})


@pytest.mark.parametrize("name", ["code", "graph", "meta"])
def test_a_top_level_child_named_like_a_graph_module_attribute_is_refused_by_name(name):
    """Found trying the library: the messages blamed the inputs ('str' object is not
    callable) or were fx's own. A child of that name deeper in the model plans."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    model.add_module(name, nn.Linear(8, 8))
    before = model_state(model)
    with pytest.raises(PlanningError, match=rf"'{name}' at its top level.*Rename it"):
        planner.plan(model, (torch.randn(4, 8),), budget_gb=1)
    assert_same_state(before, model_state(model))
    nested = nn.Sequential(model, nn.Linear(8, 8))
    reference = copy.deepcopy(nested)
    p = planner.plan(nested, (torch.randn(4, 8),), budget_gb=1, solver="sqrt_n")
    assert_equivalent(reference, nested, p.module, (torch.randn(4, 8),), {})


class CTCHead(nn.Module):
    """A speech head computing ``F.ctc_loss`` in forward, lengths as tensors (as Hugging Face's
    CTC heads pass them)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU())
        self.out = nn.Linear(16, 6)

    def forward(self, features, targets, input_lengths, target_lengths):
        log_probs = self.out(self.body(features)).log_softmax(-1).transpose(0, 1)
        return nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths)


def test_an_op_whose_result_sizes_fakes_cannot_give_is_named_without_blaming_the_inputs():
    """Found trying the library: CTC loss in forward got "check the example inputs' shapes and
    dtypes", which were fine (the model trains)."""
    model = CTCHead()
    args = (torch.randn(2, 12, 16), torch.randint(1, 6, (2, 4)), torch.full((2,), 12))
    args += (torch.full((2,), 4),)
    model(*args).backward()
    before = model_state(model)
    with pytest.raises(
        PlanningError, match=r"aten._ctc_loss.Tensor.*inputs are not at fault.*out of the planned"
    ):
        planner.plan(model, args, budget_gb=1)
    assert_same_state(before, model_state(model))


class MaskedTokens(nn.Module):
    """Replaces masked positions by a learned embedding, ``h[mask] = self.embedding`` (MAE,
    data2vec, Wav2Vec2 given ``mask_time_indices``): its backward gathers by the mask."""

    def __init__(self):
        super().__init__()
        self.embedding, self.body = nn.Parameter(torch.randn(16)), nn.Linear(16, 16)

    def forward(self, x, mask):
        h = x * 1.0
        h[mask] = self.embedding
        return self.body(h)


def test_a_backward_whose_sizes_fakes_cannot_give_is_named_with_what_computes_the_same():
    """Found trying the library: a raw ``DynamicOutputShapeException`` from the profile's
    backward, not a ``PlanningError``."""
    model, x, mask = MaskedTokens(), torch.randn(4, 10, 16), torch.rand(4, 10) < 0.3
    before = model_state(model)
    with pytest.raises(PlanningError, match=r"backward cannot be profiled.*torch\.where"):
        planner.plan(model, (x, mask), budget_gb=1)
    assert_same_state(before, model_state(model))


class ScaledTanh(nn.Module):
    """Writes over the output ``tanh`` saved for its backward: the model's own backward raises."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        t = self.a(x).tanh()
        t.mul_(2)
        return self.b(t)


def test_a_model_whose_own_backward_refuses_an_in_place_write_is_refused():
    """Found by review: autograd checks saved tensors' versions only without saved-tensor
    hooks, so checkpoint's recompute handed backward the rewritten tensor and a plan trained
    with ``a.weight``'s gradient off by 5.5 where the model itself raises."""
    model, x = ScaledTanh(), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        training_loss(model(x)).backward()
    model.zero_grad(set_to_none=True)
    before = model_state(model)
    with pytest.raises(PlanningError, match=r"own backward fails: node 'tanh'.*out of place"):
        planner.plan(model, (x,), budget_gb=1)
    assert_same_state(before, model_state(model))


def test_a_loss_fn_writing_over_what_it_saved_is_refused_by_name():
    """Found reading the change once more: the loss node is not in the graph, and looking
    for the writer after it raised a bare ValueError."""

    def scaled_tanh_loss(output):
        t = output.tanh()
        t.mul_(2)
        return t.sum()

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    message = r"own backward fails: node 'loss_fn'.*scaled_tanh_loss"
    with pytest.raises(PlanningError, match=message):
        planner.plan(model, (torch.randn(4, 8),), budget_gb=1, loss_fn=scaled_tanh_loss)


class RescaledBuffer(nn.Module):
    """Multiplies by a buffer it then assigns anew (``self.scale = ...``); the shape check
    sends it to ``torch.export``, whose graph writes the new value into the buffer."""

    def __init__(self, copy_it: bool):
        super().__init__()
        self.copy_it = copy_it
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        if x.shape[0] > 1:
            pass
        scale = self.scale.clone() if self.copy_it else self.scale
        h = torch.relu(self.a(x)) * scale
        self.scale = self.scale * 0.5 + 0.1
        return self.b(h)


def test_a_buffer_assigned_after_a_saver_read_it_is_refused_under_export_with_the_way_out():
    """Found by review: eager Python rebinds the name and trains; the exported graph copies
    the new value into the buffer ``mul`` saved, so the plan's backward raised (or, had ``mul``
    been recomputed, read the new value). The message blamed an in-place write the user never
    made; it now names the buffer and what works, which plans exactly."""
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    with pytest.raises(PlanningError, match=r"buffer 'scale', to which forward then assigns"):
        planner.plan(RescaledBuffer(copy_it=False), (x,), budget_gb=1)
    torch.manual_seed(0)
    model = RescaledBuffer(copy_it=True)
    reference = copy.deepcopy(model)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n")
    training_loss(p.module(x)).backward()
    training_loss(reference(x)).backward()
    assert torch.equal(model.a.weight.grad, reference.a.weight.grad)
    assert torch.equal(model.scale, reference.scale)


class LayerDrop(nn.Module):
    """Skips each layer in training when a random draw falls below ``layerdrop`` (drawing only
    when it is on, as Hugging Face's encoders do)."""

    def __init__(self, layerdrop: float):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.layerdrop = layerdrop

    def forward(self, x):
        for layer in self.layers:
            if self.training and self.layerdrop > 0 and torch.rand([]) < self.layerdrop:
                continue
            x = torch.tanh(layer(x))
        return x


def test_layerdrop_is_refused_with_the_option_to_turn_off():
    """Found trying the library (BART's ``encoder_layerdrop``): the message was torch.export's
    data-dependent guard and advice that did not apply."""
    model, x = LayerDrop(0.2), torch.randn(4, 8)
    before = model_state(model)
    with pytest.raises(PlanningError, match=r"uses LayerDrop \(the model.layerdrop\).*random draw"):
        planner.plan(model, (x,), budget_gb=1)
    assert_same_state(before, model_state(model))
    model.layerdrop = 0.0
    reference = copy.deepcopy(model)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n")
    assert_equivalent(reference, model, p.module, (x,), {})


class Slotted:
    __slots__ = ("width",)

    def __init__(self):
        self.width = 8


@pytest.mark.parametrize("config", [{"width": 8, 3: "x"}, Slotted()], ids=["dict", "slots"])
def test_a_config_that_is_not_a_hugging_face_one_plans(config):
    """The LayerDrop check reads ``model.config``'s fields: a dict or a slotted object there
    (common outside Hugging Face) crashed planning with ``vars()``'s TypeError (found trying
    the library)."""
    model, x = LayerDrop(0.0), torch.randn(4, 8)
    model.config = config
    reference = copy.deepcopy(model)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n")
    assert_equivalent(reference, model, p.module, (x,), {})


def test_layerdrop_in_a_dict_config_is_refused_too():
    model, x = LayerDrop(0.0), torch.randn(4, 8)
    model.config = {"layerdrop": 0.1}
    with pytest.raises(PlanningError, match=r"config.layerdrop=0.1"):
        planner.plan(model, (x,), budget_gb=1)


def test_hugging_face_layerdrop_names_the_config_options():
    transformers = pytest.importorskip("transformers")
    from hf_families import _bart_config

    config = _bart_config()
    config.encoder_layerdrop = config.decoder_layerdrop = 0.3
    model = transformers.BartForConditionalGeneration(config).train()
    ids = torch.randint(3, 64, (2, 8))
    with pytest.raises(
        PlanningError,
        match=r"config.encoder_layerdrop=0.3, config.decoder_layerdrop=0.3.*"
        r"config.encoder_layerdrop = 0.0; config.decoder_layerdrop = 0.0; "
        r"model.encoder.layerdrop = 0.0",
    ):
        planner.plan(model, (ids,), budget_gb=1, example_kwargs={"labels": ids})


class PackedRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=False
        )
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return out


def test_a_model_that_packs_sequences_is_refused_with_what_to_do():
    """Found trying the library: the refusal named only the tracers' errors (a FakeTensor
    size, ``__cuda_array_interface__``) and Hugging Face's ``use_cache``."""
    model = PackedRNN()
    x, lengths = torch.randn(4, 6, 8), torch.tensor([6, 3, 5, 2])
    before = model_state(model)
    with pytest.raises(PlanningError, match=r"PackedRNN packs sequences.*values of the lengths"):
        planner.plan(model, (x, lengths), budget_gb=1)
    assert_same_state(before, model_state(model))


def test_a_forward_hook_that_reads_a_number_is_named_when_forward_cannot_be_profiled():
    """A monitoring hook on a leaf module logging an activation's mean with ``.item()``: the
    message named the module's node and advised moving a computation out of forward (found
    trying the library)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    means = []
    model[2].register_forward_hook(lambda m, i, o: means.append(o.mean().item()))
    with pytest.raises(planner.PlanningError, match=r"'2' has forward hooks.*after planning"):
        planner.plan(model, (torch.randn(4, 16),), budget_gb=1)
    assert means == []


def test_a_backward_hook_that_reads_a_number_is_named_when_backward_cannot_be_profiled():
    """A module's backward hook logging a gradient's norm with ``.item()``, registered before
    planning: the message pointed at a boolean-mask assignment in forward (found trying the
    library)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    norms = []
    model[2].register_full_backward_hook(lambda m, gi, go: norms.append(go[0].norm().item()))
    with pytest.raises(planner.PlanningError, match=r"\.item\(\).*backward hook.*after planning"):
        planner.plan(model, (torch.randn(4, 16),), budget_gb=1)


class CausalEncoder(nn.Module):
    """torch's own encoder given a causal mask, told it is causal or not."""

    def __init__(self, is_causal):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.is_causal = is_causal

    def forward(self, x, mask):
        return self.encoder(x, mask=mask, is_causal=self.is_causal)


def test_torchs_transformer_given_a_causal_mask_is_told_to_say_it_is_causal():
    """Found by a tester: torch reads the mask's values to check that it is causal, and the
    capture error's advice was generic."""
    x, mask = torch.randn(2, 5, 16), nn.Transformer.generate_square_subsequent_mask(5)
    with pytest.raises(PlanningError, match=r"What to try: .*pass is_causal=True"):
        plan_of(CausalEncoder(None), (x, mask), {}, budget_gb=1)
    torch.manual_seed(0)
    model = CausalEncoder(True)
    reference = copy.deepcopy(model)
    p = plan_of(model, (x, mask), {}, budget_gb=1)
    assert_equivalent(reference, model, p.module, (x, mask), {})


@pytest.mark.parametrize("where", ["the model", "a submodule"])
def test_a_torchscript_model_or_submodule_is_refused_with_what_to_do(where):
    """Found by a tester: a scripted model failed with a bare ``KeyError: '0'``, a model
    holding a scripted submodule with advice about the example inputs' shapes."""
    inner = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    model = inner if where == "the model" else nn.Sequential(inner, nn.Linear(8, 8))
    with pytest.raises(PlanningError, match=r"TorchScript.*Plan the nn\.Module before scripting"):
        planner.plan(model, (torch.randn(4, 8),), budget_gb=1)
