"""What every example model's factory shares: the ``(model, inputs)`` pair and how it is built
under a seed on a device (see ``planner.zoo``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Example = tuple[nn.Module, tuple[torch.Tensor, ...]]


def make(build: Callable[[], Example], seed: int, device: str | torch.device | None) -> Example:
    """Run ``build`` under ``seed`` on ``device``; return the model in train mode."""
    torch.manual_seed(seed)
    device = None if device is None else torch.device(device)
    if device is not None and device.type == "meta":
        # Factory functions (parameter init, torch.randint, ...) allocate nothing on meta.
        with device:
            model, inputs = build()
    else:
        # Build on the CPU so that the values do not depend on the target device's RNG.
        model, inputs = build()
        if device is not None:
            model = model.to(device)
            inputs = tuple(t.to(device) for t in inputs)
    return model.train(), tuple(inputs)
