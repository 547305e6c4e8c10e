"""The steps every family's checkpoint mapping shares, around its own shape table and
tensor <-> parameter-tree functions."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from .checkpoint import CheckpointError, check_tensors
from .init import random_tensors


def params_from_hf(config_cls, expected_shapes: Callable, params_from_tensors: Callable, config: dict,
                   tensors: dict, where: str):
    """HF config dict + tensors -> ``(Config, params)``: the config parsed (a bad value is a
    ``CheckpointError`` "``where`` config: ..."), every tensor checked against the shape table
    (``CheckpointError`` naming missing, unexpected or mis-shaped ones), then the parameter
    tree built."""
    try:
        cfg = config_cls.from_hf(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} config: {e}") from e
    check_tensors(tensors, *expected_shapes(cfg), where=f"{where} checkpoint")
    return cfg, params_from_tensors(cfg, tensors)


def hf_from_params(cfg, tensors: dict, expected_shapes: Callable, where: str) -> tuple[dict, dict]:
    """``(Config, HF tensors)`` -> HF ``(config dict, numpy tensors)`` after checking the
    tensors against the shape table (a wrong parameter tree fails here, not at load)."""
    t = {k: np.asarray(v) for k, v in tensors.items()}
    check_tensors(t, *expected_shapes(cfg), where=f"{where} params")
    return cfg.to_hf(), t


def init_from_table(cfg, expected_shapes: Callable, init_rule: Callable, params_from_tensors: Callable, key,
                    dtype=jnp.float32) -> dict:
    """Random parameters drawn tensor by tensor from the required entries of the shape table
    (``init_rule(name, shape, numpy Generator)``), then built into the parameter tree."""
    return params_from_tensors(cfg, random_tensors(expected_shapes(cfg)[0], init_rule, key, dtype))


__all__ = ["params_from_hf", "hf_from_params", "init_from_table"]
