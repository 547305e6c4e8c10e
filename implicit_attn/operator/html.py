"""Notebook view of an operator (``_repr_html_``): a table of what it is and a small
heatmap of example 0's channel-mean ``|H|``.

This layer may not import a plotting library, so the heatmap is a PNG written here with
numpy and zlib: log colour scale (``|H|`` spans many decades), a viridis-like ramp,
the causally impossible upper triangle light grey, maps longer than ``MAX_PIXELS``
block-averaged down. The map comes from ``op.reduce("abs_mean")``, whose cost grows with
``B * C * L * L``; above ``MAX_ELEMENTS`` the view says so and draws no heatmap.
"""
from __future__ import annotations

import base64
import html
import struct
import zlib

import jax
import numpy as np

MAX_ELEMENTS = 1 << 24   # B*C*L*L above which no heatmap is computed
MAX_PIXELS = 256         # longer maps are block-averaged to at most this many pixels a side
DISPLAY_PX = 240         # on-screen size of the heatmap
LOG_DECADES = 6          # colour range: at most this many decades below the max
LOG_QUANTILE = 0.05      # ... starting at this quantile of the positive entries

# A few points of a perceptually ordered dark-blue -> green -> yellow ramp (viridis-like).
_RAMP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], np.float64)
_BLANK = np.array([236, 236, 236], np.uint8)


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def png_bytes(rgb: np.ndarray) -> bytes:
    """Encode ``(h, w, 3)`` uint8 RGB as a PNG file (no filtering, zlib level 6)."""
    rgb = np.ascontiguousarray(rgb, np.uint8)
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, 3 * w)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def ramp(t: np.ndarray) -> np.ndarray:
    """Colours of ``t`` in ``[0, 1]`` (any shape) -> ``(..., 3)`` uint8."""
    x = np.clip(np.asarray(t, np.float64), 0.0, 1.0) * (len(_RAMP) - 1)
    k = np.minimum(x.astype(int), len(_RAMP) - 2)
    f = (x - k)[..., None]
    return np.round(_RAMP[k] * (1 - f) + _RAMP[k + 1] * f).astype(np.uint8)


def downsample(m: np.ndarray, max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, np.ndarray]:
    """Block means of a causal ``(L, L)`` map to at most ``max_pixels`` a side, and the
    mask of blocks holding any entry ``j <= i``. Returns ``(map, mask)``."""
    L = m.shape[0]
    f = -(-L // max_pixels)
    n = -(-L // f)
    pad = n * f - L
    causal = np.tril(np.ones((L, L), bool))
    mp = np.pad(np.where(causal, m, 0.0), ((0, pad), (0, pad)))
    cp = np.pad(causal, ((0, pad), (0, pad)))
    cnt = cp.reshape(n, f, n, f).sum(axis=(1, 3))
    tot = mp.reshape(n, f, n, f).sum(axis=(1, 3))
    return np.where(cnt > 0, tot / np.maximum(cnt, 1), 0.0), cnt > 0


def log_range(values: np.ndarray) -> tuple[float, float]:
    """``(lo, hi)`` of the log colour scale of non-negative ``values`` (see module doc);
    ``hi == 0`` when every value is 0."""
    pos = values[values > 0]
    if pos.size == 0:
        return 0.0, 0.0
    hi = float(pos.max())
    lo = max(float(np.quantile(pos, LOG_QUANTILE)), hi * 10.0 ** -LOG_DECADES)
    return min(lo, hi / 10.0), hi


def heatmap_png(m: np.ndarray, max_pixels: int = MAX_PIXELS) -> tuple[bytes, float, float]:
    """PNG of a non-negative causal ``(L, L)`` map on a log scale: values at or below ``lo``
    get the darkest colour (kept visible, not dropped). Returns ``(png, lo, hi)``."""
    small, mask = downsample(np.asarray(m, np.float64), max_pixels)
    lo, hi = log_range(small[mask])
    if hi > 0:
        t = (np.log10(np.maximum(small, lo)) - np.log10(lo)) / (np.log10(hi) - np.log10(lo))
    else:
        t = np.zeros_like(small)
    rgb = np.where(mask[..., None], ramp(t), _BLANK)
    return png_bytes(rgb), lo, hi


def _img(png: bytes, alt: str, width: int, height: int) -> str:
    return (f'<img alt="{_esc(alt)}" width="{width}" height="{height}" style="image-rendering:pixelated;'
            f'border:1px solid #ccc" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">')


def operator_html(op, max_elements: int = MAX_ELEMENTS) -> str:
    """HTML summary of an operator: type, core, shape ``(B, C, L, L)``, dtypes, heads, and
    a log-scale heatmap of example 0's mean ``|H|`` over channels (heads) when
    ``B * C * L * L <= max_elements`` (else a note saying why not).

    Args:
      op: ``ImplicitOperator``, ``Mamba2Operator`` or ``AttentionOperator``.
    Returns:
      HTML string (no scripts, no external resources).
    """
    B, C, L, _ = op.shape
    attention = type(op).__name__ == "AttentionOperator"
    unit = "heads" if attention else "channels"
    rows = [("type", type(op).__name__), ("core", type(op.core).__name__),
            ("shape (B, C, L, L)", f"({B}, {C}, {L}, {L}): batch, {unit}, query i, key j"),
            ("values dtype", str(op.values.dtype)), ("H dtype", "float32 (materialize / reduce)")]
    heads = getattr(op.core, "num_heads", None)
    if heads is not None and not attention:
        rows.append(("heads", f"{heads} ({C // max(int(heads), 1)} channels each)"))
    rows.append(("dense size", f"{B * C * L * L:,} entries (never allocated unless materialized)"))
    table = "".join(f'<tr><th style="text-align:left;padding:1px 8px">{_esc(k)}</th>'
                    f'<td style="padding:1px 8px">{_esc(v)}</td></tr>' for k, v in rows)
    parts = [f'<div style="font-family:system-ui,sans-serif;font-size:13px"><table>{table}</table>']
    if isinstance(op.values, jax.core.Tracer):
        parts.append("<p>(traced operator: no heatmap)</p>")
    elif B * C * L * L > max_elements:
        parts.append(f"<p>No heatmap: B*C*L*L = {B * C * L * L:,} &gt; {max_elements:,} entries would be "
                     f"reduced for it; use <code>op.reduce(\"abs_mean\", channels=...)</code>.</p>")
    else:
        try:
            m = np.asarray(op.reduce("abs_mean"))[0]
        except Exception as e:  # a repr must not raise; show why the map is missing instead
            parts.append(f"<p>No heatmap: {_esc(type(e).__name__)}: {_esc(e)}</p>")
        else:
            png, lo, hi = heatmap_png(m)
            side = max(DISPLAY_PX // 2, min(DISPLAY_PX, 8 * L))
            bar = png_bytes(np.repeat(ramp(np.linspace(0, 1, 128))[None], 8, axis=0))
            scale = (f"log scale, {lo:.2g} (and below) to {hi:.2g}" if hi > 0 else "all zero")
            parts.append(f"<p>example 0: mean |H| over {C} {unit}, query i down, key j across "
                         f"(upper triangle grey: causal)</p>{_img(png, 'mean |H|', side, side)}"
                         f"<br>{_img(bar, 'colour scale', side, 8)}<br><span>{_esc(scale)}</span>")
    parts.append("</div>")
    return "".join(parts)


__all__ = ["operator_html", "heatmap_png", "png_bytes", "ramp", "downsample", "log_range",
           "MAX_ELEMENTS", "MAX_PIXELS"]
