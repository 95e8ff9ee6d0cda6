"""What several solvers share: segments between cuts, and the one order of candidate plans."""

from __future__ import annotations

import numbers

import numpy as np

from planner.errors import short_repr
from planner.nested import NestedChoice, validate_nested
from planner.problem import Problem
from planner.simulate import (
    Choice,
    Segments,
    Simulation,
    as_choice,
    call_seconds,
    recompute_costs,
    replayed_nodes,
    validate_choice,
    validate_segments,
)


def segments_between(problem: Problem, cuts) -> Segments:
    """Checkpoint every valid segment between consecutive ``cuts`` (0 and n are added)."""
    bounds = sorted({0, problem.size, *cuts})
    return tuple((a, b) for a, b in zip(bounds, bounds[1:]) if problem.is_valid_segment(a, b))


def rank(result: Simulation, budget_bytes: int) -> tuple[bool, float]:
    """Sort key of candidate plans: those that fit first, by recompute time; then the rest,
    by peak (so that, when nothing fits, the first is the one that comes closest)."""
    fits = result.peak_bytes <= budget_bytes
    return (not fits, result.recompute_seconds if fits else result.peak_bytes)


def least_recompute_seconds(problem: Problem, choice) -> float:
    """A lower bound on ``simulate(problem, choice).recompute_seconds``, without the replay: the
    same terms (``recompute_costs``, ``call_seconds``) summed in another order, so lowered by
    far more than rounding can move either sum (``1e-9`` of the sum of every term's size).
    A candidate whose bound is at least the cost of a plan that fits cannot rank before it."""
    choice = as_choice(choice)
    replayed = replayed_nodes(problem, choice)
    seconds, _ = recompute_costs(problem, choice, replayed)
    rounding = 1e-9 * (
        float(np.abs(problem.seconds).sum())
        + problem.size * (abs(problem.checkpoint_seconds) + abs(problem.keep_seconds))
    )
    return float(seconds.sum()) + call_seconds(problem, choice, replayed) - rounding


def checked_result(name: str, result, problem: Problem) -> Segments | Choice | NestedChoice:
    """A solver's segments, sorted, as ints (or its ``Choice``, when it keeps nodes inside
    them); a clear error naming the solver when they are not the ``(start, stop)`` pairs of int
    positions every solver must return."""
    if isinstance(result, NestedChoice):
        try:
            nested = validate_nested(problem, result)
        except ValueError as error:
            raise ValueError(f"solver {name!r} returned an invalid plan: {error}") from None
        flat = nested.flat()
        return nested if flat is None else flat.segments
    if isinstance(result, Choice):
        try:
            choice = validate_choice(problem, result)
        except ValueError as error:
            raise ValueError(f"solver {name!r} returned an invalid plan: {error}") from None
        return choice if choice.keep else choice.segments
    try:
        pairs = None if isinstance(result, (str, bytes)) else [tuple(pair) for pair in result]
    except TypeError:  # not iterable, or items that are not
        pairs = None
    if pairs is None or not all(
        len(pair) == 2
        and all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in pair)
        for pair in pairs
    ):
        raise TypeError(
            f"solver {name!r} returned {short_repr(result)}; a solver must return a tuple of "
            "(start, stop) pairs of int positions, the half-open segments to checkpoint "
            "(() for none)"
        )
    try:
        return validate_segments(problem, pairs)
    except ValueError as error:
        raise ValueError(f"solver {name!r} returned an invalid plan: {error}") from None
