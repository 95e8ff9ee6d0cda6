"""The optimal solver against exhaustive search, with ``planner.simulate`` as the only judge:
segments alone (``keep=False``) against every plan of segments, and the joint choice against
every (segments, keep set).

Problems are generated directly (no torch): chains, where each node reads the one before, and
small DAGs whose nodes also read an earlier output, so that cuts are crossed by several tensors.
Set ``HYPOTHESIS_PROFILE=thorough`` for many more examples.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from planner.pipeline import prepare
from planner.problem import Problem, Storage
from planner.simulate import Choice, as_choice, simulate, validate_choice
from planner.solvers import (
    SOLVERS,
    optimal,  # registers "optimal"
)
from problems import all_plans, budgets, problem_of, random_problem

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def make_problem(
    sizes, skips, saver_bits, seconds, workspace, blocked, output, random=None
) -> Problem:
    """A problem where node i creates storage i, reads storage i-1 and maybe ``skips[i]``.

    ``saver_bits[i]`` says whether node i saves its own output (bit 0) and its inputs (bit 1),
    as ReLU and Linear do. Gradient bookkeeping follows ``planner.problem.build_problem``.
    """
    n = len(sizes)
    reads = [
        set() if i == 0 else {i - 1} | ({skips[i]} if skips[i] is not None else set())
        for i in range(n)
    ]
    storages = []
    for k in range(n):
        readers = tuple(sorted(i for i in range(n) if k in reads[i]))
        own = {k} if saver_bits[k] & 1 else set()
        savers = tuple(sorted(own | {i for i in readers if saver_bits[i] & 2}))
        storages.append(
            Storage(
                nbytes=sizes[k],
                producer=k,
                readers=readers,
                savers=savers,
                is_output=output and k == n - 1,
                requires_grad=True,
            )
        )
    grad_alloc = np.zeros(n, dtype=np.int64)
    grad_free = np.zeros(n, dtype=np.int64)
    for s in storages:
        if s.readers:
            grad_alloc[s.last_reader] += s.nbytes
            grad_free[s.producer] += s.nbytes
    return problem_of(
        storages,
        seconds,
        workspace=np.array(workspace, dtype=np.int64),
        grad_bytes_at=np.zeros(n, dtype=np.int64),
        activation_grad_alloc=grad_alloc,
        activation_grad_free=grad_free,
        checkpointable=np.ones(n, dtype=bool),
        cut_allowed=np.array([c not in blocked for c in range(n + 1)]),
        random=np.zeros(n, dtype=bool) if random is None else np.array(random, dtype=bool),
    )


@st.composite
def problems(draw, max_nodes=7, dag=True):
    n = draw(st.integers(2, max_nodes))
    sizes = draw(st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=n, max_size=n))
    skips = [None, None] + [
        draw(st.one_of(st.none(), st.integers(0, i - 2))) if dag else None for i in range(2, n)
    ]
    return make_problem(
        sizes,
        skips,
        draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),
        draw(st.lists(st.sampled_from([0.5, 1.0, 3.0, 10.0]), min_size=n, max_size=n)),
        draw(st.lists(st.sampled_from([0, 0, 1, 4]), min_size=n, max_size=n)),
        set(draw(st.lists(st.integers(1, n - 1), max_size=2))),
        draw(st.booleans()),
        draw(st.lists(st.booleans(), min_size=n, max_size=n)),
    )


def exhaustive(problem: Problem, budget: int):
    """(least recompute, lowest peak) over all plans, judged by the simulator."""
    results = [simulate(problem, plan) for plan in all_plans(problem)]
    fitting = [r.recompute_seconds for r in results if r.peak_bytes <= budget]
    return min(fitting, default=None), min(r.peak_bytes for r in results)


@given(problems(dag=False))
def test_matches_exhaustive_search_on_chains(problem):
    for budget in budgets(problem):
        check_against_exhaustive(problem, budget)


@given(problems(dag=True))
def test_matches_exhaustive_search_on_dags_with_multi_tensor_cuts(problem):
    for budget in budgets(problem):
        check_against_exhaustive(problem, budget)


def check_against_exhaustive(problem: Problem, budget: int) -> None:
    least, lowest = exhaustive(problem, budget)
    result = simulate(problem, SOLVERS["optimal"](problem, budget, keep=False))
    if least is None:
        assert result.peak_bytes == lowest, "when nothing fits, return the lowest peak"
    else:
        assert result.peak_bytes <= budget
        assert math.isclose(result.recompute_seconds, least, rel_tol=1e-9, abs_tol=1e-12)


@given(problems(), st.data())
def test_cost_never_increases_with_budget(problem, data):
    peaks = budgets(problem)
    low, high = sorted(data.draw(st.lists(st.sampled_from(peaks), min_size=2, max_size=2)))
    cost = {b: simulate(problem, SOLVERS["optimal"](problem, b, keep=False)) for b in (low, high)}
    if cost[low].peak_bytes <= low:
        assert cost[high].recompute_seconds <= cost[low].recompute_seconds + 1e-12


@given(problems())
def test_checkpoints_nothing_at_the_baseline_budget(problem):
    baseline = simulate(problem, ()).peak_bytes
    assert SOLVERS["optimal"](problem, baseline) == ()
    assert SOLVERS["optimal"](problem, baseline + 10**9) == ()


@given(problems(), st.data())
def test_heuristics_are_never_cheaper(problem, data):
    budget = data.draw(st.sampled_from(budgets(problem)))
    best = simulate(problem, SOLVERS["optimal"](problem, budget))
    for name in ("greedy", "sqrt_n"):
        other = simulate(problem, SOLVERS[name](problem, budget))
        if other.peak_bytes <= budget:
            assert best.peak_bytes <= budget
            assert best.recompute_seconds <= other.recompute_seconds + 1e-12


@pytest.fixture(scope="module")
def gpt_problem():
    from planner import zoo
    from planner.pipeline import prepare

    return prepare(*zoo.gpt(layers=2))[1]


@given(problems())
def test_budget_zero_gives_the_exhaustive_lowest_peak(problem):
    # planner.solvers.auto.lowest_peak asks for the lowest peak this way.
    _, lowest = exhaustive(problem, 0)
    assert simulate(problem, SOLVERS["optimal"](problem, 0)).peak_bytes == lowest


def long_problem(n: int, seed: int) -> Problem:
    """A generated DAG too large for the exact search: exercises the coarse-to-fine path."""
    rng = np.random.default_rng(seed)
    skips = [None, None] + [
        int(rng.integers(max(0, i - 12), i - 1)) if rng.random() < 0.3 else None
        for i in range(2, n)
    ]
    return make_problem(
        rng.choice([1, 2, 4, 8, 16], n).tolist(),
        skips,
        rng.integers(0, 4, n).tolist(),
        rng.choice([0.5, 1.0, 3.0, 10.0], n).tolist(),
        rng.choice([0, 0, 1, 4], n).tolist(),
        set(rng.integers(1, n - 1, n // 10).tolist()),
        True,
    )


@pytest.mark.parametrize("seed", range(3))
def test_large_problems_fit_and_never_lose_to_the_heuristics(seed):
    problem = long_problem(300, seed)
    baseline = simulate(problem, ()).peak_bytes
    lowest = simulate(problem, SOLVERS["optimal"](problem, 0)).peak_bytes
    for name in ("greedy", "sqrt_n"):
        assert lowest <= simulate(problem, SOLVERS[name](problem, 0)).peak_bytes
    for fraction in (0.0, 0.2, 0.5, 0.8):
        assert_fits_and_beats_the_heuristics(problem, int(lowest + fraction * (baseline - lowest)))


def assert_fits_and_beats_the_heuristics(problem: Problem, budget: int) -> None:
    best = simulate(problem, SOLVERS["optimal"](problem, budget))
    assert best.peak_bytes <= budget
    for name in ("greedy", "sqrt_n"):
        other = simulate(problem, SOLVERS[name](problem, budget))
        if other.peak_bytes <= budget:
            assert best.recompute_seconds <= other.recompute_seconds * (1 + 1e-9)


def test_real_model_plans_fit_and_beat_the_heuristics(gpt_problem):
    baseline = simulate(gpt_problem, ()).peak_bytes
    lowest = simulate(gpt_problem, SOLVERS["optimal"](gpt_problem, 0)).peak_bytes
    assert lowest < baseline
    for fraction in (0.0, 0.3, 0.6, 0.9):
        assert_fits_and_beats_the_heuristics(
            gpt_problem, int(lowest + fraction * (baseline - lowest))
        )


def test_candidate_cuts_sets_the_first_pass_and_every_plan_fits(gpt_problem, monkeypatch):
    passes = []
    run = optimal._Search.run

    def segment_passes(self, corridors):  # the keep pass (_keep_pass) comes after them
        if not self.keeps:
            passes.append(len(corridors))
        return run(self, corridors)

    monkeypatch.setattr(optimal._Search, "run", segment_passes)
    allowed = int(gpt_problem.cut_allowed.sum())
    baseline = simulate(gpt_problem, ()).peak_bytes
    budget = (simulate(gpt_problem, SOLVERS["optimal"](gpt_problem, 0)).peak_bytes + baseline) // 2
    for candidate_cuts, first_pass in ((allowed // 4, allowed // 4), (allowed, allowed)):
        passes.clear()
        plan = SOLVERS["optimal"](gpt_problem, budget, candidate_cuts=candidate_cuts)
        assert simulate(gpt_problem, plan).peak_bytes <= budget
        assert abs(passes[0] - first_pass) <= 2  # one cut per window, plus both ends
    assert len(passes) == 1  # every allowed cut a candidate: one pass, nothing to refine


def test_large_problems_keep_at_most_masks_per_cut_and_still_fit(gpt_problem, monkeypatch):
    """Storages alive whatever the plan (autocast's weight casts) multiply the masks at a cut by
    thousands; large problems keep a bounded number of them."""
    settled = []
    settle = optimal._Search._settle

    def counted(self, position):
        states = settle(self, position)
        settled.append(len(states))
        return states

    monkeypatch.setattr(optimal._Search, "_settle", counted)
    baseline = simulate(gpt_problem, ()).peak_bytes
    budget = (simulate(gpt_problem, SOLVERS["optimal"](gpt_problem, 0)).peak_bytes + baseline) // 2
    SOLVERS["optimal"](gpt_problem, budget)
    assert max(settled) > 2  # uncapped, some cut holds more masks than the cap below

    monkeypatch.setattr(optimal, "MASKS", 2)
    settled.clear()
    assert_fits_and_beats_the_heuristics(gpt_problem, budget)
    assert max(settled) <= 2


def test_a_time_limit_stops_the_search_and_keeps_the_heuristics_plans(gpt_problem):
    baseline = simulate(gpt_problem, ()).peak_bytes
    lowest = simulate(gpt_problem, SOLVERS["optimal"](gpt_problem, 0)).peak_bytes
    budget = (lowest + baseline) // 2
    stopped = simulate(gpt_problem, SOLVERS["optimal"](gpt_problem, budget, time_limit=0))
    heuristics = [
        simulate(gpt_problem, SOLVERS[name](gpt_problem, budget)) for name in ("greedy", "sqrt_n")
    ]
    fitting = [h.recompute_seconds for h in heuristics if h.peak_bytes <= budget]
    assert fitting, "the budget is meant to be reachable by a heuristic"
    assert stopped.peak_bytes <= budget and stopped.recompute_seconds == min(fitting)
    searched = simulate(gpt_problem, SOLVERS["optimal"](gpt_problem, budget, time_limit=60))
    assert searched.recompute_seconds < stopped.recompute_seconds


# --- Keeping nodes inside segments (selective checkpointing) ---------------------------------


def all_choices(problem: Problem):
    """Every valid (segments, keep set): each plan of segments with each subset of its nodes
    that ``validate_choice`` accepts (keepable, before the recompute's end, the RNG rule)."""
    for segments in all_plans(problem):
        inside = [x for start, stop in segments for x in range(start, stop)]
        for mask in range(1 << len(inside)):
            choice = Choice(segments, frozenset(x for i, x in enumerate(inside) if mask >> i & 1))
            try:
                yield validate_choice(problem, choice)
            except ValueError:
                continue


@given(problems(max_nodes=6))  # enumerating every (segments, keep set) is feasible to 6 nodes
def test_joint_choice_matches_exhaustive_search_over_segments_and_keep_sets(problem):
    results = [simulate(problem, choice) for choice in all_choices(problem)]
    for budget in budgets(problem):
        fitting = [r.recompute_seconds for r in results if r.peak_bytes <= budget]
        result = simulate(problem, SOLVERS["optimal"](problem, budget))
        if not fitting:
            assert result.peak_bytes == min(r.peak_bytes for r in results)
            continue
        assert result.peak_bytes <= budget
        assert result.recompute_seconds <= min(fitting) * 1.01 + 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_keeps_fit_and_never_cost_more_than_segments_alone(seed):
    problem = long_problem(300, seed)
    baseline = simulate(problem, ()).peak_bytes
    lowest = simulate(problem, SOLVERS["optimal"](problem, 0)).peak_bytes
    for fraction in (0.1, 0.3, 0.6, 0.9):
        budget = int(lowest + fraction * (baseline - lowest))
        choice = as_choice(SOLVERS["optimal"](problem, budget))
        joint = simulate(problem, validate_choice(problem, choice))
        alone = simulate(problem, SOLVERS["optimal"](problem, budget, keep=False))
        assert joint.peak_bytes <= budget
        assert joint.recompute_seconds <= alone.recompute_seconds * (1 + 1e-9)


def test_on_tiny_graphs_a_keep_can_fit_where_no_segments_fit():
    """A kept node's recompute runs nothing, so keeping it spares the recompute a workspace
    its cache does not hold (``Problem.kept_bytes`` below created bytes plus workspace): the
    exhaustive search on tiny graphs finds such a plan below every segments-only peak."""
    problem = random_problem(36, 6)
    budget = min(simulate(problem, plan).peak_bytes for plan in all_plans(problem)) - 1
    choice = as_choice(SOLVERS["optimal"](problem, budget))
    assert choice.keep
    assert simulate(problem, choice).peak_bytes <= budget


@pytest.mark.parametrize("seed", [23, 0, 1, 2])
def test_exact_recompute_peaks_follow_the_replay(seed):
    """The DP's recompute peak of every segment, and the step-by-step profile its keep sets
    build on, are what ``simulate`` replays: during a lone segment's recompute the replay's live
    bytes are the profile plus a constant. On ``random_problem(23, 10)`` a recompute stopping at
    the last node once released a graph output early (16 bytes under the replay)."""
    problem = random_problem(seed, 10)
    t = optimal._tables(problem)
    for c in range(problem.size):
        for b in range(c + 1, problem.size + 1):
            if not problem.is_valid_segment(c, b) or not problem.saves[c:b].any():
                continue
            profile = optimal._recompute_profile(problem, t, c, b)
            timeline = simulate(problem, ((c, b),), record=True).timeline
            replayed = np.array([live for phase, _, live in timeline if phase == "recompute"])
            assert np.unique(replayed - profile).size == 1, (c, b)
            assert optimal._recompute_peaks(problem, t, c, b)[-1] == profile.max(), (c, b)


# --- Keeps on graphs above EXACT_KEEP_NODES: a few keep sets per segment, near the best plan ---


def expensive_chain(units: int) -> Problem:
    """``units`` pairs (A, M): A is cheap and large and saves nothing; M is expensive, small,
    and saves its input and its output. Kept inside a segment, M costs its small cache and
    spares the recompute its 10 s; stored, it holds A for backward; recomputed, it costs 10 s.
    """
    return make_problem(
        [16, 1] * units, [None] * (2 * units), [0, 3] * units, [0.5, 10.0] * units,
        [0] * (2 * units), set(), True,
    )  # fmt: skip


def test_above_the_exact_size_a_kept_node_inside_a_longer_segment_wins():
    problem = expensive_chain(8)
    assert problem.size > optimal.EXACT_KEEP_NODES
    cheap = Choice(((0, 9),), frozenset({1, 3, 5, 7}))  # recomputes the four A only: 2 s
    budget = simulate(problem, cheap).peak_bytes
    alone = simulate(problem, SOLVERS["optimal"](problem, budget, keep=False))
    assert alone.recompute_seconds >= 10.0  # exact up to EXACT_NODES: every way recomputes an M
    joint = simulate(problem, SOLVERS["optimal"](problem, budget))
    assert joint.peak_bytes <= budget
    assert joint.recompute_seconds <= simulate(problem, cheap).recompute_seconds


@pytest.mark.parametrize("seed", range(2))
def test_large_problems_get_the_same_plan_on_every_call(seed):
    """No time bound decides what the search tries: a copy of the problem, solved afresh (no
    tables remembered), gets the same plan."""
    problem = long_problem(300, seed)
    baseline = simulate(problem, ()).peak_bytes
    lowest = simulate(problem, SOLVERS["optimal"](problem, 0)).peak_bytes
    for fraction in (0.1, 0.5):
        budget = int(lowest + fraction * (baseline - lowest))
        first = SOLVERS["optimal"](problem, budget)
        assert SOLVERS["optimal"](problem, budget) == first
        assert SOLVERS["optimal"](pickle.loads(pickle.dumps(problem)), budget) == first


@pytest.mark.parametrize("seed", range(3))
def test_keep_family_bounds_are_never_below_the_exact_keep_sets(seed):
    """What ``_keep_family`` says a keep set adds, in forward and to the recompute's peak, is at
    least what the exact ``_keep_sets`` says for the same set (on top of a profile at least as
    high): the large search's keep plans may be too careful, never too bold."""
    problem = long_problem(120, seed)
    t = optimal._tables(problem)
    rng = np.random.default_rng(seed)
    checked = 0
    for c in rng.integers(0, problem.size - 2, 40).tolist():
        b = min(problem.size, c + int(rng.integers(2, 10)))
        if not problem.is_valid_segment(c, b) or not problem.saves[c:b].any():
            continue
        exact = optimal._keep_sets(problem, t, c, b)
        profile = optimal._recompute_bound_profile(problem, t, c, b)
        ranked = optimal._ranked(t, c, b)
        family = optimal._keep_family(problem, t, c, b, profile, ranked)
        if family is None:
            continue
        row_of = {frozenset(keeps): row for row, keeps in enumerate(exact.keeps)}
        for row, keeps in enumerate(family.keeps):
            match = row_of[frozenset(keeps)]
            assert (family.forward[row] >= exact.forward[match]).all()
            assert family.recompute[row] >= exact.recompute[match]
            assert family.cache[row] == exact.cache[match]
            assert family.saved[row] == pytest.approx(exact.saved[match])
            checked += 1
    assert checked > 0


# --- What the search works out once and reuses -----------------------------------------------


def segment_search(problem: Problem) -> optimal._Search:
    """A search over ``problem`` at half its baseline, as ``solve`` builds one."""
    limit = simulate(problem, ()).peak_bytes // 2 - problem.fixed_bytes
    return optimal._Search(problem, optimal._tables(problem), limit, False, False, 1)


@pytest.mark.parametrize("seed", range(3))
def test_a_segment_charges_the_inputs_it_touches_once_it_saves_something(seed):
    """``_charged_inputs`` (worked out once per segment) against its definition: an input of
    ``[c, b)`` is charged when a node of the segment reads or saves it, and not before the
    segment's first saving node."""
    problem = long_problem(120, seed)
    t, search = optimal._tables(problem), segment_search(problem)
    for c in range(0, problem.size - 1, 7):
        stop = c + int(np.argmin(np.append(problem.checkpointable[c:], False)))
        saving = np.flatnonzero(problem.saves[c:stop])
        first_saving = c + int(saving[0]) if saving.size else stop
        for b in range(c + 1, stop + 1):
            touched = {k for k in t.crossing[c] if any(c <= j < b for j in t.touches[k])}
            expected = touched if first_saving < b else set()
            assert search._charged_inputs(c, [b]) == [optimal._bits(expected)]


def cuts_and_stops(problem, every: int):
    """Every ``every``-th cut with a checkpointable node after it, and where its longest
    segment stops (the first node after it that is not checkpointable)."""
    for c in range(0, problem.size - 1, every):
        stop = c + int(np.argmin(np.append(problem.checkpointable[c:], False)))
        if stop > c:
            yield c, stop


def segment_parts(problem, t, search, every: int):
    """``cuts_and_stops`` with what ``_segment_locals`` takes at each: the segment's start
    and recompute up to the stop, and the storages crossing the cut."""
    for c, stop in cuts_and_stops(problem, every):
        recompute, _ = search._segment_costs(c, stop)
        yield c, stop, search._segment_start(c, stop), recompute, list(t.crossing[c])


@pytest.mark.parametrize("seed", range(3))
def test_segment_locals_for_the_segments_a_pass_tries_are_those_of_every_segment(seed):
    """A pass works out ``_segment_locals`` only up to the longest segment it tries from a cut:
    the same figures as when worked out for every segment from there."""
    problem = long_problem(120, seed)
    t, search = optimal._tables(problem), segment_search(problem)
    rng = np.random.default_rng(seed)
    for c, stop, start, recompute, crossing in segment_parts(problem, t, search, every=5):
        mask = optimal._bits(k for k in crossing if rng.random() < 0.5)
        (whole,) = optimal._segment_locals(t, c, [mask], start, recompute, stop - c, keeps=True)
        width = int(rng.integers(1, stop - c + 1))
        (part,) = optimal._segment_locals(t, c, [mask], start, recompute, width, keeps=True)
        for full, prefix in zip(whole[:3], part[:3]):
            assert (full[:width] == prefix).all()
        for name in ("forward", "copies", "after_recompute", "before_recompute", "recompute_base"):
            assert (getattr(whole[3], name)[:width] == getattr(part[3], name)).all()


@pytest.mark.parametrize("seed", range(2))
def test_segment_parts_worked_out_to_a_nearer_stop_are_those_of_every_segment(seed):
    """``_segment_start`` and ``_segment_costs`` (exact replay and bound) are worked out only as
    far as a pass's segments reach from a cut: the same figures as up to the cut's last
    checkpointable node, offsets past the nearer stop clipped to it."""
    problem = long_problem(120, seed)
    t = optimal._tables(problem)
    rng = np.random.default_rng(seed)
    for c, stop in cuts_and_stops(problem, every=5):
        near = c + int(rng.integers(1, stop - c + 1))
        width = near - c
        whole, part = (
            optimal._segment_start(problem, t, c, stop),
            optimal._segment_start(problem, t, c, near),
        )
        assert whole.inputs == part.inputs and (whole.nbytes == part.nbytes).all()
        for name in ("freed", "charges"):
            assert (np.minimum(getattr(whole, name), width) == getattr(part, name)).all()
        for name in ("saves", "last", "before", "after", "with_saved", "tail", "copies"):
            assert (getattr(whole, name)[:width] == getattr(part, name)).all()
        for exact in (False, True):
            full = optimal._segment_costs(problem, t, c, stop, exact)
            for whole_part, near_part in zip(
                full, optimal._segment_costs(problem, t, c, near, exact)
            ):
                assert (whole_part[:width] == near_part).all()


@pytest.mark.parametrize("seed", range(2))
def test_segment_locals_of_masks_worked_out_together_are_those_of_each_alone(seed):
    """The masks of one cut are rows of one array in ``_segment_locals``: each row is what the
    mask alone gives."""
    problem = long_problem(120, seed)
    t, search = optimal._tables(problem), segment_search(problem)
    rng = np.random.default_rng(seed)
    for c, stop, start, recompute, crossing in segment_parts(problem, t, search, every=7):
        masks = [optimal._bits(k for k in crossing if rng.random() < 0.5) for _ in range(4)]
        together = optimal._segment_locals(t, c, masks, start, recompute, stop - c, keeps=True)
        for mask, row in zip(masks, together):
            (alone,) = optimal._segment_locals(t, c, [mask], start, recompute, stop - c, True)
            for mine, its in zip(row[:3], alone[:3]):
                assert (mine == its).all()
            for name in dataclasses.fields(optimal._SavingParts):
                assert (getattr(row[3], name.name) == getattr(alone[3], name.name)).all()


def settled_entries(monkeypatch) -> list[int]:
    """Entries merged by each pass's ``_settle`` from now on, one count per pass."""
    counts: list[int] = []
    run, pareto = optimal._Search.run, optimal._pareto

    def counted_run(self, corridors):
        counts.append(0)
        return run(self, corridors)

    def counted_pareto(charged, value, bucket, ordered=False):
        counts[-1] += charged.size
        return pareto(charged, value, bucket, ordered)

    monkeypatch.setattr(optimal._Search, "run", counted_run)
    monkeypatch.setattr(optimal, "_pareto", counted_pareto)
    return counts


@pytest.mark.parametrize("seed", range(2))
def test_passes_after_the_first_drop_entries_dearer_than_the_best_plan_found(seed, monkeypatch):
    """Refining passes drop the entries already costlier than the plan of the passes before
    (``_Search.ceiling``): they merge fewer entries, and the plan still fits and beats the
    heuristics."""
    problem = long_problem(300, seed)
    baseline = simulate(problem, ()).peak_bytes
    budget = (simulate(problem, SOLVERS["optimal"](problem, 0)).peak_bytes + baseline) // 2
    counts = settled_entries(monkeypatch)
    assert_fits_and_beats_the_heuristics(problem, budget)
    with_ceiling = list(counts)
    counts.clear()
    monkeypatch.setattr(optimal._Search, "prunable", property(lambda self: False))
    SOLVERS["optimal"](problem, budget)
    assert len(counts) == len(with_ceiling) > 1  # a coarse pass, then refining ones
    assert counts[0] == with_ceiling[0]  # the first pass has no plan to compare with
    assert sum(with_ceiling[1:]) < sum(counts[1:])


def test_no_ceiling_where_a_block_can_cost_less_than_nothing():
    problem = long_problem(100, 0)
    t = optimal._tables(problem)
    search = optimal._Search(problem, t, 1 << 30, False, False, 1)
    assert search.prunable
    negative = dataclasses.replace(problem, keep_seconds=-1.0)
    assert not optimal._Search(negative, t, 1 << 30, False, False, 1).prunable
    assert not optimal._Search(problem, t, 1 << 30, True, False, 1).prunable  # peaks, not costs


@settings(max_examples=40)
@given(st.integers(0, 10_000), st.data())
def test_least_recompute_seconds_is_never_above_the_replay(seed, data):
    """The bound that lets ``greedy`` and ``_prefix_keeps`` skip replays: below what the replay
    charges, by no more than rounding."""
    from planner.solvers.common import least_recompute_seconds
    from strategies import random_choices

    problem = random_problem(seed, 12)
    choice = data.draw(random_choices(problem))
    replayed = simulate(problem, choice).recompute_seconds
    bound = least_recompute_seconds(problem, choice)
    assert bound <= replayed
    assert replayed - bound <= 1e-6 * float(problem.seconds.sum())


def every_replay(monkeypatch, module) -> None:
    """Make ``module`` replay every candidate (no bound ever skips one)."""
    monkeypatch.setattr(module, "least_recompute_seconds", lambda problem, choice: -math.inf)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_skips_only_replays_that_could_not_win(seed, monkeypatch):
    from planner.solvers import greedy

    problem = long_problem(300, seed)
    baseline = simulate(problem, ()).peak_bytes
    lowest = simulate(problem, greedy.solve(problem, 0)).peak_bytes
    budgets = [int(lowest + f * (baseline - lowest)) for f in (0.0, 0.1, 0.5, 0.9)]
    skipping = [greedy.solve(problem, budget) for budget in budgets]
    greedy._FOUND.clear()
    every_replay(monkeypatch, greedy)
    assert skipping == [greedy.solve(problem, budget) for budget in budgets]


@pytest.mark.parametrize("fraction", (0.7, 0.9))  # below, no kept node fits
def test_prefix_keeps_replays_every_plan_that_could_beat_the_one_to_beat(
    gpt_problem, fraction, monkeypatch
):
    """``_prefix_keeps`` leaves out segmentations and fills that could not go below
    ``to_beat``: below it, the cheapest plan it finds is the one it finds replaying all."""
    problem = gpt_problem
    baseline = simulate(problem, ()).peak_bytes
    lowest = simulate(problem, SOLVERS["optimal"](problem, 0, keep=False)).peak_bytes
    budget = int(lowest + fraction * (baseline - lowest))
    segments = as_choice(SOLVERS["optimal"](problem, budget, keep=False)).segments
    with monkeypatch.context() as patch:
        patch.setattr(optimal, "least_recompute_seconds", lambda problem, choice: -math.inf)
        every = optimal._prefix_keeps(problem, budget, segments, math.inf)
    costs = sorted(r.recompute_seconds for r in every.values())
    assert costs
    left_out = 0
    for to_beat in (math.inf, *costs, costs[0] / 2):
        plans = optimal._prefix_keeps(problem, budget, segments, to_beat)
        assert all(every[plan] == result for plan, result in plans.items())
        below = [cost for cost in costs if cost < to_beat]
        if below:
            assert min(r.recompute_seconds for r in plans.values()) == below[0]
        left_out += len(plans) < len(every)
    assert left_out  # the bound did spare replays


class StackedOutputs(nn.Module):
    """A chain of linear layers whose every output the model's output sums: each crosses
    every cut after it, and each way of charging them is a mask of the search."""

    def __init__(self, layers: int):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(32, 32) for _ in range(layers))

    def forward(self, x):
        outs = [x]
        for lin in self.lins:
            outs.append(lin(outs[-1]))
        return torch.stack(outs[1:]).sum(0)


def test_the_exact_search_keeps_a_bounded_number_of_masks_and_its_optimum(monkeypatch):
    """Found trying the library: a 25-node model whose output stacks every block's took 10 s
    for its lowest peak (22 layers here: 259 s) as the masks per cut doubled with each layer.
    Above ``EXACT_MASKS`` the search keeps the most promising; here it finds what the
    uncapped search finds, on a chain small enough for that to finish."""
    torch.manual_seed(0)
    _, problem = prepare(StackedOutputs(14), (torch.randn(128, 32),))
    lowest = simulate(problem, SOLVERS["optimal"](problem, 0)).peak_bytes
    baseline = simulate(problem, ()).peak_bytes
    spread = [lowest + (baseline - lowest) * k // 4 for k in range(5)]
    monkeypatch.setattr(optimal, "EXACT_MASKS", 64)  # below the masks this chain makes
    capped = [simulate(problem, SOLVERS["optimal"](problem, b)) for b in [0, *spread]]
    monkeypatch.setattr(optimal, "EXACT_MASKS", 10**9)
    exact = [simulate(problem, SOLVERS["optimal"](problem, b)) for b in [0, *spread]]
    assert [s.peak_bytes for s in capped] == [s.peak_bytes for s in exact]
    assert [s.recompute_seconds for s in capped] == pytest.approx(
        [s.recompute_seconds for s in exact], rel=0.01
    )
