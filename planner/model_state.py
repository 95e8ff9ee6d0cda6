"""The planned module saves and loads its root state through the model.

The planned module holds the model's children, parameters and buffers
(``planner.planned_module.share_user_state``), but the model's root module also decides what
else its ``state_dict`` holds and how it loads one: its extra state (``get_extra_state`` and
``set_extra_state``: labels, a config version kept with the weights), its state-dict hooks (a
``version`` entry added on save, an older checkpoint's keys renamed on load), its own
``_save_to_state_dict``/``_load_from_state_dict`` and its format ``_version``. A planned module
that saved only the shared tensors wrote checkpoints the model refused (``_extra_state``
missing) and refused the model's. ``ModelStateDict`` hands the root's part of saving and
loading to the model itself, with the model as the hooks' ``module``; hooks registered on the
planned module itself run as on any module.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn


class _HoldsModel(Protocol):
    """What this module reads of the planned module's ``Snapshot``: the user's model."""

    model: nn.Module


class ModelStateDict(nn.Module):
    """Base of :class:`planner.planned_module.PlannedModule`: ``state_dict`` and
    ``load_state_dict`` treat the root module as the model's root, so both modules' checkpoints
    have the same keys and values and each loads into the other."""

    _planner: _HoldsModel  # the Snapshot, set by planner.rewrite.rewrite

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Registered before any other (a user's, FSDP2's), so those see what the model's
        # state_dict would have returned. Bound methods: copy.deepcopy rebinds them to the copy.
        self._register_state_dict_hook(self._run_model_state_dict_hooks)
        self.register_load_state_dict_post_hook(self._run_model_load_post_hooks)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        model = self._planner.model
        for hook in model._state_dict_pre_hooks.values():
            hook(model, prefix, keep_vars)
        model._save_to_state_dict(destination, prefix, keep_vars)

    def _run_model_state_dict_hooks(self, module, destination, prefix, local_metadata):
        """The model's state_dict post-hooks, after the children's entries are written."""
        model = self._planner.model
        local_metadata["version"] = model._version  # the format its loading expects
        for hook in model._state_dict_hooks.values():
            result = hook(model, destination, prefix, local_metadata)
            if result is not None:  # older private hooks may return a new dict
                destination = result
        return destination

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args) -> None:
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, prefix, local_metadata, *args)
        self._planner.model._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    def _run_model_load_post_hooks(self, module, incompatible_keys) -> None:
        model = self._planner.model
        for hook in model._load_state_dict_post_hooks.values():
            hook(model, incompatible_keys)
