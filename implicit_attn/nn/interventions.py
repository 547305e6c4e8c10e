"""Interventions on the implicit attention: scale or knock out entries ``H[c, i, j]`` of a
layer's operator and get the exact change of the mixer output.

The mixer output is ``y[c, i] = sum_j H[c, i, j] v[c, j] + offset[c, i]``, so scaling the
chosen entries by ``s`` changes it by ``(s - 1) * sum_{j chosen} H[c, i, j] v[c, j]``
(``-H[c, i, j] v[c, j]`` for a knockout). ``edit_delta`` computes that change from the
layer's operator; the LM adds it at ``blocks.{layer}.mixer.hook_out``, so every later
layer sees the edited output and runs its own (unedited) math.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from ..operator.base import channel_index


@dataclass(frozen=True)
class AttentionEdit:
    """Scale entries of layer ``layer``'s operator ``H`` by ``scale`` (0 = knockout).

    Attributes:
      layer: layer index (negatives count from the end).
      keys: key positions ``j`` (columns) to edit; None = all.
      queries: query positions ``i`` (rows) to edit; None = all.
      entries: explicit ``[(i, j), ...]`` pairs instead of ``keys`` x ``queries``
        (each needs ``j <= i``: ``H`` is causal).
      channels: operator channels (heads for attention layers) to edit: None = all, an
        int, a slice or a list of ints.
      scale: the factor applied to the chosen entries.
    """

    layer: int
    keys: Any = None
    queries: Any = None
    entries: Sequence[tuple[int, int]] | None = None
    channels: Any = None
    scale: float = 0.0


def positions(pos, L: int, what: str) -> np.ndarray:
    """``pos`` (None = all, an int or a list of ints; negatives count from the end) as
    sorted unique ``(n,)`` ints in ``[0, L)``; ValueError naming the problem otherwise."""
    if pos is None:
        return np.arange(L)
    p = np.atleast_1d(np.asarray(pos))
    if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"{what} must be an int or a non-empty list of ints, got {pos!r}")
    if p.min() < -L or p.max() >= L:
        raise ValueError(f"{what} {p.tolist()} out of range for length {L}")
    return np.unique(p % L)


def edit_mask(edit: AttentionEdit, L: int) -> np.ndarray:
    """``(L, L)`` bool: the entries ``(i, j)`` the edit scales (only ``j <= i``)."""
    causal = np.tril(np.ones((L, L), bool))
    if edit.entries is not None:
        if edit.keys is not None or edit.queries is not None:
            raise ValueError("give entries= or keys=/queries=, not both")
        e = np.asarray(edit.entries)
        if e.ndim != 2 or e.shape[1] != 2 or e.shape[0] == 0 or not np.issubdtype(e.dtype, np.integer):
            raise ValueError(f"entries must be a non-empty list of (query, key) int pairs, got {edit.entries!r}")
        if e.min() < -L or e.max() >= L:
            raise ValueError(f"entries {e.tolist()} out of range for length {L}")
        e = e % L
        above = e[:, 1] > e[:, 0]
        if above.any():
            i, j = e[np.argmax(above)]
            raise ValueError(f"entry (query {i}, key {j}) is above the diagonal: H is causal and zero there")
        m = np.zeros((L, L), bool)
        m[e[:, 0], e[:, 1]] = True
        return m
    m = np.zeros((L, L), bool)
    m[np.ix_(positions(edit.queries, L, "queries"), positions(edit.keys, L, "keys"))] = True
    return m & causal


def check_scale(scale) -> float:
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return s


def edit_delta(op, edits: Sequence[AttentionEdit]):
    """The change of ``op.output`` when the entries of ``edits`` (all for this operator's
    layer) are scaled; edits that overlap multiply their scales.

    Args:
      op: the layer's operator (``ImplicitOperator`` with ``values (B, C, L)`` or
        ``AttentionOperator`` with ``values (B, H, L, d)``), variant ``"full"``.
      edits: the layer's ``AttentionEdit``s.
    Returns:
      an array of ``op.output``'s shape: ``sum_j (F[c, i, j] - 1) H[c, i, j] v[c, j]`` with
      ``F`` the product of the scales covering each entry (1 elsewhere).
    """
    C = op.core.num_channels
    L = op.values.shape[2]
    chans = []
    for e in edits:
        idx = np.asarray(channel_index(e.channels, C))
        if len(np.unique(idx)) != len(idx):
            raise ValueError(f"channels {np.asarray(e.channels).tolist()} list a channel twice")
        chans.append(idx)
    touched = np.unique(np.concatenate(chans))
    row = {int(c): k for k, c in enumerate(touched)}
    F = np.ones((len(touched), L, L), np.float32)
    for e, idx in zip(edits, chans):
        factor = np.where(edit_mask(e, L), np.float32(check_scale(e.scale)), np.float32(1.0))
        F[[row[int(c)] for c in idx]] *= factor
    H = op.materialize(channels=touched)
    G = (jnp.asarray(F) - 1.0)[None] * H
    v = jnp.take(op.values, touched, axis=1).astype(jnp.float32)
    d = jnp.einsum("bkij,bkj->bki", G, v) if v.ndim == 3 else jnp.einsum("bkij,bkjd->bkid", G, v)
    return jnp.zeros(op.output.shape, jnp.float32).at[:, touched].set(d)


__all__ = ["AttentionEdit", "positions", "edit_mask", "check_scale", "edit_delta"]
