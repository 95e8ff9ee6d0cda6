"""The MILP with kept nodes: how long it takes, and where ``optimal``'s keep search loses to it.

On small random graphs (``tests/problems.py``'s generator) and small zoo models, at budgets
spread between each graph's lowest peak and its baseline, solve ``milp`` with keeps (exact:
``tests/test_milp.py``) and ``optimal(keep=True)``, and report, per graph size, the MILP's
solve time, ``optimal``'s, and each budget where ``optimal`` costs more than 1% above the MILP's
optimum, or fails to fit where the MILP fits. Figures only; nothing is asserted.

    .venv/bin/python benchmarks/milp_keeps.py [--sizes 6 7 8 10 12] [--seeds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from planner.simulate import simulate
from planner.solvers import SOLVERS
from planner.solvers.milp import milp_plan
from problems import random_problem

FRACTIONS = (0.0, 0.1, 0.25, 0.5, 0.75)


def compare(problem, label: str, time_limit: float) -> list[dict]:
    """One row per budget: the MILP's cost and time (with keeps and without), optimal's cost."""
    baseline = simulate(problem, ()).peak_bytes
    lowest = milp_plan(problem, None, time_limit=time_limit).peak_bytes
    rows = []
    for fraction in FRACTIONS:
        budget = int(lowest + fraction * (baseline - lowest))
        started = time.perf_counter()
        exact = milp_plan(problem, budget, time_limit=time_limit)
        seconds = time.perf_counter() - started
        started = time.perf_counter()
        alone = milp_plan(problem, budget, time_limit=time_limit, keep=False)
        seconds_alone = time.perf_counter() - started
        started = time.perf_counter()
        plan = SOLVERS["optimal"](problem, budget)
        optimal_seconds = time.perf_counter() - started
        dp = simulate(problem, plan)
        rows.append(
            dict(
                label=label,
                budget=budget,
                fraction=fraction,
                status=exact.status,
                milp=exact.recompute_seconds if exact.fits else None,
                kept=len(exact.keep),
                segments_alone=alone.recompute_seconds if alone.fits else None,
                optimal=dp.recompute_seconds if dp.peak_bytes <= budget else None,
                milp_seconds=seconds,
                milp_seconds_alone=seconds_alone,
                optimal_seconds=optimal_seconds,
            )
        )
    return rows


def losses(rows: list[dict]) -> list[str]:
    """Budgets where optimal(keep=True) is more than 1% costlier than the MILP, or misses."""
    found = []
    for row in rows:
        if row["milp"] is None or row["status"] != "optimal":
            continue
        where = f"{row['label']} at {row['fraction']:.2f}"
        if row["optimal"] is None:
            found.append(f"{where}: optimal finds no plan that fits; the MILP costs {row['milp']}")
        elif row["optimal"] > row["milp"] * 1.01 + 1e-12:
            excess = row["optimal"] / row["milp"] - 1 if row["milp"] else float("inf")
            found.append(
                f"{where}: optimal {row['optimal']:g} vs MILP {row['milp']:g} (+{excess:.0%})"
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[6, 7, 8, 10, 12])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--zoo", action="store_true", help="also the small zoo models of test_milp")
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()

    groups: list[tuple[str, list[dict]]] = []
    for size in args.sizes:
        rows = []
        for seed in range(args.seeds):
            rows += compare(random_problem(seed, size), f"n={size} seed {seed}", args.time_limit)
        groups.append((f"random, {size} nodes", rows))
    if args.zoo:
        from planner import zoo
        from planner.pipeline import prepare

        for name, sizes in [
            ("mlp", dict(depth=8, width=16, batch=256)),
            ("resnet", dict(blocks=1)),
            ("unet", dict(depth=1)),
        ]:
            problem = prepare(*zoo.build(name, **sizes))[1]
            label = f"zoo {name} ({problem.size} nodes)"
            groups.append((label, compare(problem, label, args.time_limit)))

    print(
        "| graphs | budgets | MILP s, keeps (median / max) | MILP s, segments alone | "
        "optimal s | keeps cheaper than segments alone | optimal > MILP + 1% | optimal misses |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows in groups:
        solved = [r for r in rows if r["milp"] is not None]
        times = [r["milp_seconds"] for r in rows]
        alone = [r["milp_seconds_alone"] for r in rows]
        dp = [r["optimal_seconds"] for r in rows]
        cheaper = sum(
            1
            for r in solved
            if r["segments_alone"] is None or r["milp"] < r["segments_alone"] - 1e-12
        )
        lost = losses(rows)
        print(
            f"| {label} | {len(rows)} | {statistics.median(times):.3f} / {max(times):.3f} | "
            f"{statistics.median(alone):.3f} / {max(alone):.3f} | "
            f"{statistics.median(dp):.3f} / {max(dp):.3f} | {cheaper} | "
            f"{sum('vs MILP' in x for x in lost)} | {sum('no plan' in x for x in lost)} |"
        )
    print()
    for _, rows in groups:
        for line in losses(rows):
            print("-", line)


if __name__ == "__main__":
    main()
