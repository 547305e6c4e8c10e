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

Heads (``heads=``): for attention operators the channels are the heads; for Mamba-2 head
``h`` owns the ``P = C / num_heads`` channels ``h P .. h P + P - 1`` (they share
``alpha_h``), so selecting heads selects those channels. Families without heads
(Mamba-1, RWKV-4, Griffin's recurrent blocks) raise a ``ValueError``.

Packed documents (``segment_pos``, Griffin / RecurrentGemma only): ``(B, L)`` positions
restarting at 0 at every document start; operators are then masked between documents.
Families that do not take positions raise a ``ValueError`` when it is given.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ..nn import check_layers
from ..ops import full_precision
from ..operator import AttentionOperator, resolve_impl

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
    # m - lo >= 0, but XLA may fuse m's computation into both uses with different rounding
    # (seen: -9e-11 at XLA CPU's low optimisation level); the shift stays at or above 0.
    out = jnp.where(span > 0, jnp.maximum(m - lo, 0.0) / jnp.where(span > 0, span, 1.0), 0.0)
    return jnp.where(mask, out, 0.0)


def operator_map(op, how: str = "mean", channels=None, normalize=None, block_channels=None, heads=None):
    """Channel summary of one operator (``ImplicitOperator`` or attention operator).

    Args:
      op: operator with ``reduce`` (channels, or heads for attention layers).
      how: ``"mean" | "abs_mean" | "pos_mean"``.
      channels: None (all), an int, a slice or a list of channel/head indices.
      normalize: None or ``"minmax"`` (per map, over the causal entries).
      block_channels: channels per step of ``reduce`` (memory bound).
      heads: None, an int, a slice or a list of head indices (instead of ``channels``):
        the mean runs over every channel of those heads (see module doc).
    Returns:
      ``(B, L, L)`` float32.
    """
    check_how(how)
    check_normalize(normalize)
    return _operator_map(op, how, select_channels(op, channels, heads), normalize, block_channels)


def num_heads(op) -> int | None:
    """Number of heads of an operator: attention heads (= channels), Mamba-2 heads, or
    None for operators without heads."""
    if isinstance(op, AttentionOperator):
        return op.shape[1]
    h = getattr(op.core, "num_heads", None)
    return None if h is None else int(h)


def head_channels(op, heads) -> tuple[int, ...]:
    """Channel indices of the selected heads (``heads``: an int, a slice or a list).

    Attention operators: the heads themselves. Mamba-2: head ``h`` -> channels
    ``h P .. h P + P - 1`` with ``P = C / num_heads``. Raises ``ValueError`` for operators
    without heads and for heads out of range."""
    H, hs = _head_tuple(op, heads)
    C = op.shape[1]
    if C % H:
        raise ValueError(f"operator has {C} channels, not a multiple of its {H} heads")
    P = C // H
    return tuple(h * P + p for h in hs for p in range(P))


def _head_tuple(op, heads):
    """``(num_heads, tuple of head indices)``; clear errors for no heads / bad indices."""
    H = num_heads(op)
    if H is None:
        raise ValueError(f"heads= needs an operator with heads (Mamba-2 mixers, attention layers); "
                         f"this {type(op).__name__} with {type(op.core).__name__} has none: use channels=")
    if heads is None:
        return H, tuple(range(H))
    try:
        return H, channel_tuple(heads, H)
    except ValueError as e:
        raise ValueError(str(e).replace("channels", "heads")) from None


def select_channels(op, channels=None, heads=None):
    """``channels`` or the channels of ``heads`` (not both) as a hashable tuple, or None (all)."""
    if heads is not None:
        if channels is not None:
            raise ValueError("give channels= or heads=, not both")
        return head_channels(op, heads)
    return channel_tuple(channels, op.shape[1])


def head_maps(op, heads=None, how: str = "mean", normalize=None, block_channels=None):
    """One map per head: ``(B, H', L, L)`` float32, map ``k`` = ``operator_map`` over the
    channels of head ``heads[k]`` (all heads by default). For Mamba-2 with ``how="mean"``
    this is ``op.head_matrices("mean", heads)``; for attention layers the probabilities."""
    check_how(how)
    check_normalize(normalize)
    _, hs = _head_tuple(op, heads)
    return _head_maps(op, how, tuple(head_channels(op, h) for h in hs), normalize, block_channels)


def _head_maps_impl(op, how, groups, normalize, block_channels):
    op = with_shared_parts(op, np.unique(np.concatenate(groups)))
    return jnp.stack([_operator_map_impl(op, how, g, normalize, block_channels) for g in groups], axis=1)


def with_shared_parts(op, channels):
    """``op`` with the parts its core's channels ``channels (n,)`` (concrete) share formed once, where
    its reductions run in XLA (``impl="auto"`` resolves to "xla", as for head cores on a GPU): a head
    core's matrices of those channels' heads, ``(B, k, L, L)``. Maps over several groups of channels
    (``head_maps``) then read them instead of each forming its own, and the compiled program holds
    the head recurrence once, not once per map (Qwen3-Next's layer, 16 heads, L = 1024: XLA's
    compile of ``head_maps(how="mean")`` 10.7-11.3 s). Otherwise ``op`` itself (a core without
    per-head parts, an attention layer's among them, precomputes nothing)."""
    if resolve_impl("auto", op.core) != "xla":
        return op
    # heads None: every head
    return dataclasses.replace(op, core=op.core.precompute(op.core.heads_to_precompute(np.asarray(channels))))


_head_maps = jax.jit(full_precision(_head_maps_impl), static_argnums=(1, 2, 3, 4))


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
_operator_map = jax.jit(full_precision(_operator_map_impl), static_argnums=(1, 2, 3, 4))


def channel_maps(op, channels=None, absolute: bool = False, normalize=None, heads=None):
    """Dense maps of selected channels/heads: ``(B, C', L, L)`` float32, optionally ``|H|``
    and min-max normalised per ``(b, c)``. ``heads=`` selects every channel of those heads
    (Mamba-2: ``P`` channels per head, in head order)."""
    check_normalize(normalize)
    return _channel_maps(op, select_channels(op, channels, heads), absolute, normalize)


def _channel_maps_impl(op, channels, absolute, normalize):
    H = op.materialize(None if channels is None else list(channels))
    if absolute:
        H = jnp.abs(H)
    return minmax_normalize(H) if normalize == "minmax" else H


_channel_maps = jax.jit(full_precision(_channel_maps_impl), static_argnums=(1, 2, 3))


def takes_segment_pos(model) -> bool:
    """Whether the model's forward pass takes document positions (``segment_pos``)."""
    return bool(getattr(model, "takes_segment_pos", False))


def model_kwargs(model, ids, segment_pos=None) -> dict:
    """``{"segment_pos": (B, L) array}`` for the model calls, or ``{}`` when None.

    ``ids`` is the ``(B, L)`` batch; a ``(L,)`` ``segment_pos`` is given a batch axis.
    Raises ``ValueError`` for a family without documents or a shape unlike ``ids``
    (the model itself checks the values: starts at 0, +1 or restart at 0). A tracer
    (positions inside ``jax.jit``) stays one."""
    if segment_pos is None:
        return {}
    if not takes_segment_pos(model):
        fam = getattr(model, "family", type(model).__name__)
        raise ValueError(f"segment_pos (packed documents) is only taken by Griffin / RecurrentGemma "
                         f"models; this {fam!r} model does not take it")
    pos = segment_pos if isinstance(segment_pos, jax.core.Tracer) else np.asarray(segment_pos)
    shape = np.shape(ids)
    if len(shape) == 1:
        shape = (1,) + shape
    if pos.ndim == 1 and shape[0] == 1:
        pos = pos[None]
    if pos.shape != tuple(shape):
        raise ValueError(f"segment_pos must have the shape of ids {tuple(shape)}, got {pos.shape}")
    return {"segment_pos": pos}


def iter_operators(model, ids, layers=None, variant: str = "full", segment_pos=None,
                   mixer_inputs=None) -> Iterator[tuple[int, object]]:
    """Yield ``(layer, operator)`` one layer at a time (so only one layer's factors are
    alive). Uses one forward pass for all mixer inputs (``model.mixer_inputs``), then
    ``model.layers[i].mixer.as_operator`` layer by layer; a model without ``mixer_inputs``
    is asked for ``model.operators`` one layer at a time.
    ``segment_pos``: ``(B, L)`` document positions (Griffin only, see module doc).
    ``mixer_inputs``: ``{layer: (B, L, d_model)}`` for every selected layer, from a forward
    pass of ``ids`` already run (``logit_gradients(..., mixer_inputs=)``); None runs one."""
    sel = check_layers(layers, len(model.layers))
    kw = model_kwargs(model, ids, segment_pos)
    if mixer_inputs is not None:
        missing = sorted(set(sel) - set(mixer_inputs))
        if missing:
            raise ValueError(f"mixer_inputs has no input for layer(s) {missing}")
        xs = mixer_inputs
    elif not hasattr(model, "mixer_inputs"):
        for l in sel:
            yield l, model.operators(ids, [l], variant, **kw)[0]
        return
    else:
        xs = model.mixer_inputs(ids, sel, **kw)
    for l in sel:
        yield l, model.layers[l].mixer.as_operator(xs[l], variant, **kw)


def model_maps(model, ids, layers=None, variant: str = "full", how: str = "mean", channels=None,
               normalize=None, progress=None, heads=None, segment_pos=None):
    """Per-layer maps of a model for ``ids (B, L)``.

    Args:
      model: a family ``LM`` (``layers``, ``operators``/``mixer_inputs``).
      layers: None (all) or a list of layer indices (order kept).
      variant: the family's operator variant (``"full"``, ``"s6_only"``, ...).
      how, channels, normalize, heads: as ``operator_map`` (``heads`` needs every selected
        layer to have heads).
      progress: optional wrapper of the layer iterator (e.g. ``tqdm``).
      segment_pos: optional ``(B, L)`` document positions (Griffin only).
    Returns:
      ``(n_layers, B, L, L)`` float32.
    """
    check_how(how)
    check_normalize(normalize)
    it = iter_operators(model, ids, layers, variant, segment_pos)
    if progress is not None:
        it = progress(it)
    return jnp.stack([operator_map(op, how, channels, normalize, heads=heads) for _, op in it])


def position_mean(g):
    """Mean of a per-channel array over everything but batch and position:
    ``(B, C, L) -> (B, L)`` or ``(B, H, L, d) -> (B, L)`` (attention layers)."""
    g = jnp.asarray(g, jnp.float32)
    if g.ndim == 3:
        return jnp.mean(g, axis=1)
    if g.ndim == 4:
        return jnp.mean(g, axis=(1, 3))
    raise ValueError(f"expected (B, C, L) or (B, H, L, d), got shape {g.shape}")


__all__ = ["HOWS", "minmax_normalize", "operator_map", "channel_maps", "head_maps", "head_channels",
           "num_heads", "select_channels", "iter_operators", "model_maps", "model_kwargs",
           "takes_segment_pos", "position_mean", "causal_mask"]
