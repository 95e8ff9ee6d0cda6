"""Rewrite edge cases found by testers: each test states what a plan must do.

* A segment is emitted where its first compute node stands; the nodes it reads must exist
  there, even those the graph lists later (a parameter's ``get_attr``).
* Tensor constants torch.export makes inside a submodule's forward belong to the graph, not to
  the model: plans read them without adding them to the model or to its ``state_dict``.
* A parameter changed in place between a forward and its backward is refused by the planned
  module as by the model (autograd), never recomputed from into a wrong gradient; buffers the
  forward itself updates (BatchNorm statistics) and ordinary training steps are not refused.
"""

from __future__ import annotations

import copy
import gc
import itertools

import pytest
import torch
from torch import nn

import planner
from planner.nested import nested_choice
from planner.pipeline import prepare
from planner.rewrite import rewrite


def _valid_segments(problem) -> list[tuple[int, int]]:
    return [
        (a, b)
        for a, b in itertools.combinations(range(problem.size + 1), 2)
        if problem.is_valid_segment(a, b)
    ]


def _step(module, args) -> list[torch.Tensor]:
    """The output and every parameter's gradient after one forward and backward of ``module``."""
    for p in module.parameters():
        p.grad = None
    output = module(*args)
    output.square().mean().backward()
    return [output.detach()] + [p.grad for p in module.parameters()]


def _assert_same_step(reference, planned, args) -> None:
    expected, actual = _step(reference, args), _step(planned, args)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))


# -- a parameter read after the segment's first node ---------------------------------------------


class PositionTable(nn.Module):
    """The GPT layout ``emb(ids) + pos[:n]``: fx lists the ``get_attr`` of ``pos`` after the
    embedding, so a segment starting at the embedding reads a node the graph lists later.
    ``n`` is the input's length (sliced by a computed size) or a constant (a plain item)."""

    def __init__(self, length_from_input: bool):
        super().__init__()
        self.length_from_input = length_from_input
        self.emb = nn.Embedding(11, 8)
        self.pos = nn.Parameter(torch.randn(6, 8))
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.shape[1] if self.length_from_input else 6]
        return self.head(torch.tanh(x))


def _position_table(length_from_input: bool):
    torch.manual_seed(0)
    model = PositionTable(length_from_input).train()
    ids = torch.randint(0, 11, (3, 6))
    captured, problem = prepare(model, (ids,))
    order = [n.name for n in captured.graph_module.graph.nodes]
    assert order.index("pos") > order.index("emb"), "the layout this test is about"
    return model, (ids,), captured, _valid_segments(problem)


@pytest.mark.parametrize("length_from_input", [True, False], ids=["pos[:len]", "pos[:6]"])
def test_a_parameter_listed_after_a_segments_first_node_is_read_at_every_segment(
    length_from_input,
):
    model, args, captured, segments = _position_table(length_from_input)
    for segment in segments:
        _assert_same_step(model, rewrite(captured.graph_module, model, [segment]), args)


@pytest.mark.parametrize("length_from_input", [True, False], ids=["pos[:len]", "pos[:6]"])
def test_so_is_it_by_a_segment_inside_another(length_from_input):
    model, args, captured, segments = _position_table(length_from_input)
    for (a, b), (c, d) in itertools.product(segments, segments):
        if a <= c < d <= b and (c, d) != (a, b):
            choice = nested_choice([(a, b, [(c, d)])])
            _assert_same_step(model, rewrite(captured.graph_module, model, choice), args)


# -- tensor constants made inside a submodule's forward (torch.export) ---------------------------


