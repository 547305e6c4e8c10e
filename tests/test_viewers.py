"""Viewers and presentation: circuitsvis arrays, notebook views (``_repr_html_``) of
operators and explanations, figure layout and colour scales, the HTML report's metric
table and target text, CLI help, and ``--variant`` on attention layers."""
from __future__ import annotations

import argparse
import base64
import io
import json
import re

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn import cli
from implicit_attn.explain import (circuitsvis_kwargs, curves_plot, explain, heatmap_grid, metrics,
                                   operator_grid, relevance_strip, render_html, to_circuitsvis)
from implicit_attn.explain.report import explanation_html
from implicit_attn.explain.viz import METRIC_INFO, color_norm, heatmap
from implicit_attn.families import griffin, mamba, mamba2
from implicit_attn.operator import html as ophtml

PNG = b"\x89PNG\r\n\x1a\n"
B, L = 2, 7


def _build(mod, cfg):
    return mod.LM(cfg, mod.init_params(cfg, jax.random.PRNGKey(1)))


# conftest.xdist_group: `models` builds three models once; the tests named after a family stay with the file
ONE_WORKER = True


@pytest.fixture(scope="module")
def models():
    """Tiny Mamba, Mamba-2 and Griffin (a recurrent and an attention layer) and one input."""
    out = {
        "mamba": _build(mamba, mamba.Config(vocab_size=32, hidden_size=8, state_size=4, num_hidden_layers=2)),
        "mamba2": _build(mamba2, mamba2.Config(vocab_size=32, hidden_size=8, num_heads=4, head_dim=4,
                                               state_size=4, n_groups=2, num_hidden_layers=2, chunk_size=4)),
        "griffin": _build(griffin, griffin.Config(vocab_size=32, hidden_size=8, intermediate_size=8,
                                                  num_hidden_layers=2, num_attention_heads=2,
                                                  num_key_value_heads=1, lru_width=8, attention_window_size=4,
                                                  block_types=("recurrent", "attention"))),
    }
    ids = np.random.default_rng(0).integers(1, 32, (B, L))
    return out, ids


@pytest.fixture(scope="module")
def ops(models):
    ms, ids = models
    return {name: m.operators(ids) for name, m in ms.items()}


@pytest.fixture
def figures(monkeypatch):
    """Every matplotlib figure saved during the test; ``fig.outside`` lists its texts whose
    extent, as saved (layout done, before the figure is closed), leaves the figure."""
    from matplotlib.figure import Figure

    seen, orig = [], Figure.savefig

    def save(self, *a, **k):
        res = orig(self, *a, **k)
        self.outside = texts_outside(self)
        seen.append(self)
        return res

    monkeypatch.setattr(Figure, "savefig", save)
    return seen


def texts_outside(fig) -> list[str]:
    """Titles, axis / colour-bar labels and the suptitle of ``fig`` whose rendered extent
    leaves the figure, plus "ticks or other artists" when the figure's tight bounding box
    (everything drawn, tick labels included) does (empty list = everything fits)."""
    r = fig.canvas.get_renderer()
    W, H = fig.bbox.width, fig.bbox.height
    texts = [fig._suptitle] + [t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]
    out = []
    for t in texts:
        if t is None or not t.get_visible() or not t.get_text().strip():
            continue
        bb = t.get_window_extent(r)
        if bb.x0 < -1 or bb.y0 < -1 or bb.x1 > W + 1 or bb.y1 > H + 1:
            out.append(t.get_text())
    tb = fig.get_tightbbox(r)  # inches
    eps = 0.02
    if tb.x0 < -eps or tb.y0 < -eps or tb.x1 > fig.get_figwidth() + eps or tb.y1 > fig.get_figheight() + eps:
        out.append(f"ticks or other artists: {tb}")
    return out


