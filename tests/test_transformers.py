"""Real third-party models: Hugging Face ``transformers`` GPT-2 and BERT, built from small configs
(random weights, nothing downloaded), planned through the capture fallback (``torch.export``)
and checked exactly like the generated models: outputs (same ``ModelOutput`` type), loss, every
parameter gradient, RNG state (dropout is on), buffers, ``state_dict`` both ways.

``transformers`` is a test-only dependency (``pip install -e '.[test]'``); without it these
tests are skipped.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test-only dependency: pip install -e '.[test]'"
)

from planner.errors import PlanningError  # noqa: E402
from planner.pipeline import plan, prepare  # noqa: E402
from planner.restore import load  # noqa: E402
from planner.rewrite import rewrite  # noqa: E402
from planner.simulate import simulate  # noqa: E402
from planner.solvers.auto import choose, lowest_peak  # noqa: E402
from strategies import assert_equivalent, assert_same_state, model_state  # noqa: E402

# The sizes of the small BERT-like configs below.
SMALL = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
    ],
)


def gpt2(device="cpu"):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64, use_cache=False
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train().to(device)
    ids = torch.randint(0, 64, (2, 12), device=device)
    return model, (ids,), {}


def bert(device="cpu"):
    config = transformers.BertConfig(
        **SMALL,
        vocab_size=64,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).train().to(device)
    ids = torch.randint(0, 64, (2, 12), device=device)
    mask = torch.ones(2, 12, dtype=torch.long, device=device)
    mask[1, 9:] = 0  # padding: the attention mask matters
    return model, (ids,), {"attention_mask": mask}


MODELS = {"gpt2": gpt2, "bert": bert}


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_planned_transformer_trains_exactly_like_the_original(name, device):
    model, args, kwargs = MODELS[name](device)
    reference = copy.deepcopy(model)
    before = model_state(model)
    captured, problem = prepare(model, args, kwargs)
    assert_same_state(before, model_state(model))
    assert captured.method == "export"  # symbolic_trace cannot capture transformers
    low, high = lowest_peak(problem).peak_bytes, simulate(problem, ()).peak_bytes
    for solver, budget in [("greedy", (low + high) // 2), ("auto", low), ("sqrt_n", high)]:
        _, segments = choose(problem, budget, solver)
        assert segments, f"{solver} checkpointed nothing: the test would prove nothing"
        planned = rewrite(captured.graph_module, model, segments, problem=problem)
        assert_equivalent(reference, model, planned, args, kwargs)


@pytest.mark.slow
def test_plan_returns_the_same_model_output_type():
    model, args, kwargs = gpt2()
    _, problem = prepare(model, args, kwargs)
    budget = lowest_peak(problem).peak_bytes
    p = plan(model, args, budget_bytes=budget, example_kwargs=kwargs)
    assert p.predicted_peak_bytes <= budget
    out, expected = p.module(*args, **kwargs), model(*args, **kwargs)
    assert type(out) is type(expected)
    assert isinstance(out, transformers.modeling_outputs.ModelOutput)
    assert list(out.keys()) == list(expected.keys())
    assert out.logits.shape == expected.logits.shape


@pytest.mark.parametrize("leaf", [False, True], ids=["op by op", "blocks kept whole"])
@pytest.mark.parametrize("installed", [False, True], ids=["fresh", "recorders installed"])
def test_hidden_states_and_attentions_plan_and_leave_the_recorders_as_found(installed, leaf):
    """Found trying the library: transformers 5 records ``output_hidden_states`` and
    ``output_attentions`` by forward hooks it installs on the layers at the first call that
    asks for them (and leaves there). Planning refused them as hooks the plan would not run,
    and left those its capture installed on the model. They only append to a collector that
    lives during the model's own call: the graph returns what they recorded."""
    model, args, _ = gpt2()
    kwargs = {"labels": args[0], "output_hidden_states": True, "output_attentions": True}
    if installed:
        model(*args, **kwargs)
    reference = copy.deepcopy(model)
    before = model_state(model)
    flagged = vars(model).get("_output_capturing_hooks_installed", False)
    leaves = (transformers.models.gpt2.modeling_gpt2.GPT2Block,) if leaf else ()
    p = plan(model, args, budget_gb=1, example_kwargs=kwargs, solver="sqrt_n", leaf_modules=leaves)
    assert_same_state(before, model_state(model))
    assert vars(model).get("_output_capturing_hooks_installed", False) == flagged
    assert p.segments, "the test needs checkpointed segments"
    assert_equivalent(reference, model, p.module, args, kwargs)
    model(*args, **kwargs)  # the model itself, as a user evaluates it: installs them
    assert_equivalent(reference, model, p.module, args, kwargs)
    assert len(p.module(*args, **kwargs).hidden_states) == 3


