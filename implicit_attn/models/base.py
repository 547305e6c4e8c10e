"""What every family's language model shares: input checks, parameter holders,
and the ``operators`` entry point."""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Weights(nnx.Module):
    """A named group of checkpoint tensors (HF local names such as ``"in_proj.weight"``)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.p = nnx.Dict({k: nnx.Param(jnp.asarray(v)) for k, v in tensors.items()})

    def arrays(self) -> dict[str, jax.Array]:
        """Plain ``{name: array}`` for the pure functions."""
        return {k: v[...] for k, v in self.p.items()}


def check_input_ids(input_ids, vocab_size: int):
    """Validate token ids at the API boundary.

    Args:
      input_ids: ``(B, L)`` integer array (numpy, jax or nested lists).
      vocab_size: ids must lie in ``[0, vocab_size)``.
    Returns:
      ``(B, L)`` int32 jax array.
    Raises:
      ValueError/TypeError naming the problem. JAX gathers clamp out-of-range ids
      silently, so the range is checked here (on concrete inputs; under ``jit`` the
      caller is responsible).
    """
    if isinstance(input_ids, jax.core.Tracer):
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must have shape (batch, length), got rank {input_ids.ndim}")
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise TypeError(f"input_ids must be integers, got dtype {input_ids.dtype}")
        return input_ids.astype(jnp.int32)
    arr = np.asarray(input_ids)
    if arr.dtype == object:
        raise TypeError("input_ids must be a rectangular integer array")
    if not (np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"input_ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 2:
        hint = " (add a batch axis: ids[None])" if arr.ndim == 1 else ""
        raise ValueError(f"input_ids must have shape (batch, length), got shape {arr.shape}{hint}")
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"input_ids must be non-empty, got shape {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return jnp.asarray(arr, jnp.int32)


def check_layers(layers, num_layers: int) -> list[int]:
    """Normalise a layer selection (None, int or list; negatives count from the end)."""
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, (int, np.integer)):
        layers = [int(layers)]
    out = []
    for i in layers:
        if not isinstance(i, (int, np.integer)) or not -num_layers <= i < num_layers:
            raise ValueError(f"layer {i!r} out of range for a model with {num_layers} layers")
        out.append(int(i) % num_layers)
    return out


def count_params(tree) -> int:
    """Number of scalars in a pytree of arrays."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
