"""Specification of the planned module after planning: moves, modes, pickling, calls, changes.

The planned module shares the model's modules, parameters and buffers. Whatever a user does to
either of them after planning (``.double()``, ``.to("meta")``, ``.eval()``, replacing a
submodule, leaving out an argument, pickling) must give exactly what the unplanned model gives
after the same thing, or a clear ``PlanningError``. Each comparison uses an untouched deep copy
of the model as the reference and ``strategies.assert_equivalent`` (outputs, every gradient,
RNG state and every buffer, exactly).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import functools
import gc
import io
import pickle
import re
import types
import warnings
import weakref

import numpy as np
import pytest
import torch
import torch.nn.utils.prune
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint
from torch.utils.module_tracker import ModuleTracker

import planner
from planner import zoo
from planner.pipeline import prepare
from planner.planned_module import PlannedModule
from planner.problem import compute_nodes
from planner.rewrite import _context_fn, rewrite
from planner.simulate import Choice
from planner.solvers.auto import lowest_peak
from planner.step import peak_memory
from strategies import assert_equivalent, build, inputs, model_specs, plain_spec, random_segments

EXAMPLES = settings.default.max_examples


def tight_plan(model, args, kwargs=None):
    """A plan at the lowest achievable peak: as many checkpointed segments as it takes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _, problem = prepare(model, args, kwargs)
        p = planner.plan(
            model, args, budget_bytes=lowest_peak(problem).peak_bytes, example_kwargs=kwargs
        )
    assert p.segments, "the test needs checkpointed segments"
    return p


def exported_batchnorm_model():
    """Linear, BatchNorm, dropout...: a forward symbolic_trace rejects, so torch.export captures."""
    spec = plain_spec(
        (
            ("layer", False),
            ("norm", "bn"),
            ("act", "tanh"),
            ("dropout", 0.5),
            ("layer", False),
            ("norm", "bn"),
            ("act", "gelu"),
            ("layer", False),
        ),
        untraceable=True,
        input_requires_grad=True,
        seed=3,
    )
    args, kwargs = inputs(spec)
    return build(spec), args, kwargs


def traced_batchnorm_model():
    model, args = zoo.resnet(blocks=2, channels=8, batch=4, image=8)
    return model, args, {}


MODELS = {"symbolic_trace": traced_batchnorm_model, "export": exported_batchnorm_model}


def to_double(tree):
    return tree_map_only(
        torch.Tensor, lambda t: t.detach().double().requires_grad_(t.requires_grad), tree
    )


# --------------------------------------------------------------------------------------------
# dtype and device moves after planning (buffers are looked up when a segment runs)

MOVES = {
    "planned.double()": lambda p, model: p.module.double(),
    "planned.to(float64)": lambda p, model: p.module.to(torch.float64),
    "model.double()": lambda p, model: model.double(),
}


@pytest.mark.parametrize("capture", MODELS)
@pytest.mark.parametrize("move", MOVES)
def test_a_dtype_move_after_planning_trains_exactly_like_the_moved_model(capture, move):
    """The first call in float64 plans it (a budget float64 fits too: the plan runs)."""
    model, args, kwargs = MODELS[capture]()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        p = planner.plan(model, args, budget_bytes=10**9, solver="sqrt_n", example_kwargs=kwargs)
    assert p.capture_method == capture
    MOVES[move](p, model)
    reference.double()
    assert all(
        t.dtype == torch.float64 for t in model.state_dict().values() if t.is_floating_point()
    )
    with pytest.warns(UserWarning, match="planner planned this call form once"):
        assert_equivalent(reference, model, p.module, to_double(args), to_double(kwargs))
    [form] = p.module._planner.call_forms.values()
    assert any(n.target is torch.utils.checkpoint.checkpoint for n in form.graph.nodes)


@pytest.mark.parametrize("capture", MODELS)
def test_to_meta_after_planning_lets_go_of_every_cpu_buffer(capture):
    """``.to("meta")`` frees the model's memory: no segment may keep the old buffers alive.
    (torch.export keeps its own references to them: those are counted on both sides.)"""
    model, args, kwargs = MODELS[capture]()
    p = tight_plan(model, args, kwargs)
    old = [weakref.ref(b) for b in model.buffers()]
    p.module.to("meta")
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    if capture == "symbolic_trace":  # the exported model's backward cannot run on meta at all
        meta_args = tree_map_only(torch.Tensor, lambda t: t.to("meta"), args)
        p.module(*meta_args, **kwargs).sum().backward()  # runs: shapes only
    gc.collect()
    alive_with_the_plan = [r for r in old if r() is not None]
    del p
    gc.collect()
    assert alive_with_the_plan == [r for r in old if r() is not None]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize("capture", MODELS)
def test_cuda_after_planning_on_the_cpu_trains_exactly_like_the_moved_model(capture):
    model, args, kwargs = MODELS[capture]()
    reference = copy.deepcopy(model).cuda()
    p = tight_plan(model, args, kwargs)
    p.module.cuda()
    assert all(t.is_cuda for t in model.state_dict().values())
    on_cuda = tree_map_only(
        torch.Tensor, lambda t: t.detach().cuda().requires_grad_(t.requires_grad), (args, kwargs)
    )
    assert_equivalent(reference, model, p.module, *on_cuda)


def test_buffers_registered_on_the_model_itself_follow_a_move_of_either():
    """Root-level buffers are entries of both the model's and the planned module's own dicts."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("shift", torch.ones(32))
            self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            h = torch.tanh(self.b(torch.tanh(self.a(x) + self.shift)))
            return self.c(torch.tanh(h + self.shift))

    for move in MOVES.values():
        model, x = Scaled(), torch.randn(64, 32)
        reference = copy.deepcopy(model).double()
        p = tight_plan(model, (x,))
        move(p, model)
        assert model.shift.dtype == torch.float64
        assert_equivalent(reference, model, p.module, (x.double(),), {})
        assert p.module.shift is model.shift


class DtypeBranch(nn.Module):
    """A forward that branches on a dtype, as Hugging Face T5 clamps only in float16:
    ``symbolic_trace`` cannot branch on a proxy, so ``torch.export`` captures the branch taken."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if x.dtype == torch.float32:
            x = x * 2
        return x


def test_a_dtype_move_plans_the_moved_call_once_exactly_and_within_the_budget():
    """Found trying the library: after ``model.double()`` the plan ran the float32 branch
    (outputs off by 0.4). The first call in the new dtypes plans it (a call form of its own)."""
    torch.manual_seed(0)
    model, x = DtypeBranch(), torch.randn(64, 32)
    _, problem = prepare(copy.deepcopy(model).double(), (x.double(),))
    budget = lowest_peak(problem).peak_bytes  # a budget the float64 call needs segments for
    p = planner.plan(model, (x,), budget_bytes=budget)
    assert p.capture_method == "export"
    reference = copy.deepcopy(model).double()
    model.double()
    with pytest.warns(UserWarning, match=r"other dtypes than at planning.*float32 -> float64"):
        p.module(x.double())
    [(key, form)] = p.module._planner.call_forms.items()
    assert key.state == (torch.float64,) * 12 and key.arguments == (torch.float64,)
    assert any(n.target is torch.utils.checkpoint.checkpoint for n in form.graph.nodes)
    assert peak_memory(p.module, (x.double(),)).peak_bytes <= budget
    assert_equivalent(reference, model, p.module, (x.double(),), {})
    reference.float()
    model.float()  # the planning dtypes again: the first plan runs, with no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_equivalent(reference, model, p.module, (x,), {})


def test_a_loaded_plan_runs_the_model_after_a_dtype_move_and_says_to_plan_again(tmp_path):
    torch.manual_seed(0)
    model, x = DtypeBranch(), torch.randn(64, 32)
    planner.plan(model, (x,), budget_gb=1, solver="sqrt_n").save(tmp_path / "p.json")
    loaded = planner.load(tmp_path / "p.json", model, (x,))
    reference = copy.deepcopy(model).double()
    model.double()
    with pytest.warns(UserWarning, match=r"runs the model directly.*plan the moved model"):
        out = loaded.module(x.double())
    torch.testing.assert_close(out, reference(x.double()), rtol=0, atol=0)


class RootState(nn.Module):
    """A parameter and a buffer on the model itself, read by the traced forward."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(16))
        self.register_buffer("shift", torch.zeros(16))
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
        )

    def forward(self, x):
        return self.layers(x + self.pos + self.shift)


def sqrt_n_plan(model, args):
    p = planner.plan(model, args, budget_bytes=10**9, solver="sqrt_n")
    assert p.segments, "the test needs checkpointed segments"
    return p


def new_state(module):
    return {k: torch.randn_like(v) for k, v in module.state_dict().items()}


REPLACEMENTS = {
    "model.load_state_dict(assign=True)": lambda p, m: m.load_state_dict(new_state(m), assign=True),
    "planned.load_state_dict(assign=True)": lambda p, m: p.module.load_state_dict(
        new_state(m), assign=True
    ),
    "model.pos = Parameter": lambda p, m: setattr(m, "pos", nn.Parameter(torch.randn(16))),
    "planned.pos = Parameter": lambda p, m: setattr(p.module, "pos", nn.Parameter(torch.randn(16))),
    "planned.shift = tensor": lambda p, m: setattr(p.module, "shift", torch.ones(16)),
    "planned.register_buffer": lambda p, m: p.module.register_buffer("shift", torch.ones(16)),
}


@pytest.mark.parametrize("replace", REPLACEMENTS)
def test_root_tensors_replaced_on_either_module_are_the_ones_both_compute_with(replace):
    """The model and the planned module hold the same root parameters and buffers, whichever
    of the two gets new ones after planning."""
    torch.manual_seed(0)
    model, x = RootState(), torch.randn(8, 16)
    p = sqrt_n_plan(model, (x,))
    REPLACEMENTS[replace](p, model)
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})
    assert p.module.pos is model.pos and p.module.shift is model.shift


def test_functional_call_with_root_tensors_computes_with_the_tensors_passed():
    """``torch.func.functional_call`` swaps the planned module's own ``_parameters`` entries
    (no ``__setattr__``): found trying the library, the call ran with the model's ``pos``."""
    torch.manual_seed(0)
    model, x = RootState(), torch.randn(8, 16)
    p = sqrt_n_plan(model, (x,))
    reference = copy.deepcopy(model)
    grads = []
    for module in (reference, p.module):
        passed = {"pos": torch.randn(16, generator=torch.Generator().manual_seed(1))}
        passed["pos"].requires_grad_()
        passed["shift"] = torch.ones(16)
        out = torch.func.functional_call(module, passed, (x,))
        grads.append((out, *torch.autograd.grad(out.sum(), passed["pos"])))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert p.module.pos is model.pos and p.module.shift is model.shift  # put back
    model.pos = nn.Parameter(torch.randn(16))  # the model's replacements are still followed
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})


def _blocks(batch_norm: bool) -> nn.Sequential:
    def block():
        norm = [nn.BatchNorm1d(16)] if batch_norm else []
        return nn.Sequential(nn.Linear(16, 16), *norm, nn.Tanh())

    return nn.Sequential(*[block() for _ in range(4)], nn.Linear(16, 10))


