"""What the planned module's per-call checks cost (root parameters and buffers, training flags,
changed modules and attributes, tensor arguments and dtypes), against one forward of the zoo
GPT.

    .venv/bin/python benchmarks/check_cost.py        # about 20 s

Models: the zoo GPT at its defaults (CPU, timed forward under ``torch.no_grad``) and a
7B-parameter-class decoder (``zoo.gpt(**zoo.gpt_config_7b(), device="meta")``: only the module
count matters to the checks). Prints one Markdown table row per model.
"""

from __future__ import annotations

import timeit
import warnings

import torch

import planner
from planner import zoo


def check_seconds(module, args) -> float:
    """The best of 5 means over 2,000 runs of what ``PlannedModule`` checks before each call."""
    snapshot, name = module._planner, type(module).__name__

    def checks():
        module._read_root_state(snapshot)
        snapshot.mode_changed()
        snapshot.check_unchanged(name)
        snapshot.call_form(args, {})

    return min(timeit.repeat(checks, number=2000, repeat=5)) / 2000


def row(label, model, inputs, budget_gb, time_forward) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = planner.plan(model, inputs, budget_gb=budget_gb)
    seconds = check_seconds(p.module, inputs)
    forward = "-"
    if time_forward:
        with torch.no_grad():
            p.module(*inputs)
            forward_seconds = min(timeit.repeat(lambda: p.module(*inputs), number=3, repeat=3)) / 3
        forward = f"{forward_seconds * 1e3:.1f} ms ({seconds / forward_seconds:.3%})"
    snapshot = p.module._planner
    return (
        f"| {label} | {len(snapshot.module_dicts)} | {len(snapshot.children)} | "
        f"{len(snapshot.attributes)} | {seconds * 1e6:.1f} us | {forward} |"
    )


def main() -> None:
    print("| model | modules | traced through | attributes | checks per call | forward |")
    print("|---|---|---|---|---|---|")
    print(row("zoo GPT (CPU)", *zoo.gpt(), 10, time_forward=True))
    print(row("7B-class GPT (meta)", *zoo.gpt(**zoo.gpt_config_7b(), device="meta"), 80, False))


if __name__ == "__main__":
    main()
