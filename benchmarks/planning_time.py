"""How long planning takes: capture + profile (``prepare``) and each solver, on large graphs.

    .venv/bin/python benchmarks/planning_time.py --quick           # about 10 s
    .venv/bin/python benchmarks/planning_time.py                   # the full run, about 30 s
    .venv/bin/python benchmarks/planning_time.py --nodes 1000 10000 20000

For deep MLPs (``zoo.mlp_chain``: a plain chain, every layer an articulation point) and
GPT-style stacks (``zoo.gpt``: a pre-LN decoder whose residual stream crosses every cut inside a
block) built on the meta device (no memory, shapes only) at about 1,000 and 10,000 graph nodes,
after planning a tiny model once (a fresh process pays about 1 s of one-time imports, reported
apart), it times ``prepare`` once per graph and then each solver (``sqrt_n``, ``greedy``,
``optimal``) at one budget that forces checkpointing (greedy's lowest peak plus ``--fraction``
of the way to the baseline: every solver can fit it). A solver whose time, extrapolated
quadratically from the smaller graph of its family, would exceed ``--cap`` seconds is skipped
and marked so; one that runs past the cap is stopped (``SIGALRM``) and marked so. Then it plans
a 7B-parameter-class decoder at ``--budget-7b-gib`` and prints the plan. Output: Markdown on
stdout, appended to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import signal
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable as a script from a fresh clone, without installing
    sys.path.insert(0, str(ROOT))

import planner  # noqa: E402
from planner import zoo  # noqa: E402
from planner.pipeline import prepare  # noqa: E402
from planner.simulate import as_choice, simulate  # noqa: E402
from planner.solvers import SOLVERS  # noqa: E402

try:
    from planner.solvers import optimal  # noqa: F401  (registers "optimal")
except ImportError:  # a checkout without it: time the others
    pass

MIB = 2**20
SOLVER_ORDER = ("sqrt_n", "greedy", "optimal")
# Nodes per unit of size, measured: mlp_chain has a Linear and a ReLU per layer, gpt about 40
# nodes per block (plus embeddings and loss).
FAMILIES = {
    # A large batch, so that activations (not weights and gradients) set the peak.
    "mlp": (lambda depth: zoo.mlp_chain(depth=depth, batch=4096, device="meta"), 2),
    "gpt": (lambda layers: zoo.gpt(layers=layers, device="meta"), 40),
}


class Stopped(Exception):
    """Raised by the alarm when a solver runs past the cap."""


def _stop(signum, frame):
    raise Stopped


def timed(function, cap: float):
    """(seconds, result) of ``function()``, or (seconds, None) when stopped at ``cap``."""
    signal.signal(signal.SIGALRM, _stop)
    signal.setitimer(signal.ITIMER_REAL, cap)
    start = time.perf_counter()
    try:
        result = function()
        return time.perf_counter() - start, result
    except Stopped:
        return time.perf_counter() - start, None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def run_family(family: str, sizes: list[int], fraction: float, cap: float) -> list[dict]:
    """Time prepare and every solver on each size of one family, smallest first."""
    build, per_unit = FAMILIES[family]
    rows, last = [], {}  # last: solver -> (nodes, seconds) on the previous size
    for units in sorted(sizes):
        model, inputs = build(max(1, units // per_unit))
        start = time.perf_counter()  # planning starts from a built model
        _, problem = prepare(model, inputs)
        prepare_seconds = time.perf_counter() - start
        baseline = simulate(problem, ()).peak_bytes
        # Between the lowest peak greedy reaches (cheap to find, so every solver can fit) and
        # the baseline: a budget that forces checkpointing without being out of reach.
        reachable = simulate(problem, SOLVERS["greedy"](problem, 0)).peak_bytes
        budget = int(reachable + fraction * (baseline - reachable))
        for name in SOLVER_ORDER:
            if name not in SOLVERS:
                continue
            row = dict(
                family=family,
                nodes=problem.size,
                prepare=prepare_seconds,
                solver=name,
                budget=budget,
                baseline=baseline,
            )
            if name in last:  # at least quadratic in the nodes: every solver simulates plans
                nodes, seconds = last[name]
                estimate = seconds * (problem.size / nodes) ** 2
                if estimate > cap:
                    rows.append(
                        {
                            **row,
                            "note": f"skipped: about {estimate:,.0f} s expected "
                            "(quadratic extrapolation)",
                        }
                    )
                    continue
            seconds, segments = timed(lambda: SOLVERS[name](problem, budget), cap)
            if segments is None:
                rows.append({**row, "solve": seconds, "note": f"stopped at the {cap:g} s cap"})
                last[name] = (problem.size, float("inf"))
                continue
            last[name] = (problem.size, seconds)
            result = simulate(problem, segments)
            step = problem.step_seconds
            rows.append(
                {
                    **row,
                    "solve": seconds,
                    "segments": len(as_choice(segments).segments),
                    "kept": len(as_choice(segments).keep),
                    "peak": result.peak_bytes,
                    "fits": result.peak_bytes <= budget,
                    "overhead": result.recompute_seconds / step if step else 0.0,
                }
            )
        print(f"  {family}: {problem.size} nodes done", file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | nodes | prepare (s) | solver | solve (s) | total (s) | segments | peak / "
        "budget (MiB) | recompute | note |",
        "|---|---:|---:|---|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        solve = r.get("solve")
        timing = f"{solve:.3f} | {r['prepare'] + solve:.2f}" if solve is not None else "– | –"
        if "peak" in r:
            fits = "" if r["fits"] else " (does not fit)"
            kept = f" ({r['kept']} kept)" if r.get("kept") else ""
            result = (
                f"{r['segments']}{kept} | {r['peak'] / MIB:,.1f} / {r['budget'] / MIB:,.1f}{fits} "
                f"| {r['overhead']:.1%}"
            )
        else:
            result = f"– | – / {r['budget'] / MIB:,.1f} | –"
        lines.append(
            f"| {r['family']} | {r['nodes']:,} | {r['prepare']:.2f} | {r['solver']} | "
            f"{timing} | {result} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def plan_7b(budget_gib: float) -> str:
    model, inputs = zoo.gpt(**zoo.gpt_config_7b(), device="meta")
    parameters = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    plan = planner.plan(model, inputs, budget_gb=budget_gib)
    seconds = time.perf_counter() - start
    return (
        f"7B-class decoder ({parameters / 1e9:.2f}e9 parameters, float32, no optimizer "
        f"state), budget {budget_gib:g} GiB: planned in {seconds:.1f} s "
        f"({plan.problem.size:,} nodes)\n\n```\n{plan}\n```"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        help="approximate graph sizes (nodes) per family (default 1000 10000; "
        "200 1000 with --quick)",
    )
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument(
        "--fraction",
        type=float,
        default=0.5,
        help="budget: greedy's lowest peak + this fraction of the way to the "
        "baseline peak (default 0.5)",
    )
    parser.add_argument(
        "--cap",
        type=float,
        default=300.0,
        help="seconds a solver may take on one graph before it is stopped",
    )
    parser.add_argument("--budget-7b-gib", type=float, default=80.0)
    parser.add_argument("--skip-7b", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small graphs (200 and 1000 nodes), 60 s cap: about 20 s",
    )
    parser.add_argument("--out", type=Path, help="append the Markdown report to this file")
    args = parser.parse_args(argv)
    if args.nodes is None:
        args.nodes = [200, 1000] if args.quick else [1000, 10000]
    if args.quick:
        args.cap = min(args.cap, 60.0)

    started = time.perf_counter()
    warm_up = time.perf_counter()
    prepare(*zoo.mlp_chain(depth=2, device="meta"))
    warm_up = time.perf_counter() - warm_up
    rows = [
        r
        for family in args.families
        for r in run_family(family, args.nodes, args.fraction, args.cap)
    ]
    report = [
        f"## Planning time ({datetime.date.today().isoformat()})",
        "",
        f"`{' '.join(['benchmarks/planning_time.py', *(argv or sys.argv[1:])])}` on "
        f"{platform.machine()} ({torch.get_num_threads()} torch threads), torch "
        f"{torch.__version__}, Python {platform.python_version()}. Graphs built on the meta "
        f"device; budget = greedy's lowest peak + {args.fraction:.0%} of the way to the baseline; "
        f"cap {args.cap:g} s per solve. Before the first graph, planning a 2-layer MLP took "
        f"{warm_up:.2f} s: the one-time cost of a fresh process (PyTorch imports torch._dynamo "
        "on the first meta kernel), which the times below do not include.",
        "",
        table(rows),
    ]
    if not args.skip_7b:
        report += ["", plan_7b(args.budget_7b_gib)]
    report += ["", f"Whole run: {time.perf_counter() - started:.0f} s.", ""]
    text = "\n".join(report)
    print(text)
    if args.out is not None:
        with open(args.out, "a") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
