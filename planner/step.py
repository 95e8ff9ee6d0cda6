"""Real measurements of one training step: peak memory, FLOPs and time.

The planner *predicts* the peak memory of a training step; this module *measures* it, so that
predictions can be checked against reality. "One training step" means the same thing everywhere
in the project: run the module forward, reduce its output to a loss (the user's ``loss_fn``, by
default :func:`training_loss`), and call ``backward()`` (see :func:`training_step`). No optimizer
step is taken.

Peak memory is measured differently per device:

* **CUDA**: the caching allocator already keeps statistics, so :func:`peak_memory` reads
  ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``.
* **CPU** (and any other device): there are no allocator statistics, so a dispatch mode counts
  the bytes of live storages (:class:`planner.tracker.LiveStorageTracker`).

FLOPs and time are measured in separate passes (:func:`step_flops`, :func:`step_time`):
``FlopCounterMode`` keeps tensors alive, so a memory measurement taken under it reads too high.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import time
from collections.abc import Mapping

import torch
from torch.utils._pytree import tree_leaves

from planner.tracker import LiveStorageTracker, MemoryReport

__all__ = [
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


def output_tensors(output):
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


def grad_fn_of(tensor: torch.Tensor):
    """``tensor.grad_fn``; None for a view made under no_grad whose base was then written in
    place with grad mode on (``weight[:, :4].clamp_()`` in a no_grad block of forward):
    autograd refuses to read its grad_fn, and no gradient can flow through it."""
    try:
        return tensor.grad_fn
    except RuntimeError:
        return None


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
        for t in output_tensors(output)
        if t.is_floating_point() and t.requires_grad
    ]
    if not terms:
        raise ValueError(f"training_loss: {nothing_to_differentiate(output)}")
    return functools.reduce(torch.add, terms)


def nothing_to_differentiate(output) -> str:
    """Why ``output`` gives no training loss, and what to check."""
    tensors = list(output_tensors(output))
    kinds = ", ".join(f"{t.dtype} requires_grad={t.requires_grad}" for t in tensors[:4])
    more = f", ... ({len(tensors)} tensors)" if len(tensors) > 4 else ""
    if isinstance(output, torch.Tensor):  # the profile's stand-in (FakeTensor) or the user's
        got = f"a tensor, {kinds}"
    elif tensors:
        got = f"{type(output).__name__} of tensors [{kinds}{more}]"
    else:
        got = f"{type(output).__name__} containing no tensors"
    return (
        f"no floating-point tensor that requires grad in the model output (got {got}). Make "
        "sure the model runs with grad enabled, that its parameters or inputs require grad, "
        "and that it returns its floating-point outputs."
    )


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
    device = step_device(module, args, kwargs)
    if device.type == "meta":  # nothing is allocated there (found by a tester: it read 0)
        raise ValueError(
            "peak_memory measures a real step, and this one is on the meta device, where "
            "nothing is allocated: move the model and inputs to a device (to_empty(device=...) "
            "for a meta model) to measure, or read the plan's prediction"
        )
    clear_grads(module)
    gc.collect()
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


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so that a timer reads it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
