"""Shared fixtures: tiny random Hugging Face models built in torch and saved locally."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import numpy as np
import pytest


def torch_or_skip():
    """torch and transformers are test-time references (the ``test`` extra)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return torch, transformers


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(0)


# Module-scoped fixtures that build (and compile) one tiny model per parameter. With
# ``--dist loadgroup`` all tests of one (file, model) pair run on the same worker, so
# each model is built and compiled once instead of once per worker.
MODEL_FIXTURES = ("fam", "pair")


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = item.module.__name__
        spec = getattr(item, "callspec", None)
        for name in MODEL_FIXTURES:
            if spec is not None and name in spec.params:
                value = spec.params[name]
                group += f"[{getattr(value, 'model_type', value)}]"
        item.add_marker(pytest.mark.xdist_group(group))
