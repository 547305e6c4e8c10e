"""Linear recurrences ``h_t = a_t * h_{t-1} + b_t``: the parallel form, and Mamba-1's selective
scan step by step."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _combine(left, right):
    a_l, b_l = left
    a_r, b_r = right
    return a_l * a_r, a_r * b_l + b_r


@functools.partial(jax.jit, static_argnames=("axis",))  # one compile when eager
def linear_scan(a, b, axis: int = 1, h0=None):
    """All states of ``h_t = a_t * h_{t-1} + b_t`` with ``h_{-1} = h0`` (default 0).

    Uses ``jax.lax.associative_scan`` (O(log L) depth, no Python loop).

    Args:
      a: decays, broadcastable to ``b``.
      b: inputs, e.g. ``(B, L, ...)``.
      axis: the time axis.
      h0: optional initial state, shaped like ``b`` without the time axis.
    Returns:
      ``h`` shaped like ``b``.
    """
    a = jnp.broadcast_to(a, b.shape)
    if h0 is not None:
        first = jax.lax.index_in_dim(b, 0, axis, keepdims=True)
        a0 = jax.lax.index_in_dim(a, 0, axis, keepdims=True)
        first = first + a0 * jnp.expand_dims(h0, axis)
        b = jax.lax.dynamic_update_index_in_dim(b, first, 0, axis)
    _, h = jax.lax.associative_scan(_combine, (a, b), axis=axis)
    return h


@jax.jit  # one compile when eager
def selective_scan_sequential(u, dt, A, Bm, Cm):
    """Mamba-1's selective scan (S6) without its skip term, one ``lax.scan`` step per position:
    ``h_t = exp(dt_t A) * h_{t-1} + (dt_t u_t) B_t``, ``y_t = h_t C_t``, keeping only the
    ``(B, C, N)`` state (decay and input formed inside the step).

    Args:
      u, dt: ``(B, L, C)`` float32 inputs and step sizes; A: ``(C, N)`` or, per batch row,
        ``(B, C, N)``; Bm, Cm: ``(B, L, N)``.
    Returns:
      ``(B, L, C)`` float32.
    """
    def step(h, xs):
        d, uu, bb, cc = xs
        h = jnp.exp(d[..., None] * A) * h + (d * uu)[..., None] * bb[:, None, :]
        return h, jnp.einsum("bcn,bn->bc", h, cc)

    xs = tuple(jnp.moveaxis(v, 1, 0) for v in (dt, u, Bm, Cm))
    h0 = jnp.zeros((u.shape[0], u.shape[2], A.shape[-1]), jnp.float32)
    return jnp.moveaxis(jax.lax.scan(step, h0, xs)[1], 0, 1)