def _nudged(module: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return {
        name: (p.detach() + 0.1 * torch.randn(p.shape, generator=g)).requires_grad_()
        for name, p in module.named_parameters()
    }


@pytest.mark.parametrize("batch_norm", [False, True])
def test_functional_call_gives_the_gradients_of_the_parameters_passed_to_checkpointed_modules(
    batch_norm,
):
    """``functional_call`` puts the model's own parameters back when it returns, before
    backward recomputes a segment: the recompute must use the tensors the forward used (as
    autograd, which saved them, does). Found trying the library: it recomputed with the
    model's own, and 7 of 10 gradients differed (15 of 18 with BatchNorm). Meta-learning
    (MAML) takes gradients this way."""
    torch.manual_seed(0)
    model, x = _blocks(batch_norm).train(), torch.randn(32, 16)
    reference = copy.deepcopy(model)
    p = sqrt_n_plan(model, (x,))
    results = []
    for module, own in ((reference, reference), (p.module, model)):
        passed = _nudged(own)
        out = torch.func.functional_call(module, passed, (x,))
        out.pow(2).mean().backward()
        results.append((out, [passed[name].grad for name in sorted(passed)]))
    (expected, expected_grads), (out, grads) = results
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
    assert all(param.grad is None for param in model.parameters())


def _replace_a_weight(model: nn.Module) -> None:
    model[1][0].weight = nn.Parameter(torch.zeros(16, 16))


def _freeze(model: nn.Module) -> None:
    model[1].requires_grad_(False)  # autograd then leaves its gradients None


def _eval(model: nn.Module) -> None:
    model.eval()


@pytest.mark.parametrize("change", [_replace_a_weight, _freeze, _eval])
def test_a_change_between_forward_and_backward_is_recomputed_as_the_forward_ran(change):
    """Between the forward and the backward, ``layer.weight = nn.Parameter(...)``,
    ``requires_grad_(False)`` (a GAN loop freezing the discriminator too early) or
    ``.eval()``: the unplanned model's backward computes with what it saved, and gives the old
    parameters their gradients; so must the recompute. Found trying the library: a replaced
    weight was read (12 gradients differed); freezing and eval mode raised checkpoint's
    "different number of tensors saved"."""
    torch.manual_seed(0)
    model, x = _blocks(batch_norm=True).train(), torch.randn(32, 16)
    reference = copy.deepcopy(model)
    p = sqrt_n_plan(model, (x,))
    results = []
    for module, own in ((reference, reference), (p.module, model)):
        old = list(own.parameters())
        out = module(x)
        change(own)
        out.pow(2).mean().backward()
        results.append(([t.grad for t in old], list(own.state_dict().values())))
    (expected_grads, expected_state), (grads, state) = results
    assert [a is None for a in grads] == [b is None for b in expected_grads]
    assert all(a is None or torch.equal(a, b) for a, b in zip(grads, expected_grads))
    assert all(torch.equal(a, b) for a, b in zip(state, expected_state, strict=True))


class SquareChain(nn.Module):
    """Parameters read as attributes (no submodule calls), every tensor 16 x 16: the tensors a
    recompute saves have the same sizes, whatever they are."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.v = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        for _ in range(4):
            x = torch.tanh(x @ self.w) + torch.sin(x @ self.v)
        return x


class SquareChainOfABatch(SquareChain):
    """Takes its input as an item of a dict, as data loaders hand batches."""

    def forward(self, batch):
        return super().forward(batch["x"])


@pytest.mark.parametrize("flipped", ["w", "x", "batch item"])
@pytest.mark.parametrize("frozen_at_forward", [True, False], ids=["unfrozen", "frozen"])
def test_a_leaf_frozen_or_unfrozen_between_forward_and_backward_is_recomputed_as_it_was(
    flipped, frozen_at_forward
):
    """A parameter the graph reads as an attribute, or the input, whose ``requires_grad``
    changes between the forward and the backward: the recompute must save what the forward
    saved. Found after review: it saved others, and checkpoint, which matches them by
    position and size, handed backward the wrong ones (every tensor here has one size): the
    gradients of ``v`` were off by 7e10, without an error. An item of a dict argument too
    (found by review)."""
    torch.manual_seed(0)
    batched = flipped == "batch item"
    model, x = (SquareChainOfABatch() if batched else SquareChain()), torch.randn(16, 16)
    p = sqrt_n_plan(model, ({"x": x},) if batched else (x,))
    assert p.segments
    results = []
    for module, own in ((copy.deepcopy(model), None), (p.module, model)):
        own = own or module
        inputs = x.clone()
        leaf = own.w if flipped == "w" else inputs
        leaf.requires_grad_(not frozen_at_forward)
        out = module({"x": inputs} if batched else inputs)
        leaf.requires_grad_(frozen_at_forward)
        out.pow(2).mean().backward()
        results.append([own.w.grad, own.v.grad, inputs.grad])
    expected, grads = results
    assert [g is None for g in grads] == [g is None for g in expected]
    assert all(a is None or torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


def test_torch_func_transforms_on_the_planned_module():
    """``vmap`` works and matches the model. With gradients, backward after vmap returned
    could not recompute from vmap's batched tensors ("may have escaped", found trying the
    library): the model itself runs there, with a warning. ``torch.func.grad`` (and ``vjp``,
    ``jacrev``, ``hessian``) cannot run saved-tensor hooks, which checkpointed segments use:
    a ``PlanningError`` says so and what to do, where torch's own error did not (found trying
    the library)."""
    torch.manual_seed(0)
    model, x = RootState(), torch.randn(8, 16)
    p = sqrt_n_plan(model, (x,))
    assert p.segments
    with torch.no_grad():
        torch.testing.assert_close(torch.func.vmap(p.module)(x), torch.func.vmap(model)(x))
    reference = copy.deepcopy(model)
    torch.func.vmap(reference)(x).pow(2).sum().backward()
    with pytest.warns(UserWarning, match=r"under torch\.func\.vmap with gradients"):
        torch.func.vmap(p.module)(x).pow(2).sum().backward()
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    model.zero_grad(set_to_none=True)
    params = {k: v.detach() for k, v in p.module.named_parameters()}

    def loss(module):
        return lambda passed: torch.func.functional_call(module, passed, (x,)).sum()

    expected = torch.func.grad(loss(model))(params)
    assert expected.keys() == params.keys()
    with pytest.raises(planner.PlanningError, match=r"torch\.func\.grad.*to the model itself"):
        torch.func.grad(loss(p.module))(params)


def test_a_vmap_ensemble_of_functional_calls_computes_with_the_tensors_passed():
    """``stack_module_state`` then ``vmap(functional_call(p.module, ...))`` with gradients:
    the model runs in the planned module's place there, and must compute with the root
    parameters ``functional_call`` swapped on the planned module alone (found by review: it
    computed with the model's own, outputs 2.0 apart)."""
    torch.manual_seed(0)
    model, x = RootState(), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    p = sqrt_n_plan(model, (x,))
    copies = [copy.deepcopy(reference) for _ in range(3)]
    for k, c in enumerate(copies):
        with torch.no_grad():
            for t in c.parameters():
                t.add_(0.1 * k)
    results = []
    for module in (reference, p.module):
        params, buffers = torch.func.stack_module_state(copies)

        def one(params, buffers, x, module=module):
            return torch.func.functional_call(module, (params, buffers), (x,))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = torch.func.vmap(one, in_dims=(0, 0, None))(params, buffers, x)
        out.pow(2).sum().backward()
        results.append((out, [params[name].grad for name in sorted(params)]))
    (expected, expected_grads), (out, grads) = results
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))


def test_functional_call_in_another_mode_computes_with_the_tensors_passed():
    """An EMA evaluated through ``functional_call(p.module, ema_params, x)`` in eval mode: the
    model runs in the planned module's place there, and computed with its own root
    parameters (found after review)."""
    torch.manual_seed(0)
    model, x = RootState(), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    p = sqrt_n_plan(model, (x,))
    outputs = []
    for module, own in ((reference, reference), (p.module, model)):
        passed = {k: v.detach() + 1.0 for k, v in own.named_parameters()}
        own.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs.append(torch.func.functional_call(module, passed, (x,)))
        own.train()
    assert torch.equal(*outputs)
    assert p.module.pos is model.pos  # put back


def test_a_parameter_removed_between_forward_and_backward_leaves_the_model_intact():
    """``prune`` between the forward and the backward moves a weight away: the recompute fails
    as plain checkpoint does, and the model keeps its modules as they are (found by review:
    the recompute put ``weight = None`` back and the model itself could not run again)."""
    torch.manual_seed(0)
    model, x = _blocks(batch_norm=False), torch.randn(32, 16)
    p = sqrt_n_plan(model, (x,))
    out = p.module(x)
    torch.nn.utils.prune.l1_unstructured(model[1][0], "weight", amount=0.5)
    with pytest.raises(Exception):  # noqa: B017 (checkpoint's own error)
        out.pow(2).mean().backward()
    assert "weight" not in model[1][0]._parameters
    model(x).sum().backward()  # the model still runs


class Configured(RootState):
    """A model with what Hugging Face models carry besides forward: a config and methods."""

    def __init__(self):
        super().__init__()
        self.config = {"hidden_size": 16}

    def describe(self):
        return "six tanh layers"


def test_the_models_other_attributes_are_on_the_model_and_the_error_says_so():
    """The planned module is the model's forward only: ``planned.config`` is missing, as
    ``hasattr`` must say (libraries probe with it), but the error names where it is rather
    than a bare "no attribute" (a Hugging Face training script reading ``model.config``)."""
    model = Configured()
    p = sqrt_n_plan(model, (torch.randn(8, 16),))
    assert not hasattr(p.module, "config") and not hasattr(p.module, "describe")
    with pytest.raises(
        AttributeError,
        match=r"'config' is the model's \(Configured\): use it there \(model\.config\)",
    ):
        _ = p.module.config
    with pytest.raises(AttributeError, match=r"model\.describe"):
        p.module.describe()
    with pytest.raises(AttributeError, match=r"no attribute 'neither'$"):
        _ = p.module.neither


def test_a_model_planned_on_meta_then_materialised_trains_its_materialised_parameters():
    """Planning on the meta device, then ``model.to_empty()`` and initialisation."""
    with torch.device("meta"):
        model = RootState()
    x = torch.randn(8, 16)
    p = sqrt_n_plan(model, (x.to("meta"),))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for tensor in model.state_dict().values():
        nn.init.normal_(tensor)
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})


class ExportedPositions(nn.Module):
    """Positions made on the input's device, in a forward ``symbolic_trace`` rejects (a size
    made a Python int): torch.export bakes the device into the graph."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Embedding(16, 16)
        blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
        self.layers = nn.Sequential(*blocks)

    def forward(self, x):
        length = int(x.shape[1])
        return self.layers(x + self.positions(torch.arange(length, device=x.device)))


def test_an_exported_plan_made_on_meta_computes_on_the_device_it_runs_on():
    """Found by a tester: after ``to_empty(device="cpu")`` the graph still made its positions
    on the meta device, and the embedding read uninitialised memory (gradients off by 7.8,
    silently). The planned module plans the call on the new device once, as for a dtype move."""
    with torch.device("meta"):
        model = ExportedPositions()
    x = torch.randn(4, 8, 16)
    p = sqrt_n_plan(model, (x.to("meta"),))
    assert p.capture_method == "export"
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for tensor in model.state_dict().values():
        nn.init.normal_(tensor)
    with pytest.warns(UserWarning, match=r"runs on cpu and was planned on meta.*torch\.export"):
        assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})


class Timed(nn.Module):
    """Takes a timestep per sample, in a forward ``symbolic_trace`` rejects."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(1, 16)
        blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
        self.layers = nn.Sequential(*blocks)

    def forward(self, x, t):
        n = int(x.shape[0])
        return self.layers(x + self.embed(t.reshape(n, 1).float()))


def test_an_exported_plan_called_with_a_tensor_of_another_rank_says_so():
    """Found by a tester: a scalar timestep for a plan made with one per sample raised a bare
    ``IndexError`` from the graph."""
    x, t = torch.randn(4, 16), torch.arange(4)
    p = sqrt_n_plan(Timed(), (x, t))
    assert p.capture_method == "export"
    with pytest.raises(planner.PlanningError, match=r"t with 0 dimensions, planned with 1"):
        p.module(x, torch.tensor(3))