class Masked(nn.Module):
    """``h[h < 0] = 0``, which export lifts the 0 it writes from; the branch on a size is what
    symbolic_trace cannot trace."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if x.size(0) > 0:
            h[h < 0] = 0
        return h


class Doubled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) * torch.tensor(2.0)


def _with_constants():
    torch.manual_seed(0)
    return nn.Sequential(Masked(), Doubled(), Masked()).train(), (torch.randn(5, 8),)


def test_constants_made_in_a_submodules_forward_are_read_at_every_segment():
    model, args = _with_constants()
    captured, problem = prepare(model, args)
    assert captured.method == "export"
    for segment in _valid_segments(problem):
        _assert_same_step(
            model, rewrite(captured.graph_module, model, [segment], problem=problem), args
        )


def _longest_segment(problem, budget_bytes):
    return [max(_valid_segments(problem), key=lambda segment: segment[1] - segment[0])]


def test_a_plan_with_such_constants_leaves_the_model_and_its_state_dict_alone():
    model, args = _with_constants()
    keys = list(model.state_dict())
    plan = planner.plan(model, args, budget_gb=1, solver=_longest_segment)
    _assert_same_step(model, plan.module, args)
    assert list(plan.module.state_dict()) == list(model.state_dict()) == keys
    assert not any("lifted" in name for m in model.modules() for name in vars(m))


def test_the_planned_module_lists_the_models_buffers_first_in_the_models_order():
    """Found by a tester: the graph's constants came first in ``p.module.buffers()``, so an
    ``AveragedModel(model, use_buffers=True)`` updated from the planned module averaged each
    running statistic into the place of another, silently."""
    model, args = _with_constants()
    for block in model:
        block.register_buffer("seen", torch.zeros(8))
    plan = planner.plan(model, args, budget_gb=1, solver=_longest_segment)
    planned = list(plan.module.named_buffers())
    own = list(model.named_buffers())
    assert len(planned) > len(own)  # the constants, after the model's own
    assert [(n, id(b)) for n, b in planned[: len(own)]] == [(n, id(b)) for n, b in own]
    ema = torch.optim.swa_utils.AveragedModel(model, use_buffers=True)
    for block in model:
        block.seen.fill_(float(len(block.seen)))
    ema.update_parameters(plan.module)
    for (name, averaged), (_, buffer) in zip(ema.module.named_buffers(), own):
        assert torch.equal(averaged, buffer), name


# -- parameters changed between the forward and the backward -------------------------------------


def _mlp(*norm):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), *norm, nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)]
    return nn.Sequential(*layers).train(), (torch.randn(32, 8),)


@pytest.mark.parametrize(
    "segments", [[(0, 5)], [(0, 5, [(2, 3)])]], ids=["one segment", "inside an inner segment"]
)
def test_a_parameter_stepped_before_backward_is_refused_as_the_model_refuses_it(segments):
    model, args = _mlp()
    captured, problem = prepare(model, args)
    assert problem.size == 5, "Linear, Tanh, Linear, Tanh, Linear"
    planned = rewrite(captured.graph_module, model, nested_choice(segments), problem=problem)
    for module, refusal in (
        (model, "modified by an inplace operation"),
        (planned, "parameter '2.weight' was modified in place"),
    ):
        model.zero_grad()
        loss = module(*args).square().mean()
        with torch.no_grad():
            model[2].weight.add_(0.1)  # optimizer.step() on the second layer, before backward
        with pytest.raises(RuntimeError, match=refusal):
            loss.backward()


def test_training_steps_with_batchnorm_stay_exact_and_are_not_refused():
    """optimizer.step() after backward, BatchNorm updating its statistics in every forward."""
    model, args = _mlp(nn.BatchNorm1d(16))
    reference = copy.deepcopy(model)
    plan = planner.plan(model, args, budget_gb=1, solver=lambda problem, budget: [(0, 6)])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for _ in range(3):
        for module, optimizer in zip((reference, plan.module), optimizers):
            optimizer.zero_grad()
            module(*args).square().mean().backward()
            optimizer.step()
        assert all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), reference.state_dict().values())
        )
    assert model[1].num_batches_tracked == 3


# -- how the planned module is built --------------------------------------------------------------


def test_the_planned_module_runs_its_finished_graph_and_the_collector_is_back_on():
    """The rewrite compiles the planned graph once (in its constructor) with the garbage
    collector paused: the code it runs is the finished graph's, and the collector is on again."""
    model, args = _mlp()
    captured, _ = prepare(model, args)
    assert gc.isenabled()
    planned = rewrite(captured.graph_module, model, [(0, 2), (2, 5)])
    assert gc.isenabled()
    assert planned.code == planned.graph.python_code("self").src
    _assert_same_step(copy.deepcopy(model), planned, args)
