"""What a checkpoint call and a kept node add to a training step, in this checkout and another.

    .venv/bin/python benchmarks/call_overhead.py --against /work/main    # about 2 minutes

Two chains of 32 blocks, batch 32, d 64, one thread: ``mlp`` (``Linear`` + ``ReLU``) and
``gpt`` (LayerNorm, two ``Linear`` layers and seven pointwise ops, a residual add). Each is
stepped unplanned, with one checkpointed segment per block, and with each block's ``Linear``
layers kept as well, interleaved; the medians of the per-step differences give the seconds per
segment and per kept node. Each checkout runs in a process of its own, alternately
(``--rounds``), so that both meet the same load; each round's figures are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _measure(kind: str, reps: int) -> dict[str, float]:
    import torch
    from torch import nn

    from planner import step
    from planner.pipeline import prepare
    from planner.problem import compute_nodes
    from planner.rewrite import rewrite
    from planner.simulate import Choice

    class Block(nn.Module):  # pointwise work around two matmuls, as in a transformer's MLP
        def __init__(self, d: int):
            super().__init__()
            self.ln, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            h = self.a(self.ln(x))
            h = torch.nn.functional.gelu(h) * torch.sigmoid(h) + 0.5 * h
            return x + torch.tanh(self.b(h)) * 0.1

    torch.manual_seed(0)
    blocks, d = 32, 64
    make = (
        (lambda: nn.Sequential(nn.Linear(d, d), nn.ReLU())) if kind == "mlp" else (lambda: Block(d))
    )
    model = nn.Sequential(*[make() for _ in range(blocks)])
    x = torch.randn(32, d)
    captured, problem = prepare(model, (x,))
    per = problem.size // blocks
    segments = tuple((a, a + per) for a in range(0, problem.size, per))
    gm = captured.graph_module
    keep = frozenset(
        i
        for i, node in enumerate(compute_nodes(gm))
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear)
    )
    steps = {
        "none": model,
        "checkpoint": rewrite(gm, model, Choice(segments)),
        "keep": rewrite(gm, model, Choice(segments, keep)),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(reps + 1):  # the first round warms up
        for name in order[r % 3 :] + order[: r % 3]:
            step.clear_grads(steps[name])
            begin = time.perf_counter()
            step.training_step(steps[name], (x,))
            if r:
                times[name].append(time.perf_counter() - begin)

    def per_unit(more: str, less: str, units: int) -> float:
        return statistics.median(a - b for a, b in zip(times[more], times[less])) / units

    return {
        "step_seconds": statistics.median(times["none"]),
        "per_segment": per_unit("checkpoint", "none", len(segments)),
        "per_kept_node": per_unit("keep", "checkpoint", len(keep)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another checkout to measure alternately")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--child", choices=["mlp", "gpt"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:  # one measurement, with planner imported from opts.root
        sys.path.insert(0, str(opts.root))
        import torch

        torch.set_num_threads(1)
        print(json.dumps(_measure(opts.child, opts.reps)))
        return
    roots = {"this": ROOT, **({"against": opts.against.resolve()} if opts.against else {})}
    for r in range(opts.rounds):
        for kind in ("mlp", "gpt"):
            for label, root in roots.items():
                command = [__file__, "--child", kind, "--root", str(root), "--reps", str(opts.reps)]
                out = subprocess.run(
                    [sys.executable, *command],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                m = json.loads(out.splitlines()[-1])
                print(
                    f"round {r} {kind} {label:8s} ({root}): step {m['step_seconds'] * 1e3:.2f} ms, "
                    f"per segment (its recompute included) {m['per_segment'] * 1e6:.0f} us, "
                    f"per kept node {m['per_kept_node'] * 1e6:.0f} us",
                    flush=True,
                )


if __name__ == "__main__":
    main()
