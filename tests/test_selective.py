"""Plans that keep nodes inside checkpointed segments (selective checkpointing).

A kept node's ops run under ``create_selective_checkpoint_contexts`` with a policy that saves
them: the recompute takes their results from the cache instead of running them. These tests
pin down what that must preserve (gradients, the random stream, BatchNorm statistics), what the
simulator predicts against what the CPU tracker measures, and how plans show their keeps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from planner.choice import recompute_costs
from planner.errors import PlanningError
from planner.options import CaptureOptions
from planner.pipeline import assemble, lowest_peak, plan, prepare
from planner.rewrite import _aliases, _draws, rewrite
from planner.simulate import Choice, recompute_stop, replayed_nodes, simulate, validate_choice
from planner.step import peak_memory, training_loss
from strategies import assert_equivalent, build, inputs, model_specs, random_choices


def _plan(model, args, choice):
    captured, problem = prepare(model, args)
    return assemble(
        model,
        captured,
        problem,
        choice,
        solver="test",
        budget_bytes=1,
        solve_seconds=0.0,
        started=time.perf_counter(),
    )


class RandomMasks(nn.Module):
    """Two random masks (``rand_like``, out of place: keepable) between linear layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x)
        x = x * (torch.rand_like(x) > 0.5)
        x = self.b(x)
        x = x * (torch.rand_like(x) > 0.5)
        return self.c(x).tanh()


def _random_nodes():
    torch.manual_seed(0)
    model, args = RandomMasks(), (torch.randn(4, 8),)
    captured, problem = prepare(model, args)
    first, second = [k for k in range(problem.size) if problem.random[k]]
    return model, args, captured, problem, first, second


def test_a_kept_random_node_before_a_recomputed_one_is_refused():
    _, _, _, problem, first, second = _random_nodes()
    whole = ((0, problem.size),)
    assert problem.keepable[first] and problem.keepable[second]
    with pytest.raises(ValueError, match="draw different random numbers"):
        validate_choice(problem, Choice(whole, frozenset({first})))
    validate_choice(problem, Choice(whole, frozenset({second})))  # after every recomputed one
    validate_choice(problem, Choice(whole, frozenset({first, second})))


def test_fact_the_refused_random_keep_would_change_gradients():
    """Why the rule exists: the recompute restores the random state of the segment's start,
    and a kept random node draws nothing there, so the next random node draws other numbers."""
    model, args, captured, problem, first, _ = _random_nodes()
    reference = copy.deepcopy(model)
    # Without the problem, rewrite takes the choice as it is (with it, refuses it).
    planned = rewrite(
        captured.graph_module, model, Choice(((0, problem.size),), frozenset({first}))
    )
    with pytest.raises(AssertionError):
        assert_equivalent(reference, model, planned, args, {})


class NoisyDepth(nn.Module):
    """A dropout after three linear layers, the middle one of which a test keeps."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        x = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.d(self.drop(torch.tanh(self.c(x))))


def test_a_noise_hook_added_to_a_kept_module_after_planning_is_refused():
    """Found by a tester: the recompute served the hook's draw from the cache, so the dropout
    after it drew another mask: gradients 2.7 off, silently. (Running random ops of kept nodes
    again instead, found by review, ran a kept dropout on a replay's stand-ins, and recomputed
    every kept attention, which torch tags as random.)"""
    torch.manual_seed(0)
    model, args = NoisyDepth(), (torch.randn(4, 8),)
    _, problem = prepare(model, args)
    kept = frozenset({problem.names.index("b")})
    plan = _plan(model, args, Choice(((0, problem.size - 1),), kept))
    assert_equivalent(copy.deepcopy(model), model, plan.module, args, {})
    model.b.register_forward_hook(lambda module, inputs, out: out + 0.1 * torch.randn_like(out))
    with pytest.raises(PlanningError, match=r"drew random numbers inside b, which the plan keeps"):
        plan.module(*args)


class QuietBlock(nn.Module):
    """A residual block whose dropout is off at planning (``p=0``: no draw at all)."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.0)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


def test_a_dropout_turned_on_after_planning_in_a_kept_block_is_refused():
    """Found by a tester: the block's mask, filled in place in an allocation the forward had
    cached, raised "Tensor cached during selective activation checkpoint has been mutated";
    its draw, served from the cache, would have shifted every later one."""
    torch.manual_seed(0)
    model, args = nn.Sequential(*(QuietBlock() for _ in range(4))), (torch.randn(4, 8),)
    captured, problem = prepare(model, args, capture_options=CaptureOptions((QuietBlock,)))
    planned = rewrite(
        captured.graph_module, model, Choice(((0, 3),), frozenset({0})), problem=problem
    )
    assert_equivalent(copy.deepcopy(model), model, planned, args, {})
    for block in model:
        block.drop.p = 0.2
    with pytest.raises(PlanningError, match=r"inside \w+, which the plan keeps.*dropout"):
        planned(*args)