class ExportedDictBatch(ExportedPositions):
    """``ExportedPositions`` taking its tensor in a dict: no tensor argument of its own."""

    def forward(self, batch):
        return super().forward(batch["x"])


def test_an_exported_plan_without_tensor_arguments_is_no_new_call_form_where_nothing_moved():
    """Found by review: with its tensors in a dict, every call looked like one on another
    device and was planned again, nested until the recursion limit."""
    torch.manual_seed(0)
    model, batch = ExportedDictBatch(), {"x": torch.randn(4, 8, 16)}
    p = sqrt_n_plan(model, (batch,))
    assert p.capture_method == "export"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "the planned")
        assert_equivalent(copy.deepcopy(model), model, p.module, (batch,), {})
    assert p.module._planner.call_forms == {}


class ParameterlessDictBatch(nn.Module):
    """No parameter or buffer, and its tensor in a dict: only the batch says where it runs."""

    def forward(self, batch):
        x = batch["x"]
        positions = torch.arange(int(x.shape[-1]), device=x.device, dtype=x.dtype)
        return torch.tanh(torch.tanh(torch.tanh(x * positions) * 2) * 3) * 4


def test_an_exported_plan_of_a_parameterless_model_made_on_meta_runs_where_its_batch_is():
    """Found by review: the devices of a call were read from its tensor arguments and the first
    parameter, so a dict batch for a model without parameters moved unseen from meta to the CPU
    and the meta graph raised a device mismatch."""
    model = ParameterlessDictBatch()
    x = torch.randn(4, 8, requires_grad=True)
    p = sqrt_n_plan(model, ({"x": x.detach().to("meta").requires_grad_()},))
    assert p.capture_method == "export"
    with pytest.warns(UserWarning, match=r"runs on cpu and was planned on meta"):
        assert_equivalent(model, model, p.module, ({"x": x},), {})


class MemoisedPositions(nn.Module):
    """Memoises a positional table per length in a dict, in eval mode only."""

    def __init__(self):
        super().__init__()
        self.cache: dict = {}
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)))

    def forward(self, x):
        n = x.shape[0]
        if self.training:
            return self.layers(x + torch.arange(n)[:, None])
        if n not in self.cache:
            self.cache[n] = torch.arange(n)[:, None]
        return self.layers(x + self.cache[n])


def test_a_dict_an_eval_forward_fills_with_tensors_is_no_change_to_the_plan():
    """Found by review: validation filled the cache, and the next training step was refused."""
    torch.manual_seed(0)
    model, x = MemoisedPositions(), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    p.module.eval()
    with torch.no_grad():
        p.module(x)
    p.module.train()
    assert model.cache
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})


def test_root_tensors_replaced_on_the_model_are_listed_before_the_next_call():
    """Found by a tester: an optimizer made from ``p.module.parameters()`` after
    ``model.load_state_dict(..., assign=True)`` held the old root parameter, which the step
    never trained, and the planned module kept the old tensors alive."""
    torch.manual_seed(0)
    model, x = RootState(), torch.randn(8, 16)
    p = sqrt_n_plan(model, (x,))
    old = weakref.ref(model.pos)
    model.load_state_dict(new_state(model), assign=True)
    assert p.module.pos is model.pos and p.module.shift is model.shift
    assert any(t is model.pos for t in p.module.parameters())
    assert any(t is model.shift for t in p.module.buffers())
    optimizer = torch.optim.SGD(p.module.parameters(), lr=0.1)
    before = model.pos.detach().clone()
    p.module(x).sum().backward()
    optimizer.step()
    assert not torch.equal(model.pos, before)
    gc.collect()
    assert old() is None


# --------------------------------------------------------------------------------------------
# train and eval modes: another mode than the planning one runs the model itself


