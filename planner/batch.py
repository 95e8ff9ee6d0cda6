"""``plan_batch()``: choose the micro-batch size, the accumulation steps and the checkpoint plan.

A global batch of ``N`` samples per optimizer step can be trained as ``N / m`` micro-batches of
``m`` samples whose gradients accumulate. Larger micro-batches need more activation memory (so
more recompute to fit); smaller ones need more steps, each of which reads every weight again.
``plan_batch`` prepares the model once per candidate ``m``, plans each one under the budget, and
keeps the candidate with the lowest predicted time per global batch.

Memory under accumulation differs from one step from scratch: after the first micro-batch the
parameter gradients are live for the whole of every later forward and backward, and each backward
allocates a fresh gradient that is added in place and freed. Candidates with more than one step
are planned and simulated on a problem that says so (:func:`accumulation_problem`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from planner.capture import Captured
from planner.costs import CostModel
from planner.errors import InputsRefused, PlanningError, positive_int
from planner.nested import NestedChoice
from planner.options import CaptureOptions
from planner.pipeline import assemble, budget_in_bytes, prepare
from planner.planned_module import PlannedModule
from planner.plans import Plan
from planner.problem import Problem
from planner.simulate import Choice, Segments, Simulation, as_choice, simulate
from planner.solvers.auto import choose, lowest_peak
from planner.units import mib

__all__ = ["BatchOption", "BatchPlan", "accumulation_problem", "plan_batch"]


@dataclass(frozen=True)
class BatchOption:
    """One micro-batch size that ``plan_batch`` considered: a row of ``BatchPlan.alternatives``.

    Peaks are bytes per device for the whole training step; ``predicted_seconds`` is per global
    batch under the cost model (forward + backward as three forwards, plus recompute), or
    ``None`` with ``predicted_peak_bytes`` when the size was not evaluated (``note`` says why).
    """

    micro_batch: int
    steps: int
    predicted_peak_bytes: int | None
    predicted_seconds: float | None
    recompute_fraction: float | None
    segments: int | None
    solver: str | None
    fits: bool
    note: str = ""


@dataclass(frozen=True)
class BatchPlan:
    """The chosen micro-batch size, accumulation steps and checkpoint plan, with the alternatives.

    ``plan.module`` (also ``module``) is the planned model for one micro-batch of
    ``micro_batch`` samples; run ``steps`` of them per optimizer step (see
    :func:`planner.micro_batches`). ``alternatives`` lists every micro-batch size considered,
    the chosen one included, smallest first.
    """

    micro_batch: int
    steps: int
    global_batch: int
    world_size: int
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_seconds: float
    alternatives: tuple[BatchOption, ...]
    planning_seconds: float
    plan: Plan = field(repr=False, compare=False)

    @property
    def module(self):
        """The planned module, a drop-in replacement for the model (shares its parameters)."""
        return self.plan.module

    def table(self) -> list[dict]:
        """The alternatives as plain dicts (for pandas, JSON or a notebook)."""
        return [dataclasses.asdict(option) for option in self.alternatives]

    def __str__(self) -> str:
        per_rank = self.global_batch // self.world_size
        ranks = ""
        if self.world_size > 1:
            ranks = f" over {self.world_size} ranks ({per_rank} per rank)"
        lines = [
            f"BatchPlan: global batch {self.global_batch}{ranks} = {self.steps} x micro-batch "
            f"{self.micro_batch}, {len(self.plan.segments)} checkpointed segments "
            f"(solver {self.plan.solver})",
            f"  budget          {mib(self.budget_bytes):>12}",
            f"  predicted peak  {mib(self.predicted_peak_bytes):>12}",
            f"  predicted time  {_seconds(self.predicted_seconds):>12}   per global batch "
            "(cost model)",
            f"  planning time   {self.planning_seconds:>10.2f} s",
            f"  {'micro':>6} {'steps':>6} {'peak':>12} {'time':>12} {'recompute':>10} "
            f"{'segments':>8}  fits",
        ]
        for o in self.alternatives:
            evaluated = o.predicted_peak_bytes is not None
            peak = mib(o.predicted_peak_bytes) if o.predicted_peak_bytes is not None else "-"
            seconds = _seconds(o.predicted_seconds) if o.predicted_seconds is not None else "-"
            recompute = f"{o.recompute_fraction:.1%}" if evaluated else "-"
            lines.append(
                f"{'>' if o.micro_batch == self.micro_batch else ' '} {o.micro_batch:>6} "
                f"{o.steps:>6} {peak:>12} {seconds:>12} {recompute:>10} "
                f"{o.segments if evaluated else '-':>8}  "
                f"{'yes' if o.fits else 'no '}" + (f"  {o.note}" if o.note else "")
            )
        return "\n".join(lines)

    __repr__ = __str__


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def accumulation_problem(problem: Problem, batch_bytes: int = 0) -> Problem:
    """``problem`` as the second and later micro-batches of an accumulation window see it.

    The accumulated gradients are live from the start (counted as fixed memory); each backward
    still allocates a parameter's new gradient, which ``AccumulateGrad`` adds in place and frees
    once the last contribution has arrived: after the backward of the parameter's first reader
    (``Problem.grad_complete_at``; the node that allocated it, unless several read it: a tied
    embedding's gradient is summed from the output layer's backward to the input's).
    ``batch_bytes``: the rest of the batch's inputs, beside the micro-batch's own, live through
    the window (``micro_batches`` cuts views of the batch; ``accumulation_windows`` reads the
    window ahead).
    """
    return dataclasses.replace(
        problem,
        fixed_bytes=problem.fixed_bytes + problem.gradient_bytes + batch_bytes,
        activation_grad_free=problem.activation_grad_free + problem.grad_complete_at,
    )


def _candidates(per_rank: int, micro_batches) -> list[int]:
    if micro_batches is None:
        return [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    if not isinstance(micro_batches, Iterable) or isinstance(micro_batches, (str, bytes)):
        raise TypeError(
            f"micro_batches must be a list of micro-batch sizes (micro_batches=[{micro_batches!r}]"
            f" for one), got {type(micro_batches).__name__}"
        )
    sizes = sorted({positive_int("each of micro_batches", m) for m in micro_batches})
    if not sizes:
        raise ValueError("micro_batches is empty: give at least one micro-batch size")
    bad = [m for m in sizes if per_rank % m]
    if bad:
        raise ValueError(
            f"micro-batch sizes {bad} do not divide the per-rank batch of {per_rank}: every "
            "accumulation step must have the same size. Use divisors of "
            f"{per_rank}: {[m for m in range(1, per_rank + 1) if per_rank % m == 0]}"
        )
    return sizes


def _inputs(make_inputs, micro_batch: int) -> tuple:
    inputs = make_inputs(micro_batch)
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _input_bytes(inputs) -> int:
    """Bytes of the distinct storages of ``inputs``' tensors (each meta tensor its own)."""
    storages = {}
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = id(t) if t.is_meta else (t.device, storage.data_ptr())
            storages[key] = storage.nbytes()
    return sum(storages.values())


def _batch_input_bytes(make_inputs, per_rank: int) -> int:
    """Bytes of a per-rank batch's inputs, made on the meta device where ``make_inputs``
    leaves the device to torch's default (no memory), else as it makes them."""
    with torch.device("meta"):
        return _input_bytes(_inputs(make_inputs, per_rank))


def _shapes(inputs: tuple) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]


