"""Adapters to the array layouts existing attention viewers take.

circuitsvis (``circuitsvis.attention.attention_patterns(tokens=..., attention=...)`` and
``attention_heads(attention=..., tokens=...)``): one ``[heads, dest, src]`` float array,
``dest`` = query i, ``src`` = key j, signed values allowed. ``to_circuitsvis`` returns it
as a C-contiguous float32 numpy array (circuitsvis serialises numpy arrays, not JAX ones)
with exact zeros above the diagonal (causal) and only finite values (NaN would reach the
viewer's JSON). ``circuitsvis_kwargs`` returns the keyword arguments of either viewer.
bertviz (``head_view(attention, tokens)``): a list over layers of ``[1, heads, T, T]``
    arrays (torch tensors with ``as_torch=True``; torch is imported only then).

Channels of a recurrent operator play the role of heads; ``heads=`` (``"all"``, an int or
a list) gives one map per head instead, for operators with heads: Mamba-2 (the mean of ``H``
over the head's channels, of ``|H|`` with ``normalize="minmax"``) and attention layers (the
probabilities). Implicit ``H`` is signed and not row-normalised: values are passed on
signed unless ``normalize="minmax"`` asks for min-max normalised ``|H|`` (per head, over
``j <= i``), for viewers that expect weights in ``[0, 1]``.
"""
from __future__ import annotations

import numpy as np

from .maps import channel_maps, channel_tuple, head_maps, minmax_normalize, num_heads

VIEWERS = ("attention_patterns", "attention_heads")


def _heads(x, batch: int, channels, normalize, heads=None):
    if heads is not None:
        if channels is not None:
            raise ValueError("give channels= or heads=, not both")
        channels, by_head = (None if isinstance(heads, str) and heads == "all" else heads), True
    else:
        by_head = False
    if hasattr(x, "materialize"):
        if by_head:
            if normalize not in (None, "minmax"):
                raise ValueError(f"normalize must be None or 'minmax', got {normalize!r}")
            how = "abs_mean" if normalize == "minmax" else "mean"
            H = np.asarray(head_maps(x, channels, how=how, normalize=normalize))
        else:
            H = np.asarray(channel_maps(x, channels, absolute=normalize == "minmax", normalize=normalize))
    else:
        H = np.asarray(x, np.float32)
        if H.ndim == 3:
            H = H[None]
        if H.ndim != 4 or H.shape[-1] != H.shape[-2]:
            raise ValueError(f"expected an operator or a (B, heads, L, L) array, got shape {H.shape}")
        if channels is not None:
            H = H[:, np.atleast_1d(np.asarray(channels))]
        if normalize == "minmax":
            H = np.asarray(minmax_normalize(np.abs(H)))
        elif normalize is not None:
            raise ValueError(f"normalize must be None or 'minmax', got {normalize!r}")
    if not 0 <= batch < H.shape[0]:
        raise ValueError(f"batch index {batch} out of range for batch size {H.shape[0]}")
    return H[batch].astype(np.float32)


def to_circuitsvis(x, batch: int = 0, channels=None, normalize=None, heads=None) -> np.ndarray:
    """The ``attention`` argument of circuitsvis's viewers.

    Args:
      x: an operator, or a ``(B, heads, L, L)`` / ``(heads, L, L)`` array.
      batch: which example.
      channels: channels (heads) to show; ``heads``: one map per head (see module doc).
      normalize: None (signed values as they are) or ``"minmax"`` (``|H|`` scaled to [0, 1]).
    Returns:
      ``(heads', L, L)`` C-contiguous float32 numpy array ``[head, dest = query i, src = key j]``,
      zero above the diagonal.
    Raises:
      ValueError for non-finite values at or below the diagonal.
    """
    a = _heads(x, batch, channels, normalize, heads)
    L = a.shape[-1]
    a = np.where(np.tril(np.ones((L, L), bool)), a, np.float32(0))
    if not np.all(np.isfinite(a)):
        raise ValueError("maps have non-finite values at or below the diagonal; circuitsvis cannot show them")
    return np.ascontiguousarray(a, np.float32)


def _names(x, n: int, channels, heads) -> list[str]:
    """Labels of the ``n`` maps ``to_circuitsvis`` returns, in its order."""
    has_materialize = hasattr(x, "materialize")
    if heads is not None:
        H = num_heads(x) if has_materialize else n
        sel = range(H) if isinstance(heads, str) and heads == "all" else channel_tuple(heads, H)
        return [f"head {h}" for h in sel]
    word = "head" if has_materialize and num_heads(x) == x.shape[1] else "channel"
    if channels is None:
        return [f"{word} {c}" for c in range(n)]
    C = x.shape[1] if has_materialize else np.asarray(x).shape[-3]
    return [f"{word} {c}" for c in channel_tuple(channels, C)]


def circuitsvis_kwargs(x, tokens, batch: int = 0, channels=None, normalize=None, heads=None,
                       viewer: str = "attention_patterns") -> dict:
    """Keyword arguments of a circuitsvis viewer: ``circuitsvis.attention.<viewer>(**kw)``.

    Args:
      x, batch, channels, normalize, heads: as ``to_circuitsvis``.
      tokens: L tokens (converted to ``str``).
      viewer: ``"attention_patterns"`` -> ``{"tokens", "attention"}``;
        ``"attention_heads"`` adds ``attention_head_names`` ("channel c" / "head h"),
        ``mask_upper_tri=True`` and a colour range symmetric around 0 for signed maps
        (``min_value = -max_value``; ``[0, max]`` for non-negative ones).
    Returns:
      dict; ``"attention"`` is ``(heads', L, L)`` float32 ``[head, dest, src]``.
    """
    if viewer not in VIEWERS:
        raise ValueError(f"viewer must be one of {VIEWERS}, got {viewer!r}")
    a = to_circuitsvis(x, batch, channels, normalize, heads)
    if len(tokens) != a.shape[-1]:
        raise ValueError(f"{len(tokens)} tokens for maps of length {a.shape[-1]}")
    kw = {"tokens": [str(t) for t in tokens], "attention": a}
    if viewer == "attention_heads":
        top = float(np.max(np.abs(a))) or 1.0
        kw.update(attention_head_names=_names(x, a.shape[0], channels, heads), mask_upper_tri=True,
                  max_value=top, min_value=-top if a.min() < 0 else 0.0)
    return kw


def to_bertviz(layers, batch: int = 0, channels=None, normalize=None, as_torch: bool = False,
               heads=None) -> list:
    """List over layers of ``[1, heads, T, T]`` arrays from operators or ``(B, heads, L, L)``
    arrays (one per layer); ``heads`` as for ``to_circuitsvis``."""
    out = [_heads(x, batch, channels, normalize, heads)[None] for x in layers]
    if as_torch:
        import torch

        out = [torch.from_numpy(np.ascontiguousarray(a)) for a in out]
    return out


__all__ = ["to_circuitsvis", "circuitsvis_kwargs", "to_bertviz", "VIEWERS"]
