"""Stable segment sums and decay matrices.

``segment_sum(t)[..., i, j] = sum_{k=j+1..i} t[..., k]`` for ``i >= j`` (0 on the
diagonal). It is computed as a masked cumulative sum, never as ``S_i - S_j`` of a
global cumsum: the difference of two large partial sums loses precision at long L,
and ``exp(S_i) * exp(-S_j)`` overflows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .batching import any_in_batch


def causal_mask(n: int, m: int | None = None, *, strict: bool = False):
    """Boolean lower-triangular mask ``(n, m)``: ``i >= j`` (``i > j`` if strict)."""
    m = n if m is None else m
    i = jnp.arange(n)[:, None]
    j = jnp.arange(m)[None, :]
    return i > j if strict else i >= j


def keep_causal(H):
    """``H (..., L, L)`` with every entry above the diagonal exactly 0.

    Products that are 0 there by construction (a decay of 0, a masked probability) turn
    into NaN when a later position holds NaN or inf (``0 * nan``); this keeps such values
    out of earlier rows, so row ``i`` depends on positions ``<= i`` only, NaN included."""
    L = H.shape[-1]
    return jnp.where(causal_mask(H.shape[-2], L), H, 0.0)


def rate_times_time(rate, T):
    """``rate * T`` with ``0`` wherever ``T == 0``: the log decay over an empty segment is 0
    even for an infinite rate (``-inf * 0`` would be NaN). ``rate``, ``T`` broadcastable."""
    return jnp.where(T == 0, 0.0, rate * T)


def _segment_sum_masked(t):
    """Masked-cumsum segment sums: ``O(L^2)`` memory, a cumsum of window ``L``."""
    L = t.shape[-1]
    x = jnp.broadcast_to(t[..., :, None], t.shape + (L,))  # x[..., i, j] = t_i
    x = jnp.where(causal_mask(L, strict=True), x, 0.0)
    out = jnp.cumsum(x, axis=-2)
    return jnp.where(causal_mask(L), out, -jnp.inf)


def chunk_sums(tc):
    """The three parts of a chunked segment sum, from chunk-local increments.

    For ``i`` in chunk ``I`` and ``j`` in an earlier chunk ``J``,
    ``T[i, j] = prefix[I, i] + between[I, J] + suffix[J, j]``: the sum inside ``I`` up to
    ``i``, the totals of the chunks strictly between, and the sum inside ``J`` after
    ``j``. Each is a short sum of same-signed terms (no difference of partial sums, so
    ``-inf`` increments stay exact resets).

    Args:
      tc: ``(..., nc, Q)`` increments in ``nc`` chunks of ``Q``.
    Returns:
      ``prefix (..., nc, Q)`` (inclusive), ``suffix (..., nc, Q)`` (exclusive),
      ``between (..., nc, nc)`` (sum over chunks ``J+1..I-1``; 0 on and above the diagonal).
    """
    prefix = jnp.cumsum(tc, axis=-1)
    rev = jnp.flip(jnp.cumsum(jnp.flip(tc, -1), -1), -1)
    suffix = jnp.concatenate([rev[..., 1:], jnp.zeros_like(rev[..., :1])], axis=-1)
    nc = tc.shape[-2]
    inner = segment_sum(jnp.sum(tc, axis=-1))  # (..., nc, nc): chunks J+1..I
    between = jnp.concatenate([jnp.zeros_like(inner[..., :1, :]), inner[..., :-1, :]], axis=-2)
    return prefix, suffix, jnp.where(causal_mask(nc, strict=True), between, 0.0)


@functools.partial(jax.jit, static_argnames=("chunk",))  # one compile when eager
def segment_sum(t, chunk: int = 32):
    """Stable segment sums of ``t`` along the last axis.

    Lengths up to ``chunk`` use a masked cumsum. Longer ones are split into chunks
    (``chunk_sums``: three short sums of same-signed terms per entry, the chunk totals
    recursing). XLA's CPU cumsum costs ``O(window)`` per element, so this keeps the work
    ``O(L^2)`` rather than ``O(L^3)``.

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
    prefix, suffix, between = chunk_sums(tc)
    I = jnp.arange(nc)
    off = (prefix[..., :, :, None, None] + between[..., :, None, :, None]
           + suffix[..., None, None, :, :])  # (..., I, i, J, j)
    diag = _segment_sum_masked(tc)  # (..., nc, Q, Q)
    same = (I[:, None] == I[None, :])[:, None, :, None]
    below = (I[:, None] > I[None, :])[:, None, :, None]
    out = jnp.where(below, off, jnp.where(same, diag[..., :, :, None, :], -jnp.inf))
    out = out.reshape(t.shape[:-1] + (Lp, Lp))
    return out if Lp == L else out[..., :L, :L]


def _finite_max(x):
    """The maximum over the last axis, 0 where it is not finite (every entry ``-inf``, or a NaN)."""
    m = jnp.max(x, axis=-1)
    return jnp.where(jnp.isfinite(m), m, 0.0)


