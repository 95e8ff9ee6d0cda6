"""Running a graph without real memory, for the profile: fake or meta copies of the model's
tensors, ATen calls on them (``FakeCall``, ``MetaKernels``, which reuses meta results), and what
the profile needs to know of each op (``op_facts``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import flop_registry


def tensors_in(values) -> list[torch.Tensor]:
    """The tensors in ``values`` (a tensor, or nested lists and tuples of ATen arguments), in
    pytree order; much cheaper than ``tree_leaves`` on the flat arguments of an ATen op."""
    if isinstance(values, torch.Tensor):
        return [values]
    found = []
    if isinstance(values, (list, tuple)):
        for value in values:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found.extend(tensors_in(value))
    return found


class OpFacts(NamedTuple):
    written: tuple[tuple[int, str], ...]  # (position, name) of the arguments the op mutates
    aliasing: bool  # a return aliases an input: the op moves no bytes
    flops: Callable | None  # torch.utils.flop_counter formula
    cacheable: bool  # a pure function of its arguments' metadata (see MetaKernels)
    random: bool  # draws random numbers
    several_outputs: bool  # returns more than one tensor (see FakeCall)
    # Returns only new tensors whose metadata its arguments' metadata decide, and draws no
    # random numbers: a recompute may replay it on meta tensors (``planner.rewrite._Replaying``)
    replayable: bool


@functools.cache
def op_facts(func: torch._ops.OpOverload) -> OpFacts:
    """What an op's schema and tags say, read once per op rather than once per call."""
    schema = func._schema
    written = tuple(
        (position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )
    aliasing = any(r.alias_info is not None for r in schema.returns)
    cacheable = (
        torch._library.utils.is_builtin(func)
        and not any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))
        and not {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape} & set(func.tags)
    )
    random = torch.Tag.nondeterministic_seeded in func.tags
    several_outputs = len(schema.returns) > 1 or any(
        isinstance(r.type, torch.ListType) for r in schema.returns
    )
    returns_tensors = bool(schema.returns) and all(
        isinstance(r.type, torch.TensorType) for r in schema.returns
    )
    return OpFacts(
        written,
        aliasing,
        flop_registry.get(func.overloadpacket),
        cacheable,
        random,
        several_outputs,
        cacheable and not random and returns_tensors,
    )


def casts_a_leaf(func, args) -> bool:
    """Whether an op copies a leaf tensor that requires grad (a weight), as autocast casts one.

    Autocast's cache answers such a cast without dispatching it once the region has made it, so
    two runs of the same code (a segment's forward and its recompute, which may run under a
    fresh region; a profile and a recompute) can dispatch different numbers of them.
    """
    return (
        func is torch.ops.aten._to_copy.default
        and bool(args)
        and isinstance(args[0], torch.Tensor)
        and args[0].is_leaf
        and args[0].requires_grad
    )


class FakeCall:
    """Runs an op under ``FakeTensorMode``, which has a dispatch cache of its own.

    Ops with several outputs bypass that cache: it rebuilds a cached result on fresh storages,
    where the kernel may return one storage twice (the two bias gradients of an LSTM layer's
    backward). A profile would then depend on what ran before it in the process (a fresh
    ``nn.LSTM`` profiled 1,024 bytes lower than later ones).

    With ``device``, a ``meta`` device among an op's arguments is replaced by it: a meta model
    run on fake tensors of another device (``FakeOnDevice``) still has ``device=meta`` in the
    factory calls and checks that ``torch.export`` recorded.
    """

    def __init__(self, mode: FakeTensorMode, device: str | None = None):
        self.mode = mode
        self.device = None if device is None else torch.device(device)

    def _moved(self, device: torch.device) -> torch.device:
        return self.device if device.type == "meta" and self.device is not None else device

    def __call__(self, func, args: tuple, kwargs: dict):
        if self.device is not None:
            args, kwargs = tree_map_only(torch.device, self._moved, (args, kwargs))
        if not op_facts(func).several_outputs or not self.mode.cache_enabled:
            return func(*args, **kwargs)
        self.mode.cache_enabled = False
        try:
            return func(*args, **kwargs)
        finally:
            self.mode.cache_enabled = True


