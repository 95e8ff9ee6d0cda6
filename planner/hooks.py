"""Module hooks a captured graph cannot keep: the tables planning and every call read.

Capture traces through every submodule but the leaf modules, so a hook on one of them runs once
while capturing and never again (``capture._refuse_dropped_hooks``, ``Snapshot``). Process-wide
hooks (``torch.nn.modules.module.register_module_forward_hook`` and its kin) run on every
module call, so they are refused too, all but those of torch's ``ModuleTracker``:
``FlopCounterMode`` registers them to name the modules it counts in, and they only observe.
"""

from __future__ import annotations

from torch.nn.modules import module as _module
from torch.utils.module_tracker import ModuleTracker

HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

_PROCESS_WIDE_TABLES = (
    _module._global_forward_hooks,
    _module._global_forward_pre_hooks,
    _module._global_backward_hooks,
    _module._global_backward_pre_hooks,
)


def process_wide_hook_count() -> int:
    """How many process-wide module hooks are registered (cheap: read on every call)."""
    return sum(map(len, _PROCESS_WIDE_TABLES))


def process_wide_hooks() -> list[str]:
    """Names of the process-wide module hooks that may act (not a ``ModuleTracker``'s)."""
    return [
        getattr(hook, "__qualname__", repr(hook))
        for table in _PROCESS_WIDE_TABLES
        for hook in table.values()
        if not isinstance(getattr(hook, "__self__", None), ModuleTracker)
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
