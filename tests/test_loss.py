"""The user's loss in the plan: ``planner.plan(..., loss_fn=...)``.

A budget is the memory of the step the user runs: forward, *their* loss, backward. A loss holds
memory of its own (cross-entropy over a vocabulary keeps a log-softmax as large as the logits,
then allocates the logits' gradient), so the profile records it as one more node after the
graph's last, and the simulator replays it. Each property compares the plan with one real step
of the same loss: outputs and gradients exactly equal the unplanned model's, the measured peak
(CPU live-storage tracker) fits the budget and matches the prediction.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import planner
from planner.errors import PlanningError
from planner.pipeline import assemble, prepare
from planner.simulate import simulate
from planner.solvers.auto import lowest_peak
from planner.step import peak_memory, training_loss
from strategies import assert_equivalent, build, inputs, model_specs

EXAMPLES = max(4, settings.default.max_examples // 3)
# A loss that is a node of the graph (a loss_fn, or a model returning its loss) is predicted
# 4 bytes over the measured step (safe; not looked into), everything else to the byte.
LOSS_NODE_OVER = 4


def _main_output(out) -> torch.Tensor:
    if isinstance(out, dict):
        return out["out"]
    return out[0] if isinstance(out, tuple) else out


def make_loss(kind: str, out: torch.Tensor, seed: int = 0):
    """A loss of one of the kinds users write, for outputs shaped like ``out``: the labels of
    cross-entropy are drawn at random and closed over."""
    if kind == "sum":
        return training_loss  # the default's loss, given explicitly: its scalars are planned too
    if kind == "mean_of_squares":
        return lambda output: _main_output(output).float().pow(2).mean()
    generator = torch.Generator().manual_seed(seed)
    classes = out.shape[1]
    labels = torch.randint(0, classes, (out.shape[0], *out.shape[2:]), generator=generator)
    return lambda output: F.cross_entropy(_main_output(output), labels)


LOSSES = st.sampled_from(["sum", "mean_of_squares", "cross_entropy"])


def _planned(spec, kind, fraction):
    """(model, untouched copy, args, kwargs, loss_fn, budget, plan) for a generated model."""
    model = build(spec)
    args, kwargs = inputs(spec)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        loss_fn = make_loss(kind, _main_output(copy.deepcopy(model)(*args, **kwargs)), spec.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _, problem = prepare(model, args, kwargs, loss_fn=loss_fn)
        low, high = lowest_peak(problem).peak_bytes, simulate(problem, ()).peak_bytes
        budget = int(low + fraction * (high - low))
        p = planner.plan(model, args, budget_bytes=budget, example_kwargs=kwargs, loss_fn=loss_fn)
    return model, reference, args, kwargs, loss_fn, budget, p


@settings(max_examples=EXAMPLES)
@given(spec=model_specs(untraceable=None, max_ops=8), kind=LOSSES, fraction=st.floats(0, 1))
def test_planned_step_with_the_users_loss_trains_exactly_like_the_original(spec, kind, fraction):
    model, reference, args, kwargs, loss_fn, _, p = _planned(spec, kind, fraction)
    assert_equivalent(reference, model, p.module, args, kwargs, seed=spec.seed, loss_fn=loss_fn)


@settings(max_examples=EXAMPLES)
@given(
    spec=model_specs(untraceable=None, max_ops=8, kinds=("dense",)),
    kind=LOSSES,
    fraction=st.floats(0, 1),
)
def test_measured_step_with_the_users_loss_fits_and_matches_the_prediction(spec, kind, fraction):
    """Memory the step adds to what was live before it (parameters the graph never reads are
    live too, but no plan changes them: they are left out on both sides), at a batch large
    enough that activations, not a few scalars of bookkeeping, make the peak. One output: the
    fake backward over-predicts (never under) when two outputs' gradients meet in one tensor."""
    spec = dataclasses.replace(spec, batch=256, output="tensor")
    _, _, args, kwargs, loss_fn, budget, p = _planned(spec, kind, fraction)
    step = peak_memory(p.module, args, kwargs, loss_fn=loss_fn).activation_peak_bytes
    fixed = p.problem.fixed_bytes
    assert step <= budget - fixed
    assert math.isclose(p.predicted_peak_bytes - fixed, step, rel_tol=0.05)


