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


def _segment_sum_masked(t):
    """Masked-cumsum segment sums: ``O(L^2)`` memory, a cumsum of window ``L``."""
    L = t.shape[-1]
    x = jnp.broadcast_to(t[..., :, None], t.shape + (L,))  # x[..., i, j] = t_i
    x = jnp.where(causal_mask(L, strict=True), x, 0.0)
    out = jnp.cumsum(x, axis=-2)
    return jnp.where(causal_mask(L), out, -jnp.inf)


def segment_sum(t, chunk: int = 32):
    """Stable segment sums of ``t`` along the last axis.

    Lengths up to ``chunk`` use a masked cumsum. Longer ones are split into chunks:
    for ``i`` in chunk I and ``j`` in an earlier chunk J,
    ``T[i, j] = (sum of t in I up to i) + (totals of the chunks strictly between)
    + (sum of t in J after j)``, three short sums of same-signed terms (no
    difference of partial sums), and the chunk totals recurse. XLA's CPU cumsum costs
    ``O(window)`` per element, so this keeps the work ``O(L^2)`` rather than ``O(L^3)``.

    Args:
      t: ``(..., L)`` increments (float32 recommended; ``-inf`` is allowed and
        propagates as "fully decayed").
      chunk: the chunk length of the split (a performance knob).
    Returns:
      ``(..., L, L)`` with ``T[..., i, j] = sum_{k=j+1..i} t[..., k]`` for ``i >= j``
      and ``-inf`` above the diagonal, so ``exp(segment_sum(t))`` is the causal
      decay matrix with exact zeros above the diagonal.
    """
    L = t.shape[-1]
    Q = max(2, int(chunk))
    if L <= Q:
        return _segment_sum_masked(t)
    nc = -(-L // Q)
    Lp = nc * Q
    tc = jnp.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, Lp - L)]).reshape(t.shape[:-1] + (nc, Q))
    prefix = jnp.cumsum(tc, axis=-1)  # sum over I0..i
    # sum over j+1..end of J: a reversed cumsum shifted by one (no subtraction: t may be -inf)
    rev = jnp.flip(jnp.cumsum(jnp.flip(tc, -1), -1), -1)
    suffix = jnp.concatenate([rev[..., 1:], jnp.zeros_like(rev[..., :1])], axis=-1)
    between = segment_sum(jnp.sum(tc, axis=-1), Q)  # (..., nc, nc): chunks J+1..I
    # chunks strictly between J and I are between[I-1, J]
    between = jnp.concatenate([jnp.zeros_like(between[..., :1, :]), between[..., :-1, :]], axis=-2)
    I = jnp.arange(nc)
    off = (prefix[..., :, :, None, None] + between[..., :, None, :, None]
           + suffix[..., None, None, :, :])  # (..., I, i, J, j)
    diag = _segment_sum_masked(tc)  # (..., nc, Q, Q)
    same = (I[:, None] == I[None, :])[:, None, :, None]
    below = (I[:, None] > I[None, :])[:, None, :, None]
    out = jnp.where(below, off, jnp.where(same, diag[..., :, :, None, :], -jnp.inf))
    out = out.reshape(t.shape[:-1] + (Lp, Lp))
    return out if Lp == L else out[..., :L, :L]


def decay_matrix(log_a):
    """Causal decay matrix ``exp(segment_sum(log_a))``.

    Args:
      log_a: ``(..., L)`` per-step log decays (<= 0 for a contracting recurrence).
    Returns:
      ``(..., L, L)``: ``prod_{k=j+1..i} a_k`` for ``i >= j``, exactly 0 above.
    """
    return jnp.exp(segment_sum(log_a))
