"""Module hooks a captured graph cannot keep: the tables planning and every call read.

Capture traces through every submodule but the leaf modules, so a hook on one of them runs once
while capturing and never again (``capture._refuse_dropped_hooks``, ``Snapshot``). Process-wide
hooks (``torch.nn.modules.module.register_module_forward_hook`` and its kin) run on every
module call, so they are refused too, all but those of torch's ``ModuleTracker``:
``FlopCounterMode`` registers them to name the modules it counts in, and they only observe.

Hugging Face transformers (5.x) records ``output_hidden_states``/``output_attentions`` by
forward hooks it installs on the layers the first time a call asks for them, and leaves there:
each appends its layer's output to a collector that exists only during the model's own call.
Capture runs that call, so the graph returns what they recorded; the planned module needs no
hook, and one installed before or after planning never acts on it. They are not refused, and
those a capture installs are removed again (``restoring_output_recorders``): planning leaves
the model as it found it (a call of the same model asking for them from another thread while a
capture runs may have its recorders removed with them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.modules import module as _module
from torch.utils.module_tracker import ModuleTracker

HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

_PROCESS_WIDE_TABLES = (
    _module._global_forward_hooks,
    _module._global_forward_pre_hooks,
    _module._global_backward_hooks,
    _module._global_backward_pre_hooks,
)


def _records_outputs(hook) -> bool:
    """Whether ``hook`` is one of transformers' output recorders."""
    return getattr(hook, "__name__", None) == "output_capturing_hook" and getattr(
        hook, "__module__", ""
    ).startswith("transformers.")


# Observers of module calls, named by class so that torch.distributed is not imported for them:
# ``ModTracker``, under torch's ``MemTracker`` (found by a tester: the memory debugger a user
# would check a plan with was refused).
_OBSERVERS = frozenset({("torch.distributed._tools.mod_tracker", "ModTracker")})


def acts(hook) -> bool:
    """Whether a module hook may change what the planned module computes or does: all but a
    ``ModuleTracker``'s (or ``ModTracker``'s) and transformers' output recorders."""
    owner = getattr(hook, "__self__", None)
    tracks = isinstance(owner, ModuleTracker) or (
        (type(owner).__module__, type(owner).__name__) in _OBSERVERS
    )
    return not (tracks or _records_outputs(hook))


def acting_hooks(table: dict) -> int:
    """How many hooks of a module's hook table may act (``acts``)."""
    return sum(map(acts, table.values()))


@contextlib.contextmanager
def restoring_output_recorders(model: nn.Module) -> Iterator[None]:
    """Remove the transformers output recorders installed inside the block (on the way out,
    by any way out), and the flag that says they are installed."""
    before = {id(m): set(m._forward_hooks) for m in model.modules()}
    flagged = {id(m) for m in model.modules() if "_output_capturing_hooks_installed" in vars(m)}
    try:
        yield
    finally:
        for m in model.modules():
            for key, hook in list(m._forward_hooks.items()):
                if key not in before.get(id(m), ()) and _records_outputs(hook):
                    del m._forward_hooks[key]
            if id(m) not in flagged:
                vars(m).pop("_output_capturing_hooks_installed", None)


def process_wide_hook_count() -> int:
    """How many process-wide module hooks are registered (cheap: read on every call)."""
    return sum(map(len, _PROCESS_WIDE_TABLES))


def process_wide_hooks() -> list[str]:
    """Names of the process-wide module hooks that may act (not a ``ModuleTracker``'s)."""
    return [
        getattr(hook, "__qualname__", repr(hook))
        for table in _PROCESS_WIDE_TABLES
        for hook in table.values()
        if acts(hook)
    ]


def process_wide_hooks_message(where: str) -> str:
    """Why ``where`` cannot run with the process-wide hooks registered now."""
    names = process_wide_hooks()
    return (
        f"process-wide module hooks are registered ({', '.join(names[:4])}"
        f"{', ...' if len(names) > 4 else ''}; torch.nn.modules.module."
        f"register_module_forward_hook and its kin) {where}. They run on every module call, "
        "but the planned module calls the modules its graph traced through as operations: a "
        "hook that changes a value would be frozen into the graph or skipped, and one with "
        "side effects would run on some modules only. Remove them (handle.remove()) while "
        "planning and training with the plan, or register the hook on the modules that need "
        "it and keep those whole (leaf_modules=(...))."
    )
