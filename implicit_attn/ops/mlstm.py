"""The mLSTM (xLSTM's matrix memory) with one scalar forget and input gate per head.

Per head, with log forget gates ``f_t <= 0`` (``logsigmoid``), log input gates ``i_t`` and a
stabiliser ``m_t``, the state ``C_t = e^{f_t + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} k_t v_t^T``
(and ``n_t`` likewise with ``k_t``) is read as

    h_t = (C_t^T q_t) / (max(|n_t . q_t|, e^{-m_t}) + eps)

(``q`` already scaled by ``d_k^-1/2``). Unrolled, ``h_i = sum_{j<=i} M[i, j] v_j`` with

    M[i, j] = e^{F[i, j] + i_j - m_i} (q_i . k_j) / (max(|sum_j e^{F[i, j] + i_j - m_i} q_i . k_j|, e^{-m_i}) + eps)

where ``F[i, j] = f_{j+1} + ... + f_i``: the stabiliser cancels in the ratio except through the
floor ``e^{-m_i}`` and ``eps``, so the operator is exact only with the stabiliser the model itself
computes. Hugging Face's torch xLSTM (its native kernels) computes ``m`` chunk-wise for the
longest prefix that is a multiple of the chunk size and step by step for the rest
(``mlstm_stabiliser``); ``mlstm_rule`` is the forward for any given ``m`` and ``mlstm_matrix`` the
matrix ``M``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .segsum import causal_mask, chunk_sums, decayed_scores, segment_sum

f32 = jnp.float32


def chunk_stabiliser(log_f, log_i, chunk: int, m0):
    """The chunk-wise form's stabiliser over ``L = nc * chunk`` positions, starting from the carried
    ``m0 (...)``: within chunk ``k`` (``b`` the chunk-local cumulative log forget gates, ``M_k`` the
    state's stabiliser before the chunk) ``m_i = max(b_i + M_k, max_{j <= i} (b_i - b_j) + i_j)``,
    and ``M_{k+1} = max(b_last + M_k, max_s (b_last - b_s) + i_s)``.

    Returns ``(m (..., L), M_nc (...))``."""
    *lead, L = log_f.shape
    nc = L // chunk
    f = log_f.reshape(*lead, nc, chunk)
    i = log_i.reshape(*lead, nc, chunk)
    b = jnp.cumsum(f, axis=-1)
    g = b[..., -1]
    a_max = jnp.max(b[..., -1:] - b + i, axis=-1)

    def step(m, xs):
        g_k, a_k = xs
        return jnp.maximum(g_k + m, a_k), m

    m_last, m_inter = jax.lax.scan(step, m0, (jnp.moveaxis(g, -1, 0), jnp.moveaxis(a_max, -1, 0)))
    m_inter = jnp.moveaxis(m_inter, 0, -1)  # (..., nc): before each chunk
    log_d = jnp.where(causal_mask(chunk), b[..., :, None] - b[..., None, :], -jnp.inf) + i[..., None, :]
    m = jnp.maximum(b + m_inter[..., None], jnp.max(log_d, axis=-1))
    return m.reshape(*lead, L), m_last


def step_stabiliser(log_f, log_i, m0):
    """The step-by-step form's stabiliser ``m_t = max(f_t + m_{t-1}, i_t)`` from ``m0 (...)``:
    ``(m (..., L), m_L (...))``."""
    def step(m, xs):
        f_t, i_t = xs
        m = jnp.maximum(f_t + m, i_t)
        return m, m

    m_last, m = jax.lax.scan(step, m0, (jnp.moveaxis(log_f, -1, 0), jnp.moveaxis(log_i, -1, 0)))
    return jnp.moveaxis(m, 0, -1), m_last


@functools.partial(jax.jit, static_argnames=("chunk", "segment"))  # one compile when eager
def mlstm_stabiliser(log_f, log_i, chunk: int, segment: int | None = None):
    """The stabiliser ``m (..., L)`` of Hugging Face's torch xLSTM forward (its native kernels, zero
    initial state): the sequence is cut into pieces of ``segment`` positions when it is longer
    (``max_inference_chunksize``; None: one piece); in each piece the longest prefix that is a
    multiple of ``chunk`` runs chunk-wise (``chunk_stabiliser``) and the rest step by step
    (``step_stabiliser``), ``m`` carried throughout."""
    log_f, log_i = log_f.astype(f32), log_i.astype(f32)
    L = log_f.shape[-1]
    m = jnp.zeros(log_f.shape[:-1], f32)
    cuts = range(0, L, segment) if segment is not None and L > segment else [0]
    parts = []
    for s in cuts:
        e = L if segment is None or L <= segment else min(s + segment, L)
        n = (e - s) // chunk * chunk
        if n:
            part, m = chunk_stabiliser(log_f[..., s:s + n], log_i[..., s:s + n], chunk, m)
            parts.append(part)
        if e - s - n:
            part, m = step_stabiliser(log_f[..., s + n:e], log_i[..., s + n:e], m)
            parts.append(part)
    return jnp.concatenate(parts, axis=-1)


@functools.partial(jax.jit, static_argnames=("eps", "chunk"))  # one compile when eager
def mlstm_rule(q, k, v, log_f, log_i, m, eps: float, chunk: int = 64):
    """The mLSTM read-out ``h (..., L, d_v)`` and its normaliser ``max(|n . q|, e^{-m}) + eps (..., L)``
    for the stabiliser ``m (..., L)``, chunk-wise: within a
    chunk the decayed ``q k^T`` block, across chunks a state stabilised by its own running maximum
    (every exponential ``<= 1`` because ``m_i`` is at least every log weight of row ``i``). The log
    weights are stable segment sums (the torch kernels take differences of chunk-local cumulative
    sums, which lose ``|b| 2^-24``: about 1e-5 of a weight after 64 steps of ``e^-3``).

    Args:
      q: ``(..., L, d_k)`` queries (already scaled); k: ``(..., L, d_k)``; v: ``(..., L, d_v)``;
      log_f, log_i, m: ``(..., L)`` log forget gates, log input gates, the stabiliser; eps: added
      to the normaliser; chunk: the chunk length (a performance knob).
    """
    q, k, v, log_f, log_i, m = (x.astype(f32) for x in (q, k, v, log_f, log_i, m))
    *lead, L, dk = q.shape
    dv = v.shape[-1]
    Q = max(1, min(chunk, L))
    nc = -(-L // Q)
    pad = nc * Q - L
    padded = lambda x, extra: jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)] + [(0, 0)] * extra)
    q, k, v = (padded(x, 1).reshape(*lead, nc, Q, x.shape[-1]) for x in (q, k, v))
    log_f, log_i, m = (padded(x, 0).reshape(*lead, nc, Q) for x in (log_f, log_i, m))
    # chunk-local sums of same-signed terms (never a difference of partial sums, ``ops.segsum``):
    # the prefix up to each row, the suffix after each column, the pairs within the chunk
    b, suffix, _ = chunk_sums(log_f)
    g = b[..., -1]
    a = suffix + log_i

    def step(carry, xs):
        C, n, M = carry
        g_k, a_k, k_k, v_k = xs
        M_next = jnp.maximum(g_k + M, jnp.max(a_k, axis=-1))
        kw = k_k * jnp.exp(a_k - M_next[..., None])[..., None]
        decay = jnp.exp(g_k + M - M_next)
        C_next = decay[..., None, None] * C + jnp.einsum("...sd,...se->...de", kw, v_k)
        n_next = decay[..., None] * n + jnp.sum(kw, axis=-2)
        return (C_next, n_next, M_next), (C, n, M)

    init = (jnp.zeros((*lead, dk, dv), f32), jnp.zeros((*lead, dk), f32), jnp.zeros(tuple(lead), f32))
    mv = lambda x: jnp.moveaxis(x, len(lead), 0)
    _, (Cs, ns, Ms) = jax.lax.scan(step, init, (mv(g), mv(a), mv(k), mv(v)))
    Cs, ns, Ms = (jnp.moveaxis(x, 0, len(lead)) for x in (Cs, ns, Ms))
    tril = causal_mask(Q)
    log_d = segment_sum(log_f, Q) + log_i[..., None, :] - m[..., :, None]
    P = jnp.where(tril, jnp.exp(log_d) * jnp.einsum("...id,...jd->...ij", q, k), 0.0)
    inter = jnp.exp(b + Ms[..., None] - m)
    num = inter[..., None] * jnp.einsum("...id,...de->...ie", q, Cs) + P @ v
    den = inter * jnp.einsum("...id,...d->...i", q, ns) + jnp.sum(P, axis=-1)
    norm = jnp.maximum(jnp.abs(den), jnp.exp(-m)) + eps
    h = num / norm[..., None]
    return h.reshape(*lead, nc * Q, dv)[..., :L, :], norm.reshape(*lead, nc * Q)[..., :L]


@functools.partial(jax.jit, static_argnames=("eps", "chunk"))  # one compile when eager
def mlstm_matrix(q, k, log_f, log_i, m, eps: float | None = None, norm=None, chunk: int = 16):
    """The mLSTM's matrix ``M (..., L, L)`` (module docstring): ``h = M v``. ``q, k (..., L, d_k)``
    (``q`` scaled), ``log_f, log_i, m (..., L)``; the weights ``exp(F[i, j] + i_j - m_i)`` by
    ``segsum.decayed_scores`` (``chunk``: its blocks), exact zeros above the diagonal. The rows are divided by
    ``norm (..., L)`` when given (the forward's own normaliser, ``mlstm_rule``: where the normaliser
    is a near-cancelling sum its float32 rounding differs between summation orders, and the
    operator must divide by the forward's), else by ``max(|row sum|, e^{-m}) + eps``."""
    q, k, log_f, log_i, m = (x.astype(f32) for x in (q, k, log_f, log_i, m))
    P = decayed_scores(q, k, log_f, -m, log_i, chunk)
    if norm is None:
        if eps is None:
            raise ValueError("mlstm_matrix needs eps or norm")
        norm = jnp.maximum(jnp.abs(jnp.sum(P, axis=-1)), jnp.exp(-m)) + eps
    return P / norm.astype(f32)[..., None]


__all__ = ["chunk_stabiliser", "step_stabiliser", "mlstm_stabiliser", "mlstm_rule", "mlstm_matrix"]
