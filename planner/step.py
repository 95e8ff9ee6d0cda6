"""Real measurements of one training step: peak memory, FLOPs and time.

The planner *predicts* the peak memory of a training step; this module *measures* it, so that
predictions can be checked against reality. "One training step" means the same thing everywhere
in the project: run the module forward, reduce its output to a loss (the user's ``loss_fn``, by
default :func:`training_loss`), and call ``backward()`` (see :func:`training_step`). No optimizer
step is taken.

Peak memory is measured differently per device:

* **CUDA**: the caching allocator already keeps statistics, so :func:`peak_memory` reads
  ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``.
* **CPU** (and any other device): there are no allocator statistics, so a
  :class:`~torch.utils._python_dispatch.TorchDispatchMode` watches every operator of the step,
  forward, backward and the recomputation inside ``torch.utils.checkpoint`` alike. Each storage
  it has not seen before adds its ``nbytes()`` to a running total, and a ``weakref.finalize`` on
  the storage subtracts them when the storage dies. This works because PyTorch keeps a storage's
  Python object alive for as long as the C++ storage lives, so the finalizer fires when the
  memory is released and not when the Python wrapper goes out of scope (checked at run time by
  :func:`_storage_finalizers_track_storage_lifetime`). Temporary buffers that an operator
  allocates and frees inside its own kernel are not visible to it.

FLOPs and time are measured in separate passes (:func:`step_flops`, :func:`step_time`):
``FlopCounterMode`` keeps tensors alive, so a memory measurement taken under it reads too high.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "LiveStorageTracker",
    "MemoryReport",
    "clear_grads",
    "peak_memory",
    "state_tensors",
    "step_device",
    "step_flops",
    "step_time",
    "training_loss",
    "training_step",
]


# --------------------------------------------------------------------------------------------
# The training step
# --------------------------------------------------------------------------------------------


def _tensors_in(output):
    """Yield every tensor in a nested output, depth first, in order.

    Handles tensors, lists, tuples (named tuples included), mappings (``dict``, ``OrderedDict``
    and subclasses such as Hugging Face ``ModelOutput``), dataclass instances, and any type
    registered with ``torch.utils._pytree``. Anything else is ignored.
    """
    stack = [output]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, Mapping):
            stack.extend(reversed(list(obj.values())))
        elif isinstance(obj, (list, tuple)):
            stack.extend(reversed(obj))
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = dataclasses.fields(obj)
            stack.extend(reversed([getattr(obj, f.name) for f in fields]))
        else:
            leaves = tree_leaves(obj)
            if not (len(leaves) == 1 and leaves[0] is obj):
                stack.extend(reversed(leaves))


def training_loss(output) -> torch.Tensor:
    """Reduce a model's output to the scalar whose ``backward()`` is one training step.

    The loss is the sum of ``t.sum()`` over every floating-point tensor in `output` that
    requires grad, so that every output receives a gradient of ones and the step exercises the
    whole backward graph, as a real loss would, without depending on labels. A 0-dim tensor is
    used as is, so a model that returns its own loss is trained on that loss. Every occurrence
    counts: a tensor returned twice is summed twice.

    Parameters
    ----------
    output : Tensor, tuple, list, dict or dict-like (e.g. ``ModelOutput``), possibly nested
        What the model returned.

    Returns
    -------
    Tensor
        A 0-dim tensor that requires grad.

    Raises
    ------
    ValueError
        If no floating-point tensor in `output` requires grad: there would be nothing to
        differentiate (a model in ``torch.no_grad``, or outputs that are all integer).

    Examples
    --------
    >>> import torch
    >>> w = torch.ones(3, requires_grad=True)
    >>> training_loss({"logits": 2 * w, "ids": torch.arange(3)})
    tensor(6., grad_fn=<SumBackward0>)
    """
    terms = [
        t if t.dim() == 0 else t.sum()
        for t in _tensors_in(output)
        if t.is_floating_point() and t.requires_grad
    ]
    if not terms:
        raise ValueError(
            f"training_loss: no floating-point tensor that requires grad in the model output "
            f"(got {_describe(output)}). Make sure the model runs with grad enabled, that its "
            f"parameters or inputs require grad, and that it returns its floating-point outputs."
        )
    return functools.reduce(torch.add, terms)


def _describe(output) -> str:
    """A short description of an output, for error messages."""
    tensors = list(_tensors_in(output))
    if not tensors:
        return f"{type(output).__name__} containing no tensors"
    kinds = ", ".join(f"{t.dtype} requires_grad={t.requires_grad}" for t in tensors[:4])
    more = f", ... ({len(tensors)} tensors)" if len(tensors) > 4 else ""
    return f"{type(output).__name__} of tensors [{kinds}{more}]"


def training_step(module, args, kwargs=None, *, loss_fn=None, optimizer=None) -> torch.Tensor:
    """Run one training step: forward, the loss, backward.

    This is the unit of work that the planner's predictions and every measurement here refer
    to. Gradients accumulate into ``.grad`` as in any backward pass; no optimizer step is taken.
    The loss is ``loss_fn(output)`` when given (plan with the same ``loss_fn``), else
    :func:`training_loss`. With ``optimizer``, the step ends with ``optimizer.step()`` (plan
    with the same ``optimizer=``).

    Parameters
    ----------
    module : callable
        Usually an ``nn.Module``; called as ``module(*args, **kwargs)``.
    args : tuple
        Positional inputs.
    kwargs : dict, optional
        Keyword inputs.

    Returns
    -------
    Tensor
        The loss, detached (so holding it keeps no graph alive).
    """
    output = module(*args, **(kwargs or {}))
    loss = training_loss(output) if loss_fn is None else loss_fn(output)
    del output  # let backward free what only the output kept alive, as a training loop would
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss.detach()


# --------------------------------------------------------------------------------------------
# Peak memory
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryReport:
    """Measured memory of one training step, in bytes.

    Attributes
    ----------
    peak_bytes : int
        The most bytes live at any moment of the step, everything included (parameters,
        buffers, inputs, activations, gradients, temporaries between operators).
    start_bytes : int
        Bytes live when the step began: parameters, buffers, inputs and existing gradients
        (on CUDA: everything allocated on the device).
    end_bytes : int
        Bytes live after the step: typically `start_bytes` plus the new gradients.
    device : str
        ``"cpu"`` or ``"cuda:N"``.
    timeline : tuple of int or None
        Live bytes at the start, then after each allocation or free, when recorded (CPU only).
    """

    peak_bytes: int
    start_bytes: int
    end_bytes: int
    device: str
    timeline: tuple[int, ...] | None = dataclasses.field(default=None, repr=False)

    @property
    def activation_peak_bytes(self) -> int:
        """Peak bytes above what was live at the start: what the step itself added."""
        return self.peak_bytes - self.start_bytes


def peak_memory(
    module, args, kwargs=None, *, record_timeline=False, loss_fn=None, optimizer=None
) -> MemoryReport:
    """Run one training step and measure its peak memory.

    The step starts from a clean state: every parameter's ``.grad`` is first set to ``None``
    (as ``optimizer.zero_grad(set_to_none=True)`` would; existing gradients are discarded) and
    ``gc.collect()`` runs, so that garbage from earlier work is not counted. The step is a real
    one: gradients are left in ``.grad`` afterwards and buffers such as BatchNorm running
    statistics are updated.

    On CUDA (parameters or inputs on a CUDA device) the allocator's statistics are read; on
    other devices a dispatch-mode tracker of live storages measures it (see the module
    docstring). Do not wrap this in another dispatch mode such as ``FlopCounterMode``: it keeps
    tensors alive and inflates the measurement.

    Parameters
    ----------
    module : callable
        Usually an ``nn.Module``; called as ``module(*args, **kwargs)``.
    args : tuple
        Positional inputs.
    kwargs : dict, optional
        Keyword inputs.
    record_timeline : bool, default False
        Also record the live bytes after each allocation and free (CPU tracker only), e.g. to
        plot memory over the step.
    loss_fn : callable, optional
        The step's loss, as in :func:`training_step`.
    optimizer : torch.optim.Optimizer, optional
        Ends the step with ``optimizer.step()``. Its state, when a step has already made it, is
        counted among the start bytes (it is read, so seen, during the step).

    Returns
    -------
    MemoryReport
    """
    kwargs = kwargs or {}
    clear_grads(module)
    gc.collect()
    device = step_device(module, args, kwargs)
    if device.type == "cuda":
        return _cuda_peak_memory(module, args, kwargs, device, loss_fn, optimizer)
    tracker = LiveStorageTracker(record_timeline=record_timeline)
    for t in state_tensors(module, args, kwargs):
        tracker.register_existing(t)
    with tracker:
        training_step(module, args, kwargs, loss_fn=loss_fn, optimizer=optimizer)
        gc.collect()  # free reference cycles, if the step made any, while still tracking
    return tracker.report(str(device))


def _cuda_peak_memory(module, args, kwargs, device, loss_fn, optimizer) -> MemoryReport:
    """Peak memory of one step on CUDA from the caching allocator's statistics."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    training_step(module, args, kwargs, loss_fn=loss_fn, optimizer=optimizer)
    gc.collect()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    end = torch.cuda.memory_allocated(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return MemoryReport(
        peak_bytes=peak, start_bytes=start, end_bytes=end, device=f"cuda:{index}", timeline=None
    )


def _parameters(module):
    return list(module.parameters()) if isinstance(module, torch.nn.Module) else []


def clear_grads(module) -> None:
    """Set every parameter's ``.grad`` to None, so that a step starts as after ``zero_grad``."""
    for p in _parameters(module):
        p.grad = None


def step_device(module, args, kwargs) -> torch.device:
    """The device the step runs on: the first CUDA device among parameters and inputs, if any."""
    tensors = state_tensors(module, args, kwargs)
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
    return tensors[0].device if tensors else torch.device("cpu")


def state_tensors(module, args, kwargs) -> list[torch.Tensor]:
    """Tensors live before the step that the step may read or view.

    Parameters, buffers, plain tensor attributes of submodules (constants that were not
    registered as buffers), input tensors, and the gradients of leaf inputs.
    """
    tensors: list[torch.Tensor] = []
    if isinstance(module, torch.nn.Module):
        tensors += list(module.parameters())
        tensors += list(module.buffers())
        for m in module.modules():
            tensors += [
                v
                for v in vars(m).values()
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)
            ]
        tensors += [p.grad for p in module.parameters() if p.grad is not None]
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors += inputs
    # `.grad` of a non-leaf warns; only leaves accumulate gradients anyway.
    tensors += [t.grad for t in inputs if t.is_leaf and t.grad is not None]
    return tensors


