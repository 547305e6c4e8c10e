"""Every explanation method on every family (Mamba, Mamba-2, Griffin with recurrent and
attention layers, RWKV-4), on tiny random models built with each family's ``init_params``.

References are float64 numpy on the materialized operators (checked exact against the
blocks' own outputs first) and forward-mode ``jax.jvp`` through the model's taps for the
first-order claims of the contributions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.explain import (METHODS, activation, channel_maps, contribution_map, explain, faithfulness,
                                   head_channels, head_maps, model_maps, operator_map, output_gradients,
                                   positive_perturbation, to_circuitsvis)
from implicit_attn.families import griffin, mamba, mamba2, rwkv

# Query inside the sequence: positions after it must get nothing. The Mamba model and the
# input shape are those of test_explain.py, so a run of both shares their compilations.
B, L, Q = 2, 7, 5

CONFIGS = {
    "mamba": (mamba, mamba.Config(vocab_size=32, hidden_size=8, state_size=4, num_hidden_layers=2)),
    "mamba2": (mamba2, mamba2.Config(vocab_size=32, hidden_size=8, num_heads=4, head_dim=4, state_size=4,
                                     n_groups=2, num_hidden_layers=2, chunk_size=4)),
    "griffin": (griffin, griffin.Config(vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, lru_width=8,
                                        attention_window_size=4, block_types=("recurrent", "attention"))),
    "rwkv": (rwkv, rwkv.Config(vocab_size=32, hidden_size=8, attention_hidden_size=4, intermediate_size=8,
                               num_hidden_layers=2)),
}
FAMILIES = tuple(CONFIGS)

dense = jax.jit(lambda op: op.materialize())


def build(name):
    mod, cfg = CONFIGS[name]
    return mod.LM(cfg, mod.init_params(cfg, jax.random.PRNGKey(1)))


class Fam:
    """A family's model, inputs and float64 references: per layer the dense operator,
    its values and output, and the gradients of the target at ``Q``."""

    def __init__(self, name):
        self.name = name
        self.mod = CONFIGS[name][0]
        self.model = build(name)
        self.ids = np.random.default_rng(0).integers(1, 32, (B, L))
        self.ops = self.model.operators(self.ids)
        self.H = [np.asarray(dense(op), np.float64) for op in self.ops]
        self.v = [np.asarray(op.values, np.float64) for op in self.ops]
        self.grads, q, self.t = output_gradients(self.model, self.ids, query=Q)
        assert q == Q
        self.g = [np.asarray(self.grads[l], np.float64) for l in range(len(self.ops))]

    @property
    def maps(self):
        """Channel (head) mean of every layer: ``(N, B, L, L)``."""
        return np.stack([H.mean(1) for H in self.H])

    def gbar(self, l):
        g = self.g[l]
        return g.mean(axis=(1, 3)) if g.ndim == 4 else g.mean(1)

    def contributions(self, l):
        """``R[b, i, j] = sum_c g[c, i] H[c, i, j] v[c, j]`` (attention: the head_dim sum too)."""
        H, v, g = self.H[l], self.v[l], self.g[l]
        if v.ndim == 4:
            return np.einsum("bhid,bhij,bhjd->bij", g, H, v)
        return np.einsum("bci,bcij,bcj->bij", g, H, v)


_CACHE: dict[str, Fam] = {}


def get_fam(name) -> Fam:
    """One ``Fam`` per family for the whole module (its compilations are shared)."""
    if name not in _CACHE:
        _CACHE[name] = Fam(name)
    return _CACHE[name]


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request):
    return get_fam(request.param)


def roll(mats):
    """``(I + M_{N-1}) ... (I + M_0)`` per example."""
    rho = np.broadcast_to(np.eye(L), (B, L, L))
    for M in mats:
        rho = np.einsum("bij,bjk->bik", np.eye(L) + M, rho)
    return rho


def test_references_are_exact(fam):
    """The dense operators used as references reproduce each block's own output, and
    attention layers are probabilities (rows sum to 1, window and causality respected)."""
    kinds = []
    for l, op in enumerate(fam.ops):
        H, v = fam.H[l], fam.v[l]
        out = np.asarray(op.output, np.float64)
        sub = "bhij,bhjd->bhid" if v.ndim == 4 else "bcij,bcj->bci"
        got = np.einsum(sub, H, v) + np.asarray(op.offset, np.float64)
        np.testing.assert_allclose(got, out, rtol=1e-4, atol=1e-5 * np.abs(out).max())
        assert np.all(np.triu(np.ones((L, L)), 1) * H == 0)
        assert fam.g[l].shape == out.shape
        kinds.append("attention" if v.ndim == 4 else "recurrent")
        if v.ndim == 4:
            np.testing.assert_allclose(H.sum(-1), 1.0, rtol=1e-5)
            win = CONFIGS["griffin"][1].attention_window_size
            assert np.all(np.tril(np.ones((L, L)), -win) * H == 0)
    assert kinds == (["recurrent", "attention"] if fam.name == "griffin" else ["recurrent"] * 2)


@pytest.mark.parametrize("method", METHODS)
def test_method_matches_reference(fam, method):
    ex = explain(fam.model, fam.ids, method, query=Q, how="mean")
    N = len(fam.ops)
    assert ex.relevance.shape == (B, L) and ex.layer_maps.shape == (N, B, L, L)
    assert ex.layer_relevance.shape == (N, B, L)
    assert np.isfinite(ex.relevance).all() and np.isfinite(ex.layer_maps).all()
    assert np.all(ex.relevance[:, Q + 1:] == 0)
    np.testing.assert_array_equal(ex.target, fam.t)
    assert np.abs(ex.relevance[:, :Q + 1]).max() > 0
    tol = dict(rtol=1e-4, atol=1e-6)
    if method == "raw":
        np.testing.assert_allclose(ex.layer_maps, fam.maps, **tol)
        np.testing.assert_allclose(ex.matrix, fam.maps.mean(0), **tol)
        np.testing.assert_allclose(ex.relevance, fam.maps.mean(0)[:, Q], **tol)
    elif method == "rollout":
        rho = roll(fam.maps)
        np.testing.assert_allclose(ex.matrix, rho, **tol)
        np.testing.assert_allclose(ex.relevance, rho[:, Q], **tol)
    elif method == "attribution":
        att = [np.maximum(fam.gbar(l)[:, :, None] * fam.maps[l], 0) for l in range(N)]
        np.testing.assert_allclose(ex.layer_maps, np.stack(att), **tol)
        np.testing.assert_allclose(ex.relevance, roll(att)[:, Q], **tol)
    else:
        R = np.stack([fam.contributions(l) for l in range(N)])
        scale = np.abs(R).max()
        np.testing.assert_allclose(ex.layer_maps, R, rtol=1e-4, atol=1e-5 * scale)
        np.testing.assert_allclose(ex.relevance, R.sum(2).mean(0), rtol=1e-4, atol=1e-5 * scale)
        assert np.all(R[:, :, Q + 1:] == 0)  # rows after the query do not reach the target


def _target_jvp(fam):
    """``d -> d target_b / d eps`` along tap direction ``d`` of one layer: ``(B,)``."""
    rows, t = jnp.arange(B), jnp.asarray(fam.t)
    taps0 = {l: jnp.zeros(op.output.shape, jnp.float32) for l, op in enumerate(fam.ops)}

    def target(taps):
        return fam.model.tapped_logits(fam.ids, taps)[rows, Q, t]

    def jvp(l, d):
        return np.asarray(jax.jvp(target, (taps0,), ({**taps0, l: jnp.asarray(d, jnp.float32)},))[1])

    return jvp


@pytest.mark.parametrize("name", ["mamba2", "rwkv"])
def test_contributions_total_is_first_order_change(name):
    """Summed over layers, i and j, the contributions ``explain`` returns are the derivative
    of the target when every layer's token-mixing output (minus its offset) is scaled.
    (Mamba: test_explain.py; Griffin: row by row and column by column below.)"""
    fam = get_fam(name)
    rows, t = jnp.arange(B), jnp.asarray(fam.t)
    taps0 = {l: jnp.zeros(op.output.shape, jnp.float32) for l, op in enumerate(fam.ops)}
    dirs = {l: op.output - op.offset for l, op in enumerate(fam.ops)}
    target = lambda taps: fam.model.tapped_logits(fam.ids, taps)[rows, Q, t]
    want = np.asarray(jax.jvp(target, (taps0,), (dirs,))[1])
    ex = explain(fam.model, fam.ids, "contributions", query=Q, how="mean")
    got = ex.layer_maps.astype(np.float64).sum((0, 2, 3))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_griffin_contributions_rows_and_columns_vs_jvp():
    """Griffin, recurrent (taps ``(B, C, L)``) and attention (taps ``(B, H, L, head_dim)``)
    layers: row i of ``R`` is the first-order change when the output at i is scaled; column
    j is the change when token j's value is scaled, through every position that reads it."""
    f = get_fam("griffin")
    jvp = _target_jvp(f)
    ex = explain(f.model, f.ids, "contributions", query=Q, how="mean")
    for l, op in enumerate(f.ops):
        R = ex.layer_maps[l].astype(np.float64)
        y = np.asarray(op.output - op.offset, np.float64)
        H, v = f.H[l], f.v[l]
        att = v.ndim == 4
        assert att == (l == 1)
        scale = np.abs(R).max()
        for i in (0, 2, Q):
            d = np.zeros_like(y)
            d[:, :, i] = y[:, :, i]
            np.testing.assert_allclose(R[:, i].sum(-1), jvp(l, d), rtol=1e-4, atol=1e-5 * scale)
        for j in (0, 1, Q):
            d = H[:, :, :, j, None] * v[:, :, None, j] if att else H[:, :, :, j] * v[:, :, None, j]
            np.testing.assert_allclose(R[:, :, j].sum(-1), jvp(l, d), rtol=1e-4, atol=1e-5 * scale)
        np.testing.assert_allclose(ex.layer_relevance[l], R.sum(1), rtol=1e-5, atol=1e-7)


