"""Chains: a plain MLP (every layer an articulation point, Chen's setting) and an unrolled
MLP that ``symbolic_trace`` cannot capture (a Python loop over a tensor size)."""

from __future__ import annotations

import torch
from torch import nn

from planner.zoo.common import Example, make


def mlp_chain(
    depth: int = 32,
    width: int = 256,
    batch: int = 64,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A plain chain of ``depth`` Linear layers with ReLU between them.

    The simplest checkpointing problem: every layer's output is an articulation point and all
    layers cost the same, so sqrt(n) segmentation is optimal-ish. ``depth=128`` (or more) gives
    a long chain for solver scaling tests. Input ``(x,)`` of shape ``(batch, width)``; output a
    tensor of the same shape.
    """

    def build() -> Example:
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(width, width))
            if i < depth - 1:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers), (torch.randn(batch, width),)

    return make(build, seed, device)


class UnrolledMLP(nn.Module):
    """A shared Linear+tanh cell applied once per time step, looping over ``x.size(1)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.cell = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x[:, 0])
        # range() needs a Python int. Under symbolic_trace x.size(1) is a Proxy, and
        # range(Proxy) raises TypeError. torch.export(strict=False) sees a static int and
        # unrolls the loop.
        for t in range(x.size(1)):
            h = torch.tanh(self.inp(x[:, t]) + self.cell(h))
        return self.out(h)


def untraceable_mlp(
    steps: int = 8,
    width: int = 64,
    batch: int = 16,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A recurrent MLP that ``torch.fx.symbolic_trace`` cannot capture but ``torch.export`` can.

    Its forward loops ``for t in range(x.size(1))``: under fx, ``x.size(1)`` is a Proxy and
    ``range`` rejects it (``TypeError: 'Proxy' object cannot be interpreted as an integer``);
    ``torch.export.export(model, args, strict=False)`` runs the Python with a concrete size and
    unrolls the loop into ``steps`` copies of the cell sharing one weight. It exercises the
    export fallback of capture and parameters used at many places in the graph.
    Input ``(x,)`` of shape ``(batch, steps, width)``; output ``(batch, width)``.
    """

    def build() -> Example:
        return UnrolledMLP(width), (torch.randn(batch, steps, width),)

    return make(build, seed, device)
