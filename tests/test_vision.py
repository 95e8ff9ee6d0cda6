"""torchvision and timm models as users build them (random weights, train mode, BatchNorm and
dropout on), planned at a budget halfway between their lowest peak and their baseline, with the
default loss and with labels (a cross-entropy ``loss_fn``):

* the plan fits: the measured peak is within the budget and within 5% of the prediction;
* one step equals the model's exactly (outputs of the same type, ``OrderedDict`` included,
  loss, gradients, BatchNorm statistics, RNG state, ``state_dict``);
* a second shape works: 48 px images (batch 1 at 64 px where the image size is part of the
  model) train within the budget, equal to the model.

ResNet-18 with labels runs in the default suite; the whole matrix under ``-m models``. The
torchvision operator shim is in ``tests/vision_models.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from planner.pipeline import assemble, prepare
from planner.simulate import simulate
from planner.solvers.auto import choose, lowest_peak
from planner.step import peak_memory
from strategies import assert_equivalent
from vision_models import MODELS

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning:torchvision")]

FIXED_SIZE = {"vit_b_16", "timm_vit_tiny", "timm_deit_tiny", "timm_swin"}  # position tables
CASES = [
    pytest.param(
        name, labels, marks=[] if (name, labels) == ("resnet18", True) else [pytest.mark.models]
    )
    for name in MODELS
    for labels in (False, True)
]


def labels_loss(args):
    """Cross-entropy against fixed random labels: per image, or per pixel for segmentation
    models (their output is an ``OrderedDict`` with ``"out"``)."""
    generator = torch.Generator().manual_seed(1)

    def loss_fn(output):
        logits = output["out"] if isinstance(output, dict) else output
        shape = (logits.shape[0], *logits.shape[2:])
        labels = torch.randint(0, logits.shape[1], shape, generator=generator.manual_seed(1))
        return F.cross_entropy(logits, labels)

    return loss_fn


def plan_halfway(model, args, loss_fn):
    """A plan at the budget halfway between the lowest peak and the baseline, and whether
    any plan lowers the peak at all."""
    captured, problem = prepare(model, args, loss_fn=loss_fn)
    low, high = lowest_peak(problem).peak_bytes, simulate(problem, ()).peak_bytes
    name, segments = choose(problem, (low + high) // 2, "auto")
    return low < high, assemble(
        model, captured, problem, segments, solver=name, budget_bytes=(low + high) // 2,
        solve_seconds=0.0, started=0.0,
    )  # fmt: skip


@pytest.mark.parametrize(("name", "labels"), CASES)
def test_vision_plans_fit_and_train_like_the_model(name, labels):
    model, args, _ = MODELS[name]()
    loss_fn = labels_loss(args) if labels else None
    lowers, p = plan_halfway(model, args, loss_fn)
    assert p.segments or not lowers  # (the ViTs at 64 px: no plan lowers their peak)
    measured = peak_memory(p.module, args, loss_fn=loss_fn).peak_bytes
    assert measured <= p.budget_bytes
    assert abs(measured - p.predicted_peak_bytes) <= 0.05 * measured
    # a measured step updated BatchNorm statistics: compare with a copy of the model as it is now
    assert_equivalent(copy.deepcopy(model), model, p.module, args, {}, loss_fn=loss_fn)
    # a second shape
    second = {"batch": 1} if name in FIXED_SIZE else {"size": 48}
    _, other_args, _ = MODELS[name](**second)
    measured = peak_memory(p.module, other_args, loss_fn=loss_fn).peak_bytes
    assert measured <= p.budget_bytes
    assert_equivalent(copy.deepcopy(model), model, p.module, other_args, {}, loss_fn=loss_fn)
