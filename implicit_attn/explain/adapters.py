"""Adapters to the array layouts existing attention viewers take.

circuitsvis (``circuitsvis.attention.attention_patterns(tokens=..., attention=...)``):
    one ``[heads, dest, src]`` float array, ``dest`` = query i, ``src`` = key j.
bertviz (``head_view(attention, tokens)``): a list over layers of ``[1, heads, T, T]``
    arrays (torch tensors with ``as_torch=True``; torch is imported only then).

Channels of a recurrent operator play the role of heads; ``heads=`` (``"all"``, an int or
a list) gives one map per head instead, for operators with heads: Mamba-2 (the mean of ``H``
over the head's channels, of ``|H|`` with ``normalize="minmax"``) and attention layers (the
probabilities). Implicit ``H`` is signed and not row-normalised, so ``normalize="minmax"`` of ``|H|`` (per head, over ``j <= i``) is offered
for viewers that expect weights in ``[0, 1]``.
"""
from __future__ import annotations

import numpy as np

from .maps import channel_maps, head_maps, minmax_normalize


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
    """``[heads, dest, src]`` float32 from an operator or a ``(B, heads, L, L)`` /
    ``(heads, L, L)`` array (``channels`` selects heads/channels; ``heads`` one map per head,
    see module doc)."""
    return _heads(x, batch, channels, normalize, heads)


def circuitsvis_kwargs(x, tokens, batch: int = 0, channels=None, normalize=None, heads=None) -> dict:
    """``{"tokens": [...], "attention": [heads, dest, src]}`` for ``attention_patterns(**kw)``."""
    a = to_circuitsvis(x, batch, channels, normalize, heads)
    if len(tokens) != a.shape[-1]:
        raise ValueError(f"{len(tokens)} tokens for maps of length {a.shape[-1]}")
    return {"tokens": [str(t) for t in tokens], "attention": a}


def to_bertviz(layers, batch: int = 0, channels=None, normalize=None, as_torch: bool = False,
               heads=None) -> list:
    """List over layers of ``[1, heads, T, T]`` arrays from operators or ``(B, heads, L, L)``
    arrays (one per layer); ``heads`` as for ``to_circuitsvis``."""
    out = [_heads(x, batch, channels, normalize, heads)[None] for x in layers]
    if as_torch:
        import torch

        out = [torch.from_numpy(np.ascontiguousarray(a)) for a in out]
    return out


__all__ = ["to_circuitsvis", "circuitsvis_kwargs", "to_bertviz"]