class _Recomputing:
    """Dispatch modes for the fact below, active in a checkpoint's recompute only: ``Replay``
    returns a storage-less result (a 0-d tensor expanded to the op's output) instead of
    computing; ``Cached`` answers the ops the forward cached."""

    def __init__(self):
        self.on, self.cache, self.replayed = False, [], []
        owner = self

        class Replay(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not owner.on or _aliases(func):  # views stay views of real inputs
                    return func(*args, **(kwargs or {}))
                owner.replayed.append(func)
                with _disable_current_modes():
                    meta = func(*tree_map_only(torch.Tensor, lambda t: t.to("meta"), args))
                    return torch.empty((), dtype=meta.dtype).expand(meta.shape)

        class Cached(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is not torch.ops.aten._softmax.default:
                    return func(*args, **(kwargs or {}))
                if owner.on:
                    return owner.cache.pop(0)
                out = func(*args, **(kwargs or {}))
                owner.cache.append(out.detach())
                return out

        self.replay, self.cached = Replay, Cached

    @contextlib.contextmanager
    def recompute(self):
        self.on = True
        try:
            yield
        finally:
            self.on = False


def test_fact_a_recompute_can_replay_an_op_without_computing_what_nothing_saves():
    """What replayed nodes rest on (``planner.choice.replayed_nodes``; the tests below run
    them through plans): with the softmax's output kept, the attention scores feeding it
    are saved by nothing, yet their matmul must run in the recompute, whose autograd record
    saves its inputs for its own backward. Run under a mode that returns a storage-less
    result, it costs no FLOPs and no memory, and the gradients stay bit-equal."""
    torch.manual_seed(0)
    weight, x = torch.randn(8, 24, requires_grad=True), torch.randn(2, 16, 8, requires_grad=True)
    modes = _Recomputing()

    def attention(x, weight, replay, cached):
        q, k, v = (x @ weight).split(8, dim=-1)
        with replay():
            scores = q @ k.transpose(1, 2) / 8**0.5
        with cached():
            probabilities = torch.softmax(scores, -1)
        return probabilities @ v

    attention(x, weight, contextlib.nullcontext, contextlib.nullcontext).pow(2).sum().backward()
    expected = x.grad, weight.grad
    x.grad = weight.grad = None
    checkpoint(
        attention, x, weight, modes.replay, modes.cached, use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), modes.recompute()),
    ).pow(2).sum().backward()  # fmt: skip
    assert modes.replayed == [  # in the recompute only
        torch.ops.aten.bmm.default,
        torch.ops.aten._unsafe_view.default,
        torch.ops.aten.div.Tensor,
    ]
    assert torch.equal(x.grad, expected[0]) and torch.equal(weight.grad, expected[1])


class Attention(nn.Module):
    """Attention blocks whose scores (``q @ k.T``, scaled) feed only a softmax, which saves
    its own output: keep the softmax, and nothing needs the scores in a recompute."""

    def __init__(self, width=32, blocks=2, squared=False, heads=1):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(blocks))
        self.width, self.squared, self.heads = width, squared, heads

    def forward(self, x):
        batch, length, _ = x.shape
        for qkv in self.qkv:
            q, k, v = qkv(x).split(self.width, dim=-1)
            if self.heads > 1:  # (batch, heads, length, width / heads), not contiguous
                q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            scores = q @ k.transpose(-2, -1) / self.width**0.5
            if self.squared:  # a multiplication saves the scores for its own backward
                scores = scores * scores
            x = torch.softmax(scores, -1) @ v
            if self.heads > 1:
                x = x.transpose(1, 2).reshape(batch, length, self.width)
        return x


def _attention(batch=4, **options):
    torch.manual_seed(0)
    model, args = Attention(**options), (torch.randn(batch, 64, 32, requires_grad=True),)
    captured, problem = prepare(model, args)
    softmaxes = frozenset(k for k in range(problem.size) if problem.labels[k] == "softmax")
    return model, args, captured, problem, Choice(((0, problem.size),), softmaxes)


def _named(problem, positions) -> list[str]:
    return [problem.names[k] for k in sorted(positions)]


def test_keeping_a_softmax_replays_the_scores_that_feed_it():
    """The recompute runs the scores' matmul and scaling through autograd, which saves ``q``
    and ``k`` for the matmul's backward, but computes neither: the planned step runs exactly
    the FLOPs the simulator predicts, its peak is the predicted peak, and it trains exactly
    like the model."""
    model, args, captured, problem, choice = _attention()
    replayed = np.flatnonzero(replayed_nodes(problem, choice))
    assert _named(problem, replayed) == ["matmul", "truediv", "matmul_2", "truediv_1"]
    scores = problem.flops[replayed].sum()
    recomputing_all = simulate(problem, Choice(choice.segments))
    assert simulate(problem, choice).recompute_flops == recomputing_all.recompute_flops - scores

    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    extra = _step_flops(planned, args) - _step_flops(model, args)
    assert extra == simulate(problem, choice).recompute_flops
    args[0].grad = None
    assert peak_memory(planned, args).peak_bytes == simulate(problem, choice).peak_bytes
    assert_equivalent(copy.deepcopy(model), model, planned, args, {})


