"""Peak memory of a CPU training step, measured: a dispatch mode that counts live storages.

There are no allocator statistics on the CPU, so :class:`LiveStorageTracker` watches every
operator of the step, forward, backward and the recomputation inside ``torch.utils.checkpoint``
alike. Each storage it has not seen before adds its ``nbytes()`` to a running total, and a
``weakref.finalize`` on the storage subtracts them when the storage dies. This works because
PyTorch keeps a storage's Python object alive for as long as the C++ storage lives, so the
finalizer fires when the memory is released and not when the Python wrapper goes out of scope
(checked at run time by :func:`_storage_finalizers_track_storage_lifetime`). Temporary buffers
that an operator allocates and frees inside its own kernel are not visible to it.
:func:`planner.step.peak_memory` runs a step under it (or reads the CUDA allocator's statistics).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveStorageTracker", "MemoryReport"]


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
