"""Specifications of gradient accumulation (planner.training).

Accumulating micro-batches must give exactly the gradients of the whole batch, computed here a
second way in one backward, for mean and sum losses and for a smaller last micro-batch or a
shorter last window; on a plain and on a planned (checkpointed) module.
"""

import contextlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import planner
from planner import zoo
from planner.training import accumulation_windows, micro_batches

BATCH = 10


def regression_model():
    """A plain chain (no BatchNorm: its statistics would depend on the micro-batch) and data."""
    model, (x,) = zoo.mlp_chain(depth=6, width=16, batch=BATCH, seed=0)
    y = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(1))
    return model, (x, y)


# plan() counts gradients from backward on, so it warns when a micro-batch after the first
# starts with them held; plan_batch plans accumulation (see the end of this file).
ACCUMULATING_WITH_PLAN = pytest.mark.filterwarnings(
    "ignore:the planned Sequential is called while its parameters or tensor arguments hold"
)


def planned(model, batch):
    p = planner.plan(model, batch[:1], budget_bytes=2**30, solver="sqrt_n")
    assert p.segments
    return p.module


def loss_of(module, batch, reduction):
    x, y = batch
    return F.mse_loss(module(x), y, reduction=reduction)


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def full_batch_grads(batch, reduction):
    model, _ = regression_model()
    loss_of(model, batch, reduction).backward()
    return grads(model)


def assert_same_grads(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=name)


@ACCUMULATING_WITH_PLAN
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("micro_batch", [1, 2, 4, 5, 10, 32], ids=lambda m: f"micro{m}")
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "planned"])
def test_accumulated_gradients_equal_full_batch_gradients(reduction, micro_batch, checkpointed):
    model, batch = regression_model()
    module = planned(model, batch) if checkpointed else model
    sizes = []
    for micro in micro_batches(batch, micro_batch, reduction=reduction):
        with micro:
            micro.backward(loss_of(module, micro.data, reduction))
        sizes.append(micro.size)
    assert sum(sizes) == BATCH and max(sizes) == min(micro_batch, BATCH)
    assert_same_grads(grads(model), full_batch_grads(batch, reduction))


def test_a_partial_last_micro_batch_weighs_by_its_samples():
    x = torch.arange(10.0)
    micros = list(micro_batches(x, 4))
    assert [m.size for m in micros] == [4, 4, 2]
    assert [m.loss_scale for m in micros] == [0.4, 0.4, 0.2]
    assert [m.is_last for m in micros] == [False, False, True]
    assert sum(m.loss_scale * m.data.mean() for m in micros) == x.mean()
    assert [m.loss_scale for m in micro_batches(x, 4, reduction="sum")] == [1.0, 1.0, 1.0]


def test_structures_are_split_along_dim_0_and_other_leaves_kept():
    batch = {"x": torch.zeros(5, 3), "pair": (torch.ones(5), 7), "temperature": torch.tensor(2.0)}
    micros = list(micro_batches(batch, 2))
    assert [m.data["x"].shape[0] for m in micros] == [2, 2, 1]
    assert all(m.data["pair"][1] == 7 and m.data["temperature"] == 2.0 for m in micros)
    assert [m.data["pair"][0].shape[0] for m in micros] == [2, 2, 1]


def test_numpy_arrays_and_per_sample_names_are_cut_with_the_tensors():
    """What a data loader yields beside tensors: per-sample weights as a numpy array, and the
    samples' names collated into a list; a list of another length is not per-sample."""
    batch = {
        "x": torch.zeros(5, 3),
        "weight": np.arange(5.0),
        "names": [f"sample{i}" for i in range(5)],
        "classes": ("cat", "dog"),
    }
    micros = list(micro_batches(batch, 2))
    assert [m.data["weight"].tolist() for m in micros] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert [m.data["names"] for m in micros] == [
        ["sample0", "sample1"],
        ["sample2", "sample3"],
        ["sample4"],
    ]
    assert all(m.data["classes"] == ("cat", "dog") for m in micros)


