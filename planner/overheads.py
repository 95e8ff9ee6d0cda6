"""What checkpointing costs besides recompute, measured: ``CostModel.checkpoint_seconds`` and
``keep_seconds`` (``planner.costs``).

It plans and rewrites a small chain to measure them, so it sits above the pipeline, which builds
problems with the ``CostModel`` these figures go into.
"""

from __future__ import annotations

import statistics
import time

import torch

from planner.pipeline import prepare
from planner.rewrite import rewrite
from planner.simulate import Choice
from planner.step import clear_grads, step_device, synchronize, training_step

__all__ = ["checkpoint_overheads"]


def checkpoint_overheads(
    module, args, kwargs=None, *, repeat: int = 15, blocks: int = 32
) -> dict[str, float]:
    """Seconds that one checkpoint call and one kept node add to a training step, measured on
    the device (and in the parameter dtype) of ``module`` called with ``args``.

    They are the work of ``torch.utils.checkpoint`` and of the planned module, not of the
    model's nodes, so a chain of ``blocks`` small ``Linear`` + ``ReLU`` blocks measures them:
    unplanned, with one checkpointed segment per block, and with each block's ``Linear`` kept
    as well, interleaved ``repeat`` times; the medians of the differences per block are the
    overheads (the call's includes its block's recompute, two ops on 4 x 8 values). Returns
    ``{"checkpoint_seconds": ..., "keep_seconds": ...}``, arguments of ``CostModel``::

        CostModel(measured_seconds=node_seconds(m, x), **checkpoint_overheads(m, x))
    """
    if repeat < 1 or blocks < 1:
        raise ValueError(
            f"checkpoint_overheads needs repeat >= 1 and blocks >= 1, got {repeat=}, {blocks=}"
        )
    device = step_device(module, tuple(args), kwargs or {})
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    chain = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(blocks)]
    ).to(device, dtype)
    x = torch.randn(4, 8, device=device, dtype=dtype)
    captured, problem = prepare(chain, (x,))
    if problem.size != 2 * blocks:
        raise AssertionError(f"the chain captured as {problem.size} nodes, not {2 * blocks}")
    segments = tuple((2 * k, 2 * k + 2) for k in range(blocks))
    steps = {
        "none": chain,
        "checkpoint": rewrite(captured.graph_module, chain, Choice(segments)),
        "keep": rewrite(
            captured.graph_module, chain, Choice(segments, frozenset(range(0, 2 * blocks, 2)))
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(repeat + 1):  # the first round warms up
        for name in order[r % 3 :] + order[: r % 3]:
            clear_grads(steps[name])
            synchronize(device)
            begin = time.perf_counter()
            training_step(steps[name], (x,))
            synchronize(device)
            if r:
                times[name].append(time.perf_counter() - begin)

    def per_block(more: str, less: str) -> float:
        # a cost is never negative; on a loaded machine a small difference can read so
        difference = statistics.median(a - b for a, b in zip(times[more], times[less]))
        return max(difference / blocks, 0.0)

    return {
        "checkpoint_seconds": per_block("checkpoint", "none"),
        "keep_seconds": per_block("keep", "checkpoint"),
    }
