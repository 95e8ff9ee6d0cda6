"""Specification of ``planner.profile``: what the annotations count, and that a model already on
the meta device (profiled on meta copies, without ``FakeTensorMode``) is annotated exactly like the
same model on the CPU (profiled on fake tensors)."""

import pytest
import torch
from torch import nn

import planner.profile
from planner import zoo
from planner.capture import capture
from planner.pipeline import prepare
from planner.profile import COMPUTE_OPS, META_KEYS, profile
from planner.rewrite import rewrite
from planner.simulate import Choice, simulate
from planner.step import peak_memory

SMALL = {
    "gpt": lambda device: zoo.gpt(
        layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=2, device=device
    ),
    "resnet": lambda device: zoo.resnet(blocks=2, channels=8, batch=2, image=16, device=device),
    "untraceable": lambda device: zoo.untraceable_mlp(steps=4, width=16, batch=4, device=device),
}


def annotations(gm, inputs):
    """Every annotation of every compute node, and the Profile's fields but its timing."""
    result = profile(gm, inputs)
    nodes = [
        (node.name, {key: node.meta[key] for key in META_KEYS})
        for node in gm.graph.nodes
        if node.op in COMPUTE_OPS
    ]
    return nodes, (
        result.storage_bytes,
        result.fixed_kind,
        result.trainable,
        result.output_storages,
    )


@pytest.mark.parametrize("name", sorted(SMALL))
def test_a_meta_model_is_annotated_like_the_same_model_on_the_cpu(name):
    on_meta, meta_inputs = SMALL[name]("meta")
    on_cpu, cpu_inputs = SMALL[name](None)
    assert annotations(capture(on_meta, meta_inputs).graph_module, meta_inputs) == annotations(
        capture(on_cpu, cpu_inputs).graph_module, cpu_inputs
    )


def test_a_meta_model_is_profiled_without_fake_tensors(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("FakeTensorMode entered for a model on the meta device")

    monkeypatch.setattr(planner.profile, "FakeTensorMode", refuse)
    model, inputs = zoo.mlp_chain(depth=3, device="meta")
    profile(capture(model, inputs).graph_module, inputs)


def test_the_users_meta_model_and_inputs_are_untouched():
    # BatchNorm updates its buffers in place; an input that requires grad would get a .grad.
    model, (images,) = zoo.resnet(blocks=2, channels=8, batch=2, image=16, device="meta")
    images.requires_grad_()
    tensors = dict([*model.named_parameters(), *model.named_buffers(), ("images", images)])
    versions = {name: t._version for name, t in tensors.items()}
    profile(capture(model, (images,)).graph_module, (images,))
    after = dict([*model.named_parameters(), *model.named_buffers(), ("images", images)])
    assert all(after[name] is t for name, t in tensors.items())
    assert {name: t._version for name, t in after.items()} == versions
    assert all(t.grad is None for t in after.values())


@pytest.mark.parametrize("device", [None, "meta"])
def test_bytes_moved_counts_what_the_ops_read_and_write(device):
    # One Linear: addmm reads the input, the weight (through a transposed view) and the bias,
    # and writes the output. Fake tensors dispatch ``tensor.device`` like an op: it moves nothing.
    batch, width = 8, 16
    model, inputs = zoo.mlp_chain(depth=1, width=width, batch=batch, device=device)
    gm = capture(model, inputs).graph_module
    profile(gm, inputs)
    (linear,) = [node for node in gm.graph.nodes if node.op in COMPUTE_OPS]
    float_bytes = 4
    moved = float_bytes * (batch * width + width * width + width + batch * width)
    assert linear.meta["planner.bytes_moved"] == moved


@pytest.mark.parametrize("device", [None, "meta"])
def test_profiling_the_same_graph_twice_gives_the_same_annotations(device):
    model, inputs = SMALL["gpt"](device)
    gm = capture(model, inputs).graph_module
    assert annotations(gm, inputs) == annotations(gm, inputs)


class Scaled(nn.Module):
    """Holds a plain tensor attribute (neither parameter nor buffer), read inside the module."""

    def __init__(self, device=None):
        super().__init__()
        self.linear = nn.Linear(8, 8, device=device)
        self.scale = torch.full((8,), 0.5, device=device)

    def forward(self, x):
        return self.linear(x) * self.scale


@pytest.mark.parametrize("leaf", [False, True])
def test_tensor_attributes_of_modules_are_annotated_alike_on_meta_and_cpu(leaf):
    # Kept whole (a leaf module), its attribute is first met while the node runs.
    results = []
    for device in ("meta", "cpu"):
        torch.manual_seed(0)
        model, inputs = nn.Sequential(Scaled(device), nn.ReLU()), (torch.ones(4, 8, device=device),)
        leaf_modules = (Scaled,) if leaf else ()
        results.append(
            annotations(capture(model, inputs, leaf_modules=leaf_modules).graph_module, inputs)
        )
    assert results[0] == results[1]


def test_a_batch_norm_whose_input_needs_no_gradient_allocates_none_in_backward():
    """``native_batch_norm_backward``'s fake kernel returns an input gradient even where its
    ``output_mask`` asks for none; the CPU kernel makes none. The profile counts what the CPU
    does, so a checkpointed step's measured peak matches the prediction."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4))
    args = (torch.randn(256, 4),)  # needs no gradient, so neither does the norm's input
    captured, problem = prepare(model, args)
    norm = problem.labels.index("0")
    assert problem.activation_grad_alloc[norm] == 0  # its weight and bias gradients only
    whole = Choice(((norm, problem.size),))
    module = rewrite(captured.graph_module, model, whole)
    measured = peak_memory(module, args).activation_peak_bytes
    predicted = simulate(problem, whole).peak_bytes - problem.fixed_bytes
    assert abs(predicted - measured) <= 16, (predicted, measured)


def test_the_backward_of_a_tensor_passed_through_unchanged_is_charged_to_its_maker():
    """``Dropout(p=0.0)`` in train mode returns its input itself, with the GELU's ``grad_fn``.
    The GELU's backward (its input gradient) runs after the GELU's recompute when the GELU is
    checkpointed, so it is charged to the GELU, not to the dropout after it: charged to the
    dropout, the prediction was 131,080 bytes under the measured peak of this step (the
    cause of BART's overshoot in the Hugging Face matrix)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(p=0.0), nn.Linear(256, 64))
    args = (torch.randn(128, 64),)
    captured, problem = prepare(model, args)
    gelu, dropout = problem.labels.index("1"), problem.labels.index("2")
    assert problem.activation_grad_alloc[gelu] == 128 * 256 * 4
    assert problem.activation_grad_alloc[dropout] == 0
    linear_and_gelu = Choice(((0, dropout),))
    module = rewrite(captured.graph_module, model, linear_and_gelu)
    measured = peak_memory(module, args).activation_peak_bytes
    predicted = simulate(problem, linear_and_gelu).peak_bytes - problem.fixed_bytes
    assert abs(predicted - measured) <= 16, (predicted, measured)
