"""Dense causal decayed kernels, the inner factor of every gated linear RNN operator.

Two shapes of decay cover the recurrent blocks:

* ``state_decay_kernel``: a decay per (channel, state) pair, as in Mamba-1
  (``exp(A[c, n] * dt[c, t])``), contracted over the state with shared ``q, k``.
  Materialized with the chunked factorization: for ``i`` in chunk I and ``j`` in
  an earlier chunk J the segment sum splits into three non-negative parts, so each
  exponential is ``<= 1`` and the state sum becomes a small matmul.
* ``scalar_decay_kernel``: one decay per group (a Mamba-2 head, a Griffin channel),
  times an optional low-rank ``q k^T``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .segsum import causal_mask, chunk_sums, keep_causal, rate_times_time, segment_sum


def _pad_time(x, axis: int, Lp: int):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, Lp - x.shape[axis])
    return jnp.pad(x, pad)


@functools.partial(jax.jit, static_argnames=("chunk",))  # one compile when eager
def state_decay_kernel(q, k, A, dt, chunk: int = 16, left=None, right=None, diag=None):
    """``K[b,c,i,j] = l[b,c,i] (sum_n q[b,i,n] k[b,j,n] exp(A[c,n] T[b,c,i,j])) r[b,c,j] + d[b,c,i] [i=j]``
    with ``T[b,c,i,j] = sum_{t=j+1..i} dt[b,c,t]``.

    Lower-triangular (``i >= j``), exact zeros above. Requires ``A <= 0`` and
    ``dt >= 0`` (a contracting recurrence), which makes every exponential <= 1.
    The diagonal scalings are folded into the chunk factors, so they cost nothing
    at the ``L x L`` level.

    Args:
      q, k: ``(B, L, N)`` read-out and write-in vectors (Mamba's C and B).
      A: ``(c, N)`` per-channel, per-state rates (negative).
      dt: ``(B, c, L)`` per-channel step sizes (non-negative).
      chunk: chunk length Q; memory grows as ``c * L * Q * N``.
      left, right, diag: optional ``(B, c, L)`` row scale, column scale, diagonal term.
    Returns:
      ``(B, c, L, L)`` float32.
    """
    f32 = jnp.float32
    q, k, A, dt = (x.astype(f32) for x in (q, k, A, dt))
    Bn, L, N = q.shape
    c = A.shape[0]
    Q = max(1, min(chunk, L))
    nc = -(-L // Q)
    Lp = nc * Q
    # Padding with dt = 0 and q = k = 0 adds rows/columns that are sliced away.
    qc = _pad_time(q, 1, Lp).reshape(Bn, 1, nc, Q, N)
    kc = _pad_time(k, 1, Lp).reshape(Bn, 1, nc, Q, N)
    dtc = _pad_time(dt, 2, Lp).reshape(Bn, c, nc, Q)
    if left is not None:
        qc = qc * _pad_time(left.astype(f32), 2, Lp).reshape(Bn, c, nc, Q, 1)
    if right is not None:
        kc = kc * _pad_time(right.astype(f32), 2, Lp).reshape(Bn, c, nc, Q, 1)
    qc = jnp.broadcast_to(qc, (Bn, c, nc, Q, N))
    kc = jnp.broadcast_to(kc, (Bn, c, nc, Q, N))
    An = A[None, :, None, None, :]  # (1, c, 1, 1, N)

    # Blocks on the diagonal: stable segment sums inside each chunk.
    seg = segment_sum(dtc)  # (B, c, nc, Q, Q), -inf above the diagonal
    lower = causal_mask(Q)
    seg0 = jnp.where(lower, seg, 0.0)[..., None]  # (B, c, nc, Q, Q, 1)
    dec = jnp.where(lower[..., None], jnp.exp(rate_times_time(An[:, :, :, :, None, :], seg0)), 0.0)
    diag_blocks = jnp.einsum("bcIijn,bcIin,bcIjn->bcIij", dec, qc, kc)
    if diag is not None:
        d = _pad_time(diag.astype(f32), 2, Lp).reshape(Bn, c, nc, Q)
        diag_blocks = diag_blocks + d[..., :, None] * jnp.eye(Q, dtype=f32)

    # Blocks below the diagonal: (S_i - S_I0) + (S_I0 - S_Jend) + (S_Jend - S_j).
    prefix, suffix, between = chunk_sums(dtc)
    qd = qc * jnp.exp(rate_times_time(An, prefix[..., None]))
    kd = kc * jnp.exp(rate_times_time(An, suffix[..., None]))
    strict = causal_mask(nc, strict=True)
    mid = jnp.where(strict[..., None], jnp.exp(rate_times_time(A[None, :, None, None, :], between[..., None])), 0.0)
    # Batch over the query chunk I so the matmul writes rows of the output in place.
    kdm = mid[:, :, :, :, None, :] * kd[:, :, None]  # (B, c, I, J, Q, N)
    full = jnp.einsum("bcIin,bcIJjn->bcIiJj", qd, kdm)
    ar = jnp.arange(nc)
    # Diagonal blocks are written in place (mid is 0 there).
    full = full.at[:, :, ar, :, ar, :].set(jnp.moveaxis(diag_blocks, 2, 0))
    full = keep_causal(full.reshape(Bn, c, Lp, Lp))
    return full if Lp == L else full[:, :, :L, :L]


def scalar_decay_kernel(log_a, q=None, k=None):
    """``K[b, g, i, j] = (q[b,g,i] . k[b,g,j]) * exp(sum_{t=j+1..i} log_a[b,g,t])``.

    Args:
      log_a: ``(B, G, L)`` per-group log decays (``-inf`` allowed: a full reset).
      q, k: optional ``(B, G, L, N)``; omitted means rank one with ``q = k = 1``.
    Returns:
      ``(B, G, L, L)`` float32, exact zeros above the diagonal.
    """
    K = jnp.exp(segment_sum(log_a.astype(jnp.float32)))
    if q is not None:
        K = keep_causal(K * jnp.einsum("bgin,bgjn->bgij", q.astype(jnp.float32), k.astype(jnp.float32)))
    return K