# One ablation per family (the one specific to it where there is one); the others take
# the same path through ``explain`` (test_explain.py covers Mamba's s6_only and no_conv).
VARIANT = {"mamba2": "no_norm", "griffin": "no_gate", "rwkv": "no_gate"}


@pytest.mark.parametrize("name", list(VARIANT))
def test_variant_reaches_every_method(name):
    """``variant=`` switches the maps to those of ``model.operators(variant=...)`` in every
    method; the gradients (attribution, contributions) stay those of the real model."""
    fam = get_fam(name)
    variant = VARIANT[name]
    assert variant in fam.mod.VARIANTS
    ops = fam.model.operators(fam.ids, variant=variant)
    Hv = [np.asarray(dense(op), np.float64) for op in ops]
    maps = np.stack([H.mean(1) for H in Hv])
    assert np.abs(maps - fam.maps).max() > 1e-4  # the ablation matters
    tol = dict(rtol=1e-4, atol=1e-6)
    for method in METHODS:
        ex = explain(fam.model, fam.ids, method, variant=variant, query=Q, how="mean")
        assert ex.variant == variant and np.isfinite(ex.relevance).all()
        assert np.all(ex.relevance[:, Q + 1:] == 0)
        if method == "raw":
            np.testing.assert_allclose(ex.layer_maps, maps, **tol)
        elif method == "rollout":
            np.testing.assert_allclose(ex.matrix, roll(maps), **tol)
        elif method == "attribution":
            att = [np.maximum(fam.gbar(l)[:, :, None] * maps[l], 0) for l in range(len(ops))]
            np.testing.assert_allclose(ex.matrix, roll(att), **tol)
        else:
            R0 = np.einsum("bci,bcij,bcj->bij", fam.g[0], Hv[0], np.asarray(ops[0].values, np.float64))
            np.testing.assert_allclose(ex.layer_maps[0], R0, rtol=1e-4, atol=1e-5 * np.abs(R0).max())


