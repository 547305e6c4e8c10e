"""Matplotlib figures (Agg backend, PNG files): heatmap grids of per-layer / per-channel /
per-head maps and token-relevance strips. Inputs are plain arrays; nothing here computes H.

Heatmaps show ``M[i, j]`` with query ``i`` on rows and key ``j`` on columns; the strict
upper triangle (causally impossible) is left blank.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .maps import channel_maps


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _labels(ax, tokens, L, max_ticks: int = 40):
    if tokens is not None and L <= max_ticks:
        ax.set_xticks(range(L), [str(t) for t in tokens], rotation=90, fontsize=6)
        ax.set_yticks(range(L), [str(t) for t in tokens], fontsize=6)
    else:
        ax.tick_params(labelsize=6)


def heatmap_grid(mats, path, titles=None, tokens=None, ncols: int = 4, cmap: str = "viridis",
                 causal: bool = True, suptitle: str | None = None, shared_scale: bool = False) -> Path:
    """A grid of ``(L, L)`` heatmaps (layers, channels or heads), one colour bar each.

    Args:
      mats: ``(N, L, L)`` array (or ``(L, L)``).
      path: output PNG path.
      titles: N subplot titles (default ``"0".."N-1"``).
      tokens: optional L token strings for the axes (shown when L <= 40).
      shared_scale: one colour range for all panels.
    Returns:
      ``path``.
    """
    plt = _plt()
    m = np.asarray(mats, np.float64)
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3 or m.shape[1] != m.shape[2]:
        raise ValueError(f"mats must have shape (N, L, L), got {m.shape}")
    N, L, _ = m.shape
    titles = [str(i) for i in range(N)] if titles is None else list(titles)
    if len(titles) != N:
        raise ValueError(f"{len(titles)} titles for {N} maps")
    if causal:
        m = np.where(np.tril(np.ones((L, L), bool)), m, np.nan)
    vmin = vmax = None
    if shared_scale:
        vmin, vmax = np.nanmin(m), np.nanmax(m)
    ncols = max(1, min(ncols, N))
    nrows = -(-N // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols, 3.0 * nrows), dpi=100, squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k >= N:
            ax.axis("off")
            continue
        im = ax.imshow(m[k], cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_title(titles[k], fontsize=8)
        _labels(ax, tokens, L)
        fig.colorbar(im, ax=ax, shrink=0.75)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def relevance_strip(relevance, path, tokens=None, names=None, title: str | None = None,
                    cmap: str = "RdBu_r") -> Path:
    """Token-relevance strips: one row per method, each scaled to ``[-1, 1]`` by its max
    ``|r|`` (diverging colours: red positive, blue negative), token labels below.

    Args:
      relevance: ``(L,)`` or ``(M, L)``.
      names: M row labels.
    """
    plt = _plt()
    r = np.asarray(relevance, np.float64)
    if r.ndim == 1:
        r = r[None]
    if r.ndim != 2:
        raise ValueError(f"relevance must have shape (L,) or (M, L), got {r.shape}")
    M, L = r.shape
    names = [str(i) for i in range(M)] if names is None else list(names)
    scale = np.max(np.abs(r), axis=1, keepdims=True)
    rn = np.where(scale > 0, r / np.where(scale > 0, scale, 1), 0.0)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * L + 2), 0.5 * M + 1.4), dpi=100)
    im = ax.imshow(rn, cmap=cmap, vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(M), names, fontsize=7)
    if tokens is not None and L <= 80:
        ax.set_xticks(range(L), [str(t) for t in tokens], rotation=90, fontsize=7)
    fig.colorbar(im, ax=ax, shrink=0.9, label="relevance / max|relevance|")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def operator_grid(op, path, channels, batch: int = 0, absolute: bool = True, normalize="minmax",
                  tokens=None, label: str = "channel") -> Path:
    """Heatmaps of selected channels (heads) of one operator (``materialize``)."""
    idx = np.atleast_1d(np.asarray(channels))
    H = np.asarray(channel_maps(op, idx, absolute, normalize))[batch]
    return heatmap_grid(H, path, [f"{label} {int(c)}" for c in idx], tokens)


def curves_plot(curves: dict, path) -> Path:
    """Faithfulness curves (``{name: metrics.Curve}``), batch-mean values vs fraction."""
    plt = _plt()
    n = len(curves)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 2.8), dpi=100, squeeze=False)
    for ax, (name, c) in zip(axes.flat, curves.items()):
        ax.plot(c.fractions, np.mean(c.values, axis=0), marker="o", ms=3)
        ax.set_title(f"{c.name}\narea {c.mean_area:.4g}", fontsize=8)
        ax.set_xlabel("fraction", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["heatmap_grid", "relevance_strip", "operator_grid", "curves_plot"]
