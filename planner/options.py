"""How a model is captured: every option that changes the captured graph, as one value.

``prepare`` takes a ``CaptureOptions``; ``plan``, ``plan_batch``, ``frontier`` and ``load`` build
one from their arguments and pass it on, and a saved plan records it, so the options cannot drift
between entry points (a plan made with ``leaf_modules`` loads with them).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.capture import module_classes


@dataclass(frozen=True)
class CaptureOptions:
    """What decides the captured graph, besides the model, its mode and the inputs' shapes.

    Parameters
    ----------
    leaf_modules
        Module classes to keep whole (e.g. a transformer block class): segments then start and
        end at their boundaries, and hooks on them, such as FSDP2 sharding per block, keep
        running. One class alone is accepted too. Under ``torch.export`` too: see
        ``planner.export_leaves``.
    dynamic_shapes
        For models captured by ``torch.export``: let the planned module take other sizes of its
        tensor arguments than the example's. Models ``symbolic_trace`` captures take other sizes
        without it. Either way the budget holds up to the example's sizes: a call with a larger
        dimension warns once.
    """

    leaf_modules: tuple[type, ...] = ()
    dynamic_shapes: bool = False

    def __post_init__(self):
        object.__setattr__(self, "leaf_modules", module_classes(self.leaf_modules))
        if not isinstance(self.dynamic_shapes, bool):
            raise TypeError(f"dynamic_shapes must be True or False, got {self.dynamic_shapes!r}")