# ----------------------------------------------------------------------------- head selection

def test_mamba2_head_selection_matches_direct_computation():
    """Mamba-2 head h owns channels h*P .. h*P+P-1: ``heads=`` maps equal the mean over
    those channels of the dense operator and the operator's own per-head matrices."""
    f = get_fam("mamba2")
    cfg = CONFIGS["mamba2"][1]
    P = cfg.head_dim
    op, H = f.ops[1], f.H[1]
    assert head_channels(op, [1, 3]) == tuple(range(P, 2 * P)) + tuple(range(3 * P, 4 * P))
    sel = [1, 3]
    chans = [h * P + p for h in sel for p in range(P)]
    tol = dict(rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(operator_map(op, "mean", heads=sel), H[:, chans].mean(1), **tol)
    assert head_channels(op, -1) == tuple(range(3 * P, 4 * P))
    per_head = np.asarray(head_maps(op, sel), np.float64)
    np.testing.assert_allclose(per_head, np.asarray(op.head_matrices("mean", sel)), **tol)
    np.testing.assert_allclose(per_head, H.reshape(B, cfg.num_heads, P, L, L)[:, sel].mean(2), **tol)
    np.testing.assert_allclose(channel_maps(op, heads=2), H[:, 2 * P:3 * P], **tol)
    np.testing.assert_allclose(to_circuitsvis(op, batch=1, heads=sel), per_head[1], rtol=1e-6)
    # through the model and the methods
    mm = model_maps(f.model, f.ids, heads=[0])
    np.testing.assert_allclose(mm, np.stack([Hl[:, :P].mean(1) for Hl in f.H]), **tol)
    ex = explain(f.model, f.ids, "rollout", query=Q, heads=[0], how="mean")
    np.testing.assert_allclose(ex.layer_maps, mm, **tol)
    R = contribution_map(op, f.grads[1], heads=[3])
    want = np.einsum("bci,bcij,bcj->bij", f.g[1][:, 3 * P:], H[:, 3 * P:], f.v[1][:, 3 * P:])
    np.testing.assert_allclose(R, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_attention_heads_and_heads_errors():
    f = get_fam("griffin")
    att, H = f.ops[1], f.H[1]
    np.testing.assert_allclose(operator_map(att, heads=[1]), H[:, 1], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(head_maps(att), H, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="has none: use channels="):
        operator_map(f.ops[0], heads=[0])  # the recurrent layer has no heads
    with pytest.raises(ValueError, match="has none"):
        explain(get_fam("rwkv").model, f.ids, "raw", heads=0, how="mean")
    with pytest.raises(ValueError, match="heads out of range for an operator with 2"):
        operator_map(att, heads=[2])
    with pytest.raises(ValueError, match="not both"):
        operator_map(att, channels=[0], heads=[1])


# ----------------------------------------------------------------------------- packed documents

POS = np.array([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])  # row 0: documents of 3 and 4 tokens


@pytest.mark.parametrize("method", METHODS)
def test_packed_documents_explain_like_separate_inputs(method):
    """With ``segment_pos`` nothing crosses a document start: in row 0 (documents A, B,
    query in B) the tokens of A get exactly 0, and B's relevance is that of B explained on
    its own (same model, B first, query at the same offset in B). Row 1 (one document) is
    unchanged by the positions."""
    f = get_fam("griffin")
    ex = explain(f.model, f.ids, method, query=Q, segment_pos=POS, how="mean")
    alone = f.ids.copy()
    a, nb = 3, L - 3  # document A: positions 0..2, document B: 3..L-1
    alone[0] = np.concatenate([f.ids[0, a:], f.ids[0, :a]])  # B then A: B is causally alone
    ref = explain(f.model, alone, method, query=Q - a, how="mean")
    plain = explain(f.model, f.ids, method, query=Q, how="mean")
    assert np.all(ex.relevance[0, :a] == 0) and np.abs(plain.relevance[0, :a]).max() > 1e-6
    assert ex.target[0] == ref.target[0]
    np.testing.assert_allclose(ex.relevance[0, a:], ref.relevance[0, :nb], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ex.relevance[1], plain.relevance[1], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ex.layer_maps[:, 0, a:, a:], ref.layer_maps[:, 0, :nb, :nb], rtol=1e-4, atol=1e-6)
    if method == "raw":
        maps = model_maps(f.model, f.ids, segment_pos=POS)
        np.testing.assert_allclose(ex.layer_maps, maps, rtol=1e-6)
        assert np.all(np.asarray(maps)[:, 0, a:, :a] == 0)


def test_packed_documents_metrics_and_errors():
    """Perturbing only document A never changes the score at a query in document B when
    the positions are given (and does without them)."""
    f = get_fam("griffin")
    rel = np.tile(np.arange(L, dtype=float), (B, 1))
    cand = np.arange(L) < 3
    t = np.asarray(np.argmax(f.model(f.ids, segment_pos=POS)[:, Q], -1))
    kw = dict(query=Q, target=t, score="logit", candidates=cand, fractions=[0.4, 1.0], batch_size=B)
    packed = positive_perturbation(f.model, f.ids, rel, segment_pos=POS, **kw)
    s0 = np.asarray(f.model(f.ids, segment_pos=POS))[np.arange(B), Q, t]
    np.testing.assert_allclose(packed.values[0], s0[0], rtol=1e-5)
    assert np.abs(packed.values[1] - s0[1]).max() > 1e-4  # row 1 is one document
    plain = positive_perturbation(f.model, f.ids, rel, **kw)
    assert np.abs(plain.values[0] - np.asarray(f.model(f.ids))[0, Q, t[0]]).max() > 1e-4
    curves = faithfulness(f.model, f.ids, rel, query=Q, segment_pos=POS, batch_size=B)
    assert all(np.isfinite(c.area).all() for c in curves.values())
    mm = get_fam("mamba")
    for fn in (lambda: explain(mm.model, mm.ids, "raw", segment_pos=POS, how="mean"),
               lambda: activation(mm.model, mm.ids, rel, segment_pos=POS),
               lambda: model_maps(mm.model, mm.ids, segment_pos=POS)):
        with pytest.raises(ValueError, match="segment_pos .* only taken by Griffin"):
            fn()
    with pytest.raises(ValueError, match=r"segment_pos must have the shape of ids \(2, 7\)"):
        explain(f.model, f.ids, "raw", segment_pos=POS[:, :4], how="mean")
    with pytest.raises(ValueError, match="segment_pos"):  # the model's own check of the values
        explain(f.model, f.ids, "raw", segment_pos=POS + 1, how="mean")

