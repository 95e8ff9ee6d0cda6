"""How long ``planner.plan(..., solver="auto")`` takes, stage by stage, on large graphs.

    .venv/bin/python benchmarks/planning_time.py --quick          # 1,000 nodes: about a minute
    .venv/bin/python benchmarks/planning_time.py                  # 1,000 and 10,000 nodes
    .venv/bin/python benchmarks/planning_time.py --against /tmp/main --repeat 3

Models, all built on the meta device (shapes only, no memory):

- ``mlp``: ``zoo.mlp_chain(depth, batch=4096)``, a chain of Linear and ReLU (2 nodes a layer);
- ``gpt``: ``zoo.gpt(layers)``, a pre-LN decoder (about 37 nodes a block);
- ``residual``: blocks ``x + Linear(GELU(Linear(LayerNorm(x))))``, width 1,024, batch 64
  (5 nodes a block; issue 16's 10,000-node case is 2,000 blocks);
- ``nested``: blocks ``x + Linear(ReLU(Linear(x)))``, width 16, batch 65,536 (4 nodes a block;
  ``benchmarks/nested_floor.py``), planned at its lowest peak, below every flat plan's: there
  ``auto`` runs ``optimal``, ``greedy`` and ``sqrt_n``, finds that none fits, and plans with
  ``rotor``. Only up to ``AUTO_ROTOR_MAX_NODES`` (2,000) nodes, where ``auto`` tries ``rotor``.

The others are planned at greedy's lowest peak plus ``--fraction`` of the way to the baseline (a
budget that forces checkpointing and that every solver can meet). Budgets are worked out in a
process of their own; each plan is then timed in a fresh process that has planned a tiny model
first (a fresh process pays about 1 s of one-time imports, reported apart), by wrapping the
functions ``plan`` calls: ``capture``, ``profile``, ``build_problem`` ("problem"), ``choose``
("solve", split into the time of each solver ``auto`` ran and of ``lowest_peak``, each without
the solvers it called in turn) and ``rewrite``; "other" is the rest of ``plan`` (its
simulations and checks). The last row plans the 7B-class decoder (``zoo.gpt_config_7b()``) at
``--budget-7b-gib``.

``--against DIR`` times the planner package of another checkout too (``git worktree add DIR
main``), with this same script: the two alternate, ``--repeat`` times each, and every figure
is the fastest of its repeats. The table then gives both and their ratio (this checkout over
DIR's), which is what to read on a shared machine, where single timings vary by 2x. Output:
Markdown on stdout, appended to ``--out`` when given.

Times are CPU seconds of the planning process (``time.process_time``), which other jobs on the
machine disturb far less than elapsed time; the last column is the elapsed time of ``plan``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
STAGES = ("capture", "profile", "problem", "solve", "rewrite", "other", "total", "wall")
SOLVER_PARTS = ("optimal", "greedy", "sqrt_n", "rotor", "lowest_peak")
# Nodes per unit of size (layers or blocks), measured.
PER_UNIT = {"mlp": 2, "gpt": 37, "residual": 5, "nested": 4}
ROTOR_MAX_NODES = 2_000


def build(family: str, nodes: int):
    """(model, inputs) of about ``nodes`` graph nodes, on the meta device."""
    import torch
    from torch import nn

    from planner import zoo

    if family == "7b":
        return zoo.gpt(**zoo.gpt_config_7b(), device="meta")
    units = max(1, nodes // PER_UNIT[family])
    if family == "mlp":
        return zoo.mlp_chain(depth=units, batch=4096, device="meta")
    if family == "gpt":
        return zoo.gpt(layers=units, device="meta")
    norm = family == "residual"
    width, batch = (1024, 64) if norm else (16, 65536)
    activation = nn.GELU() if norm else nn.ReLU()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width) if norm else nn.Identity()
            self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)
            self.activation = activation

        def forward(self, x):
            return x + self.down(self.activation(self.up(self.norm(x))))

    with torch.device("meta"):
        return nn.Sequential(*(Block() for _ in range(units))), (torch.randn(batch, width),)


def budget_of(family: str, nodes: int, fraction: float) -> int:
    """The budget a family is planned at (see the module docstring)."""
    from planner.pipeline import prepare
    from planner.simulate import simulate
    from planner.solvers import SOLVERS
    from planner.solvers.auto import lowest_peak

    _, problem = prepare(*build(family, nodes))
    if family == "nested":
        return lowest_peak(problem).peak_bytes
    baseline = simulate(problem, ()).peak_bytes
    reachable = simulate(problem, SOLVERS["greedy"](problem, 0)).peak_bytes
    return int(reachable + fraction * (baseline - reachable))


class Timers:
    """Exclusive time per name: a timed call inside another is taken out of the outer one."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.stack: list[list[float]] = []  # per open call: [its start, time of calls inside]

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            self.stack.append([time.process_time(), 0.0])
            try:
                return function(*args, **kwargs)
            finally:
                start, inner = self.stack.pop()
                spent = time.process_time() - start
                self.seconds[name] = self.seconds.get(name, 0.0) + spent - inner
                if self.stack:
                    self.stack[-1][1] += spent

        return timed


