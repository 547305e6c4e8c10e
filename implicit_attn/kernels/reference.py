"""Pure-jnp references for the kernels (the materialize reference is ``core.dense``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .tiles import apply_mode


def xla_reduce(core, idx, mode, qw, kw):
    """``sum_c qw[b,c,i] f(H_c[b,i,j]) kw[b,c,j]`` one channel at a time (``lax.scan`` with
    rematerialisation, so the backward pass also stays at ``O(B L^2)``).

    Args:
      core: any operator core; idx: ``(n,)`` int; mode: int (array) 0 identity, 1 abs, 2 positive
        part (``tiles.MODES``);
      qw, kw: ``(B, n, L)`` float32.
    Returns:
      ``(B, L, L)`` float32.
    """
    def body(acc, xs):
        c, q, k = xs
        H = apply_mode(core.dense(c[None])[:, 0], mode)
        return acc + q[:, :, None] * H * k[:, None, :], None

    B, n, L = qw.shape
    xs = (jnp.asarray(idx), jnp.moveaxis(qw, 1, 0), jnp.moveaxis(kw, 1, 0))
    out, _ = jax.lax.scan(jax.checkpoint(body), jnp.zeros((B, L, L), jnp.float32), xs)
    return out
