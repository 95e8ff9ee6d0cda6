"""planner: choose which activations to keep and which to recompute, to train within a budget.

>>> import planner
>>> model, inputs = planner.zoo.gpt()
>>> p = planner.plan(model, inputs, budget_gb=0.05)   # doctest: +SKIP
>>> loss = p.module(*inputs); loss.backward()          # doctest: +SKIP
"""

from planner import zoo
from planner.batch import BatchOption, BatchPlan, plan_batch
from planner.costs import CostModel
from planner.errors import PlanningError
from planner.frontier import Frontier, frontier, frontier_of
from planner.pipeline import plan
from planner.plans import Plan
from planner.problem import Problem
from planner.restore import load
from planner.simulate import Simulation
from planner.solvers import SOLVERS, register
from planner.training import MicroBatch, accumulation_windows, micro_batches

__version__ = "0.1.0"  # the one source of the version: pyproject.toml reads it

__all__ = [
    "accumulation_windows",
    "BatchOption",
    "BatchPlan",
    "CostModel",
    "Frontier",
    "frontier",
    "frontier_of",
    "load",
    "micro_batches",
    "MicroBatch",
    "Plan",
    "plan",
    "plan_batch",
    "PlanningError",
    "Problem",
    "register",
    "Simulation",
    "SOLVERS",
    "zoo",
]
