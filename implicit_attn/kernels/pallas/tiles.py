"""Tile math shared by the Pallas kernels: pure functions on the values of one tile.

Every recurrent operator is ``diag(left) K diag(right) + diag(d)`` followed by a short
banded conv, with ``K`` a causal decayed kernel. For a tile of rows ``I`` and columns
``J < I`` the segment sum splits into three sums of same-signed terms (``ops.chunk_sums``,
computed outside the kernel)::

    T[i, j] = P[i] + Mid + S[j],  P[i] = sum_{k=I0..i} t_k,  S[j] = sum_{k=j+1..J0+T-1} t_k,

so no difference of partial sums is ever formed (``-inf`` log decays, i.e. resets, give
exact zeros instead of NaN). Diagonal tiles get their in-tile segment sum from one masked
matmul.

The functions keep every value two-dimensional: a per-row quantity is a ``(T, 1)`` column,
a per-column one a ``(1, T)`` row, a scalar ``(1, 1)``. Entries are picked with masked sums,
never by slicing or indexing a value, and sizes are powers of two, so the same code runs in
interpret mode and lowers to Triton (which has no value slicing) and to Mosaic TPU (which
wants 2-D vectors).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...ops import rate_times_time

f32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
# A finite stand-in for -inf inside the in-tile matmul (0 * -inf would be NaN); any sum
# of T such terms still underflows exp() to exactly 0, as -inf does.
NEG_BIG = -1e30


def iota2(shape, axis: int):
    """int32 index grid of a 2-D ``shape`` along ``axis``."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def pick(x, k, axis: int):
    """Entry ``k`` (static or traced int) of ``x (R, C)`` along ``axis``, kept 2-D:
    ``(1, C)`` for ``axis=0``, ``(R, 1)`` for ``axis=1``."""
    return jnp.sum(jnp.where(iota2(x.shape, axis) == k, x, 0.0), axis=axis, keepdims=True)


def dot(a, b):
    """``a @ b`` in float32 at full precision (no TF32/bf16 passes)."""
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=f32)


def dot_t(a, b):
    """``a @ b.T`` in float32 at full precision."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=f32)


def maximum(a, b):
    """``jnp.maximum(a, b)`` with NaN where either is NaN, as XLA computes it. Pallas lowers
    ``max`` for Triton to ``maxnumf``, which returns the other operand of a NaN: on an H200 the
    compiled RG-LRU tiles were finite where XLA's are NaN."""
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), a + b, jnp.maximum(a, b))


def row_max(x):
    """Row maxima of ``x (R, C)``: ``(R, 1)``, NaN for a row holding one (see ``maximum``)."""
    has_nan = jnp.sum(jnp.where(jnp.isnan(x), 1.0, 0.0), axis=1, keepdims=True) > 0
    return jnp.where(has_nan, jnp.nan, jnp.max(x, axis=1, keepdims=True))


def keep_lower(H, is_diag):
    """``H (T, T)`` with exact zeros above the diagonal on a diagonal tile (``is_diag``, traced
    bool): a zero decay times a later NaN factor is NaN there (``ops.keep_causal``)."""
    T = H.shape[0]
    return jnp.where(is_diag & (iota2((T, T), 1) > iota2((T, T), 0)), 0.0, H)


def nan_matmul(a, b, reach, nan_in: int):
    """``a @ b`` where a NaN of operand ``nan_in`` (0: ``a``, 1: ``b``) enters only the entries
    the elementwise form reaches: ``(R, K) @ (K, C)``.

    A matmul multiplies every entry by zeros of the other operand too (``0 * NaN = NaN``).
    Here NaN entries count as 0 in the product, and an entry is NaN where a NaN meets the
    other operand's pattern ``reach`` (a bool array of its shape: the entries the elementwise
    form multiplies, zero weights included). Two matmuls: the kernels take this form only for
    inputs that hold a NaN (``Plan.nan_safe``)."""
    x = (a, b)[nan_in]
    nan = jnp.isnan(x)
    flag, pattern = jnp.where(nan, 1.0, 0.0), jnp.where(reach, 1.0, 0.0)
    clean = jnp.where(nan, 0.0, x)
    hit, y = (dot(flag, pattern), dot(clean, b)) if nan_in == 0 else (dot(pattern, flag), dot(a, clean))
    return jnp.where(hit > 0, jnp.nan, y)


