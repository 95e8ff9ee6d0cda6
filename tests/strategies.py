"""Hypothesis strategies that generate small random models for the equivalence suite.

A generated model is described by a :class:`ModelSpec` (plain data, so hypothesis can shrink it
and print it) and built by :func:`build`. ``GeneratedModel.forward`` interprets the spec's list of
operations, so ``torch.fx.symbolic_trace`` unrolls it into a straight graph; with
``untraceable=True`` the forward starts with a Python ``if`` on a tensor size, which
``symbolic_trace`` rejects and ``torch.export`` (static shapes) accepts, sending capture down its
fallback path.

What the generator covers: chains; residual adds (``push`` ... ``add``); branches joined by a
concatenation; several outputs (tuple and dict); Linear or Conv2d layers; LayerNorm/GroupNorm;
BatchNorm (running statistics); Dropout; GELU, tanh, ReLU and in-place ReLU; a module applied
twice and two modules tied to one weight; frozen (``requires_grad=False``) leading layers; a
keyword tensor input; non-tensor arguments (a float scale and a bool flag); inputs with or without
``requires_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import nn

from planner.simulate import Choice, recompute_stop

# Operations, each a tuple whose first item names it:
#   ("layer", inplace_relu)  the next Linear/Conv2d, optionally followed by nn.ReLU(inplace=True)
#   ("norm", "ln" | "bn")    LayerNorm (GroupNorm for images) or BatchNorm
#   ("act", name)            "gelu", "tanh", "relu" (functional, out of place)
#   ("dropout", p)           nn.Dropout(p)
#   ("push",) / ("add",)     remember h / add the last remembered value (a residual connection)
#   ("branch",)              proj(cat([a(h), gelu(b(h))], dim=1)): two branches and a concat
#   ("reuse",)               apply the first layer again (one module, two call sites)
#   ("scale",)               h * scale        (non-tensor float argument)
#   ("flag",)                h + 1 if flag    (non-tensor bool argument)
#   ("extra",)               h + y            (keyword tensor argument)
#   ("mark",)                remember h as the auxiliary output
OPS = (
    "layer",
    "norm",
    "act",
    "dropout",
    "push",
    "add",
    "branch",
    "reuse",
    "scale",
    "flag",
    "extra",
    "mark",
)


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "dense": (batch, width) inputs and Linear; "conv": (batch, width, s, s), Conv2d
    width: int
    batch: int
    spatial: int
    ops: tuple
    frozen: int  # leading layers with requires_grad=False
    tie: bool  # the last layer shares the first layer's weight (two modules, one Parameter)
    output: str  # "tensor" | "tuple" | "dict"
    extra_input: bool  # pass y= as a keyword tensor
    scale: float | None  # pass scale= (non-tensor), or leave the default
    flag: bool  # value of the flag= argument
    untraceable: bool  # force capture through torch.export
    input_requires_grad: bool
    seed: int


def plain_spec(ops, **fields) -> ModelSpec:
    """A fixed dense :class:`ModelSpec` of ``ops`` (width 8, batch 4, one plain tensor input
    and output, nothing frozen or tied); ``fields`` override the rest."""
    plain = dict(
        kind="dense",
        width=8,
        batch=4,
        spatial=3,
        frozen=0,
        tie=False,
        output="tensor",
        extra_input=False,
        scale=None,
        flag=False,
        untraceable=False,
        input_requires_grad=False,
        seed=0,
    )
    return ModelSpec(ops=tuple(ops), **{**plain, **fields})


class GeneratedModel(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.ops = spec.ops
        w, dense = spec.width, spec.kind == "dense"

        def layer(c_in=w, c_out=w):
            return nn.Linear(c_in, c_out) if dense else nn.Conv2d(c_in, c_out, 3, padding=1)

        self.layers = nn.ModuleList()
        self.norms = nn.ModuleList()
        self.branches = nn.ModuleList()
        self.relus = nn.ModuleList()
        self.drops = nn.ModuleList()
        for op in spec.ops:
            if op[0] == "layer":
                self.layers.append(layer())
                if op[1]:
                    self.relus.append(nn.ReLU(inplace=True))
            elif op[0] == "norm":
                if op[1] == "bn":
                    self.norms.append(nn.BatchNorm1d(w) if dense else nn.BatchNorm2d(w))
                else:
                    self.norms.append(nn.LayerNorm(w) if dense else nn.GroupNorm(2, w))
            elif op[0] == "branch":
                self.branches.append(nn.ModuleList([layer(), layer(), layer(2 * w, w)]))
            elif op[0] == "dropout":
                self.drops.append(nn.Dropout(op[1]))
        if not self.layers:
            self.layers.append(layer())  # "reuse" and "tie" need one
        self.head = layer()
        if spec.tie:
            self.head.weight = self.layers[0].weight
        frozen = [*self.layers, self.head][: spec.frozen]
        for module in frozen:
            module.requires_grad_(False)
        if not any(p.requires_grad for p in self.parameters()):
            self.head.bias.requires_grad_(True)

    def forward(self, x, y=None, scale: float = 1.0, flag: bool = False):
        if self.spec.untraceable and x.size(0) > 0:  # a Python bool of a size: fx cannot trace
            x = x * 1.0
        h = x
        stack, aux = [], None
        n_layer = n_norm = n_branch = n_relu = n_drop = 0
        for op in self.ops:
            name = op[0]
            if name == "layer":
                h = self.layers[n_layer](h)
                n_layer += 1
                if op[1]:
                    h = self.relus[n_relu](h)
                    n_relu += 1
            elif name == "norm":
                h = self.norms[n_norm](h)
                n_norm += 1
            elif name == "act":
                h = {"gelu": nn.functional.gelu, "tanh": torch.tanh, "relu": torch.relu}[op[1]](h)
            elif name == "dropout":
                h = self.drops[n_drop](h)
                n_drop += 1
            elif name == "push":
                stack.append(h)
            elif name == "add":
                if stack:
                    h = h + stack.pop()
            elif name == "branch":
                a, b, proj = self.branches[n_branch]
                n_branch += 1
                h = proj(torch.cat([a(h), nn.functional.gelu(b(h))], dim=1))
            elif name == "reuse":
                h = self.layers[0](h)
            elif name == "scale":
                h = h * scale
            elif name == "flag":
                if flag:
                    h = h + 1.0
            elif name == "extra":
                if y is not None:
                    h = h + y
            elif name == "mark":
                aux = h
        out = self.head(h)
        if self.spec.output == "tensor":
            return out
        aux = aux if aux is not None else h
        if self.spec.output == "tuple":
            return out, aux
        return {"out": out, "aux": aux}


def inputs(spec: ModelSpec) -> tuple[tuple, dict]:
    """(args, kwargs) for a call of the model built from ``spec``; deterministic in its seed."""
    generator = torch.Generator().manual_seed(spec.seed + 1)
    shape = (spec.batch, spec.width) + ((spec.spatial,) * 2 if spec.kind == "conv" else ())
    x = torch.randn(shape, generator=generator).requires_grad_(spec.input_requires_grad)
    kwargs = {"flag": spec.flag}
    if spec.extra_input:
        kwargs["y"] = torch.randn(shape, generator=generator)
    if spec.scale is not None:
        kwargs["scale"] = spec.scale
    return (x,), kwargs


def build(spec: ModelSpec) -> GeneratedModel:
    torch.manual_seed(spec.seed)
    return GeneratedModel(spec).train()


_op = st.one_of(
    st.tuples(st.just("layer"), st.booleans()),
    st.tuples(st.just("norm"), st.sampled_from(["ln", "bn"])),
    st.tuples(st.just("act"), st.sampled_from(["gelu", "tanh", "relu"])),
    st.tuples(st.just("dropout"), st.sampled_from([0.1, 0.5])),
    st.sampled_from(
        [("push",), ("add",), ("branch",), ("reuse",), ("scale",), ("flag",), ("extra",), ("mark",)]
    ),
)


@st.composite
def model_specs(
    draw,
    *,
    untraceable: bool | None = False,
    max_ops: int = 10,
    kinds: tuple[str, ...] = ("dense", "conv"),
) -> ModelSpec:
    """A random :class:`ModelSpec`; ``untraceable=None`` draws it too."""
    kind = draw(st.sampled_from(kinds))
    ops = tuple(draw(st.lists(_op, min_size=1, max_size=max_ops)))
    n_layers = max(1, sum(op[0] == "layer" for op in ops)) + 1  # + head
    return ModelSpec(
        kind=kind,
        width=draw(st.sampled_from([4, 6, 8] if kind == "dense" else [2, 4])),
        batch=draw(st.integers(2, 4)),
        spatial=draw(st.integers(3, 5)),
        ops=ops,
        frozen=draw(st.integers(0, n_layers)),
        tie=draw(st.booleans()),
        output=draw(st.sampled_from(["tensor", "tuple", "dict"])),
        extra_input=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.sampled_from([0.5, 2.0, -1.5]))),
        flag=draw(st.booleans()),
        untraceable=draw(st.booleans()) if untraceable is None else untraceable,
        input_requires_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def random_segments(draw, problem) -> tuple[tuple[int, int], ...]:
    """Random disjoint valid segments of ``problem``: random allowed cuts, a random subset of the
    valid intervals between them. The strongest test of the rewrite, independent of solvers."""
    n = problem.size
    allowed = [c for c in range(1, n) if problem.cut_allowed[c]]
    cuts = draw(st.lists(st.sampled_from(allowed), unique=True)) if allowed else []
    bounds = sorted({0, n, *cuts})
    valid = [(a, b) for a, b in zip(bounds, bounds[1:]) if problem.is_valid_segment(a, b)]
    keep = draw(st.lists(st.booleans(), min_size=len(valid), max_size=len(valid)))
    return tuple(segment for segment, k in zip(valid, keep) if k)


@st.composite
def random_choices(draw, problem) -> Choice:
    """Random segments (``random_segments``, or every valid interval between random allowed
    cuts) with a random subset of the nodes each may keep: keepable nodes its recompute runs
    (``recompute_stop``), minus kept random nodes that come before a recomputed random one
    (``validate_choice``'s rules)."""
    if draw(st.booleans()):
        segments = draw(random_segments(problem))
    else:
        allowed = [c for c in range(1, problem.size) if problem.cut_allowed[c]]
        cuts = [c for c in allowed if draw(st.integers(0, 3)) == 0]
        bounds = sorted({0, problem.size, *cuts})
        segments = tuple(
            (a, b) for a, b in zip(bounds, bounds[1:]) if problem.is_valid_segment(a, b)
        )
    keep = set()
    for start, stop in segments:
        runs_to = recompute_stop(problem, start, stop)
        candidates = [k for k in range(start, runs_to) if problem.keepable[k]]
        chosen = {k for k in candidates if draw(st.booleans())}
        recomputed_random = [
            k for k in range(start, runs_to) if problem.random[k] and k not in chosen
        ]
        if recomputed_random:
            chosen -= {k for k in chosen if problem.random[k] and k < recomputed_random[-1]}
        keep |= chosen
    return Choice(segments, frozenset(keep))


# --------------------------------------------------------------------------------------------
# Checks shared by the equivalence tests: one training step of the untouched reference and of
# the planned module, compared exactly.
# --------------------------------------------------------------------------------------------

import copy  # noqa: E402

from torch.utils._pytree import tree_flatten, tree_map_only  # noqa: E402

from planner.step import training_loss  # noqa: E402

EXACT = dict(rtol=0, atol=0)


def fresh(tree):
    """Leaf copies of every tensor in ``tree`` (keeping requires_grad), so runs do not share
    ``.grad`` accumulation."""
    return tree_map_only(
        torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), tree
    )


