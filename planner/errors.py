"""The one exception type the planner raises for problems a user can act on, and the helpers
that word its checks of bad input."""

import numbers


class PlanningError(RuntimeError):
    """A model, its inputs or a budget that cannot be planned; the message says what to do next."""


class InputsRefused(PlanningError):
    """The model's own forward raised on the example inputs (a BatchNorm given one sample per
    channel, a wrong shape): other inputs of the same model may plan (``plan_batch`` skips
    such a micro-batch size)."""


def short_repr(value) -> str:
    """A bad value as an error message names it: its type and repr, or its size when long."""
    text, kind = repr(value), type(value).__name__
    if len(text) <= 60:
        return f"{kind} {text}"
    return f"a {kind}" + (f" of {len(value)} items" if hasattr(value, "__len__") else "")


def non_negative_int(name: str, value) -> int:
    """``value`` as an int, or a ValueError naming ``name`` when it is not an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer (bytes), got {short_repr(value)}")
    return int(value)


def positive_int(name: str, value) -> int:
    """``value`` as an int, or a ValueError naming ``name`` when it is not a positive integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def checkpointing_disable_advice(model) -> str:
    """How to turn a library's own checkpointing off, in the name the installed version uses:
    transformers 5 deprecates ``gradient_checkpointing_disable`` for
    ``activation_checkpointing_disable``; diffusers names it ``disable_gradient_checkpointing``
    (found by a tester)."""
    for method in (
        "activation_checkpointing_disable",
        "gradient_checkpointing_disable",
        "disable_gradient_checkpointing",
    ):
        if callable(getattr(model, method, None)):
            return f"call model.{method}()" + input_require_grads_advice(model)
    return "turn the library's gradient checkpointing off"


def input_require_grads_advice(model) -> str:
    """Hugging Face's checkpointing also hooks the input embeddings to require grad
    (``enable_input_require_grads``), and disabling checkpointing leaves that hook, which
    planning refuses (found by a tester): how to remove it, where the model holds one."""
    if getattr(model, "_require_grads_hooks", None):
        return " and model.disable_input_require_grads()"
    return ""
