"""Calling a captured module like the model: the model's signature, fixed arguments and output
container types (``ModelCall``, installed as module hooks and found under ``CALL_KEY``)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import torch
from torch import fx, nn
from torch.utils._pytree import TreeSpec, tree_leaves, tree_structure

CALL_KEY = "planner.call"  # GraphModule.meta key of a module's ModelCall


class ModelCall:
    """What a captured module needs to be called like the model it was captured from.

    ``torch.export`` gives a module whose ``forward`` takes exactly the example's arguments,
    positional and keyword as in the example, non-tensor ones included; ``symbolic_trace``
    rebuilds ``OrderedDict`` and ``ModelOutput`` outputs as plain ``dict``. A ``ModelCall``
    binds a call to the model's own signature (defaults, keywords given positionally, the
    arguments planner fixed such as ``use_cache=False``) and puts the output's container types
    back. Calls the captured graph cannot compute like the model (another non-tensor value, a
    tensor added) raise instead of computing something else; a tensor argument left out is
    passed on as None (the planned module then runs that call form's own plan).
    """

    def __init__(
        self,
        model: nn.Module,
        args: tuple | None,
        kwargs: dict | None,
        *,
        fixed: dict | None = None,
        output=None,
        checks=(),
        constants: dict | None = None,
    ):
        self.model_name = type(model).__name__
        self.signature = inspect.signature(model.forward)
        self.fixed = dict(fixed or {})
        self.output_types = output
        self.checks = list(checks)  # each is called with the inputs as the graph takes them
        self.binds = args is not None
        # Arguments holding no tensor, by name: the graph computes with these values. Given for
        # a traced graph, which takes the call as it is, they are checked all the same: fx
        # asserts only values of a few types (bool, int, str, ...), not a generator, an enum
        # or a config object.
        self.constants = dict(constants or {})
        if args is not None:
            kwargs = {} if kwargs is None else kwargs
            passed = self._passed(args, kwargs)
            self.positional = tuple(self.signature.parameters)[: len(args)]
            self.keywords = tuple({**kwargs, **self.fixed})
            self.constants = {
                name: value
                for name, value in passed.items()
                if not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))
            }
            # The graph takes the tensors of a list or dict argument one by one, as many as
            # the example had: another structure (a third crop, another key) is refused.
            self.structures = {
                name: tree_structure(value)
                for name, value in passed.items()
                if name not in self.constants and not isinstance(value, torch.Tensor)
            }

    def _passed(self, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name (``**kwargs`` ones too), planner's fixed ones added."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self.model_name}.forward{self.signature}: {error}") from None
        passed = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind == inspect.Parameter.VAR_KEYWORD:
                passed.update(value)
            elif kind != inspect.Parameter.VAR_POSITIONAL:
                passed[name] = value
        return {**self.fixed, **passed}

    def _default(self, name: str):
        parameter = self.signature.parameters.get(name)
        if parameter is None or parameter.default is parameter.empty:
            return None
        return parameter.default

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call ``model(*args, **kwargs)`` as the captured module takes it."""
        if not self.binds:
            if self.constants:
                passed = self._passed(args, kwargs)
                for name in self.constants:
                    self._check_constant(name, passed.get(name, self._default(name)))
            return args, kwargs
        passed = self._passed(args, kwargs)
        captured = (*self.positional, *self.keywords)
        added = [
            name
            for name, value in passed.items()
            if name not in captured and not _same(value, self._default(name))
        ]
        if added:
            raise TypeError(
                f"this plan of {self.model_name} was made for calls without "
                f"{', '.join(added)}: its graph has no input for them. Plan with them in "
                "example_inputs or example_kwargs to train with them."
            )
        values = {name: passed.get(name, self._default(name)) for name in captured}
        for name, value in values.items():
            if name in self.fixed and not _same(value, self.fixed[name]):
                raise ValueError(
                    f"planner plans {self.model_name} for training with {name}="
                    f"{self.fixed[name]!r}; this call passes {name}={value!r}. Leave {name} "
                    f"out (or pass {self.fixed[name]!r}), and use the model itself where you "
                    "need its cache (generation)."
                )
            if name in self.constants:
                self._check_constant(name, value)
            if name in self.structures and value is not None:
                self._check_structure(name, value)
        graph_args = tuple(values[name] for name in self.positional)
        graph_kwargs = {name: values[name] for name in self.keywords}
        for check in self.checks:
            check(graph_args, graph_kwargs)
        return graph_args, graph_kwargs

    def _check_constant(self, name: str, value) -> None:
        if not _same(value, self.constants[name]):
            raise ValueError(
                f"this plan of {self.model_name} was captured with {name}="
                f"{self.constants[name]!r} and computes with that value; this call passes "
                f"{name}={value!r}. Plan again with {name}={value!r} in the example inputs."
            )

    def _check_structure(self, name: str, value) -> None:
        expected = self.structures[name]
        if tree_structure(value) != expected:
            raise TypeError(
                f"this plan of {self.model_name} was captured with {name} holding "
                f"{_described(expected)}; this call passes {_described(tree_structure(value))}. "
                "Its graph takes exactly the example's tensors, so it would compute something "
                f"else: plan with an example {name} of the structure you train with (one "
                "plan per structure)."
            )

    def output(self, value):
        """``value`` with the container types of the model's own output."""
        return _retyped(self.output_types, value) if self.output_types is not None else value

    def install(self, gm: fx.GraphModule) -> None:
        """Make ``gm`` take the model's calls and return its output types (module hooks)."""
        gm.meta[CALL_KEY] = self
        if self.binds or self.constants:
            gm.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        if self.output_types is not None:
            gm.register_forward_hook(self._after_forward)

    def _before_forward(self, module, args, kwargs):
        return self.inputs(args, kwargs)

    def _after_forward(self, module, args, output):
        return self.output(output)


def _described(spec: TreeSpec) -> str:
    """A list, tuple or dict argument's structure, in words: its type and keys or length."""
    if spec.type in (list, tuple):
        return f"a {spec.type.__name__} of {spec.num_children} items"
    if spec.type is not None and issubclass(spec.type, Mapping):
        return f"a {spec.type.__name__} with keys {list(spec.context)}"
    return str(spec)


def _same(value, expected) -> bool:
    if value is expected:
        return True
    if isinstance(value, torch.Tensor) or isinstance(expected, torch.Tensor):
        return False
    try:
        return bool(value == expected)
    except Exception:  # noqa: BLE001 - incomparable values are not the same
        return False


def container_types(output):
    """The mapping types in ``output`` that fx rebuilds as plain ``dict`` (None if there are
    none), as a tree: ``(type, {key: subtree})`` or ``(type, [subtree, ...])``."""
    if isinstance(output, Mapping):
        children = {key: container_types(value) for key, value in output.items()}
        keep = type(output) is not dict or any(c is not None for c in children.values())
        return (type(output), children) if keep else None
    if isinstance(output, (list, tuple)):
        elements = [container_types(value) for value in output]
        return (type(output), elements) if any(c is not None for c in elements) else None
    return None


def _retyped(template, value):
    if template is None:
        return value
    kind, children = template
    if isinstance(children, dict):
        items = {key: _retyped(children.get(key), item) for key, item in value.items()}
        if kind is dict:
            return items
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):  # Hugging Face ModelOutput
            return kind(**items)
        return kind(items)
    values = [_retyped(child, item) for child, item in zip(children, value)]
    return kind(*values) if hasattr(kind, "_fields") else kind(values)
