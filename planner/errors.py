"""The one exception type the planner raises for problems a user can act on."""


class PlanningError(RuntimeError):
    """A model, its inputs or a budget that cannot be planned; the message says what to do next."""


def short_repr(value) -> str:
    """A bad value as an error message names it: its type and repr, or its size when long."""
    text, kind = repr(value), type(value).__name__
    if len(text) <= 60:
        return f"{kind} {text}"
    return f"a {kind}" + (f" of {len(value)} items" if hasattr(value, "__len__") else "")
