"""Token relevance for one query position ``q`` (default: the last) and a target logit.

Per-layer maps ``A_l (B, L, L)`` come from ``maps.model_maps`` (Eq. 20 uses the channel
mean, ``how="mean"``). Positions in ``exclude`` (attention sinks, BOS) have their key
column zeroed in every ``A_l`` before combining, and relevance 0 in every method.

raw attention      R = 1/n sum_{l >= s} A_l                         relevance = R[q, :]
rollout            rho = Ahat_{N-1} ... Ahat_{s},  Ahat_l = I + A_l     relevance = rho[q, :]
                   (``normalize_rows``: Ahat_l <- Ahat_l / rowsum(Ahat_l); ``add_identity=False``
                   drops the I)  -- Abnar & Zuidema 2020; Ali et al. 2024 Eq. 20-21
attribution        Ahat_l = I + ( gbar_l[i] * A_l[i, j] )^+ then rolled out as above, with
                   gbar_l[b, i] = mean_c d target / d y_l[b, c, i] (for attention layers the
                   mean runs over heads and head_dim) -- Mamba-Attribution, Ali et al. 2024 Eq. 23
contributions      R_l[i, j] = sum_c g_l[c, i] H_l[c, i, j] v_l[c, j],  g_l = d target / d y_l,
                   v_l = the operator's values; relevance_l[j] = sum_i R_l[i, j] (the gradient
                   already routes position i to the target); relevance = mean over layers.
                   For an exact operator sum_j R_l[i, j] = sum_c g_l[c, i] (y_l - offset_l)[c, i]:
                   the first-order change of the target when layer l's token-mixing output
                   at i is scaled, split over the values j it reads.
                   Attention layers: R_l[i, j] = sum_h P_h[i, j] sum_d g[h, i, d] v[h, j, d]
                   (one weighted ``reduce`` cannot carry the head_dim sum, so it is computed
                   head by head from ``materialize``).

``y_l`` is the operator's ``output`` (the block's own token-mixing output); gradients come
from ``model.tapped_logits(ids, taps)`` with zero taps (through ``model.logit_gradients``,
forward and backward in one compiled program, where the model has it; its forward pass also
gives the mixer inputs the operators are built from). The target is ``logits[b, q, t_b]``
with ``t_b`` the argmax at ``q`` unless given. Every method takes ``variant=`` (the
operator ablations); gradients are always those of the real model. ``heads=`` restricts the
maps (and the contributions sum) to the channels of those heads (``maps.head_channels``);
``segment_pos=`` explains packed documents (Griffin / RecurrentGemma only): every model
call and operator then uses those positions, so nothing crosses a document start.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..nn import check_layers
from ..nn.lm import query_logit_sum
from ..ops import full_precision
from .maps import (check_how, check_normalize, iter_operators, model_kwargs, operator_map, position_mean,
                   select_channels)
from .report import explanation_html

METHODS = ("raw", "rollout", "attribution", "contributions")


# ----------------------------------------------------------------------------- pure functions

def _keep_mask_np(L: int, exclude: Sequence[int]) -> np.ndarray:
    keep = np.ones(L, np.float32)
    for p in exclude:
        if not -L <= int(p) < L:
            raise ValueError(f"exclude position {p} out of range for length {L}")
        keep[int(p) % L] = 0.0
    return keep


def _keep_mask(L: int, exclude: Sequence[int]):
    return jnp.asarray(_keep_mask_np(L, exclude))


def check_start_layer(start_layer, n: int, what: str) -> int:
    """``start_layer`` as an int in ``[0, n)`` (``n`` layers of ``what``); ValueError otherwise."""
    if isinstance(start_layer, (bool, np.bool_)) or not isinstance(start_layer, (int, np.integer)):
        raise ValueError(f"start_layer must be an int, got {start_layer!r}")
    if not 0 <= start_layer < n:
        raise ValueError(f"start_layer must be in [0, {n}) for {n} {what}, got {start_layer}")
    return int(start_layer)


def _check_start(maps, start_layer: int) -> int:
    return check_start_layer(start_layer, maps.shape[0], "layer maps")


def _check_maps(maps):
    maps = jnp.asarray(maps, jnp.float32)
    if maps.ndim != 4 or maps.shape[-1] != maps.shape[-2]:
        raise ValueError(f"maps must have shape (layers, B, L, L), got {maps.shape}")
    return maps


def raw_attention(maps, start_layer: int = 0, exclude: Sequence[int] = ()):
    """Layer-averaged maps. ``maps (N, B, L, L) -> (B, L, L)``: mean of ``A_l`` for ``l >= start_layer``."""
    maps = _check_maps(maps)
    s = _check_start(maps, start_layer)
    keep = _keep_mask(maps.shape[-1], exclude)
    return jnp.mean(maps[s:] * keep, axis=0)


def rollout(maps, start_layer: int = 0, add_identity: bool = True, normalize_rows: bool = False,
            exclude: Sequence[int] = ()):
    """Attention rollout ``rho = Ahat_{N-1} ... Ahat_{start}`` with ``Ahat_l = I + A_l``.

    Args:
      maps: ``(N, B, L, L)`` per-layer maps in layer order (first layer first).
      start_layer: first map (index into ``maps``) included.
      add_identity: add ``I`` (the residual path) to every map.
      normalize_rows: divide each ``Ahat_l`` by its row sums (rows summing to 0 stay 0).
      exclude: positions whose key columns are zeroed in every ``A_l``.
    Returns:
      ``(B, L, L)`` float32; row ``q`` is the relevance of every position for query ``q``.
    """
    maps = _check_maps(maps)
    s = _check_start(maps, start_layer)
    L = maps.shape[-1]
    A = maps[s:] * _keep_mask(L, exclude)
    if add_identity:
        A = A + jnp.eye(L, dtype=jnp.float32)
    if normalize_rows:
        rs = jnp.sum(A, axis=-1, keepdims=True)
        A = jnp.where(rs != 0, A / jnp.where(rs != 0, rs, 1.0), 0.0)

    def step(rho, a):
        return jnp.einsum("bij,bjk->bik", a, rho, precision=jax.lax.Precision.HIGHEST), None

    rho0 = jnp.broadcast_to(jnp.eye(L, dtype=jnp.float32), A.shape[1:])
    rho, _ = jax.lax.scan(step, rho0, A)
    return rho


def attribution_maps(maps, grad_means):
    """Eq. 23 without the identity: ``(gbar[b, i] * A[b, i, j])^+`` per layer.

    ``maps (N, B, L, L)``, ``grad_means (N, B, L)`` -> ``(N, B, L, L)``."""
    maps = _check_maps(maps)
    g = jnp.asarray(grad_means, jnp.float32)
    if g.shape != maps.shape[:3]:
        raise ValueError(f"grad_means must have shape {maps.shape[:3]}, got {g.shape}")
    return jnp.maximum(g[..., :, None] * maps, 0.0)


def contribution_map(op, g, channels=None, block_channels=None, heads=None):
    """Gradient-weighted contributions ``R[b, i, j] = sum_c g[b, c, i] H[b, c, i, j] v[b, c, j]``.

    Args:
      op: operator; ``values`` ``(B, C, L)`` (recurrent) or ``(B, H, L, d)`` (attention).
      g: gradient of the target w.r.t. ``op.output``, same shape as ``op.output``.
      channels: optional channel/head subset (None: all).
      heads: optional head subset instead of ``channels`` (Mamba-2, attention layers).
    Returns:
      ``(B, L, L)`` float32.
    """
    v = op.values
    if tuple(g.shape) != tuple(v.shape):
        raise ValueError(f"gradient shape {g.shape} does not match the operator values {v.shape}")
    if v.ndim not in (3, 4):
        raise ValueError(f"operator values must be (B, C, L) or (B, H, L, d), got {v.shape}")
    return _contribution_map(op, g, select_channels(op, channels, heads), block_channels)


def _contribution_map_impl(op, g, channels, block_channels):
    v = jnp.asarray(op.values, jnp.float32)
    g = jnp.asarray(g, jnp.float32)
    idx = np.arange(v.shape[1]) if channels is None else np.asarray(channels)
    if v.ndim == 3:
        return op.reduce("weighted", weights=g[:, idx], key_weights=v[:, idx], channels=list(idx),
                         block_channels=block_channels)
    B, _, L, _ = v.shape
    R = jnp.zeros((B, L, L), jnp.float32)
    for h in idx:  # one head at a time: O(B L^2) memory
        P = op.materialize([int(h)])[:, 0]
        R = R + P * jnp.einsum("bid,bjd->bij", g[:, h], v[:, h])
    return R


_contribution_map = jax.jit(full_precision(_contribution_map_impl), static_argnums=(2, 3))


# ----------------------------------------------------------------------------- model drivers

def check_query(query: int, L: int) -> int:
    """Normalise a query position (negative counts from the end)."""
    if isinstance(query, (bool, np.bool_)) or not isinstance(query, (int, np.integer)):
        raise ValueError(f"query position must be an int (negative counts from the end), got {query!r}")
    if not -L <= query < L:
        raise ValueError(f"query position {query!r} out of range for length {L}")
    return int(query) % L


def as_ids(ids) -> np.ndarray:
    """Token ids as a ``(B, L)`` numpy array (a ``(L,)`` sequence gets a batch axis); a
    tracer (ids inside ``jax.jit``) stays one."""
    a = ids if isinstance(ids, jax.core.Tracer) else np.asarray(ids)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2:
        raise ValueError(f"ids must have shape (B, L) or (L,), got {a.shape}")
    return a


def resolve_target(model, ids, query: int, target=None, logits=None, segment_pos=None) -> np.ndarray:
    """``(B,)`` target token ids: the argmax at ``query`` (None), or the given int / ``(B,)``.
    ``segment_pos``: document positions for the model call (Griffin only). Under ``jax.jit``
    the argmax is a traced int32 array."""
    ids = as_ids(ids)
    B = ids.shape[0]
    V = model.config.vocab_size
    kw = model_kwargs(model, ids, segment_pos)
    if target is None:
        lg = model(ids, **kw) if logits is None else logits
        t = jnp.argmax(lg[:, query], axis=-1)
        return t if isinstance(t, jax.core.Tracer) else np.asarray(t).astype(np.int64)
    t = np.asarray(target)
    if t.ndim > 1 or t.size not in (1, B) or t.dtype == object or not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"target must be an int or {B} ints (one per example), got {target!r}")
    t = np.broadcast_to(t.reshape(-1), (B,)).astype(np.int64)
    if t.min() < 0 or t.max() >= V:
        raise ValueError(f"target token {int(t.max() if t.max() >= V else t.min())} is outside "
                         f"the vocabulary [0, {V})")
    return t


def output_gradients(model, ids, layers=None, query: int = -1, target=None, segment_pos=None):
    """Gradients of ``sum_b logits[b, q, t_b]`` w.r.t. each selected layer's operator output
    (``segment_pos``: optional ``(B, L)`` document positions, Griffin only). ``t_b`` is
    ``target`` (checked as ``resolve_target`` does) or, when None, the argmax of the logits at
    ``q``, found in the same forward pass as the gradients.

    Returns:
      ``({layer: array shaped like op.output}, q, t)`` with ``q`` normalised and ``t (B,)``.
    """
    grads, q, t, _ = _output_gradients(model, ids, layers, query, target, segment_pos, False)
    return grads, q, t


def _output_gradients(model, ids, layers, query, target, segment_pos, with_inputs: bool):
    # output_gradients, plus (with_inputs) the selected layers' mixer inputs from the same
    # forward pass where the model returns them (None otherwise)
    ids = as_ids(ids)
    B, L = ids.shape
    q = check_query(query, L)
    kw = model_kwargs(model, ids, segment_pos)
    t = None if target is None else resolve_target(model, ids, q, target, **kw)
    grads, t, xs = _query_gradients(model, ids, np.full(B, q), t, layers, segment_pos, with_inputs)
    return grads, q, (t if isinstance(t, jax.core.Tracer) else np.asarray(t).astype(np.int64)), xs


def _query_gradients(model, ids, queries, targets, layers, segment_pos, with_inputs: bool = False):
    """``({layer: gradient}, targets, mixer inputs or None)``: ``model.logit_gradients`` (one
    compiled program; with ``with_inputs`` it also returns the selected layers' mixer inputs)
    where the model has it; otherwise ``jax.grad`` through ``model.tapped_logits``."""
    ids = as_ids(ids)
    B, L = ids.shape
    uniq = sorted(set(check_layers(layers, len(model.layers))))
    kw = model_kwargs(model, ids, segment_pos)
    if hasattr(model, "logit_gradients"):
        taps = {l: np.zeros(model.tap_shape(l, B, L)[0], np.float32) for l in uniq}
        if with_inputs:
            return model.logit_gradients(ids, taps, queries, targets, mixer_inputs=uniq, **kw)
        return (*model.logit_gradients(ids, taps, queries, targets, **kw), None)
    shapes = jax.eval_shape(lambda: [op.output for _, op in iter_operators(model, ids, uniq, **kw)])
    taps = {l: jnp.zeros(s.shape, jnp.float32) for l, s in zip(uniq, shapes)}
    grads, t = jax.grad(lambda taps: query_logit_sum(model.tapped_logits(ids, taps, **kw), queries, targets),
                        has_aux=True)(taps)
    return grads, t, None


def query_gradients(model, ids, queries, targets, layers=None, segment_pos=None) -> dict:
    """Gradients of ``sum_b logits[b, queries[b], targets[b]]`` w.r.t. each selected layer's
    operator output: one query position and target per example (right-padded batches of
    different lengths use ``queries = lengths - 1``). Examples do not interact, so row ``b``
    of each gradient is that of example ``b`` alone.

    Args:
      ids: ``(B, L)`` token ids; queries, targets: ``(B,)`` ints (no range checks: traced
        under ``jax.jit``; ``output_gradients`` checks its own).
    Returns:
      ``{layer: array shaped like op.output}``.
    """
    return _query_gradients(model, ids, queries, targets, layers, segment_pos)[0]


def combine(method: str, maps, queries, grad_means=None, start_layer: int = 0, normalize_rows: bool = False,
            exclude: Sequence[int] = ()):
    """Relevance from per-layer matrices, one query position per example (the combination
    step of ``explain``; see module doc).

    Args:
      method: one of ``METHODS``.
      maps: ``(N, B, L, L)``: the maps ``A_l`` (``"contributions"``: the ``R_l``).
      queries: ``(B,)`` query positions (``>= 0``).
      grad_means: ``(N, B, L)`` ``gbar_l`` (``"attribution"`` only).
    Returns:
      ``(relevance (B, L), layer_maps (N, B, L, L), layer_relevance (N, B, L), matrix (B, L, L)
      or None)``; ``relevance`` is not yet multiplied by the ``exclude`` mask.
    """
    maps = _check_maps(maps)
    keep = _keep_mask(maps.shape[-1], exclude)
    rows, qj = jnp.arange(maps.shape[1]), jnp.asarray(queries)
    if method == "contributions":
        lrel = jnp.sum(maps, axis=2) * keep
        return jnp.mean(lrel[start_layer:], axis=0), maps, lrel, None
    if method == "attribution":
        maps = attribution_maps(maps, grad_means)
    if method == "raw":
        matrix = raw_attention(maps, start_layer, exclude)
    else:
        matrix = rollout(maps, start_layer, True, normalize_rows, exclude)
    return matrix[rows, qj], maps, (maps * keep)[:, rows, qj], matrix


@functools.partial(jax.jit, static_argnames=("method", "start_layer", "normalize_rows", "exclude"))
def _combine_layers(method: str, per_layer: list, grads: list | None, queries, start_layer: int,
                    normalize_rows: bool, exclude: tuple):
    # explain's last step as one compiled program: stack the layer maps (and gradient means)
    # and combine them
    gm = None if grads is None else jnp.stack([position_mean(g) for g in grads])
    return combine(method, jnp.stack(per_layer), queries, gm, start_layer, normalize_rows, exclude)


@dataclasses.dataclass
class Explanation:
    """Result of ``explain``.

    relevance: ``(B, L)`` per-token relevance for the query (0 after it).
    layer_maps: ``(N, B, L, L)`` the per-layer matrices the method combines
      (``A_l``; attribution: ``(gbar A_l)^+``; contributions: ``R_l``).
    layer_relevance: ``(N, B, L)`` row ``q`` of each layer map (contributions: column sums).
    matrix: ``(B, L, L)`` the combined matrix (raw mean / rollout), None for contributions.
    """

    method: str
    variant: str
    layers: list
    query: int
    target: np.ndarray
    relevance: np.ndarray
    layer_maps: np.ndarray
    layer_relevance: np.ndarray
    matrix: np.ndarray | None = None

    def _repr_html_(self) -> str:
        """Notebook view: summary, relevance of example 0, heatmap (``report.explanation_html``;
        call that with ``tokens=`` for token text)."""
        return explanation_html(self)


def explain(model, ids, method: str = "rollout", variant: str = "full", layers=None, query: int = -1,
            target=None, how: str = "abs_mean", channels=None, start_layer: int = 0,
            normalize_rows: bool = False, exclude: Sequence[int] = (), normalize=None,
            progress=None, heads=None, segment_pos=None) -> Explanation:
    """Per-token relevance of ``ids (B, L)`` for ``query`` by ``method`` (see module doc).

    Args:
      model: a family ``LM``.
      method: ``"raw" | "rollout" | "attribution" | "contributions"``.
      variant: operator variant of the family (``"full"``, ``"s6_only"``, ...).
      layers: layer subset (None: all), combined in the order given.
      query: query position (default last); target: token id(s), default argmax at ``query``.
      how, channels, normalize: per-layer map options (``maps.operator_map``); ``channels``
        also restricts the contributions sum. ``how`` defaults to ``"abs_mean"``: signed
        channels cancel in ``"mean"`` (on the shipped induction model its rollout scores
        worse than random; see the README's induction study).
      heads: instead of ``channels``, the channels of these heads (Mamba-2 mixers and
        attention layers; an error for layers without heads).
      segment_pos: optional ``(B, L)`` document positions of packed inputs (Griffin /
        RecurrentGemma only; a ``ValueError`` for other families).
      start_layer: index into ``layers`` of the first map combined.
      normalize_rows, exclude: rollout options (``exclude`` applies to every method).
      progress: optional wrapper of the layer iterator (e.g. ``tqdm``).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_how(how)
    check_normalize(normalize)
    ids = as_ids(ids)
    B, L = ids.shape
    q = check_query(query, L)
    sel = check_layers(layers, len(model.layers))
    kw = model_kwargs(model, ids, segment_pos)
    keep = _keep_mask_np(L, exclude)
    check_start_layer(start_layer, len(sel), "layers")
    grads = xs = None
    if method in ("attribution", "contributions"):  # the mixer inputs come from the gradients' forward pass
        grads, q, t, xs = _output_gradients(model, ids, sel, q, target, segment_pos, True)
    else:
        t = resolve_target(model, ids, q, target, **kw)
    it = iter_operators(model, ids, sel, variant, mixer_inputs=xs, **kw)
    if progress is not None:
        it = progress(it)
    per_layer = []
    for l, op in it:
        if method == "contributions":
            per_layer.append(contribution_map(op, grads[l], channels, heads=heads))
        else:
            per_layer.append(operator_map(op, how, channels, normalize, heads=heads))
    rel, maps, lrel, matrix = _combine_layers(method, per_layer,
                                              [grads[l] for l in sel] if method == "attribution" else None,
                                              np.full(B, q), start_layer, normalize_rows,
                                              tuple(int(p) for p in exclude))
    rel = np.asarray(rel) * keep
    return Explanation(method=method, variant=variant, layers=sel, query=q, target=np.asarray(t),
                       relevance=rel, layer_maps=np.asarray(maps), layer_relevance=np.asarray(lrel),
                       matrix=None if matrix is None else np.asarray(matrix))


__all__ = ["METHODS", "Explanation", "explain", "raw_attention", "rollout", "attribution_maps",
           "contribution_map", "output_gradients", "query_gradients", "combine", "resolve_target", "check_query", "check_start_layer", "as_ids"]