@pytest.mark.parametrize("segments", [((0, 3),), ((1, 2),), ((0, 9),), ((0, 3), (3, 6), (6, 9))])
def test_the_copies_of_batchnorm_statistics_a_segment_keeps_are_predicted_to_the_byte(segments):
    """A checkpointed segment copies the buffers it may update when its forward starts, and
    again when its recompute starts, to recompute from the first and leave the second; both
    copies go when the recompute ends. Small (520 bytes per BatchNorm of width 64), but a step
    whose peak is its recompute holds them."""
    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Tanh())]
    model, args = nn.Sequential(*layers), (torch.randn(256, 64),)
    captured, problem = prepare(model, args)
    assert problem.buffer_copy_bytes(0, 9) == 3 * (2 * 64 * 4 + 8)  # mean, var, batches seen
    p = assemble(
        model,
        captured,
        problem,
        segments,
        solver="test",
        budget_bytes=0,
        solve_seconds=0,
        started=0,
    )
    measured = peak_memory(p.module, args)
    assert p.predicted_peak_bytes <= measured.peak_bytes <= p.predicted_peak_bytes


def _gpt_with_cross_entropy(vocab=2048):
    model, (idx,) = planner.zoo.gpt(layers=2, vocab=vocab, with_loss=False)
    labels = torch.randint(0, vocab, idx.shape, generator=torch.Generator().manual_seed(1))
    return model, (idx,), lambda logits: F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_cross_entropy_over_a_vocabulary_is_predicted_to_the_byte():
    """The log-softmax and the logits' gradient are as large as the logits: without the loss
    in the plan the prediction is far too low; with it, it matches the step."""
    model, args, loss_fn = _gpt_with_cross_entropy()
    measured = peak_memory(model, args, loss_fn=loss_fn).peak_bytes
    _, without = prepare(model, args)
    _, problem = prepare(model, args, loss_fn=loss_fn)
    assert simulate(without, ()).peak_bytes < 0.8 * measured
    assert 0 <= simulate(problem, ()).peak_bytes - measured <= LOSS_NODE_OVER
    assert problem.has_loss and problem.names[-1] == "loss_fn"
    assert not problem.checkpointable[-1]


def test_a_plan_with_the_loss_fits_a_budget_the_loss_would_break():
    """Planned without the loss, the step goes over the budget, and planning says so (found
    trying the library: a cross-entropy over logits went 99.8% over without a word)."""
    model, args, loss_fn = _gpt_with_cross_entropy()
    _, problem = prepare(model, args, loss_fn=loss_fn)
    budget = (lowest_peak(problem).peak_bytes + simulate(problem, ()).peak_bytes) // 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = planner.plan(model, args, budget_bytes=budget, loss_fn=loss_fn)
    assert peak_memory(p.module, args, loss_fn=loss_fn).peak_bytes <= budget
    with pytest.warns(UserWarning, match=r"no 0-dim loss, and no loss_fn=.*Pass that loss as"):
        blind = planner.plan(model, args, budget_bytes=budget)  # planned for the sum of outputs
    assert peak_memory(blind.module, args, loss_fn=loss_fn).peak_bytes > budget


def test_outputs_too_small_for_their_loss_to_matter_plan_without_a_warning():
    """A classifier's few logits: a loss over them is far below the budget's 1%."""
    model, args = planner.zoo.mlp_chain(depth=4, width=32, batch=16)
    assert model(*args).dim() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planner.plan(model, args, budget_gb=1)


def test_a_loss_reading_a_value_says_to_compute_metrics_outside_loss_fn():
    """Found trying the library: ``.item()`` in loss_fn failed with fake tensors' own
    exception (``DataDependentOutputException: aten._local_scalar_dense``)."""
    model, args = planner.zoo.mlp_chain(depth=2, width=8)

    def loss_fn(out):
        print(out.mean().item())  # a metric, read in the loss
        return out.pow(2).mean()

    with pytest.raises(PlanningError, match=r"reads a tensor's value.*outside loss_fn"):
        planner.plan(model, args, budget_gb=1, loss_fn=loss_fn)


LABELS = torch.tensor([0, 3, -100, 5, 1, -100, 2, 7])
CLASSES = torch.tensor([0, 3, 4, 5, 1, 6, 2, 7])
LOSSES_SIZED_BY_VALUES = {
    "a one-hot target": (
        lambda out: -(F.log_softmax(out, -1) * F.one_hot(CLASSES, 8)).sum(-1).mean(),
        r"F\.one_hot\(labels, n\) checks.*clamp\(min=0\)",
    ),
    "positions left out by a mask": (
        lambda out: F.cross_entropy(out[LABELS != -100], LABELS[LABELS != -100]),
        r"boolean mask.*ignore_index=-100",
    ),
}


