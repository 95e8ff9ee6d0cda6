"""Specification: a model already wrapped by torch.compile, DataParallel or DDP is refused with
what to do instead: plan the wrapped model, then wrap the planned module.

Found trying the library: both failed at export's ``_guards_fn`` with a message that blamed
the example inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import planner


def chain():
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])


def refusal(model) -> str:
    with pytest.raises(planner.PlanningError) as info:
        planner.plan(model, (torch.randn(8, 16),), budget_bytes=10**9)
    return str(info.value)


def test_a_compiled_model_is_refused_with_its_wrapped_model_named():
    message = refusal(torch.compile(chain(), backend="eager"))
    assert "OptimizedModule is a torch.compile'd module" in message
    assert "planner.plan(model._orig_mod, ...)" in message
    assert "torch.compile(plan.module)" in message


def test_a_data_parallel_model_is_refused_with_its_wrapped_model_named():
    message = refusal(nn.DataParallel(chain()))
    assert "DataParallel is an nn.DataParallel wrapper" in message
    assert "planner.plan(model.module, ...)" in message
    # nn.DataParallel replicates by shallow copies on several GPUs: found by review, the
    # advice named nn.DataParallel(plan.module), which fails there.
    assert "DistributedDataParallel(plan.module, ...)" in message


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()) or dist.is_initialized(),
    reason="needs gloo and no process group of this process's own",
)
def test_a_ddp_model_is_refused_with_its_wrapped_model_named():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        message = refusal(nn.parallel.DistributedDataParallel(chain()))
    finally:
        dist.destroy_process_group()
    assert "DistributedDataParallel is a DistributedDataParallel wrapper" in message
    assert "planner.plan(model.module, ...)" in message
    assert "DistributedDataParallel(plan.module, ...)" in message


def test_the_wrapped_model_plans_and_its_planned_module_can_be_wrapped():
    """What the message advises works."""
    model, x = chain(), torch.randn(8, 16)
    wrapped = torch.compile(model, backend="eager")
    p = planner.plan(wrapped._orig_mod, (x,), budget_bytes=10**9, solver="sqrt_n")
    assert p.segments
    expected = model(x)
    torch.testing.assert_close(
        torch.compile(p.module, backend="eager")(x), expected, rtol=0, atol=0
    )
    torch.testing.assert_close(nn.DataParallel(p.module)(x), expected, rtol=0, atol=0)
