"""What recomputing a node costs: the ``CostModel`` solvers weigh, and measured node times.

By default the cost of a node is a roofline estimate from its FLOPs and bytes moved;
``node_seconds`` measures real per-node times to replace it (``CostModel(measured_seconds=...)``),
or ``CostModel(measure_repeat=...)`` has planning measure them on the graph it captured (one
capture; the times are those of the planned graph's own nodes).
Checkpointing also costs time of its own, whatever it recomputes: each checkpoint call (saving
the random state, installing hooks, starting and stopping the recompute) and each kept node
(the selective cache's dispatch). ``planner.overheads.checkpoint_overheads`` measures both on
the model's device
(``CostModel(checkpoint_seconds=..., keep_seconds=...)``).
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from planner.capture import Captured, capture
from planner.options import CaptureOptions
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
    that replace the roofline for those nodes; planning warns when they cover only some of the
    graph's nodes, and refuses them when they match none (times of another graph: measure
    with the same capture options as the plan). ``measure_repeat`` > 0 instead has planning
    time every node of the graph it captured itself, that many times (the median, as
    ``node_seconds`` does): the times of the very graph planned, from one capture.

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
    measure_repeat: int = 0

    def __post_init__(self):
        if isinstance(self.measure_repeat, bool) or not isinstance(self.measure_repeat, int):
            raise TypeError(f"measure_repeat must be an int, got {self.measure_repeat!r}")
        if self.measure_repeat < 0:
            raise ValueError(f"CostModel needs measure_repeat >= 0, got {self.measure_repeat}")
        if self.measure_repeat and self.measured_seconds is not None:
            raise ValueError(
                "give CostModel either measured_seconds (times measured already) or "
                "measure_repeat (planning measures them), not both"
            )
        for name in ("flops_per_second", "bytes_per_second"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not float(value) > 0
            ):
                raise ValueError(
                    f"CostModel needs {name} > 0 (inf ignores that side of the roofline), "
                    f"got {value!r}"
                )
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


def node_seconds(
    module, args, kwargs=None, *, repeat=3, capture_options: CaptureOptions | None = None
) -> dict[str, float]:
    """Median forward seconds of every node of ``module``'s captured graph, by node name.

    Feed the result to ``planner.CostModel(measured_seconds=...)`` so that solvers weigh
    recompute by measured time instead of the roofline estimate. Nodes run on real tensors
    with autograd recording, as a recompute does. Buffers (BatchNorm statistics) are restored
    afterwards, so the model is left as it was.

    ``capture_options`` must be those of the plan (its ``leaf_modules`` and
    ``dynamic_shapes``): other options capture another graph, whose node names differ.
    ``CostModel(measure_repeat=repeat)`` measures the same times while planning, without
    capturing the model a second time.
    """
    if repeat < 1:
        raise ValueError(f"node_seconds needs repeat >= 1, got {repeat=}")
    options = capture_options or CaptureOptions()
    kwargs = kwargs or {}
    captured = capture(
        module,
        tuple(args),
        kwargs,
        leaf_modules=options.leaf_modules,
        dynamic_shapes=options.dynamic_shapes,
    )
    return captured_node_seconds(captured, module, tuple(args), kwargs, repeat=repeat)


def captured_node_seconds(
    captured: Captured, module: nn.Module, args: tuple, kwargs: dict, *, repeat: int
) -> dict[str, float]:
    """``node_seconds`` of a graph captured already (``module(*args, **kwargs)``'s)."""
    graph_module = captured.graph_module
    args, kwargs = captured.inputs(args, kwargs)
    device = step_device(module, args, kwargs)
    if device.type == "meta":
        raise ValueError(
            "node times cannot be measured on the meta device, which computes nothing: "
            "measure a copy of the model on the device it trains on (CPU or CUDA)"
        )
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
