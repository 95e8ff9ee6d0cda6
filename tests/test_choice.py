"""``validate_choice`` accepts exactly the choices its rules allow, however many segments.

Replays check every choice they are given; the check works on whole arrays at once, so these
tests hold it against the rules written out node by node, on random graphs and random (often
invalid) choices.
"""

import numpy as np
import pytest

from planner.simulate import Choice, recompute_stop, validate_choice, validate_segments
from problems import random_problem


def rules_allow(problem, segments, keep) -> bool:
    """The rules of ``validate_choice``, one node at a time."""
    ordered = sorted(segments)
    for (start, stop), (following, _) in zip(ordered, [*ordered[1:], (problem.size, None)]):
        if not problem.is_valid_segment(start, stop) or stop > following:
            return False
    for k in keep:
        homes = [(a, b) for a, b in ordered if a <= k < recompute_stop(problem, a, b)]
        if not homes or not problem.keepable[k]:
            return False
    for start, stop in ordered:
        randoms = [
            x for x in range(start, recompute_stop(problem, start, stop)) if problem.random[x]
        ]
        kept = [x for x in randoms if x in keep]
        recomputed = [x for x in randoms if x not in keep]
        if kept and recomputed and kept[0] < recomputed[-1]:
            return False
    return True


def random_choice(rng, n: int) -> Choice:
    """A few segments (sometimes overlapping or reversed) and a few kept positions."""
    segments = []
    for _ in range(int(rng.integers(0, 4))):
        start, stop = sorted(int(x) for x in rng.integers(-1, n + 2, 2))
        segments.append((start, stop))
    keep = frozenset(int(x) for x in rng.integers(-1, n + 1, int(rng.integers(0, 4))))
    return Choice(tuple(segments), keep)


@pytest.mark.parametrize("seed", range(40))
def test_validate_choice_accepts_exactly_what_the_rules_allow(seed):
    problem = random_problem(seed, 12)
    rng = np.random.default_rng(seed)
    accepted = rejected = 0
    for _ in range(300):
        choice = random_choice(rng, problem.size)
        allowed = rules_allow(problem, choice.segments, choice.keep)
        try:
            result = validate_choice(problem, choice)
        except ValueError:
            assert not allowed, choice
            rejected += 1
            continue
        assert allowed, choice
        assert result == Choice(tuple(sorted(choice.segments)), choice.keep)
        accepted += 1
    assert accepted and rejected  # both sides of the rules were exercised


def test_validate_segments_names_the_overlapping_segment():
    problem = random_problem(3, 12)
    valid = [
        (a, b)
        for a in range(problem.size)
        for b in range(a + 2, problem.size + 1)
        if problem.is_valid_segment(a, b)
    ]
    first, second = next((s, t) for s in valid for t in valid if s[0] < t[0] < s[1] < t[1])
    with pytest.raises(ValueError, match=rf"segment \({second[0]}, {second[1]}\) overlaps"):
        validate_segments(problem, [second, first])
