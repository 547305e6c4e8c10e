"""Row-normalised (softmax) attention matrices: the explicit attention of hybrid models'
attention layers and RWKV-4's decayed softmax; and those layers' forward output, computed
per block of queries without the whole matrix. Pure functions, float32, masked and
max-shifted (no overflow), exact zeros where masked."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

f32 = jnp.float32


def visible(seg, window: int, rows: tuple[int, int], keys: tuple[int, int]):
    """Boolean ``(B, end - start, stop - first)``: key ``j`` in ``keys = (first, stop)`` is visible
    to query ``i`` in ``rows = (start, end)`` iff ``j <= i``, ``i - j < window`` and both lie in
    the same document (``seg`` ``(B, L)`` int ids)."""
    i = jnp.arange(*rows)[:, None]
    j = jnp.arange(*keys)[None, :]
    band = (j <= i) & (i - j < window)
    return band[None] & (seg[:, rows[0]:rows[1], None] == seg[:, None, keys[0]:keys[1]])


@functools.partial(jax.jit, static_argnames=("window",))  # one compile when eager
def attention_mask(seg, window: int):
    """Boolean ``(B, 1, L, L)`` mask: key ``j`` is visible to query ``i`` iff ``j <= i``,
    ``i - j < window`` and both lie in the same document (``seg`` ``(B, L)`` int ids)."""
    L = seg.shape[-1]
    return visible(seg, window, (0, L), (0, L))[:, None]


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
    mask = attention_mask(seg, window)
    logits = jnp.where(mask, logits, -jnp.inf)
    # The diagonal is always visible, so no row is all -inf. where(): a NaN logit makes its
    # whole row NaN, the masked entries too (exp(-inf - NaN)); they stay exact zeros.
    return jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)


def query_blocks(L: int, window: int, rows: int = 128, most: int = 8) -> list[tuple[int, int, int]]:
    """The query blocks ``attention_output`` computes one at a time: ``(start, end, first
    key)`` triples covering ``[0, L)``, at most ``most`` blocks of about ``L / most`` rows
    but no fewer than ``rows`` (one block for ``L <= rows``); each block's keys run from
    the first one its earliest query can see (``start - window + 1``, at least 0) to
    ``end``: keys after a block's last query or before its first query's window are never
    multiplied (inside that range the mask removes the rest)."""
    size = max(rows, -(-L // most))
    return [(s, min(L, s + size), max(0, s - window + 1)) for s in range(0, L, size)]


@functools.partial(jax.jit, static_argnames=("window",))  # one compile when eager
def attention_output(q, k, v, seg, window: int):
    """Masked softmax attention applied to the values, ``softmax(q kᵀ) v`` per head, with
    keys shared by groups of query heads (GQA) and without forming the whole ``(L, L)``
    matrix: each block of queries (``query_blocks``) meets only the keys it can see.

    Args:
      q: ``(B, H, L, d)`` queries, already scaled and rotated.
      k: ``(B, KV, L, d)`` keys, ``H`` a multiple of ``KV``; query head ``h`` uses key and
        value head ``h // (H // KV)``.
      v: ``(B, KV, L, e)`` values.
      seg: ``(B, L)`` int document ids.
      window: keys at distance ``>= window`` are masked.
    Returns:
      ``(B, H, L, e)`` in ``v``'s dtype: row ``i`` is ``attention_probs``' row ``i`` (float32,
      then cast to ``v``'s dtype) times the values.
    """
    B, H, L, d = q.shape
    KV = k.shape[1]
    if H % KV or k.shape[2] != L or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention_output: queries {q.shape}, keys {k.shape} and values {v.shape} do not match")
    qg = q.astype(f32).reshape(B, KV, H // KV, L, d)
    k = k.astype(f32)
    out = []
    for s, e, lo in query_blocks(L, window):
        logits = jnp.einsum("bkgid,bkjd->bkgij", qg[:, :, :, s:e], k[:, :, lo:e])
        mask = visible(seg, window, (s, e), (lo, e))[:, None, None]
        # The diagonal is always visible, so no row is all -inf.
        probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
        out.append(jnp.einsum("bkgij,bkje->bkgie", probs.astype(v.dtype), v[:, :, lo:e]))
    return jnp.concatenate(out, axis=3).reshape(B, H, L, v.shape[-1])


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
    return jnp.where(j <= i, e / jnp.sum(e, axis=-1, keepdims=True), 0.0)  # a NaN row: zeros stay above


__all__ = ["visible", "attention_mask", "attention_probs", "query_blocks", "attention_output", "softmax_decay_rows"]
