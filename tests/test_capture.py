"""Specification of ``planner.capture``'s tracer where it departs from ``torch.fx``'s: it names
parameters and buffers from a table instead of scanning the module tree at every use, and must
give exactly the graph fx gives."""

import collections
import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

import planner
from planner.capture import LeafTracer


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
    attributes, output = traced(LeafTracer(()))
    assert attributes == fx_attributes
    assert output == fx_output
    assert "b" in attributes and any(a.startswith("_tensor_constant") for a in attributes)


class Pair(NamedTuple):
    out: torch.Tensor
    aux: dict


@dataclasses.dataclass
class Result(collections.OrderedDict):
    """A mapping output with fields, as Hugging Face's ``ModelOutput`` is."""

    logits: torch.Tensor = None

    def __post_init__(self):
        self["logits"] = self.logits


class Heads(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        h = self.body(x)
        if self.kind == "ordered":  # torchvision segmentation models return this
            return collections.OrderedDict(out=h, aux=collections.OrderedDict(mid=h * 2))
        if self.kind == "namedtuple":
            return Pair(h, collections.OrderedDict(mid=h))
        return Result(logits=h)


@pytest.mark.parametrize("kind", ["ordered", "namedtuple", "fields"])
def test_a_planned_module_returns_the_models_own_container_types(kind):
    model, x = Heads(kind), torch.randn(3, 4)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n")
    assert p.capture_method == "symbolic_trace" and p.segments
    out, expected = p.module(x), model(x)
    assert type(out) is type(expected)
    inner = {"ordered": lambda o: o["aux"], "namedtuple": lambda o: o.aux, "fields": None}[kind]
    if inner is not None:
        assert type(inner(out)) is type(inner(expected))
    torch.testing.assert_close(tree_leaves(out), tree_leaves(expected), rtol=0, atol=0)
    if kind == "ordered":
        out.move_to_end("out")
