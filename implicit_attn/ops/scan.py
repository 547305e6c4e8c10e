"""Parallel linear recurrences ``h_t = a_t * h_{t-1} + b_t``."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _combine(left, right):
    a_l, b_l = left
    a_r, b_r = right
    return a_l * a_r, a_r * b_l + b_r


def linear_scan(a, b, axis: int = 1, h0=None):
    """All states of ``h_t = a_t * h_{t-1} + b_t`` with ``h_{-1} = h0`` (default 0).

    Uses ``jax.lax.associative_scan`` (O(log L) depth, no Python loop).

    Args:
      a: decays, broadcastable to ``b``.
      b: inputs, e.g. ``(B, L, ...)``.
      axis: the time axis.
      h0: optional initial state, shaped like ``b`` without the time axis.
    Returns:
      ``h`` shaped like ``b``.
    """
    a = jnp.broadcast_to(a, b.shape)
    if h0 is not None:
        first = jax.lax.index_in_dim(b, 0, axis, keepdims=True)
        a0 = jax.lax.index_in_dim(a, 0, axis, keepdims=True)
        first = first + a0 * jnp.expand_dims(h0, axis)
        b = jax.lax.dynamic_update_index_in_dim(b, first, 0, axis)
    _, h = jax.lax.associative_scan(_combine, (a, b), axis=axis)
    return h