def test_a_numpy_array_of_another_length_is_refused():
    with pytest.raises(ValueError, match=r"disagree on dimension 0 \(\[4, 5\]\)"):
        list(micro_batches({"x": torch.zeros(5, 3), "weight": np.ones(4)}, 2))


@ACCUMULATING_WITH_PLAN
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_windows_over_a_loader_end_with_a_partial_window(reduction):
    model, batch = regression_model()
    module = planned(model, batch)
    # A loader of 4 micro-batches (3, 3, 3, 1 samples), windows of 3: [3+3+3] then [1].
    loader = [tuple(t[i : i + 3] for t in batch) for i in range(0, BATCH, 3)]
    windows, window_grads = [[]], []
    for micro in accumulation_windows(loader, steps=3, reduction=reduction):
        with micro:
            micro.backward(loss_of(module, micro.data, reduction))
        windows[-1].append(micro.size)
        if micro.is_last:  # where the optimizer would step
            window_grads.append(grads(model))
            model.zero_grad(set_to_none=True)
            windows.append([])
    assert windows[:-1] == [[3, 3, 3], [1]]
    assert_same_grads(window_grads[0], full_batch_grads(tuple(t[:9] for t in batch), reduction))
    assert_same_grads(window_grads[1], full_batch_grads(tuple(t[9:] for t in batch), reduction))


class FakeWrapper(torch.nn.Module):
    """Records whether each forward ran with gradient synchronisation on, as DDP decides."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.sync = True
        self.synced_forwards = []

    def forward(self, x):
        self.synced_forwards.append(self.sync)
        return self.linear(x).sum()


class FakeDataParallel(FakeWrapper):
    """DDP's interface: a ``no_sync()`` context manager."""

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


class FakeFullyShard(FakeWrapper):
    """FSDP2's interface: a switch instead of a context manager."""

    def set_requires_gradient_sync(self, requires_gradient_sync):
        self.sync = requires_gradient_sync


@pytest.mark.parametrize("wrapper", [FakeDataParallel, FakeFullyShard])
def test_only_the_last_micro_batch_synchronises(wrapper):
    model = wrapper()
    for micro in micro_batches(torch.ones(7, 2), 2, model=model, data_parallel_size=1):
        with micro:
            micro.backward(model(micro.data))
    assert model.synced_forwards == [False, False, False, True]
    assert model.sync


def test_backward_outside_the_context_is_refused_for_a_data_parallel_model():
    model = FakeDataParallel()
    micro = next(micro_batches(torch.ones(4, 2), 2, model=model, data_parallel_size=1))
    with pytest.raises(RuntimeError, match="inside `with micro:`"):
        micro.backward(model(micro.data))