class TrainingBranches(nn.Module):
    """Train-mode behaviour that tracing freezes into the graph: functional dropout reading
    ``self.training``, an ``if self.training:`` branch, and an ``nn.Dropout`` leaf."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = nn.functional.dropout(torch.tanh(self.a(x)), 0.5, training=self.training)
        if self.training:
            h = h * 2.0
        h = self.drop(torch.tanh(self.b(h)))
        return self.c(h)


class ExportedTrainingBranches(TrainingBranches):
    def forward(self, x):
        if x.size(0) > 0:  # a Python bool of a size: symbolic_trace fails, torch.export captures
            x = x * 1.0
        return super().forward(x)


SWITCHES = {
    "planned.eval()": lambda p, model: p.module.eval(),
    "model.eval()": lambda p, model: model.eval(),
}


@pytest.mark.parametrize("cls", [TrainingBranches, ExportedTrainingBranches])
@pytest.mark.parametrize("switch", SWITCHES)
def test_eval_after_planning_gives_the_models_eval_outputs_and_train_again_its_training(
    cls, switch
):
    torch.manual_seed(0)
    model, x = cls(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    p = tight_plan(model, (x,))
    assert p.capture_method == ("export" if cls is ExportedTrainingBranches else "symbolic_trace")
    SWITCHES[switch](p, model)
    assert not model.training and not any(m.training for m in model.modules())
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(p.module(x), reference(x), rtol=0, atol=0)
    with pytest.warns(UserWarning, match="checkpointing is not applied"):
        assert_equivalent(reference, model, p.module, (x,), {})
    p.module.train()
    assert model.training and all(m.training for m in model.modules())
    reference.train()
    assert_equivalent(reference, model, p.module, (x,), {})


def test_the_eval_warning_comes_once_and_never_under_no_grad():
    model, x = TrainingBranches(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    p.module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            p.module(x)
    with pytest.warns(UserWarning, match="checkpointing is not applied"):
        p.module(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.module(x)


def test_the_eval_warning_comes_once_for_each_set_of_training_flags():
    """Found by a tester: a whole-model eval call used the warning up, and a later training
    step with one block frozen in eval ran the model itself over the budget without a word."""
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    p.module.eval()
    with pytest.warns(UserWarning, match="checkpointing is not applied"):
        p.module(x)
    p.module.train()
    model.blocks[1].eval()
    with pytest.warns(UserWarning, match=r"blocks\.1 train then, eval now"):
        p.module(x)


def test_the_eval_warning_names_the_switched_modules_and_points_at_the_call():
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    model.blocks[1].eval()
    with pytest.warns(UserWarning, match=r"blocks\.1 train then, eval now") as caught:
        p.module(x)
    assert caught[0].filename == __file__


def test_planned_train_uses_the_models_own_train():
    """A model whose ``train()`` keeps a frozen BatchNorm in eval mode stays planned in train."""

    class FrozenNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)

        def train(self, mode=True):
            super().train(mode)
            self.bn.eval()
            return self

        def forward(self, x):
            return self.b(torch.tanh(self.bn(self.a(x))))

    # At batch 4 no plan is below the unplanned peak (the nested plan the replay once put 32
    # bytes under it measures 16 bytes over it); at 16 a segment is.
    model, x = FrozenNorm().train(), torch.randn(16, 8)
    reference = copy.deepcopy(model)
    p = tight_plan(model, (x,))
    p.module.eval()
    p.module.train()
    assert model.training and not model.bn.training
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the planning mode again: the plan runs
        assert_equivalent(reference, model, p.module, (x,), {})


AFTER_PLANNING = {
    "planned.double()": lambda p, model, ref: (p.module.double(), ref.double()),
    "model.double()": lambda p, model, ref: (model.double(), ref.double()),
    "planned.eval()": lambda p, model, ref: (p.module.eval(), ref.eval()),
    "model.eval()": lambda p, model, ref: (model.eval(), ref.eval()),
    "eval, then train": lambda p, model, ref: (p.module.eval(), p.module.train()),
    "eval, double": lambda p, model, ref: (p.module.eval().double(), ref.eval().double()),
}


@settings(max_examples=max(4, EXAMPLES // 3))
@given(
    spec=model_specs(untraceable=None, max_ops=8),
    change=st.sampled_from(sorted(AFTER_PLANNING)),
    data=st.data(),
)
def test_any_model_moved_or_switched_after_planning_trains_like_the_model(spec, change, data):
    """Random models and segments, then a dtype move and/or a mode switch on the planned module
    or the model: the same step as the unplanned model after the same change."""
    model, (args, kwargs) = build(spec), inputs(spec)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        captured, problem = prepare(model, args, kwargs)
    planned = rewrite(
        captured.graph_module, model, data.draw(random_segments(problem)), problem=problem
    )
    p = type("P", (), {"module": planned})
    AFTER_PLANNING[change](p, model, reference)
    if "double" in change:
        args, kwargs = to_double(args), to_double(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eval with gradients: the model runs
        assert_equivalent(reference, model, planned, args, kwargs, seed=spec.seed)


# --------------------------------------------------------------------------------------------
# pickle and torch.save refuse; the plan saves instead


@pytest.mark.parametrize("capture", MODELS)
@pytest.mark.parametrize(
    "dump", [pickle.dumps, lambda m: torch.save(m, io.BytesIO())], ids=["pickle", "torch.save"]
)
def test_pickling_the_planned_module_refuses_and_says_what_to_save(capture, dump):
    model, args, kwargs = MODELS[capture]()
    p = tight_plan(model, args, kwargs)
    with pytest.raises(planner.PlanningError, match=r"plan\.save\(path\).*planner\.load"):
        dump(p.module)


def test_what_the_pickling_error_recommends_gives_the_same_module(tmp_path):
    model, args, kwargs = traced_batchnorm_model()
    p = tight_plan(model, args, kwargs)
    p.save(tmp_path / "plan.json", args)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    rebuilt, _ = zoo.resnet(blocks=2, channels=8, batch=4, image=8, seed=1)
    rebuilt.load_state_dict(torch.load(tmp_path / "weights.pt"))
    reference = copy.deepcopy(rebuilt)
    loaded = planner.load(tmp_path / "plan.json", rebuilt)
    assert loaded.segments == p.segments
    assert_equivalent(reference, rebuilt, loaded.module, args, kwargs)


@pytest.mark.parametrize("capture", MODELS)
def test_a_deep_copy_of_the_planned_module_trains_like_a_deep_copy_of_the_model(capture):
    model, args, kwargs = MODELS[capture]()
    p = tight_plan(model, args, kwargs)
    copied = copy.deepcopy(p.module)
    assert type(copied).__name__ == type(p.module).__name__  # messages name the model's class
    assert not {id(t) for t in copied.parameters()} & {id(t) for t in model.parameters()}
    assert_equivalent(copy.deepcopy(model), copied, copied, args, kwargs)
    assert_equivalent(copy.deepcopy(model), model, p.module, args, kwargs)


USE_GELU = False  # a module global the forward below reads


class GlobalSwitch(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = nn.functional.gelu(layer(x)) if USE_GELU else torch.tanh(layer(x))
        return x


def test_a_deep_copy_of_a_plan_whose_forward_reads_a_module_global_shares_that_global():
    """Found by review: the copy tried to copy the module's globals (a module cannot be
    pickled)."""
    torch.manual_seed(0)
    model, x = GlobalSwitch(), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    copied = copy.deepcopy(p.module)
    assert_equivalent(copy.deepcopy(copied._planner.model), copied, copied, (x,), {})


def test_a_deep_copy_put_in_eval_mode_computes_as_the_copied_model_in_eval_mode():
    """An EMA copy, evaluated: found by review, the copy watched stale copies of its modules'
    state and ran the training-mode graph, dropout on, silently."""
    torch.manual_seed(0)
    model, x = TrainingBranches(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    copied = copy.deepcopy(p.module)
    copied.eval()
    with torch.no_grad():
        assert torch.equal(copied(x), copied._planner.model(x))


class ExportedOrderedOutput(nn.Module):
    """Returns an ``OrderedDict`` (torchvision's segmentation models do) from a forward
    symbolic_trace rejects, taking a flag the plan fixes (as ``use_cache=False``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, double: bool = False):
        if x.size(0) > 0:  # a Python bool of a size: symbolic_trace fails, torch.export captures
            for layer in self.layers:
                x = torch.tanh(layer(x))
        return collections.OrderedDict(out=2 * x if double else x, aux=x.sum())


def test_a_deep_copy_of_an_exported_plan_takes_the_calls_and_returns_the_types_of_the_model():
    """Found trying the library: ``copy.deepcopy(p.module)`` of a Hugging Face plan raised
    ``forward() missing 1 required positional argument: 'use_cache'``. fx's copy drops module
    hooks, which fill in the arguments the plan fixed and rebuild the output's type."""
    torch.manual_seed(0)
    model, x = ExportedOrderedOutput(), torch.randn(8, 16)
    p = planner.plan(
        model, (x,), example_kwargs={"double": False}, budget_bytes=10**9, solver="sqrt_n"
    )
    assert p.segments
    copied = copy.deepcopy(p.module)
    out = copied(x)  # ``double`` left out, as the model may be called
    assert type(out) is collections.OrderedDict
    torch.testing.assert_close(out["out"], model(x)["out"], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# calls without a tensor argument given at planning, and shallow copies


def test_torchscript_of_the_planned_module_refuses_and_says_what_to_use():
    """Found trying the library: ``torch.jit.script`` failed on an internal annotation
    ("Unknown type annotation: 'Snapshot'")."""
    p = sqrt_n_plan(RootState(), (torch.randn(8, 16),))
    with pytest.raises(planner.PlanningError, match=r"torch\.jit\.script.*torch\.compile"):
        torch.jit.script(p.module)


def test_a_shallow_copy_of_the_planned_module_refuses_and_says_what_to_do():
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    with pytest.raises(TypeError, match=r"copy\.deepcopy"):
        copy.copy(p.module)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask=None, scale: float = 1.0):
        h = torch.tanh(self.a(x))
        if mask is not None:
            h = h + mask
        return self.b(h) * scale


class ExportedMasked(Masked):
    def forward(self, x, mask=None, scale: float = 1.0):
        if x.size(0) > 0:
            x = x * 1.0
        return super().forward(x, mask, scale)


@pytest.mark.parametrize("cls", [Masked, ExportedMasked])
@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: m(x, scale=0.5),
        lambda m, x: m(x, None, 0.5),
        lambda m, x: m(x, mask=None, scale=0.5),
    ],
    ids=["left out", "None by position", "None by keyword"],
)
def test_a_call_leaving_out_a_tensor_argument_is_planned_once_as_a_call_form_of_its_own(cls, call):
    model, x = cls(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    p = tight_plan(model, (x,), {"mask": torch.ones(4, 8), "scale": 0.5})
    with pytest.warns(UserWarning, match=r"called without: planner planned this call form once"):
        out = call(p.module, x)
    torch.testing.assert_close(out, model(x, scale=0.5), rtol=0, atol=0)
    [(key, form)] = p.module._planner.call_forms.items()
    assert key.left_out == ("mask",)
    assert isinstance(form, PlannedModule) and form is not p.module
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(call(p.module, x), model(x, scale=0.5), rtol=0, atol=0)
    assert not [w for w in caught if "call form" in str(w.message)], "planned only once"
    assert p.module._planner.call_forms == {key: form}
    assert_equivalent(reference, model, p.module, (x,), {"scale": 0.5})
    mask = torch.zeros(4, 8)
    torch.testing.assert_close(p.module(x, mask, 0.5), model(x, mask, 0.5), rtol=0, atol=0)


class Mode(enum.Enum):
    PLAIN = 1
    NEGATED = 2


class Parametrised(nn.Module):
    """Non-tensor arguments whose values fx cannot assert: a config object, an enum and a
    generator of the caller's (torch.export refuses such inputs)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, config, mode, generator):
        for layer in self.layers:
            x = torch.tanh(layer(x)) * config.scale
            x = x * (torch.rand(x.shape, generator=generator) > 0.2)
        return -x if mode is Mode.NEGATED else x


def test_a_non_tensor_argument_of_another_value_is_refused_not_computed_with_the_old_one():
    """Found trying the library: ``symbolic_trace`` bakes a config object, an enum or a
    generator into the graph without an assert (fx warns that it could not add one), and the
    planned module computed with the planning values whatever it was given. Calls with equal
    values (the same generator) compute exactly what the model computes; others are a
    ``ValueError`` saying to plan with them, as under ``torch.export``."""
    model, x = Parametrised(), torch.randn(4, 8)
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # planner checks what fx could not assert
        p = planner.plan(
            model,
            (x, types.SimpleNamespace(scale=0.5), Mode.PLAIN, generator),
            budget_gb=1,
            solver="sqrt_n",
        )
    assert p.capture_method == "symbolic_trace"
    reference = torch.Generator().manual_seed(7)
    generator.manual_seed(7)
    same = (x, types.SimpleNamespace(scale=0.5), Mode.PLAIN)
    torch.testing.assert_close(p.module(*same, generator), model(*same, reference), rtol=0, atol=0)
    assert torch.equal(generator.get_state(), reference.get_state())
    for other in [
        (x, types.SimpleNamespace(scale=2.0), Mode.PLAIN, generator),
        (x, types.SimpleNamespace(scale=0.5), Mode.NEGATED, generator),
        (x, types.SimpleNamespace(scale=0.5), Mode.PLAIN, torch.Generator()),
    ]:
        with pytest.raises(ValueError, match=r"was captured with .* computes with that value"):
            p.module(*other)


def test_a_loaded_plan_runs_the_model_for_a_call_leaving_out_a_tensor_argument(tmp_path):
    model, x, kwargs = Masked(), torch.randn(4, 8), {"mask": torch.ones(4, 8), "scale": 0.5}
    tight_plan(model, (x,), kwargs).save(tmp_path / "p.json")
    loaded = planner.load(tmp_path / "p.json", model, (x,), kwargs)
    with pytest.warns(UserWarning, match=r"planned with mask given and is called without"):
        out = loaded.module(x, scale=0.5)
    torch.testing.assert_close(out, model(x, scale=0.5), rtol=0, atol=0)
    assert loaded.module._planner.call_forms == {}


def test_a_call_leaving_out_a_tensor_argument_under_no_grad_plans_nothing():
    model, x = Masked(), torch.randn(4, 8)
    p = tight_plan(model, (x,), {"mask": torch.ones(4, 8), "scale": 0.5})
    with torch.no_grad():
        torch.testing.assert_close(p.module(x, scale=0.5), model(x, scale=0.5), rtol=0, atol=0)
    assert p.module._planner.call_forms == {}


# --------------------------------------------------------------------------------------------
# changes to the model after planning


class Blocks(nn.Module):
    """Blocks that symbolic_trace traces through (their forward and ``scale`` are inlined)."""

    def __init__(self, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.1)) for _ in range(n)
        )
        self.scale = 0.5

    def forward(self, x):
        for block in self.blocks:
            x = x + self.scale * block(x)
        return x


class LowRankAdapted(nn.Module):
    """A LoRA-like layer: its branch is skipped once merged, and scaled by a dict entry, state
    a library changes in place (PEFT's ``merge_adapter()``, diffusers' ``set_adapters``)."""

    def __init__(self):
        super().__init__()
        self.base, self.down, self.up = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(2, 8)
        self.merged_adapters: list[str] = []
        self.scaling = {"default": 1.0}

    def forward(self, x):
        h = self.base(x)
        if not self.merged_adapters:
            h = h + self.scaling["default"] * self.up(self.down(x))
        return torch.tanh(h)


IN_PLACE_CHANGES = {
    "a list appended to": lambda m: m.merged_adapters.append("default"),
    "a dict entry set": lambda m: m.scaling.__setitem__("default", 0.3),
    # found by review: a tensor added beside the change hid it (a cache counts as no change)
    "a dict entry set beside a tensor": lambda m: m.scaling.update(default=0.3, x=torch.ones(1)),
}


@pytest.mark.parametrize("change", IN_PLACE_CHANGES)
def test_lists_and_dicts_of_values_changed_in_place_after_planning_are_refused(change):
    """Found by a tester: PEFT's ``merge_adapter()`` after planning applied the adapter twice,
    and diffusers' ``set_adapters(weights=...)`` was ignored, silently."""
    model, x = nn.Sequential(*(LowRankAdapted() for _ in range(4))), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})  # unchanged: no refusal
    IN_PLACE_CHANGES[change](model[2])
    with pytest.raises(planner.PlanningError, match=r"changed after planning.*Plan again"):
        p.module(x)


class Halve:
    """A callable object a module holds and calls (as diffusers' attention ``processor``)."""

    def __call__(self, h):
        return h / 2


class Processed(nn.Module):
    """Calls a function and a callable object it holds, and reads a setting that exists only
    once set (FreeU's ``getattr(self, "s1", None)`` on diffusers' up blocks)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.activation = torch.tanh
        self.processor = Halve()

    def forward(self, x):
        h = self.processor(self.activation(self.linear(x)))
        boost = getattr(self, "boost", None)
        return h * boost if boost is not None else h


CALLABLE_CHANGES = {
    "a function replaced": lambda m: setattr(m, "activation", torch.sigmoid),
    "a callable object replaced": lambda m: setattr(m, "processor", Halve()),
    "a setting the code reads once set": lambda m: setattr(m, "boost", 2.0),
}


@pytest.mark.parametrize("change", CALLABLE_CHANGES)
def test_callables_replaced_and_settings_added_after_planning_are_refused(change):
    """Found by a tester: diffusers' ``unet.set_attn_processor(...)`` and ``enable_freeu()``
    after planning were ignored, silently (outputs 0.21 and 0.31 off)."""
    model, x = nn.Sequential(*(Processed() for _ in range(4))), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    model[1].note = "set by the training script"  # named by no code: no change to the graph
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})
    copied = copy.deepcopy(p.module)  # the copy holds and watches the copied callables
    torch.testing.assert_close(copied(x), p.module(x), rtol=0, atol=0)
    CALLABLE_CHANGES[change](model[2])
    changed = r"changed after planning: 2\.(activation|processor|boost)"
    with pytest.raises(planner.PlanningError, match=changed):
        p.module(x)


class Counting(nn.Module):
    """Saves a step counter with its checkpoints (extra state), which forward never reads."""

    def __init__(self):
        super().__init__()
        self.linear, self.steps = nn.Linear(8, 8), 0

    def get_extra_state(self):
        return {"steps": self.steps}

    def set_extra_state(self, state):
        self.steps = state["steps"]

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_a_counter_restored_from_a_checkpoint_that_forward_never_reads_is_no_change():
    """Found by a tester: resuming from a checkpoint (``load_state_dict`` restoring the extra
    state's counter) was refused on every later call, as if the graph had read it."""
    model, x = nn.Sequential(*(Counting() for _ in range(4))), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    state = model.state_dict()
    state["1._extra_state"] = {"steps": 1234}
    model.load_state_dict(state)
    assert model[1].steps == 1234
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})


def test_a_setting_turned_off_then_on_after_planning_is_refused():
    """Found by review: FreeU enabled (refused), disabled (``s1 = None``: the planned branch)
    and enabled again ran the old graph, silently."""
    model, x = nn.Sequential(*(Processed() for _ in range(4))), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    model[2].boost = None  # what the graph read as absent: no change
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})
    model[2].boost = 2.0
    with pytest.raises(planner.PlanningError, match=r"2\.boost changed from None to 2\.0"):
        p.module(x)