@pytest.mark.parametrize("form", LOSSES_SIZED_BY_VALUES)
def test_a_loss_fake_tensors_cannot_run_says_what_to_write_instead(form):
    """Found by a tester: a masked-language-model loss and a one-hot target were refused with
    fake tensors' own exception and no way out, or advice about metrics."""
    model, args = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), (torch.randn(8, 8),)
    loss_fn, advice = LOSSES_SIZED_BY_VALUES[form]
    with pytest.raises(PlanningError, match=advice):
        planner.plan(model, args, budget_gb=1, loss_fn=loss_fn)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_planning_with_a_loss_under_no_grad_names_the_grad_mode(mode):
    """Found by a tester: planned inside a ``@torch.no_grad()`` setup function, the loss was
    told to reduce itself to a scalar, which it was."""
    model, args = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), (torch.randn(8, 8),)
    with mode(), pytest.raises(PlanningError, match=r"under torch\.no_grad\(\).*enable_grad"):
        planner.plan(model, args, budget_gb=1, loss_fn=lambda out: out.pow(2).mean())


def test_planning_on_the_meta_device_counts_the_loss_the_same():
    """Labels closed over by the loss are replaced by stand-ins, on fake and meta tensors."""
    model, args, loss_fn = _gpt_with_cross_entropy()
    _, problem = prepare(model, args, loss_fn=loss_fn)
    meta_model, (meta_idx,) = planner.zoo.gpt(layers=2, vocab=2048, with_loss=False, device="meta")
    labels = torch.zeros(meta_idx.shape, dtype=torch.long)  # on the CPU: made meta too
    meta_loss = lambda logits: F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # noqa: E731
    _, meta_problem = prepare(meta_model, (meta_idx,), loss_fn=meta_loss)
    assert simulate(meta_problem, ()).peak_bytes == simulate(problem, ()).peak_bytes


def test_a_model_that_returns_its_own_loss_needs_no_loss_fn():
    model, args = planner.zoo.gpt(layers=2)  # forward(idx, targets) returns the loss
    p = planner.plan(model, args, budget_gb=1)
    measured = peak_memory(p.module, args).peak_bytes
    assert 0 <= p.predicted_peak_bytes - measured <= LOSS_NODE_OVER


def test_loss_fn_must_be_callable():
    model, args = planner.zoo.mlp_chain(depth=2, width=8)
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        planner.plan(model, args, budget_gb=1, loss_fn="cross_entropy")


def test_a_loss_that_is_not_a_scalar_is_refused_with_what_to_do():
    model, args = planner.zoo.mlp_chain(depth=2, width=8)
    with pytest.raises(PlanningError, match=r"0-dim .* got a tensor of shape \(.*\).*\.mean\(\)"):
        planner.plan(model, args, budget_gb=1, loss_fn=lambda out: out.pow(2))


def test_a_loss_that_fails_names_loss_fn_and_leaves_the_labels_alone():
    model, args = planner.zoo.mlp_chain(depth=2, width=8)
    labels = torch.tensor([0, 1])  # the wrong batch size
    with pytest.raises(PlanningError, match="loss_fn failed on the model's output"):
        planner.plan(model, args, budget_gb=1, loss_fn=lambda out: F.cross_entropy(out, labels))
    assert type(labels) is torch.Tensor and labels.tolist() == [0, 1]


@pytest.mark.parametrize("mid_training", [False, True])
def test_a_loss_reading_the_models_parameters_leaves_their_gradients_alone(mid_training):
    """An L2 penalty written in the loss reads the model's own parameters, and a learnable loss
    weight is the user's tensor too: planning leaves their ``.grad`` as it found them (None,
    or the gradients of a step in progress), and the planned step trains exactly."""
    model, args = planner.zoo.mlp_chain(depth=4, width=32, batch=16)
    reference = copy.deepcopy(model)
    weight = torch.zeros((), requires_grad=True)

    def loss_fn_of(net):
        penalty = sum(p.pow(2).sum() for p in net.parameters())
        return lambda out: out.pow(2).mean() * weight.exp() + 1e-3 * penalty

    if mid_training:
        for net in (model, reference):
            loss_fn_of(net)(net(*args)).backward()
    grads = [p.grad for p in (*model.parameters(), weight)]
    p = planner.plan(model, args, budget_gb=1, loss_fn=loss_fn_of(model))
    assert all(a is b for a, b in zip([p.grad for p in (*model.parameters(), weight)], grads))
    loss_fn_of(model)(p.module(*args)).backward()
    loss_fn_of(reference)(reference(*args)).backward()
    for planned, original in zip(model.parameters(), reference.parameters()):
        assert torch.equal(planned.grad, original.grad)


