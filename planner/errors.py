"""The one exception type the planner raises for problems a user can act on."""


class PlanningError(RuntimeError):
    """A model, its inputs or a budget that cannot be planned; the message says what to do next."""