@functools.cache
def _storage_finalizers_track_storage_lifetime() -> bool:
    """Whether a finalizer on a storage's Python object fires when the storage dies.

    PyTorch preserves a storage's Python object while the C++ storage is alive (the object is
    handed to the storage rather than deallocated when Python drops it), so the finalizer fires
    when the last tensor using the storage dies. Without that preservation the finalizer would
    fire as soon as Python dropped its wrapper, and the tracker would undercount.
    """
    fired: list[bool] = []
    tensor = torch.empty(8)
    storage = tensor.untyped_storage()
    weakref.finalize(storage, fired.append, True)
    del storage
    gc.collect()
    dropped_wrapper_early = bool(fired)
    del tensor
    gc.collect()
    return not dropped_wrapper_early and bool(fired)


class LiveStorageTracker(TorchDispatchMode):
    """Dispatch mode that keeps the running total of bytes held by live storages.

    Every storage is counted once, however many tensors view it, from the first operator that
    returns it until it dies. Storages registered before the step (parameters, inputs, ...) and
    storages of unknown origin that an operator reads form the *start* bytes: they were live
    before the step. A storage first seen as the output of an operator that did not read it is
    an allocation of the step.
    """

    # Ops whose input is a tensor just created outside the dispatcher (``torch.tensor(...)``):
    # their unseen input storage is new, not pre-existing.
    _FRESH_INPUT_OPS = frozenset(
        {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
    )

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Otherwise dynamo runs compiled frames eagerly under this mode, and a compiled module
        # would measure as the eager one.
        return True

    def __init__(self, *, record_timeline=False):
        super().__init__()
        if not _storage_finalizers_track_storage_lifetime():
            raise RuntimeError(
                "This PyTorch does not keep storage Python objects alive for the storage's "
                "lifetime, so the CPU peak-memory tracker cannot see when memory is freed. "
                "Measure on CUDA, or use a PyTorch version with storage PyObject preservation."
            )
        # Reentrant: creating a finalizer can run the garbage collector, whose frees call back in.
        self._lock = threading.RLock()
        # key (the storage's StorageImpl address) -> [nbytes, weak ref pinning the address,
        # finalizer]. The weak ref keeps the StorageImpl shell (not its memory) from being freed,
        # so no other storage can take the same address while the record exists.
        self._records: dict[int, list] = {}
        self._start = 0  # bytes of storages live before the step
        self._delta = 0  # bytes allocated minus bytes freed since the step began
        self._max_delta = 0
        self._timeline = [0] if record_timeline else None
        self._closed = False

    # -- bookkeeping ---------------------------------------------------------------------------

    def _add(self, storage, *, existing: bool) -> None:
        if storage.device.type == "meta":
            return
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            record = self._records.get(key)
            if record is not None:
                if record[0] != nbytes:  # resized in place (``resize_``)
                    self._delta += nbytes - record[0]
                    record[0] = nbytes
                    self._note_event()
                return
            if nbytes == 0:
                return
            finalizer = weakref.finalize(storage, self._on_free, key)
            finalizer.atexit = False
            self._records[key] = [nbytes, StorageWeakRef(storage), finalizer]
            if existing:
                self._start += nbytes  # it was live all along, at every earlier moment too
            else:
                self._delta += nbytes
                self._note_event()

    def _on_free(self, key: int) -> None:
        with self._lock:
            record = self._records.pop(key, None)
            if record is None or self._closed:
                return
            self._delta -= record[0]
            self._note_event()

    def _note_event(self) -> None:
        self._max_delta = max(self._max_delta, self._delta)
        if self._timeline is not None:
            self._timeline.append(self._delta)

    @staticmethod
    def _storages(tree):
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                try:
                    yield t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    pass  # sparse and some subclass tensors have no single storage

    # -- public to this module -----------------------------------------------------------------

    def register_existing(self, tensor: torch.Tensor) -> None:
        """Count a tensor that is live before the step among the start bytes."""
        for storage in self._storages(tensor):
            self._add(storage, existing=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._FRESH_INPUT_OPS:
            for storage in self._storages((args, kwargs)):
                if storage._cdata not in self._records:
                    self._add(storage, existing=True)
        out = func(*args, **kwargs)
        for storage in self._storages(out):
            self._add(storage, existing=False)
        return out

    def report(self, device: str) -> MemoryReport:
        """Stop tracking and summarise; call after leaving the mode."""
        with self._lock:
            self._closed = True
            records, self._records = self._records, {}
        for _, _, finalizer in records.values():
            finalizer.detach()
        start = self._start
        timeline = None
        if self._timeline is not None:
            timeline = tuple(start + d for d in self._timeline)
        return MemoryReport(
            peak_bytes=start + self._max_delta,
            start_bytes=start,
            end_bytes=start + self._delta,
            device=device,
            timeline=timeline,
        )


# --------------------------------------------------------------------------------------------
# FLOPs and time
# --------------------------------------------------------------------------------------------


def step_flops(module, args, kwargs=None) -> int:
    """Count the FLOPs of one training step with ``FlopCounterMode``.

    A separate pass from :func:`peak_memory`, because the counter keeps tensors alive. Only
    operators with a FLOP formula count (matmuls, convolutions, attention); elementwise
    operators, norms and softmax count zero. Parameter gradients are set to ``None`` first, as
    in :func:`peak_memory`, and left filled afterwards.

    Returns
    -------
    int
        Forward plus backward FLOPs (a multiply-add counts as two).
    """
    from torch.utils.flop_counter import FlopCounterMode

    clear_grads(module)
    counter = FlopCounterMode(display=False)
    with counter:
        training_step(module, args, kwargs)
    return int(counter.get_total_flops())


def step_time(module, args, kwargs=None, *, repeat=5, warmup=1) -> float:
    """Median wall-clock seconds of one training step.

    Each step starts with parameter gradients set to ``None`` (outside the timed region), as in
    a training loop with ``zero_grad(set_to_none=True)``, so every repetition does the same
    work. `warmup` untimed steps come first, to leave out one-time costs (allocator growth,
    lazy initialisation). On CUDA the device is synchronized around each timed step, so the
    time includes the kernels and not only their launch.

    Parameters
    ----------
    repeat : int, default 5
        Timed steps; the median is returned, as it is robust to a stray slow step.
    warmup : int, default 1
        Untimed steps before.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"step_time needs repeat >= 1 and warmup >= 0, got {repeat=}, {warmup=}")
    kwargs = kwargs or {}
    device = step_device(module, args, kwargs)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(warmup + repeat):
        clear_grads(module)
        sync()
        begin = time.perf_counter()
        training_step(module, args, kwargs)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    return statistics.median(times)
