"""Rewrite edge cases found by testers: each test states what a plan must do.

* A segment is emitted where its first compute node stands; the nodes it reads must exist
  there, even those the graph lists later (a parameter's ``get_attr``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from planner.nested import nested_choice
from planner.pipeline import prepare
from planner.rewrite import rewrite

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


def _position_table(length_from_input: bool):
    torch.manual_seed(0)
    model = PositionTable(length_from_input).train()
    ids = torch.randint(0, 11, (3, 6))
    captured, problem = prepare(model, (ids,))
    order = [n.name for n in captured.graph_module.graph.nodes]
    assert order.index("pos") > order.index("emb"), "the layout this test is about"
    segments = [
        (a, b)
        for a, b in itertools.combinations(range(problem.size + 1), 2)
        if problem.is_valid_segment(a, b)
    ]
    return model, (ids,), captured, segments


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
