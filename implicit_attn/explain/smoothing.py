"""Over-smoothing: how alike the tokens of a layer's feature map are (Ali, Zimerman & Wolf,
"The Hidden Attention of Mamba Models", appendix A, following Wang et al. 2022).

The paper's measure, Eq. (24), for layer ``l`` and its feature map ``X^(l)`` (one row per
token, ``d`` features):

    M_feat^l = 2 / (n (n - 1)) * sum_{i=1}^{n} sum_{j=i+1}^{n}
               X_{i,:}^(l)T X_{j,:}^(l) / ( ||X_{i,:}^(l)||_2 ||X_{j,:}^(l)||_2 )

"the average similarity between all token pairs except for self-similarity": the mean
cosine similarity over the ``n (n - 1) / 2`` unordered pairs ``i < j`` (equivalently over
the ordered pairs ``i != j``); the diagonal ``i == j`` is not counted. In the paper
``X^l`` is ``(L + 1) x d`` for a vision model (``L`` patches plus its CLS token) and the sum
runs over every row; the causal LMs here have no CLS token, so ``n`` is the number of
positions kept: all ``L`` by default, fewer with ``exclude`` (e.g. a BOS / attention-sink
position) or ``mask`` (padding). The paper averages ``M`` over a data set; here it is
returned per example, ``(B, layers)``, and ``smoothing_summary`` averages over the batch.

Computed in float32 without the ``(n, n)`` Gram matrix: with unit rows
``u_i = X_i / ||X_i||`` and keep weights ``m_i in {0, 1}``,

    sum_{i != j} m_i m_j u_i . u_j = || sum_i m_i u_i ||^2 - sum_i m_i ||u_i||^2,

divided by ``n (n - 1)`` (``n = sum_i m_i``). Its rounding error is at most a few float32
epsilons of ``M`` (``|| sum u ||^2 <= n^2``), checked against float64 in the tests.

A feature map is ``(B, L, d)``: the residual stream (``hook_resid_pre`` / ``hook_resid_post``
/ ``hook_resid_mid``), the mixer input (``mixer.hook_in``) or the token mixer's output
(``mixer.hook_out``: ``(B, C, L)`` read as ``(B, L, C)``; attention layers'
``(B, heads, L, head_dim)`` as ``(B, L, heads * head_dim)``), taken from ``run_with_cache``.
A token row of zeros (or NaN / inf) has no cosine: ``oversmoothing`` raises ``ValueError``
naming the layer, example and position.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..nn import check_layers
from .maps import model_kwargs

POINTS = ("hook_resid_pre", "mixer.hook_in", "mixer.hook_out", "hook_resid_mid", "hook_resid_post")


def check_points(point: str, model=None) -> str:
    """``point`` if it is one of ``POINTS`` (and, given ``model``, one of its hook points)."""
    if point not in POINTS:
        raise ValueError(f"point must be one of {POINTS} (a per-token feature map), got {point!r}")
    have = getattr(model, "hook_points", None)
    if have is not None and point not in have:
        raise ValueError(f"this {getattr(model, 'label', type(model).__name__)} model has no {point!r} hook "
                         f"point; its points are {tuple(have)}")
    return point


def keep_mask(B: int, L: int, exclude: Sequence[int] = (), mask=None) -> np.ndarray:
    """``(B, L)`` bool: the positions whose tokens enter the measure.

    Args:
      exclude: positions (negatives count from the end) left out in every example, e.g. 0
        for a BOS / CLS-like first token.
      mask: optional ``(B, L)`` (or ``(L,)``) bool, True for tokens to keep (False: padding).
    Raises:
      ValueError naming the problem: a position out of range, a mask of another shape or
      not boolean, or an example with fewer than 2 kept tokens (no pair to compare).
    """
    if B < 1:
        raise ValueError(f"the over-smoothing measure needs at least one example, got batch size {B}")
    keep = np.ones((B, L), bool)
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype != bool:
            raise ValueError(f"mask must be boolean (True = keep the token), got dtype {m.dtype}")
        if m.ndim == 1:
            m = np.broadcast_to(m[None], (B,) + m.shape)
        if m.shape != (B, L):
            raise ValueError(f"mask must have shape (B, L) = {(B, L)} (or (L,)), got {np.shape(mask)}")
        keep &= m
    for p in exclude:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not -L <= int(p) < L:
            raise ValueError(f"exclude position {p!r} out of range for length {L}")
        keep[:, int(p) % L] = False
    n = keep.sum(axis=1)
    if np.any(n < 2):
        b = int(np.argmin(n))
        raise ValueError(f"the over-smoothing measure averages over token pairs and needs at least 2 tokens "
                         f"per example; example {b} keeps {int(n[b])} of length {L} (after exclude / mask)")
    return keep


@jax.jit
def pairwise_cosine(X, keep):
    """Eq. (24) per example: ``X (B, L, d)`` float, ``keep (B, L)`` bool -> ``(B,)`` float32,
    the mean cosine similarity over the pairs ``i != j`` of kept tokens (module doc).
    Pure and jittable; it does not check its inputs (``feature_smoothing`` does): a kept
    zero row gives NaN, fewer than 2 kept tokens give NaN."""
    X = jnp.asarray(X, jnp.float32)
    keep = jnp.asarray(keep, bool)
    w = keep.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(X * X, axis=-1))
    # left-out rows (padding, excluded positions) may be zero or NaN: never divide by them
    u = jnp.where(keep[..., None], X / jnp.where(keep, norm, 1.0)[..., None], 0.0)
    s = jnp.sum(u, axis=1)                                   # (B, d)
    total = jnp.sum(s * s, axis=-1) - jnp.sum(u * u, axis=(1, 2))
    n = jnp.sum(w, axis=1)
    return total / (n * (n - 1.0))


def feature_smoothing(X, exclude: Sequence[int] = (), mask=None, name: str = "X") -> np.ndarray:
    """Eq. (24) of each example of one feature map ``X (B, L, d)`` (or ``(L, d)``):
    ``(B,)`` float32 numpy. ``ValueError`` for a wrong rank, a non-float dtype, fewer than 2
    kept tokens or a kept token whose row has norm 0 or is not finite."""
    X = np.asarray(X)
    if X.ndim == 2:
        X = X[None]
    if X.ndim != 3:
        raise ValueError(f"{name} must be a feature map (B, L, d) or (L, d), got shape {X.shape}")
    if not np.issubdtype(X.dtype, np.floating) and X.dtype.name != "bfloat16":
        raise ValueError(f"{name} must be floating point, got dtype {X.dtype}")
    B, L, d = X.shape
    if d == 0:
        raise ValueError(f"{name} has no features (d = 0), shape {X.shape}")
    keep = keep_mask(B, L, exclude, mask)
    norms = np.sqrt(np.sum(np.square(X.astype(np.float32)), axis=-1))
    bad = keep & ~(np.isfinite(norms) & (norms > 0))
    if bad.any():
        b, i = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"{name}: token {i} of example {b} has norm {norms[b, i]} (zero or not finite), so its "
                         f"cosine similarity is undefined; leave it out with exclude= or mask=")
    return np.asarray(pairwise_cosine(X, keep))


def token_rows(x, point: str) -> np.ndarray:
    """A cached activation at ``point`` as a ``(B, L, features)`` feature map (module doc)."""
    x = np.asarray(x)
    if point != "mixer.hook_out":
        return x
    if x.ndim == 3:                                         # (B, C, L)
        return np.swapaxes(x, 1, 2)
    B, H, L, P = x.shape                                    # (B, heads, L, head_dim)
    return np.transpose(x, (0, 2, 1, 3)).reshape(B, L, H * P)


def oversmoothing(model, ids, point: str = "hook_resid_post", layers=None, exclude: Sequence[int] = (),
                  mask=None, segment_pos=None) -> np.ndarray:
    """Eq. (24) of every selected layer of ``model`` on ``ids``: ``(B, len(layers))`` float32.

    ``M[b, k]`` is the mean cosine similarity between the kept tokens of example ``b``'s
    feature map at ``blocks.{layers[k]}.{point}`` (module doc), read from one
    ``model.run_with_cache`` pass.

    Args:
      model: any ``nn.LanguageModel`` (a registered family's ``LM``, ``models.las.LaSLM``).
      ids: ``(B, L)`` token ids (``(L,)`` is one example), ``L >= 2``.
      point: one of ``POINTS`` the model has (default: the residual stream leaving the layer).
      layers: None (all), an int or a list (negatives count from the end).
      exclude: positions left out of every example's pairs (e.g. ``(0,)``).
      mask: ``(B, L)`` bool, False for positions left out (padding; a causal model's earlier
        positions do not see right padding, so pad on the right).
      segment_pos: packed-document positions (Griffin / RecurrentGemma), passed to the model.
    Raises:
      ValueError naming the problem (unknown point, layer out of range, fewer than 2 kept
      tokens, a token with zero norm, bad ids).
    """
    check_points(point, model)
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"ids must have shape (B, L), got {ids.shape}")
    B, L = ids.shape
    sel = check_layers(layers, len(model.layers))
    keep_mask(B, L, exclude, mask)  # fail before running the model
    names = [f"blocks.{i}.{point}" for i in sel]
    _, cache = model.run_with_cache(ids, names=names, **model_kwargs(model, ids, segment_pos))
    cols = [feature_smoothing(token_rows(cache[n], point), exclude, mask, name=n) for n in names]
    return np.stack(cols, axis=1).astype(np.float32)


def smoothing_summary(values, layers=None, num_layers: int | None = None, point: str = "hook_resid_post") -> dict:
    """Batch summary of ``oversmoothing`` values for plots and JSON.

    Args:
      values: ``(B, K)`` from ``oversmoothing`` (``(K,)`` is one example).
      layers: the K layer indices (default ``0..K-1``).
      num_layers: the model's layer count (default K), for the normalised depth.
    Returns:
      ``{"point", "layers", "num_layers", "depth", "mean", "std", "min", "max", "n"}``:
      lists of K floats (``depth = (layer + 1) / num_layers``, the paper's "layer index
      normalized by the total number of layers", so models of different depths share an
      axis; ``std`` over the ``n`` examples, ``ddof=0``).
    """
    v = np.asarray(values, np.float64)
    if v.ndim == 1:
        v = v[None]
    if v.ndim != 2 or v.shape[0] == 0 or v.shape[1] == 0:
        raise ValueError(f"values must have shape (B, layers) with B, layers >= 1, got {np.shape(values)}")
    K = v.shape[1]
    layers = list(range(K)) if layers is None else [int(x) for x in layers]
    num_layers = K if num_layers is None else int(num_layers)
    if len(layers) != K:
        raise ValueError(f"{len(layers)} layer indices for {K} columns of values")
    if num_layers < 1 or any(not 0 <= x < num_layers for x in layers):
        raise ValueError(f"layers {layers} must lie in [0, num_layers = {num_layers})")
    return {"point": point, "layers": layers, "num_layers": num_layers,
            "depth": [(x + 1) / num_layers for x in layers],
            "mean": v.mean(axis=0).tolist(), "std": v.std(axis=0).tolist(),
            "min": v.min(axis=0).tolist(), "max": v.max(axis=0).tolist(), "n": int(v.shape[0])}


__all__ = ["oversmoothing", "feature_smoothing", "pairwise_cosine", "smoothing_summary", "keep_mask",
           "token_rows", "POINTS"]
