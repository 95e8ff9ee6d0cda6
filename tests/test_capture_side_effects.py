"""What a forward does to state a captured graph does not carry (found by testers, each planned
silently wrong): tensors of the model read outside the traced values, the random generator
seeded in forward, values collected in a module's containers. Each is captured exactly or
refused with what to do, and planning leaves the model as it was."""

from __future__ import annotations

import collections
import copy
import operator

import pytest
import torch
from torch import nn

import planner


def _layers() -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


# -- tensors of the model read outside the traced values -------------------------------------
# symbolic_trace gives a get_attr to parameters only: an op on a buffer or a plain tensor
# attribute alone ran once, at planning, and the graph held its result, a frozen copy.


class Queue(nn.Module):
    """A MoCo-style queue updated in place in forward: read through ``clone()``, then written.
    Planned, the logits read the queue as it was at planning (0.83 off from the second step)."""

    def __init__(self, register: bool):
        super().__init__()
        self.layers = _layers()
        if register:
            self.register_buffer("queue", torch.zeros(32, 16), persistent=False)
        else:
            self.queue = torch.zeros(32, 16)  # a plain attribute, as many repositories keep it

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = x @ self.queue.clone().t()
        self.queue[:8] = x.detach()
        return logits.sum() + x.sum()


class WeightPenalty(nn.Module):
    """An L2 penalty over ``self.parameters()`` in forward: real tensors, not traced ones."""

    def __init__(self):
        super().__init__()
        self.layers = _layers()

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum() + 0.1 * sum(p.pow(2).sum() for p in self.parameters())


def _planned_beside_a_copy(model: nn.Module):
    """A copy of ``model`` made before planning, and a plan of ``model`` with segments."""
    reference = copy.deepcopy(model)
    p = planner.plan(model, (torch.randn(8, 16),), budget_gb=1, solver="sqrt_n")
    assert p.segments
    return reference, p


@pytest.mark.parametrize(
    "make",
    [lambda: Queue(register=False), lambda: Queue(register=True), WeightPenalty],
    ids=["plain attribute", "buffer", "parameters"],
)
def test_a_tensor_of_the_model_read_outside_traced_values_is_read_at_every_call(make):
    torch.manual_seed(0)
    model = make()
    reference, p = _planned_beside_a_copy(model)
    for step in range(3):
        x = torch.randn(8, 16)
        for parameter in (*model.parameters(), *reference.parameters()):
            parameter.grad = None
        expected, out = reference(x), p.module(x)
        expected.backward()
        out.backward()
        assert torch.equal(out, expected), f"step {step}"
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: {name}"
    if isinstance(model, Queue):
        assert torch.equal(model.queue, reference.queue)
        reads = [n.target for n in p.module.graph.find_nodes(op="get_attr")]
        assert any(operator.attrgetter(t)(p.module) is model.queue for t in reads)


class CountsInATensorAttribute(nn.Module):
    """A step counter kept as a plain tensor attribute, not a buffer, updated in place."""

    def __init__(self):
        super().__init__()
        self.layers = _layers()
        self.step = torch.zeros(())

    def forward(self, x):
        self.step += 1
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.step


def test_a_tensor_attribute_updated_in_place_is_refused_and_put_back():
    """Found trying the library: planning moved the counter by two and the planned module,
    whose graph held it as a constant, never again (outputs off from the first call)."""
    model = CountsInATensorAttribute()
    with pytest.raises(planner.PlanningError, match=r"updates tensor attributes in place \(step\)"):
        planner.plan(model, (torch.randn(8, 16),), budget_gb=1)
    assert model.step.item() == 0


