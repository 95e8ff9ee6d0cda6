"""What a forward does to state a captured graph does not carry (found by testers, each planned
silently wrong): tensors of the model read outside the traced values, the random generator
seeded in forward, values collected in a module's containers. Each is captured exactly or
refused with what to do, and planning leaves the model as it was."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import nn

import planner


def _layers() -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


# -- tensors of the model read outside the traced values -------------------------------------
# symbolic_trace gives a get_attr to parameters only: an op on a buffer or a plain tensor
# attribute alone ran once, at planning, and the graph held its result, a frozen copy.


class Queue(nn.Module):
    """A MoCo-style queue updated in place in forward: read through ``clone()``, then written.
    Planned, the logits read the queue as it was at planning (0.83 off from the second step)."""

    def __init__(self, register: bool):
        super().__init__()
        self.layers = _layers()
        if register:
            self.register_buffer("queue", torch.zeros(32, 16), persistent=False)
        else:
            self.queue = torch.zeros(32, 16)  # a plain attribute, as many repositories keep it

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = x @ self.queue.clone().t()
        self.queue[:8] = x.detach()
        return logits.sum() + x.sum()


class WeightPenalty(nn.Module):
    """An L2 penalty over ``self.parameters()`` in forward: real tensors, not traced ones."""

    def __init__(self):
        super().__init__()
        self.layers = _layers()

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum() + 0.1 * sum(p.pow(2).sum() for p in self.parameters())


@pytest.mark.parametrize(
    "make",
    [lambda: Queue(register=False), lambda: Queue(register=True), WeightPenalty],
    ids=["plain attribute", "buffer", "parameters"],
)
def test_a_tensor_of_the_model_read_outside_traced_values_is_read_at_every_call(make):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    p = planner.plan(model, (torch.randn(8, 16),), budget_gb=1, solver="sqrt_n")
    assert p.segments
    for step in range(3):
        x = torch.randn(8, 16)
        for parameter in (*model.parameters(), *reference.parameters()):
            parameter.grad = None
        expected, out = reference(x), p.module(x)
        expected.backward()
        out.backward()
        assert torch.equal(out, expected), f"step {step}"
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: {name}"
    if isinstance(model, Queue):
        assert torch.equal(model.queue, reference.queue)
        reads = [n.target for n in p.module.graph.find_nodes(op="get_attr")]
        assert any(operator.attrgetter(t)(p.module) is model.queue for t in reads)
