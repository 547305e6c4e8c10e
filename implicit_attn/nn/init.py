"""Random parameters drawn from a family's shape table (the checkpoint mapping), so that
``init_params`` and the converter read the same shapes."""
from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np


def seed_of(key) -> int:
    """An int seed from an int or a JAX PRNG key (typed or raw)."""
    if isinstance(key, (int, np.integer)):
        return int(key)
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return int(np.asarray(data).astype(np.uint64).sum())


def fan_in_normal(shape, g: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Normal entries with standard deviation ``scale / sqrt(shape[-1])``."""
    return scale * g.standard_normal(shape) * float(shape[-1]) ** -0.5


def random_tensors(shapes: Mapping[str, tuple], rule: Callable, key, dtype=jnp.float32) -> dict:
    """``{name: array}`` for every ``name -> shape`` of a shape table.

    Args:
      shapes: tensor name -> shape (the family's ``expected_shapes``).
      rule: ``(name, shape, numpy Generator) -> array`` of that shape (the family's init).
      key: int seed or JAX PRNG key (drawn with numpy: no per-shape compilation).
      dtype: dtype of the returned arrays.
    Returns:
      ``{name: jax array}`` in the order of ``shapes``.
    Raises:
      ValueError if the rule returns a wrong shape (naming the tensor).
    """
    g = np.random.default_rng(seed_of(key))
    out = {}
    for name, shape in shapes.items():
        a = np.asarray(rule(name, tuple(shape), g), np.float32)
        if a.shape != tuple(shape):
            raise ValueError(f"init rule gave {name} shape {a.shape}, the table says {tuple(shape)}")
        out[name] = jnp.asarray(a, dtype)
    return out


__all__ = ["seed_of", "fan_in_normal", "random_tensors"]
