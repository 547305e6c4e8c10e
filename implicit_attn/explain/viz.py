"""Matplotlib figures (PNG files): heatmap grids of per-layer / per-channel / per-head maps,
single heatmaps, token-relevance strips and faithfulness curves. Inputs are plain arrays;
nothing here computes H. Figures are drawn by Agg outside pyplot, so the user's pyplot
backend and open figures are left as they were.

Heatmaps show ``M[i, j]`` with query ``i`` on rows and key ``j`` on columns; the strict
upper triangle (causally impossible) is left blank.

Colour scales (``scale=``): implicit maps span many decades (a trained Mamba layer at
L = 255: max 9.1, median 7e-4), so a linear scale is almost uniformly dark. ``"log"`` (the
default) uses ``LogNorm`` for non-negative maps, from ``vmin`` = the 5th percentile of the
positive causal entries (at most ``LOG_DECADES`` decades below the max) to the max; smaller
values and zeros are drawn in the lowest colour (the colour bar's extension says so), never
hidden; over two or more decades the colour bar labels each power of ten, without minor
ticks. Signed maps get a symmetric ``SymLogNorm`` around 0 whose linear band is chosen the
same way. ``"linear"``: the plain min..max scale.

Every figure uses constrained layout and wraps long titles, so titles, axis labels and
colour-bar labels stay inside the saved image.
"""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np

from .maps import channel_maps

SCALES = ("log", "linear")
LOG_QUANTILE = 0.05   # vmin (or the SymLog linear band) = this quantile of the nonzero |entries|
LOG_DECADES = 6       # ... but at most this many decades below the largest |entry|

# Faithfulness metrics (keys of ``metrics.faithfulness``): a readable name, which way is
# better (from each metric's definition in ``metrics``), and the axes of its curve.
# ``{score}`` is filled with the score the curve measured ("probability", "logit", ...).
METRIC_INFO = {
    "auac": ("activation AUAC", "higher",
             "fraction of tokens restored (most relevant first)", "target {score}"),
    "au_mse": ("pruning AU-MSE", "lower",
               "fraction of tokens removed (least relevant first)", "MSE of the logits at the query"),
    "positive_auc": ("positive perturbation AUC", "lower",
                     "fraction of tokens removed (most relevant first)", "target {score}"),
    "negative_auc": ("negative perturbation AUC", "higher",
                     "fraction of tokens removed (least relevant first)", "target {score}"),
    "comprehensiveness": ("comprehensiveness (ERASER)", "higher",
                          "rationale size (fraction of tokens)", "{score} drop, rationale removed"),
    "sufficiency": ("sufficiency (ERASER)", "lower",
                    "rationale size (fraction of tokens)", "{score} drop, only rationale kept"),
}
# ``Curve.name`` of each metric's curve -> its key (curves given without their keys).
_CURVE_NAMES = {"activation (AUAC)": "auac", "pruning (AU-MSE)": "au_mse",
                "positive perturbation": "positive_auc", "negative perturbation": "negative_auc",
                "comprehensiveness": "comprehensiveness", "sufficiency": "sufficiency"}
_SCORE_WORDS = {"prob": "probability", "logit": "logit", "top1": "top-1 indicator"}


def metric_label(key: str) -> tuple[str, str | None]:
    """``(readable name, "higher" | "lower" | None)`` of a faithfulness metric key (or curve
    name); unknown keys come back unchanged with no direction."""
    key = _CURVE_NAMES.get(key, key)
    info = METRIC_INFO.get(key)
    return (key, None) if info is None else (info[0], info[1])


