"""Branch predicates that stay one branch under ``jax.vmap``.

A ``lax.cond`` whose predicate is batched becomes a select that computes both sides for every
example. Where the cheap side is only a shortcut (it gives the same numbers when it applies),
one predicate for the whole batch keeps the branch.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import custom_batching


@custom_batching.custom_vmap
def any_in_batch(flag):
    """``flag`` (a traced bool scalar) as it is; under ``jax.vmap`` the OR over the mapped axis,
    unbatched, so a ``lax.cond`` on it stays a branch (the side for "true" runs for the whole
    batch when any example needs it). Differentiable functions may branch on it."""
    return flag


@any_in_batch.def_vmap
def _any_in_batch_vmap(axis_size, in_batched, flag):
    return (jnp.any(flag) if in_batched[0] else flag), False


__all__ = ["any_in_batch"]
