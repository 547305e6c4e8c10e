"""A self-contained HTML report: tokens coloured by relevance (one row per method), a
colour-scale legend, a metrics table (readable metric names, which way is better, the best
method per metric in bold) and the PNG figures embedded as base64 data URIs. No scripts,
no external resources, so it opens offline. Every token and every text field is
HTML-escaped. ``explanation_html`` is the notebook view of an ``Explanation``
(``Explanation._repr_html_``).

Colour of token ``j`` in a row ``r``: ``x = r[j] / max_k |r[k]|`` in ``[-1, 1]``;
red with opacity ``x`` for ``x > 0``, blue with opacity ``-x`` for ``x < 0``.
"""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import numpy as np

from .viz import METRIC_INFO, heatmap, metric_label

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
figure{margin:12px 0} figcaption{font-size:13px;color:#333;font-weight:600}
.meta{font-size:12px;color:#555} .best{font-weight:700}
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
    return _img_bytes(Path(path).read_bytes(), Path(path).name)


def _img_bytes(data: bytes, alt: str, width: int | None = None) -> str:
    w = "" if width is None else f' width="{int(width)}"'
    return f'<img alt="{esc(alt)}"{w} src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">'


def _metrics_table(metrics: dict) -> str:
    """One row per metric (readable name, which way is better), one column per method;
    the best method of each metric with a direction is bold."""
    keys = list(dict.fromkeys(k for m in metrics.values() for k in m))
    order = [k for k in METRIC_INFO if k in keys] + [k for k in keys if k not in METRIC_INFO]
    methods = list(metrics)
    rows = ["<table><tr><th>metric</th><th>better</th>"
            + "".join(f"<th>{esc(n)}</th>" for n in methods) + "</tr>"]
    for k in order:
        name, better = metric_label(k)
        vals = {n: float(metrics[n][k]) for n in methods if k in metrics[n]}
        best = None
        if better is not None and len(vals) > 1:
            best = (max if better == "higher" else min)(vals, key=vals.get)
        bold = ' class="best"'
        cells = "".join("<td></td>" if n not in vals else
                        f"<td{bold if n == best else ''}>{vals[n]:.4g}</td>" for n in methods)
        direction = "" if better is None else f"{better} is better"
        rows.append(f'<tr><td title="{esc(k)}">{esc(name)}</td><td>{esc(direction)}</td>{cells}</tr>')
    rows.append("</table>")
    return "".join(rows)


def render_html(tokens, relevances: dict, title: str = "implicit_attn explanation", query=None,
                images=None, metrics=None, meta=None) -> str:
    """The report as a string.

    Args:
      tokens: L token strings.
      relevances: ``{method name: (L,) relevance}``.
      query: position outlined as the query (optional).
      images: ``{caption: png path}`` embedded inline, each captioned, under "Figures".
      metrics: ``{method name: {metric key: float}}`` (keys of ``metrics.faithfulness``
        get readable names and a "higher/lower is better" column; others are shown as given).
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
        parts.append("<h2>Faithfulness</h2>" + _metrics_table(metrics))
    if images:
        parts.append("<h2>Figures</h2>")
        for cap, p in images.items():
            parts.append(f"<figure><figcaption>{esc(cap)}</figcaption>{_img(p)}</figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


# The notebook fragment sits inside a page that is not ours: every rule is scoped.
_FRAGMENT_CSS = """
.ia-ex{font-family:system-ui,sans-serif;font-size:13px}
.ia-ex table{border-collapse:collapse;margin:4px 0} .ia-ex td,.ia-ex th{border:1px solid #ccc;padding:2px 6px;text-align:left}
.ia-ex .row{margin:6px 0;line-height:2.1} .ia-ex .name{font-weight:600;margin-right:8px}
.ia-ex .tok{padding:2px 3px;margin:1px;border-radius:3px;white-space:pre;font-family:monospace}
.ia-ex .q{outline:2px solid #111} .ia-ex .meta{font-size:12px;color:#555}
"""


def explanation_html(ex, tokens=None, batch: int = 0, image: bool = True) -> str:
    """An HTML fragment showing an ``Explanation`` (its ``_repr_html_``): method, variant,
    layers, query and target; the relevance of example ``batch`` as coloured tokens; and
    (``image``) a log-scale heatmap of the combined matrix (raw mean / rollout) or, for
    contributions, of the layer-mean ``R_l``.

    Args:
      ex: an ``Explanation`` (``relevance (B, L)``, ``layer_maps (N, B, L, L)``, ...).
      tokens: L token strings (default: the positions ``0 .. L-1``).
      batch: which example of the batch to show.
    Returns:
      HTML string (no scripts, no external resources).
    """
    rel = np.asarray(ex.relevance)
    B, L = rel.shape
    if not 0 <= batch < B:
        raise ValueError(f"batch index {batch} out of range for batch size {B}")
    tokens = [str(j) for j in range(L)] if tokens is None else [str(t) for t in tokens]
    target = np.asarray(ex.target).reshape(-1)
    info = {"method": ex.method, "variant": ex.variant, "layers": list(ex.layers),
            "query position": ex.query, "target token id": int(target[batch]) if target.size else None,
            "batch": f"{batch} of {B}"}
    parts = [f'<div class="ia-ex"><style>{_FRAGMENT_CSS}</style><b>Explanation</b>',
             "<table>" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in info.items())
             + "</table>", _row(ex.method, tokens, rel[batch], ex.query)]
    if image:
        if ex.matrix is not None:
            m, what = np.asarray(ex.matrix)[batch], f"{ex.method} matrix"
        else:
            m, what = np.asarray(ex.layer_maps)[:, batch].mean(axis=0), f"mean over layers of the {ex.method} maps"
        buf = io.BytesIO()
        heatmap(m, buf, f"{what} (example {batch}, log colour scale)", tokens)
        parts.append(_img_bytes(buf.getvalue(), what, width=420))
    parts.append("</div>")
    return "\n".join(parts)


def write_html(path, tokens, relevances: dict, **kw) -> Path:
    """Write ``render_html(...)`` to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.write_text(render_html(tokens, relevances, **kw), encoding="utf-8")
    return path


__all__ = ["render_html", "write_html", "explanation_html", "esc", "token_colour"]