@contextlib.contextmanager
def timing(timers: Timers):
    """Wrap what ``plan`` calls (module attributes and registered solvers) while planning."""
    import planner.pipeline as pipeline
    import planner.solvers.auto as auto
    from planner.solvers import SOLVERS

    patched = [
        (pipeline, "capture", "capture"),
        (pipeline, "profile", "profile"),
        (pipeline, "build_problem", "problem"),
        (pipeline, "choose", "solve"),
        (pipeline, "rewrite", "rewrite"),
        (auto, "lowest_peak_plan", "lowest_peak"),
    ]
    originals = [
        (module, attribute, getattr(module, attribute)) for module, attribute, _ in patched
    ]
    solvers = dict(SOLVERS)
    for module, attribute, name in patched:
        setattr(module, attribute, timers.wrap(name, getattr(module, attribute)))
    for name in SOLVER_PARTS[:-1]:
        if name in SOLVERS:
            SOLVERS[name] = timers.wrap(name, SOLVERS[name])
    try:
        yield
    finally:
        for module, attribute, original in originals:
            setattr(module, attribute, original)
        SOLVERS.update(solvers)


def measure(family: str, nodes: int, budget: int) -> dict:
    """Plan once, in this process, and return the seconds of each stage."""
    import planner
    from planner import zoo

    started = time.perf_counter()
    planner.plan(*zoo.mlp_chain(depth=2, device="meta"), budget_gb=1.0)
    warm_up = time.perf_counter() - started
    model, inputs = build(family, nodes)
    timers = Timers()
    with timing(timers):
        started, wall = time.process_time(), time.perf_counter()
        plan = planner.plan(model, inputs, budget_bytes=budget)
        total, wall = time.process_time() - started, time.perf_counter() - wall
    seconds = timers.seconds
    solve = sum(seconds.get(name, 0.0) for name in ("solve", *SOLVER_PARTS))
    staged = sum(seconds.get(name, 0.0) for name in ("capture", "profile", "problem", "rewrite"))
    return {
        **{name: seconds.get(name, 0.0) for name in ("capture", "profile", "problem", "rewrite")},
        **{name: seconds[name] for name in SOLVER_PARTS if name in seconds},
        "solve": solve,
        "other": total - staged - solve,
        "total": total,
        "wall": wall,
        "warm_up": warm_up,
        "nodes": plan.problem.size,
        "solver": plan.solver,
        "segments": len(plan.segments),
        "nested": plan.nesting is not None,
        "peak": plan.predicted_peak_bytes,
        "budget": budget,
    }


def child(root: Path, task: list[str]) -> dict:
    """Run ``task`` in a fresh process importing the planner package of ``root``."""
    command = [sys.executable, __file__, "--child", str(root), *task]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child(argv: list[str]) -> None:
    root, kind, family, nodes, value = argv
    sys.path.insert(0, root)  # before the first import of planner
    import warnings

    warnings.simplefilter("ignore")
    if kind == "budget":
        print(json.dumps({"budget": budget_of(family, int(nodes), float(value))}))
    else:
        print(json.dumps(measure(family, int(nodes), int(value))))


def configurations(args) -> list[tuple[str, int]]:
    configs = [
        (family, nodes)
        for nodes in args.nodes
        for family in args.families
        if family != "nested" or nodes <= ROTOR_MAX_NODES
    ]
    return configs + ([] if args.skip_7b else [("7b", 0)])


