"""Token embedding lookup."""
from __future__ import annotations

import jax.numpy as jnp


def embed(table, ids):
    """Rows of ``table (V, d)`` for ``ids (B, L)`` int: ``(B, L, d)``.

    An id outside ``[0, V)`` gives a row of NaN (so NaN logits), never another token's
    row: JAX's default gather clamps it to ``V - 1``. The API checks concrete ids and
    raises; this is what remains under ``jit``, where the range cannot be checked.
    """
    ids = jnp.where(ids < 0, table.shape[0], ids)  # take() would wrap negatives around
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)


__all__ = ["embed"]