@functools.partial(jax.jit, static_argnames=("chunk",))  # one compile when eager
def decayed_scores(q, k, log_a, row=None, col=None, chunk: int = 64):
    """``S[..., i, j] = exp(segment_sum(log_a)[i, j] + row_i + col_j) (q_i . k_j)`` for ``i >= j``,
    exactly 0 above the diagonal, with one exponential per row and column instead of one per entry.

    In chunks of ``chunk`` positions: for ``i`` in chunk ``I`` and ``j`` in an earlier chunk ``J``
    the exponent is ``r_i + between[I, J] + c_j`` (``r`` = ``row`` plus the sum inside ``I`` up to
    ``i``, ``c`` = ``col`` plus the sum inside ``J`` after ``j``: ``chunk_sums``), taken as three
    factors against the chunks' maxima ``rho_I``, ``gamma_J``: ``exp(r_i - rho_I) <= 1``, ``exp(c_j
    - gamma_J) <= 1`` (folded into ``q`` and ``k`` before one matmul) and ``exp(rho_I + between +
    gamma_J)``, the block's largest weight. Neither of the first two overflows, and one underflows
    only where the entry is below float32's normal range relative to its block's largest. The
    diagonal blocks take each pair's exponent on its own.

    Args:
      q, k: ``(..., L, d)``; log_a: ``(..., L)`` log decays (``-inf`` allowed: a reset);
      row, col: ``(..., L)`` log weights of the rows / columns, or None (0);
      chunk: the block length (a performance knob).
    Returns:
      ``(..., L, L)`` float32.
    """
    q, k, log_a = (x.astype(jnp.float32) for x in (q, k, log_a))
    zero = jnp.zeros_like(log_a)
    row = zero if row is None else row.astype(jnp.float32)
    col = zero if col is None else col.astype(jnp.float32)
    *lead, L, d = q.shape
    Q = max(1, min(int(chunk), L))
    nc = -(-L // Q)
    Lp = nc * Q
    pad = lambda x, extra, value=0.0: jnp.pad(x, [(0, 0)] * len(lead) + [(0, Lp - L)] + [(0, 0)] * extra,
                                              constant_values=value)
    split = lambda x: x.reshape(*lead, nc, Q, *x.shape[len(lead) + 1:])
    qc, kc = split(pad(q, 1)), split(pad(k, 1))
    # The padded rows and columns weigh nothing (-inf), so they never set a chunk's maximum: a
    # padded 0 above rows whose weights are far below 0 (the mLSTM's -m with large input gates)
    # once made exp(r - rho) underflow to 0 against an infinite block weight (0 * inf = NaN).
    tc, rc, cc = split(pad(log_a, 0)), split(pad(row, 0, -jnp.inf)), split(pad(col, 0, -jnp.inf))
    prefix, suffix, between = chunk_sums(tc)
    r, c = prefix + rc, suffix + cc
    rho, gamma = _finite_max(r), _finite_max(c)  # (..., nc)
    qs = (qc * jnp.exp(r - rho[..., None])[..., None]).reshape(*lead, Lp, d)
    ks = (kc * jnp.exp(c - gamma[..., None])[..., None]).reshape(*lead, Lp, d)
    block = jnp.exp(rho[..., :, None] + between + gamma[..., None, :])  # (..., I, J), J < I
    off = jnp.einsum("...id,...jd->...ij", qs, ks).reshape(*lead, nc, Q, nc, Q) * block[..., :, None, :, None]
    own = jnp.where(causal_mask(Q), jnp.exp(_segment_sum_masked(tc) + rc[..., :, None] + cc[..., None, :])
                    * jnp.einsum("...nid,...njd->...nij", qc, kc), 0.0)  # (..., nc, Q, Q)
    I = jnp.arange(nc)
    same = (I[:, None] == I[None, :])[:, None, :, None]
    below = (I[:, None] > I[None, :])[:, None, :, None]
    out = jnp.where(below, off, jnp.where(same, own[..., :, :, None, :], 0.0)).reshape(*lead, Lp, Lp)
    return out[..., :L, :L]


@functools.partial(jax.jit, static_argnames=("chunk",))  # one compile when eager
def decay_matrix(log_a, chunk: int = 32):
    """Causal decay matrix ``exp(segment_sum(log_a, chunk))``.

    Longer than ``chunk``, it is ``decayed_scores`` of unit vectors: left of the diagonal blocks
    each entry is a product of ``chunk_sums``' exponentials, each factor ``<= 1`` against its
    chunk's maximum (``O(L^2 / chunk)`` exponentials and one product per entry instead of an
    exponential per entry: 3-4x less CPU time for Mamba-2's head matrices at L = 512). With a
    positive increment an entry far below its block's largest could underflow where it is a
    normal float, so such inputs take the exponential of each entry's sum instead (under
    ``jax.vmap`` the whole batch does, if any example has one: ``any_in_batch``).

    Args:
      log_a: ``(..., L)`` per-step log decays (<= 0 for a contracting recurrence; ``-inf`` a
        reset, NaN spreads to the entries whose segment holds it).
      chunk: the chunk length of the segment sum (a performance knob).
    Returns:
      ``(..., L, L)``: ``prod_{k=j+1..i} a_k`` for ``i >= j``, exactly 0 above.
    """
    Q = max(2, int(chunk))
    if log_a.shape[-1] <= Q:
        return jnp.exp(_segment_sum_masked(log_a))
    one = jnp.ones(log_a.shape + (1,), jnp.float32)
    return jax.lax.cond(any_in_batch(jnp.any(log_a > 0)), lambda t: jnp.exp(segment_sum(t, Q)),
                        lambda t: decayed_scores(one, one, t, chunk=Q), log_a)
