"""Solvers choose which segments to checkpoint. Every solver has one signature::

    solve(problem: Problem, budget_bytes: int, **options) -> tuple[tuple[int, int], ...]

returning half-open ``(start, stop)`` segments of positions. Solvers only choose: shared code
(``planner.simulate``) checks the choice against the budget and ``planner.rewrite`` builds it.
Any callable with this signature can be passed wherever a solver name is accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from planner.nested import NestedChoice
from planner.problem import Problem
from planner.simulate import Choice, Segments


class Solver(Protocol):
    def __call__(
        self, problem: Problem, budget_bytes: int, **options
    ) -> Segments | Choice | NestedChoice: ...


SOLVERS: dict[str, Solver] = {}


AnySolver = TypeVar("AnySolver", bound=Solver)


def register(name: str) -> Callable[[AnySolver], AnySolver]:
    """Decorator that makes a solver available by ``name``."""

    def add(solver: AnySolver) -> AnySolver:
        SOLVERS[name] = solver
        return solver

    return add


def get_solver(solver: str | Solver) -> tuple[str, Solver]:
    """The (name, callable) for a registered name or a user callable."""
    if callable(solver):
        return getattr(solver, "__name__", type(solver).__name__), solver
    try:
        return solver, SOLVERS[solver]
    except KeyError:
        raise ValueError(
            f"unknown solver {solver!r}; registered solvers: {', '.join(sorted(SOLVERS))}, "
            "or pass a callable solve(problem, budget_bytes, **options)"
        ) from None


from planner.solvers import auto, greedy, milp, optimal, rotor, sqrt_n  # noqa: E402,F401  (registration side effect)
