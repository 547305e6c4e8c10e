"""Grouped matrix products of the mixture-of-experts layers: token copies sorted by expert,
laid out in packs of ``tile`` columns that each belong to one expert."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_packs(sizes, n: int, tile: int):
    """The pack layout of ``n`` token copies sorted by expert, ``sizes[e]`` of them expert
    ``e``'s (``sum(sizes) == n``): each expert's copies fill whole packs of ``tile`` columns, the
    last one padded.

    Args:
      sizes: ``(E,)`` int; n: the number of copies (static); tile: columns per pack.
    Returns:
      ``slot (n,)`` int32, sorted copy ``i``'s column in the packs laid end to end (pack ``p``
      holds columns ``p tile .. p tile + tile - 1``), and ``owner (P,)`` int32, each pack's expert,
      -1 for the packs past the copies; ``P = ceil((n + E (tile - 1)) / tile)`` packs hold any
      routing.
    """
    E = sizes.shape[0]
    P = -(-(n + E * (tile - 1)) // tile)
    packs = (sizes + tile - 1) // tile
    ends = jnp.cumsum(packs)
    expert = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=n)  # sorted copy i's expert
    slot = (ends - packs)[expert] * tile + jnp.arange(n) - (jnp.cumsum(sizes) - sizes)[expert]
    owner = jnp.searchsorted(ends, jnp.arange(P), side="right")
    return slot.astype(jnp.int32), jnp.where(owner < E, owner, -1).astype(jnp.int32)


def grouped_matmul_packs(x, owner, w):
    """``out[p] = w[owner[p]] @ x[p]``, zeros where ``owner[p] < 0``: every pack's product with its
    expert's weights (each pack's weights gathered: the reference form, not a fast one).

    Args:
      x: ``(P, K, T)`` the packs' inputs as columns; owner: ``(P,)`` int in ``[-1, E)``;
      w: ``(E, R, K)``.
    Returns:
      ``(P, R, T)`` in the inputs' result dtype.
    """
    y = jnp.einsum("prk,pkt->prt", jnp.take(w, jnp.maximum(owner, 0), axis=0), x,
                   precision=jax.lax.Precision.HIGHEST)
    return jnp.where((owner >= 0)[:, None, None], y, jnp.zeros((), y.dtype))


__all__ = ["expert_packs", "grouped_matmul_packs"]