def test_gradient_checkpointing_enabled_in_transformers_is_refused():
    """A model that checkpoints itself: planner must not drop those checkpoints silently."""
    model, args, kwargs = gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    before = model_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PlanningError, match=r"already calls torch\.utils\.checkpoint"):
            prepare(model, args, kwargs)
    assert_same_state(before, model_state(model))


def test_gradient_checkpointing_enabled_after_planning_says_so_and_how_to_go_back():
    """Found trying the library: the message spoke of hooks added to ``transformer.wte`` and
    ``leaf_modules``, not of the gradient checkpointing the user had just turned on. What it
    advises (turning it off again) lets the plan train again, exactly."""
    model, args, kwargs = gpt2()
    reference = copy.deepcopy(model)
    p = plan(model, args, budget_gb=1, example_kwargs=kwargs, solver="sqrt_n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5's deprecation
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(
        PlanningError,
        match=r"gradient checkpointing was enabled.*after planning.*call "
        r"model.activation_checkpointing_disable\(\) and model.disable_input_require_grads\(\)",
    ):
        p.module(*args, **kwargs)
    model.activation_checkpointing_disable()
    model.disable_input_require_grads()
    assert_equivalent(reference, model, p.module, args, kwargs)


def _wav2vec2(**options):
    return transformers.Wav2Vec2Config(
        **SMALL,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        mask_time_length=2,
        layerdrop=0.0,
        **options,
    )


def test_spec_augment_is_refused_with_the_settings_that_turn_it_off():
    """Found trying the library: Wav2Vec2's default SpecAugment (its masks drawn with numpy in
    training) was refused as a numpy draw to "turn off", without naming what turns it off."""
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(_wav2vec2()).train()
    before = model_state(model)
    with pytest.raises(
        PlanningError,
        match=r"SpecAugment \(config.mask_time_prob=0.05\).*"
        r"config.apply_spec_augment = False",
    ):
        plan(model, (torch.randn(2, 1600),), budget_gb=1)
    assert_same_state(before, model_state(model))


def test_a_loss_inside_forward_that_cannot_be_captured_is_named_with_loss_fn_as_the_way_out():
    """Found trying the library: DeBERTa-v2 with ``labels=`` (``(labels >= 0).nonzero()`` in
    its loss) failed export with advice about caches and Python ``if``s only."""
    config = transformers.DebertaV2Config(
        **SMALL,
        vocab_size=100,
        max_position_embeddings=64,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.DebertaV2ForSequenceClassification(config).train()
    ids, labels = torch.randint(0, 100, (2, 8)), torch.tensor([0, 2])
    with pytest.raises(PlanningError, match=r"the loss the model computes from labels.*loss_fn="):
        plan(model, (ids,), example_kwargs={"labels": labels}, budget_gb=1)
    plan(model, (ids,), budget_gb=1)  # the way out: the loss outside the plan


def test_a_mask_the_model_makes_itself_is_reported_without_advice_about_an_argument():
    """Found trying the library: Wav2Vec2 called without ``attention_mask`` was told to leave
    "an attention mask that masks nothing" out of the example."""
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(_wav2vec2(apply_spec_augment=False)).train()
    with pytest.warns(UserWarning, match="No argument of the call gives that mask") as caught:
        prepare(model, (torch.randn(2, 1600),))
    assert not any("Leave an attention mask" in str(w.message) for w in caught)


def test_a_plan_made_with_a_padded_mask_loads_without_advice_to_leave_the_mask_out(tmp_path):
    """Found by a tester: ``load`` rebuilds the inputs filled with ones, whose mask masks
    nothing, and told the user to leave out the padding mask they train with. The loaded plan
    computes with the real padded mask exactly."""
    model, (ids,), _ = gpt2()
    reference = copy.deepcopy(model)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded row
    kwargs = {"attention_mask": mask, "labels": ids}
    saved = plan(model, (ids,), example_kwargs=kwargs, budget_gb=1, solver="sqrt_n")
    path = saved.save(tmp_path / "plan.json")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*masks nothing")
        loaded = load(path, model)
    assert_equivalent(reference, model, loaded.module, (ids,), kwargs)


def test_attributes_a_librarys_own_modules_set_in_forward_are_refused_as_not_plannable():
    """Found trying the library: Funnel (its attention structure keeps ``seq_len`` on a module)
    was told to "return such values from forward", advice for code the user does not own."""
    config = transformers.FunnelConfig(
        vocab_size=100, d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[1, 1]
    )
    torch.manual_seed(0)
    model = transformers.FunnelForMaskedLM(config).train()
    with pytest.raises(PlanningError, match=r"installed package \(transformers\).*cannot be"):
        plan(model, (torch.randint(0, 100, (2, 8)),), budget_gb=1)


def test_the_advice_after_gradient_checkpointing_was_enabled_before_planning_leads_to_a_plan():
    """Found by a tester: disabling checkpointing as advised left Hugging Face's hook making
    the input embeddings require grad, which planning refused with advice the user could not
    follow (no handle to remove). Both messages name ``disable_input_require_grads``."""
    model, args, kwargs = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with pytest.raises(PlanningError, match=r"and model.disable_input_require_grads\(\)"):
            plan(model, args, budget_gb=1, example_kwargs=kwargs)
        model.activation_checkpointing_disable()
        with pytest.raises(PlanningError, match=r"goes with model.disable_input_require_grads"):
            plan(model, args, budget_gb=1, example_kwargs=kwargs)
        model.disable_input_require_grads()
        p = plan(model, args, budget_gb=1, example_kwargs=kwargs)
    assert p.predicted_peak_bytes <= p.budget_bytes


def test_a_second_input_require_grads_hook_left_after_disabling_gets_advice_that_works():
    """Found by a tester: PEFT has the model register the hook twice, and
    ``disable_input_require_grads()`` removed one; the message then said ``handle.remove()``,
    and the user holds no handle."""
    model, args, kwargs = gpt2()
    model.enable_input_require_grads()
    model.enable_input_require_grads()  # as PEFT's get_peft_model does on a checkpointed model
    model.disable_input_require_grads()
    with pytest.raises(PlanningError, match=r"_forward_hooks\.clear\(\)"):
        plan(model, args, budget_gb=1, example_kwargs=kwargs)
    model.get_input_embeddings()._forward_hooks.clear()
    p = plan(model, args, budget_gb=1, example_kwargs=kwargs)
    assert p.predicted_peak_bytes <= p.budget_bytes


class KeywordWrapper(torch.nn.Module):
    """Passes its keywords through to a Hugging Face model, as PEFT's task wrappers do: its
    own signature has no ``use_cache``, so planner cannot turn the cache off for it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, labels=None, **kwargs):
        return self.inner(input_ids=input_ids, labels=labels, **kwargs)


def test_a_wrapper_of_a_model_that_returns_a_cache_gets_advice_that_leads_to_a_plan():
    """Found by a tester: PEFT's ``get_peft_model(..., task_type="CAUSAL_LM")`` failed to
    capture, and the advice began with the loss."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    torch.manual_seed(0)
    model = KeywordWrapper(transformers.GPT2LMHeadModel(config).train())
    ids = torch.randint(0, 64, (2, 12))
    with pytest.raises(PlanningError, match=r"What to try: the model returns a key/value cache"):
        plan(model, (ids,), budget_gb=1)
    model.config.use_cache = False  # the advice
    reference = copy.deepcopy(model)
    p = plan(model, (ids,), budget_gb=1)
    assert_equivalent(reference, model, p.module, (ids,), {})
