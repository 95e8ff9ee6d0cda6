"""Profile: one forward pass on fake tensors that records, per node, what memory it creates and
what autograd saves for backward, plus FLOPs and bytes moved. No real activation memory is used.

Storages are the unit of memory: two tensors that share a storage (views) cost it once. Every
storage is given a small integer key. Storages of parameters, buffers, model inputs and constants
are *fixed*: they are live for the whole step whatever the plan does.

Keys written into ``node.meta`` (the one place they are documented):

``planner.created``
    ``{storage: nbytes}`` of the storages this node creates and that outlive it: new outputs and
    tensors saved for backward (e.g. a dropout mask).
``planner.reads``
    storages that existed before this node and that its ops read (parameters included).
``planner.saved``
    storages autograd saved for backward while this node ran (fixed storages excluded).
``planner.writes``
    storages this node mutates in place.
``planner.workspace``
    bytes of temporaries created and dropped inside the node (an upper bound on its transient).
``planner.flops``, ``planner.bytes_moved``
    FLOPs (``torch.utils.flop_counter`` formulas) and bytes read plus written by its ATen ops.
``planner.requires_grad``
    whether any of its outputs requires grad (then backward allocates a gradient for it).
``planner.tensor_output``
    whether it returns any tensor (``x.size(1)`` does not: it holds no memory).
``planner.backward_high``, ``planner.backward_net``
    measured in the fake backward that follows the forward: the most bytes the node's backward
    has allocated at once (input and parameter gradients, temporaries), and what of it is still
    live when the node's backward ends (gradients waiting for their consumers, ``.grad``).
"""

from __future__ import annotations

import copy
import inspect
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import flop_registry

from planner.errors import PlanningError
from planner.measure import training_loss

META_KEYS = (
    "planner.created",
    "planner.reads",
    "planner.saved",
    "planner.writes",
    "planner.workspace",
    "planner.flops",
    "planner.bytes_moved",
    "planner.requires_grad",
    "planner.tensor_output",
    "planner.backward_high",
    "planner.backward_net",
)
COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Profile:
    """What the forward pass showed beyond the per-node annotations."""

    storage_bytes: dict[int, int]
    fixed_kind: dict[int, str]  # storage -> "parameter" | "buffer" | "input" | "constant"
    trainable: frozenset[int]  # parameter storages that require grad (backward makes a grad)
    output_storages: frozenset[int]  # storages reachable from the graph's output
    seconds: float = 0.0

    def fixed_bytes(self, kind: str) -> int:
        return sum(self.storage_bytes[s] for s, k in self.fixed_kind.items() if k == kind)

    @property
    def gradient_bytes(self) -> int:
        return sum(self.storage_bytes[s] for s in self.trainable)


def require_meta(node: fx.Node, key: str):
    """``node.meta[key]``, or an error saying which pass should have written it."""
    try:
        return node.meta[key]
    except KeyError:
        raise PlanningError(
            f"{node.format_node()} has no {key!r}: run planner.profile.profile() first"
        ) from None


@dataclass
class _Storages:
    """Gives each storage seen a stable key (strong references prevent address reuse)."""

    keys: dict[int, int] = field(default_factory=dict)  # storage _cdata -> key
    nbytes: dict[int, int] = field(default_factory=dict)
    alive: list = field(default_factory=list)

    def key(self, tensor: torch.Tensor) -> int | None:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        cdata = storage._cdata
        if cdata not in self.keys:
            self.keys[cdata] = len(self.keys)
            self.nbytes[self.keys[cdata]] = storage.nbytes()
            self.alive.append(storage)
        return self.keys[cdata]


class _CostMode(TorchDispatchMode):
    """Counts FLOPs and bytes moved of every ATen op, and which storages each op creates."""

    def __init__(self, storages: _Storages):
        super().__init__()
        self.storages = storages
        self.reset()

    def reset(self):
        self.flops = 0
        self.bytes_moved = 0
        self.new: set[int] = set()
        self.reads: set[int] = set()
        self.writes: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.reads.update(self.storages.key(t) for t in inputs)
        before = len(self.storages.keys)
        out = func(*args, **kwargs)
        schema = func._schema
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[position] if position < len(args) else kwargs.get(argument.name)
                for t in tree_flatten(value)[0]:
                    key = self.storages.key(t)
                    if key is not None:
                        self.writes.add(key)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outputs:
            key = self.storages.key(t)
            if key is not None and key >= before:
                self.new.add(key)
        packet = func.overloadpacket
        if packet in flop_registry:
            self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
        aliasing = any(r.alias_info is not None for r in schema.returns)
        if not aliasing:
            self.bytes_moved += sum(t.numel() * t.element_size() for t in inputs + outputs)
        return out


