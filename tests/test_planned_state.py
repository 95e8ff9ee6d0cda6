"""Specification: the planned module's ``state_dict`` is the model's, root module included.

Beyond the shared parameters and buffers, a model's root module may keep extra state
(``get_extra_state``/``set_extra_state``) and state-dict hooks (a version entry on save,
renaming an older checkpoint's keys on load). A checkpoint saved from either module loads into
the other with ``strict=True`` and restores the same state; the hooks run as they do for the
model, with the model as their ``module``. Found trying the library: the planned module's
``state_dict`` lacked ``_extra_state`` and it refused the model's checkpoints.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import planner


class Labelled(nn.Module):
    """A classifier that saves its label names with its weights (the root's extra state)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(16, 4)
        self.labels = ["cat", "dog", "bird", "fish"]

    def forward(self, x):
        return self.head(self.body(x))

    def get_extra_state(self):
        return {"labels": list(self.labels)}

    def set_extra_state(self, state):
        self.labels = list(state["labels"])


class Versioned(nn.Module):
    """Version 2 of a model whose version 1 called its body ``encoder``: hooks add a
    ``version`` entry on save and rename version 1's keys on load; every hook call is logged."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
        self.calls: list[tuple[str, nn.Module]] = []
        log = self.calls

        def before_save(module, prefix, keep_vars):
            log.append(("state_dict pre", module))

        def add_version(module, state_dict, prefix, local_metadata):
            log.append(("state_dict post", module))
            state_dict[prefix + "version"] = torch.tensor(2)

        def rename_version_1_keys(module, state_dict, prefix, *args):
            log.append(("load pre", module))
            state_dict.pop(prefix + "version", None)
            for key in list(state_dict):
                if key.startswith(prefix + "encoder."):
                    new_key = prefix + "body." + key[len(prefix + "encoder.") :]
                    state_dict[new_key] = state_dict.pop(key)

        def after_load(module, incompatible_keys):
            log.append(("load post", module))

        self.register_state_dict_pre_hook(before_save)
        self.register_state_dict_post_hook(add_version)
        self.register_load_state_dict_pre_hook(rename_version_1_keys)
        self.register_load_state_dict_post_hook(after_load)

    def forward(self, x):
        return self.body(x)


class LabelledExported(Labelled):
    """The same model with a forward symbolic_trace rejects (an ``if`` on a size)."""

    def forward(self, x):
        h = self.body(x)
        if x.shape[0] > 1:
            h = h * 2.0
        return self.head(h)


def planned(model, capture="symbolic_trace"):
    p = planner.plan(model, (torch.randn(8, 16),), budget_bytes=10**9, solver="sqrt_n")
    assert p.segments, "the test needs checkpointed segments"
    assert p.capture_method.startswith(capture)
    return p.module


def assert_same_state(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


@pytest.mark.parametrize(
    "model_class, capture", [(Labelled, "symbolic_trace"), (LabelledExported, "export")]
)
def test_the_root_extra_state_is_saved_and_loaded_through_the_model(model_class, capture):
    model = model_class()
    module = planned(model, capture)
    assert_same_state(module.state_dict(), model.state_dict())
    assert module.state_dict()["_extra_state"] == {"labels": ["cat", "dog", "bird", "fish"]}

    fresh = model_class()
    fresh.labels = []
    fresh.load_state_dict(module.state_dict(), strict=True)  # a planned module's checkpoint
    assert fresh.labels == model.labels

    checkpoint = model_class().state_dict()
    checkpoint["_extra_state"] = {"labels": ["ant", "bee", "cow", "doe"]}
    module.load_state_dict(checkpoint, strict=True)  # the model's checkpoint
    assert model.labels == ["ant", "bee", "cow", "doe"]
    assert torch.equal(model.head.weight, checkpoint["head.weight"])


def test_the_models_state_dict_hooks_run_for_the_planned_module_with_the_model():
    model = Versioned()
    module = planned(model)
    saved = module.state_dict()
    assert_same_state(saved, model.state_dict())
    assert saved["version"].item() == 2

    model.calls.clear()
    version_1 = {k.replace("body.", "encoder."): v for k, v in saved.items() if k != "version"}
    module.load_state_dict(version_1, strict=True)
    module.state_dict()
    assert model.calls == [
        ("load pre", model),
        ("load post", model),
        ("state_dict pre", model),
        ("state_dict post", model),
    ]


def test_the_saved_format_version_is_the_models():
    """``_version`` tells a model's ``_load_from_state_dict`` how old a checkpoint is."""

    class Version3(Labelled):
        _version = 3

    model = Version3()
    metadata = planned(model).state_dict()._metadata  # type: ignore[attr-defined]
    assert metadata[""]["version"] == 3
    assert metadata == model.state_dict()._metadata  # type: ignore[attr-defined]


def test_hooks_on_the_planned_module_itself_run_after_the_models():
    model = Versioned()
    module = planned(model)
    seen = []
    module.register_state_dict_post_hook(lambda m, sd, prefix, meta: seen.append(sorted(sd)))
    module.register_load_state_dict_post_hook(lambda m, keys: seen.append(m))
    module.load_state_dict(module.state_dict())
    assert seen == [sorted(model.state_dict()), module]


def test_a_planned_module_inside_another_module_saves_and_loads_the_models_state():
    model = Labelled()
    outer, reference = (
        nn.ModuleDict({"classifier": planned(model)}),
        nn.ModuleDict({"classifier": model}),
    )
    assert_same_state(outer.state_dict(), reference.state_dict())
    checkpoint = reference.state_dict()
    checkpoint["classifier._extra_state"] = {"labels": ["a", "b", "c", "d"]}
    outer.load_state_dict(checkpoint, strict=True)
    assert model.labels == ["a", "b", "c", "d"]


def test_a_deep_copy_saves_and_loads_its_own_copy_of_the_model():
    model = Labelled()
    copied = copy.deepcopy(planned(model))
    copied.load_state_dict({**model.state_dict(), "_extra_state": {"labels": ["x"] * 4}})
    assert model.labels == ["cat", "dog", "bird", "fish"]
    assert copied.state_dict()["_extra_state"] == {"labels": ["x"] * 4}


def test_loading_with_assign_gives_both_modules_the_new_root_tensors():
    class RootScale(Labelled):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return super().forward(x) * self.scale

    model = RootScale()
    module = planned(model)
    checkpoint = {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()
    }
    module.load_state_dict(checkpoint, assign=True)
    assert model.scale is module.scale
    assert torch.equal(model.scale, checkpoint["scale"])
