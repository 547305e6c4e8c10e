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