class Memoising(nn.Module):
    """Memoises the longest batch it has seen, in eval mode only, in an attribute it makes."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if not self.training and x.shape[0] > getattr(self, "longest", 0):
            self.longest = x.shape[0]
        return torch.tanh(self.linear(x))


def test_a_setting_the_models_own_forward_makes_in_a_mode_it_runs_itself_is_refused():
    """What forward sets in a mode the plan does not run, and its code reads, is refused at the
    next planned call: the planned module cannot tell a memo from a setting a training branch
    reads (found by review: taking such values as the model's bookkeeping ran the old graph
    where training read one). Keep such values in a buffer."""
    model, x = nn.Sequential(*(Memoising() for _ in range(4))), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    model.eval()
    with torch.no_grad():
        p.module(x)
    assert model[0].longest == 4
    model.train()
    with pytest.raises(planner.PlanningError, match=r"0\.longest was set to 4"):
        p.module(x)


class EvalStatistic(nn.Module):
    """Stores a statistic in eval mode that no code reads (a debugging record)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if not self.training:
            self.last_eval_scale = float(x.abs().mean())
        return torch.tanh(self.linear(x))


def test_a_value_forward_stores_in_eval_mode_and_nothing_reads_is_no_change():
    """Found by review: an eval-only record that no code reads was refused as a setting made
    since planning, once eval calls had set it."""
    model, x = nn.Sequential(*(EvalStatistic() for _ in range(4))), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    model.eval()
    with torch.no_grad():
        p.module(x)
    model.train()
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})


class CallsLeaf(nn.Module):
    """Sets its leaf's callable in a method (as diffusers' ``set_attn_processor``); in
    ``calls_it`` mode its forward calls one of them itself, a call the graph holds."""

    def __init__(self, calls_it=False):
        super().__init__()
        self.leaf, self.calls_it = Processed(), calls_it

    def set_processor(self, processor):
        self.leaf.processor = processor

    def forward(self, x):
        return self.leaf.activation(self.leaf(x)) if self.calls_it else self.leaf(x)


def test_a_callable_of_a_module_the_graph_calls_may_be_replaced():
    """Found by review: a leaf module's processor, named by its parent's code, was compared,
    and its replacement refused; the leaf calls its own processor when it runs."""
    model = nn.Sequential(*(CallsLeaf() for _ in range(4)))
    x = torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n", leaf_modules=(Processed,))
    for block in model:
        block.set_processor(lambda h: h * 3)
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})


def test_a_callable_of_a_called_module_that_the_traced_parent_calls_is_compared():
    """Found by review: exempting every callable of a leaf let ``self.leaf.activation(...)``,
    a call the traced parent makes and the graph holds, be replaced unseen (0.78 off)."""
    model = nn.Sequential(*(CallsLeaf(calls_it=True) for _ in range(4)))
    x = torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n", leaf_modules=(Processed,))
    model[1].leaf.activation = torch.sigmoid
    with pytest.raises(planner.PlanningError, match=r"1\.leaf\.activation was replaced"):
        p.module(x)


def test_a_compiled_plan_takes_a_public_attribute_set_since_and_refuses_a_setting():
    """Found by review: under torch.compile, any public attribute set on a traced module after
    planning made every later call crash inside Dynamo (it traced into the code reading)."""
    torch._dynamo.reset()
    model, x = nn.Sequential(*(Processed() for _ in range(4))), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    compiled = torch.compile(p.module, backend="eager")
    compiled(x)
    model[1].global_step = 7  # read by no code: no change to the graph
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    model[1].boost = 2.0
    with pytest.raises(planner.PlanningError, match=r"1\.boost was set to 2\.0"):
        compiled(x)
    # Dynamo's state after a refusal inside a compiled call makes a later fullgraph compile
    # of another planned module break its graph at the vmap check: start the next one afresh.
    torch._dynamo.reset()


CHANGES = {
    "a leaf module replaced": lambda m: m.blocks[0].__setitem__(0, nn.Linear(8, 8)),
    "a traced-through module replaced": lambda m: m.blocks.__setitem__(
        1, copy.deepcopy(m.blocks[1])
    ),
    "a module appended": lambda m: m.blocks.append(copy.deepcopy(m.blocks[0])),
    "a plain attribute changed": lambda m: setattr(m, "scale", 2.0),
}

CHANGES_TO_THE_GRAPH = {"a module appended"}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_to_the_model_after_planning_refuses_and_says_re_plan(change, tmp_path):
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    p.save(tmp_path / "plan.json", (x,))
    CHANGES[change](model)
    with pytest.raises(planner.PlanningError, match=r"changed after planning.*Plan again"):
        p.module(x)
    # A saved plan is applied by capturing the model again: the loaded module is the new model
    # where the graph is the same size, and the plan is refused where it is not.
    if change in CHANGES_TO_THE_GRAPH:
        with pytest.raises(planner.PlanningError, match="made for another graph"):
            planner.load(tmp_path / "plan.json", model)
    else:
        reference = copy.deepcopy(model)
        loaded = planner.load(tmp_path / "plan.json", model)
        assert_equivalent(reference, model, loaded.module, (x,), {})


USE_TANH = True  # a module-level switch that ScaledByClass's forward reads
GAIN = 1.0  # a module-level value that a helper ScaledByClass's forward calls reads
step = 0  # a training script's counter: ScaledByClass reads an attribute of that name only


def _with_gain(y):
    return y * GAIN


class ScaledByClass(nn.Module):
    """Reads a class attribute (``self.scale``, set in the class body) and a global switch,
    which tracing bakes into the graph like an instance's own attribute."""

    scale = 0.5

    def __init__(self):
        super().__init__()
        self.linear, self.step = nn.Linear(8, 8), 1

    def forward(self, x):
        y = _with_gain(self.linear(x)) * self.scale * self.step
        return torch.tanh(y) if USE_TANH else torch.relu(y)


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda m: setattr(ScaledByClass, "scale", 2.0), "scale changed from 0.5 to 2.0"),
        (lambda m: setattr(m[1], "scale", 2.0), "1.scale changed from 0.5 to 2.0"),
        (lambda m: globals().__setitem__("USE_TANH", False), "USE_TANH changed from True to False"),
        (lambda m: globals().__setitem__("GAIN", 3.0), "GAIN changed from 1.0 to 3.0"),
    ],
    ids=["in the class", "on the instance, over the class's", "a global", "a helper's global"],
)
def test_a_class_attribute_or_global_the_forward_reads_may_not_change(change, named):
    """Found trying the library: after ``B.scale = 2.0`` or ``USE_GELU = False`` the plan
    kept computing with the old value (0.80 and 0.16 apart), silently."""
    global step
    model, x = nn.Sequential(ScaledByClass(), ScaledByClass()), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    step += 1  # a global of the same name as an attribute the model reads: no concern
    assert torch.equal(p.module(x), model(x))
    try:
        change(model)
        with pytest.raises(planner.PlanningError, match=named):
            p.module(x)
    finally:
        ScaledByClass.scale = 0.5
        globals().update(USE_TANH=True, GAIN=1.0)


class TemperatureBehindAProperty(nn.Module):
    """Reads its temperature through a public property backed by a private attribute, and a
    second one whose private default lives in the class body."""

    _floor = 1.0  # a private default, set on the instance through ``floor``

    def __init__(self):
        super().__init__()
        self.linear, self._tau = nn.Linear(8, 8), 1.0

    @property
    def temperature(self):
        return self._tau

    @temperature.setter
    def temperature(self, value):
        self._tau = value

    @property
    def floor(self):
        return self._floor

    @floor.setter
    def floor(self, value):
        self._floor = value

    def forward(self, x):
        return torch.tanh(self.linear(x) / self.temperature) * self.floor


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda m: setattr(m[1], "temperature", 0.25), r"1\._tau changed from 1\.0 to 0\.25"),
        (lambda m: setattr(m[0], "floor", 3.0), r"0\._floor changed from 1\.0 to 3\.0"),
    ],
    ids=["on the instance", "over the class body's default"],
)
def test_a_private_attribute_behind_a_property_the_forward_reads_may_not_change(change, named):
    """Found trying the library: after ``block.temperature = 0.25`` (a property setting
    ``self._tau``) the plan kept dividing by 1.0, silently: private attributes were never
    compared. Those the class's own code names are, as public ones are (on the instance, or
    as a default in the class body)."""
    model, x = (
        nn.Sequential(TemperatureBehindAProperty(), TemperatureBehindAProperty()),
        torch.randn(4, 8),
    )
    p = planner.plan(model, (x,), budget_gb=1)
    assert torch.equal(p.module(x), model(x))
    change(model)
    with pytest.raises(planner.PlanningError, match=named):
        p.module(x)


class ScaledByNumpy(nn.Module):
    """A temperature from a numpy schedule (``np.cos(...)`` gives ``np.float64``, a float32
    schedule array ``np.float32``), a numpy integer and a numpy bool."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.tau, self.scale = np.float64(1.0), np.float32(0.5)
        self.repeats, self.use_tanh = np.int64(1), np.bool_(True)

    def forward(self, x):
        y = self.linear(x) * self.scale / self.tau
        for _ in range(self.repeats):
            y = torch.tanh(y) if self.use_tanh else torch.relu(y)
        return y


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("tau", np.float64(0.25), r"tau changed from np\.float64\(1\.0\) to np\.float64\(0\.25\)"),
        ("scale", np.float32(2.0), r"scale changed from np\.float32\(0\.5\)"),
        ("scale", 0.5, r"scale changed from np\.float32\(0\.5\) to 0\.5"),
        ("repeats", np.int64(2), r"repeats changed from np\.int64\(1\) to np\.int64\(2\)"),
        ("use_tanh", np.bool_(False), r"use_tanh changed from np\.(bool|True_)"),
    ],
    ids=["np.float64", "np.float32", "np.float32 to an equal float", "np.int64", "np.bool_"],
)
def test_a_numpy_scalar_attribute_the_forward_reads_may_not_change(key, value, named):
    """Found trying the library: a temperature schedule computed with numpy, set on the model
    after planning (``model.tau = schedule[epoch]``), was ignored: the plan kept the value it
    was traced with. numpy's scalars are compared as Python's are, by value and by type (an
    equal value of another type may promote differently)."""
    model, x = ScaledByNumpy(), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    model.tau = np.float64(1.0)  # an equal value of the same type: no change
    assert torch.equal(p.module(x), model(x))
    setattr(model, key, value)
    with pytest.raises(planner.PlanningError, match=named):
        p.module(x)


class Adapted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


def _relu_forward(self, x):
    return x + self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize(
    "patch",
    [
        lambda m: setattr(m[1], "forward", types.MethodType(_relu_forward, m[1])),
        lambda m: setattr(Adapted, "forward", _relu_forward),
    ],
    ids=["on the instance", "on the class"],
)
def test_a_forward_replaced_after_planning_is_refused(patch):
    """Found trying the library: ``block.forward = types.MethodType(f, block)`` (an adapter, a
    swapped activation) or ``Block.forward = f`` after planning was ignored: the graph kept
    running the forward it traced. The forward a call of each traced module would run is
    compared by identity."""
    model, x = nn.Sequential(Adapted(), Adapted()), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    original = Adapted.forward
    assert torch.equal(p.module(x), model(x))
    try:
        patch(model)
        with pytest.raises(planner.PlanningError, match=r"the forward of 1 was replaced"):
            p.module(x)
    finally:
        Adapted.forward = original
        vars(model[1]).pop("forward", None)
    assert torch.equal(p.module(x), model(x))  # put back: the plan runs again


class NoisyWithItsGenerator(nn.Module):
    """Adds noise drawn from a generator it holds, reseeded or replaced once per epoch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.noise = torch.Generator().manual_seed(0)

    def forward(self, x):
        x = x + 0.3 * torch.randn(x.shape, generator=self.noise)
        return self.b(torch.tanh(self.a(x)))