def skewed_map(n=255, seed=0):
    """Like a trained layer's channel-mean |H|: a few large entries, median ~1e-3."""
    rng = np.random.default_rng(seed)
    m = np.tril(np.exp(rng.normal(-7.0, 2.0, (n, n))))
    m[-1, n // 3] = 9.1
    return m


# ----------------------------------------------------------------------------- colour scales, figures

def test_color_norm_kinds_and_nothing_dropped():
    from matplotlib import colors

    m = np.tril(skewed_map(40))
    m[5, 0] = 0.0
    norm, shown, extend = color_norm(np.where(np.tril(np.ones((40, 40), bool)), m, np.nan), "log")
    assert isinstance(norm, colors.LogNorm) and extend == "min"
    assert norm.vmax == pytest.approx(9.1) and 9.1e-6 <= norm.vmin < np.median(m[np.tril_indices(40)])
    # zeros and tiny values are raised to vmin (drawn in the lowest colour), never masked
    assert shown[5, 0] == norm.vmin and np.isfinite(shown[np.tril_indices(40)]).all()
    assert np.isnan(shown[0, 1])  # the blank upper triangle stays blank
    signed = m * np.where(np.arange(40) % 2, 1.0, -1.0)
    norm, shown, _ = color_norm(signed, "log")
    assert isinstance(norm, colors.SymLogNorm) and norm.vmin == -norm.vmax == pytest.approx(-9.1)
    np.testing.assert_array_equal(shown, signed)
    norm, _, _ = color_norm(m, "linear")
    assert type(norm) is colors.Normalize and (norm.vmin, norm.vmax) == (0.0, pytest.approx(9.1))
    norm, _, _ = color_norm(np.zeros((3, 3)), "log")  # all zero: no log possible
    assert type(norm) is colors.Normalize
    with pytest.raises(ValueError, match="scale"):
        color_norm(m, "sqrt")


def test_log_scale_uses_the_colour_range_at_L255(tmp_path, figures):
    """The issue: at L = 255 a linear scale paints almost every cell in the lowest colour."""
    m = skewed_map()
    heatmap(m, tmp_path / "log.png", "layer 1")
    heatmap(m, tmp_path / "lin.png", "layer 1", scale="linear")
    tri = np.tril_indices(255)
    (log_im,), (lin_im,) = figures[0].axes[0].images, figures[1].axes[0].images
    from matplotlib import colors

    assert isinstance(log_im.norm, colors.LogNorm) and type(lin_im.norm) is colors.Normalize
    t_log = np.asarray(log_im.norm(log_im.get_array()))[tri]
    t_lin = np.asarray(lin_im.norm(lin_im.get_array()))[tri]
    assert np.median(t_lin) < 0.01 and 0.2 < np.median(t_log) < 0.9
    assert (tmp_path / "log.png").read_bytes()[:8] == PNG


def test_log_colour_bars_mark_decades_and_keep_minor_ticks_only_for_narrow_ranges(tmp_path, figures):
    """Over two or more decades the colour bar labels each power of ten and draws no minor
    ticks (they cost a third of a figure's drawing); a narrower range keeps them."""
    heatmap(skewed_map(40), tmp_path / "wide.png", "wide")
    narrow = np.tril(np.linspace(1.0, 5.0, 36).reshape(6, 6))
    heatmap(narrow, tmp_path / "narrow.png", "narrow")
    (wide_fig, narrow_fig) = figures
    wide_bar, narrow_bar = wide_fig.axes[1], narrow_fig.axes[1]
    assert wide_bar.yaxis.get_minorticklocs().size == 0
    majors = [t for t in wide_bar.get_yticks() if wide_bar.get_ylim()[0] <= t <= wide_bar.get_ylim()[1]]
    assert len(majors) >= 2 and np.allclose(np.log10(majors), np.round(np.log10(majors)))
    assert narrow_bar.yaxis.get_minorticklocs().size > 0


def test_demo_heatmap_title_fits_and_is_log_scaled(tmp_path, figures):
    """The CLI's heatmap (demo, operator): the issue's clipped title, at L = 255."""
    from matplotlib import colors

    title = ("induction Mamba, layer 1: mean |H| over channels "
             "(earlier occurrence 120, answer position 121)")
    cli.save_heatmap(skewed_map(), tmp_path / "demo.png", title)
    (fig,) = figures
    assert fig.outside == []
    assert isinstance(fig.axes[0].images[0].norm, colors.LogNorm)
    assert fig.axes[0].get_xlabel() == "key position j" and fig.axes[0].get_ylabel() == "query position i"


def test_heatmaps_titles_and_labels_fit(tmp_path, figures):
    long = ("induction Mamba, layer 1: mean |H| over channels (earlier occurrence 12, answer position 13) "
            "on a long random sequence")
    heatmap(skewed_map(60), tmp_path / "one.png", long, tokens=None)
    heatmap_grid(np.stack([skewed_map(9, s) for s in range(5)]), tmp_path / "grid.png",
                 [f"layer {k}: a rather long panel title" for k in range(5)], list("abcdefghi"),
                 suptitle=long + " -- suptitle")
    relevance_strip(np.random.default_rng(0).normal(size=(2, 24)), tmp_path / "strip.png",
                    [f"tok{j}" for j in range(24)], ["rollout", "raw"], title=long)
    assert len(figures) == 3
    for fig in figures:
        assert fig.outside == []
    one, grid, strip = figures
    ax = one.axes[0]
    assert "\n" in ax.get_title()  # wrapped, not clipped
    panels = [a for a in grid.axes if a.images]
    assert len(panels) == 5
    for a in panels:
        assert a.get_xlabel() == "key position j" and a.get_ylabel() == "query position i"
    cbar_labels = [a.get_ylabel() for a in strip.axes if not a.images]
    assert any("max |relevance|" in s for s in cbar_labels)


def test_signed_grid_is_diverging_and_operator_grid_labelled(tmp_path, figures, ops):
    from matplotlib import colors

    m = skewed_map(9)
    heatmap_grid(np.stack([m, -m]), tmp_path / "g.png", ["pos", "neg"])
    a, b = [ax for ax in figures[0].axes if ax.images]
    assert isinstance(a.images[0].norm, colors.LogNorm) and a.images[0].cmap.name == "viridis"
    assert isinstance(b.images[0].norm, colors.SymLogNorm) and b.images[0].cmap.name == "RdBu_r"
    operator_grid(ops["mamba"][0], tmp_path / "o.png", channels=[0, 2])
    panels = [ax for ax in figures[1].axes if ax.images]
    assert [p.get_title() for p in panels] == ["channel 0", "channel 2"]
    assert all(p.get_xlabel() and p.get_ylabel() for p in panels)
    assert all(f.outside == [] for f in figures)


def test_curves_plot_labels_and_directions(tmp_path, figures):
    f = np.array([0.0, 0.5, 1.0])
    curves = {k: metrics.Curve(name=k, fractions=f, values=np.array([[0.1, 0.3, 0.2]]), area=np.array([0.2]))
              for k in METRIC_INFO}
    curves_plot(curves, tmp_path / "c.png")
    axes = figures[0].axes
    assert len(axes) == len(METRIC_INFO)
    for ax, (key, (_, better, _, _)) in zip(axes, METRIC_INFO.items()):
        assert ax.get_ylabel().strip() and ax.get_xlabel().strip()
        assert f"({better} is better)" in ax.get_title()
    assert "probability" in axes[0].get_ylabel()
    assert figures[0].outside == []


def test_figures_leave_pyplot_alone(tmp_path):
    """Drawing switches no pyplot backend and opens no pyplot figure (a notebook's inline
    backend stays)."""
    import matplotlib
    import matplotlib.pyplot as plt

    old = matplotlib.get_backend()
    plt.switch_backend("svg")
    try:
        before = plt.get_fignums()
        heatmap_grid(np.ones((2, 4, 4)), tmp_path / "g.png", tokens=list("abcd"))
        relevance_strip(np.arange(4.0), tmp_path / "s.png", list("abcd"))
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == before
    finally:
        plt.switch_backend(old)
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG == (tmp_path / "s.png").read_bytes()[:8]


def test_metric_directions_match_the_metric_definitions():
    """The directions shown to users are those each metric function documents."""
    fns = {"auac": metrics.activation, "au_mse": metrics.pruning, "positive_auc": metrics.positive_perturbation,
           "negative_auc": metrics.negative_perturbation, "comprehensiveness": metrics.comprehensiveness,
           "sufficiency": metrics.sufficiency}
    assert set(fns) == set(METRIC_INFO)
    for key, fn in fns.items():
        better = METRIC_INFO[key][1]
        other = {"higher": "lower", "lower": "higher"}[better]
        doc = " ".join(fn.__doc__.split())
        assert f"{better} better" in doc and f"{other} better" not in doc, key


# ----------------------------------------------------------------------------- report

def test_report_metric_table_readable_with_direction_and_no_duplicate_heading(tmp_path):
    p = relevance_strip(np.array([0.5, -1.0, 0.2]), tmp_path / "s.png")
    res = {"rollout": {"auac": 0.6, "au_mse": 2.0, "sufficiency": 0.1, "custom": 1.0},
           "raw": {"auac": 0.4, "au_mse": 1.0, "sufficiency": 0.3}}
    html = render_html(["a", "b", "c"], {"rollout": np.array([0.5, -1.0, 0.2])}, metrics=res,
                       images={"token relevance": p, "rollout: faithfulness curves": p})
    rows = re.findall(r"<tr>(.*?)</tr>", html)
    text = {re.sub(r"<[^>]+>", "|", r) for r in rows}
    assert any("activation AUAC" in t and "higher is better" in t for t in text)
    assert any("pruning AU-MSE" in t and "lower is better" in t for t in text)
    assert any("sufficiency (ERASER)" in t and "lower is better" in t for t in text)
    assert any("custom" in t for t in text)  # unknown metrics are shown as given
    # the best method per metric is bold: higher AUAC (rollout), lower AU-MSE (raw)
    assert '<td class="best">0.6</td>' in html and '<td class="best">1</td>' in html
    assert '<td class="best">0.1</td>' in html
    # raw keys appear only as hover titles, never as visible cell text
    assert ">auac<" not in html and ">au_mse<" not in html
    heads = [h.lower() for h in re.findall(r"<h[12][^>]*>(.*?)</h[12]>", html)]
    assert len(heads) == len(set(heads)), heads
    assert html.count("<figcaption>") == 2 and "token relevance" in html


# ----------------------------------------------------------------------------- notebook views

def _png_of(html_text: str) -> list[bytes]:
    return [base64.b64decode(s) for s in re.findall(r'src="data:image/png;base64,([^"]+)"', html_text)]


def test_png_encoder_roundtrips():
    import matplotlib.image as mpimg

    rgb = np.random.default_rng(0).integers(0, 256, (5, 9, 3)).astype(np.uint8)
    back = mpimg.imread(io.BytesIO(ophtml.png_bytes(rgb)), format="png")
    np.testing.assert_array_equal(np.round(back[..., :3] * 255).astype(np.uint8), rgb)


def test_operator_heatmap_png_is_log_scaled_and_downsampled():
    import matplotlib.image as mpimg

    png, lo, hi = ophtml.heatmap_png(skewed_map(600))
    img = mpimg.imread(io.BytesIO(png), format="png")
    assert img.shape[:2] == (200, 200)  # 600 -> block means of 3 x 3
    assert hi > 0 and hi / lo <= 10 ** ophtml.LOG_DECADES * 1.0001
    blank = np.round(img[0, -1, :3] * 255)
    np.testing.assert_array_equal(blank, [236, 236, 236])  # upper triangle
    low = np.round(img[150, 10, :3] * 255)
    assert not np.array_equal(low, blank)


@pytest.mark.parametrize("name,layer", [("mamba", 0), ("mamba2", 1), ("griffin", 0), ("griffin", 1)])
def test_operator_repr_html(ops, name, layer):
    op = ops[name][layer]
    h = op._repr_html_()
    assert type(op).__name__ in h and type(op.core).__name__ in h
    Bo, C, Lo, _ = op.shape
    assert f"({Bo}, {C}, {Lo}, {Lo})" in h and str(op.values.dtype) in h
    pngs = _png_of(h)
    assert len(pngs) == 2 and all(p[:8] == PNG for p in pngs)  # the map and its colour bar
    assert "log scale" in h
    if name == "griffin" and layer == 1:
        assert "AttentionOperator" in h and "heads" in h
    if name == "mamba2":
        assert "heads" in h and "Mamba2Operator" in h
    small = ophtml.operator_html(op, max_elements=10)
    assert "No heatmap" in small and "data:image/png" not in small


def test_explanation_repr_html(models):
    ms, ids = models
    for method in ("rollout", "contributions"):
        ex = explain(ms["mamba"], ids, method)
        h = ex._repr_html_()
        assert "<table>" in h and method in h and "target token id" in h and f"{int(ex.target[0])}" in h
        assert len(_png_of(h)) == 1 and _png_of(h)[0][:8] == PNG
        assert h.count('class="tok') == L
    ex = explain(ms["griffin"], ids, "raw")
    toks = [f"<t{j}>" for j in range(L)]
    h = explanation_html(ex, tokens=toks, batch=1, image=False)
    assert "&lt;t3&gt;" in h and "<t3>" not in h and "1 of 2" in h and "data:image" not in h
    with pytest.raises(ValueError, match="batch index"):
        explanation_html(ex, batch=2)


# ----------------------------------------------------------------------------- circuitsvis

@pytest.mark.parametrize("name", ["mamba", "mamba2", "griffin"])
def test_to_circuitsvis_contract(ops, name):
    for op in ops[name]:
        dense = np.asarray(op.materialize())
        a = to_circuitsvis(op, batch=1)
        assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous
        assert a.shape == (op.shape[1], L, L)  # [heads, dest = query i, src = key j]
        np.testing.assert_allclose(a, dense[1], rtol=1e-5, atol=1e-7)
        assert np.all(np.triu(a, 1) == 0)
        if "Attention" not in type(op).__name__:
            assert a.min() < 0  # signed values are kept
        n = to_circuitsvis(op, normalize="minmax")
        assert n.min() >= 0 and np.allclose(n.max(axis=(1, 2)), 1)
    # a non-causal array is masked to zero above the diagonal; NaN below it is refused
    x = np.random.default_rng(0).normal(size=(3, L, L)).astype(np.float32)
    np.testing.assert_array_equal(to_circuitsvis(x), np.tril(x))
    x[0, 3, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        to_circuitsvis(x)


def test_circuitsvis_kwargs_heads_viewer(ops):
    op = ops["mamba2"][0]
    kw = circuitsvis_kwargs(op, list(range(L)), heads=[1, 3], viewer="attention_heads")
    assert kw["tokens"] == [str(j) for j in range(L)]
    assert kw["attention"].shape == (2, L, L) and kw["attention_head_names"] == ["head 1", "head 3"]
    assert kw["mask_upper_tri"] is True and kw["min_value"] == -kw["max_value"] < 0
    kw = circuitsvis_kwargs(ops["griffin"][1], list("abcdefg"), viewer="attention_heads")
    assert kw["attention_head_names"] == ["head 0", "head 1"] and kw["min_value"] == 0.0
    kw = circuitsvis_kwargs(ops["mamba"][0], list("abcdefg"), channels=[5, 2])
    assert set(kw) == {"tokens", "attention"}
    assert circuitsvis_kwargs(ops["mamba"][0], list("abcdefg"), channels=[5, 2],
                              viewer="attention_heads")["attention_head_names"] == ["channel 5", "channel 2"]
    with pytest.raises(ValueError, match="viewer"):
        circuitsvis_kwargs(op, list(range(L)), viewer="bertviz")
    with pytest.raises(ValueError, match="tokens"):
        circuitsvis_kwargs(op, list(range(L - 1)))


def _cv_props(rendered) -> dict:
    """The props JSON circuitsvis embeds in its (CDN) HTML."""
    src = rendered.cdn_src
    start = src.index("{", src.index("render(") + len("render("))
    end = src.rindex("}", 0, src.rindex(")")) + 1
    return json.loads(src[start:end])


def test_circuitsvis_renders_the_arrays(ops):
    """With circuitsvis installed, both viewers accept the arrays and embed them unchanged."""
    cv = pytest.importorskip("circuitsvis.attention")
    tokens = [f"t{j}" for j in range(L)]
    kw = circuitsvis_kwargs(ops["mamba"][1], tokens, channels=[0, 3])
    props = _cv_props(cv.attention_patterns(**kw))
    assert props["tokens"] == tokens
    np.testing.assert_allclose(np.asarray(props["attention"]), kw["attention"], rtol=1e-6)
    kw = circuitsvis_kwargs(ops["mamba2"][0], tokens, heads="all", viewer="attention_heads")
    props = _cv_props(cv.attention_heads(**kw))
    assert props["attentionHeadNames"] == ["head 0", "head 1", "head 2", "head 3"]
    assert np.asarray(props["attention"]).shape == (4, L, L) and props["minValue"] < 0


# ----------------------------------------------------------------------------- CLI

def _all_parsers():
    p = cli.build_parser()
    subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return p, subs.choices


def test_cli_help_plain_text_every_option_helped_defaults_shown():
    p, subs = _all_parsers()
    for name, sp in {"": p, **subs}.items():
        text = sp.format_help()
        assert "``" not in text, name
        for a in sp._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help and a.help.strip(), f"{name}: {a.dest} has no help"
            if a.option_strings and a.default not in (None, False):
                assert "default" in sp._get_formatter()._get_help_string(a), f"{name}: {a.dest}"
    assert "(default: rollout)" in " ".join(subs["explain"].format_help().split())
    assert "{log,linear}" in subs["operator"].format_help() and "{log,linear}" in subs["demo"].format_help()
    assert "{raw,rollout,attribution,contributions,all}" in subs["explain"].format_help()
    helped = " ".join(subs["operator"].format_help().split())
    assert "Griffin (recurrent_gemma): full, no_conv, no_gate" in helped


@pytest.fixture(scope="module")
def griffin_ckpt(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("viewers_cli")
    ia.save(models[0]["griffin"], root / "g")
    return root


def test_operator_variant_on_attention_layer_is_an_error(griffin_ckpt, capsys):
    root = griffin_ckpt
    out = root / "o"
    args = ["operator", str(root / "g"), "--ids", "1,2,3,4,5", "--out", str(out)]
    assert cli.main(args + ["--layer", "1", "--variant", "no_conv"]) == 2
    err = capsys.readouterr().err
    assert "attention layer" in err and "'full'" in err and "no_conv" in err and "[0]" in err
    assert not out.exists() or not list(out.glob("*no_conv*"))
    assert cli.main(args + ["--layer", "1"]) == 0  # "full" is fine on attention layers
    assert cli.main(args + ["--layer", "0", "--variant", "no_conv", "--scale", "linear"]) == 0
    assert (out / "layer0_no_conv_abs_mean.png").exists() and (out / "layer1_full_abs_mean.png").exists()


def test_explain_variant_with_attention_layers(griffin_ckpt, capsys):
    root = griffin_ckpt
    out = root / "e"
    base = ["explain", str(root / "g"), "--ids", "1,2,3,4,5", "--method", "raw", "--out", str(out)]
    assert cli.main(base + ["--variant", "no_conv", "--layers", "1"]) == 2
    assert "attention layer" in capsys.readouterr().err
    assert cli.main(base + ["--variant", "no_conv"]) == 0
    err = capsys.readouterr().err
    assert "note: layers [1] are attention layers" in err and "'full'" in err
    html = (out / "report.html").read_text()
    assert "attention layers" in html and "variant &#x27;full&#x27;" in html
