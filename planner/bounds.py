"""A lower bound on the recompute any plan needs to fit a peak, from a few moments of the step.

A plan decides, in the end, which storages stay live for backward and which nodes run again.
Every storage backward unpacks is either held from the forward or made again by recomputing its
producer, and a recomputed node needs what it reads held or recomputed in turn. Over 0/1
variables ``held[s]`` (storage ``s`` live when forward ends) and ``recomputed[v]``, the least
recompute cost under those rules and under the memory rows below is at most what any plan
(flat with kept nodes, or nested: a node it runs again is counted at least once) whose peak fits
costs: the plan's own choice satisfies every row. It is an integer program with one variable per
storage and per node, far smaller than the full MILP of ``planner.solvers.milp``.

The memory rows (``planner.simulate``, which the bound is stated against; fixed memory counted
in every row):

* when forward ends, at three high points: the last forward node's (with every storage read
  there last, the graph's outputs among them, and its workspace), the default loss's (the
  outputs and the loss's sums) and the first backward step's (what the last node's backward
  allocates, or the loss, when a recompute runs first), everything held is live;
* at node ``j``'s backward, what ``j`` saves is live (held, or made again for it), and so is
  what an earlier node saves unless its producer is recomputed (an earlier copy may go and a
  later recompute bring it back), beside the gradients backward has allocated by then, which
  every plan allocates alike.

Left out (which only lowers the bound): storages a custom function keeps on its autograd
context (a kept node's goes with its segment's recompute) and weight casts autocast caches (a
recompute casts them again even when their node is kept), except that the former live to the
end of backward in any plan when forward ends.
"""

from __future__ import annotations

import math

import numpy as np

from planner.problem import Problem

COSTS = ("flops", "seconds")


def recompute_lower_bound(
    problem: Problem, peak_bytes: int, *, cost: str = "flops", time_limit: float = 60.0
) -> float:
    """The least recompute cost (``"flops"``: ``Problem.flops``; ``"seconds"``:
    ``Problem.seconds``, checkpoint-call costs left out) that any plan whose simulated peak is
    at most ``peak_bytes`` pays; ``inf`` when no plan fits. See the module docstring for why it
    is a bound. It is the solver's dual bound, so a ``time_limit`` reached still gives a valid
    (lower) bound.
    """
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}, not {cost!r}")
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
    except ImportError as error:
        raise ImportError(
            "recompute_lower_bound needs scipy (HiGHS): pip install scipy "
            "(or pip install 'torch-activation-planner[milp]')"
        ) from error

    n, storages = problem.size, problem.storages
    if n == 0:
        return 0.0
    m = len(storages)
    rec = m  # columns: held[s] for each storage s, then recomputed[v] for each node v
    nbytes = np.array([s.nbytes for s in storages], dtype=np.float64)
    rows: list[tuple[dict[int, float], float]] = []  # sum(value * x[column]) <= upper

    saved_by: list[list[int]] = [[] for _ in range(n)]  # node -> storages it needs in backward
    for k, s in enumerate(storages):
        if s.cast_cache:
            continue
        for v in set(s.readers):
            if v > s.producer and problem.checkpointable[v]:
                rows.append(({rec + v: 1.0, k: -1.0, rec + s.producer: -1.0}, 0.0))
        if s.held_by_context:
            continue
        # The producer's own save needs it only when a recompute stopping there makes it again
        # (``choice.recompute_stop``); otherwise no plan recomputes it for that save.
        remade = s.before_last_save and bool(problem.saves_own[s.producer])
        savers = {j for j in s.savers if j > s.producer or (j == s.producer and remade)}
        if savers:
            rows.append(({k: -1.0, rec + s.producer: -1.0}, -1.0))
        for j in savers:
            saved_by[j].append(k)

    last_use = problem.storage_arrays.last_use
    output = np.array([s.is_output for s in storages], dtype=bool)
    by_context = np.array([s.held_by_context and bool(s.savers) for s in storages], dtype=bool)
    last_saving = int(problem.last_saving[n - 1])
    first_backward = int(problem.activation_grad_alloc[n - 1] + problem.grad_bytes_at[n - 1])
    if last_saving >= 0 and problem.checkpointable[last_saving]:
        first_backward = min(first_backward, problem.loss_bytes)
    moments = [  # (storages live then whether held or not, bytes live beside them)
        (last_use == n - 1, int(problem.workspace[n - 1])),
        (output, problem.default_loss_high),
        (np.zeros(m, dtype=bool), max(first_backward, 0)),
    ]
    for anyway, extra in moments:
        anyway = anyway | by_context
        allowance = peak_bytes - problem.fixed_bytes - extra - int(nbytes[anyway].sum())
        rows.append(({int(k): nbytes[k] for k in np.flatnonzero(~anyway)}, allowance))

    grads = problem.activation_grad_alloc + problem.grad_bytes_at
    freed = problem.activation_grad_free
    allocated = np.cumsum((grads - freed)[::-1])[::-1] + freed  # at node j's high point
    earlier: set[int] = set()  # storages that nodes before j save
    for j in range(n):
        own = set(saved_by[j])
        terms: dict[int, float] = {}
        for k in earlier - own:
            column = rec + storages[k].producer
            terms[column] = terms.get(column, 0.0) - nbytes[k]
        live = int(nbytes[sorted(own | earlier)].sum())
        # The part of the high point after j's backward may have dropped some of what it
        # saved need not see ``own`` (``Problem.grad_after_saved``).
        high = int(allocated[j] - problem.grad_after_saved[j])
        rows.append((terms, peak_bytes - problem.fixed_bytes - high - live))
        earlier |= own

    row_index = [i for i, (terms, _) in enumerate(rows) for _ in terms]
    columns = [c for terms, _ in rows for c in terms]
    values = [float(v) for terms, _ in rows for v in terms.values()]
    matrix = coo_array((values, (row_index, columns)), shape=(len(rows), m + n)).tocsr()
    upper = np.array([bound for _, bound in rows], dtype=np.float64)
    if (upper[[not terms for terms, _ in rows]] < 0).any():
        return math.inf  # a row no choice can meet: the peak is below what any plan holds
    costs = np.asarray(problem.flops if cost == "flops" else problem.seconds, dtype=np.float64)
    scale = float(costs.max()) or 1.0
    result = milp(
        np.concatenate([np.zeros(m), costs / scale]),
        integrality=np.ones(m + n),
        bounds=Bounds(np.zeros(m + n), np.concatenate([np.ones(m), problem.checkpointable])),
        constraints=LinearConstraint(matrix, -np.inf, upper),
        options={"time_limit": time_limit},
    )
    if result.status == 2:  # infeasible: no choice covers backward within the peak
        return math.inf
    dual = result.mip_dual_bound if result.mip_dual_bound is not None else 0.0
    return max(float(dual), 0.0) * scale
