"""The diagonal-plus-low-rank (DPLR) linear recurrence and its token-mixing matrix, chunk by chunk.

Per head, with the state ``S`` of shape ``(d_v, d_k)``::

    S_t = S_{t-1} (Diag(w_t) + a_t b_t^T) + v_t k_t^T

read out as ``o_t = S_t q_t`` (RWKV-7's generalised delta rule: ``a = -kk``, ``b = kk * iclr``)
or as ``o_t = S_{t-1} q_t`` (RWKV-5/6, ``a = b = 0``, whose bonus term for the current token is
added by the caller). Either way ``o_i = sum_j M[i, j] v_j`` with one scalar ``M[i, j]`` per head.

Within a chunk of ``C`` positions entering with state ``S_0``, let ``G_t`` be the cumulative log
decay from the chunk start through ``t`` (one per key dimension) and ``E_t = G_t - log w_t``
(through ``t - 1``). With ``x_t = S_{t-1} a_t`` (what the low-rank term reads),

* ``X = (I - A_ab)^{-1} ((a * exp(E)) S_0^T + A_ak V)`` (a unit-triangular solve, rows ``x_t``),
* ``O = (q * exp(G or E)) S_0^T + A_qb X + A_qk V``,
* ``S_C = S_0 Diag(exp(G_C)) + X^T (b * exp(G_C - G)) + V^T (k * exp(G_C - G))``,

where ``A_xy[t, s] = sum_d x_td y_sd exp(R_td - G_sd)`` over ``s < t`` (``A_ak``, ``A_ab``, ``R = E``)
or ``s <= t`` (``A_qk``, ``A_qb`` for the read after the update, ``R = G``; ``s < t`` and ``R = E``
for the read before it). Every exponent is a sum of log decays over a forward range, so every
factor is in ``(0, 1]``: strong decays underflow to 0, never overflow.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .delta import masked_exp, split_chunks

f32 = jnp.float32


def dplr_chunk(qc, kc, vc, gc, ac, bc, S, after: bool):
    """One chunk of the DPLR recurrence for every head.

    Args:
      qc, kc: ``(B, H, C, d_k)``; vc: ``(B, H, C, d_v)``; gc: ``(B, H, C, d_k)`` log decays;
      ac, bc: ``(B, H, C, d_k)`` the low-rank vectors, or None (no low-rank term);
      S: ``(B, H, d_v, d_k)`` the state entering the chunk; after: read ``S_t`` (else ``S_{t-1}``).
    Returns:
      ``(O (B, H, C, d_v), S after the chunk)``.
    """
    C = kc.shape[2]
    G = jnp.cumsum(gc, axis=2)
    E = G - gc  # through t - 1
    R = G if after else E
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    read_mask = jnp.tril(jnp.ones((C, C), bool)) if after else strict

    def pair(x, Rx, y, mask):
        """``sum_d x_td y_sd exp(Rx_td - G_sd)`` where ``mask[t, s]``: ``(B, H, C, C)``."""
        e = masked_exp(Rx[:, :, :, None, :] - G[:, :, None, :, :], mask[..., None])
        return jnp.einsum("bhtd,bhsd,bhtsd->bhts", x, y, e)

    to_end = jnp.exp(G[:, :, -1:] - G)
    O = jnp.einsum("bhtd,bhvd->bhtv", qc * jnp.exp(R), S) + pair(qc, R, kc, read_mask) @ vc
    S_next = jnp.exp(G[:, :, -1])[:, :, None, :] * S + jnp.einsum("bhtv,bhtd->bhvd", vc, kc * to_end)
    if ac is not None:
        T = jnp.eye(C, dtype=f32) - pair(ac, E, bc, strict)
        rhs = jnp.einsum("bhtd,bhvd->bhtv", ac * jnp.exp(E), S) + pair(ac, E, kc, strict) @ vc
        X = jax.scipy.linalg.solve_triangular(T, rhs, lower=True, unit_diagonal=True)
        O = O + pair(qc, R, bc, read_mask) @ X
        S_next = S_next + jnp.einsum("bhtv,bhtd->bhvd", X, bc * to_end)
    return O, S_next


def dplr_rule(q, k, v, log_w, a=None, b=None, chunk: int = 32, after: bool = True):
    """Outputs of the DPLR recurrence (float32, chunk by chunk; see the module docstring).

    Args:
      q, k: ``(B, H, L, d_k)`` queries (RWKV's receptance) and keys.
      v: ``(B, H, L, d_v)`` values.
      log_w: ``(B, H, L, d_k)`` log decays (``<= 0``).
      a, b: ``(B, H, L, d_k)`` the transition's low-rank vectors (``Diag(w_t) + a_t b_t^T``), or
        None for a diagonal transition.
      chunk: positions per chunk (a performance knob: the numbers do not depend on it beyond
        float32 rounding).
      after: read ``o_t = S_t q_t`` (True) or ``S_{t-1} q_t`` (False).
    Returns:
      ``(B, H, L, d_v)`` float32.
    """
    if (a is None) != (b is None):
        raise ValueError("give both low-rank vectors a and b, or neither")
    B, H, L, dk = k.shape
    dv = v.shape[-1]
    C = max(1, min(chunk, L))
    Lp = -(-L // C) * C
    pad = lambda x: split_chunks(jnp.pad(x.astype(f32), ((0, 0), (0, 0), (0, Lp - L), (0, 0))), C)
    low_rank = a is not None

    def step(S, xs):
        qc, kc, vc, gc, *ab = xs
        O, S = dplr_chunk(qc, kc, vc, gc, *(ab if low_rank else (None, None)), S, after)
        return S, O

    xs = tuple(pad(x) for x in (q, k, v, log_w) + ((a, b) if low_rank else ()))
    _, O = jax.lax.scan(step, jnp.zeros((B, H, dv, dk), f32), xs)
    return jnp.moveaxis(O, 0, 2).reshape(B, H, Lp, dv)[:, :, :L]


def dplr_matrix(q, k, log_w, a=None, b=None, chunk: int = 32, after: bool = True):
    """``M (B, H, L, L)`` float32 of the DPLR recurrence of each head: ``dplr_rule`` with the
    identity as values, so row ``i`` holds ``o_i``'s weights on ``v_0 ... v_{L-1}``.

    Args: as ``dplr_rule`` (no ``v``).
    Returns:
      ``(B, H, L, L)``: ``M[i, j] = k_j^T P_{j+1} ... P_i q_i`` with ``P_t = Diag(w_t) + b_t a_t^T``
      acting on key vectors (``after``; else ``... P_{i-1} q_i`` for ``j < i`` and 0 on the
      diagonal), exactly 0 above the diagonal.
    """
    B, H, L, _ = k.shape
    eye = jnp.broadcast_to(jnp.eye(L, dtype=f32), (B, H, L, L))
    M = dplr_rule(q, k, eye, log_w, a, b, chunk, after)
    return jnp.where(jnp.tril(jnp.ones((L, L), bool), 0 if after else -1), M, 0.0)


__all__ = ["dplr_chunk", "dplr_rule", "dplr_matrix"]