def model_state(model: nn.Module) -> dict:
    """Everything about ``model`` that planning must not change."""
    return {
        "parameters": [
            (
                name,
                id(p),
                p.requires_grad,
                p.detach().clone(),
                None if p.grad is None else p.grad.clone(),
            )
            for name, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [(name, id(b), b.clone()) for name, b in model.named_buffers()],
        "training": [(name, m.training) for name, m in model.named_modules()],
        "hooks": [
            (
                name,
                {
                    k: len(v)
                    for k, v in vars(m).items()
                    if k.endswith("hooks") and v is not None and hasattr(v, "__len__")
                },
            )
            for name, m in model.named_modules()
        ],
        "modules": [(name, id(m), type(m)) for name, m in model.named_modules()],
    }


def assert_same_state(before: dict, after: dict) -> None:
    assert [p[:3] for p in before["parameters"]] == [p[:3] for p in after["parameters"]]
    for (name, *_, value, grad), (_, *_, value2, grad2) in zip(
        before["parameters"], after["parameters"]
    ):
        torch.testing.assert_close(value2, value, **EXACT, msg=lambda m: f"{name}: {m}")
        assert (grad is None) == (grad2 is None), f"{name}.grad changed"
        if grad is not None:
            torch.testing.assert_close(grad2, grad, **EXACT)
    assert [b[:2] for b in before["buffers"]] == [b[:2] for b in after["buffers"]]
    for (name, _, value), (_, _, value2) in zip(before["buffers"], after["buffers"]):
        torch.testing.assert_close(value2, value, **EXACT, msg=lambda m: f"{name}: {m}")
    for key in ("training", "hooks", "modules"):
        assert before[key] == after[key], f"{key} changed"


def _assert_same_tree(expected, actual, what: str) -> None:
    leaves, spec = tree_flatten(expected)
    leaves2, spec2 = tree_flatten(actual)
    assert type(actual) is type(expected), f"{what}: {type(actual)} instead of {type(expected)}"
    assert spec == spec2, f"{what}: structure {spec2} instead of {spec}"
    for k, (a, b) in enumerate(zip(leaves, leaves2)):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(b, a, **EXACT, msg=lambda m: f"{what}[{k}]: {m}")
            assert a.requires_grad == b.requires_grad, f"{what}[{k}] requires_grad"
        else:
            assert a == b, f"{what}[{k}]"


def _step(module, params, args, kwargs, seed: int, use_autograd_grad: bool, loss_fn=None):
    args, kwargs = fresh(args), fresh(kwargs)
    inputs = [
        t
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    out = module(*args, **kwargs)
    loss = training_loss(out) if loss_fn is None else loss_fn(out)
    trainable = [p for p in params if p.requires_grad]
    if use_autograd_grad:
        grads = list(torch.autograd.grad(loss, trainable + inputs, allow_unused=True))
    else:
        loss.backward()
        grads = [p.grad for p in params] + [t.grad for t in inputs]
    return out, loss, grads, torch.get_rng_state()


def assert_equivalent(
    reference: nn.Module,
    model: nn.Module,
    planned,
    args,
    kwargs,
    *,
    seed: int = 0,
    check_output_type: bool = True,
    loss_fn=None,
) -> None:
    """One step of ``planned`` (sharing ``model``'s parameters) equals one of ``reference`` (an
    untouched deep copy of ``model``): outputs, loss, every parameter and input gradient, the
    RNG state after the step (so every dropout mask drew the same numbers), and every buffer
    (BatchNorm running statistics and ``num_batches_tracked``: updated once, not twice); by
    ``backward()`` and by ``torch.autograd.grad``; then ``state_dict`` both ways. The loss is
    ``loss_fn(output)``, by default ``planner.step.training_loss``."""
    names = [n for n, _ in reference.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    ref_params = [p for _, p in reference.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    for step, use_grad in enumerate((False, True)):
        expected = _step(reference, ref_params, args, kwargs, seed + step, use_grad, loss_fn)
        actual = _step(planned, params, args, kwargs, seed + step, use_grad, loss_fn)
        how = "autograd.grad" if use_grad else "backward"
        if check_output_type:
            _assert_same_tree(expected[0], actual[0], f"output ({how})")
        else:
            _assert_same_tree(tree_flatten(expected[0])[0], tree_flatten(actual[0])[0], "output")
        torch.testing.assert_close(actual[1], expected[1], **EXACT)
        assert len(expected[2]) == len(actual[2])
        labels = names + [f"input {k}" for k in range(len(expected[2]) - len(names))]
        if use_grad:
            labels = [n for n, p in zip(names, ref_params) if p.requires_grad] + labels[
                len(names) :
            ]
        for label, a, b in zip(labels, expected[2], actual[2]):
            assert (a is None) == (b is None), f"{how}: gradient of {label}: {a} vs {b}"
            if a is not None:
                torch.testing.assert_close(b, a, **EXACT, msg=lambda m: f"{how} {label}: {m}")
        assert torch.equal(actual[3], expected[3]), f"{how}: RNG state after the step differs"
        for (name, a), (_, b) in zip(reference.named_buffers(), model.named_buffers()):
            torch.testing.assert_close(b, a, **EXACT, msg=lambda m: f"{how} buffer {name}: {m}")
    # state_dict: same keys and values; each loads into the other.
    sd, ref_sd = planned.state_dict(), reference.state_dict()
    assert list(sd) == list(ref_sd)
    for key in sd:
        torch.testing.assert_close(sd[key], ref_sd[key], **EXACT)
    copy.deepcopy(reference).load_state_dict(sd, strict=True)
    planned.load_state_dict(ref_sd, strict=True)


# --------------------------------------------------------------------------------------------
# Models whose forward switches modes and updates buffers: grad-mode and autocast regions placed
# at random (nested or not), and registered buffers updated in forward in every common way.
# --------------------------------------------------------------------------------------------

# Items of a RegionSpec's body, each a tuple whose first item names it:
#   ("layer",)              the next Linear, then tanh
#   ("region", kind, body)  ``with <kind>:`` around a nested body; kind one of REGIONS
#   ("buffer", form)        update the next buffer by ``form`` (one of BUFFER_UPDATES), then
#                           h = h + buffer (so a stale or doubled update changes the output)
REGIONS = ("no_grad", "set_grad_enabled(False)", "enable_grad", "autocast", "autocast(off)")
BUFFER_UPDATES = ("+= 1", "add_", "assign", "running", "copy_")


@dataclass(frozen=True)
class RegionSpec:
    width: int
    batch: int
    body: tuple
    untraceable: bool  # force capture through torch.export
    seed: int


def _count(body: tuple, name: str) -> int:
    return sum(
        (item[0] == name) + (_count(item[2], name) if item[0] == "region" else 0) for item in body
    )


class RegionModel(nn.Module):
    def __init__(self, spec: RegionSpec):
        super().__init__()
        self.spec = spec
        w = spec.width
        self.layers = nn.ModuleList(nn.Linear(w, w) for _ in range(_count(spec.body, "layer")))
        for k in range(_count(spec.body, "buffer")):
            self.register_buffer(f"state{k}", torch.full((w,), 0.5))
        self.head = nn.Linear(w, w)

    def forward(self, x):
        if self.spec.untraceable and x.size(0) > 0:  # a Python bool of a size: fx cannot trace
            x = x * 1.0
        self.n_layer = self.n_buffer = 0
        return self.head(self._run(self.spec.body, x))

    def _run(self, body, h):
        for item in body:
            if item[0] == "layer":
                h = torch.tanh(self.layers[self.n_layer](h))
                self.n_layer += 1
            elif item[0] == "buffer":
                h = self._update(item[1], f"state{self.n_buffer}", h)
                self.n_buffer += 1
            else:
                with _region(item[1]):
                    if item[1] == "autocast(off)":
                        h = h.float()  # full precision inside, where weights are no longer cast
                    h = self._run(item[2], h)
                h = h.float()  # back from an autocast dtype
        return h

    def _update(self, form: str, name: str, h):
        if form == "+= 1":
            buffer = getattr(self, name)
            buffer += 1
            setattr(self, name, buffer)
        elif form == "add_":
            getattr(self, name).add_(1)
        elif form == "assign":
            setattr(self, name, getattr(self, name) * 2)
        elif form == "running":  # a running mean, as BatchNorm keeps one
            getattr(self, name).mul_(0.5).add_(h.detach().mean(0) * 0.5)
        else:
            getattr(self, name).copy_(h.detach().mean(0))
        return h + getattr(self, name)


def _region(kind: str):
    return {
        "no_grad": torch.no_grad,
        "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False),
        "enable_grad": torch.enable_grad,
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        "autocast(off)": lambda: torch.autocast("cpu", enabled=False),
    }[kind]()


def region_inputs(spec: RegionSpec) -> tuple[tuple, dict]:
    generator = torch.Generator().manual_seed(spec.seed + 1)
    return (torch.randn(spec.batch, spec.width, generator=generator),), {}


def build_region_model(spec: RegionSpec) -> RegionModel:
    torch.manual_seed(spec.seed)
    return RegionModel(spec).train()


def _bodies(leaf):
    return st.recursive(
        st.lists(leaf, min_size=1, max_size=4).map(tuple),
        lambda inner: st.lists(
            st.one_of(leaf, st.tuples(st.just("region"), st.sampled_from(REGIONS), inner)),
            min_size=1,
            max_size=4,
        ).map(tuple),
        max_leaves=8,
    )


@st.composite
def region_specs(draw, *, buffers: bool = True, untraceable: bool | None = False) -> RegionSpec:
    """A random :class:`RegionSpec`: layers, regions and (when ``buffers``) buffer updates."""
    leaf = st.just(("layer",))
    if buffers:
        leaf = st.one_of(leaf, st.tuples(st.just("buffer"), st.sampled_from(BUFFER_UPDATES)))
    return RegionSpec(
        width=draw(st.sampled_from([4, 8])),
        batch=draw(st.integers(2, 4)),
        body=draw(_bodies(leaf)),
        untraceable=draw(st.booleans()) if untraceable is None else untraceable,
        seed=draw(st.integers(0, 2**16)),
    )