class _BackwardMemory(TorchDispatchMode):
    """Attributes the memory that backward allocates to the node whose backward is running.

    A pre-hook on each node's output ``grad_fn`` marks where that node's backward starts;
    storages created from then on (gradients, temporaries) count against it, and finalizers
    tell when they are freed. Storages alive since the forward are not counted here: the
    simulator decides their fate, which depends on the plan.
    """

    def __init__(self, forward_storages: _Storages, nodes: list[fx.Node]):
        super().__init__()
        self.forward = forward_storages
        self.nodes = nodes
        self.live = 0
        self.current: fx.Node | None = None
        self.start = 0
        self.tracked: dict[int, int] = {}

    def enter(self, node: fx.Node) -> None:
        self._close()
        self.current, self.start = node, self.live
        node.meta.setdefault("planner.backward_high", 0)
        node.meta.setdefault("planner.backward_net", 0)

    def _close(self) -> None:
        if self.current is not None:
            self.current.meta["planner.backward_net"] += self.live - self.start

    def finish(self) -> None:
        self._close()
        for node in self.nodes:
            node.meta.setdefault("planner.backward_high", 0)
            node.meta.setdefault("planner.backward_net", 0)

    def _free(self, cdata: int) -> None:
        self.live -= self.tracked.pop(cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            cdata = storage._cdata
            if cdata in self.forward.keys or cdata in self.tracked:
                continue
            self.tracked[cdata] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, cdata)
        if self.current is not None:
            high = self.live - self.start
            if high > self.current.meta["planner.backward_high"]:
                self.current.meta["planner.backward_high"] = high
        return out


class _Recorder(fx.Interpreter):
    """Runs the graph node by node, annotating each compute node."""

    def __init__(
        self, module: fx.GraphModule, storages: _Storages, cost: _CostMode, fakes: _Fakes
    ):
        super().__init__(module, garbage_collect_values=True)
        self.extra_traceback = False  # our error names the node; fx's would repeat the graph
        self.fakes = fakes
        self.storages = storages
        self.cost = cost
        self.saved_by_current: set[int] = set()
        nodes = [n for n in module.graph.nodes if n.op in COMPUTE_OPS]
        self.backward = _BackwardMemory(storages, nodes)

    def fetch_attr(self, target: str):
        return self.fakes(super().fetch_attr(target))

    def pack(self, tensor):
        key = self.storages.key(tensor)
        if key is not None:
            self.saved_by_current.add(key)
        return tensor

    def run_node(self, node: fx.Node):
        if node.op not in COMPUTE_OPS:
            return super().run_node(node)
        self.cost.reset()
        self.saved_by_current = set()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            try:
                out = super().run_node(node)
            except Exception as error:
                raise PlanningError(
                    f"the model's forward failed on the example inputs at node {node.name!r} "
                    f"({node.op} {node.target}): {type(error).__name__}: {error}. Check the "
                    "example inputs' shapes and dtypes against what the model expects."
                ) from error
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        out_keys = {self.storages.key(t) for t in tensors} - {None}
        kept = (self.cost.new & out_keys) | (self.cost.new & self.saved_by_current)
        nbytes = self.storages.nbytes
        node.meta["planner.created"] = {k: nbytes[k] for k in sorted(kept)}
        node.meta["planner.reads"] = frozenset(self.cost.reads - self.cost.new - {None})
        node.meta["planner.saved"] = frozenset(self.saved_by_current)
        node.meta["planner.writes"] = frozenset(self.cost.writes)
        node.meta["planner.workspace"] = sum(nbytes[k] for k in self.cost.new - kept)
        node.meta["planner.flops"] = self.cost.flops
        node.meta["planner.bytes_moved"] = self.cost.bytes_moved
        node.meta["planner.requires_grad"] = any(t.requires_grad for t in tensors)
        node.meta["planner.tensor_output"] = bool(tensors)
        for grad_fn in {t.grad_fn for t in tensors if t.grad_fn is not None}:
            grad_fn.register_prehook(lambda grads, node=node: self.backward.enter(node))
        return out


