"""Stable segment sums and decay matrices.

``segment_sum(t)[..., i, j] = sum_{k=j+1..i} t[..., k]`` for ``i >= j`` (0 on the
diagonal). It is computed as a masked cumulative sum, never as ``S_i - S_j`` of a
global cumsum: the difference of two large partial sums loses precision at long L,
and ``exp(S_i) * exp(-S_j)`` overflows.
"""
from __future__ import annotations

import jax.numpy as jnp


def causal_mask(n: int, m: int | None = None, *, strict: bool = False):
    """Boolean lower-triangular mask ``(n, m)``: ``i >= j`` (``i > j`` if strict)."""
    m = n if m is None else m
    i = jnp.arange(n)[:, None]
    j = jnp.arange(m)[None, :]
    return i > j if strict else i >= j


def segment_sum(t):
    """Stable segment sums of ``t`` along the last axis.

    Args:
      t: ``(..., L)`` increments (float32 recommended; ``-inf`` is allowed and
        propagates as "fully decayed").
    Returns:
      ``(..., L, L)`` with ``T[..., i, j] = sum_{k=j+1..i} t[..., k]`` for ``i >= j``
      and ``-inf`` above the diagonal, so ``exp(segment_sum(t))`` is the causal
      decay matrix with exact zeros above the diagonal.
    """
    L = t.shape[-1]
    x = jnp.broadcast_to(t[..., :, None], t.shape + (L,))  # x[..., i, j] = t_i
    x = jnp.where(causal_mask(L, strict=True), x, 0.0)
    out = jnp.cumsum(x, axis=-2)
    return jnp.where(causal_mask(L), out, -jnp.inf)


def decay_matrix(log_a):
    """Causal decay matrix ``exp(segment_sum(log_a))``.

    Args:
      log_a: ``(..., L)`` per-step log decays (<= 0 for a contracting recurrence).
    Returns:
      ``(..., L, L)``: ``prod_{k=j+1..i} a_k`` for ``i >= j``, exactly 0 above.
    """
    return jnp.exp(segment_sum(log_a))