class ScaledByName(nn.Module):
    """Reads its scales by names it holds (``getattr(self, key)``), as code handing the module
    to a function elsewhere does (transformers' attention reads ``module.is_causal``); it keeps
    its last output in eval mode, for itself."""

    def __init__(self):
        super().__init__()
        self.linear, self.keys, self.scale, self._last = nn.Linear(8, 8), ("scale",), 0.5, None

    def forward(self, x):
        y = self.linear(x)
        for key in self.keys:
            y = y * getattr(self, key)
        if not self.training:
            self._last = y
        return torch.tanh(y)


def test_an_attribute_read_by_name_may_not_change_and_one_forward_only_sets_may():
    """Found in review: comparing only what the code a call runs names missed ``scale`` (named
    in ``__init__`` alone: 1.71 apart, and Hugging Face Llama's ``is_causal``, read in another
    module, 0.28 apart); comparing private ones it names refused a step after an eval call
    that set ``_last``, which the graph never reads."""
    model, x = nn.Sequential(ScaledByName(), ScaledByName()), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    model.eval()
    p.module(x)
    model.train()
    assert torch.equal(p.module(x), model(x))
    model[0].scale = 3.0
    with pytest.raises(planner.PlanningError, match=r"0\.scale changed from 0\.5 to 3\.0"):
        p.module(x)


class Tempered(nn.Module):
    """Divides by a temperature kept as a plain tensor attribute (neither a parameter nor a
    buffer), as annealing code does; ``if`` on a size sends it to torch.export."""

    def __init__(self, traceable: bool):
        super().__init__()
        self.linear, self.tau, self.traceable = nn.Linear(8, 8), torch.tensor(2.0), traceable

    def forward(self, x):
        if not self.traceable and x.shape[0] > 0:
            x = x * 1.0
        return torch.tanh(self.linear(x) / self.tau)


@pytest.mark.parametrize("traceable", [True, False], ids=["symbolic_trace", "export"])
def test_a_plain_tensor_attribute_replaced_after_planning_is_refused_and_updating_it_is_not(
    traceable,
):
    """Found in review: ``model.tau = torch.tensor(0.5)`` after planning left the graph with the
    old tensor (0.55 apart), on both capture paths; updating it in place is followed."""
    model, x = Tempered(traceable), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    model.tau.fill_(0.5)
    assert torch.equal(p.module(x), model(x))
    model.tau = torch.tensor(0.25)
    with pytest.raises(planner.PlanningError, match="tau, a tensor that is neither"):
        p.module(x)


def test_a_generator_attribute_replaced_after_planning_is_refused_and_reseeding_it_is_not():
    """Found trying the library: ``model.noise = torch.Generator().manual_seed(epoch)`` after
    planning was ignored: the graph kept drawing from the generator it was traced with.
    A generator the model holds is compared by identity; reseeding it in place changes nothing
    the graph holds, and computes exactly what the model computes."""
    model, x = NoisyWithItsGenerator(), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    reference = copy.deepcopy(model)
    model.noise.manual_seed(3)
    reference.noise.manual_seed(3)
    assert torch.equal(p.module(x), reference(x))
    model.noise = torch.Generator().manual_seed(4)
    with pytest.raises(
        planner.PlanningError, match=r"noise was replaced by another torch.Generator"
    ):
        p.module(x)


class BranchesOnGradMode(nn.Module):
    """Skips a costly regulariser when no gradient is wanted, as validation code does."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.b(torch.tanh(self.a(x)))
        return y + 0.1 * y.pow(2) if torch.is_grad_enabled() else y


def test_under_no_grad_a_forward_that_reads_grad_mode_runs_as_the_model():
    """Found trying the library: symbolic_trace baked in the branch of grad mode at planning,
    so a validation loop under ``torch.no_grad()`` computed the training branch (0.43 apart).
    Capture notes that forward called ``torch.is_grad_enabled()``; under ``no_grad`` such a
    plan runs the model itself."""
    model, x = BranchesOnGradMode(), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n")
    assert p.capture_method == "symbolic_trace" and p.segments
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(p.module(x), model(x))
    with torch.inference_mode():
        assert torch.equal(p.module(x), model(x))
    assert torch.equal(p.module(x), model(x))  # and with gradients, the graph


class RootWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.a, self.b = nn.Parameter(torch.randn(8, 8)), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x @ self.w)))


def test_functional_call_under_no_grad_computes_with_the_parameters_it_is_given():
    """Found in review: running the model itself under ``no_grad`` for every plan ignored the
    root parameters ``torch.func.functional_call`` swapped on the planned module (an EMA
    evaluation computed with the live weights)."""
    model, x = RootWeight(), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n")
    swapped = {"w": torch.zeros(8, 8)}  # a root parameter: the planned module's own entry
    with torch.no_grad():
        expected = torch.func.functional_call(model, swapped, (x,))
        assert torch.equal(torch.func.functional_call(p.module, swapped, (x,)), expected)


class BranchesOnItsInput(nn.Module):
    """Branches torch.export bakes in: on whether the input requires grad, and on its layout
    (timm's LayerNorm2d checks ``is_contiguous`` for channels_last)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        if x.requires_grad:
            x = x * 2
        if not x.is_contiguous():
            x = x.contiguous() + 1
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize(
    "other, described",
    [
        (lambda x: x.detach().requires_grad_(), "x: no grad, contiguous then, requires grad"),
        (lambda x: x.t().contiguous().t(), "x: no grad, contiguous then, no grad, not contig"),
    ],
    ids=["requires grad", "not contiguous"],
)
def test_an_exported_plan_called_with_another_layout_plans_that_call_form(other, described):
    """Found trying the library: called with an input that required grad, or a transposed one,
    the exported graph took the planning call's branches (0.12 and 0.23 apart), silently."""
    model, x = BranchesOnItsInput(), torch.randn(8, 8)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n")
    assert p.capture_method == "export"
    with pytest.warns(UserWarning, match=f"differ in requires_grad or contiguity.*{described}"):
        assert torch.equal(p.module(other(x)), model(other(x)))
    assert torch.equal(p.module(x), model(x))


def test_a_model_loaded_from_a_file_outside_sys_modules_is_checked_too(tmp_path):
    """Found in review: a class whose module is not in ``sys.modules`` (loaded with
    ``importlib.util.spec_from_file_location``, or through ``torch.package``) made planning
    fail with a KeyError; the globals are its functions' own."""
    import importlib.util

    source = tmp_path / "loose_model.py"
    source.write_text(
        "import torch\nfrom torch import nn\nUSE_TANH = True\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n"
        "        return torch.tanh(self.a(x)) if USE_TANH else self.a(x)\n"
    )
    spec = importlib.util.spec_from_file_location("loose_model", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not in sys.modules
    model, x = module.Net(), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    assert torch.equal(p.module(x), model(x))
    module.USE_TANH = False
    with pytest.raises(planner.PlanningError, match="USE_TANH changed from True to False"):
        p.module(x)


def test_an_attribute_the_forward_never_reads_may_change():
    """Bookkeeping on the model (a step counter) is not part of what the graph computes."""
    model, x = Blocks(), torch.randn(4, 8)
    model.global_step = 0
    p = tight_plan(model, (x,))
    model.global_step += 1
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})


FOLLOWED = {
    "a leaf's parameter replaced": lambda m: setattr(
        m.blocks[0][0], "weight", nn.Parameter(torch.randn(8, 8))
    ),
    "a leaf's attribute changed": lambda m: setattr(m.blocks[2][2], "p", 0.7),
}


@pytest.mark.parametrize("change", FOLLOWED)
def test_what_the_graph_reads_when_it_runs_may_change(change):
    """Parameters and the modules the graph calls are read when it runs, as in the model."""
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    FOLLOWED[change](model)
    assert_equivalent(copy.deepcopy(model), model, p.module, (x,), {})


def test_saved_tensor_hooks_around_a_plan_warn_that_its_segments_bypass_them():
    """Found trying the library: bfloat16 compression by ``saved_tensors_hooks`` packed 17
    tensors of the model and 7 of the plan (the segments' are recomputed), so gradients
    differed (0.02) without a word; under ``disable_saved_tensors_hooks`` the plan failed in
    torch.utils.checkpoint with the block's own message."""
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autograd.graph.save_on_cpu():  # lossless: the model's gradients
            p.module(x).sum().backward()
        model.zero_grad(set_to_none=True)  # inside torch's own checkpoint: its hooks
        checkpoint(p.module, x, use_reentrant=False).sum().backward()
    model.zero_grad(set_to_none=True)
    pack = functools.partial(lambda t, dtype: t.to(dtype), dtype=torch.bfloat16)  # no __qualname__
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.float()):
        with pytest.warns(UserWarning, match=r"saved-tensor hooks.*never reach them"):
            p.module(x).sum().backward()
    model.zero_grad(set_to_none=True)
    unsegmented = planner.plan(model, (x,), budget_gb=1)
    assert not unsegmented.segments
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in here"):
        with pytest.raises(planner.PlanningError, match=r"disable_saved_tensors_hooks.*in here"):
            p.module(x).sum().backward()
        with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes"):  # the model's error
            unsegmented.module(torch.randn(4, 5))


class SharedDropout(nn.Module):
    """Reads its called Dropout's ``p`` for a second use, as timm's attention passes
    ``attn_drop.p`` to SDPA's ``dropout_p``: the traced graph holds the number."""

    def __init__(self):
        super().__init__()
        self.a, self.drop = nn.Linear(8, 8), nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.a(nn.functional.dropout(x, self.drop.p, self.training)))


class ReadsItsGrandchild(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))

    def forward(self, x):
        return self.inner(nn.functional.dropout(x, self.inner[1].p, self.training))


@pytest.mark.parametrize("make", [SharedDropout, ReadsItsGrandchild])
def test_an_attribute_of_a_called_module_a_traced_one_reads_may_not_change(make):
    """Found trying the library: the planned module kept the old ``p`` (max difference 0.27
    after a dropout schedule set it to 0), silently; the model read the new one. Read from
    further up, too (found in review)."""
    model, x = make(), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    dropout = next(m for m in model.modules() if isinstance(m, nn.Dropout))
    dropout.p = 0.0
    with pytest.raises(planner.PlanningError, match=r"\.p changed from 0\.1 to 0\.0"):
        p.module(x)


# --------------------------------------------------------------------------------------------
# torch.compile


def test_torch_compile_traces_the_planned_module_in_one_graph():
    """The per-call checks are plain Python that Dynamo traces (fullgraph: no graph break)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    x = torch.randn(8, 16)
    p = sqrt_n_plan(model, (x,))
    reference = copy.deepcopy(model)
    compiled = torch.compile(p.module, backend="eager", fullgraph=True)
    compiled(x).sum().backward()
    reference(x).sum().backward()
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


@pytest.mark.parametrize("form", ["float64", "autocast"])
def test_a_compiled_plan_called_in_a_new_form_plans_it_outside_the_compiled_graph(form):
    """Found by a tester: the plan of a new call form (a dtype move, autocast around the call)
    was made inside Dynamo's trace, which failed on an internal assertion of torch's
    dispatcher. The new form runs eagerly, planned, exactly like the model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    compiled = torch.compile(p.module, backend="aot_eager")
    compiled(x).sum().backward()
    model.zero_grad(set_to_none=True)
    if form == "float64":
        model.double()
        x = x.double()
    reference = copy.deepcopy(model)
    run = contextlib.nullcontext()
    if form == "autocast":
        run = torch.autocast("cpu", dtype=torch.bfloat16)
    with run, pytest.warns(UserWarning, match="planned this call form once"):
        torch.manual_seed(1)
        out = compiled(x)
    with run:
        torch.manual_seed(1)
        expected = reference(x)
    out.float().sum().backward()
    expected.float().sum().backward()
    assert torch.equal(out, expected)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


