"""Specification of ``planner.capture``'s tracer where it departs from ``torch.fx``'s: it names
parameters and buffers from a table instead of scanning the module tree at every use, and must
give exactly the graph fx gives."""

import torch
from torch import fx, nn

from planner.capture import _Tracer


class ReplacesItsBuffer(nn.Module):
    """Uses a buffer, replaces it, then uses the old tensor and a new constant."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.ones(4))
        self.tied = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)
        self.other.weight = self.tied.weight

    def forward(self, x):
        old = self.b
        y = x + old + self.tied.weight.sum() + self.other.weight.sum()
        self.b = torch.zeros(4)
        return y + old + torch.full((4,), 5.0) + self.b


def traced(tracer: fx.Tracer) -> tuple[list, list]:
    torch.manual_seed(0)
    model = ReplacesItsBuffer()
    graph = tracer.trace(model)
    module = fx.GraphModule(tracer.root, graph)
    attributes = [node.target for node in graph.nodes if node.op == "get_attr"]
    return attributes, module(torch.zeros(4)).tolist()


def test_the_graph_is_the_one_fx_makes_even_when_forward_replaces_a_buffer():
    fx_attributes, fx_output = traced(fx.Tracer())
    attributes, output = traced(_Tracer(()))
    assert attributes == fx_attributes
    assert output == fx_output
    assert "b" in attributes and any(a.startswith("_tensor_constant") for a in attributes)
