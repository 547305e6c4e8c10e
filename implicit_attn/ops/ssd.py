"""Mamba-2's state-space duality (SSD) scan in chunks: the XLA form of the block's forward."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .scan import linear_scan
from .segsum import keep_causal, segment_sum

f32 = jnp.float32
SEGSUM_CHUNK = 16  # the split of the in-chunk segment sums (a performance knob)


@functools.partial(jax.jit, static_argnames=("chunk",))  # one compile when eager
def ssd_chunked(x, dt, A, Bm, Cm, chunk: int = 64):
    """Chunked SSD: ``y_h = alpha_h (dt_h x_h)`` for every head, without forming ``alpha``, i.e. the
    recurrence ``S_t = exp(dt_t A_h) S_{t-1} + (dt_t x_t) B_t^T``, ``y_t = S_t C_t`` per head.

    Intra-chunk blocks are masked matmuls with stable segment sums; chunk states are passed on
    by a scan over chunks. Any ``L`` (the tail chunk is zero-padded with ``dt = 0``). NaN inputs,
    a state input that overflows, and the skip are the caller's (``mamba2.block.ssd``); here the
    in-chunk products keep exact zeros above the diagonal, where ``C_i . B_j`` of huge finite
    ``B``, ``C`` may be inf.

    Args:
      x: ``(B, L, H, P)`` head inputs; dt: ``(B, L, H)`` step sizes; A: ``(H,)`` (negative), or
        per batch row ``(B, 1, H)``;
      Bm, Cm: ``(B, L, G, N)`` with ``H % G == 0`` (head ``h`` reads group ``h // (H / G)``);
      chunk: chunk length (a performance knob).
    Returns:
      ``(B, L, H, P)`` float32.
    """
    Bn, L, H, P = x.shape
    G, N = Bm.shape[2:]
    hg = H // G
    Q = min(chunk, L)
    nc = -(-L // Q)
    pad = nc * Q - L
    padt = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    # Heads leading, then positions: every product below is a plain batched matmul over (b, c, g[, h]).
    xs = padt(x.astype(f32) * dt[..., None]).reshape(Bn, nc, Q, G, hg, P).transpose(0, 1, 3, 4, 2, 5)  # (b, c, g, h, j, p)
    Bc = padt(Bm).reshape(Bn, nc, Q, G, N).transpose(0, 1, 3, 2, 4)  # (b, c, g, j, n)
    Cc = padt(Cm).reshape(Bn, nc, Q, G, N).transpose(0, 1, 3, 2, 4)
    la = padt(dt * A).reshape(Bn, nc, Q, G, hg).transpose(0, 1, 3, 4, 2)  # (b, c, g, h, j)

    # Diagonal blocks: (C_i . B_j) exp(segment sum) masked.
    dec = jnp.exp(segment_sum(la, SEGSUM_CHUNK))  # (b, c, g, h, i, j)
    # keep_causal: C_i . B_j of huge finite B, C can overflow, and 0 * inf above the diagonal is NaN
    y = keep_causal((Cc @ jnp.swapaxes(Bc, -1, -2))[:, :, :, None] * dec) @ xs  # (b, c, g, h, i, p)

    # State at the end of each chunk, then passed from chunk to chunk.
    cs = jnp.cumsum(la, axis=-1)
    tot = cs[..., -1]  # (b, c, g, h)
    states = jnp.einsum("bcghjp,bcgjn->bcghpn", xs * jnp.exp(tot[..., None] - cs)[..., None], Bc)
    h = linear_scan(jnp.exp(tot)[..., None, None], states, axis=1)
    prev = jnp.pad(h, ((0, 0), (1, 0)) + ((0, 0),) * 4)[:, :nc]  # state entering each chunk
    y = y + jnp.einsum("bcgin,bcghpn->bcghip", Cc, prev) * jnp.exp(cs)[..., None]

    y = y.transpose(0, 1, 4, 2, 3, 5)
    return y.reshape(Bn, nc * Q, H, P)[:, :L]


__all__ = ["ssd_chunked", "SEGSUM_CHUNK"]
