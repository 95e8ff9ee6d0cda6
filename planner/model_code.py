"""The model's own Python code: what capture ran once and the planned module never runs again.

Tracing bakes in what that code read beside tensors (class attributes, module globals), and
loses what it changed (a list of auxiliary losses at module level). ``planner.planned_module``
compares what it read on every call and ``planner.side_effects`` refuses what it changed; both
find that code here.
"""

from __future__ import annotations

import dis
import functools
import types
from typing import Any

from torch import nn

__all__ = ["codes", "global_loads", "loaded_attributes", "method_codes"]

_ENTRIES = ("forward", "__call__")


@functools.cache
def codes(cls: type) -> tuple[tuple[types.CodeType, dict], ...]:
    """The code a call of a ``cls`` module may run, each with the globals it reads them from
    (its function's, whatever module loaded it): ``forward``, the methods and properties of
    ``cls`` that code names (``self.attention(...)``, ``getattr(self, "norm")``, a parent's
    ``forward`` through ``super()``), what decorators wrap (``functools.wraps``), the functions
    nested in them, and the functions of their own module they call (a helper beside the
    class). nn.Module's own methods are left out, and so are functions of other modules: a
    library's would take the whole library in."""
    classes = [k for k in cls.__mro__ if k not in (nn.Module, object)]
    found: dict[int, tuple[types.CodeType, dict]] = {}  # by identity: equal code may differ

    def named(name: str):
        for klass in classes:
            value = vars(klass).get(name)
            value = value.fget if isinstance(value, property) else value
            function: Any = getattr(value, "__func__", value)
            while isinstance(getattr(function, "__code__", None), types.CodeType):
                yield function.__code__, function.__globals__
                function = getattr(function, "__wrapped__", None)  # under a decorator

    pending: list[tuple[types.CodeType, dict]] = [
        entry for name in _ENTRIES for entry in named(name)
    ]
    while pending:
        code, space = pending.pop()
        if id(code) in found:
            continue
        found[id(code)] = code, space
        pending += [(c, space) for c in code.co_consts if isinstance(c, types.CodeType)]
        for name in (*code.co_names, *(c for c in code.co_consts if isinstance(c, str))):
            pending += named(name)
        for key in _loaded_globals(code):
            helper = space.get(key)
            if isinstance(helper, types.FunctionType) and helper.__globals__ is space:
                pending.append((helper.__code__, space))
    return tuple(found.values())


def _loaded_globals(code: types.CodeType) -> list[str]:
    return [
        instruction.argval
        for instruction in dis.get_instructions(code)
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    ]


@functools.cache
def global_loads(cls: type) -> tuple[tuple[dict, str], ...]:
    """``(globals, key)`` of every name that the code of ``cls`` (``codes``) loads as a
    global, once each."""
    loads = {
        (id(space), key): (space, key)
        for code, space in codes(cls)
        for key in _loaded_globals(code)
    }
    return tuple(loads.values())


@functools.cache
def method_codes(cls: type) -> tuple[types.CodeType, ...]:
    """The code of every method and property of ``cls`` (not nn.Module's own), nested functions
    too, whether a call runs it or not: where its attributes are named (``__init__`` sets
    those that a library's function, handed the module, reads)."""
    found = []
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        for value in vars(klass).values():
            value = value.fget if isinstance(value, property) else value
            code = getattr(getattr(value, "__func__", value), "__code__", None)
            stack = [code] if isinstance(code, types.CodeType) else []
            while stack:
                code = stack.pop()
                found.append(code)
                stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return tuple(found)


ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})


@functools.cache
def loaded_attributes(cls: type) -> frozenset[str]:
    """The attribute names the code a call may run (``codes``) reads: loaded as attributes, or
    named by a string (``getattr(self, "norm")``); not those it only sets."""
    names: set[str] = set()
    for code, _ in codes(cls):
        names.update(i.argval for i in dis.get_instructions(code) if i.opname in ATTRIBUTE_LOADS)
        names.update(c for c in code.co_consts if isinstance(c, str))
    return frozenset(names)
