"""The lowest peaks reached against each zoo model's physical floor, and plans at 20% of the
activation memory, predicted beside measured.

    .venv/bin/python benchmarks/floors.py                    # U-Net, ResNet, GPT, BERT
    .venv/bin/python benchmarks/floors.py --models gpt --no-page

Each zoo model (default sizes, on the CPU) is captured and profiled once. Reported per model:

- its physical floor (``planner.nested.physical_floor``: what any recompute strategy must hold
  at once) and the peak without checkpointing;
- the lowest peak of the best flat plan (``planner.solvers.auto.lowest_flat_plan``) and the
  lowest peak reached (``lowest_peak_plan``: ``rotor``'s nested plans included), each as the
  plan ``auto`` chooses at that peak as its budget, with its recompute (cost-model time as a
  share of a step, and FLOPs) and its peak as a multiple of the floor (target: at most 1.5x);
- ``auto``'s plan at parameters + gradients + 20% of the activations (the fixed memory plus
  the gradients plus 20% of the measured peak above them), where the floor allows.

Every plan is rewritten and its step measured with the CPU live-storage tracker
(``planner.step.peak_memory``) beside the prediction. The results go to
``benchmarks/results/floors.json`` and, unless ``--no-page``, into their section of
``docs/benchmarks.md`` (``benchmarks/report.py`` keeps it when it rewrites the page).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from planner import zoo  # noqa: E402
from planner.nested import NestedChoice, physical_floor  # noqa: E402
from planner.pipeline import prepare  # noqa: E402
from planner.rewrite import rewrite  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.solvers.auto import choose, lowest_flat_plan, lowest_peak_plan  # noqa: E402
from planner.step import peak_memory  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "floors.json"
PAGE = ROOT / "docs" / "benchmarks.md"
HEADING = "## Lowest peaks against the physical floor"
SHARE = 0.2  # of the activation memory, the budget
MiB = 2**20


def _plan_row(problem, captured, model, args, budget: int) -> dict:
    """``auto``'s plan at ``budget``: predicted and measured peak, recompute, shape."""
    strategy, choice = choose(problem, budget)
    predicted = simulate(problem, choice, record=True)
    assert predicted.timeline is not None
    phase, position, _ = max(predicted.timeline, key=lambda step: step[2])
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    nested = isinstance(choice, NestedChoice) and choice.flat() is None
    segments = choice.segments if hasattr(choice, "segments") else choice
    return {
        "budget_bytes": budget,
        "strategy": strategy,
        "predicted_bytes": predicted.peak_bytes,
        "measured_bytes": peak_memory(planned, args).peak_bytes,
        "recompute_share": predicted.recompute_seconds / problem.step_seconds,
        "recompute_flops_share": predicted.recompute_flops / (3 * float(problem.flops.sum())),
        "segments": len(segments),
        "depth": choice.depth if nested else 1,
        "peak_at": f"{phase} of {problem.names[position]}",
    }


def measure(name: str) -> dict:
    model, args = zoo.build(name)
    captured, problem = prepare(model, args)
    baseline = peak_memory(model, args).peak_bytes
    held = problem.fixed_bytes + problem.gradient_bytes
    share_budget = int(held + SHARE * (baseline - held))
    floor = physical_floor(problem)
    lowest = lowest_peak_plan(problem)[1].peak_bytes
    flat = lowest_flat_plan(problem)[1].peak_bytes
    return {
        "model": name,
        "nodes": problem.size,
        "fixed_bytes": problem.fixed_bytes,
        "gradient_bytes": problem.gradient_bytes,
        "baseline_predicted_bytes": simulate(problem, ()).peak_bytes,
        "baseline_measured_bytes": baseline,
        "floor_bytes": floor,
        "flat": _plan_row(problem, captured, model, args, flat),
        "lowest": _plan_row(problem, captured, model, args, lowest),
        "share_budget_bytes": share_budget,
        "at_share": (
            _plan_row(problem, captured, model, args, share_budget)
            if share_budget >= lowest
            else None
        ),
    }


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:.2f}"


def _plan_cells(row: dict) -> str:
    shape = f"{row['segments']} seg" + (f", depth {row['depth']}" if row["depth"] > 1 else "")
    return (
        f"{_mib(row['predicted_bytes'])} / {_mib(row['measured_bytes'])} | "
        f"{row['recompute_share']:.1%} ({row['recompute_flops_share']:.1%}) | "
        f"{row['strategy']}, {shape}"
    )


