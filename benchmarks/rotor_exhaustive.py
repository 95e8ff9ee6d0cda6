"""``rotor`` against an exhaustive search over every nested plan, on small random graphs.

    .venv/bin/python benchmarks/rotor_exhaustive.py --nodes 5 --seeds 100
    .venv/bin/python benchmarks/rotor_exhaustive.py --nodes 6 --seeds 40
    .venv/bin/python benchmarks/rotor_exhaustive.py --nodes 6 --seeds 40 --chains

For each graph (``tests/problems.py``'s generator, seeds ``0..seeds-1``; with ``--chains``
the same graphs without their skips, ``random_problem(..., chain=True)``) every nested plan is
replayed; at each peak some plan reaches (the budgets where the answer can change), ``rotor``
matches when its plan fits and recomputes no more than the cheapest plan that fits. Prints the
count of matched budgets and each miss (seed, budget, rotor's peak and recompute, the
cheapest's recompute and plan). Figures only; ``tests/test_nested.py`` asserts seeds 0-29 at
5 nodes, and chains at 5 and 6 nodes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from planner.simulate import simulate
from planner.solvers import SOLVERS
from problems import all_nested_plans, random_problem


def misses(seed: int, nodes: int, chain: bool = False) -> tuple[int, list[str]]:
    """(budgets compared, a line per budget where rotor does worse than the search)."""
    problem = random_problem(seed, nodes, chain=chain)
    replays = [(simulate(problem, plan), plan) for plan in all_nested_plans(problem)]
    budgets = sorted({r.peak_bytes for r, _ in replays})
    lines = []
    for budget in budgets:
        cost, best = min(
            ((r.recompute_seconds, repr(plan)) for r, plan in replays if r.peak_bytes <= budget)
        )
        found = simulate(problem, SOLVERS["rotor"](problem, budget))
        if found.peak_bytes > budget or found.recompute_seconds > cost + 1e-12:
            lines.append(
                f"seed {seed}, budget {budget}: rotor {found.peak_bytes} bytes, "
                f"{found.recompute_seconds:g} s; cheapest {cost:g} s: {best}"
            )
    return len(budgets), lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--chains", action="store_true", help="the graphs without skips")
    args = parser.parse_args()
    started = time.process_time()
    compared, missed = 0, []
    for seed in range(args.seeds):
        count, lines = misses(seed, args.nodes, args.chains)
        compared += count
        missed += lines
    graphs = "chains" if args.chains else "graphs"
    print(
        f"{args.nodes}-node {graphs}, seeds 0-{args.seeds - 1}: rotor matched the exhaustive "
        f"search at {compared - len(missed)} of {compared} budgets "
        f"({time.process_time() - started:.0f} CPU s)"
    )
    print("\n".join(missed))


if __name__ == "__main__":
    main()