def _metadata(value):
    """What a meta kernel's result can depend on, hashable: for a tensor its metadata."""
    if isinstance(value, torch.Tensor):
        if not value.is_meta or value.layout is not torch.strided:
            raise TypeError("not a strided meta tensor")
        return (
            value.dtype,
            value.shape,
            value.stride(),
            value.storage_offset(),
            value.is_conj(),
            value.is_neg(),
        )
    if isinstance(value, (list, tuple)):
        return (type(value), *[_metadata(v) for v in value])
    return (type(value), value)


class MetaKernels:
    """Runs ATen ops on meta tensors, reusing the result of an earlier call with the same
    metadata and arguments.

    Many meta kernels are Python decompositions (``addmm``, ``relu``...), and they are most of
    the cost of a meta run; a long model repeats the same few calls. Only ops that neither
    mutate nor alias their inputs and return fresh tensors are reused: their results depend on
    nothing else, which is also what ``FakeTensorMode``'s dispatch cache relies on.
    """

    def __init__(self):
        self.results: dict[tuple, tuple] = {}  # call -> how to rebuild its result, or ()

    def __call__(self, func, args: tuple, kwargs: dict):
        if not op_facts(func).cacheable:
            return func(*args, **kwargs)
        try:
            key = (func, _metadata(args), _metadata(tuple(kwargs.items())))
            entry = self.results.get(key)
        except TypeError:  # an argument that is not a strided meta tensor, or unhashable
            return func(*args, **kwargs)
        if entry is None:
            out = func(*args, **kwargs)
            self.results[key] = self._entry(
                out, tensors_in(args) + tensors_in(tuple(kwargs.values()))
            )
            return out
        return self._rebuild(entry) if entry else func(*args, **kwargs)

    @staticmethod
    def _entry(out, inputs: list[torch.Tensor]) -> tuple:
        """How to rebuild ``out``: per tensor its metadata and which new storage it is on;
        empty unless ``out`` is fresh strided meta tensors."""
        single = isinstance(out, torch.Tensor)
        outputs = [out] if single else out
        if not isinstance(outputs, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) and t.is_meta and t.layout is torch.strided for t in outputs
        ):
            return ()
        storages = [t.untyped_storage()._cdata for t in inputs]
        first_new = len(storages)
        specs = []
        for t in outputs:
            storage = t.untyped_storage()
            if storage._cdata not in storages:
                storages.append(storage._cdata)
            index = storages.index(storage._cdata) - first_new
            if index < 0:  # shares an input's storage
                return ()
            offset = t.storage_offset()
            specs.append((t.dtype, t.shape, t.stride(), offset, storage.nbytes(), index))
        return single, type(out), tuple(specs)

    @staticmethod
    def _rebuild(entry: tuple):
        single, kind, specs = entry
        storages: list[torch.UntypedStorage] = []
        outputs = []
        for dtype, size, stride, offset, nbytes, index in specs:
            if index == len(storages):
                storages.append(torch.UntypedStorage(nbytes, device="meta"))
            t = torch.empty((), dtype=dtype, device="meta")
            outputs.append(t.set_(storages[index], offset, size, stride))
        return outputs[0] if single else kind(outputs)