def test_a_problem_given_other_seconds_charges_its_replays_in_them():
    """A replay costs a share of its node's time, so a problem whose ``seconds`` are replaced
    (a cost model of FLOPs first, pooled measured times: ``dataclasses.replace``) charges its
    replays in the new seconds. Found measuring: they kept the old cost model's, 10-1000 times
    the new scale, and ``auto`` shunned replays it should have chosen."""
    _, _, _, problem, choice = _attention(heads=4)
    replayed = replayed_nodes(problem, choice)
    assert (problem.replay_seconds[replayed] > 0).any()  # the copies a 4-d matmul makes
    assert (problem.replay_seconds <= problem.seconds).all()
    slower = dataclasses.replace(problem, seconds=1000 * problem.seconds)
    np.testing.assert_allclose(slower.replay_seconds, 1000 * problem.replay_seconds)
    np.testing.assert_allclose(
        recompute_costs(slower, choice)[0], 1000 * recompute_costs(problem, choice)[0]
    )


def test_a_replay_computes_the_copies_a_matmul_saves_for_its_own_backward():
    """With heads, ``q @ k.T`` multiplies 4-d tensors that are not contiguous: the matmul
    copies them into 3-d ones, which its ``bmm`` saves. Its replay computes the copies and
    fakes the ``bmm``: FLOPs and peak as predicted, gradients exact."""
    model, args, captured, problem, choice = _attention(heads=4)
    replayed = np.flatnonzero(replayed_nodes(problem, choice))
    assert "matmul" in _named(problem, replayed)
    assert problem.replay_reads[replayed].any() and problem.replay_flops[replayed].sum() == 0
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    extra = _step_flops(planned, args) - _step_flops(model, args)
    assert extra == simulate(problem, choice).recompute_flops
    assert extra < simulate(problem, Choice(choice.segments)).recompute_flops
    args[0].grad = None
    assert peak_memory(planned, args).peak_bytes == simulate(problem, choice).peak_bytes
    assert_equivalent(copy.deepcopy(model), model, planned, args, {})


class FrozenLayersUnderAutocast(nn.Module):
    """Fine-tuning the last layer of a bf16 model: autocast casts the frozen weights at every
    call (it caches casts of weights that train only), inside the Linear's node."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.a.requires_grad_(False)
        self.b.requires_grad_(False)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.b(torch.nn.functional.gelu(self.a(x))) + x
            return self.c(self.norm(h)).float()


def test_a_frozen_linear_under_autocast_is_recomputed_not_replayed_on_stand_ins():
    """Found by a tester: replaying ``b`` (its output read only by the kept ``add``) faked the
    casts of its frozen weight and bias; ``F.linear`` took the ``mm`` path on those stand-ins,
    not the profile's ``addmm``, and the recompute raised in backward. A node whose faked op
    would compute from another's stand-in is recomputed: the step trains exactly like the
    model, at its predicted peak."""
    torch.manual_seed(0)
    model, args = FrozenLayersUnderAutocast(), (torch.randn(4, 32, 16),)
    captured, problem = prepare(model, args)
    add = next(k for k in range(problem.size) if problem.labels[k] == "add")
    choice = Choice(((1, add + 2),), frozenset({add}))  # to the norm, which saves the sum
    validate_choice(problem, choice)
    assert "b" not in _named(problem, np.flatnonzero(replayed_nodes(problem, choice)))
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    assert peak_memory(planned, args).peak_bytes == simulate(problem, choice).peak_bytes
    assert_equivalent(copy.deepcopy(model), model, planned, args, {})


class Affine(nn.Module):
    """Several ops in one node (kept whole), each computing from the one before."""

    def forward(self, x):
        return (x * 2.0 + 1.0) * 0.5


class ScoresThroughAffine(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.affine, self.b = nn.Linear(64, 64), Affine(), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.softmax(self.affine(self.a(x)), -1))


def test_a_node_of_several_ops_feeding_a_kept_node_is_recomputed_at_its_predicted_peak():
    """Found by review: the first fix above computed every op of such a node whose result a
    later op read, in a replay the simulator counts as making nothing: 19% over the
    prediction. The node is recomputed, as the simulator replays it."""
    torch.manual_seed(0)
    model, args = ScoresThroughAffine(), (torch.randn(64, 64),)
    captured, problem = prepare(model, args, capture_options=CaptureOptions(leaf_modules=(Affine,)))
    softmax = next(k for k in range(problem.size) if problem.labels[k] == "softmax")
    choice = Choice(((0, softmax + 2),), frozenset({softmax}))
    validate_choice(problem, choice)
    assert not replayed_nodes(problem, choice).any()
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    assert peak_memory(planned, args).peak_bytes == simulate(problem, choice).peak_bytes
    assert_equivalent(copy.deepcopy(model), model, planned, args, {})


@torch.library.custom_op("planner_tests::triple", mutates_args=())
def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0


@triple.register_fake
def _(x):
    return torch.empty_like(x)


triple.register_autograd(lambda ctx, grad: grad * 3.0)


class TripledByACustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.tanh(triple(self.a(x))))


def test_a_kept_custom_op_is_served_from_the_cache_like_an_aten_op():
    """Found by review: the first policy for hooks' ops recomputed every op outside ATen, so a
    kept custom op computed from its replayed input's stand-in: gradients off by 300, garbage,
    and the peak off its prediction. The model's own ops are cached whatever their library."""
    torch.manual_seed(0)
    model, args = TripledByACustomOp(), (torch.randn(64, 64),)
    captured, problem = prepare(model, args)
    custom = next(k for k in range(problem.size) if "triple" in problem.names[k])
    choice = Choice(((0, custom + 2),), frozenset({custom}))
    validate_choice(problem, choice)
    assert replayed_nodes(problem, choice)[custom - 1]  # its input is replayed
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    assert peak_memory(planned, args).peak_bytes == simulate(problem, choice).peak_bytes
    assert_equivalent(copy.deepcopy(model), model, planned, args, {})