def _batch_dims(shapes: list[tuple[int, ...]], size: int) -> set[tuple[int, int]]:
    """(tensor, dimension) positions of ``shapes`` whose size is ``size``."""
    return {(i, d) for i, shape in enumerate(shapes) for d, n in enumerate(shape) if n == size}


def _check_batch(shapes, micro_batch: int, first: tuple | None) -> tuple:
    """``first`` for the next size: (size, shapes, positions that may hold the batch) of the
    first size checked, the positions narrowed to those that held every size so far; an error
    when ``make_inputs(micro_batch)`` returned inputs of another batch size."""
    found = _batch_dims(shapes, micro_batch)
    if first is None:
        if not found:
            raise ValueError(
                f"make_inputs({micro_batch}) returned tensors of shapes {shapes}, none with a "
                f"dimension of {micro_batch}: make_inputs(batch_size) must return inputs for "
                "batch_size samples"
            )
        return micro_batch, shapes, found
    size, first_shapes, positions = first
    if found & positions:
        return size, first_shapes, found & positions
    i, d = min(positions)
    received = shapes[i][d] if i < len(shapes) and d < len(shapes[i]) else "?"
    raise ValueError(
        f"make_inputs({micro_batch}) returned inputs of batch size {received}, expected "
        f"{micro_batch} (dimension {d} of tensor {i}, which is {size} in make_inputs({size}); "
        f"shapes {shapes} against {first_shapes}): make_inputs(batch_size) must return inputs "
        "for batch_size samples"
    )