def diag_segment(t_col, nan_safe: bool = False):
    """In-tile segment sums ``seg[i, j] = sum_{k=j+1..i} t_k`` of a ``(T, 1)`` column of
    increments: ``(T, T)``, ``-inf`` above the diagonal. One masked ``(T, T)`` matmul, which
    puts a NaN increment into every row; ``nan_safe``: NaN exactly in the segments that hold
    one (``nan_matmul``)."""
    T = t_col.shape[0]
    lower = iota2((T, T), 1) <= iota2((T, T), 0)  # [i, k]: k <= i
    after = jnp.where(iota2((T, T), 0) > iota2((T, T), 1), maximum(t_col, NEG_BIG), 0.0)  # [k, j]
    ones = jnp.where(lower, 1.0, 0.0)
    s = nan_matmul(ones, after, lower, 1) if nan_safe else dot(ones, after)
    return jnp.where(iota2((T, T), 0) >= iota2((T, T), 1), s, -jnp.inf)


def add_diagonal(H, d_col, is_diag):
    """``H + diag(d)`` on a diagonal tile (``d_col (T, 1)``), ``H`` elsewhere."""
    on = (iota2(H.shape, 0) == iota2(H.shape, 1)) & is_diag
    return H + jnp.where(on, d_col, 0.0)


def scalar_decay(t_col, P_col, mid, S_row, is_diag, nan_safe: bool = False, offset=None):
    """``exp(T[i, j] + offset[i, j])`` for one tile of a scalar log decay: ``(T, T)``.

    Args:
      t_col, P_col: ``(T, 1)`` log decays and inclusive prefix sums of the row tile.
      mid: ``(1, 1)`` sum of the tiles between; S_row: ``(1, T)`` suffix sums of the column
        tile (both ignored on the diagonal).
      is_diag: traced bool, row tile == column tile; nan_safe: see ``diag_segment``.
      offset: ``(T, T)`` log weights added inside the exponential (the mLSTM's ``-m_i + log i_j``,
        which as separate factors ``e^{-m}``, ``e^{log i}`` could overflow), or None.
    """
    seg = jax.lax.cond(is_diag, lambda: diag_segment(t_col, nan_safe), lambda: P_col + mid + S_row)
    return jnp.exp(seg if offset is None else seg + offset)


def state_decay(q, k, kT, A_row, t_col, P_col, mid, S_col, is_diag, nan_safe: bool = False):
    """``sum_n q[i, n] k[j, n] exp(A[n] T[i, j])`` for one tile (Mamba-1's per-state decay).

    Args:
      q, k: ``(T, N)`` row-tile queries, column-tile keys (row / column scalings folded in);
        kT: ``(N, T)`` the same keys transposed.
      A_row: ``(1, N)`` rates (``<= 0``); t_col, P_col: ``(T, 1)`` step sizes (``>= 0``) and
        their prefix sums in the row tile; mid: ``(1, 1)``; S_col: ``(T, 1)`` suffix sums of
        the column tile.
    Returns:
      ``(T, T)``. Off the diagonal the decay factorises over the three parts (each factor
      ``<= 1``) into one matmul; on it a loop over the states.
    """
    def diag():
        seg = diag_segment(t_col, nan_safe)
        lower = iota2(seg.shape, 0) >= iota2(seg.shape, 1)  # (not seg > -inf: False for NaN)
        s0 = jnp.where(lower, seg, 0.0)

        def one(n, acc):
            dec = jnp.exp(rate_times_time(pick(A_row, n, 1), s0))
            return acc + pick(q, n, 1) * pick(kT, n, 0) * dec

        H = jax.lax.fori_loop(0, q.shape[1], one, jnp.zeros(s0.shape, f32))
        return jnp.where(lower, H, 0.0)

    def off():
        return dot_t(q * jnp.exp(rate_times_time(A_row, P_col)), k * jnp.exp(rate_times_time(A_row, S_col + mid)))

    return jax.lax.cond(is_diag, diag, off)


