"""RWKV-4's WKV recurrence in chunks: the XLA form of the time mix's forward."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

f32 = jnp.float32
EMPTY_LOG_MAX = -1e38  # "empty state" log-max, as the HF CPU path (finite: no inf - inf)


def past_decay(n, w):
    """``n * w`` for integer steps ``n >= 0``; exactly 0 at ``n = 0`` (even for ``w = -inf``)."""
    return jnp.where(n > 0, n * w, 0.0)


@functools.partial(jax.jit, static_argnames=("chunk",))  # one compile when eager
def wkv_chunked(w, u, k, v, chunk: int = 32):
    """The WKV recurrence, max-shifted like HF's running-max state, by chunks:
    ``wkv_i = sum_{j<=i} e^{l[i,j]} v_j / sum_{j<=i} e^{l[i,j]}`` with ``l[i,j] = (i-1-j) w + k_j``
    (``j < i``) and ``l[i,i] = u + k_i``, per channel.

    Within a chunk of ``T`` positions all outputs are computed at once (a masked ``T x T``
    softmax-weighted sum); a ``lax.scan`` over the ``L / T`` chunks carries the state ``S = e^m
    (num, den)`` of everything before the chunk. No Python loop over positions, every exponent
    ``<= 0``. No NaN handling: the caller's (``rwkv.block.wkv``).

    Args:
      w: ``(A,)`` log decay (``-exp(time_decay)``); u: ``(A,)`` bonus (``time_first``).
      k, v: ``(B, L, A)`` keys and values.
      chunk: positions per chunk ``T`` (a performance knob).
    Returns:
      ``(B, L, A)`` float32.
    """
    B, L, A = k.shape
    T = max(1, min(chunk, L))
    nc = -(-L // T)
    pad = nc * T - L
    # End padding is never seen by earlier (causal) outputs; it is dropped.
    prep = lambda a: jnp.pad(a.astype(f32), ((0, 0), (0, pad), (0, 0))).reshape(B, nc, T, A).swapaxes(0, 1)
    kc, vc = prep(k), prep(v)  # (nc, B, T, A)
    w, u = w.astype(f32), u.astype(f32)
    s = jnp.arange(T, dtype=f32)
    si, sj = s[:, None], s[None, :]
    # Intra-chunk log weights without k: (s-1-s') w below the diagonal, u on it.
    rel = jnp.where(sj < si, past_decay(si - 1 - sj, w[:, None, None]), u[:, None, None])  # (A, T, T)
    rel = jnp.where(sj <= si, rel, -jnp.inf)
    into = past_decay(s[:, None], w)  # (T, A): decay from the chunk start to position s
    out_of = past_decay(T - 1 - s[:, None], w)  # (T, A): from position s to the chunk end

    def step(state, kv):
        m, n, d = state  # (B, A)
        kk, vv = kv  # (B, T, A)
        l = rel[None] + jnp.swapaxes(kk, 1, 2)[:, :, None, :]  # (B, A, T, T)
        ms = m[:, None, :] + into[None]  # (B, T, A) log weight of the carried state
        top = jnp.maximum(ms, jnp.swapaxes(jnp.max(l, axis=-1), 1, 2))
        e = jnp.exp(l - jnp.swapaxes(top, 1, 2)[..., None])  # (B, A, T, T)
        es = jnp.exp(ms - top)
        num = es * n[:, None, :] + jnp.swapaxes(jnp.einsum("bast,bta->bas", e, vv), 1, 2)
        den = es * d[:, None, :] + jnp.swapaxes(jnp.sum(e, axis=-1), 1, 2)
        # State after the chunk: e^{T w} S + sum_s e^{(T-1-s) w + k_s} (v_s, 1).
        g = out_of[None] + kk  # (B, T, A)
        mc = m + past_decay(jnp.float32(T), w)
        m2 = jnp.maximum(mc, jnp.max(g, axis=1))
        eg, ec = jnp.exp(g - m2[:, None]), jnp.exp(mc - m2)
        state = (m2, ec * n + jnp.sum(eg * vv, axis=1), ec * d + jnp.sum(eg, axis=1))
        return state, num / den

    init = (jnp.full((B, A), EMPTY_LOG_MAX, f32), jnp.zeros((B, A), f32), jnp.zeros((B, A), f32))
    _, out = jax.lax.scan(step, init, (kc, vc))  # (nc, B, T, A)
    return out.swapaxes(0, 1).reshape(B, nc * T, A)[:, :L]