def _on_larger_storage(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``tensor``'s sizes and strides on a storage of ``nbytes`` (when that is more than its own):
    what a kernel that allocates more than it returns (then narrows or resizes) really holds."""
    if tensor.untyped_storage().nbytes() >= nbytes:
        return tensor
    storage = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device).untyped_storage()
    larger = tensor.new_empty(0)
    return larger.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())


def _embedding_bag(args: tuple, kwargs: dict, out: tuple) -> tuple:
    """The CPU kernel makes ``offset2bag`` one element longer, then resizes it down (when it
    makes one at all), and ``bag_size`` as long as ``offsets`` before dropping the last bag's
    (``include_last_offset``): 8 and more bytes its fake kernel leaves out."""
    output, offset2bag, bag_size, max_indices = out
    offsets = args[2] if len(args) > 2 else kwargs["offsets"]
    if offset2bag.numel():
        size = (offset2bag.numel() + 1) * offset2bag.element_size()
        offset2bag = _on_larger_storage(offset2bag, size)
    bag_size = _on_larger_storage(bag_size, offsets.numel() * bag_size.element_size())
    return output, offset2bag, bag_size, max_indices


@functools.cache
def _rnn_workspace_bytes(func, call: tuple) -> int:
    """The bytes of the workspace the real CPU kernel of ``func`` returns for ``call`` (its
    arguments, tensors given by shape and dtype)."""
    # Real tensors: made with every mode off (a fake mode would make fakes, run fake kernels).
    with _disable_current_modes(), torch.enable_grad():  # the kernel makes none without grad
        args = [
            torch.zeros(value[1], dtype=value[2]) if _is_tensor_spec(value) else value
            for value in call
        ]
        return func(*args)[3].untyped_storage().nbytes()


def _is_tensor_spec(value) -> bool:
    return isinstance(value, tuple) and value[:1] == ("tensor",)


def _frozen(value):
    """A hashable stand-in for an ATen argument: tensors by shape and dtype."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, list):
        return tuple(value)
    return value


def _mkldnn_rnn_layer(args: tuple, kwargs: dict, out: tuple) -> tuple:
    """oneDNN decides the size of an LSTM layer's workspace (the gates and states backward
    reads: 1.27 MB for LSTM(32, 64) at 8 x 40, 3.3x the rest of that step), and the fake
    kernel returns an empty one. The real kernel is run once per distinct call, on zeros, to
    read it: oneDNN's sizes depend on its version and on the CPU."""
    output, hy, cy, workspace = out
    call = tuple(_frozen(value) for value in (*args, *kwargs.values()))
    nbytes = _rnn_workspace_bytes(torch.ops.aten.mkldnn_rnn_layer.default, call)
    return output, hy, cy, workspace.new_empty(nbytes)  # uint8, as the real one


def _mkldnn_rnn_layer_backward(args: tuple, kwargs: dict, out: tuple) -> tuple:
    """The real kernel returns the two bias gradients on storages of their own; the fake one
    returns one tensor twice."""
    bias_ih, bias_hh = out[3:5]
    if bias_hh.untyped_storage()._cdata == bias_ih.untyped_storage()._cdata:
        return (*out[:4], torch.empty_like(bias_hh), *out[5:])
    return out


def _loss_on_elementwise_storage(args: tuple, kwargs: dict, loss: torch.Tensor) -> torch.Tensor:
    """The CPU kernels of these losses return the reduced loss on a storage as large as the
    elementwise loss (the broadcast inputs' size); the fake kernels, on one element. The step
    holds the loss to its end: 256 KiB under for ``F.mse_loss`` of 4 x 16 x 32 x 32 floats."""
    if loss.dim() > 0:
        return loss  # reduction="none": the elementwise loss is the result already
    shape = torch.broadcast_shapes(*(t.shape for t in tensors_in((*args, *kwargs.values()))))
    return _on_larger_storage(loss, shape.numel() * loss.element_size())


def _col2im(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    """The CPU kernel (``F.fold``; ``F.unfold``'s backward) makes its result like its input,
    the columns, then resizes it down to the image: a 3 x 3 kernel's result holds 9x its size
    (found trying the library: 200,776 bytes over a budget)."""
    columns = args[0] if args else kwargs["self"]
    return _on_larger_storage(out, max(columns.numel(), out.numel()) * out.element_size())


def _batch_norm_layout(args: tuple, kwargs: dict, out: tuple) -> tuple:
    """The CPU kernels make their result (the forward's output, backward's input gradient)
    dense in a layout they pick from the input's strides (``_kernel_layout``); the fake
    kernels keep the input's strides.
    On a transposed input (``bn(x.transpose(1, 2))``, a BatchNorm1d in a sequence model) the
    real graph then copies what the profile saw as free views: 25% over the prediction."""
    source = args[0] if args else kwargs["input"]
    return _dense_first(source, out)


def _batch_norm_backward_layout(args: tuple, kwargs: dict, out: tuple) -> tuple:
    """``_batch_norm_layout`` of ``native_batch_norm_backward``, whose input comes second."""
    source = args[1] if len(args) > 1 else kwargs["input"]
    return _dense_first(source, out)


def _dense_first(source: torch.Tensor, out: tuple) -> tuple:
    """``out`` with its first result dense in the layout the CPU kernel picks for ``source``."""
    first = out[0]
    if first is None:
        return out
    layout = _kernel_layout(source)
    if first.is_contiguous(memory_format=layout):
        return out
    return (torch.empty_like(first, memory_format=layout), *out[1:])


def _kernel_layout(tensor: torch.Tensor) -> torch.memory_format:
    """Channels-last for a 4-d (5-d) tensor dense in it and not contiguous (a size-1
    dimension makes some both), or whose strides are exactly channels-last's; else
    contiguous. Checked against the CPU kernels on 17,658 random layouts: every forward
    result agrees; 3 input gradients, of an output gradient laid out otherwise than the
    input, do not (the kernel makes them contiguous)."""
    if tensor.dim() in (4, 5):
        channels_last = torch.channels_last if tensor.dim() == 4 else torch.channels_last_3d
        if tensor.is_contiguous(memory_format=channels_last) and not tensor.is_contiguous():
            return channels_last
    return suggest_memory_format(tensor)


# CPU kernels whose results hold more memory than their fake kernels' (torch 2.13), or lay it
# out otherwise: each takes (args, kwargs, fake result) and returns the result as the real
# kernel makes it.
_CPU_ALLOCATIONS: dict[torch._ops.OpOverload, Callable[[tuple, dict, Any], Any]] = {
    torch.ops.aten._embedding_bag.default: _embedding_bag,
    torch.ops.aten._embedding_bag_forward_only.default: _embedding_bag,
    torch.ops.aten.col2im.default: _col2im,
    torch.ops.aten.mkldnn_rnn_layer.default: _mkldnn_rnn_layer,
    torch.ops.aten.mkldnn_rnn_layer_backward.default: _mkldnn_rnn_layer_backward,
    torch.ops.aten.mse_loss.default: _loss_on_elementwise_storage,
    torch.ops.aten.smooth_l1_loss.default: _loss_on_elementwise_storage,
    torch.ops.aten.binary_cross_entropy.default: _loss_on_elementwise_storage,
    torch.ops.aten.soft_margin_loss.default: _loss_on_elementwise_storage,
    torch.ops.aten.native_batch_norm.default: _batch_norm_layout,
    torch.ops.aten.native_batch_norm_backward.default: _batch_norm_backward_layout,
    torch.ops.aten._native_batch_norm_legit.default: _batch_norm_layout,
    torch.ops.aten._native_batch_norm_legit.no_stats: _batch_norm_layout,
    torch.ops.aten._native_batch_norm_legit_no_training.default: _batch_norm_layout,
    torch.ops.aten._native_batch_norm_legit_functional.default: _batch_norm_layout,
}


def real_cpu_allocations(func, args: tuple, kwargs: dict, out):
    """``out`` with the storage sizes that ``func``'s CPU kernel really allocates, where its
    fake kernel reports less (see ``_CPU_ALLOCATIONS``); ``out`` itself elsewhere."""
    fix = _CPU_ALLOCATIONS.get(func)
    if fix is None or not all(t.device.type == "cpu" for t in tensors_in(out)):
        return out
    return fix(args, kwargs, out)


# Kernels that refuse operands of different dtypes on every device, where meta kernels (and so
# the profile) accept them: an int64 input into a float nn.Linear would fail only when run.


class MetaCopies:
    """Fresh meta tensors like the given meta tensors: same sizes, strides, dtypes, and the same
    storage sharing among them, on storages of their own (so the originals are never touched)."""

    def __init__(self):
        # source _cdata -> (the source, held so that its address is not reused; its copy)
        self.storages: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.untyped_storage()
        if source._cdata not in self.storages:
            fresh = torch.UntypedStorage(source.nbytes(), device="meta")
            self.storages[source._cdata] = (source, fresh)
        storage = self.storages[source._cdata][1]
        result = torch.empty((), dtype=tensor.dtype, device="meta")
        result.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
        return result.requires_grad_(tensor.requires_grad)


class FakeOnDevice:
    """Fake tensors on ``device`` like the given tensors, with ``MetaCopies``' storage sharing.

    Autocast casts only the ops of tensors on its own device, never those of meta tensors: a
    meta model profiled under autocast would run in float32 where the real one runs in low
    precision. Its fake copies on autocast's device are cast as the real model's tensors are.
    """

    def __init__(self, mode: FakeTensorMode, device: str):
        self.mode = mode
        self.device = torch.device(device)
        self.meta = MetaCopies()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():  # plain meta tensors, not fakes, and no op counted
            meta = self.meta(tensor).requires_grad_(False)
        fake = self.mode.fake_tensor_converter.from_meta_and_device(self.mode, meta, self.device)
        return fake.requires_grad_(tensor.requires_grad)


class Copies:
    """Stand-ins for the captured module's tensors and modules, made on first use.

    ``convert`` makes a tensor's stand-in (a fake tensor, or a fresh meta tensor). Modules are
    copied structurally (a shallow copy whose parameters, buffers and children are replaced),
    which is much cheaper than a deep copy of the whole GraphModule and leaves the user's
    objects untouched.
    """

    def __init__(self, convert: Callable[[torch.Tensor], torch.Tensor]):
        self.convert = convert
        self.memo: dict[int, object] = {}

    def __call__(self, value):
        key = id(value)
        if key not in self.memo:
            self.memo[key] = self._make(value)
        return self.memo[key]

    def _make(self, value):
        if isinstance(value, nn.Parameter):
            return nn.Parameter(self.convert(value), requires_grad=value.requires_grad)
        if isinstance(value, torch.Tensor):
            return self.convert(value)
        if isinstance(value, nn.Module):
            # A shallow copy without ``copy.copy``: a parametrized module's class (weight_norm,
            # spectral_norm, orthogonal) refuses the pickling protocol copy.copy goes through.
            module = object.__new__(type(value))
            module.__dict__.update(vars(value))
            for table in ("_parameters", "_buffers", "_modules"):  # plain attributes of a Module
                entries = getattr(value, table).items()
                module.__dict__[table] = {k: v if v is None else self(v) for k, v in entries}
            for name, attribute in vars(value).items():
                if isinstance(attribute, torch.Tensor):
                    module.__dict__[name] = self(attribute)
            if isinstance(value, nn.modules.batchnorm._BatchNorm) and value.momentum is None:
                # A cumulative average reads float(num_batches_tracked), which a fake cannot
                # give; any momentum runs the same ops on the same tensors.
                module.__dict__["momentum"] = 0.1
            return module
        return value


def all_on_meta(gm: fx.GraphModule, args: tuple, kwargs: dict) -> bool:
    """Whether the tensors the run starts from (inputs, parameters, buffers, tensor attributes)
    are all plain tensors or parameters on the meta device (and there is one at least)."""
    values = [*tree_leaves((args, kwargs)), *gm.parameters(), *gm.buffers()]
    values += [value for module in gm.modules() for value in vars(module).values()]
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    return bool(tensors) and all(
        type(t) in (torch.Tensor, nn.Parameter) and t.is_meta and t.layout is torch.strided
        for t in tensors
    )


class _QuietFakeFailures(logging.Filter):
    """Drops ``FakeTensorMode``'s log of a kernel that failed (a traceback of about 20 lines)
    in the profiling thread: the PlanningError raised for it says the same, in one line."""

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def quiet_fake_failures():
    logger = logging.getLogger(FakeTensorMode.__module__)
    quiet = _QuietFakeFailures()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