def plan_batch(
    model: nn.Module,
    make_inputs,
    budget_gb: float | None = None,
    *,
    global_batch: int,
    budget_bytes: int | None = None,
    world_size: int = 1,
    micro_batches=None,
    solver="auto",
    optimizer_state_bytes: int | None = None,
    cost_model: CostModel | None = None,
    leaf_modules: tuple = (),
    dynamic_shapes: bool = False,
    make_loss_fn=None,
    optimizer=None,
) -> BatchPlan:
    """Choose micro-batch size, accumulation steps and checkpoint plan for a global batch.

    Each candidate micro-batch size ``m`` (by default every divisor of the per-rank batch
    ``global_batch / world_size``) is prepared once (capture, profile, analyse) on
    ``make_inputs(m)`` and planned under the budget. Its predicted time per global batch is
    ``steps x (3 x forward time + recompute time)`` under the cost model, so per-step costs
    that do not shrink with the batch (reading the weights) favour fewer, larger steps, and
    recompute favours smaller ones. The fastest candidate that fits wins; ties go to the larger
    micro-batch.

    Memory is only assumed to grow with the micro-batch: once a size with accumulation cannot
    fit even with maximal recompute, larger sizes with accumulation are reported as skipped
    (the single-step size, without accumulated gradients, is still evaluated). A size the
    model's forward refuses (``BatchNorm1d`` on one sample) is reported as skipped too.

    Parameters
    ----------
    model
        The model, in train mode; never modified.
    make_inputs
        ``make_inputs(batch_size)`` returns example inputs for that many samples: a tensor or a
        tuple of positional arguments. Only their shapes matter; one dimension of them, the
        same for every size, must be ``batch_size``.
    budget_gb, budget_bytes
        Exactly one: the memory of one device for the training step (see :func:`planner.plan`).
    global_batch
        Samples per optimizer step, over all ranks.
    world_size
        Data-parallel ranks; each trains ``global_batch / world_size`` samples per step. The
        prediction is per rank and leaves out communication.
    micro_batches
        Candidate micro-batch sizes, each dividing the per-rank batch (default: all divisors).
    solver, optimizer_state_bytes, cost_model, leaf_modules, dynamic_shapes, optimizer
        As in :func:`planner.plan`.
    make_loss_fn
        ``make_loss_fn(batch_size)`` returns the ``loss_fn`` (see :func:`planner.plan`) for a
        micro-batch of that many samples, e.g. with labels of that size; default: the sum of
        the outputs.

    Returns
    -------
    BatchPlan
        The choice, its plan and module, and every alternative considered (``str()`` is a table).

    Raises
    ------
    ValueError
        For a budget, global batch, world size or micro-batch size that is not valid, a global
        batch not divisible by ``world_size``, a micro-batch size not dividing the per-rank
        batch, or inputs from ``make_inputs(m)`` with no dimension of ``m`` samples (checked
        across sizes: the message gives the expected and the received batch size).
    PlanningError
        When no candidate fits even with maximal recompute; the message gives the minimum memory.
        When the model's forward refuses every size, the error of the first.

    Examples
    --------
    >>> import planner
    >>> model, _ = planner.zoo.mlp_chain(depth=4, width=32)
    >>> make = lambda b: planner.zoo.mlp_chain(depth=4, width=32, batch=b)[1]
    >>> choice = planner.plan_batch(model, make, budget_bytes=2**20, global_batch=8)
    >>> choice.predicted_peak_bytes <= choice.budget_bytes
    True
    """
    start = time.perf_counter()
    budget = budget_in_bytes(budget_gb, budget_bytes)
    global_batch = positive_int("global_batch", global_batch)
    world_size = positive_int("world_size", world_size)
    capture_options = CaptureOptions(leaf_modules, dynamic_shapes)
    if not callable(make_inputs):
        raise ValueError(
            f"make_inputs must be a function of the batch size returning example inputs, got "
            f"{type(make_inputs).__name__}"
        )
    if global_batch % world_size:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by world_size={world_size}: every "
            "rank must train the same number of samples per step"
        )
    per_rank = global_batch // world_size
    sizes = _candidates(per_rank, micro_batches)
    batch_bytes = _batch_input_bytes(make_inputs, per_rank) if sizes[0] < per_rank else 0

    options: list[BatchOption] = []
    # (key, option, captured, problem, segments, simulation, solve seconds, solver name, bytes
    # of the batch's rest held under accumulation or None)
    best: (
        tuple[
            tuple[float, int],
            BatchOption,
            Captured,
            Problem,
            Segments | Choice | NestedChoice,
            Simulation,
            float,
            str,
            int | None,
        ]
        | None
    ) = None
    smallest_minimum: tuple[int, int, int] | None = None  # (micro-batch, steps, lowest peak)
    too_big = None  # the smallest accumulating size that cannot fit at all
    first = None  # the first size's inputs: where they hold the batch (see _check_batch)
    refused = None  # the first size the model's forward refused (see InputsRefused)
    for m in sizes:
        steps = per_rank // m
        if too_big is not None and steps > 1:
            options.append(
                BatchOption(
                    m,
                    steps,
                    None,
                    None,
                    None,
                    None,
                    None,
                    False,
                    f"skipped: micro-batch {too_big} already cannot fit",
                )
            )
            continue
        inputs = _inputs(make_inputs, m)
        first = _check_batch(_shapes(inputs), m, first)
        try:
            captured, problem = prepare(
                model,
                inputs,
                cost_model=cost_model,
                optimizer_state_bytes=optimizer_state_bytes,
                capture_options=capture_options,
                loss_fn=None if make_loss_fn is None else make_loss_fn(m),
                optimizer=optimizer,
            )
        except InputsRefused as error:
            # The model cannot train on m samples (BatchNorm on one): other sizes may.
            refused = refused or error
            reason = f"{type(error.__cause__).__name__}: {error.__cause__}"
            options.append(
                BatchOption(m, steps, None, None, None, None, None, False, f"skipped: {reason}")
            )
            continue
        rest = max(0, batch_bytes - _input_bytes(inputs)) if steps > 1 else None
        if rest is not None:
            problem = accumulation_problem(problem, rest)
        solve_start = time.perf_counter()
        name, segments = choose(problem, budget, solver)
        solve_seconds = time.perf_counter() - solve_start
        result = simulate(problem, segments)
        step_seconds = problem.step_seconds
        fits = result.peak_bytes <= budget
        note = ""
        if not fits:
            minimum = lowest_peak(problem)
            if smallest_minimum is None:
                smallest_minimum = (m, steps, minimum.peak_bytes)
            if minimum.peak_bytes > budget:
                note = f"needs at least {mib(minimum.peak_bytes)}"
                if steps > 1:
                    too_big = m
            else:
                note = f"solver {name} found no fit (lowest {mib(minimum.peak_bytes)})"
        seconds = steps * (step_seconds + result.recompute_seconds)
        option = BatchOption(
            micro_batch=m,
            steps=steps,
            predicted_peak_bytes=result.peak_bytes,
            predicted_seconds=seconds,
            recompute_fraction=result.recompute_seconds / step_seconds if step_seconds else 0.0,
            segments=len(
                segments.segments
                if isinstance(segments, NestedChoice)
                else as_choice(segments).segments
            ),
            solver=name,
            fits=fits,
            note=note,
        )
        options.append(option)
        key = (seconds, -m)
        if fits and (best is None or key < best[0]):
            best = (key, option, captured, problem, segments, result, solve_seconds, name, rest)

    if best is None and smallest_minimum is None:
        # The forward refused every size (nothing else stops a size before the first fails).
        assert refused is not None
        raise refused
    if best is None:
        assert smallest_minimum is not None
        m, steps, needed = smallest_minimum
        raise PlanningError(
            f"no micro-batch size fits a budget of {mib(budget)} ({budget} bytes): the "
            f"smallest, micro-batch {m} ({steps} accumulation steps), needs at least "
            f"{mib(needed)} ({needed} bytes) even with maximal recompute"
            + (
                f", the batch's inputs held by the loop included ({mib(batch_bytes)})"
                if steps > 1 and batch_bytes
                else ""
            )
            + f". Raise the budget to at least budget_bytes={needed}"
            + (", or try smaller micro-batches." if m > 1 else ", or shard the model (FSDP).")
        )
    key, option, captured, problem, segments, result, solve_seconds, name, rest = best
    predicted_seconds = key[0]
    chosen = assemble(
        model,
        captured,
        problem,
        segments,
        solver=name,
        budget_bytes=budget,
        solve_seconds=solve_seconds,
        started=start,
        capture_options=capture_options,
        accumulation_bytes=rest,
    )
    if isinstance(optimizer, torch.optim.Optimizer):
        cast(PlannedModule, chosen.module)._planner.watch_optimizer(optimizer)
    options = [
        dataclasses.replace(o, note="chosen" + (f"; {o.note}" if o.note else ""))
        if o is option
        else o
        for o in options
    ]
    return BatchPlan(
        micro_batch=option.micro_batch,
        steps=option.steps,
        global_batch=global_batch,
        world_size=world_size,
        budget_bytes=budget,
        predicted_peak_bytes=result.peak_bytes,
        predicted_seconds=predicted_seconds,
        alternatives=tuple(options),
        planning_seconds=time.perf_counter() - start,
        plan=chosen,
    )