class ScaledAttention(nn.Module):
    """Scores scaled by a parameter and by a tensor argument: ``scores * t`` saves the scores
    for ``t``'s gradient only when ``t`` requires grad."""

    def __init__(self, width=32):
        super().__init__()
        self.qkv, self.width = nn.Linear(width, 3 * width), width
        self.temperature = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, scale):
        q, k, v = self.qkv(x).split(self.width, dim=-1)
        scores = q @ k.transpose(-2, -1) * self.temperature * scale
        return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("unfrozen", ["parameter", "argument"])
def test_a_call_training_other_tensors_than_planned_recomputes_what_it_would_replay(unfrozen):
    """Found by review: planned with the temperature frozen (and the scale a constant), the
    scores are saved by nothing and replayed; unfrozen after planning, autograd saves them for
    the new gradient, and a replay handed backward a stand-in (the temperature's gradient read
    uninitialised memory). A call whose ``requires_grad`` flags (or sizes) differ from the
    planning call's recomputes instead, exactly."""
    torch.manual_seed(0)
    model, x, scale = ScaledAttention(), torch.randn(2, 16, 32), torch.tensor(0.5)
    model.temperature.requires_grad_(False)
    captured, problem = prepare(model, (x, scale))
    softmax = frozenset(k for k in range(problem.size) if problem.labels[k] == "softmax")
    choice = Choice(((0, problem.size),), softmax)
    assert "matmul" in _named(problem, np.flatnonzero(replayed_nodes(problem, choice)))
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    if unfrozen == "parameter":
        model.temperature.requires_grad_(True)
    else:
        scale.requires_grad_(True)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan's memory no longer holds: it says so
        assert_equivalent(reference, model, planned, (x, scale), {})


class ScaledByState(nn.Module):
    """Scores scaled by a tensor the graph reads as an attribute: a buffer, a plain tensor
    attribute (a constant to the graph) or a frozen root parameter."""

    def __init__(self, kind: str, width=32):
        super().__init__()
        self.qkv, self.width = nn.Linear(width, 3 * width), width
        if kind == "buffer":
            self.register_buffer("t", torch.tensor(0.5))
        elif kind == "attribute":
            self.t = torch.tensor(0.5)
        else:
            self.t = nn.Parameter(torch.tensor(0.5), requires_grad=False)

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.width, dim=-1)
        return torch.softmax(q @ k.transpose(-2, -1) * self.t, -1) @ v


