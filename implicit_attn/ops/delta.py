"""The gated delta rule's token-mixing matrix, chunk by chunk.

Per head, ``S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T`` and ``o_t = S_t q_t`` give
``o_i = sum_{j <= i} M[i, j] v_j`` with one scalar ``M[i, j]`` shared by every value channel.
With ``u_t = b_t (v_t - a_t S_{t-1} k_t)`` the state is ``S_t = a_t S_{t-1} + u_t k_t^T``, so
``U = T^{-1} diag(b) V`` with ``T = I + diag(b) tril(K K^T * Gamma, -1)`` and ``O = tril(Q K^T *
Gamma) U``, ``Gamma[i, j] = prod_{t=j+1..i} a_t`` (the WY / UT form). ``M`` is ``O`` for the
identity as values: the recurrence runs over chunks of ``chunk`` positions with a state of
one row per source position, each chunk a unit-triangular solve (never an inverse), every
decay a product of factors in ``(0, 1]`` (no ``exp(S_i - S_j)`` of a large positive number).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32


def delta_rule(q, k, v, log_a, beta, chunk: int = 64):
    """The gated delta rule's outputs ``o_t = S_t q_t``, chunk by chunk (float32).

    Args:
      q, k: ``(B, H, L, d_k)`` queries and keys as the recurrence uses them (normalised and
        scaled as the model does).
      v: ``(B, H, L, d_v)`` values.
      log_a: ``(B, H, L)`` log decays (``<= 0``; 0: no decay, plain DeltaNet).
      beta: ``(B, H, L)`` write strengths ``b_t`` (in ``[0, 2]`` for a contracting step).
      chunk: positions per chunk (a performance knob; the numbers do not depend on it beyond
        float32 rounding).
    Returns:
      ``(B, H, L, d_v)`` float32.
    """
    B, H, L, dk = k.shape
    dv = v.shape[-1]
    C = max(1, min(chunk, L))
    Lp = -(-L // C) * C
    pad = lambda x, *tail: jnp.pad(x.astype(f32), ((0, 0), (0, 0), (0, Lp - L)) + tail)
    q, k, v = pad(q, (0, 0)), pad(k, (0, 0)), pad(v, (0, 0))
    log_a, beta = pad(log_a), pad(beta)  # padded steps: no decay, no write
    n = Lp // C
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[:2] + (n, C) + x.shape[3:]), 2, 0)
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    lower = jnp.tril(jnp.ones((C, C), bool))
    eye = jnp.eye(C, dtype=f32)

    def step(S, xs):
        """``S (B, H, d_v, d_k)``: the state entering the chunk."""
        qc, kc, vc, gc, bc = xs
        G = jnp.cumsum(gc, axis=-1)  # (B, H, C): log prod of a from the chunk start
        diff = G[..., :, None] - G[..., None, :]
        decay_s = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
        decay_l = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
        T = eye + bc[..., :, None] * (jnp.einsum("bhid,bhjd->bhij", kc, kc) * decay_s)
        eG = jnp.exp(G)
        W = vc - eG[..., :, None] * jnp.einsum("bhid,bhvd->bhiv", kc, S)  # (B, H, C, d_v)
        U = jax.scipy.linalg.solve_triangular(T, bc[..., :, None] * W, lower=True, unit_diagonal=True)
        qk = jnp.einsum("bhid,bhjd->bhij", qc, kc) * decay_l
        O = eG[..., :, None] * jnp.einsum("bhid,bhvd->bhiv", qc, S) + qk @ U
        tail = jnp.exp(G[..., -1:] - G)  # (B, H, C): decay from each step to the chunk's end
        S = jnp.exp(G[..., -1])[..., None, None] * S + jnp.einsum("bhtv,bhtd->bhvd", U, tail[..., None] * kc)
        return S, O

    S0 = jnp.zeros((B, H, dv, dk), f32)
    _, O = jax.lax.scan(step, S0, tuple(split(x) for x in (q, k, v, log_a, beta)))
    return jnp.moveaxis(O, 0, 2).reshape(B, H, Lp, dv)[:, :, :L]


def delta_rule_matrix(q, k, log_a, beta, chunk: int = 64):
    """``M (B, H, L, L)`` float32 of the gated delta rule of each head: ``delta_rule`` with the
    identity as values (value channel ``j`` is position ``j``'s indicator), so row ``i`` is
    ``o_i``'s weights on ``v_0 ... v_{L-1}``.

    Args: as ``delta_rule`` (no ``v``).
    Returns:
      ``(B, H, L, L)``: ``M[i, j] = b_j k_j^T A_{j+1} A_{j+2} ... A_i q_i`` with ``A_t = a_t (I -
      b_t k_t k_t^T)`` for ``j <= i``, exactly 0 above the diagonal.
    """
    B, H, L, _ = k.shape
    eye = jnp.broadcast_to(jnp.eye(L, dtype=f32), (B, H, L, L))
    M = delta_rule(q, k, eye, log_a, beta, chunk)
    return jnp.where(jnp.tril(jnp.ones((L, L), bool)), M, 0.0)


__all__ = ["delta_rule", "delta_rule_matrix"]
