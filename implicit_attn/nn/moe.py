"""Mixture-of-experts feed-forward layers of the hybrid families: routers and the expert
computation, grouped by expert so only the chosen experts run.

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


def experts_forward(x, weights, experts, w_in, w_out, act, block: int = 64):
    """Weighted sum of the chosen experts' MLPs, ``sum_j weights[t, j] * E_{experts[t, j]}(x[t])``
    with ``E_e(x) = w_out[e] @ act(w_in[e] @ x)``; only the chosen experts run.

    The token copies are sorted by expert. On accelerators the experts run as one grouped
    matmul (``jax.lax.ragged_dot``); on CPU, where that lowering is slow, each expert's group
    is padded to whole blocks of ``block`` rows and a loop runs one expert per block.

    Args:
      x: ``(T, D)`` tokens; weights: ``(T, k)`` routing weights; experts: ``(T, k)`` int
        expert indices in ``[0, E)``;
      w_in: ``(E, F_in, D)``; w_out: ``(E, D, F)``; act: ``(..., F_in) -> (..., F)``.
    Returns:
      ``(T, D)`` in ``x``'s dtype.
    """
    w_in, w_out = jnp.asarray(w_in), jnp.asarray(w_out)
    T, k = experts.shape
    E = w_in.shape[0]
    n = T * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # token copies grouped by expert
    tok, sorted_experts = order // k, flat[order]
    sizes = jnp.bincount(flat, length=E)
    xs = x[tok]

    def grouped(xs):
        u = jax.lax.ragged_dot(xs, jnp.swapaxes(w_in, 1, 2), sizes)
        return jax.lax.ragged_dot(act(u), jnp.swapaxes(w_out, 1, 2), sizes)

    def blocked(xs):
        padded = (sizes + block - 1) // block * block
        end = jnp.cumsum(padded)
        rows = -(-(n + E * (block - 1)) // block) * block  # enough for any routing
        dest = (end - padded)[sorted_experts] + jnp.arange(n) - (jnp.cumsum(sizes) - sizes)[sorted_experts]
        xp = jnp.zeros((rows, x.shape[1]), x.dtype).at[dest].set(xs).reshape(rows // block, block, -1)
        owner = jnp.minimum(jnp.searchsorted(end, jnp.arange(rows // block) * block, side="right"), E - 1)
        out = jax.lax.map(lambda a: act(a[0] @ w_in[a[1]].T) @ w_out[a[1]].T, (xp, owner))
        return out.reshape(rows, -1)[dest]

    o = jax.lax.platform_dependent(xs, cpu=blocked, default=grouped)
    o = o * weights.reshape(-1)[order][:, None].astype(o.dtype)
    return jnp.zeros_like(x).at[tok].add(o.astype(x.dtype))


__all__ = ["topk_then_softmax", "softmax_then_topk", "gated_act", "experts_forward"]
