"""Mixture-of-experts feed-forward layers of the hybrid families: routers and the expert
computation, grouped by expert (``jax.lax.ragged_dot``) so only the chosen experts run.

Each token's output depends on that token alone (no capacity limits, no token dropping),
so the layers keep causality, NaN in one token included.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32


def topk_then_softmax(logits, k: int):
    """GraniteMoe routing: the ``k`` largest logits per token, weighted by the softmax over
    those ``k``. ``logits (T, E) -> (weights (T, k) float32, experts (T, k) int32)``."""
    top, idx = jax.lax.top_k(logits.astype(f32), k)
    return jax.nn.softmax(top, axis=-1), idx


def softmax_then_topk(logits, k: int):
    """Mixtral/Jamba routing: softmax over all experts, then the ``k`` largest probabilities,
    not renormalised. ``logits (T, E) -> (weights (T, k) float32, experts (T, k) int32)``."""
    return jax.lax.top_k(jax.nn.softmax(logits.astype(f32), axis=-1), k)


def gated_act(act):
    """``u (..., 2F) -> act(u[..., :F]) * u[..., F:]`` (a fused gate/up projection)."""
    def f(u):
        g, up = jnp.split(u, 2, axis=-1)
        return act(g) * up
    return f


def experts_forward(x, weights, experts, w_in, w_out, act):
    """Weighted sum of the chosen experts' MLPs, ``sum_j weights[t, j] * E_{experts[t, j]}(x[t])``
    with ``E_e(x) = w_out[e] @ act(w_in[e] @ x)``.

    Args:
      x: ``(T, D)`` tokens; weights: ``(T, k)`` routing weights; experts: ``(T, k)`` int
        expert indices in ``[0, E)``;
      w_in: ``(E, F_in, D)``; w_out: ``(E, D, F)``; act: ``(..., F_in) -> (..., F)``.
    Returns:
      ``(T, D)`` in ``x``'s dtype.
    """
    T, k = experts.shape
    E = w_in.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # token copies grouped by expert
    tok = order // k
    sizes = jnp.bincount(flat, length=E)
    u = jax.lax.ragged_dot(x[tok], jnp.swapaxes(w_in, 1, 2), sizes)
    o = jax.lax.ragged_dot(act(u), jnp.swapaxes(w_out, 1, 2), sizes)
    o = o * weights.reshape(-1)[order][:, None].astype(o.dtype)
    return jnp.zeros_like(x).at[tok].add(o.astype(x.dtype))


__all__ = ["topk_then_softmax", "softmax_then_topk", "gated_act", "experts_forward"]