@pytest.mark.parametrize("kind", ["buffer", "attribute", "functional_call"])
def test_a_call_whose_graph_tensors_require_grad_now_recomputes_what_it_would_replay(kind):
    """Found by a second review: the gate above saw parameters and arguments only. A buffer
    or tensor attribute made to require grad after planning, or a root parameter that
    ``torch.func.functional_call`` swaps for one that requires grad, gave the scale a zero
    (or uninitialised) gradient. The tensors the graph reads as attributes count too."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model, x = ScaledByState(kind), torch.randn(2, 16, 32)
    captured, problem = prepare(model, (x,))
    softmax = frozenset(k for k in range(problem.size) if problem.labels[k] == "softmax")
    choice = Choice(((0, problem.size),), softmax)
    assert "matmul" in _named(problem, np.flatnonzero(replayed_nodes(problem, choice)))
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    reference = copy.deepcopy(model)
    if kind == "functional_call":
        given = [torch.tensor(0.5, requires_grad=True) for _ in range(2)]
        functional_call(reference, {"t": given[0]}, (x,)).sum().backward()
        functional_call(planned, {"t": given[1]}, (x,)).sum().backward()
        expected, got = given[0].grad, given[1].grad
    else:
        reference.t.requires_grad_(True)
        model.t.requires_grad_(True)
        reference(x).sum().backward()
        planned(x).sum().backward()
        expected, got = reference.t.grad, model.t.grad
    assert got is not None and torch.equal(got, expected)


def test_a_node_whose_ops_make_tensors_from_nothing_is_not_replayed():
    """Found by review: ``torch.ones`` in a replayed node ran (a replay fakes only ops with
    tensor arguments, given no device) while the simulator counted nothing for it. Such ops
    are computed in a replay; a node of them alone is recomputed, and the peak holds."""

    class Masked(nn.Module):
        def __init__(self, width=8):
            super().__init__()
            self.qkv, self.width = nn.Linear(width, 3 * width), width

        def forward(self, x):
            q, k, v = self.qkv(x).split(self.width, dim=-1)
            length = x.shape[1]
            mask = torch.ones(4, length, length).tril().log()
            return torch.softmax(q @ k.transpose(-2, -1) + mask, -1) @ v

    torch.manual_seed(0)
    model, args = Masked(), (torch.randn(1, 256, 8),)
    captured, problem = prepare(model, args)
    softmax = frozenset(k for k in range(problem.size) if problem.labels[k] == "softmax")
    choice = Choice(((0, problem.size),), softmax)
    replayed = _named(problem, np.flatnonzero(replayed_nodes(problem, choice)))
    assert "matmul" in replayed and "ones" not in replayed
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    assert peak_memory(planned, args).peak_bytes == simulate(problem, choice).peak_bytes
    assert (
        _step_flops(planned, args) - _step_flops(model, args)
        == simulate(problem, choice).recompute_flops
    )


class Regroup(nn.Module):
    """One node of several ops: a transpose, then a reshape that copies (``clone``,
    ``_unsafe_view``), or views what is already laid out so (a stand-in is)."""

    def forward(self, x):
        return x.transpose(1, 2).reshape(x.shape[0], -1)


class RegroupedScores(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.qk, self.width, self.regroup = nn.Linear(width, 2 * width), width, Regroup()

    def forward(self, x):
        q, k = self.qk(x).split(self.width, dim=-1)
        return torch.softmax(self.regroup(q @ k.transpose(1, 2)), -1).sum(-1)


def test_a_kept_node_of_several_ops_reads_no_stand_in():
    """Found while widening replays: a kept node whose ops depend on its input's strides
    dispatched other ops on a stand-in than on the forward's tensor, and the cache, matching
    the recompute's ops to the forward's, refused ("invocation index 1 ... not found"). Only
    kept or replayed nodes of one op (``Problem.one_op``) may read a stand-in."""
    torch.manual_seed(0)
    model, args = RegroupedScores(), (torch.randn(4, 32, 16, requires_grad=True),)
    captured, problem = prepare(model, args, capture_options=CaptureOptions((Regroup,)))
    regroup = problem.names.index("regroup")
    assert problem.keepable[regroup] and not problem.one_op[regroup]
    choice = Choice(((0, problem.size),), frozenset({regroup}))
    assert "matmul" not in _named(problem, np.flatnonzero(replayed_nodes(problem, choice)))
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    assert_equivalent(copy.deepcopy(model), model, planned, args, {})


def test_nothing_is_replayed_where_the_recompute_needs_the_values():
    """Not without the kept softmax (it recomputes from the scores), and not where a node of
    the segment saves the scores (``scores * scores``): backward would get the stand-in. The
    multiplication itself, which only the kept softmax reads, is replayed."""
    model, args, captured, problem, choice = _attention()
    assert not replayed_nodes(problem, Choice(choice.segments)).any()
    model, args, captured, problem, choice = _attention(squared=True)
    assert _named(problem, np.flatnonzero(replayed_nodes(problem, choice))) == ["mul", "mul_1"]
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    assert_equivalent(copy.deepcopy(model), model, planned, args, {})


def test_a_plan_replays_what_its_kept_nodes_leave_unneeded():
    """``plan`` rewrites with the replays its prediction counts, and ``optimal`` keeps a
    softmax for them (at 80% of the way from the lowest peak to the unplanned one, measured);
    the plan names them where it names its kept nodes."""
    model, args, _, problem, _ = _attention(batch=32, blocks=4)
    lowest, unplanned = lowest_peak(problem).peak_bytes, simulate(problem, ()).peak_bytes
    planned = plan(model, args, budget_bytes=int(lowest + 0.8 * (unplanned - lowest)))
    replayed = replayed_nodes(problem, planned.choice)
    assert replayed.any()
    names = _named(problem, np.flatnonzero(replayed))
    assert planned.replayed == frozenset(np.flatnonzero(replayed).tolist())
    assert sorted(n for row in planned.segment_table() for n in row["replayed"]) == names
    assert f"{len(names)} replayed in their recomputes" in str(planned)
    assert f"replaying {len(names)} in their recomputes" in planned._repr_html_()
    assert planned.recompute_flops == simulate(problem, planned.choice).recompute_flops
    extra = _step_flops(planned.module, args) - _step_flops(model, args)
    assert extra == planned.recompute_flops
    args[0].grad = None
    assert peak_memory(planned.module, args).peak_bytes == planned.predicted_peak_bytes


@pytest.mark.parametrize("kept", ["second", "both"])
def test_allowed_random_keeps_train_exactly_like_the_original(kept):
    model, args, captured, problem, first, second = _random_nodes()
    reference = copy.deepcopy(model)
    keep = {second} if kept == "second" else {first, second}
    planned = rewrite(
        captured.graph_module, model, Choice(((0, problem.size),), frozenset(keep)), problem=problem
    )
    assert_equivalent(reference, model, planned, args, {})


def _backward_twice(module, params, args):
    loss = training_loss(module(*args))
    loss.backward(retain_graph=True)
    loss.backward()


def _gradient_penalty(module, params, args):
    loss = training_loss(module(*args))
    grads = torch.autograd.grad(loss, params, create_graph=True)
    (loss + sum(g.pow(2).sum() for g in grads)).backward()


@pytest.mark.parametrize("step", [_backward_twice, _gradient_penalty])
@pytest.mark.parametrize("name", ["resnet", "bert"])
def test_a_second_backward_over_the_same_graph_recomputes_exactly(name, step):
    """Found by trying the library: segments with a ``context_fn`` (BatchNorm buffers on the
    ResNet, kept nodes and dropout on the BERT) raised on their second recompute, where the
    model itself runs. The second recompute also runs the kept nodes' ops (torch's cache hands
    each result over once)."""
    from planner import zoo
    from planner.solvers.auto import lowest_peak

    torch.manual_seed(0)
    model, args = zoo.build(name, **({"layers": 2} if name == "bert" else {}))
    reference = copy.deepcopy(model)
    _, problem = prepare(model, args)
    lowest, baseline = lowest_peak(problem).peak_bytes, simulate(problem, ()).peak_bytes
    p = plan(model, args, budget_bytes=int(lowest + 0.3 * (baseline - lowest)))
    assert p.keep if name == "bert" else p.segments  # a context_fn for the test to mean anything
    for m in (reference, model):
        torch.manual_seed(1)
        step(p.module if m is model else m, list(m.parameters()), args)
    for (key, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), key
    for (key, a), b in zip(reference.named_buffers(), model.buffers()):
        assert torch.equal(a, b), key


def test_batchnorm_statistics_are_updated_once_under_a_partial_recompute():
    """The buffer-restoring context composes with the selective-checkpoint ones: the
    recompute reruns BatchNorm (never keepable: it writes its statistics) beside kept Linears."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh()
    )
    args = (torch.randn(5, 6),)
    reference = copy.deepcopy(model)
    captured, problem = prepare(model, args)
    batchnorms = [k for k, label in enumerate(problem.labels) if label in ("1", "4")]
    assert not problem.keepable[batchnorms].any()
    linears = frozenset(k for k, label in enumerate(problem.labels) if label in ("0", "3"))
    planned = rewrite(
        captured.graph_module, model, Choice(((0, problem.size),), linears), problem=problem
    )
    assert_equivalent(reference, model, planned, args, {})
    assert int(model[1].num_batches_tracked) == 2  # one per step of assert_equivalent


