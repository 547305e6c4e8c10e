"""Falcon-Mamba checkpoints: Mamba's tensor names and shapes (the weightless norms hold no
tensors), read and written with the Falcon-Mamba config."""
from __future__ import annotations

from ...nn import hf_from_params, params_from_hf
from ..mamba.checkpoint import expected_shapes, params_from_tensors, tensors_from_params
from .config import Config


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "falcon_mamba")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    return hf_from_params(cfg, tensors_from_params(cfg, params, "Falcon-Mamba"), expected_shapes, "falcon_mamba")


__all__ = ["to_params", "from_params"]
