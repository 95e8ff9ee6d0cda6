"""Small built-in models for the demo, the tests and the benchmarks.

Each factory returns ``(model, example_inputs)``: the model in train mode and a tuple of
positional arguments for it. Every factory takes keyword-only ``seed`` (weights and inputs are
drawn after ``torch.manual_seed(seed)``, so two calls give identical models) and ``device``:

- ``device=None`` builds on the CPU;
- ``device="meta"`` builds parameters, buffers and inputs on the meta device, allocating no
  memory, so that a 7B-parameter-class decoder can be built for planning only
  (``gpt(**gpt_config_7b(), device="meta")``);
- any other device builds on the CPU, then moves there (same values as on the CPU).

Defaults are small: one CPU training step of any of them takes well under a second.

Each model exists to exercise one structure a checkpoint planner meets:

=========== ================================================================================
name        structure
=========== ================================================================================
mlp         a plain chain: every layer is an articulation point (Chen's setting)
resnet      residual blocks with BatchNorm: one articulation point per block, running stats
gpt         pre-LN decoder with explicit attention: big attention matrices, dropout, tied weights
bert        post-LN encoder with a mask input and a dict output
unet        long skip connections: few articulation points, cuts crossed by several tensors
untraceable a Python loop over a tensor size: ``symbolic_trace`` fails, ``torch.export`` works
=========== ================================================================================

The factories live by family (``chains``, ``vision``, ``transformers``; ``common`` holds what
they share) and are all reachable from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.zoo.chains import mlp_chain, untraceable_mlp
from planner.zoo.common import Example
from planner.zoo.transformers import bert, gpt, gpt_config_7b
from planner.zoo.vision import resnet, unet

__all__ = [
    "MODELS",
    "bert",
    "build",
    "gpt",
    "gpt_config_7b",
    "mlp_chain",
    "resnet",
    "unet",
    "untraceable_mlp",
]

MODELS: dict[str, Callable[..., Example]] = {
    "mlp": mlp_chain,
    "resnet": resnet,
    "gpt": gpt,
    "bert": bert,
    "unet": unet,
    "untraceable": untraceable_mlp,
}


def build(name: str, **overrides: Any) -> Example:
    """Build the model registered as ``name``, passing ``overrides`` to its factory.

    >>> model, inputs = build("mlp", depth=4)
    """
    try:
        factory = MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None
    return factory(**overrides)