def test_a_node_that_is_mutated_in_place_later_cannot_be_kept():
    """torch refuses a cached tensor that changed since the forward; such nodes are not
    keepable (and nodes that mutate anything themselves, e.g. dropout's bernoulli_)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    _, problem = prepare(model, (torch.randn(2, 4),))
    assert problem.keepable.tolist() == [False, False, True]


def _chain():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)]
    return nn.Sequential(*layers), (torch.randn(1024, 16),)


@pytest.mark.parametrize("every", [3, 2])
def test_simulated_peak_moves_exactly_as_the_measured_peak_when_nodes_are_kept(every):
    """Against the CPU live-storage tracker: keeping nodes changes the predicted peak by
    exactly what it changes the measured one (the simulator's fixed offset on this model,
    a few bytes, is that of the plain plan). Each segment ends at a LayerNorm, the node where
    its recompute stops, which runs since it saves its own statistics: keeping it is allowed."""
    model, args = _chain()
    captured, problem = prepare(model, args)
    segments = ((0, 6), (6, problem.size))
    stops = {recompute_stop(problem, start, stop) - 1 for start, stop in segments}
    assert stops == {5, problem.size - 1} and problem.keepable[list(stops)].all()
    errors, kept = set(), set()
    for offset in range(every):
        keep = frozenset(
            k
            for start, stop in segments
            for k in range(start, recompute_stop(problem, start, stop))
            if (k - offset) % every == 0 and problem.keepable[k]
        )
        kept |= keep
        plan = assemble(
            model,
            captured,
            problem,
            Choice(segments, keep),
            solver="test",
            budget_bytes=1,
            solve_seconds=0.0,
            started=time.perf_counter(),
        )
        peak_memory(plan.module, args)  # warm up: first steps allocate lazily
        errors.add(plan.predicted_peak_bytes - peak_memory(plan.module, args).peak_bytes)
    flat = _plan(model, args, segments)
    peak_memory(flat.module, args)
    assert errors == {flat.predicted_peak_bytes - peak_memory(flat.module, args).peak_bytes}
    assert max(abs(e) for e in errors) < 64
    assert stops <= kept


def _three_linears():
    """Linear, ReLU, Linear, Tanh, Linear: each Linear saves only its input (early stops end
    there without running it); ReLU and Tanh save their own outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)
    )
    return model, (torch.randn(32, 64),)


