"""How long ``auto``'s solve (``planner.solvers.auto.choose``) takes alone, on prepared problems.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/solve_time.py --repeat 3 --against DIR

Each model is captured, profiled and analysed once (``prepare``, with this checkout's
planner) and its ``Problem`` pickled; each solve then runs in a fresh process that loads it
(with DIR's planner for ``--against``, so the two checkouts solve the very same problem), the
checkouts alternating ``--repeat`` times, and the fastest run of each is reported: CPU seconds
(``time.process_time``) of ``choose`` at the model's budget, which is what the solve stage of
``benchmarks/planning_time.py`` and ``benchmarks/huggingface_stages.py`` times, without the
stages before it. Budgets: the Hugging Face families (``tests/hf_families.py``, labels on,
batch 3, length 16) halfway between the lowest peak and the baseline, as
``huggingface_stages.py`` plans them; the zoo GPT on the meta device at about 1,000 and
10,000 nodes at ``planning_time.py``'s budget (greedy's lowest peak plus half the way to the
baseline).
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("t5", "qwen2_moe", "gpt-1k", "gpt-10k")


def prepared(name: str):
    """(Problem, budget) of one model (see the module docstring)."""
    from planner.pipeline import prepare
    from planner.simulate import simulate
    from planner.solvers.auto import lowest_peak

    if name.startswith("gpt-"):
        import planning_time

        nodes = {"gpt-1k": 1_000, "gpt-10k": 10_000}[name]
        _, problem = prepare(*planning_time.build("gpt", nodes))
        return problem, planning_time.budget_of("gpt", nodes, 0.5)
    import plan_digest

    model, args, kwargs = plan_digest._hf(name)
    _, problem = prepare(model, args, kwargs)
    lowest, baseline = lowest_peak(problem).peak_bytes, simulate(problem, ()).peak_bytes
    return problem, int(lowest + 0.5 * (baseline - lowest))


def child(root: str, path: str) -> None:
    """Solve the pickled (problem, budget) with the planner of ``root``; print its seconds."""
    import time

    sys.path.insert(0, root)
    from planner.solvers.auto import choose

    with open(path, "rb") as handle:
        problem, budget = pickle.load(handle)
    started = time.process_time()
    name, _ = choose(problem, budget)
    print(json.dumps({"seconds": time.process_time() - started, "plan": name}))


def solve_seconds(root: Path, path: str) -> dict:
    command = [sys.executable, __file__, "--child", str(root), path]
    return json.loads(subprocess.run(command, check=True, capture_output=True).stdout)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:4])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout to time side by side")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    roots = {"this": ROOT} | ({"against": options.against.resolve()} if options.against else {})
    print("| model | nodes | budget | plan | " + " | ".join(f"{r} s" for r in roots) + " |")
    print("|---|---:|---:|---|" + "---:|" * len(roots))
    with tempfile.TemporaryDirectory() as folder:
        for name in options.models:
            problem, budget = prepared(name)
            path = str(Path(folder) / f"{name}.pickle")
            with open(path, "wb") as handle:
                pickle.dump((problem, budget), handle)
            runs: dict[str, list[dict]] = {label: [] for label in roots}
            for _ in range(options.repeat):
                for label, root in roots.items():
                    runs[label].append(solve_seconds(root, path))
            best = {label: min(r["seconds"] for r in found) for label, found in runs.items()}
            ratio = f" ({best['this'] / best['against']:.2f}x)" if "against" in best else ""
            seconds = " | ".join(f"{s:.3f}" for s in best.values())
            plan = runs["this"][0]["plan"]
            print(f"| {name} | {problem.size:,} | {budget:,} | {plan} | {seconds}{ratio} |")


if __name__ == "__main__":
    main()
