"""Row-normalised (softmax) attention matrices: the explicit attention of hybrid models'
attention layers and RWKV-4's decayed softmax. Pure functions, float32, masked and
max-shifted (no overflow), exact zeros where masked."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

f32 = jnp.float32


@functools.partial(jax.jit, static_argnames=("window",))  # one compile when eager
def attention_mask(seg, window: int):
    """Boolean ``(B, 1, L, L)`` mask: key ``j`` is visible to query ``i`` iff ``j <= i``,
    ``i - j < window`` and both lie in the same document (``seg`` ``(B, L)`` int ids)."""
    L = seg.shape[-1]
    i = jnp.arange(L)[:, None]
    j = jnp.arange(L)[None, :]
    band = (j <= i) & (i - j < window)
    same = seg[:, :, None] == seg[:, None, :]
    return (band[None] & same)[:, None]


@functools.partial(jax.jit, static_argnames=("window",))  # one compile when eager
def attention_probs(q, k, seg, window: int):
    """Masked softmax probabilities in float32.

    Args:
      q: ``(B, h, L, d)`` queries, already scaled by ``d ** -0.5`` and rotated.
      k: ``(B, h, L, d)`` keys (one per query head; repeat shared heads first).
      seg: ``(B, L)`` int document ids.
      window: keys at distance ``>= window`` are masked.
    Returns:
      ``(B, h, L, L)`` float32 rows summing to 1, exact zeros where masked.
    """
    logits = jnp.einsum("bhid,bhjd->bhij", q.astype(jnp.float32), k.astype(jnp.float32))
    logits = jnp.where(attention_mask(seg, window), logits, -jnp.inf)
    # The diagonal is always visible, so no row is all -inf.
    return jax.nn.softmax(logits, axis=-1)


@jax.jit  # one compile when eager
def softmax_decay_rows(k, w, u):
    """``softmax_rows(l)`` of each channel, masked and max-shifted (no overflow).

    Args:
      k: ``(B, c, L)`` keys; w, u: ``(c,)`` log decay and bonus (float32).
    Returns:
      ``(B, c, L, L)`` float32, ``l[i,j] = (i-1-j) w + k_j`` (j < i), ``u + k_i`` (j = i),
      zero above the diagonal; each row sums to 1.
    """
    L = k.shape[-1]
    i = jnp.arange(L)[:, None]
    j = jnp.arange(L)[None, :]
    past = (i - 1 - j).astype(f32)
    w, u = w[:, None, None], u[:, None, None]
    # where(): dist 0 (j = i-1) must give 0 even for w = -inf.
    rel = jnp.where(j < i, jnp.where(past > 0, past * w, 0.0), u)  # (c, L, L)
    l = jnp.where(j <= i, rel + k.astype(f32)[:, :, None, :], -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(l, axis=-1, keepdims=True))  # finite: diagonal is there
    e = jnp.exp(l - top)
    return e / jnp.sum(e, axis=-1, keepdims=True)


__all__ = ["attention_mask", "attention_probs", "softmax_decay_rows"]
