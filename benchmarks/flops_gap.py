"""Planner's extra matmul FLOPs at torch.compile's peaks, against compile's (issue 12's target).

    .venv/bin/python benchmarks/flops_gap.py hf-gpt2 hf-llama hf-bert

Reads the compiled peaks ``benchmarks/objective.py`` measured (``benchmarks/results/
objective.json``), so it runs in a minute without compiling: for each model and compiled
variant it plans ``auto`` at that peak with FLOPs as the cost (``objective.FLOPS_FIRST``, as
the partitioner sees it), rewrites the plan as ``plan`` does (replays included) and measures
the planned step's matmul FLOPs (``FlopCounterMode``) and peak (CPU tracker). Prints one line
per variant; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable as a script from a fresh clone, without installing
    sys.path.insert(0, str(ROOT))

from benchmarks import compare, instruments, objective  # noqa: E402
from planner import step  # noqa: E402
from planner.pipeline import prepare  # noqa: E402
from planner.rewrite import rewrite  # noqa: E402
from planner.simulate import simulate  # noqa: E402


def gaps(name: str, results: dict):
    """(variant, compile's extra FLOPs, planner's, planned peak / compile's, predicted peak /
    measured, seconds to solve) per compiled variant of ``name`` in ``results``."""
    model, args = compare.build_model(name, compare.CONFIGS[name], None)
    captured, problem = prepare(model, args)
    by_flops = dataclasses.replace(
        problem,
        seconds=objective.FLOPS_FIRST.seconds(problem.flops, problem.bytes_moved),
        checkpoint_seconds=0.0,
        keep_seconds=0.0,
    )
    unplanned = instruments.step_flops(model, args)
    for key, variant in results["models"][name]["variants"].items():
        if not key.startswith("compile ") or key == "compile 1":
            continue
        begin = time.perf_counter()
        choice = objective._plan(by_flops, variant["peak_bytes"])
        solve = time.perf_counter() - begin
        module = rewrite(captured.graph_module, model, choice, problem=problem)
        extra = instruments.step_flops(module, args) / unplanned - 1
        peak = step.peak_memory(module, args).peak_bytes
        predicted = simulate(problem, choice).peak_bytes
        ratio = peak / variant["peak_bytes"]
        yield key, variant["extra_flops"], extra, ratio, predicted / peak, solve


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", choices=sorted(compare.CONFIGS))
    parser.add_argument("--results", type=Path, default=objective.RESULTS)
    options = parser.parse_args(argv)
    results = json.loads(options.results.read_text())
    for name in options.models:
        for key, compiled, planned, peak, prediction, solve in gaps(name, results):
            print(
                f"{name} @ {key}: compile +{compiled:.2%}, planner +{planned:.2%}; planned peak "
                f"{peak:.4f}x compile's, predicted/measured {prediction:.4f}; solve {solve:.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
