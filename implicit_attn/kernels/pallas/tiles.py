"""Tile math shared by the Pallas kernels: small pure functions on one ``(T, T)`` tile.

Every recurrent operator is ``diag(left) K diag(right) + diag(d)`` followed by a short
banded conv, with ``K`` a causal decayed kernel. For a tile of rows ``I`` and columns
``J < I`` the segment sum splits into three sums of non-positive log decays::

    T[i, j] = P[i] + Mid + S[j],  P[i] = sum_{k=I0..i} t_k,  S[j] = sum_{k=j+1..J0+T-1} t_k,
                                   Mid = sum of the whole tiles strictly between J and I,

so every exponent is ``<= 0`` and no difference of partial sums is ever formed (``-inf``
log decays, i.e. resets, give exact zeros instead of NaN). Diagonal tiles use a masked
in-tile segment sum. All functions here work on values (not refs) and are plain jnp,
so they run in interpret mode and lower to the GPU/TPU backends alike.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def iota2(T: int):
    """Row and column index grids ``(T, T)`` int32."""
    i = jax.lax.broadcasted_iota(jnp.int32, (T, T), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (T, T), 1)
    return i, j


def seg_diag(t):
    """In-tile segment sums ``seg[i, j] = sum_{k=j+1..i} t_k`` (``(T,) -> (T, T)``),
    ``-inf`` above the diagonal. A masked sum (no cumsum, no subtraction)."""
    T = t.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (T, T, T), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (T, T, T), 1)
    k = jax.lax.broadcasted_iota(jnp.int32, (T, T, T), 2)
    s = jnp.sum(jnp.where((k > j) & (k <= i), t[None, None, :], 0.0), axis=-1)
    ii, jj = iota2(T)
    return jnp.where(ii >= jj, s, -jnp.inf)


def prefix_incl(t):
    """``P[i] = sum_{k<=i} t_k`` within the tile: ``(T,) -> (T,)``."""
    i, k = iota2(t.shape[0])
    return jnp.sum(jnp.where(k <= i, t[None, :], 0.0), axis=1)


def suffix_excl(t):
    """``S[j] = sum_{k>j} t_k`` within the tile: ``(T,) -> (T,)``."""
    j, k = iota2(t.shape[0])
    return jnp.sum(jnp.where(k > j, t[None, :], 0.0), axis=1)


def between(tot, I, J):
    """Sum of the tile totals ``tot (nt,)`` of tiles strictly between ``J`` and ``I``: scalar."""
    m = jax.lax.broadcasted_iota(jnp.int32, tot.shape, 0)
    return jnp.sum(jnp.where((m > J) & (m < I), tot, 0.0))


def conv_bands(w, T: int):
    """The two ``(T, T)`` pieces of the banded conv matrix ``M`` that a column tile needs.

    ``(H M)[:, tile J] = H[:, tile J] @ M0 + H[:, tile J+1] @ M1`` with
    ``M[a, b] = w[K-1-(a-b)]`` for ``0 <= a-b <= K-1`` (``K - 1 <= T``).
    Args:
      w: ``(K,)`` float32 filter of one channel.
    """
    K = w.shape[0]
    a, b = iota2(T)
    d0 = a - b
    d1 = T + a - b
    M0 = jnp.zeros((T, T), f32)
    M1 = jnp.zeros((T, T), f32)
    for s in range(K):
        M0 = jnp.where(d0 == s, w[K - 1 - s], M0)
        M1 = jnp.where(d1 == s, w[K - 1 - s], M1)
    return M0, M1


def dot(a, b):
    """``a @ b`` in float32 at full precision (no TF32/bf16 passes)."""
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=f32)


def dot_t(a, b):
    """``a @ b.T`` in float32 at full precision."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=f32)


def scalar_decay_tile(tI, tJ, mid, is_diag):
    """``exp(T[i, j])`` for one tile of a scalar (per-channel) log decay.

    Args:
      tI, tJ: ``(T,)`` log decays of the row and column tiles (``<= 0``, ``-inf`` allowed).
      mid: scalar sum of the tiles between (ignored on the diagonal).
      is_diag: traced bool, row tile == column tile.
    Returns:
      ``(T, T)`` float32, exact zeros above the diagonal of a diagonal tile.
    """
    def diag_branch():
        return seg_diag(tI)

    def off_branch():
        return prefix_incl(tI)[:, None] + mid + suffix_excl(tJ)[None, :]

    return jnp.exp(jax.lax.cond(is_diag, diag_branch, off_branch))


def state_decay_tile(qI, kJ, A, tI, tJ, mid, is_diag):
    """``sum_n qI[i, n] kJ[j, n] exp(A[n] T[i, j])`` for one tile (Mamba-1's per-state decay).

    Args:
      qI, kJ: ``(T, N)`` (row scalings already folded into ``qI``, column ones into ``kJ``).
      A: ``(N,)`` rates (``<= 0``); tI, tJ: ``(T,)`` step sizes (``>= 0``); mid: scalar.
    Returns:
      ``(T, T)`` float32. Off the diagonal the decay factorises over the three parts, each
      factor ``<= 1``; on it a ``(T, T, N)`` masked exponential.
    """
    def diag_branch():
        s = seg_diag(tI)
        lower = s > -jnp.inf
        s0 = jnp.where(lower, s, 0.0)
        dec = jnp.where(lower[:, :, None], jnp.exp(A[None, None, :] * s0[:, :, None]), 0.0)
        return jnp.sum(qI[:, None, :] * kJ[None, :, :] * dec, axis=-1)

    def off_branch():
        qd = qI * jnp.exp(A[None, :] * prefix_incl(tI)[:, None])
        kd = kJ * jnp.exp(A[None, :] * (suffix_excl(tJ) + mid)[:, None])
        return dot_t(qd, kd)

    return jax.lax.cond(is_diag, diag_branch, off_branch)


def decay_rows_logits(kJ, w, u, I0, J0, T: int):
    """RWKV-4 logits ``l[i, j]`` of one tile: ``(i-1-j) w + k_j`` for ``j < i``, ``u + k_i``
    on the diagonal, ``-inf`` above. ``kJ (T,)``, ``w, u`` scalars, ``I0, J0`` tile starts."""
    a, b = iota2(T)
    i = a + I0
    j = b + J0
    dist = (i - 1 - j).astype(f32)
    rel = jnp.where(j < i, jnp.where(dist > 0, dist * w, 0.0), u)
    return jnp.where(j <= i, rel + kJ[None, :], -jnp.inf)
