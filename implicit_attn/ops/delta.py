"""The gated delta rule's token-mixing matrix, chunk by chunk.

Per head, ``S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T`` and ``o_t = S_t q_t`` give
``o_i = sum_{j <= i} M[i, j] v_j`` with one scalar ``M[i, j]`` shared by every value channel.
With ``u_t = b_t (v_t - a_t S_{t-1} k_t)`` the state is ``S_t = a_t S_{t-1} + u_t k_t^T``, so
``U = T^{-1} diag(b) V`` with ``T = I + diag(b) tril(K K^T * Gamma, -1)`` and ``O = tril(Q K^T *
Gamma) U``, ``Gamma[i, j] = prod_{t=j+1..i} a_t`` (the WY / UT form). ``M`` is ``O`` for the
identity as values: the recurrence runs over chunks of ``chunk`` positions with a state of
one row per source position, each chunk a unit-triangular solve (never an inverse), every
decay a product of factors in ``(0, 1]`` (no ``exp(S_i - S_j)`` of a large positive number).

Kimi Delta Attention decays each key dimension separately (``a_t`` a vector, the state times
``Diag(a_t)``); the same steps hold with ``Gamma`` moved inside the key sums: ``(K K^T * Gamma)[i,
j] = sum_d k_id k_jd prod_{t=j+1..i} a_td``, formed per chunk from the pairwise differences of
the cumulative log decays (``(C, C, d_k)`` per head; each factor again in ``(0, 1]``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32


def masked_exp(x, mask):
    """``exp(x)`` where ``mask``, exactly 0 elsewhere (no ``exp`` of an unmasked large value)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def delta_rule(q, k, v, log_a, beta, chunk: int = 64, erase: bool = True):
    """The gated delta rule's outputs ``o_t = S_t q_t``, chunk by chunk (float32).

    Args:
      q, k: ``(B, H, L, d_k)`` queries and keys as the recurrence uses them (normalised and
        scaled as the model does).
      v: ``(B, H, L, d_v)`` values.
      log_a: ``(B, H, L)`` log decays, one per head (Gated DeltaNet), or ``(B, H, L, d_k)``, one
        per key dimension (Kimi Delta Attention: the state decays by ``Diag(a_t)`` before the
        erasure, ``S_t = (S_{t-1} Diag(a_t)) (I - b_t k_t k_t^T) + b_t v_t k_t^T``); ``<= 0``.
      beta: ``(B, H, L)`` write strengths ``b_t`` (in ``[0, 2]`` for a contracting step).
      chunk: positions per chunk (a performance knob; the numbers do not depend on it beyond
        float32 rounding).
      erase: False leaves the erasure ``(I - b_t k_t k_t^T)`` out: gated linear attention,
        ``S_t = S_{t-1} Diag(a_t) + b_t v_t k_t^T``.
    Returns:
      ``(B, H, L, d_v)`` float32.
    """
    B, H, L, dk = k.shape
    dv = v.shape[-1]
    per_dim = log_a.ndim == 4
    C = max(1, min(chunk, L))
    Lp = -(-L // C) * C
    pad = lambda x, *tail: jnp.pad(x.astype(f32), ((0, 0), (0, 0), (0, Lp - L)) + tail)
    q, k, v = pad(q, (0, 0)), pad(k, (0, 0)), pad(v, (0, 0))
    log_a, beta = pad(log_a, *((0, 0),) * per_dim), pad(beta)  # padded steps: no decay, no write
    n = Lp // C
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[:2] + (n, C) + x.shape[3:]), 2, 0)
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    lower = jnp.tril(jnp.ones((C, C), bool))
    eye = jnp.eye(C, dtype=f32)

    def step(S, xs):
        """``S (B, H, d_v, d_k)``: the state entering the chunk."""
        qc, kc, vc, gc, bc = xs
        G = jnp.cumsum(gc, axis=2)  # (B, H, C[, d_k]): log prod of a from the chunk start
        if per_dim:
            diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # (B, H, C, C, d_k)
            pair = lambda x, y, m: jnp.einsum("bhid,bhjd,bhijd->bhij", x, y, masked_exp(diff, m[..., None]))
            eG, to_end = jnp.exp(G), jnp.exp(G[:, :, -1:] - G)  # (B, H, C, d_k)
            S_decay = jnp.exp(G[:, :, -1])[:, :, None, :]
        else:
            diff = G[..., :, None] - G[..., None, :]  # (B, H, C, C)
            pair = lambda x, y, m: jnp.einsum("bhid,bhjd->bhij", x, y) * masked_exp(diff, m)
            eG, to_end = jnp.exp(G)[..., None], jnp.exp(G[..., -1:] - G)[..., None]
            S_decay = jnp.exp(G[..., -1])[..., None, None]
        if erase:
            T = eye + bc[..., :, None] * pair(kc, kc, strict)
            W = vc - jnp.einsum("bhid,bhvd->bhiv", kc * eG, S)  # (B, H, C, d_v)
            U = jax.scipy.linalg.solve_triangular(T, bc[..., :, None] * W, lower=True, unit_diagonal=True)
        else:
            U = bc[..., :, None] * vc
        O = jnp.einsum("bhid,bhvd->bhiv", qc * eG, S) + pair(qc, kc, lower) @ U
        S = S_decay * S + jnp.einsum("bhtv,bhtd->bhvd", U, to_end * kc)
        return S, O

    S0 = jnp.zeros((B, H, dv, dk), f32)
    _, O = jax.lax.scan(step, S0, tuple(split(x) for x in (q, k, v, log_a, beta)))
    return jnp.moveaxis(O, 0, 2).reshape(B, H, Lp, dv)[:, :, :L]


def delta_rule_matrix(q, k, log_a, beta, chunk: int = 64, erase: bool = True):
    """``M (B, H, L, L)`` float32 of the gated delta rule of each head: ``delta_rule`` with the
    identity as values (value channel ``j`` is position ``j``'s indicator), so row ``i`` is
    ``o_i``'s weights on ``v_0 ... v_{L-1}``.

    Args: as ``delta_rule`` (no ``v``).
    Returns:
      ``(B, H, L, L)``: ``M[i, j] = b_j k_j^T A_{j+1} A_{j+2} ... A_i q_i`` with ``A_t = Diag(a_t) (I -
      b_t k_t k_t^T)`` (``a_t`` a scalar or per key dimension; without the erasure: ``Diag(a_t)``)
      for ``j <= i``, exactly 0 above the diagonal.
    """
    B, H, L, _ = k.shape
    eye = jnp.broadcast_to(jnp.eye(L, dtype=f32), (B, H, L, L))
    M = delta_rule(q, k, eye, log_a, beta, chunk, erase)
    return jnp.where(jnp.tril(jnp.ones((L, L), bool)), M, 0.0)


__all__ = ["masked_exp", "delta_rule", "delta_rule_matrix"]