def render(results: dict) -> list[str]:
    """The page section (markdown lines) for ``results``."""
    out = [
        HEADING,
        "",
        f"`{results['command']}` ({results['date']}; zoo models at default sizes, CPU, torch "
        f"{results['torch']}). Peaks in MiB, predicted / measured (the CPU live-storage "
        "tracker; it also counts the loss's scalars, 4-8 bytes). The **floor** "
        "(`planner.nested.physical_floor`) is what any recompute strategy holds at once: fixed "
        "memory plus, at the heaviest moment, one node's inputs, outputs and workspace (with the "
        "graph outputs made before it), or one node's saved tensors and backward allocation with "
        "the gradients pending by then (parameter gradients accumulated, the outputs' and "
        "activations' gradients), or the optimizer step. Recompute: cost-model time as a share "
        "of a step (FLOPs share in brackets). Each plan is the one `auto` chooses with that peak "
        "as its budget.",
        "",
        "| model | nodes | none | floor | best flat lowest | flat recompute | lowest | lowest "
        "/ floor | lowest recompute | lowest plan |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["models"]:
        flat, low = r["flat"], r["lowest"]
        out.append(
            f"| {r['model']} | {r['nodes']} | {_mib(r['baseline_predicted_bytes'])} / "
            f"{_mib(r['baseline_measured_bytes'])} | {_mib(r['floor_bytes'])} | "
            f"{_mib(flat['predicted_bytes'])} / {_mib(flat['measured_bytes'])} | "
            f"{flat['recompute_share']:.1%} | "
            f"{_mib(low['predicted_bytes'])} / {_mib(low['measured_bytes'])} | "
            f"{low['predicted_bytes'] / r['floor_bytes']:.2f}x | "
            f"{low['recompute_share']:.1%} ({low['recompute_flops_share']:.1%}) | "
            f"{low['strategy']}, {low['segments']} seg"
            + (f", depth {low['depth']}" if low["depth"] > 1 else "")
            + f"; peaks at the {low['peak_at']} |"
        )
    over = [
        r["model"]
        for r in results["models"]
        if r["lowest"]["predicted_bytes"] > 1.5 * r["floor_bytes"]
    ]
    measured_under = [
        r["model"] for r in results["models"] if r["lowest"]["measured_bytes"] < r["floor_bytes"]
    ]
    notes = [f"Above 1.5x the floor: {', '.join(over) if over else 'none'}."]
    if measured_under:
        notes.append(
            f"Measured under the floor: {', '.join(measured_under)} (the floor comes from the "
            "same profile as the prediction: where the profile reads over, so does the floor)."
        )
    out += ["", " ".join(notes)]
    out += [
        "",
        f"At parameters + gradients + {results['share']:.0%} of the activations (fixed memory "
        f"and gradients, plus {results['share']:.0%} of the measured peak above them):",
        "",
        "| model | budget | predicted / measured | recompute | plan |",
        "|---|---:|---:|---:|---|",
    ]
    for r in results["models"]:
        budget = _mib(r["share_budget_bytes"])
        if r["at_share"] is None:
            out.append(
                f"| {r['model']} | {budget} | below the floor ({_mib(r['floor_bytes'])}) "
                f"and the lowest peak ({_mib(r['lowest']['predicted_bytes'])}) | | no plan |"
            )
        else:
            out.append(f"| {r['model']} | {budget} | {_plan_cells(r['at_share'])} |")
    return [*out, ""]


def write_section(page: Path, section: list[str]) -> None:
    """Put ``section`` in place of the page's own (or before "How it is measured")."""
    lines = page.read_text().split("\n")
    if HEADING in lines:
        start = lines.index(HEADING)
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
    else:
        start = end = lines.index("## How it is measured")
    page.write_text("\n".join([*lines[:start], *section, *lines[end:]]))


def main(argv=None) -> dict:
    import datetime

    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["unet", "resnet", "gpt", "bert"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--no-page", action="store_true", help="leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    results = {
        "command": " ".join(
            ["python benchmarks/floors.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "share": SHARE,
        "models": [],
    }
    for name in args.models:
        results["models"].append(measure(name))
        print(json.dumps(results["models"][-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    section = render(results)
    print("\n".join(section))
    if not args.no_page:
        write_section(args.page, section)
    return results


if __name__ == "__main__":
    main()
