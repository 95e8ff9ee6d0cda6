"""Gradient accumulation for the training loop: split, scale the loss, synchronise once.

Accumulating ``k`` micro-batches gives the gradients of the whole batch only if each micro-batch's
loss is weighted by its share of the batch (for a mean-reduced loss) and, under data parallelism,
if gradients are synchronised once, after the last micro-batch, rather than after every one.
Both are easy to get subtly wrong (a smaller last micro-batch, a forward run outside
``no_sync``), so this module does them explicitly::

    for micro in planner.micro_batches(batch, 8, model=ddp_model):
        with micro:                                   # no_sync() unless it is the last
            loss = loss_fn(ddp_model(micro.data[0]), micro.data[1])
            micro.backward(loss)                      # backward of loss * micro.loss_scale
    optimizer.step()
    optimizer.zero_grad()

:func:`micro_batches` splits one batch; :func:`accumulation_windows` groups a stream of
micro-batches (a data loader) into windows of ``steps``, the last of which may be shorter.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.errors import positive_int

__all__ = ["MicroBatch", "accumulation_windows", "micro_batches"]

REDUCTIONS = ("mean", "sum")


class MicroBatch:
    """One micro-batch of an accumulation window, and how to train on it.

    Attributes
    ----------
    data
        The micro-batch: the same structure as the batch (tensor, tuple, list or dict), each
        tensor holding ``size`` samples along dimension 0.
    index, steps
        Its position in its window and the number of micro-batches in the window.
    size, window_size
        Samples in this micro-batch and in its whole window.
    loss_scale
        The factor :meth:`backward` applies to the loss: ``size / window_size`` for a
        mean-reduced loss, so that the accumulated gradient is that of the window's mean;
        ``1`` for a sum (times the data-parallel size when gradients are averaged over ranks,
        so that they become the global sum).
    is_last
        Whether it ends its window: gradients synchronise in its backward, and the optimizer
        steps after it.
    """

    def __init__(self, data, *, index, steps, size, window_size, loss_scale, sync_control):
        self.data = data
        self.index = index
        self.steps = steps
        self.size = size
        self.window_size = window_size
        self.loss_scale = loss_scale
        self._sync_control = sync_control
        self._context = None
        self._entered = False

    @property
    def is_last(self) -> bool:
        return self.index == self.steps - 1

    def __enter__(self) -> MicroBatch:
        if self._context is not None:
            raise RuntimeError("this micro-batch is already entered; use `with micro:` once")
        self._context = (
            contextlib.nullcontext()
            if self.is_last or self._sync_control is None
            else self._sync_control()
        )
        self._context.__enter__()
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        context, self._context = self._context, None
        if context is not None:  # None only for an __exit__ without __enter__
            context.__exit__(*exc)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``(loss * loss_scale).backward(**kwargs)``, exactly.

        With a data-parallel ``model`` it must run inside ``with micro:`` (forward included),
        because ``DistributedDataParallel`` decides in forward whether the backward will
        synchronise.
        """
        if self._sync_control is not None and not self._entered:
            raise RuntimeError(
                "MicroBatch.backward() outside `with micro:` while accumulating for a "
                "data-parallel model: run the forward and the backward of each micro-batch "
                "inside `with micro:`, so that only the last one synchronises gradients"
            )
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                "MicroBatch.backward() needs the scalar loss of the micro-batch (a 0-dim "
                f"tensor), got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        if "gradient" in kwargs:
            raise TypeError(
                "MicroBatch.backward() passes the loss's gradient itself (the micro-batch's "
                "loss_scale): give it the loss alone, without gradient="
            )
        # The scale as the gradient of the loss, not a product: the same gradients, and no
        # scaled copy of the loss held through backward beside the loss (as planned).
        loss.backward(torch.full_like(loss, self.loss_scale), **kwargs)

    def __repr__(self) -> str:
        return (
            f"MicroBatch({self.index + 1}/{self.steps}, size {self.size} of {self.window_size}, "
            f"loss_scale={self.loss_scale:.4g})"
        )


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _scalars(value) -> bool:
    """A list or tuple of plain values (strings, numbers, None): what a data loader's default
    collate makes of per-sample strings, such as file names or captions."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(v, (str, bytes, int, float, bool, type(None))) for v in value)
    )


def _samples(leaf) -> int | None:
    """Samples along dimension 0 of a tensor or numpy array; None for what has no such axis."""
    if isinstance(leaf, (torch.Tensor, np.ndarray)) and leaf.ndim:
        return leaf.shape[0]
    return None


def batch_size(batch) -> int:
    """Samples in ``batch``: the common length of dimension 0 of its tensors and numpy arrays
    (0-dim ones aside)."""
    sizes = {n for n in map(_samples, tree_flatten(batch)[0]) if n is not None}
    if len(sizes) != 1:
        raise ValueError(
            "cannot tell the batch size: "
            + (
                "no tensor with a batch dimension"
                if not sizes
                else f"tensors disagree on dimension 0 ({sorted(sizes)})"
            )
            + " in the batch; every tensor with dimensions must hold the samples along dim 0"
        )
    return sizes.pop()


def _split(batch, micro_batch: int) -> list:
    """``batch`` cut along dim 0 in pieces of ``micro_batch`` samples; the last may be smaller.

    Tensors and numpy arrays are cut, and so is a list or tuple of plain values as long as the
    batch (per-sample names); anything else reaches every piece whole."""
    n = batch_size(batch)
    leaves, spec = tree_flatten(batch, is_leaf=lambda v: _scalars(v) and len(v) == n)

    def cut(leaf, begin: int):
        if _scalars(leaf):
            return type(leaf)(leaf[begin : begin + micro_batch])
        return leaf if _samples(leaf) is None else leaf[begin : begin + micro_batch]

    return [
        tree_unflatten([cut(leaf, begin) for leaf in leaves], spec)
        for begin in range(0, n, micro_batch)
    ]


def _sync_control(model):
    """A factory of contexts that turn gradient synchronisation off, or None if there is none."""
    if model is None:
        return None
    if hasattr(model, "no_sync"):  # DistributedDataParallel, FSDP1
        return model.no_sync
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 (fully_shard)

        @contextlib.contextmanager
        def no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return no_sync
    return None


def _averaging_ranks(model, data_parallel_size) -> int:
    """Ranks whose gradients the wrapper averages; a sum loss is scaled back up by this many."""
    if data_parallel_size is not None:
        return positive_int("data_parallel_size", data_parallel_size)
    if _sync_control(model) is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(getattr(model, "process_group", None))


def _window(pieces: list, sync_control, reduction: str, sum_scale: int) -> Iterator[MicroBatch]:
    sizes = [batch_size(p) for p in pieces]
    total = sum(sizes)
    for index, (piece, size) in enumerate(zip(pieces, sizes)):
        yield MicroBatch(
            piece,
            index=index,
            steps=len(pieces),
            size=size,
            window_size=total,
            loss_scale=size / total if reduction == "mean" else float(sum_scale),
            sync_control=sync_control,
        )


def micro_batches(
    batch,
    micro_batch: int,
    *,
    model=None,
    reduction: str = "mean",
    data_parallel_size: int | None = None,
) -> Iterator[MicroBatch]:
    """Split one batch into micro-batches whose accumulated gradients equal the batch's.

    Parameters
    ----------
    batch
        A tensor, or a tuple, list or dict of them (nested structures too), with the samples
        along dimension 0. Numpy arrays are cut the same way, and so is a list or tuple of
        strings or numbers as long as the batch (the per-sample names a data loader collates);
        other values and 0-dim tensors are passed to every micro-batch as is.
    micro_batch
        Samples per micro-batch; when it does not divide the batch, the last one is smaller
        and its loss weighs less (mean) so that the result is still the whole batch's gradient.
    model
        The module being trained. A ``DistributedDataParallel`` (or FSDP) module gets gradient
        synchronisation turned off in all micro-batches but the last (``with micro:``); a plain
        module, or None, trains in one process.
    reduction
        How the loss reduces over samples: ``"mean"`` (as ``F.cross_entropy`` by default) or
        ``"sum"``. A loss averaged over something else than samples (tokens with padding) needs
        its own weights: use ``reduction="sum"`` and divide by the window's count yourself.
    data_parallel_size
        Ranks whose gradients the data-parallel wrapper averages (default: the size of its
        process group). Only a sum loss needs it, to undo the averaging.

    Yields
    ------
    MicroBatch
        Use ``with micro:`` around its forward and backward, and ``micro.backward(loss)``.

    Examples
    --------
    >>> import torch
    >>> w = torch.ones(3, requires_grad=True)
    >>> x = torch.arange(15.0).reshape(5, 3)
    >>> for micro in micro_batches(x, 2):
    ...     with micro:
    ...         micro.backward((micro.data @ w).mean())
    >>> torch.allclose(w.grad, x.mean(0))
    True
    """
    _check_reduction(reduction)
    micro_batch = positive_int("micro_batch", micro_batch)
    sync = _sync_control(model)
    return _window(
        _split(batch, micro_batch), sync, reduction, _averaging_ranks(model, data_parallel_size)
    )


def accumulation_windows(
    loader: Iterable,
    steps: int,
    *,
    model=None,
    reduction: str = "mean",
    data_parallel_size: int | None = None,
) -> Iterator[MicroBatch]:
    """Group a stream of micro-batches (a data loader) into accumulation windows of ``steps``.

    Step the optimizer after each ``micro.is_last``. The last window may hold fewer than
    ``steps`` micro-batches (and a micro-batch may be smaller than the others): losses are
    weighted by samples within each window, so every window's gradient is that of its samples'
    mean. Each window's micro-batches are read ahead before the first is yielded, to know the
    window's size; keep them on the CPU if that memory matters. Under data parallelism every
    rank must see the same number of micro-batches (e.g. ``DistributedSampler(drop_last=True)``),
    or the ranks wait for each other forever.

    Parameters are as in :func:`micro_batches`; ``steps`` is the number of micro-batches per window.
    """
    _check_reduction(reduction)
    steps = positive_int("steps", steps)
    sync = _sync_control(model)
    sum_scale = _averaging_ranks(model, data_parallel_size)
    return _windows(iter(loader), steps, sync, reduction, sum_scale)


def _windows(iterator, steps, sync, reduction, sum_scale) -> Iterator[MicroBatch]:
    # A generator apart from accumulation_windows, so that bad arguments raise at the call.
    while pieces := list(itertools.islice(iterator, steps)):
        yield from _window(pieces, sync, reduction, sum_scale)
