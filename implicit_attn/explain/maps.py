"""Per-layer maps: one ``(B, L, L)`` matrix per layer summarising an operator's channels.

For an operator with channels (heads, for attention layers) ``c`` and dense ``H[b, c, i, j]``
(weight of value ``j`` in output ``i``), over the selected channels ``S``:

    mean      A[b, i, j] = 1/|S| sum_{c in S} H[b, c, i, j]
    abs_mean  A[b, i, j] = 1/|S| sum_{c in S} |H[b, c, i, j]|
    pos_mean  A[b, i, j] = 1/|S| sum_{c in S} max(H[b, c, i, j], 0)
    minmax    A'[b] = (A[b] - min A[b]) / (max A[b] - min A[b]), min/max over the causal
              entries j <= i of each map; 0 above the diagonal (and everywhere if max == min)

The channel summaries go through ``op.reduce`` (blocked over channels, ``O(B L^2)``
memory), so all channels of a real layer fit at lengths where ``(B, C, L, L)`` cannot.
"""
from __future__ import annotations

from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ..models.base import check_layers

HOWS = ("mean", "abs_mean", "pos_mean")
NORMALIZE = (None, "minmax")


def check_how(how: str) -> str:
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, got {how!r}")
    return how


def check_normalize(normalize):
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
    return normalize


def causal_mask(L: int, dtype=bool):
    """``(L, L)`` lower-triangular mask (``j <= i``)."""
    return jnp.tril(jnp.ones((L, L), dtype))


def minmax_normalize(m, causal: bool = True):
    """Min-max normalise each ``(L, L)`` map of ``m (..., L, L)`` to [0, 1].

    With ``causal`` the min and max are taken over ``j <= i`` only and the strict upper
    triangle is returned as 0. A constant map becomes all zeros.
    """
    m = jnp.asarray(m, jnp.float32)
    L = m.shape[-1]
    mask = causal_mask(L) if causal else jnp.ones((L, L), bool)
    lo = jnp.min(jnp.where(mask, m, jnp.inf), axis=(-2, -1), keepdims=True)
    hi = jnp.max(jnp.where(mask, m, -jnp.inf), axis=(-2, -1), keepdims=True)
    span = hi - lo
    out = jnp.where(span > 0, (m - lo) / jnp.where(span > 0, span, 1.0), 0.0)
    return jnp.where(mask, out, 0.0)


def operator_map(op, how: str = "mean", channels=None, normalize=None, block_channels=None):
    """Channel summary of one operator (``ImplicitOperator`` or attention operator).

    Args:
      op: operator with ``reduce`` (channels, or heads for attention layers).
      how: ``"mean" | "abs_mean" | "pos_mean"``.
      channels: None (all), an int, a slice or a list of channel/head indices.
      normalize: None or ``"minmax"`` (per map, over the causal entries).
      block_channels: channels per step of ``reduce`` (memory bound).
    Returns:
      ``(B, L, L)`` float32.
    """
    check_how(how)
    check_normalize(normalize)
    return _operator_map(op, how, channel_tuple(channels, op.shape[1]), normalize, block_channels)


def channel_tuple(channels, C: int):
    """None or a hashable tuple of channel indices (for static jit arguments); range-checked."""
    if channels is None:
        return None
    if isinstance(channels, slice):
        channels = list(range(C))[channels]
    idx = np.atleast_1d(np.asarray(channels))
    if idx.ndim != 1 or idx.size == 0 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"channels must be an int, a slice or a non-empty list of ints, got {channels!r}")
    if idx.min() < -C or idx.max() >= C:
        raise ValueError(f"channels out of range for an operator with {C} channels: {idx.tolist()}")
    return tuple(int(c) % C for c in idx)


def _operator_map_impl(op, how, channels, normalize, block_channels):
    m = op.reduce(how, channels=None if channels is None else list(channels), block_channels=block_channels)
    return minmax_normalize(m) if normalize == "minmax" else m


# Layers of equal shapes share one compilation (the operator is a pytree argument).
_operator_map = jax.jit(_operator_map_impl, static_argnums=(1, 2, 3, 4))


def channel_maps(op, channels, absolute: bool = False, normalize=None):
    """Dense maps of selected channels/heads: ``(B, C', L, L)`` float32, optionally ``|H|``
    and min-max normalised per ``(b, c)``."""
    check_normalize(normalize)
    return _channel_maps(op, channel_tuple(channels, op.shape[1]), absolute, normalize)


def _channel_maps_impl(op, channels, absolute, normalize):
    H = op.materialize(None if channels is None else list(channels))
    if absolute:
        H = jnp.abs(H)
    return minmax_normalize(H) if normalize == "minmax" else H


_channel_maps = jax.jit(_channel_maps_impl, static_argnums=(1, 2, 3))


def iter_operators(model, ids, layers=None, variant: str = "full") -> Iterator[tuple[int, object]]:
    """Yield ``(layer, operator)`` one layer at a time (so only one layer's factors are
    alive). Uses one forward pass for all mixer inputs when the model exposes
    ``mixer_name`` (``model.layers[i].<mixer_name>.as_operator``), else ``model.operators``."""
    sel = check_layers(layers, len(model.layers))
    name = getattr(model, "mixer_name", None)
    if name is None or not hasattr(model, "mixer_inputs"):
        for l in sel:
            yield l, model.operators(ids, [l], variant)[0]
        return
    xs = model.mixer_inputs(ids, sel)
    for l in sel:
        yield l, getattr(model.layers[l], name).as_operator(xs[l], variant)


def model_maps(model, ids, layers=None, variant: str = "full", how: str = "mean", channels=None,
               normalize=None, progress=None):
    """Per-layer maps of a model for ``ids (B, L)``.

    Args:
      model: a family ``LM`` (``layers``, ``operators``/``mixer_inputs``).
      layers: None (all) or a list of layer indices (order kept).
      variant: the family's operator variant (``"full"``, ``"s6_only"``, ...).
      how, channels, normalize: as ``operator_map``.
      progress: optional wrapper of the layer iterator (e.g. ``tqdm``).
    Returns:
      ``(n_layers, B, L, L)`` float32.
    """
    check_how(how)
    check_normalize(normalize)
    it = iter_operators(model, ids, layers, variant)
    if progress is not None:
        it = progress(it)
    return jnp.stack([operator_map(op, how, channels, normalize) for _, op in it])


def position_mean(g):
    """Mean of a per-channel array over everything but batch and position:
    ``(B, C, L) -> (B, L)`` or ``(B, H, L, d) -> (B, L)`` (attention layers)."""
    g = jnp.asarray(g, jnp.float32)
    if g.ndim == 3:
        return jnp.mean(g, axis=1)
    if g.ndim == 4:
        return jnp.mean(g, axis=(1, 3))
    raise ValueError(f"expected (B, C, L) or (B, H, L, d), got shape {g.shape}")


__all__ = ["HOWS", "minmax_normalize", "operator_map", "channel_maps", "iter_operators", "model_maps",
           "position_mean", "causal_mask"]