class NumpyScaledAndTempered(nn.Module):
    """Reads a numpy scalar and a plain tensor attribute, both compared on every call."""

    def __init__(self):
        super().__init__()
        self.linear, self.scale, self.tau = nn.Linear(8, 8), np.float32(0.5), torch.tensor(2.0)

    def forward(self, x):
        return torch.tanh(self.linear(x) * self.scale / self.tau)


def test_under_torch_compile_a_change_after_planning_is_refused_with_what_changed():
    """Found in review: with a numpy scalar among the values compared, the message of a change
    (here the tensor attribute replaced) failed to trace ("Failed to convert args/kwargs to
    proxy") instead of naming it."""
    torch._dynamo.reset()
    model, x = NumpyScaledAndTempered(), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    compiled = torch.compile(p.module, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), model(x))
    model.tau = torch.tensor(3.0)
    with pytest.raises(Exception, match="tau, a tensor that is neither a parameter nor a buffer"):
        compiled(x)


class UpdatesRootBuffer(RootState):
    """A root buffer read inside a segment and updated later in forward (restored on
    recompute)."""

    def forward(self, x):
        h = self.layers[:3](x + self.shift)
        self.shift.add_(1.0)
        return self.layers[3:](h) + self.pos


def _kept_linears(model, args, kwargs):
    """Every node in one segment, each Linear's node kept (a selective segment)."""
    captured, problem = prepare(model, args, kwargs)
    gm = captured.graph_module
    keep = [
        k
        for k, node in enumerate(compute_nodes(gm))
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear)
    ]
    return rewrite(gm, model, Choice(((0, problem.size),), frozenset(keep[:2])), problem=problem)


def _lowest(model, args, kwargs):
    return tight_plan(model, args, kwargs).module


COMPILED_PLANS = {
    "BatchNorm, traced": (traced_batchnorm_model, _lowest),
    "kept nodes": (lambda: (Blocks(), (torch.randn(4, 8),), {}), _kept_linears),
}


@pytest.mark.parametrize("case", COMPILED_PLANS)
def test_torch_compile_of_a_plan_whose_segments_pass_context_fn_trains_like_the_model(case):
    """Segments that restore buffers or keep nodes pass ``checkpoint`` a ``context_fn``,
    which torch.compile refused (an opaque TypeError, found trying the library). Compiled,
    they recompute everything: the functional graph updates buffers once and recomputes from
    the values the forward read, so the plan trains exactly as the compiled model."""
    torch.manual_seed(0)
    make_model, make_planned = COMPILED_PLANS[case]
    model, args, kwargs = make_model()
    reference = copy.deepcopy(model)
    planned = make_planned(model, args, kwargs)
    assert any(n.target is _context_fn for n in planned.graph.nodes), "needs a context_fn"
    reference.compile(backend="aot_eager", fullgraph=True)
    planned.compile(backend="aot_eager", fullgraph=True)
    assert_equivalent(reference, model, planned, args, kwargs)


REFUSED_UNDER_COMPILE = {
    # Compiled, the first segment's recompute would read ``shift`` after forward's ``add_``:
    # wrong gradients (measured: all of ``layers.0``'s).
    "root buffer updated in forward": (
        lambda: (UpdatesRootBuffer(), (torch.randn(8, 16),), {}),
        lambda model, args, kwargs: rewrite(
            prepare(model, args, kwargs)[0].graph_module, model, ((0, 4), (5, 9))
        ),
    ),
    # Buffers read by ATen ops: the rule cannot tell a BatchNorm's from any other.
    "BatchNorm, exported": (exported_batchnorm_model, _lowest),
}


@pytest.mark.parametrize("case", REFUSED_UNDER_COMPILE)
def test_torch_compile_of_a_plan_that_could_recompute_from_an_updated_buffer_says_so(case):
    """``fullgraph=True`` raises the reason; otherwise Dynamo runs the forward eagerly, where
    the plan is exact."""
    torch.manual_seed(0)
    make_model, make_planned = REFUSED_UNDER_COMPILE[case]
    model, args, kwargs = make_model()
    reference = copy.deepcopy(model)
    planned = make_planned(model, args, kwargs)
    strict = copy.deepcopy(planned)
    strict.compile(backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"(?s)PlanningError.*would read them as updated"):
        strict(*args, **kwargs)
    planned.compile(backend="aot_eager")
    assert_equivalent(reference, model, planned, args, kwargs)


@pytest.mark.parametrize("where", ["the model", "a traced-through block"])
def test_a_hook_added_after_planning_where_the_graph_traced_through_refuses(where):
    """Found trying the library: the hook never ran and outputs silently differed (a hook that
    rescales a block's output). Hooks on leaf modules run and stay allowed."""
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    target = model if where == "the model" else model.blocks[1]
    target.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(planner.PlanningError, match=r"hooks were added.*after planning"):
        p.module(x)


def test_a_hook_on_a_container_forward_never_calls_is_allowed_as_in_the_model():
    """Found by a tester: a logger hooking every module put one on the ``nn.ModuleList``, which
    has no forward, and the plan refused the call; the model never runs such a hook."""
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    model.blocks.register_forward_hook(lambda module, args, out: out * 2)
    torch.manual_seed(0)
    planned = p.module(x)
    torch.manual_seed(0)
    torch.testing.assert_close(planned, model(x), rtol=0, atol=0)


def test_a_hook_on_a_module_whose_forward_is_set_on_the_instance_still_refuses():
    """Found by review: the container rule above took a module given its forward as an
    attribute (``inner.forward = ...``) for one without, and dropped its hook silently."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(4, 8)
    adapter = nn.Module()
    adapter.forward = lambda h: h * 2
    model.blocks[1].append(adapter)
    p = tight_plan(model, (x,))
    adapter.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(planner.PlanningError, match=r"hooks were added.*after planning"):
        p.module(x)


def test_a_hook_on_a_leaf_module_after_planning_runs():
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    model.blocks[1][0].register_forward_hook(lambda module, args, out: out * 2)
    torch.manual_seed(0)
    planned = p.module(x)
    torch.manual_seed(0)
    torch.testing.assert_close(planned, model(x), rtol=0, atol=0)


def _observing(module: nn.Module) -> None:
    """A forward pre-hook with effects, as an activation observer has: it counts the batches
    it saw in a buffer it adds and scales the input by that count."""
    module.register_buffer("seen", torch.zeros(()))

    def pre_hook(module, args):
        with torch.no_grad():
            module.seen.add_(1)
        return (args[0] * (1 + module.seen),)

    module.register_forward_pre_hook(pre_hook)


def test_an_observer_added_after_planning_to_a_called_module_updates_its_buffer_once():
    """Found trying the library: the observer's hook ran again in every recompute of its
    segment, and 16-25 gradients and its buffer differed. The buffer it adds makes the call a
    call form of its own, planned with it (the replay restores a called module's buffers for
    the recompute)."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    reference = copy.deepcopy(model)
    for m in (reference, model):
        for block in m.blocks:
            _observing(block[0])
    for step in range(2):
        outputs = []
        for module in (reference, p.module):
            torch.manual_seed(step)
            out = module(x)
            out.pow(2).sum().backward()
            outputs.append(out)
        assert torch.equal(*outputs)
        for a, b in zip(reference.state_dict().values(), model.state_dict().values()):
            assert torch.equal(a, b)
        for a, b in zip(reference.parameters(), model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)


def test_pruning_after_planning_is_planned_again_with_the_mask():
    """``torch.nn.utils.prune`` moves a Linear's weight to ``weight_orig``, adds a
    ``weight_mask`` buffer where the module had none, and computes the weight in a pre-hook:
    found trying the library, the plan ran on (27% over its budget), with a warning that named
    frozen parameters. The call is now planned again with the pruned layers."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(4, 8)
    p = sqrt_n_plan(model, (x,))
    reference = copy.deepcopy(model)
    for m in (reference, model):
        torch.nn.utils.prune.l1_unstructured(m.blocks[1][0], "weight", amount=0.5)
    with pytest.warns(UserWarning, match=r"removed from where they were at planning.*prune"):
        outputs = []
        for module in (reference, p.module):
            torch.manual_seed(0)
            outputs.append(module(x))
            outputs[-1].pow(2).sum().backward()
    assert torch.equal(*outputs)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert all(p.module._planner.call_forms.values())  # planned, not run by the model


def _halve_sequential_outputs(module, args, out):
    return out / 2 if isinstance(module, nn.Sequential) else out


def test_a_process_wide_module_hook_is_refused_while_planning_and_after():
    """Found trying the library: ``register_module_forward_hook`` (every module's calls) was
    frozen into the graph when registered before planning (still applied after its
    ``remove()``), and never ran on the traced-through blocks when registered after: outputs
    and gradients differed silently."""
    model, x = Blocks(), torch.randn(4, 8)
    handle = torch.nn.modules.module.register_module_forward_hook(_halve_sequential_outputs)
    try:
        with pytest.raises(planner.PlanningError, match=r"process-wide.*_halve_sequential"):
            planner.plan(model, (x,), budget_gb=1)
    finally:
        handle.remove()
    with ModuleTracker():  # planned while hooks that only observe are registered
        p = tight_plan(model, (x,))
    # As many process-wide hooks as at planning (the tracker's two), both acting (found in
    # review: a count alone missed them).
    handles = [
        torch.nn.modules.module.register_module_forward_hook(_halve_sequential_outputs),
        torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None),
    ]
    try:
        with pytest.raises(planner.PlanningError, match=r"process-wide.*after planning"):
            p.module(x)
    finally:
        for handle in handles:
            handle.remove()
    torch.manual_seed(0)
    planned = p.module(x)
    torch.manual_seed(0)
    assert torch.equal(planned, model(x))


def test_flop_counter_mode_around_a_planned_step_is_not_a_process_wide_hook():
    """``FlopCounterMode`` registers torch's ``ModuleTracker`` hooks for every module: they
    only observe, so a plan runs under it and counts the same FLOPs as the model (no segment
    recomputed at a budget that fits the baseline)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, x = Blocks(), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1)
    counts = []
    for module in (model, p.module):
        with FlopCounterMode(display=False) as counter:
            module(x).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_torchs_memory_tracker_around_a_planned_step_observes_it():
    """Found by a tester: ``MemTracker`` (its ``ModTracker`` registers process-wide hooks that
    only observe) was refused as a hook that acts, so the tool a user would check the plan's
    memory with could not run. The step under it trains as the model does."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    model, x = Blocks(), torch.randn(4, 8)
    p = tight_plan(model, (x,))
    assert p.segments
    reference = copy.deepcopy(model)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model)
    with tracker:
        torch.manual_seed(0)
        p.module(x).sum().backward()
    assert tracker.get_tracker_snapshot("peak")
    torch.manual_seed(0)
    reference(x).sum().backward()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("reloaded", [False, True], ids=["same parameters", "assign=True"])
def test_unfreezing_after_planning_warns_that_the_memory_no_longer_holds(reloaded):
    """Staged fine-tuning: frozen layers save nothing for backward, so a plan made with them
    frozen measured 2.86x its budget once they trained (found trying the library). Also once a
    checkpoint is loaded with ``assign=True``, which puts new parameter objects in the model:
    the check read the old ones, stayed silent and warned of the old ones' gradients."""
    model, x = Blocks(), torch.randn(4, 8)
    model.blocks[0].requires_grad_(False)
    p = tight_plan(model, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.module(x).sum().backward()  # as planned: no warning
        if reloaded:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict(state, assign=True)  # new objects, .grad None
            model.blocks[0].requires_grad_(False)  # still as planned
            p.module(x).sum().backward()  # old objects' gradients are no longer the model's
    model.zero_grad(set_to_none=True)
    model.requires_grad_(True)
    with pytest.warns(UserWarning, match="frozen or unfrozen after planning"):
        p.module(x).sum().backward()


def test_untying_tied_parameters_after_planning_warns_that_the_memory_no_longer_holds():
    """Found trying the library: a fine-tuning recipe untied the output head from the
    embedding after planning, and the step went 6.9% over the budget without a word: the plan
    counted one parameter and one gradient where there were two. Gradients stay exact."""
    model, args = planner.zoo.gpt(layers=2, vocab=512, d_model=64)
    p = planner.plan(model, args, budget_gb=1)
    assert model.lm_head.weight is model.wte.weight  # tied
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.module(*args)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    reference = copy.deepcopy(model)
    # 512 x 64 float32 weights: 128 KiB, and as much for their gradient
    with pytest.warns(UserWarning, match=r"tied at planning are no longer shared.*0\.2 MiB more"):
        assert_equivalent(reference, model, p.module, args, {})


class ExportedTiedHead(nn.Module):
    """An embedding and an output head sharing one weight, as language models tie them, in a
    forward symbolic_trace rejects: torch.export captures it, and reads the weight by one name."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.mix = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        if ids.size(0) > 0:  # a Python bool of a size: symbolic_trace fails, torch.export captures
            for layer in self.mix:
                h = h + torch.tanh(layer(h))
        return self.head(h)


class TracedTiedHead(nn.Module):
    """Tied weights also read as an attribute, which symbolic_trace names by the first module
    holding it (``head.weight`` for ``self.embed.weight``)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 64, bias=False)
        self.embed = nn.Embedding(64, 16)
        self.embed.weight = self.head.weight
        self.unused = nn.Linear(16, 16)  # tied below, never called
        self.unused_twin = nn.Linear(16, 16)
        self.unused_twin.weight = self.unused.weight

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h) + nn.functional.linear(h, self.embed.weight)


