"""planner: choose which activations to keep and which to recompute, to train within a budget.

>>> import planner
>>> model, inputs = planner.zoo.gpt()
>>> p = planner.plan(model, inputs, budget_gb=0.05)   # doctest: +SKIP
>>> loss = p.module(*inputs); loss.backward()          # doctest: +SKIP

``__all__`` is what a user plans with, then the advanced tier for planning by hand, one capture
for many solves: ``prepare``, ``Problem``, ``frontier_of`` and ``Simulation`` (with
``planner.simulate.simulate``, which keeps its module's name). The example models
(``planner.zoo``) and the solver registry (``planner.solvers``) are submodules.
"""

# Submodules reachable as attributes after `import planner` (planner.zoo.gpt(),
# planner.overheads.checkpoint_overheads()).
from planner import overheads as overheads
from planner import solvers as solvers
from planner import zoo as zoo
from planner.batch import BatchOption, BatchPlan, plan_batch
from planner.costs import CostModel
from planner.errors import PlanningError
from planner.frontier import Frontier, frontier, frontier_of
from planner.options import CaptureOptions
from planner.pipeline import plan, prepare
from planner.plans import Plan
from planner.problem import Problem
from planner.restore import load
from planner.simulate import Simulation
from planner.training import MicroBatch, accumulation_windows, micro_batches
from planner.version import __version__ as __version__

__all__ = [
    # Planning
    "plan",
    "Plan",
    "PlanningError",
    "load",
    "CaptureOptions",
    "CostModel",
    "frontier",
    "Frontier",
    "plan_batch",
    "BatchPlan",
    "BatchOption",
    "micro_batches",
    "accumulation_windows",
    "MicroBatch",
    # Advanced: planning by hand
    "prepare",
    "Simulation",
    "Problem",
    "frontier_of",
]