def _step_flops(module, args) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        module(*args).sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "choice, linears",
    [
        (Choice(((0, 3),)), 1),  # ends at a Linear: the recompute stops before running it
        (Choice(((0, 4),)), 2),  # ends at Tanh, which saves its output: both Linears rerun
        (Choice(((0, 2), (2, 4))), 2),
        (Choice(((0, 4),), frozenset({0})), 1),  # the first Linear comes from the cache
        (Choice(((0, 5),), frozenset({2})), 1),  # a kept Linear, then a stop at a Linear
        # the stop node itself kept: the Linear feeding it is replayed (nothing needs its
        # values: planner.choice.replayed_nodes)
        (Choice(((0, 4),), frozenset({3})), 1),
    ],
)
def test_predicted_recompute_flops_equal_what_backward_really_runs(choice, linears):
    """FlopCounterMode over a real step, planned against unplanned: the extra FLOPs are the
    simulator's recompute FLOPs (matmuls only, as both count)."""
    model, args = _three_linears()
    captured, problem = prepare(model, args)
    assert problem.labels == ("0", "1", "2", "3", "4")
    extra = _step_flops(
        rewrite(captured.graph_module, model, choice, problem=problem), args
    ) - _step_flops(model, args)
    assert extra == linears * 2 * 32 * 64 * 64
    assert simulate(problem, choice).recompute_flops == extra


class AutocastLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.b(torch.tanh(self.a(x)))
        return self.c(h.float())


def test_a_recompute_stopping_inside_a_linear_under_autocast_runs_only_its_casts():
    """Found by a tester: under autocast a Linear casts its input and weight and saves the
    casts, so a recompute ending at it stops once they are saved, before its matmul. The
    predicted FLOPs count what the node runs until its last save (``Problem.stop_flops``):
    they counted the whole Linear, twice what ran here."""
    torch.manual_seed(0)
    model, args = AutocastLinears(), (torch.randn(32, 64),)
    captured, problem = prepare(model, args)
    b = problem.names.index("b")
    choice = Choice(((1, b + 1),))
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    extra = _step_flops(planned, args) - _step_flops(model, args)
    assert extra == 2 * 32 * 64 * 64  # the first Linear's matmul, not the second's
    assert simulate(problem, choice).recompute_flops == extra


def test_a_node_the_recompute_never_runs_cannot_be_kept():
    """A Linear saves only its input, so the recompute stops before running it: a cache entry
    for it would never be used."""
    model, args = _three_linears()
    _, problem = prepare(model, args)
    with pytest.raises(ValueError, match="never runs it"):
        validate_choice(problem, Choice(((0, 3),), frozenset({2})))


def test_keeping_costs_memory_and_saves_recompute():
    model, args = _chain()
    _, problem = prepare(model, args)
    segments = ((0, 6), (6, problem.size))
    linears = frozenset(k for k in range(problem.size) if problem.labels[k] in ("0", "3", "6"))
    flat, selective = simulate(problem, segments), simulate(problem, Choice(segments, linears))
    assert selective.peak_bytes > flat.peak_bytes
    assert selective.recompute_seconds < flat.recompute_seconds


def test_a_plan_shows_its_kept_nodes():
    model, args = _chain()
    _, problem = prepare(model, args)
    keep = frozenset({0, 3})
    plan = _plan(model, args, Choice(((0, 6), (6, problem.size)), keep))
    assert plan.keep == keep and plan.choice == Choice(((0, 6), (6, problem.size)), keep)
    rows = plan.segment_table()
    assert rows[0]["kept"] == [problem.names[0], problem.names[3]] and rows[1]["kept"] == []
    assert rows[0]["kept_bytes"] == int(problem.kept_bytes[0] + problem.kept_bytes[3])
    text = str(plan)
    assert "2 nodes kept inside them" in text and "kept bytes" in text
    assert "kept nodes" in plan._repr_html_()
    from planner import viz

    assert viz.memory_timeline(plan)["plan"].peak_bytes == plan.predicted_peak_bytes


def test_the_drawing_and_memory_plot_name_the_kept_nodes():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    model, args = _chain()
    _, problem = prepare(model, args)
    plan = _plan(model, args, Choice(((0, 6), (6, problem.size)), frozenset({0, 3})))
    figure = plan.draw()
    assert "2 nodes kept inside them" in figure.axes[0].get_title()
    assert any("kept" in t.get_text() for t in figure.axes[0].texts)
    axes = plan.plot_memory().axes[0]
    assert any("2 kept nodes" in t.get_text() for t in axes.get_legend().get_texts())
    plt.close("all")


# -- the simulator against the CPU tracker, on random plans with kept nodes ----------------------