def test_untying_tied_parameters_the_graph_never_reads_only_warns():
    """Found by review: the refusal below first refused a tied pair forward never reads."""
    torch.manual_seed(0)
    model, ids = TracedTiedHead(), torch.randint(0, 64, (4, 8))
    p = sqrt_n_plan(model, (ids,))
    model.unused_twin.weight = nn.Parameter(torch.randn(16, 16))
    with pytest.warns(UserWarning, match="tied at planning are no longer shared"):
        out = p.module(ids)
    assert torch.equal(out, model(ids))
    model.embed.weight = nn.Parameter(torch.randn(64, 16))  # read as head.weight: refused
    with pytest.raises(planner.PlanningError, match="reads them by one name"):
        p.module(ids)


@pytest.mark.parametrize("untie", ["new head", "load_state_dict(assign=True)"])
def test_untying_parameters_an_export_reads_as_one_is_refused(untie):
    """Found trying the library on Hugging Face GPT-2 and Llama: untied after planning (a head
    of its own for fine-tuning), the exported graph kept reading one tensor for both uses, and
    the loss came out 29.35 against the model's 14.02, with a warning that gradients stay
    exact. The planned module now refuses the call and says to plan again."""
    torch.manual_seed(0)
    model, ids = ExportedTiedHead(), torch.randint(0, 64, (4, 8))
    p = sqrt_n_plan(model, (ids,))
    reads = {n.target for n in p.module.graph.find_nodes(op="get_attr") if n.users}
    assert len(reads & {"embed.weight", "head.weight"}) == 1  # the premise: read by one name
    p.module(ids).sum().backward()  # as planned
    if untie == "new head":
        model.head.weight = nn.Parameter(torch.randn(64, 16))
    else:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
    with pytest.raises(planner.PlanningError, match=r"tied at planning.*reads them by one name"):
        p.module(ids)
    with pytest.raises(planner.PlanningError, match="tied at planning"):
        p.module(ids)  # every call, not once
    model.head.weight = model.embed.weight  # tied again: runs
    torch.testing.assert_close(p.module(ids), model(ids), rtol=0, atol=0)


class ViewedByLength(nn.Module):
    """Takes its sequence length as a number beside the tensor it shapes."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x, length, mask=None):
        h = torch.tanh(self.linear(x)).view(x.shape[0], length, 16)
        return h * mask[..., None] if mask is not None else h


def test_a_call_form_the_examples_sizes_do_not_suit_is_planned_at_its_own():
    """Found in review: planned at the example's sizes (the call's tensors cut to length 8), a
    form whose length comes as a number (16) failed, and its calls ran unplanned."""
    model, x = ViewedByLength(), torch.randn(2, 16, 16)
    example = (torch.randn(2, 8, 16), 8)
    p = planner.plan(model, example, example_kwargs={"mask": torch.ones(2, 8)}, budget_gb=1)
    with pytest.warns(UserWarning, match="planned this call form once.*at this call's sizes"):
        out = p.module(x, 16)
    assert torch.equal(out, model(x, 16))


def _head_and_encoder():
    torch.manual_seed(0)
    head = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    return head, nn.Linear(8, 8), torch.randn(4, 8)


def test_an_example_another_modules_graph_made_plans_and_trains_that_graph_too():
    """A head planned on an encoder's output (a discriminator on a generator's): the profile
    failed trying to differentiate into the encoder ("Tried to backward() through example
    input"). The plan is of the head's step; the encoder still gets its gradients."""
    head, encoder, x = _head_and_encoder()
    reference_head, reference_encoder = copy.deepcopy(head), copy.deepcopy(encoder)
    p = planner.plan(head, (encoder(x),), budget_gb=1)
    p.module(encoder(x)).sum().backward()
    reference_head(reference_encoder(x)).sum().backward()
    for got, expected in zip(
        [*head.parameters(), *encoder.parameters()],
        [*reference_head.parameters(), *reference_encoder.parameters()],
    ):
        assert torch.equal(got.grad, expected.grad)


def test_a_call_form_first_seen_with_an_input_another_graph_made_is_planned():
    """Found trying the library: a GAN's generator step, D(G(z)) under autocast, failed
    planning its call form (the same profile error), at every call."""
    head, encoder, x = _head_and_encoder()
    p = planner.plan(head, (x,), budget_gb=1)
    with torch.autocast("cpu", torch.bfloat16):
        with pytest.warns(UserWarning, match="planned this call form once"):
            out = p.module(encoder(x))
        with torch.no_grad():
            expected = copy.deepcopy(head)(encoder(x))
    out.float().sum().backward()
    assert torch.equal(out, expected)
    assert all(q.grad is not None for q in encoder.parameters())


def test_a_second_call_before_the_first_calls_backward_warns_that_the_step_holds_both():
    """Contrastive pairs, a discriminator's real and fake batches: each call holds its
    activations until its backward, and the plan counts one call's. It measured 74% over the
    budget without a word (found trying the library)."""
    head, _, x = _head_and_encoder()
    p = planner.plan(head, (x,), budget_gb=1)
    first = p.module(x)
    with pytest.warns(UserWarning, match="graph of an earlier call .*waits for its backward"):
        second = p.module(x)
    (first - second).pow(2).sum().backward()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "the planned .* earlier call .*waits")
        p.module(x), p.module(x)  # once only


@dataclasses.dataclass
class Scores:
    value: torch.Tensor


class ScoresHead(nn.Module):
    """Returns a dataclass, which is no pytree."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return Scores(self.b(torch.tanh(self.a(x))))


def test_a_second_call_warns_whatever_container_holds_the_first_calls_output():
    """Found by a tester: with a dataclass output nothing warned (31% over the budget)."""
    x = torch.randn(4, 8)
    p = planner.plan(ScoresHead(), (x,), budget_gb=1)
    first = p.module(x)
    with pytest.warns(UserWarning, match="graph of an earlier call .*waits for its backward"):
        second = p.module(x)
    (first.value - second.value).pow(2).sum().backward()


def test_calls_whose_backward_ran_or_whose_graph_is_gone_do_not_warn():
    head, _, x = _head_and_encoder()
    p = planner.plan(head, (x,), budget_gb=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "the planned .* earlier call .*waits")
        for _ in range(2):  # gradient accumulation: a backward after each call
            p.module(x).sum().backward()
        p.module(x)  # a forward whose result is dropped: its graph dies with it
        loss = p.module(x).sum()
        loss.backward(retain_graph=True)  # reached, though the graph is kept
        p.module(x).sum().backward()
        # The user's own checkpoint around each call (a block shared by layers) holds only
        # the calls' inputs: found by review, the warning fired there.
        first = checkpoint(p.module, x, use_reentrant=False)
        (first + checkpoint(p.module, x, use_reentrant=False)).sum().backward()


def test_once_warned_a_cell_called_many_times_before_backward_is_watched_no_more():
    """Found by review: a recurrent cell called 8,000 times before one backward rebuilt the
    list of waiting calls each time (578 us a step against 44)."""
    head, _, x = _head_and_encoder()
    p = planner.plan(head, (x,), budget_gb=1)
    h = x
    with pytest.warns(UserWarning, match="earlier call .*waits"):
        for _ in range(50):
            h = p.module(h)
    assert p.module._planner.earlier_calls == []
    h.sum().backward()


class ReturnsAStatisticViewOfItsActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x) + 1  # saves nothing a write in place would change (tanh's output would)
        with torch.no_grad():
            statistic = h[:, :2]  # a view made under no_grad...
        h.mul_(2)  # ... whose base is then written with grad on: its grad_fn is unreadable
        return self.b(h), statistic


def test_an_output_whose_grad_fn_autograd_refuses_to_read_is_returned_as_the_model_does():
    """Found by review: noting the call's graph read every output's grad_fn, and the call
    raised where the model returns."""
    model, x = ReturnsAStatisticViewOfItsActivations(), torch.randn(4, 8)
    p = planner.plan(model, (x,), budget_gb=1, solver="sqrt_n", loss_fn=lambda o: o[0].sum())
    out, statistic = p.module(x)
    expected = copy.deepcopy(model)(x)
    assert torch.equal(out, expected[0]) and torch.equal(statistic, expected[1])
    with pytest.raises(RuntimeError, match="view was created in no_grad mode"):
        statistic.grad_fn  # noqa: B018 - the read autograd refuses, as on the model's output


def test_torch_jit_trace_of_a_plan_is_refused_as_script_is():
    """Tracing recorded the segments' ops without their checkpoints: a module holding every
    activation, 67% over the budget, with only torch's generic TracerWarning (found trying the
    library)."""
    head, _, x = _head_and_encoder()
    p = planner.plan(head, (x,), budget_gb=1, solver="sqrt_n")
    assert p.segments
    with pytest.raises(planner.PlanningError, match=r"torch\.jit\.trace cannot record"):
        torch.jit.trace(p.module, (x,))


@pytest.mark.parametrize("capture", ["torch.fx.symbolic_trace", "torch.export"])
def test_capturing_a_plan_as_a_graph_is_refused(capture):
    """Found by a tester: ``torch.fx.symbolic_trace`` of a planned module recorded its
    segments' ops without their checkpoints (every activation held, 2.5x the budget), and
    ``torch.export`` gave a program that ran them without gradients; neither said a word."""
    head, _, x = _head_and_encoder()
    p = planner.plan(head, (x,), budget_gb=1, solver="sqrt_n")
    assert p.segments
    with pytest.raises(planner.PlanningError, match=rf"{re.escape(capture)} cannot record"):
        if capture == "torch.export":
            torch.export.export(p.module, (x,))
        else:
            torch.fx.symbolic_trace(p.module)


def test_torchs_checkpoint_debug_mode_is_refused_with_a_way_out():
    """Found by a tester: every planned step raised torch's "debug=True is incompatible with
    non-default context_fn", naming neither planner nor a way out."""
    head, _, x = _head_and_encoder()
    p = planner.plan(head, (x,), budget_gb=1, solver="sqrt_n")
    assert p.segments
    with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
        with pytest.raises(planner.PlanningError, match=r"debug mode.*cannot run.*turn debug"):
            p.module(x)
    p.module(x)  # debug mode off again: the plan runs
