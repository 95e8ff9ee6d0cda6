"""Measurements that also see inside ``torch.compile``d code.

Dynamo runs a compiled frame eagerly (without its graph) whenever a ``TorchDispatchMode`` is on
the stack, unless the mode declares ``ignore_compile_internals()``. ``FlopCounterMode`` does not,
so under it a compiled model silently counts as the eager one; the mode below declares it and
so watches the compiled graph's operators (the project's memory tracker declares it too; its
readings on compiled modules were cross-checked against ``torch.profiler`` memory events, equal
to the byte on the GPT model).
"""

from __future__ import annotations

import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from planner.step import training_step


class _FlopMode(TorchDispatchMode):
    """Sums ``torch.utils.flop_counter``'s formulas (those of ``FlopCounterMode``)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


def step_flops(module, args) -> int:
    """FLOPs of one training step (matmul/conv/attention only, as ``FlopCounterMode``)."""
    for p in module.parameters():
        p.grad = None
    mode = _FlopMode()
    with mode:
        training_step(module, args)
    return mode.flops


def saved_bytes(module, args, exclude: list[torch.Tensor]) -> int:
    """Bytes of distinct storages autograd saves for backward during one forward.

    Read with ``torch.autograd.graph.saved_tensors_hooks``; storages of ``exclude``
    (parameters, buffers, inputs) are left out. Inside non-reentrant ``checkpoint`` regions
    the checkpoint's own hooks take over, so this is meaningful for plain and compiled modules.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        try:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args)
    del out
    gc.collect()
    return sum(n for ptr, n in seen.items() if ptr not in skip)
