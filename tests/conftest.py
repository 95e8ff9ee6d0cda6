"""Hypothesis profiles for the property suite (tests/test_equivalence.py).

* ``ci`` (default): a few dozen generated models per property, derandomized so CI is
  reproducible; keeps the whole equivalence suite within about three minutes on two cores.
* ``thorough``: thousands of generated models, random seeds; run on demand::

      HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest tests/test_equivalence.py -x

Properties scale their example counts from the profile's ``max_examples`` (see
``tests/test_equivalence.py``), so one variable selects the whole suite's depth.
"""

import os

from hypothesis import HealthCheck, settings

from torchvision_shim import define_torchvision_operators

define_torchvision_operators()  # before transformers or timm import torchvision, if installed

_COMMON = dict(
    deadline=None,  # a shared two-core machine: timings vary too much for per-example deadlines
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("ci", max_examples=30, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """The ``models`` matrix runs only when asked for (``-m models``): it takes minutes."""
    import pytest

    if "models" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="the full model matrix: run it with pytest -m models")
    for item in items:
        if "models" in item.keywords:
            item.add_marker(skip)