def test_a_sum_loss_undoes_the_averaging_over_ranks():
    model = FakeDataParallel()
    scales = [
        m.loss_scale
        for m in micro_batches(
            torch.ones(4, 2), 2, model=model, reduction="sum", data_parallel_size=4
        )
    ]
    assert scales == [4.0, 4.0]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: micro_batches(torch.ones(4), 0), "micro_batch must be a positive integer"),
        (lambda: micro_batches(torch.ones(4), -2), "micro_batch must be a positive integer"),
        (lambda: micro_batches(torch.ones(4), 2.5), "micro_batch must be a positive integer"),
        (lambda: micro_batches(torch.ones(4), True), "micro_batch must be a positive integer"),
        (lambda: micro_batches(torch.ones(4), 2, reduction="avg"), "reduction must be one of"),
        (lambda: micro_batches((torch.ones(4), torch.ones(3)), 2), "disagree on dimension 0"),
        (lambda: micro_batches({"n": 3}, 2), "no tensor with a batch dimension"),
        (lambda: accumulation_windows([], steps=0), "steps must be a positive integer"),
    ],
)
def test_bad_arguments_raise_value_error_at_the_call(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_backward_needs_a_scalar_loss():
    micro = next(micro_batches(torch.ones(4, 2, requires_grad=True), 2))
    with pytest.raises(ValueError, match="scalar loss"):
        micro.backward(micro.data * 2)


def test_backward_passes_the_scale_itself_and_takes_no_gradient():
    """It passes ``loss_scale`` as the loss's gradient (no scaled copy of the loss held)."""
    x = torch.ones(4, 2, requires_grad=True)
    micro = next(micro_batches(x, 2))
    micro.backward((micro.data * 3).sum())
    assert torch.equal(x.grad[:2], torch.full((2, 2), 3 * micro.loss_scale))
    with pytest.raises(TypeError, match="without gradient="):
        micro.backward((micro.data * 3).sum(), gradient=torch.tensor(2.0))


# --------------------------------------------------------------------------------------------
# Gradients held when a step starts: plan() counts them from backward on, plan_batch from the
# start of an accumulation window.
# --------------------------------------------------------------------------------------------


def _step(module, batch):
    loss_of(module, batch, "mean").backward()


@contextlib.contextmanager
def no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_a_step_starting_with_gradients_zeroed_in_place_warns_once():
    model, batch = regression_model()
    module = planned(model, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with no_warning():
        _step(module, batch)  # .grad None: what the plan counts
    optimizer.zero_grad(set_to_none=False)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.warns(UserWarning, match=rf"hold gradients \(0\.0 MiB, {held} bytes\).*plan_batch"):
        _step(module, batch)
    with no_warning():
        _step(module, batch)  # once


def test_a_step_starting_with_an_input_gradient_kept_from_the_last_step_warns():
    """An input that requires grad (a gradient penalty, an adversarial example) keeps its
    ``.grad`` unless the loop frees it: measured exactly its size over the budget (found trying
    the library)."""
    model, (x, y) = regression_model()
    x.requires_grad_(True)
    module = planned(model, (x, y))
    _step(module, (x, y))
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match=rf"MiB, {x.numel() * 4} bytes\).*x\.grad = None"):
        _step(module, (x, y))


class SparseEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 32, sparse=True)
        self.lin = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))

    def forward(self, ids):
        x = self.emb(ids)
        for lin in self.lin:
            x = torch.tanh(lin(x))
        return x


def test_accumulating_into_sparse_gradients_warns_with_their_bytes():
    """Found trying the library: the second micro-batch of a model with a sparse embedding
    raised 'nbytes is not defined for sparse tensors' where the model itself accumulates."""
    torch.manual_seed(0)
    model, ids = SparseEmbedding(), torch.randint(0, 100, (32, 16))
    module = planner.plan(model, (ids,), budget_gb=1).module
    module(ids).sum().backward()
    grad = model.emb.weight.grad
    assert grad.is_sparse
    held = sum(p.grad.nbytes for p in model.lin.parameters())
    held += grad._indices().nbytes + grad._values().nbytes
    with pytest.warns(UserWarning, match=rf"MiB, {held} bytes\)"):
        module(ids).sum().backward()


def test_steps_that_free_gradients_or_run_without_them_do_not_warn():
    model, batch = regression_model()
    module = planned(model, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with no_warning():
        for _ in range(3):
            _step(module, batch)
            optimizer.step()
            optimizer.zero_grad()  # set_to_none=True, the default
        _step(module, batch)
        with torch.no_grad():
            module(batch[0])  # validation between steps holds gradients and makes none


def test_accumulation_planned_by_plan_batch_does_not_warn():
    model, _ = regression_model()

    def make_inputs(size):
        return zoo.mlp_chain(depth=6, width=16, batch=size, seed=0)[1]

    choice = planner.plan_batch(
        model, make_inputs, budget_bytes=2**30, global_batch=BATCH, micro_batches=[5]
    )
    assert choice.steps == 2
    batch = (make_inputs(BATCH)[0], torch.randn(BATCH, 16))
    with no_warning():
        for micro in micro_batches(batch, choice.micro_batch):
            with micro:
                micro.backward(loss_of(choice.module, micro.data, "mean"))
