"""Does the cost model rank plans the way real step time does?

    .venv/bin/python benchmarks/cost_model.py            # about 3 minutes on an idle machine

On a residual MLP (``BLOCKS`` blocks ``x + Linear(relu(Linear(x)))``, d 256, batch 1024) at half
its activation memory, ``optimal`` plans with four cost models: the default roofline, each
node's measured time (``planner.costs.node_seconds``), the measured times pooled over the nodes
doing the same work (``benchmarks.compare.pooled_seconds``), and those with what a checkpoint
call and a kept node cost measured too (``planner.overheads.checkpoint_overheads``). For each plan
it records the overhead its cost model predicts, the overhead the last (most complete) model
predicts for it, and the measured step time (all plans interleaved, median of the
per-repetition ratios to no checkpointing), and the spread of the raw measured times of
identical layers. Writes ``benchmarks/results/cost_model.json``, which ``compare.py`` renders
on docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.compare import pooled_seconds  # noqa: E402
from planner import costs, step  # noqa: E402
from planner.costs import CostModel  # noqa: E402
from planner.overheads import checkpoint_overheads  # noqa: E402
from planner.pipeline import plan, prepare  # noqa: E402
from planner.simulate import Choice, simulate  # noqa: E402

BLOCKS, WIDTH, BATCH = 60, 256, 1024


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def residual_mlp(blocks: int = BLOCKS, width: int = WIDTH, batch: int = BATCH):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)]).train(), (
        torch.randn(batch, width),
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=BLOCKS)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "cost_model.json"
    )
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, args = residual_mlp(opts.blocks)

    raw = costs.node_seconds(model, args)
    overheads = checkpoint_overheads(model, args)
    _, problem = prepare(model, args, cost_model=CostModel(measured_seconds=raw))
    linear = [problem.seconds[i] for i, label in enumerate(problem.labels) if label.endswith(".a")]
    pooled = pooled_seconds(problem, model)
    models = {
        "roofline": CostModel(),
        "measured": CostModel(measured_seconds=raw),
        "measured, pooled": CostModel(measured_seconds=pooled),
        "measured, pooled, with calls": CostModel(measured_seconds=pooled, **overheads),
    }
    fixed = problem.fixed_bytes + problem.gradient_bytes
    baseline = simulate(problem, ()).peak_bytes
    budget = fixed + (baseline - fixed) // 2

    plans = {
        name: plan(model, args, budget_bytes=budget, solver="optimal", cost_model=cm)
        for name, cm in models.items()
    }
    # Every plan judged by the last cost model: does it order them as the step times do?
    judge = dataclasses.replace(
        problem,
        seconds=models["measured, pooled, with calls"].seconds(
            problem.flops, problem.bytes_moved, problem.names
        ),
        **overheads,
    )
    modules = {"none": model, **{name: p.module for name, p in plans.items()}}
    times: dict[str, list[float]] = {name: [] for name in modules}
    order = list(modules)
    for r in range(opts.reps + 1):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            step.clear_grads(modules[name])
            begin = time.perf_counter()
            step.training_step(modules[name], args)
            if r:
                times[name].append(time.perf_counter() - begin)
    results = dict(
        command="python benchmarks/cost_model.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        blocks=opts.blocks,
        width=WIDTH,
        batch=BATCH,
        reps=opts.reps,
        budget_bytes=budget,
        **overheads,
        linear_seconds=dict(
            min=float(min(linear)), median=float(statistics.median(linear)), max=float(max(linear))
        ),
        plans={
            name: dict(
                segments=len(p.segments),
                kept=len(getattr(p, "keep", ()) or ()),
                predicted_overhead=p.predicted_overhead,
                predicted_overhead_with_calls=simulate(
                    judge, Choice(p.segments, p.keep)
                ).recompute_seconds
                / judge.step_seconds,
                predicted_peak_bytes=p.predicted_peak_bytes,
                measured_time_ratio=statistics.median(
                    [t / t0 for t, t0 in zip(times[name], times["none"])]
                ),
            )
            for name, p in plans.items()
        },
    )
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results["plans"], indent=1))
    return results


if __name__ == "__main__":
    main()