class SetsData(nn.Module):
    """Assigns ``.data`` of a parameter or a buffer in forward (old-style clamping or EMA)."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self.layers = _layers()
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.what == "parameter":
            self.layers[0].weight.data = self.layers[0].weight.data.clamp(max=0.1)
        else:
            self.ema.data = 0.9 * self.ema.data + 0.1 * x.detach().mean(0)
        return x + self.ema


@pytest.mark.parametrize("what", ["parameter", "buffer"])
def test_assigning_data_in_forward_is_refused_not_dropped(what):
    """Found trying the library: a traced tensor took ``.data = ...`` as an attribute of its
    own, so the graph dropped the assignment (the parameter's: outputs off with no segment)."""
    model = SetsData(what)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(planner.PlanningError, match="cannot capture"):
        planner.plan(model, (torch.randn(8, 16),), budget_gb=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- torch's random state set in forward -----------------------------------------------------
# Tracing ran the call once, at planning; the graph records ops, so the planned module drew
# from wherever the generator stood: outputs 0.94 and gradients 17.6 off, with no segment.


class Reseeded(nn.Module):
    """Seeds in forward ("the same dropout masks at every call"), by one of ``how``."""

    def __init__(self, how: str, traceable: bool = True):
        super().__init__()
        self.layers, self.how, self.traceable = _layers(), how, traceable
        self.state = torch.get_rng_state()

    def forward(self, x):
        if not self.traceable:  # a loop over a size: symbolic_trace fails, export captures
            for _ in range(x.shape[0] // x.shape[0]):
                pass
        if self.how == "manual_seed":
            torch.manual_seed(1234)
        elif self.how == "set_rng_state":
            torch.set_rng_state(self.state)
        elif self.how == "fork_rng":  # fixed noise, the global generator left where it was
            with torch.random.fork_rng():
                torch.manual_seed(7)
                x = x + torch.randn_like(x)
        elif self.how == "cuda":
            torch.cuda.manual_seed_all(1234)
        for layer in self.layers:
            x = nn.functional.dropout(torch.tanh(layer(x)), 0.3, self.training)
        return x.sum()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Reseeded("manual_seed"), r"calls torch\.manual_seed, which sets torch's random"),
        (lambda: Reseeded("set_rng_state"), r"calls torch\.set_rng_state"),
        (lambda: Reseeded("fork_rng"), r"calls torch\.random\.fork_rng"),
        (lambda: Reseeded("cuda"), r"calls torch\.cuda\.manual_seed_all"),
        (lambda: Reseeded("manual_seed", traceable=False), r"calls torch\.manual_seed"),
    ],
    ids=["manual_seed", "set_rng_state", "fork_rng", "cuda", "manual_seed, export"],
)
def test_setting_the_random_state_in_forward_is_refused_and_leaves_it_as_it_was(make, match):
    torch.manual_seed(0)
    model, x = make(), torch.randn(8, 16)
    state = torch.get_rng_state()
    with pytest.raises(planner.PlanningError, match=match + ".*Seed outside forward"):
        planner.plan(model, (x,), budget_gb=1)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_model_with_dropout_and_a_generator_of_its_own_still_plans_exactly():
    """What the refusal advises; torch's own calls (export, fork_rng inside) are not refused."""

    class OwnNoise(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers, self.generator = _layers(), torch.Generator().manual_seed(7)

        def forward(self, x):
            for layer in self.layers:
                x = x + torch.randn(x.shape, generator=self.generator)
                x = nn.functional.dropout(torch.tanh(layer(x)), 0.3, self.training)
            return x.sum()

    torch.manual_seed(0)
    model = OwnNoise()
    reference, p = _planned_beside_a_copy(model)
    for step in range(2):
        x = torch.randn(8, 16)
        torch.manual_seed(step)
        expected = reference(x)
        torch.manual_seed(step)
        assert torch.equal(p.module(x), expected), f"step {step}"


class OwnStream(nn.Module):
    """Adds noise from a generator of its own, made in ``__init__`` (``how="own"``: what the
    refusals advise), or reseeded in forward to draw the same noise at every call
    (``"reseeded"``)."""

    def __init__(self, how: str, traceable: bool = True):
        super().__init__()
        self.layers, self.how, self.traceable = _layers(), how, traceable
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x):
        if not self.traceable:  # a loop over a size: symbolic_trace fails, export captures
            for _ in range(x.shape[0] // x.shape[0]):
                pass
        if self.how == "reseeded":
            self.generator.manual_seed(7)
        for layer in self.layers:
            x = torch.tanh(layer(x + torch.randn(x.shape, generator=self.generator)))
        return x.sum()


@pytest.mark.parametrize("traceable", [True, False], ids=["symbolic_trace", "export"])
def test_a_generator_of_its_own_seeded_in_forward_is_refused_and_left_as_it_was(traceable):
    """Found by trying: the seed ran once, at planning, and the planned module drew on from the
    generator planning left (outputs 2.1 apart from the second call), on both capture paths."""
    model, x = OwnStream("reseeded", traceable), torch.randn(8, 16)
    model.generator.manual_seed(3)
    state = model.generator.get_state()
    with pytest.raises(planner.PlanningError, match="it seeds generator, a generator of its own"):
        planner.plan(model, (x,), budget_gb=1)
    assert torch.equal(model.generator.get_state(), state)


NOISE = torch.Generator().manual_seed(5)  # a module-level generator a forward draws from


class DrawsFrom(nn.Module):
    """Adds noise drawn from a generator that exists before the call: a global or an argument."""

    def __init__(self):
        super().__init__()
        self.layers = _layers()

    def forward(self, x, generator=None):
        for layer in self.layers:
            noise = torch.randn(x.shape, generator=generator or NOISE)
            x = torch.tanh(layer(x + noise))
        return x.sum()


@pytest.mark.parametrize("passed", [False, True], ids=["a global", "an argument"])
def test_a_generator_made_outside_the_modules_plans_exactly(passed):
    torch.manual_seed(0)
    model, x, generator = DrawsFrom(), torch.randn(8, 16), torch.Generator().manual_seed(3)
    kwargs = {"generator": generator} if passed else {}
    p = planner.plan(model, (x,), example_kwargs=kwargs, budget_gb=1)
    drawn = generator if passed else NOISE
    state = drawn.get_state()
    expected = model(x, **kwargs)
    drawn.set_state(state)
    assert torch.equal(p.module(x, **kwargs), expected)


@pytest.mark.parametrize("traceable", [True, False], ids=["symbolic_trace", "export"])
def test_the_plan_draws_from_the_models_own_generator(traceable):
    """On both capture paths (torch.export lifts the generator into its graph), the plan draws
    the model's own stream, and reseeding the model's generator (between epochs) reseeds the
    plan's."""
    torch.manual_seed(0)
    model, x = OwnStream("own", traceable), torch.randn(8, 16)
    reference, p = _planned_beside_a_copy(model)
    for step in range(3):
        if step == 2:
            model.generator.manual_seed(11)
            reference.generator.manual_seed(11)
        assert torch.equal(p.module(x), reference(x)), f"step {step}"
        assert torch.equal(model.generator.get_state(), reference.generator.get_state())


# -- values collected in a module's containers -----------------------------------------------
# Planned, the model's list held tracing placeholders (fx Proxy objects): a loss built from them
# was a Proxy too, and its backward() did nothing, silently.


class Collecting(nn.Module):
    """Collects a value per layer on the module, as MoE balancing losses and deep supervision
    do, into ``where``: a list, a dict, a list in a dict, a deque, or a public list of names."""

    def __init__(self, where: str, traceable: bool = True):
        super().__init__()
        self.layers, self.where, self.traceable = _layers(), where, traceable
        self.aux: list = []
        self.stats: dict = {}
        self.nested: dict = {"losses": []}
        self._window = collections.deque(maxlen=8)
        self.seen: list = []

    def forward(self, x):
        if not self.traceable:  # a loop over a size: symbolic_trace fails, export captures
            for _ in range(x.shape[0] // x.shape[0]):
                pass
        self.aux.clear()
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            value = x.pow(2).mean()
            if self.where == "list":
                self.aux.append(value)
            elif self.where == "dict":
                self.stats[f"layer{i}"] = value
            elif self.where == "nested":
                self.nested["losses"].append(value)
            elif self.where == "deque":
                self._window.append(value)
            elif self.where == "names":
                self.seen.append(f"layer{i}")
        return x.sum()


@pytest.mark.parametrize(
    "where, attribute",
    [
        ("list", "aux"),
        ("dict", "stats"),
        ("nested", "nested"),
        ("deque", "_window"),
        ("names", "seen"),
    ],
)
@pytest.mark.parametrize("traceable", [True, False], ids=["symbolic_trace", "export"])
def test_values_put_into_a_modules_containers_are_refused_and_the_containers_put_back(
    where, attribute, traceable
):
    torch.manual_seed(0)
    model, x = Collecting(where, traceable), torch.randn(8, 16)
    model(x)  # a step before planning: the containers hold real values
    containers = (model.aux, model.stats, model.nested, model.nested["losses"], model._window)
    before = [_contents(c) for c in (*containers, model.seen)]
    with pytest.raises(
        planner.PlanningError,
        match=rf"puts values into containers held by module attributes or globals \({attribute}\).*"
        "Return such values from forward",
    ):
        planner.plan(model, (x,), budget_gb=1)
    now = (model.aux, model.stats, model.nested, model.nested["losses"], model._window)
    assert all(a is b for a, b in zip(now, containers))
    for old, new in zip(before, [_contents(c) for c in (*containers, model.seen)]):
        assert len(old) == len(new) and all(a is b for a, b in zip(old, new))


AUXILIARY_LOSSES: list = []  # filled by forward, as some MoE codebases collect them
_PER_LAYER: list = []


def _collect(value) -> None:
    """A helper beside the model, called by its forward, that fills a global list."""
    _PER_LAYER.append(value)


class CollectingGlobally(nn.Module):
    def __init__(self, through_helper: bool, traceable: bool):
        super().__init__()
        self.layers, self.through_helper, self.traceable = _layers(), through_helper, traceable

    def forward(self, x):
        if not self.traceable:  # a loop over a size: symbolic_trace fails, export captures
            for _ in range(x.shape[0] // x.shape[0]):
                pass
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if self.through_helper:
                _collect(x.pow(2).mean())
            else:
                AUXILIARY_LOSSES.append(x.pow(2).mean())
        return x.sum()


@pytest.mark.parametrize(
    "through_helper, name",
    [(False, "AUXILIARY_LOSSES"), (True, "_PER_LAYER")],
    ids=["in forward", "by a helper"],
)
@pytest.mark.parametrize("traceable", [True, False], ids=["symbolic_trace", "export"])
def test_values_put_into_a_global_list_are_refused_and_the_list_put_back(
    through_helper, name, traceable
):
    """Found by trying: planned, the list held a tracing placeholder, and the planned module
    never filled it again, so the loss silently lost its auxiliary terms."""
    torch.manual_seed(0)
    model, x = CollectingGlobally(through_helper, traceable), torch.randn(8, 16)
    collected = AUXILIARY_LOSSES if name == "AUXILIARY_LOSSES" else _PER_LAYER
    collected[:] = ["from the step before"]
    with pytest.raises(
        planner.PlanningError,
        match=rf"containers held by module attributes or globals \(.*{name}\)",
    ):
        planner.plan(model, (x,), budget_gb=1)
    assert collected == ["from the step before"]
    collected.clear()


WARNED: set = set()  # a warn-once registry
MASKS: dict = {}  # a memo of causal masks by length


class RegistersAndMemoises(nn.Module):
    """Fills module-level containers with what no gradient flows through: a registry of the
    warnings given and a memo of masks computed from sizes."""

    def __init__(self):
        super().__init__()
        self.layers = _layers()

    def forward(self, x):
        WARNED.add("slow path")
        n = x.shape[-1]
        if n not in MASKS:
            MASKS[n] = torch.tril(torch.ones(n, n))
        for layer in self.layers:
            x = torch.tanh(layer(x) @ MASKS[n])
        return x.sum()


def test_a_global_registry_or_memo_is_put_back_not_refused():
    """Found in review: every change to a public global container was refused; only values a
    gradient flows through are carried out through one."""
    torch.manual_seed(0)
    model, x = RegistersAndMemoises(), torch.randn(8, 16)
    p = planner.plan(model, (x,), budget_gb=1)
    assert not WARNED and not MASKS  # as planning found them
    assert torch.equal(p.module(x), model(x))


def _contents(container) -> list:
    """What a container holds (keys and values, for a dict), to compare by identity."""
    if isinstance(container, dict):
        return [x for pair in container.items() for x in pair]
    return list(container)


class _MemoisedTable(nn.Module):
    """A sinusoidal table memoised by sequence length in a private dict, as positional and
    rotary encodings often are: a cache, which the graph computes anew, exactly."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.width, self._tables = width, {}

    def forward(self, x):
        n = x.shape[1]
        if n not in self._tables:
            position = torch.arange(n, dtype=torch.float32)[:, None]
            frequency = torch.exp(torch.arange(0, self.width, 2, dtype=torch.float32) * -0.5)
            angle = position * frequency
            self._tables[n] = torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)
        return x + self._tables[n]


@pytest.mark.parametrize("warm", [True, False], ids=["warm cache", "cold cache"])
def test_a_private_cache_of_values_no_gradient_flows_through_is_put_back_not_refused(warm):
    """Found in review: every tensor put into any container was refused, a memoised table
    too; only values a gradient flows through (an auxiliary loss) are."""
    model = nn.Sequential(_MemoisedTable(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    x = torch.randn(2, 10, 16)
    if warm:
        model(x)
    cache = dict(model[0]._tables)
    p = planner.plan(model, (x,), budget_gb=1)
    assert model[0]._tables == cache  # as planning found it
    assert torch.equal(p.module(x), model(x))


class _CompressedBlock(nn.Module):
    """A block that stores its own activations in float16, by saved-tensor hooks entered in
    its forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        pack, unpack = (lambda t: t.half()), (lambda t: t.float())
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return x + self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("kept_whole", [False, True], ids=["traced through", "a leaf module"])
def test_saved_tensor_hooks_entered_in_forward_are_refused(kept_whole):
    """Traced through, the hooks vanished from the graph: 26 gradients differed, silently.
    Kept whole, they took the place of the profile's and checkpoint's own: plans measured up
    to 46% over their budgets (found trying the library)."""
    model = nn.Sequential(_CompressedBlock(), nn.ReLU(), _CompressedBlock())
    leaves = (_CompressedBlock,) if kept_whole else ()
    with pytest.raises(
        planner.PlanningError, match=r"enters saved-tensor hooks.*around the training step"
    ):
        planner.plan(model, (torch.randn(8, 32),), budget_gb=1, leaf_modules=leaves)


def test_torchs_offload_wrapper_in_forward_is_refused_too():
    """``offload_wrapper`` enters ``save_on_cpu`` from torch's own code: kept whole, its
    hooks took the place of the profile's (found by review: 20% under the measured peak)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        OffloadWrapper,
        offload_wrapper,
    )

    class Block(nn.Module):  # the user's: watched (torch's own modules enter no hooks)
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(32, 32)

        def forward(self, x):
            return torch.tanh(self.linear(x))

    model = nn.Sequential(offload_wrapper(Block()), nn.ReLU(), nn.Linear(32, 32))
    with pytest.raises(planner.PlanningError, match=r"enters saved-tensor hooks \(save_on_cpu:"):
        planner.plan(model, (torch.randn(8, 32),), budget_gb=1, leaf_modules=(OffloadWrapper,))
