"""``python -m planner.demo``: plan a GPT-style model at half its activation memory, then check.

Plans the zoo GPT under a budget of parameters + gradients + half the baseline activation peak,
prints the plan, runs one training step of the original and of the planned module from the same
seed, compares every gradient, and prints predicted against measured peak memory.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import planner
from planner.pipeline import prepare
from planner.simulate import simulate
from planner.step import peak_memory, training_step
from planner.units import mib


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.5, help="of the activation peak")
    parser.add_argument("--solver", default="auto")
    options = parser.parse_args(argv)

    model, inputs = planner.zoo.gpt(
        layers=options.layers, d_model=options.d_model, seq=options.seq, batch=options.batch
    )
    _, problem = prepare(model, inputs)
    baseline = simulate(problem, ()).peak_bytes
    unavoidable = problem.fixed_bytes + problem.gradient_bytes
    budget = int(unavoidable + options.fraction * (baseline - unavoidable))
    print(
        f"GPT: {options.layers} layers, d_model {options.d_model}, seq {options.seq}, "
        f"batch {options.batch}; budget = params, grads + {options.fraction:.0%} of the "
        "activation peak\n"
    )

    plan = planner.plan(model, inputs, budget_bytes=budget, solver=options.solver)
    print(plan, "\n")

    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    reference_loss = training_step(reference, inputs)
    torch.manual_seed(0)
    planned_loss = training_step(plan.module, inputs)
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        if p.grad is None or q.grad is None:  # a parameter the loss does not use
            if p.grad is not q.grad:
                worst = float("inf")
            continue
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    identical = worst == 0.0 and torch.equal(reference_loss, planned_loss)
    print(
        f"loss: original {reference_loss.item():.6f}, planned {planned_loss.item():.6f}; "
        f"largest gradient difference {worst:.3g} "
        f"({'identical' if identical else 'DIFFERENT'})"
    )

    measured_baseline = peak_memory(reference, inputs).peak_bytes
    measured_plan = peak_memory(plan.module, inputs)
    print("\npeak memory of one training step (CPU live-storage tracker):")
    print(
        f"  baseline  predicted {mib(plan.baseline_peak_bytes)}  measured {mib(measured_baseline)}"
    )
    print(
        f"  planned   predicted {mib(plan.predicted_peak_bytes)}  measured "
        f"{mib(measured_plan.peak_bytes)}  "
        f"(prediction error {plan.predicted_peak_bytes / measured_plan.peak_bytes - 1:+.1%})"
    )
    print(
        f"  activation peak     {mib(measured_baseline - unavoidable)} -> "
        f"{mib(measured_plan.peak_bytes - unavoidable)} "
        f"({1 - (measured_plan.peak_bytes - unavoidable) / (measured_baseline - unavoidable):.0%}"
        " lower)"
    )
    fits = measured_plan.peak_bytes <= budget
    print(f"  budget    {mib(budget)}  ({'fits' if fits else 'EXCEEDED'})")
    return 0 if identical and fits else 1


if __name__ == "__main__":
    sys.exit(main())