def conv_bands(w_row, K: int, T: int):
    """The two ``(T, T)`` pieces of the banded conv matrix ``M`` that a column tile needs.

    ``(H M)[:, tile J] = H[:, tile J] @ M0 + H[:, tile J+1] @ M1`` with
    ``M[a, b] = w[K-1-(a-b)]`` for ``0 <= a-b <= K-1`` (``K - 1 <= T``).
    Args:
      w_row: ``(1, Kp)`` filter of one channel (zero-padded past ``K``).
    """
    d0 = iota2((T, T), 0) - iota2((T, T), 1)
    M0 = jnp.zeros((T, T), f32)
    M1 = jnp.zeros((T, T), f32)
    for s in range(K):
        ws = pick(w_row, K - 1 - s, 1)
        M0 = jnp.where(d0 == s, ws, M0)
        M1 = jnp.where(d0 + T == s, ws, M1)
    return M0, M1


def conv_reach(K: int, T: int):
    """Where ``conv_bands``' ``M0, M1`` may be nonzero (``0 <= a-b <= K-1``, zero weights
    included): ``(T, T)`` bool each, for ``nan_matmul``."""
    d0 = iota2((T, T), 0) - iota2((T, T), 1)
    return (d0 >= 0) & (d0 <= K - 1), (d0 + T >= 0) & (d0 + T <= K - 1)


def band(w_row, K: int, I, J, left_col, right_row=None):
    """Tile ``(I, J)`` of ``diag(left) M diag(right)`` with ``M`` the banded conv matrix of one
    channel (``M[i, j] = w[K-1-(i-j)]`` for ``0 <= i-j <= K-1``, ``K - 1 <= T``): ``conv_bands``'
    ``M0`` on the diagonal tile, ``M1`` on the one left of it, zeros elsewhere, exact zeros off
    the band even where a scaling is NaN. ``left_col (T, 1)``, ``right_row (1, T)`` or None."""
    T = left_col.shape[0]
    M0, M1 = conv_bands(w_row, K, T)
    B0, B1 = conv_reach(K, T)
    reach = jnp.where(J == I, B0, (J + 1 == I) & B1)
    H = left_col * jnp.where(J == I, M0, M1)
    if right_row is not None:
        H = H * right_row
    return jnp.where(reach, H, 0.0)


def decay_rows_logits(k_row, w, u, I0, J0, T: int):
    """RWKV-4 logits ``l[i, j]`` of one tile: ``(i-1-j) w + k_j`` for ``j < i``, ``u + k_i``
    on the diagonal, ``-inf`` above. ``k_row (1, T)``, ``w, u (1, 1)``, ``I0, J0`` tile starts."""
    i = iota2((T, T), 0) + I0
    j = iota2((T, T), 1) + J0
    dist = (i - 1 - j).astype(f32)
    # where(): dist 0 (j = i-1) must give 0 even for w = -inf.
    rel = jnp.where(j < i, jnp.where(dist > 0, dist * w, 0.0), u)
    return jnp.where(j <= i, rel + k_row, -jnp.inf)


def attention_logits(q, k, seg_col, seg_row, I0, J0, window: int, alpha=None, slope=None):
    """Masked attention logits of one tile: ``q_i . k_j`` where key ``j`` is visible to query
    ``i`` (``j <= i``, ``i - j < window``, same document), ``-inf`` elsewhere; and that mask.
    LaS attention's distance terms (``ops.las_scores``), each optional: the logit times
    ``exp(-alpha (i - j))`` (ELD), then minus ``slope (i - j)`` (ALiBi).

    Args:
      q, k: ``(T, d)`` the row tile's queries and the column tile's keys.
      seg_col: ``(T, 1)`` document ids of the rows; seg_row: ``(1, T)`` of the columns.
      I0, J0: the tiles' first positions; window: a static int.
      alpha, slope: ``(1, 1)`` or None.
    Returns:
      ``(logits (T, T), visible (T, T) bool)``.
    """
    T = q.shape[0]
    i = iota2((T, T), 0) + I0
    j = iota2((T, T), 1) + J0
    visible = (j <= i) & (i - j < window) & (seg_col == seg_row)
    s = dot_t(q, k)
    if alpha is not None or slope is not None:
        dist = jnp.maximum(i - j, 0).astype(f32)
        if alpha is not None:
            s = jnp.exp(-alpha * dist) * s
        if slope is not None:
            s = s - slope * dist
    return jnp.where(visible, s, -jnp.inf), visible