def _figure(figsize, dpi: int = 100):
    """A constrained-layout ``matplotlib.figure.Figure`` that belongs to no pyplot state, so
    drawing never switches the user's backend nor leaves open figures behind."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)  # the figure's own Agg canvas: saving and measuring text need no backend switch
    return fig


def _wrap(text: str, width_in: float, fontsize: float) -> str:
    """Wrap ``text`` to lines that fit ``width_in`` inches at ``fontsize`` points."""
    chars = max(12, int(width_in * 72 / (0.6 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in str(text).split("\n"))


def _save(fig, path):
    """Save ``fig`` as PNG (Agg) to a path or a binary file object, return ``path``."""
    target = Path(path) if isinstance(path, (str, os.PathLike)) else path
    fig.savefig(target, format="png")
    return target


def color_norm(values, scale: str = "log"):
    """The colour normalisation of a heatmap (see module doc).

    Args:
      values: array of any shape; NaNs (blank cells) are ignored.
      scale: ``"log"`` or ``"linear"``.
    Returns:
      ``(norm, shown, extend)``: a ``matplotlib.colors.Normalize``, the values to draw
      (entries below a ``LogNorm``'s ``vmin`` raised to it so none is masked), and the
      colour bar ``extend`` (``"min"`` when values were raised).
    """
    from matplotlib import colors

    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    v = np.asarray(values, np.float64)
    fin = v[np.isfinite(v)]
    top = float(np.max(np.abs(fin))) if fin.size else 0.0
    if scale == "linear" or top == 0.0:
        lo, hi = (float(fin.min()), float(fin.max())) if fin.size else (0.0, 1.0)
        return colors.Normalize(lo, hi if hi > lo else lo + 1.0), v, "neither"
    nz = np.abs(fin[fin != 0])
    floor = max(float(np.quantile(nz, LOG_QUANTILE)), top * 10.0 ** -LOG_DECADES)
    if fin.min() < 0:
        return colors.SymLogNorm(linthresh=floor, vmin=-top, vmax=top, base=10), v, "neither"
    floor = min(floor, top / 10.0)  # a constant map still gets one decade
    raised = bool(np.any(fin < floor))
    shown = np.where(np.isfinite(v), np.maximum(v, floor), np.nan)
    return colors.LogNorm(vmin=floor, vmax=top), shown, "min" if raised else "neither"


def _symlog_ticks(norm):
    """A few powers of ten (and 0) as colour-bar ticks for a ``SymLogNorm`` (matplotlib's
    default crowds the linear band); None (automatic) for other norms."""
    if not hasattr(norm, "linthresh"):
        return None
    lo, hi = int(np.ceil(np.log10(norm.linthresh))), int(np.floor(np.log10(norm.vmax)))
    exps = np.arange(lo, hi + 1)
    if exps.size > 3:
        exps = exps[np.unique(np.linspace(0, exps.size - 1, 3).round().astype(int))]
    side = 10.0 ** exps
    return np.concatenate([-side[::-1], [0.0], side])


def _decades(norm) -> float:
    """How many powers of ten a ``LogNorm`` spans (0 for other norms)."""
    from matplotlib import colors

    if not isinstance(norm, colors.LogNorm):
        return 0.0
    return float(np.log10(norm.vmax / norm.vmin))


def _tick_text(x, _pos=None) -> str:
    return "0" if x == 0 else f"{x:.0e}"


def _ticks(ax, tokens, L: int, max_ticks: int = 40):
    if tokens is not None and L <= max_ticks:
        ax.set_xticks(range(L), [str(t) for t in tokens], rotation=90, fontsize=6)
        ax.set_yticks(range(L), [str(t) for t in tokens], fontsize=6)
    else:
        ax.tick_params(labelsize=6)


def _as_maps(mats, causal: bool) -> np.ndarray:
    m = np.asarray(mats, np.float64)
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3 or m.shape[1] != m.shape[2]:
        raise ValueError(f"mats must have shape (N, L, L), got {m.shape}")
    if causal:
        L = m.shape[-1]
        m = np.where(np.tril(np.ones((L, L), bool)), m, np.nan)
    return m


def _heatmaps(m, titles, tokens, ncols, cmap, scale, shared_scale, suptitle, colorbar_label,
              panel=(3.6, 3.2), title_size=8.0, label_size=7.0):
    """A figure of the ``(N, L, L)`` maps ``m`` (NaN = blank), one colour bar per panel."""
    N, L, _ = m.shape
    ncols = max(1, min(ncols, N))
    nrows = -(-N // ncols)
    fig = _figure((panel[0] * ncols, panel[1] * nrows + (0.4 if suptitle else 0)))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    shared = color_norm(m, scale) if shared_scale else None
    for k, ax in enumerate(axes.flat):
        if k >= N:
            ax.axis("off")
            continue
        norm, shown, extend = shared if shared is not None else color_norm(m[k], scale)
        shown = shown[k] if shared is not None else shown
        signed = bool(np.nanmin(m[k]) < 0) if np.isfinite(m[k]).any() else False
        im = ax.imshow(shown, cmap=cmap or ("RdBu_r" if signed else "viridis"), norm=norm,
                       interpolation="nearest")
        ax.set_title(_wrap(titles[k], panel[0] * 0.8, title_size), fontsize=title_size)
        ax.set_xlabel("key position j", fontsize=label_size)
        ax.set_ylabel("query position i", fontsize=label_size)
        _ticks(ax, tokens, L)
        ticks = _symlog_ticks(norm)
        cb = fig.colorbar(im, ax=ax, shrink=0.85, extend=extend, ticks=ticks,
                          format=None if ticks is None else _tick_text)
        cb.ax.tick_params(labelsize=6)
        if _decades(norm) >= 2:  # a labelled power of ten every decade: minor ticks add little, and cost
            cb.minorticks_off()  # a third of the figure's drawing time
        if colorbar_label:
            cb.set_label(colorbar_label, fontsize=label_size)
    if suptitle:
        fig.suptitle(_wrap(suptitle, panel[0] * ncols * 0.95, 10), fontsize=10)
    return fig


def heatmap_grid(mats, path, titles=None, tokens=None, ncols: int = 4, cmap: str | None = None,
                 causal: bool = True, suptitle: str | None = None, shared_scale: bool = False,
                 scale: str = "log", colorbar_label: str | None = None) -> Path:
    """A grid of ``(L, L)`` heatmaps (layers, channels or heads), one colour bar each.

    Args:
      mats: ``(N, L, L)`` array (or ``(L, L)``).
      path: output PNG path (or a binary file object).
      titles: N subplot titles (default ``"0".."N-1"``).
      tokens: optional L token strings for the axes (shown when L <= 40).
      cmap: colour map; default ``"viridis"`` for non-negative maps, the diverging
        ``"RdBu_r"`` (red positive, blue negative) for signed ones.
      shared_scale: one colour range for all panels.
      scale: ``"log"`` (default) or ``"linear"`` colours (see module doc).
      colorbar_label: text beside every colour bar.
    Returns:
      ``path``.
    """
    m = _as_maps(mats, causal)
    N = m.shape[0]
    titles = [str(i) for i in range(N)] if titles is None else list(titles)
    if len(titles) != N:
        raise ValueError(f"{len(titles)} titles for {N} maps")
    color_norm(m[:1, :1, :1], scale)  # validate scale before drawing
    fig = _heatmaps(m, titles, tokens, ncols, cmap, scale, shared_scale, suptitle, colorbar_label)
    return _save(fig, path)


def heatmap(matrix, path, title: str = "", tokens=None, cmap: str | None = None, causal: bool = True,
            scale: str = "log", colorbar_label: str | None = None) -> Path:
    """One large ``(L, L)`` heatmap (query ``i`` rows, key ``j`` columns) as a PNG.

    Args:
      matrix: ``(L, L)``.
      path: output PNG path (or a binary file object).
      title: wrapped to the figure width.
      tokens: optional L token strings for the axes (shown when L <= 40).
      cmap: as ``heatmap_grid``.
      scale: ``"log"`` (default) or ``"linear"`` colours (see module doc).
    Returns:
      ``path``.
    """
    m = _as_maps(matrix, causal)
    if m.shape[0] != 1:
        raise ValueError(f"matrix must have shape (L, L), got {np.shape(matrix)}")
    color_norm(m[:1, :1, :1], scale)
    fig = _heatmaps(m, [title], tokens, 1, cmap, scale, False, None, colorbar_label,
                    panel=(6.0, 5.2), title_size=9.0, label_size=8.0)
    return _save(fig, path)


def relevance_strip(relevance, path, tokens=None, names=None, title: str | None = None,
                    cmap: str = "RdBu_r") -> Path:
    """Token-relevance strips: one row per method, each scaled to ``[-1, 1]`` by its max
    ``|r|`` (diverging colours: red positive, blue negative), token labels below
    (when L <= 80).

    Args:
      relevance: ``(L,)`` or ``(M, L)``.
      path: output PNG path (or a binary file object).
      names: M row labels.
    """
    r = np.asarray(relevance, np.float64)
    if r.ndim == 1:
        r = r[None]
    if r.ndim != 2:
        raise ValueError(f"relevance must have shape (L,) or (M, L), got {r.shape}")
    M, L = r.shape
    names = [str(i) for i in range(M)] if names is None else list(names)
    scale = np.max(np.abs(r), axis=1, keepdims=True)
    rn = np.where(scale > 0, r / np.where(scale > 0, scale, 1), 0.0)
    labelled = tokens is not None and L <= 80
    width = max(5.0, 0.3 * L + 2.5) if labelled else 12.0
    # room for the rotated token labels, the title and a colour bar tall enough for its label
    fig = _figure((width, 0.4 * M + 2.6))
    ax = fig.subplots()
    im = ax.imshow(rn, cmap=cmap, vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(M), names, fontsize=7)
    if labelled:
        ax.set_xticks(range(L), [str(t) for t in tokens], rotation=90, fontsize=7)
    else:
        ax.tick_params(labelsize=7)
    ax.set_xlabel("key position j" if not labelled else "token", fontsize=7)
    cb = fig.colorbar(im, ax=ax, shrink=0.95)
    cb.set_label("relevance\n/ max |relevance|", fontsize=7)
    cb.ax.tick_params(labelsize=6)
    if title:
        ax.set_title(_wrap(title, width * 0.85, 9), fontsize=9)
    return _save(fig, path)


def operator_grid(op, path, channels, batch: int = 0, absolute: bool = True, normalize="minmax",
                  tokens=None, label: str = "channel", scale: str = "log") -> Path:
    """Heatmaps of selected channels (heads) of one operator (``materialize``).

    Args:
      op: an operator; channels: the channel (head) indices, one panel each.
      absolute, normalize: as ``maps.channel_maps`` (default: ``|H|`` min-max per panel).
      scale: ``"log"`` (default) or ``"linear"`` colours.
    """
    idx = np.atleast_1d(np.asarray(channels))
    H = np.asarray(channel_maps(op, idx, absolute, normalize))[batch]
    what = ("|H|" if absolute else "H") + (", min-max per panel" if normalize == "minmax" else "")
    return heatmap_grid(H, path, [f"{label} {int(c)}" for c in idx], tokens, scale=scale,
                        colorbar_label=what)


def curves_plot(curves: dict, path, score: str = "prob") -> Path:
    """Faithfulness curves (``{name: metrics.Curve}``, e.g. ``metrics.faithfulness``):
    batch-mean values vs fraction, one panel each, axes labelled with what was measured
    and the title saying whether a higher or a lower area is better.

    Args:
      curves: ``{metric key: Curve}``.
      path: output PNG path (or a binary file object).
      score: the score the curves measured (``"prob"``, ``"logit"``, ``"top1"``).
    """
    n = len(curves)
    word = _SCORE_WORDS.get(score, score)
    fig = _figure((3.4 * n, 3.2))
    axes = fig.subplots(1, n, squeeze=False)
    for ax, (key, c) in zip(axes.flat, curves.items()):
        k = key if key in METRIC_INFO else _CURVE_NAMES.get(c.name, key)
        info = METRIC_INFO.get(k)
        ax.plot(c.fractions, np.mean(c.values, axis=0), marker="o", ms=3)
        head = f"{c.name}\narea {c.mean_area:.4g}"
        if info is not None:
            head += f" ({info[1]} is better)"
        ax.set_title(head, fontsize=8)
        xl, yl = (info[2], info[3].format(score=word)) if info is not None else ("fraction", "value")
        ax.set_xlabel(_wrap(xl, 3.0, 7), fontsize=7)
        ax.set_ylabel(_wrap(yl, 2.2, 7), fontsize=7)
        ax.tick_params(labelsize=6)
    return _save(fig, path)


def smoothing_plot(summaries: dict, path, title: str | None = None) -> Path:
    """Over-smoothing curves (``{name: explain.smoothing.smoothing_summary(...)}``): the
    batch-mean cosine similarity of each layer's tokens (Eq. 24 of the hidden-attention
    paper) against the layer index normalised by the model's layer count, ``(l + 1) / N``
    (so models of different depths share the axis, as in the paper's Fig. 6), with error
    bars of one standard deviation over the examples. Lower is less smoothing.

    Args:
      summaries: ``{label: summary dict}`` with ``depth``, ``mean``, ``std``, ``layers``.
      path: output PNG path (or a binary file object).
    """
    if not summaries:
        raise ValueError("summaries is empty: give {label: smoothing_summary(...)}")
    fig = _figure((5.0, 3.6))
    ax = fig.subplots()
    for label, s in summaries.items():
        x, m, sd = (np.asarray(s[k], np.float64) for k in ("depth", "mean", "std"))
        k = s.get("num_layers", len(x))
        ax.errorbar(x, m, yerr=sd, marker="o", ms=4, capsize=3, label=f"{label} ({k} layer{'' if k == 1 else 's'})")
    ax.set_xlabel("layer (index + 1) / number of layers", fontsize=8)
    ax.set_ylabel("mean cosine similarity between tokens", fontsize=8)
    ax.set_xlim(0, 1.05)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    point = next(iter(summaries.values())).get("point")
    head = title or f"over-smoothing (Eq. 24){'' if point is None else f' at {point}'}; lower = less smoothing"
    ax.set_title(_wrap(head, 4.5, 9), fontsize=9)
    return _save(fig, path)


__all__ = ["heatmap_grid", "heatmap", "relevance_strip", "operator_grid", "curves_plot", "smoothing_plot",
           "color_norm",
           "metric_label", "METRIC_INFO", "SCALES"]
