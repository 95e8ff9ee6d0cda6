"""What recomputing a node costs: the ``CostModel`` solvers weigh, and measured node times.

By default the cost of a node is a roofline estimate from its FLOPs and bytes moved;
``node_seconds`` measures real per-node times to replace it (``CostModel(measured_seconds=...)``).
Checkpointing also costs time of its own, whatever it recomputes: each checkpoint call (saving
the random state, installing hooks, starting and stopping the recompute) and each kept node
(the selective cache's dispatch). ``planner.overheads.checkpoint_overheads`` measures both on
the model's device
(``CostModel(checkpoint_seconds=..., keep_seconds=...)``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from planner.capture import capture
from planner.profile import COMPUTE_OPS, placeholder_values
from planner.step import step_device, synchronize

__all__ = ["CostModel", "node_seconds"]


@dataclass(frozen=True)
class CostModel:
    """Time of each node: what recomputing it costs.

    By default a roofline: the larger of its compute time and its memory-traffic time. FLOPs
    alone would make elementwise ops, norms and softmax look free to recompute. The default
    figures are round numbers for one recent data-centre GPU in bf16 (about 400 TFLOP/s dense,
    2 TB/s); only ratios between nodes matter to the solvers. ``measured_seconds`` maps node
    names (``Plan.problem.names``; ``planner.costs.node_seconds`` measures them) to times
    that replace the roofline for those nodes.

    ``checkpoint_seconds`` is what one checkpoint call adds to a step beyond the nodes it
    recomputes (its forward call and its recompute), and ``keep_seconds`` what one kept node
    adds (``planner.simulate.Choice.keep``); ``planner.overheads.checkpoint_overheads`` measures
    both. By default both are 0: the roofline describes a GPU, whose kernels run
    asynchronously from the Python that launches them, so a checkpoint call's host work (about
    0.2 ms on a CPU core) overlaps the kernels queued before it unless the step is bound by
    launches. Measure them when it is, and on a CPU, where nothing overlaps.
    """

    flops_per_second: float = 4e14
    bytes_per_second: float = 2e12
    measured_seconds: Mapping[str, float] | None = None
    checkpoint_seconds: float = 0.0
    keep_seconds: float = 0.0

    def __post_init__(self):
        for name in ("checkpoint_seconds", "keep_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"CostModel needs a finite {name} >= 0 (seconds), got {value!r}; "
                    "planner.overheads.checkpoint_overheads measures it"
                )

    def seconds(self, flops: np.ndarray, bytes_moved: np.ndarray, names=()) -> np.ndarray:
        estimate = np.maximum(flops / self.flops_per_second, bytes_moved / self.bytes_per_second)
        for i, name in enumerate(names):
            if self.measured_seconds and name in self.measured_seconds:
                estimate[i] = float(self.measured_seconds[name])
        return estimate


def node_seconds(module, args, kwargs=None, *, repeat=3) -> dict[str, float]:
    """Median forward seconds of every node of ``module``'s captured graph, by node name.

    Feed the result to ``planner.CostModel(measured_seconds=...)`` so that solvers weigh
    recompute by measured time instead of the roofline estimate. Nodes run on real tensors
    with autograd recording, as a recompute does. Buffers (BatchNorm statistics) are restored
    afterwards, so the model is left as it was.
    """
    if repeat < 1:
        raise ValueError(f"node_seconds needs repeat >= 1, got {repeat=}")
    kwargs = kwargs or {}
    captured = capture(module, tuple(args), kwargs)
    graph_module = captured.graph_module
    args, kwargs = captured.inputs(tuple(args), kwargs)
    device = step_device(module, args, kwargs)
    samples: dict[str, list[float]] = {}

    class Timer(torch.fx.Interpreter):
        def run_node(self, node):
            if node.op not in COMPUTE_OPS:
                return super().run_node(node)
            synchronize(device)
            begin = time.perf_counter()
            out = super().run_node(node)
            synchronize(device)
            samples.setdefault(node.name, []).append(time.perf_counter() - begin)
            return out

    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        for _ in range(repeat):
            Timer(graph_module).run(*placeholder_values(graph_module, tuple(args), kwargs))
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    return {name: statistics.median(times) for name, times in samples.items()}
