"""A self-contained HTML report: tokens coloured by relevance (one row per method), a
colour-scale legend, a metrics table and the PNG figures embedded as base64 data URIs.
No scripts, no external resources, so it opens offline. Every token and every text
field is HTML-escaped.

Colour of token ``j`` in a row ``r``: ``x = r[j] / max_k |r[k]|`` in ``[-1, 1]``;
red with opacity ``x`` for ``x > 0``, blue with opacity ``-x`` for ``x < 0``.
"""
from __future__ import annotations

import base64
import html
from pathlib import Path

import numpy as np

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px}
.row{margin:8px 0;line-height:2.1} .name{font-weight:600;margin-right:8px}
.tok{padding:2px 3px;margin:1px;border-radius:3px;white-space:pre;font-family:monospace}
.q{outline:2px solid #111}
.legend{display:flex;align-items:center;gap:8px;font-size:12px}
.bar{width:240px;height:14px;border:1px solid #999;
 background:linear-gradient(to right,rgba(37,99,235,1),rgba(255,255,255,1),rgba(220,38,38,1))}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:6px 0}
.meta{font-size:12px;color:#555}
"""


def esc(x) -> str:
    """HTML-escape any value (quotes included)."""
    return html.escape(str(x), quote=True)


def token_colour(x: float) -> str:
    """CSS background for a normalised relevance ``x`` in ``[-1, 1]``."""
    x = float(np.clip(x, -1.0, 1.0))
    if x >= 0:
        return f"rgba(220,38,38,{x:.3f})"
    return f"rgba(37,99,235,{-x:.3f})"


def _row(name: str, tokens, r, query):
    r = np.asarray(r, np.float64)
    if r.shape != (len(tokens),):
        raise ValueError(f"relevance {name!r} has shape {r.shape}, expected ({len(tokens)},)")
    s = np.max(np.abs(r))
    rn = r / s if s > 0 else np.zeros_like(r)
    spans = []
    for j, (tok, v, x) in enumerate(zip(tokens, r, rn)):
        cls = "tok q" if j == query else "tok"
        spans.append(f'<span class="{cls}" style="background:{token_colour(x)}" '
                     f'title="{esc(f"position {j}: {v:.4g}")}">{esc(tok)}</span>')
    return (f'<div class="row"><span class="name">{esc(name)}</span>'
            f'<span class="meta">(max |r| = {s:.4g})</span><br>{"".join(spans)}</div>')


def _img(path) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{esc(Path(path).name)}" src="data:image/png;base64,{data}">'


def render_html(tokens, relevances: dict, title: str = "implicit_attn explanation", query=None,
                images=None, metrics=None, meta=None) -> str:
    """The report as a string.

    Args:
      tokens: L token strings.
      relevances: ``{method name: (L,) relevance}``.
      query: position outlined as the query (optional).
      images: ``{caption: png path}`` embedded inline.
      metrics: ``{method name: {metric name: float}}`` shown as a table.
      meta: ``{key: value}`` shown as a list (model, variant, target, ...).
    """
    tokens = [str(t) for t in tokens]
    parts = [f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{esc(title)}</h1>"]
    if meta:
        parts.append("<ul class=\"meta\">" + "".join(
            f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in meta.items()) + "</ul>")
    parts.append("<h2>Token relevance</h2>")
    parts.append('<div class="legend"><span>-max|r|</span><div class="bar"></div><span>+max|r|</span>'
                 '<span>(each row scaled by its own max |relevance|; outlined: query; '
                 'hover for values)</span></div>')
    for name, r in relevances.items():
        parts.append(_row(name, tokens, r, query))
    if metrics:
        cols = sorted({k for m in metrics.values() for k in m})
        parts.append("<h2>Faithfulness</h2><table><tr><th>method</th>"
                     + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>")
        for name, m in metrics.items():
            parts.append(f"<tr><td>{esc(name)}</td>" + "".join(
                f"<td>{m[c]:.4g}</td>" if c in m else "<td></td>" for c in cols) + "</tr>")
        parts.append("</table>")
    for cap, p in (images or {}).items():
        parts.append(f"<h2>{esc(cap)}</h2>{_img(p)}")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(path, tokens, relevances: dict, **kw) -> Path:
    """Write ``render_html(...)`` to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.write_text(render_html(tokens, relevances, **kw), encoding="utf-8")
    return path


__all__ = ["render_html", "write_html", "esc", "token_colour"]
