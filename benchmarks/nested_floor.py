"""How the lowest peak grows with depth: flat plans against nested ones (``rotor``).

    .venv/bin/python benchmarks/nested_floor.py                      # blocks 10, 100, 1000
    .venv/bin/python benchmarks/nested_floor.py --blocks 10 100 --out docs/img/nested_floor.png

A residual MLP (``x + W2 relu(W1 x)`` per block, every block boundary an articulation point)
is captured and profiled on the meta device; for each depth the lowest simulated peak of the
best flat plan (``planner.solvers.auto.lowest_flat_plan``) and of ``rotor``
(``solve(problem, 0)``) is printed, as activation bytes (the peak less the fixed memory:
parameters, inputs, gradients are counted in the peak) and as multiples of one block output.
Then ``a + b * f(n)`` is fitted by least squares for ``f = log2`` and ``f = sqrt``, and the
residuals of both fits printed: the smaller one names the growth. With ``--out`` a figure is
written (matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from planner.pipeline import prepare  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.solvers import SOLVERS  # noqa: E402
from planner.solvers.auto import lowest_flat_plan  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def residual_mlp(blocks: int, width: int, batch: int):
    with torch.device("meta"):
        model = nn.Sequential(*(Block(width) for _ in range(blocks)))
        return model, (torch.randn(batch, width),)


def fit(n: np.ndarray, y: np.ndarray, f) -> tuple[float, float, float]:
    """(a, b, root-mean-square residual) of y = a + b f(n)."""
    design = np.stack([np.ones_like(n), f(n)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    return float(a), float(b), float(np.sqrt(np.mean((design @ [a, b] - y) ** 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--out", type=Path, help="write a figure here (PNG)")
    args = parser.parse_args()
    unit = args.width * args.batch * 4  # one block output, float32
    rows = []
    print("| blocks | nodes | flat lowest (blocks) | nested lowest (blocks) | depth | time (s) |")
    print("|---|---|---|---|---|---|")
    for blocks in args.blocks:
        model, inputs = residual_mlp(blocks, args.width, args.batch)
        _, problem = prepare(model, inputs)
        flat = lowest_flat_plan(problem)[1].peak_bytes - problem.fixed_bytes
        start = time.perf_counter()
        choice = SOLVERS["rotor"](problem, 0)
        seconds = time.perf_counter() - start
        nested = simulate(problem, choice).peak_bytes - problem.fixed_bytes
        depth = getattr(choice, "depth", 1)
        rows.append((blocks, flat / unit, nested / unit))
        print(
            f"| {blocks} | {problem.size} | {flat / unit:.1f} | {nested / unit:.1f} | {depth} "
            f"| {seconds:.1f} |"
        )
    n = np.array([r[0] for r in rows], dtype=float)
    for label, column in (("flat", 1), ("nested", 2)):
        y = np.array([r[column] for r in rows])
        for name, f in (("log2(n)", np.log2), ("sqrt(n)", np.sqrt)):
            a, b, residual = fit(n, y, f)
            print(f"{label}: {a:.1f} + {b:.2f} {name} blocks, rms residual {residual:.2f}")
    if args.out:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(n, [r[1] for r in rows], "o-", label="best flat plan")
        ax.plot(n, [r[2] for r in rows], "s-", label="nested (rotor)")
        ax.set(xscale="log", xlabel="residual blocks", ylabel="lowest peak (block outputs)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
