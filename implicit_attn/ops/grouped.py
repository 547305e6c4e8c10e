"""Grouped matrix products of the mixture-of-experts layers: token copies sorted by expert,
laid out in packs of ``tile`` columns that each belong to one expert.

Copy ``i = t k + j`` is token ``t``'s ``j``-th chosen expert. These are the XLA forms (the
references) of the CPU kernels' products; ``expert_order`` and ``expert_columns`` lay the copies
out for every path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


# Keys ``expert * n + i`` are sorted where ``n E`` is below this (they fit int32).
SORT_KEY_LIMIT = 2 ** 31


def expert_order(experts, E: int):
    """The token copies sorted by expert, stably (copies of one expert in copy order).

    One sort of single integer keys ``expert * n + i`` (a stable argsort, which sorts pairs, took
    2.4x as long on XLA:CPU at 2048 copies) and a scatter for the inverse permutation (a second
    argsort took 20x as long); a plain stable argsort where the keys would not fit int32.

    Args:
      experts: ``(n,)`` int in ``[0, E)``; E: the number of experts.
    Returns:
      ``order (n,)`` int32 (the sorted copies), ``rank (n,)`` int32 (copy ``i``'s place in
      ``order``) and ``sizes (E,)`` int32 (copies per expert).
    """
    n = experts.shape[0]
    i = jnp.arange(n, dtype=jnp.int32)
    if n * max(E, 1) < SORT_KEY_LIMIT:
        order = jnp.sort(experts.astype(jnp.int32) * n + i) % n
    else:
        order = jnp.argsort(experts, stable=True).astype(jnp.int32)
    rank = jnp.zeros(n, jnp.int32).at[order].set(i, unique_indices=True)
    return order, rank, jnp.bincount(experts, length=E).astype(jnp.int32)


def pack_layout(sizes, n: int, tile: int):
    """Where each expert's copies go in the packs (``expert_packs``' layout), per expert.

    Args:
      sizes: ``(E,)`` int copies per expert (``sum(sizes) == n``); n: the number of copies
        (static); tile: columns per pack.
    Returns:
      ``shift (E,)`` int32, what an expert's copies add to their place among the sorted copies
      to give their column (its first pack's first column minus its first sorted copy), and
      ``owner (P,)`` int32 as ``expert_packs`` gives it.
    """
    E = sizes.shape[0]
    P = -(-(n + E * (tile - 1)) // tile)
    packs = (sizes + tile - 1) // tile
    ends = jnp.cumsum(packs)
    shift = (ends - packs) * tile - (jnp.cumsum(sizes) - sizes)
    # every pack against every expert's end: P E compares, which XLA compiles in a fraction of
    # the time of searchsorted's default loop (and E is at most a few hundred)
    owner = jnp.searchsorted(ends, jnp.arange(P), side="right", method="compare_all")
    return shift.astype(jnp.int32), jnp.where(owner < E, owner, -1).astype(jnp.int32)


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
    shift, owner = pack_layout(sizes, n, tile)
    expert = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=n)  # sorted copy i's expert
    return (shift[expert] + jnp.arange(n)).astype(jnp.int32), owner


def expert_columns(experts, rank, sizes, tile: int):
    """Each copy's column in the packs, for the kernels' layout (``expert_packs``): the slot of
    its place among the sorted copies, found from its own expert (no per-copy expert index is
    built for the sorted copies, which cost most of a mixture-of-experts layer's compile time).

    Args:
      experts: ``(n,)`` int copy ``i``'s expert; rank: ``(n,)`` copy ``i``'s place among the
        copies sorted by expert (``expert_order``); sizes: ``(E,)`` copies per expert; tile:
        columns per pack.
    Returns:
      ``col (n,)`` int32, all distinct, and ``owner (P,)`` int32 as ``expert_packs`` gives it.
    """
    shift, owner = pack_layout(sizes, rank.shape[0], tile)
    return (shift[experts] + rank).astype(jnp.int32), owner


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


def packs_from_tokens(x, col, P: int, tile: int):
    """The packs' inputs: column ``col[t, j]`` holds token ``t`` (each of its copies), zero columns
    elsewhere. ``x (T, D)``, ``col (T, k)`` int -> ``(P, D, tile)``."""
    T, k = col.shape
    token = jnp.full((P * tile,), T, jnp.int32).at[col.reshape(-1)].set(
        jnp.repeat(jnp.arange(T, dtype=jnp.int32), k), unique_indices=True)
    xs = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[token]
    return jnp.swapaxes(xs.reshape(P, tile, x.shape[1]), 1, 2)


def grouped_matmul_from_tokens(x, col, owner, w, tile: int):
    """``grouped_matmul_packs`` of the packs ``packs_from_tokens`` lays out: each copy's token
    times its expert's weights, as the packs' columns.

    Args:
      x: ``(T, K)``; col: ``(T, k)`` int, distinct, in ``[0, P tile)``; owner: ``(P,)`` int in
        ``[-1, E)``; w: ``(E, R, K)``; tile: columns per pack.
    Returns:
      ``(P, R, tile)``.
    """
    return grouped_matmul_packs(packs_from_tokens(x, col, owner.shape[0], tile), owner, w)


def grouped_matmul_to_tokens(h, col, weights, owner, w):
    """``grouped_matmul_packs`` of the packs ``h``, then each token's columns weighted and summed:
    ``out[t] = sum_j weights[t, j] y[:, col[t, j]]`` with ``y`` the products' columns.

    Args:
      h: ``(P, K, tile)``; col: ``(T, k)`` int; weights: ``(T, k)``; owner: ``(P,)`` int in
        ``[-1, E)``; w: ``(E, R, K)``.
    Returns:
      ``(T, R)``.
    """
    y = grouped_matmul_packs(h, owner, w)
    P, R, tile = y.shape
    copies = jnp.swapaxes(y, 1, 2).reshape(P * tile, R)[col]  # (T, k, R)
    return jnp.einsum("tkr,tk->tr", copies, weights.astype(y.dtype), precision=jax.lax.Precision.HIGHEST)


__all__ = ["SORT_KEY_LIMIT", "expert_order", "pack_layout", "expert_packs", "expert_columns", "grouped_matmul_packs", "packs_from_tokens",
           "grouped_matmul_from_tokens", "grouped_matmul_to_tokens"]