def _restored_bytes(module) -> int:
    """Bytes of the buffers the planned module's segments copy to restore them in the recompute
    (``planner.rewrite.Segment``; not modelled by the simulator yet): a copy lives from a
    segment's forward to the end of its recompute, a second one during the recompute."""
    from planner.rewrite import Segment

    segments = {
        id(v): v for m in module.modules() for v in vars(m).values() if isinstance(v, Segment)
    }
    return sum(b.untyped_storage().nbytes() for s in segments.values() for b in s.buffers())


def _prediction_error(model, args, kwargs, captured, problem, choice) -> tuple[int, int]:
    """(predicted minus measured peak, bytes the segments copy to restore buffers), the
    measurement taken against the rewritten graph's with nothing checkpointed (its loss
    scalars are not in the replay)."""
    plain = rewrite(captured.graph_module, model, (), problem=problem)
    peak_memory(plain, args, kwargs)
    offset = peak_memory(plain, args, kwargs).peak_bytes - simulate(problem, ()).peak_bytes
    planned = rewrite(captured.graph_module, model, choice, problem=problem)
    peak_memory(planned, args, kwargs)  # warm up: first steps allocate lazily
    measured = peak_memory(planned, args, kwargs).peak_bytes - offset
    return simulate(problem, choice).peak_bytes - measured, _restored_bytes(planned)


_GPT: dict = {}


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_simulated_peak_equals_the_measured_peak_of_random_selective_plans_on_the_zoo_gpt(data):
    """Random segments with random kept nodes. Two effects are left out of the replay, each
    bounded here by what it measured: the copies of the causal-mask buffer the rewrite makes
    per segment (4096 bytes each, under the measurement) and a node's backward taken as one
    step (the last Linear's bias gradient counts with its matmuls, up to 2048 bytes over).
    Before the frame of a recompute was modelled, the replay was 287 KB under the measurement
    and, for segments that save nothing or end in views, 381 KB over it."""
    from planner import zoo

    if not _GPT:
        model, args = zoo.build("gpt")
        _GPT["prepared"] = (model, args, *prepare(model, args))
    model, args, captured, problem = _GPT["prepared"]
    choice = data.draw(random_choices(problem), label="choice")
    error, restored = _prediction_error(model, args, {}, captured, problem, choice)
    assert -2 * restored <= error <= 2048, (error, restored)


@settings(max_examples=20, deadline=None)
@given(spec=model_specs(untraceable=None), data=st.data())
def test_simulated_peak_is_never_below_the_measured_peak_of_random_selective_plans(spec, data):
    """The same on generated models (BatchNorm, dropout, in-place ReLU, shared layers, traced
    or exported), in the direction that matters for a budget: the replay is never under the
    measurement but for the buffer copies the rewrite makes. (It can be over: by up to 576
    bytes on the generated models measured, causes not yet found.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = build(spec)
        args, kwargs = inputs(spec)
        captured, problem = prepare(model, args, kwargs)
        choice = data.draw(random_choices(problem), label="choice")
        error, restored = _prediction_error(model, args, kwargs, captured, problem, choice)
    assert error >= -2 * restored, (error, restored)


class CausalAttention(nn.Module):
    """Fused attention (``dropout_p=0``, which torch still tags as random) then dropout."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.drop = nn.Linear(32, 96), nn.Linear(32, 32), nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.out(attended.transpose(1, 2).reshape(2, 16, 32)))


def test_a_kept_attention_planned_on_meta_runs_where_its_kernel_is_tagged_random():
    """Found by review of the refusal of kept nodes that draw since planning: planned on the
    meta device, a kept attention profiles a kernel torch does not tag as random, and on the
    CPU runs one it does, though with ``dropout_p=0`` it draws nothing."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(CausalAttention(), CausalAttention())
    x = torch.randn(2, 16, 32)
    captured, problem = prepare(model, (x.to("meta"),))
    kept = frozenset(i for i, name in enumerate(problem.names) if "scaled_dot" in name)
    assert kept and not problem.random[sorted(kept)].any()
    plan = assemble(
        model,
        captured,
        problem,
        Choice(((0, problem.size),), kept),
        solver="test",
        budget_bytes=1,
        solve_seconds=0.0,
        started=time.perf_counter(),
    )
    model.to_empty(device="cpu")
    for parameter in model.parameters():
        nn.init.normal_(parameter, std=0.1)
    assert_equivalent(copy.deepcopy(model), model, plan.module, (x,), {})


def test_kernels_torch_tags_as_random_draw_nothing_without_dropout():
    """Found by review: torch tags fused attention and cuDNN's RNN as random whatever their
    dropout, so a kept LSTM moved to CUDA, or an attention planned on meta, was refused as a
    kept node drawing since planning."""
    aten = torch.ops.aten
    assert not _draws(aten._cudnn_rnn.default, (), {"dropout": 0.0, "train": True})
    assert not _draws(aten._cudnn_rnn.default, (), {"dropout": 0.3, "train": False})
    assert _draws(aten._cudnn_rnn.default, (), {"dropout": 0.3, "train": True})
    assert not _draws(aten._scaled_dot_product_flash_attention_for_cpu.default, (), {})
    assert _draws(aten.bernoulli.default, (torch.zeros(2),), {})
