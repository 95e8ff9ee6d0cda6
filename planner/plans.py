"""``Plan``: a checkpointing plan, the module that carries it out, and how it shows itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch import fx

from planner import serialize, viz
from planner.nested import NestedChoice
from planner.options import CaptureOptions
from planner.problem import Problem
from planner.simulate import (
    Choice,
    Segments,
    call_seconds,
    recompute_costs,
    replayed_nodes,
    simulate,
)
from planner.units import mib


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan and the module that carries it out.

    ``module`` is a drop-in replacement for the model (same call signature, outputs, parameters
    and ``state_dict`` keys). Peaks are bytes of the whole training step (parameters, gradients,
    optimizer state when given, activations, working memory); ``predicted_overhead`` is the
    recompute time as a fraction of a step without checkpointing (forward + backward, taken as
    three forwards), under the cost model. ``capture_options`` and ``training`` record how the
    model was captured (``save`` writes them, so that ``load`` captures it the same way).
    """

    segments: Segments
    solver: str
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    predicted_overhead: float
    recompute_flops: float
    capture_method: str
    solve_seconds: float
    planning_seconds: float
    module: fx.GraphModule = field(repr=False, compare=False)
    problem: Problem = field(repr=False, compare=False)
    input_spec: dict | None = field(default=None, repr=False, compare=False)
    capture_options: CaptureOptions = field(default=CaptureOptions(), repr=False, compare=False)
    training: bool = field(default=True, repr=False, compare=False)

    keep: frozenset[int] = frozenset()  # positions of kept nodes inside segments
    # The whole tree when segments hold segments (planner.nested); ``segments`` is its top level.
    nesting: NestedChoice | None = field(default=None, repr=False)
    # A plan of plan_batch's for the later micro-batches of an accumulation window: gradients
    # held from the start, and these bytes of the rest of the batch (``accumulation_problem``).
    accumulation_bytes: int | None = field(default=None, repr=False, compare=False)

    @property
    def choice(self) -> Choice | NestedChoice:
        """The segments and kept nodes (or the nested segments), as ``simulate`` takes them."""
        return self.nesting if self.nesting is not None else Choice(self.segments, self.keep)

    @property
    def replayed(self) -> frozenset[int]:
        """Positions of the nodes the recomputes replay, computing nothing their values need
        (``planner.choice.replayed_nodes``); none in a nested plan."""
        if self.nesting is not None:
            return frozenset()
        return frozenset(np.flatnonzero(replayed_nodes(self.problem, self.choice)).tolist())

    @property
    def baseline_fixed_bytes(self) -> int:
        """Parameters, buffers, inputs and optimizer state: memory no plan can remove."""
        return self.problem.fixed_bytes

    def segment_table(self) -> list[dict]:
        """One row per checkpointed segment: positions, node names, inputs and dropped bytes.

        ``input_tensors`` and ``input_bytes`` are the activation storages made before the
        segment and read inside it: the checkpoint's inputs, which it holds until its backward
        (as ``simulate`` counts them). Tensors that merely cross the cut on their way to later
        nodes are not among them. Every rendering of the plan (``str``, the notebook HTML, the
        graph drawing) shows these rows. Kept nodes (``keep``) are neither dropped nor
        recomputed: ``kept`` names them and ``kept_bytes`` is what their cache holds from the
        forward to the recompute. ``replayed`` names the nodes the recompute replays
        (``replayed``).
        """
        replayed = self.replayed
        saved = self.problem.saved_bytes_per_node()
        saved[list(self.keep)] = 0
        top = Choice(self.segments, self.keep)  # a nested plan's top level
        seconds, _ = recompute_costs(self.problem, top)
        nests = self.nesting.segments if self.nesting is not None else (None,) * len(self.segments)
        rows = []
        for k, ((start, stop), nest) in enumerate(zip(self.segments, nests)):
            tensors, nbytes = _segment_inputs(self.problem, start, stop)
            if nest is not None and nest.inner:  # every recompute inside it, nested ones too
                recompute = simulate(self.problem, NestedChoice((nest,))).recompute_seconds
            else:
                recompute = float(seconds[start:stop].sum()) + call_seconds(
                    self.problem, Choice(((start, stop),), top.keep & set(range(start, stop)))
                )
            rows.append(
                {
                    "segment": k,
                    "start": start,
                    "stop": stop,
                    "nodes": stop - start,
                    "first": self.problem.names[start],
                    "last": self.problem.names[stop - 1],
                    "input_tensors": tensors,
                    "input_bytes": nbytes,
                    "dropped_bytes": int(saved[start:stop].sum()),
                    "recompute_seconds": recompute,
                    "nested": 0 if nest is None else sum(1 for _ in nest.walk()) - 1,
                    "kept": [self.problem.names[i] for i in sorted(self.keep) if start <= i < stop],
                    "kept_bytes": int(
                        sum(int(self.problem.kept_bytes[i]) for i in self.keep if start <= i < stop)
                    ),
                    "replayed": [
                        self.problem.names[i] for i in sorted(replayed) if start <= i < stop
                    ],
                }
            )
        return rows

    def __str__(self) -> str:
        kept = f", {len(self.keep)} nodes kept inside them" if self.keep else ""
        replayed = self.replayed
        kept += f", {len(replayed)} replayed in their recomputes" if replayed else ""
        if self.nesting is not None:
            inner = sum(1 for _ in self.nesting.walk()) - len(self.segments)
            kept += f", holding {inner} nested segments ({self.nesting.depth} levels)"
        lines = [
            f"Plan: {len(self.segments)} checkpointed segments{kept} over {self.problem.size} "
            f"nodes (solver {self.solver}, captured by {self.capture_method})",
            f"  budget          {mib(self.budget_bytes):>12}",
            f"  predicted peak  {mib(self.predicted_peak_bytes):>12}"
            f"   (baseline {mib(self.baseline_peak_bytes)}, "
            f"fixed {mib(self.problem.fixed_bytes)})",
            f"  recompute       {self.predicted_overhead:>11.1%}   of a step "
            f"({self.recompute_flops:.3g} FLOPs)",
            f"  planning time   {self.planning_seconds:>10.2f} s   "
            f"(solve {self.solve_seconds:.3f} s)",
            *self._step_lines(),
        ]
        rows = self.segment_table()
        if rows:
            header = (
                f"  {'seg':>4} {'nodes':>6} {'from':<24} {'to':<24} {'inputs':>10} {'dropped':>10}"
            )
            header += f" {'kept':>5} {'kept bytes':>10}" if self.keep else ""
            header += f" {'replayed':>8}" if replayed else ""
            lines.append(header + (f" {'nested':>6}" if self.nesting is not None else ""))
            for r in rows:
                line = (
                    f"  {r['segment']:>4} {r['nodes']:>6} {r['first']:<24.24} "
                    f"{r['last']:<24.24} {mib(r['input_bytes']):>10} "
                    f"{mib(r['dropped_bytes']):>10}"
                )
                if self.keep:
                    line += f" {len(r['kept']):>5} {mib(r['kept_bytes']):>10}"
                if replayed:
                    line += f" {len(r['replayed']):>8}"
                if self.nesting is not None:
                    line += f" {r['nested']:>6}"
                lines.append(line)
        return "\n".join(lines)

    def _step_lines(self) -> list[str]:
        """The loss, autocast and optimizer parts of the step, when it has them."""
        problem, lines = self.problem, []
        if problem.autocast_cache_bytes:
            lines.append(
                f"  autocast cache  {mib(problem.autocast_cache_bytes):>12}   low-precision "
                "weight copies, live all step (part of fixed)"
            )
        if problem.has_loss:
            lines.append(
                f"  loss_fn         {mib(problem.created_bytes[-1]):>12}   kept for its backward, "
                f"which allocates {mib(problem.activation_grad_alloc[-1])}"
            )
        if problem.optimizer_state_bytes or problem.optimizer_step_bytes:
            step = simulate(problem, self.choice).optimizer_step_bytes
            peak = "; the step's peak" if step >= self.predicted_peak_bytes else ""
            lines.append(
                f"  optimizer       {mib(problem.optimizer_state_bytes):>12}   state; step() "
                f"holds {mib(step)} with {mib(problem.optimizer_step_bytes)} of "
                f"temporaries{peak}"
            )
        return lines

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return viz.plan_html(self)

    def draw(self, path=None, ax=None, **options):
        """Draw the graph, segments coloured, boundaries highlighted; see planner.viz.draw."""
        return viz.draw(self, path=path, ax=ax, **options)

    def plot_memory(self, measured=None, ax=None, **options):
        """Predicted memory over the step, baseline vs plan vs budget; see viz.plot_memory."""
        return viz.plot_memory(self, measured, ax=ax, **options)

    def save(self, path, example_inputs=None, example_kwargs=None):
        """Write the plan as JSON (no pickle); load it with ``planner.load(path, model)``."""

        return serialize.save(self, path, example_inputs, example_kwargs)


def _segment_inputs(problem: Problem, start: int, stop: int) -> tuple[int, int]:
    """(count, bytes) of the activation storages made before ``start`` and read in the segment."""
    a = problem.storage_arrays
    inside = (a.read_node >= start) & (a.read_node < stop)
    kept = np.unique(a.read_storage[inside & (a.producer[a.read_storage] < start)])
    return int(kept.size), int(a.nbytes[kept].sum())
