"""Optimizer memory: the state ``optimizer.step()`` keeps between steps, and the temporaries it
holds while it runs (``foreach`` implementations make whole-model-sized ones).

Both are found by running the same optimizer, with the same options, for two steps on meta
copies of the parameters it trains: no memory is used and nothing of the user's is touched, and
any optimizer is counted as it really allocates (Adam and AdamW: two tensors per parameter, plus
a step counter; SGD with momentum: one; without: none).

Master weights: a low-precision model (``model.to(torch.bfloat16)``) is often trained through
float32 copies of its parameters, which the optimizer updates and which are copied back after
each step. An optimizer given those copies counts them: parameters it trains that are not the
model's are master weights, live between steps like its state, and their gradients (filled from
the model's before ``step()``) are among the step's temporaries.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from planner.errors import PlanningError

__all__ = ["OptimizerMemory", "optimizer_memory"]


@dataclass(frozen=True)
class OptimizerMemory:
    """Bytes of an optimizer: ``state_bytes`` live between steps (from the first step on), and
    ``step_bytes`` the most that ``step()`` holds at once beyond parameters, gradients and
    state."""

    state_bytes: int
    step_bytes: int
    master_bytes: int = 0  # float32 master weights, included in state_bytes (their grads: step)


class _Allocations(TorchDispatchMode):
    """Live bytes of the storages created under it, and their high-water mark."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.high = 0
        self.tracked: dict[int, tuple[int, weakref.ref]] = {}

    def _free(self, cdata: int, reference: weakref.ref) -> None:  # a weakref callback
        self.live -= self.tracked.pop(cdata)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
                continue
            storage = t.untyped_storage()
            cdata = storage._cdata
            if cdata in seen or cdata in self.tracked:
                continue
            reference = weakref.ref(storage, functools.partial(self._free, cdata))
            self.tracked[cdata] = (storage.nbytes(), reference)
            self.live += storage.nbytes()
        self.high = max(self.high, self.live)
        return out


def _meta_groups(groups: list[dict], on_cuda: bool, gradless: frozenset[int]) -> list[dict]:
    """The parameter groups on meta copies (with gradients where they train: they require grad
    and their ``id`` is not in ``gradless``), options kept. Fused kernels do not
    run on meta: their state is the same as the plain one's. On CUDA, PyTorch defaults to the
    ``foreach`` implementation: the copies ask for it, since meta tensors would not."""
    result = []
    for group in groups:
        params = []
        for p in group["params"]:
            # A frozen parameter gets no gradient, and so no state (found trying the library:
            # AdamW given a frozen backbone's parameters counted 24 MiB of state for 4).
            copy = torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
            if p.requires_grad and id(p) not in gradless:
                copy.grad = torch.empty_like(copy)
            params.append(copy)
        options = {**group, "params": params}
        if options.get("fused"):
            options["fused"] = False
        if on_cuda and "foreach" in options and options["foreach"] is None:
            options["foreach"] = True
        result.append(options)
    return result


