"""Specifications of the built-in models in planner.zoo.

Every model trains (finite gradients everywhere), is reproducible from its seed, and is
captured the way the planner expects: five by torch.fx.symbolic_trace, one only by torch.export.
"""

import resource

import pytest
import torch
import torch.fx

from planner import zoo

TRACEABLE = ["mlp", "resnet", "gpt", "bert", "unet"]
ALL = [*TRACEABLE, "untraceable"]


def scalar(output):
    """Reduce a tensor or a dict of tensors to one scalar to call backward on."""
    if isinstance(output, dict):
        return sum(value.float().mean() for value in output.values())
    return output.float().mean()


def assert_same_output(a, b):
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ALL)
def test_factory_returns_model_in_train_mode_and_a_tuple_of_inputs(name):
    model, inputs = zoo.build(name)
    assert isinstance(model, torch.nn.Module)
    assert model.training
    assert isinstance(inputs, tuple) and inputs
    assert all(isinstance(x, torch.Tensor) for x in inputs)


@pytest.mark.parametrize("name", ALL)
def test_one_training_step_gives_finite_gradients_for_every_parameter(name):
    model, inputs = zoo.build(name)
    scalar(model(*inputs)).backward()
    for pname, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, f"{name}: {pname} got no gradient"
            assert torch.isfinite(param.grad).all(), f"{name}: {pname} has a non-finite gradient"


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_model_and_inputs_other_seed_differs(name):
    model_a, inputs_a = zoo.build(name, seed=3)
    model_b, inputs_b = zoo.build(name, seed=3)
    model_c, _ = zoo.build(name, seed=4)
    for a, b in zip(inputs_a, inputs_b):
        assert torch.equal(a, b)
    params_a, params_b, params_c = (list(m.parameters()) for m in (model_a, model_b, model_c))
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert not all(torch.equal(a, c) for a, c in zip(params_a, params_c))


@pytest.mark.parametrize("name", TRACEABLE)
def test_symbolic_trace_gives_the_same_output_under_the_same_seed(name):
    # Seeding before each call makes the dropout masks identical: the traced graph calls the
    # same modules in the same order, so it draws the same random numbers.
    model, inputs = zoo.build(name)
    traced = torch.fx.symbolic_trace(model)
    torch.manual_seed(123)
    expected = model(*inputs)
    torch.manual_seed(123)
    actual = traced(*inputs)
    assert_same_output(expected, actual)


def test_gpt_without_loss_returns_logits_and_traces():
    model, inputs = zoo.gpt(with_loss=False, vocab=100, seq=16, batch=2)
    assert len(inputs) == 1
    model.eval()
    traced = torch.fx.symbolic_trace(model)
    logits = model(*inputs)
    assert logits.shape == (2, 16, 100)
    assert_same_output(logits, traced(*inputs))


def test_gpt_with_loss_returns_a_scalar_near_log_vocab_at_init():
    model, (idx, targets) = zoo.gpt(vocab=512)
    loss = model(idx, targets)
    assert loss.dim() == 0
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5


def test_gpt_attention_is_explicit_and_the_lm_head_is_tied():
    model, _ = zoo.gpt(layers=2)
    targets = [n.target for n in torch.fx.symbolic_trace(model).graph.nodes]
    assert targets.count(torch.nn.functional.softmax) == 2  # attention matrices are visible nodes
    assert torch.nn.functional.scaled_dot_product_attention not in targets
    assert model.lm_head.weight is model.wte.weight


def test_gpt_accepts_a_shorter_sequence_than_it_was_built_for():
    model, (idx, targets) = zoo.gpt(seq=64)
    model.eval()
    traced = torch.fx.symbolic_trace(model)
    assert_same_output(model(idx[:, :10], targets[:, :10]), traced(idx[:, :10], targets[:, :10]))


def test_bert_returns_logits_and_pooled_and_masks_padding():
    model, (input_ids, attention_mask) = zoo.bert(batch=2, seq=16, vocab=100, d_model=32)
    assert attention_mask[1].sum() < attention_mask[0].sum()  # row 1 is padded
    model.eval()
    out = model(input_ids, attention_mask)
    assert set(out) == {"logits", "pooled"}
    assert out["logits"].shape == (2, 16, 100)
    assert out["pooled"].shape == (2, 32)
    # Changing a padded token leaves the real tokens' outputs unchanged.
    padded = attention_mask[1].argmin().item()
    changed = input_ids.clone()
    changed[1, padded] = (changed[1, padded] + 1) % 100
    out2 = model(changed, attention_mask)
    torch.testing.assert_close(out["logits"][1, :padded], out2["logits"][1, :padded])


def test_mlp_chain_can_be_deep():
    model, inputs = zoo.mlp_chain(depth=128, width=16, batch=4)
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 128
    gm = torch.fx.symbolic_trace(model)
    assert sum(n.op == "call_module" for n in gm.graph.nodes) == 128 + 127
    scalar(model(*inputs)).backward()


def test_resnet_has_batchnorm_and_outputs_logits():
    model, inputs = zoo.resnet(num_classes=7)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model(*inputs).shape == (8, 7)


def test_unet_concatenates_encoder_features_into_the_decoder():
    model, inputs = zoo.unet(depth=3)
    gm = torch.fx.symbolic_trace(model)
    assert sum(n.target is torch.cat for n in gm.graph.nodes) == 3
    assert model(*inputs).shape == (4, 2, 64, 64)


def test_untraceable_fails_symbolic_trace_but_torch_export_captures_it():
    model, inputs = zoo.untraceable_mlp()
    with pytest.raises(TypeError, match="Proxy"):
        torch.fx.symbolic_trace(model)
    exported = torch.export.export(model, inputs, strict=False).module()
    torch.testing.assert_close(exported(*inputs), model(*inputs))


def test_gpt_7b_config_builds_on_meta_without_allocating():
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    model, inputs = zoo.gpt(**zoo.gpt_config_7b(), device="meta")
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_rss) / 2**20
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert all(x.is_meta for x in inputs)
    assert 6e9 < sum(p.numel() for p in model.parameters()) < 8e9
    assert grown_gib < 1  # real float32 weights would be 26 GB
    assert inputs[0].shape == (1, 2048)
    # Shapes flow through forward and backward on meta, which is all planning needs.
    loss = model(*inputs)
    loss.backward()
    assert loss.is_meta and model.wte.weight.grad.is_meta


@pytest.mark.parametrize("name", ALL)
def test_every_model_builds_on_meta(name):
    model, inputs = zoo.build(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(x.is_meta for x in inputs)


def test_device_argument_moves_model_and_inputs_keeping_values():
    model_cpu, inputs_cpu = zoo.mlp_chain(depth=2, width=8, batch=2)
    model_dev, inputs_dev = zoo.mlp_chain(depth=2, width=8, batch=2, device="cpu")
    assert torch.equal(inputs_cpu[0], inputs_dev[0])
    assert all(torch.equal(a, b) for a, b in zip(model_cpu.parameters(), model_dev.parameters()))


def test_build_passes_overrides_and_rejects_unknown_names():
    _, (x,) = zoo.build("mlp", depth=3, width=8, batch=2)
    assert x.shape == (2, 8)
    assert set(zoo.MODELS) == set(ALL)
    with pytest.raises(ValueError, match=r"known models: .*gpt"):
        zoo.build("no-such-model")