def placeholder_values(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values of ``gm``'s placeholders for a call ``gm(*args, **kwargs)``."""
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = []
    for name, value in bound.arguments.items():
        kind = inspect.signature(gm.forward).parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            values.extend(value)
        elif kind == inspect.Parameter.VAR_KEYWORD:
            values.extend(value.values())
        else:
            values.append(value)
    return values


class _Fakes:
    """Fake stand-ins for the captured module's tensors and modules, made on first use.

    Modules are copied structurally (a shallow copy whose parameters, buffers and children are
    replaced), which is much cheaper than a deep copy of the whole GraphModule and leaves the
    user's objects untouched.
    """

    def __init__(self, mode: FakeTensorMode):
        self.mode = mode
        self.memo: dict[int, object] = {}

    def __call__(self, value):
        key = id(value)
        if key not in self.memo:
            self.memo[key] = self._make(value)
        return self.memo[key]

    def _make(self, value):
        if isinstance(value, nn.Parameter):
            fake = self.mode.from_tensor(value, static_shapes=True)
            return nn.Parameter(fake, requires_grad=value.requires_grad)
        if isinstance(value, torch.Tensor):
            return self.mode.from_tensor(value, static_shapes=True)
        if isinstance(value, nn.Module):
            module = copy.copy(value)
            for table in ("_parameters", "_buffers", "_modules"):
                entries = getattr(value, table).items()
                setattr(module, table, {k: v if v is None else self(v) for k, v in entries})
            for name, attribute in vars(value).items():
                if isinstance(attribute, torch.Tensor):
                    module.__dict__[name] = self(attribute)
            return module
        return value


def profile(gm: fx.GraphModule, args: tuple, kwargs: dict | None = None) -> Profile:
    """Annotate every compute node of ``gm`` (see the module docstring) from one fake training
    step: forward, the loss of ``planner.measure.training_loss``, backward.

    ``gm`` itself is not run: a fake copy is, so neither real memory nor the user's parameters
    are touched. Savings are deduplicated by storage; parameter storages are fixed, never saved.
    """
    start = time.perf_counter()
    kwargs = kwargs or {}
    storages = _Storages()
    fixed_kind: dict[int, str] = {}
    trainable: set[int] = set()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fakes = _Fakes(mode)
        fake_args, fake_kwargs = tree_map_only(torch.Tensor, fakes, (args, kwargs))
        for p in gm.parameters():
            key = storages.key(fakes(p))
            fixed_kind[key] = "parameter"
            if p.requires_grad:
                trainable.add(key)
        for b in gm.buffers():
            fixed_kind.setdefault(storages.key(fakes(b)), "buffer")
        for t in tree_flatten((fake_args, fake_kwargs))[0]:
            if isinstance(t, torch.Tensor):
                fixed_kind.setdefault(storages.key(t), "input")
        cost = _CostMode(storages)
        recorder = _Recorder(gm, storages, cost, fakes)
        with cost, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pytree specs of exported modules
            output = recorder.run(*placeholder_values(gm, fake_args, fake_kwargs))
        output_keys = {storages.key(t) for t in tree_flatten(output)[0]} - {None}
        loss = training_loss(output)
        with recorder.backward:
            loss.backward()
        recorder.backward.finish()
    produced, read = set(), set()
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            produced.update(require_meta(node, "planner.created"))
            read.update(node.meta["planner.reads"])
    for key in read - produced - set(fixed_kind):
        fixed_kind[key] = "constant"  # tensors the graph holds, e.g. lifted by torch.export
    return Profile(
        storage_bytes=dict(storages.nbytes),
        fixed_kind=fixed_kind,
        trainable=frozenset(trainable),
        output_storages=frozenset(output_keys),
        seconds=time.perf_counter() - start,
    )