def optimizer_memory(
    optimizer, model: nn.Module | None = None, gradless: frozenset[int] = frozenset()
) -> OptimizerMemory:
    """State and step bytes of ``optimizer`` for the parameters it would train.

    Parameters
    ----------
    optimizer
        An optimizer instance (its parameter groups and options are used: frozen parameters it
        was not given do not count), or a class or factory called with the trainable parameters
        of ``model`` (``torch.optim.AdamW``, ``functools.partial(torch.optim.SGD, lr=0.1,
        momentum=0.9)``).
    model
        Needed for a class or factory. With an instance, the parameters it trains that are not
        ``model``'s are counted as master weights (see the module docstring).
    gradless
        ``id`` of parameters that require grad but get no gradient in the step (an unused head,
        a teacher under ``no_grad``; ``Profile.gradless``): PyTorch's optimizers make them no
        state (found by a tester: 15-22% over-predicted).

    Examples
    --------
    >>> import torch
    >>> model = torch.nn.Linear(10, 10)  # 110 parameters, 440 bytes
    >>> optimizer_memory(torch.optim.Adam(model.parameters())).state_bytes  # 2 x 440 + 2 x 4
    888
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        groups, make, defaults = optimizer.param_groups, type(optimizer), optimizer.defaults
        master_bytes = _master_bytes(groups, model)
    elif callable(optimizer):
        if model is None:
            raise TypeError("an optimizer class or factory needs the model to count its state")
        trainable = [p for p in model.parameters() if p.requires_grad]
        probe = optimizer([torch.empty(0, requires_grad=True)])
        if not isinstance(probe, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer= must be a torch.optim.Optimizer, its class or a factory of one; "
                f"{optimizer!r} returned {type(probe).__name__}"
            )
        groups, make, defaults = [{**probe.param_groups[0], "params": trainable}], optimizer, {}
        master_bytes = 0
    else:
        raise TypeError(
            f"optimizer= must be a torch.optim.Optimizer, its class or a factory of one, got "
            f"{type(optimizer).__name__}"
        )
    on_cuda = any(p.device.type == "cuda" for g in groups for p in g["params"])
    meta_groups = _meta_groups(groups, on_cuda, gradless)
    # The state is what the constructor and the first step make and keep, wherever the
    # optimizer keeps it: in ``self.state``, or in attributes of its own (found trying the
    # library: a hand-written momentum kept in ``self.bufs`` went uncounted, 50% over budget).
    made = _Allocations()
    with made:
        meta = _rebuild(make, meta_groups, defaults)
        _step_on_meta(meta)
    storages = {cdata: nbytes for cdata, (nbytes, _) in made.tracked.items()}
    storages.update(
        (t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        for t in tree_leaves(list(meta.state.values()))
        if isinstance(t, torch.Tensor)
    )
    allocations = _Allocations()
    with allocations:
        _step_on_meta(meta)  # a later step: its temporaries on top of the state
    return OptimizerMemory(
        state_bytes=sum(storages.values()) + master_bytes,
        step_bytes=allocations.high + master_bytes,
        master_bytes=master_bytes,
    )


def _rebuild(make, groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
    """``make(groups)``: the optimizer's class (or the factory given) on the meta copies. A
    class whose constructor requires options beside the parameters (``lr`` without a default)
    gets those it recorded in its ``defaults``; one that takes something else (a wrapper
    such as Lookahead, built on another optimizer) cannot be rebuilt."""
    try:
        try:
            return make(groups)
        except TypeError:
            if not defaults:
                raise
            return make(groups, **defaults)
    except Exception as error:
        name = getattr(make, "__name__", type(make).__name__)
        raise PlanningError(
            f"cannot count the memory of optimizer {name}: planning builds it again on meta "
            f"copies of its parameter groups, as {name}(param_groups), and that failed "
            f"({type(error).__name__}: {error}). Pass a factory that takes the parameters "
            "alone (functools.partial(MyOptimizer, lr=...)). Or: " + _BY_HAND
        ) from error


# Found by a tester: the state's bytes alone, as the advice said, left out what step() allocates
# (Adafactor's step 25% over the budget, with foreach 50%).
_BY_HAND = (
    "Pass optimizer_state_bytes= instead of optimizer=: its state's bytes plus the most its "
    "step() allocates at once (a foreach step: a few copies of the gradients), which the plan "
    "then holds through the whole step"
)


def _step_on_meta(optimizer: torch.optim.Optimizer) -> None:
    """One step on meta tensors; a clear error for an optimizer whose step reads a value
    (``Adafactor``'s ``.item()``), which meta tensors do not have, or needs a closure that
    re-evaluates the model (``LBFGS``)."""
    try:
        optimizer.step()
    except (RuntimeError, NotImplementedError, TypeError) as error:
        if isinstance(error, TypeError):
            why = "its step needs a closure that runs the model, and planning steps it without one"
        elif "sparse" in str(error).lower():  # SparseAdam: "does not support dense gradients"
            why = (
                "it takes sparse gradients (an embedding with sparse=True), and planning steps "
                "it on dense meta copies"
            )
        else:
            why = "its step reads tensor values, and planning steps it on the meta device"
        raise PlanningError(
            f"cannot count the memory of {type(optimizer).__name__}: {why} ({error}). " + _BY_HAND
        ) from error


def _master_bytes(groups: list[dict], model: nn.Module | None) -> int:
    """Bytes of the parameters an optimizer trains that are not ``model``'s: master weights."""
    if model is None:
        return 0
    own = {p.untyped_storage()._cdata for p in model.parameters()}
    master = {
        p.untyped_storage()._cdata: p.untyped_storage().nbytes()
        for group in groups
        for p in group["params"]
        if p.untyped_storage()._cdata not in own
    }
    return sum(master.values())
