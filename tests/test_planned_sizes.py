"""Specification: a plan's budget holds up to the sizes it was planned at, and a larger call
says so once, whichever way the model was captured.

Found trying the library: a ``symbolic_trace`` plan of the zoo GPT planned at batch 4 and
called at batch 16 measured 3.4 times its budget without a word, while a ``torch.export`` plan
with ``dynamic_shapes=True`` warned.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import planner
from planner import zoo
from planner.step import peak_memory


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
        )

    def forward(self, x, extra=None):
        h = self.blocks(x)
        return h if extra is None else torch.cat([h, extra])


class ChainExported(Chain):
    """The same model with a forward symbolic_trace rejects (an ``if`` on a size)."""

    def forward(self, x, extra=None):
        h = super().forward(x, extra)
        return h * 2.0 if x.shape[0] > 1 else h


def planned(model, x, capture, **kwargs):
    p = planner.plan(model, (x,), budget_bytes=10**9, solver="sqrt_n", **kwargs)
    assert p.segments, "the test needs checkpointed segments"
    assert p.capture_method.startswith(capture)
    return p.module


def call(module, *args, **kwargs) -> list[str]:
    """The messages of the warnings that a training step of ``module(*args, **kwargs)`` raises
    (it ends as ``zero_grad()`` does: gradients held into the next step would warn too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module(*args, **kwargs).sum().backward()
    module.zero_grad(set_to_none=True)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "model_class, capture, options",
    [
        (Chain, "symbolic_trace", {}),
        (ChainExported, "export", {"dynamic_shapes": True}),
    ],
)
def test_a_call_larger_than_the_example_warns_once(model_class, capture, options):
    module = planned(model_class(), torch.randn(8, 16), capture, **options)
    assert call(module, torch.randn(8, 16)) == []
    assert call(module, torch.randn(3, 16)) == []  # smaller: less memory
    with torch.no_grad():
        module(torch.randn(32, 16))  # without gradients (validation): no training step
    (message,) = call(module, torch.randn(12, 16))
    assert "larger tensors than the example it was planned for (x [8, 16])" in message
    assert "Plan with example inputs of the largest size" in message
    assert call(module, torch.randn(12, 16)) == []  # once per planned module


def test_a_call_with_a_tensor_of_another_rank_and_more_elements_warns():
    """A plan for a (8, 16) batch called with (3, 8, 16), which the model also takes: no
    warning before, and 130% over the budget (found trying the library). Fewer elements at
    another rank (one unbatched row) use less memory."""
    module = planned(Chain(), torch.randn(8, 16), "symbolic_trace")
    assert call(module, torch.randn(16)) == []
    (message,) = call(module, torch.randn(3, 8, 16))
    assert "larger tensors than the example it was planned for (x [8, 16])" in message


def test_every_tensor_argument_is_compared_positional_or_keyword():
    extra = torch.randn(2, 16)
    p = planner.plan(
        Chain(), (torch.randn(8, 16),), budget_bytes=10**9, example_kwargs={"extra": extra}
    )
    assert call(p.module, torch.randn(8, 16), extra=extra) == []
    (message,) = call(p.module, torch.randn(8, 16), extra=torch.randn(6, 16))
    assert "(x [8, 16], extra [2, 16])" in message


def test_the_warning_names_a_call_that_measures_over_the_budget():
    """The user's case: the zoo GPT planned at batch 4 steps at batch 16."""
    model, inputs = zoo.gpt(layers=2, d_model=64, seq=64, batch=4)
    p = planner.plan(model, inputs, budget_bytes=3_000_000)
    larger = zoo.gpt(layers=2, d_model=64, seq=64, batch=16)[1]
    with pytest.warns(UserWarning, match="larger tensors than the example"):
        measured = peak_memory(p.module, larger).peak_bytes
    assert measured > p.budget_bytes


class _Normalized(nn.Module):
    """BatchNorm between two layers, with a forward symbolic_trace rejects (torch.export
    captures it, as ATen ops)."""

    def __init__(self):
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        x = x * 0.5 if x.shape[0] > 0 else x
        return self.l2(torch.relu(self.bn(self.l1(x))))


def test_a_batch_of_one_in_training_is_refused_as_the_model_refuses_it():
    """``F.batch_norm`` checks in Python that a channel has more than one value, which
    torch.export does not record: a plan taking other sizes ran a last batch of one and wrote
    NaN into the running variance (found trying the library)."""
    torch.manual_seed(0)
    model = _Normalized().train()
    p = planner.plan(model, (torch.randn(8, 16),), budget_gb=1, dynamic_shapes=True)
    assert p.capture_method.startswith("export")
    one = torch.randn(1, 16)
    with pytest.raises(ValueError, match="more than 1 value per channel") as expected:
        copy.deepcopy(model)(one)
    with pytest.raises(ValueError, match="more than 1 value per channel") as planned_error:
        p.module(one)
    assert str(planned_error.value) == str(expected.value)
    assert torch.equal(model.bn.running_var, torch.ones(16))
    assert call(p.module, torch.randn(3, 16)) == []  # other batch sizes train as before