def test_a_saved_plan_is_loaded_with_its_loss(tmp_path):
    model, args, loss_fn = _gpt_with_cross_entropy()
    _, problem = prepare(model, args, loss_fn=loss_fn)
    budget = (lowest_peak(problem).peak_bytes + simulate(problem, ()).peak_bytes) // 2
    p = planner.plan(model, args, budget_bytes=budget, loss_fn=loss_fn)
    path = p.save(tmp_path / "plan.json", args)
    with pytest.raises(PlanningError, match="made with a loss_fn"):
        planner.load(path, model)
    loaded = planner.load(path, model, loss_fn=loss_fn)
    assert loaded.segments == p.segments
    assert loaded.predicted_peak_bytes == p.predicted_peak_bytes


def test_frontier_and_plan_batch_take_the_loss():
    model, args, loss_fn = _gpt_with_cross_entropy()
    f = planner.frontier(model, args, points=2, loss_fn=loss_fn)
    _, problem = prepare(model, args, loss_fn=loss_fn)
    assert f.baseline_peak_bytes == simulate(problem, ()).peak_bytes

    def make_inputs(batch):
        return planner.zoo.gpt(layers=2, vocab=2048, with_loss=False, batch=batch)[1]

    def make_loss_fn(batch):
        labels = torch.zeros(batch, 64, dtype=torch.long)
        return lambda logits: F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    choice = planner.plan_batch(
        model,
        make_inputs,
        budget_bytes=f.baseline_peak_bytes,
        global_batch=4,
        micro_batches=[4],
        make_loss_fn=make_loss_fn,
    )
    assert choice.predicted_peak_bytes == f.baseline_peak_bytes


# The CPU kernels of these losses compute the elementwise loss and return the reduced value on
# its storage, which the step holds to its end: one input's size more than the fake kernels'
# single element (a plan measured 256 KiB over its prediction with F.mse_loss).
ELEMENTWISE_STORAGE_LOSSES = {
    "mse_loss": lambda out, target: F.mse_loss(out, target),
    "smooth_l1_loss": lambda out, target: F.smooth_l1_loss(out, target, reduction="sum"),
    "binary_cross_entropy": lambda out, t: F.binary_cross_entropy(out.sigmoid(), t.sigmoid()),
    "soft_margin_loss": lambda out, target: F.soft_margin_loss(out, target.sign()),
}


def _denoiser() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.SiLU()) for _ in range(4)]
    return nn.Sequential(*blocks)


class _LossInForward(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.net, self.loss = _denoiser(), loss

    def forward(self, x, target):
        return self.loss(self.net(x), target)


def _at_lowest_budget(model, args, loss_fn=None):
    """(budget, plan) at the lowest budget the planner accepts for this step."""
    _, problem = prepare(model, args, loss_fn=loss_fn)
    budget = lowest_peak(problem).peak_bytes
    return budget, planner.plan(model, args, budget_bytes=budget, loss_fn=loss_fn)


@pytest.mark.parametrize("name", sorted(ELEMENTWISE_STORAGE_LOSSES))
def test_a_loss_reduced_on_its_elementwise_storage_is_predicted_in_loss_fn(name):
    x, target = torch.randn(4, 8, 16, 16), torch.randn(4, 8, 16, 16)
    model, loss = _denoiser(), ELEMENTWISE_STORAGE_LOSSES[name]
    loss_fn = lambda out: loss(out, target)  # noqa: E731
    budget, p = _at_lowest_budget(model, (x,), loss_fn)
    measured = peak_memory(p.module, (x,), loss_fn=loss_fn).peak_bytes
    assert p.predicted_peak_bytes <= measured <= p.predicted_peak_bytes
    assert measured <= budget


@pytest.mark.parametrize("name", sorted(ELEMENTWISE_STORAGE_LOSSES))
def test_a_loss_reduced_on_its_elementwise_storage_is_predicted_in_forward(name):
    args = (torch.randn(4, 8, 16, 16), torch.randn(4, 8, 16, 16))
    model = _LossInForward(ELEMENTWISE_STORAGE_LOSSES[name])
    budget, p = _at_lowest_budget(model, args)
    measured = peak_memory(p.module, args).peak_bytes
    assert p.predicted_peak_bytes <= measured <= p.predicted_peak_bytes
    assert measured <= budget
