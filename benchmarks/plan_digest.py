"""Every plan ``auto`` makes on a set of models and budgets, as JSON lines: to check that a change
meant only to make planning faster leaves every plan, peak and problem exactly as it was.

    .venv/bin/python benchmarks/plan_digest.py > after.jsonl
    git stash; .venv/bin/python benchmarks/plan_digest.py > before.jsonl; git stash pop
    diff before.jsonl after.jsonl                                 # no output: identical

Each line is one model: a hash of every field of its ``Problem`` (the profile and analysis),
the baseline and lowest peak, then at budgets from the lowest peak to the baseline (and one
below the lowest) what ``auto`` chose (strategy, segments, kept nodes, nesting), its simulated
peak, recompute seconds and FLOPs, and the same for ``greedy``, ``sqrt_n`` and ``rotor`` at the
middle budget. ``--models`` picks some; Hugging Face families need ``transformers``.

``auto`` stops ``optimal`` after ``AUTO_OPTIMAL_SECONDS``: plans then depend on how fast the
machine ran at that moment. The limit is lifted here (``--timed`` keeps it), so that two runs can
be compared.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from planner import zoo  # noqa: E402
from planner.errors import PlanningError  # noqa: E402
from planner.pipeline import prepare  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.solvers import SOLVERS, auto  # noqa: E402
from planner.solvers.auto import choose, lowest_peak  # noqa: E402

FRACTIONS = (
    -0.05,
    0.0,
    0.02,
    0.1,
    0.3,
    0.5,
    0.9,
    1.0,
)  # of the way from the lowest peak to baseline


class Block(nn.Module):
    """A pre-norm residual MLP block: ``x + W2 gelu(W1 norm(x))``."""

    def __init__(self, width: int, norm: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def residual_mlp(blocks: int, width: int, batch: int, norm: bool = True):
    with torch.device("meta"):
        model = nn.Sequential(*(Block(width, norm) for _ in range(blocks)))
        return model, (torch.randn(batch, width),)


def _hf(name: str):
    sys.path.insert(0, str(ROOT / "tests"))
    from torchvision_shim import define_torchvision_operators

    define_torchvision_operators()
    from hf_families import FAMILIES

    torch.manual_seed(0)
    return FAMILIES[name](labels=True)


def _with_kwargs(example):
    model, inputs = example
    return model, inputs, {}


def _gpt_with_labels():
    """zoo GPT with a loss_fn whose labels come through its closure (profiled on stand-ins)."""
    model, (idx,) = zoo.gpt(layers=2, with_loss=False)
    labels = torch.roll(idx, -1, dims=1)

    def loss_fn(logits):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return model, (idx,), {}, loss_fn


MODELS = {
    "mlp": lambda: _with_kwargs(zoo.mlp_chain()),
    "gpt": lambda: _with_kwargs(zoo.gpt(layers=2)),
    "bert": lambda: _with_kwargs(zoo.bert(layers=2)),
    "resnet": lambda: _with_kwargs(zoo.resnet()),
    "unet": lambda: _with_kwargs(zoo.unet()),
    "mlp-meta-1k": lambda: _with_kwargs(zoo.mlp_chain(depth=500, batch=4096, device="meta")),
    "gpt-meta-1k": lambda: _with_kwargs(zoo.gpt(layers=25, device="meta")),
    "residual-meta-1k": lambda: _with_kwargs(residual_mlp(200, 1024, 64)),
    "nested-meta-400": lambda: _with_kwargs(residual_mlp(80, 16, 65536, norm=False)),
    "gpt-loss-fn": _gpt_with_labels,
    "gpt-autocast": lambda: _with_kwargs(zoo.gpt(layers=2)),
    "hf-gpt2": lambda: _hf("gpt2"),
    "hf-t5": lambda: _hf("t5"),
    "hf-llama": lambda: _hf("llama"),
    "hf-qwen2_moe": lambda: _hf("qwen2_moe"),
}


def _digest(value) -> str:
    """A short hash of a Problem field (arrays by their bytes and dtype, the rest by repr)."""
    if isinstance(value, np.ndarray):
        data = value.dtype.str.encode() + np.ascontiguousarray(value).tobytes()
    else:
        data = repr(value).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _result(problem, name: str, choice) -> dict:
    result = simulate(problem, choice)
    return {
        "solver": name,
        "choice": repr(choice),
        "peak": result.peak_bytes,
        "recompute_seconds": result.recompute_seconds,
        "recompute_flops": result.recompute_flops,
    }


def digest(name: str) -> dict:
    model, args, kwargs, *loss_fn = MODELS[name]()
    autocast = name.endswith("-autocast")
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        return _digest_of(name, prepare(model, args, kwargs, loss_fn=(loss_fn or [None])[0])[1])


def _digest_of(name: str, problem) -> dict:
    fields = {
        f.name: _digest(getattr(problem, f.name))
        for f in dataclasses.fields(problem)
        if f.name != "storages"
    }
    fields["storages"] = _digest(problem.storages)
    # No copies at all may be written as () or as one empty entry per node: the same problem.
    fields["buffer_copies"] = _digest(problem.buffer_copies or ((),) * problem.size)
    baseline = simulate(problem, ()).peak_bytes
    lowest = lowest_peak(problem).peak_bytes
    plans = {}
    for fraction in FRACTIONS:
        budget = int(lowest + fraction * (baseline - lowest))
        try:
            plans[str(fraction)] = _result(problem, *choose(problem, budget))
        except PlanningError as error:
            plans[str(fraction)] = {"error": str(error)}
    middle = int(lowest + 0.3 * (baseline - lowest))
    for solver in ("greedy", "sqrt_n", "rotor"):
        plans[solver] = _result(problem, solver, SOLVERS[solver](problem, middle))
    return {
        "model": name,
        "nodes": problem.size,
        "problem": fields,
        "baseline": baseline,
        "lowest": lowest,
        "plans": plans,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--timed", action="store_true", help="keep auto's time limit for optimal (see above)"
    )
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    if not options.timed:
        auto.AUTO_OPTIMAL_SECONDS = math.inf
    for name in options.models:
        print(json.dumps(digest(name), sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