def cell(figures: list[dict], stage: str) -> str:
    """The fastest time of a stage over repeats, with the parts of "solve" after it."""
    best = min(f.get(stage, 0.0) for f in figures)
    if stage != "solve":
        return f"{best:.2f}"
    fastest = min(figures, key=lambda f: f["solve"])
    parts = [f"{name} {fastest[name]:.2f}" for name in SOLVER_PARTS if fastest.get(name)]
    return f"{best:.2f} ({', '.join(parts)})" if parts else f"{best:.2f}"


def table(rows: list[tuple[str, dict[str, list[dict]]]], labels: list[str]) -> str:
    lines = [
        "| model | nodes | budget MiB | plan (auto) | checkout | "
        + " | ".join(f"{s} s" for s in STAGES)
        + " |",
        "|---|---:|---:|---|---|" + "---:|" * len(STAGES),
    ]
    for name, by_label in rows:
        first = by_label[labels[0]][0]
        plan = f"{first['solver']}, {first['segments']} segments" + (
            " (nested)" if first["nested"] else ""
        )
        head = f"| {name} | {first['nodes']:,} | {first['budget'] / MIB:,.1f} | {plan}"
        for label in labels:
            stages = " | ".join(cell(by_label[label], s) for s in STAGES)
            lines.append(f"{head} | {label} | {stages} |")
            head = "| | | |"
        if len(labels) == 2:
            mine, theirs = (by_label[label] for label in labels)
            ratios = []
            for stage in STAGES:
                a, b = (min(f.get(stage, 0.0) for f in figures) for figures in (mine, theirs))
                ratios.append(f"{a / b:.2f}x" if b > 0.005 else "–")
            lines.append(f"| | | | | ratio | {' | '.join(ratios)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        run_child(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", help="graph sizes (default 1000 10000)")
    parser.add_argument("--families", nargs="+", default=list(PER_UNIT), choices=list(PER_UNIT))
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true", help="1,000 nodes only, no 7B")
    parser.add_argument("--budget-7b-gib", type=float, default=80.0)
    parser.add_argument("--skip-7b", action="store_true")
    parser.add_argument("--against", type=Path, help="another checkout to time side by side")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each plan per checkout")
    parser.add_argument("--out", type=Path, help="append the Markdown report to this file")
    args = parser.parse_args(argv)
    if args.nodes is None:
        args.nodes = [1000] if args.quick else [1000, 10000]
    args.skip_7b |= args.quick
    roots = {"this": ROOT}
    if args.against is not None:
        roots["against"] = args.against.resolve()
    started = time.perf_counter()
    rows = []
    for family, nodes in configurations(args):
        if family == "7b":
            budget, name = (
                int(args.budget_7b_gib * 2**30),
                f"7B decoder at {args.budget_7b_gib:g} GiB",
            )
        else:
            budget = child(ROOT, ["budget", family, str(nodes), str(args.fraction)])["budget"]
            name = family
        figures: dict[str, list[dict]] = {label: [] for label in roots}
        for _ in range(args.repeat):
            for label, root in roots.items():
                figures[label].append(child(root, ["time", family, str(nodes), str(budget)]))
        rows.append((name, figures))
        print(
            "\n".join(table(rows[-1:], list(roots)).splitlines()[2:]), file=sys.stderr, flush=True
        )
    warm_up = min(f["warm_up"] for _, figures in rows for f in figures["this"])
    against = f" against `{args.against}`" if args.against else ""
    report = [
        f"## Planning time ({datetime.date.today().isoformat()})",
        "",
        f"`{' '.join(['benchmarks/planning_time.py', *argv])}`{against} on "
        f"{platform.machine()}, Python {platform.python_version()}; fastest of {args.repeat} "
        f"run(s) per checkout, each in a fresh process after planning a 2-layer MLP (which "
        f"took {warm_up:.2f} s at best: the one-time imports, not counted below). CPU seconds "
        "of the planning process, and the elapsed (wall) seconds of plan.",
        "",
        table(rows, list(roots)),
        "",
        f"Whole run: {time.perf_counter() - started:.0f} s.",
        "",
    ]
    text = "\n".join(report)
    print(text)
    if args.out is not None:
        with open(args.out, "a") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
