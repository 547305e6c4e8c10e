"""Explanations: maps, rollout, attribution, contributions, metrics, figures, report, adapters.

References are independent of the code under test: float64 numpy on materialized
operators, closed forms on a linear toy model, and forward-mode jvp through the model's
taps for the first-order claims.
"""
from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.explain import (METHODS, activation, attribution_maps, comprehensiveness,
                                   contribution_map, explain, faithfulness, heatmap_grid,
                                   minmax_normalize, negative_perturbation, operator_grid,
                                   operator_map, output_gradients, positive_perturbation, pruning,
                                   random_relevance, raw_attention, relevance_strip, render_html,
                                   rollout, sufficiency, to_bertviz, to_circuitsvis, channel_maps,
                                   model_maps, position_mean, iter_operators)
from implicit_attn.explain.maps import channel_tuple
from implicit_attn.explain.metrics import ordering, perturbed_ids, score_of, token_counts
from implicit_attn.families import mamba
from implicit_attn.nn import check_input_ids, check_layers
from implicit_attn.operator import ImplicitOperator, OperatorCore, pytree_dataclass

PNG = b"\x89PNG\r\n\x1a\n"
# The operator's own materialize (jitted: eager dispatch of the chunked kernel is slow).
dense = jax.jit(lambda op: op.materialize())


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def mm():
    """A tiny random Mamba and a batch of 2 inputs of odd length."""
    cfg = mamba.Config(vocab_size=32, hidden_size=8, state_size=4, num_hidden_layers=2)
    model = mamba.LM(cfg, mamba.init_params(cfg, jax.random.PRNGKey(1)))
    ids = np.random.default_rng(0).integers(1, 32, (2, 7))
    return model, ids


@pytest.fixture(scope="module")
def mm_ops(mm):
    model, ids = mm
    return model.operators(ids)


@pytest.fixture(scope="module")
def mm_dense(mm_ops):
    """Every layer's dense H in float64: ``[(B, C, L, L)]``."""
    return [np.asarray(dense(op), np.float64) for op in mm_ops]


@pytest.fixture(scope="module")
def mm_grads(mm):
    """Gradients of the target at query position L - 2 w.r.t. every layer's output."""
    model, ids = mm
    return output_gradients(model, ids, query=-2)


@pytree_dataclass
class DenseCore(OperatorCore):
    """A core holding its dense ``H (B, C, L, L)`` (for synthetic operators)."""

    H: Any

    @property
    def num_channels(self) -> int:
        return self.H.shape[1]

    def dense(self, idx):
        return jnp.take(self.H, idx, axis=1)


class ToyLM:
    """Linear residual model with the LM interface, built so relevance is known exactly.

    ``h_0[c, j] = E[ids_j, c]``; layer l: ``y_l = H_l h_l`` per channel (the same ``H_l``
    for every channel), ``h_{l+1} = h_l + y_l``; ``logits[j] = W h_N[:, j]``. Every token
    but the baseline (id 0, zero embedding) has the same embedding ``e``, so the target
    logit at the last position q is ``(W e)_t * sum_j rho[q, j] [ids_j != 0]`` with
    ``rho = (I + H_{N-1}) ... (I + H_0)``: the influence of position j is ``rho[q, j]``.
    """

    family = "toy"

    def __init__(self, Hs, C=3, V=6, seed=0):
        rng = np.random.default_rng(seed)
        e = rng.uniform(0.5, 1.0, C)
        self.E = jnp.asarray(np.vstack([np.zeros(C), np.tile(e, (V - 1, 1))]), jnp.float32)
        W = rng.normal(0, 0.3, (V, C))
        W[2] = 2.0 * e / np.linalg.norm(e)  # token 2 is the top logit for every input
        self.W = jnp.asarray(W, jnp.float32)
        self.Hs = [jnp.asarray(H, jnp.float32) for H in Hs]
        self.layers = list(range(len(Hs)))
        self.config = types.SimpleNamespace(vocab_size=V)

    def _run(self, ids, taps):
        h = jnp.swapaxes(self.E[ids], 1, 2)
        B, C, L = h.shape
        ops = []
        for l, H in enumerate(self.Hs):
            Hb = jnp.broadcast_to(H, (B, C, L, L))
            y = jnp.einsum("bcij,bcj->bci", Hb, h)
            ops.append(ImplicitOperator(values=h, offset=jnp.zeros_like(h), output=y, core=DenseCore(Hb)))
            if l in taps:
                y = y + taps[l]
            h = h + y
        return jnp.einsum("bcl,vc->blv", h, self.W), ops

    def __call__(self, ids):
        return self._run(check_input_ids(ids, self.config.vocab_size), {})[0]

    def tapped_logits(self, ids, taps):
        return self._run(check_input_ids(ids, self.config.vocab_size), taps)[0]

    def operators(self, ids, layers=None, variant="full"):
        if variant != "full":
            raise ValueError(f"toy variant must be 'full', got {variant!r}")
        ops = self._run(check_input_ids(ids, self.config.vocab_size), {})[1]
        return [ops[l] for l in check_layers(layers, len(self.Hs))]


L_TOY, P_STAR = 8, 2


def toy_maps(seed=3):
    """Two non-negative causal layers; layer 1 reads position P_STAR strongly at the last row."""
    rng = np.random.default_rng(seed)
    H0 = np.tril(rng.uniform(0.0, 0.1, (L_TOY, L_TOY)))
    H1 = np.tril(rng.uniform(0.0, 0.1, (L_TOY, L_TOY)))
    H1[-1, P_STAR] = 8.0
    return H0, H1


@pytest.fixture(scope="module")
def toy():
    H0, H1 = toy_maps()
    model = ToyLM([H0, H1])
    ids = np.array([[1, 3, 4, 5, 1, 3, 4, 5]])
    rho = (np.eye(L_TOY) + H1) @ (np.eye(L_TOY) + H0)
    return model, ids, rho, (H0, H1)


# ----------------------------------------------------------------------------- maps

def test_operator_map_matches_float64_reductions(mm_ops, mm_dense):
    op, H = mm_ops[1], mm_dense[1]
    ref = {"mean": H.mean(1), "abs_mean": np.abs(H).mean(1), "pos_mean": np.maximum(H, 0).mean(1)}
    for how, r in ref.items():
        np.testing.assert_allclose(operator_map(op, how), r, rtol=1e-5, atol=1e-6)
    sel = [0, 5, 15]
    np.testing.assert_allclose(operator_map(op, "abs_mean", channels=sel), np.abs(H[:, sel]).mean(1),
                               rtol=1e-5, atol=1e-6)
    assert channel_tuple(slice(0, 4), 16) == (0, 1, 2, 3) and channel_tuple(-1, 16) == (15,)
    # min-max of |H|: over the causal entries of each map, in [0, 1], zero above the diagonal
    m = np.abs(H).mean(1)
    tri = np.tril(np.ones(m.shape[-2:], bool))
    lo = np.array([x[tri].min() for x in m])[:, None, None]
    hi = np.array([x[tri].max() for x in m])[:, None, None]
    np.testing.assert_allclose(operator_map(op, "abs_mean", normalize="minmax"),
                               np.where(tri, (m - lo) / (hi - lo), 0), rtol=1e-5, atol=1e-6)
    # inside a user's jit as well
    jm = jax.jit(lambda o: operator_map(o, "abs_mean", channels=[0, 5, 15]))(op)
    np.testing.assert_allclose(jm, np.abs(H[:, sel]).mean(1), rtol=1e-5, atol=1e-6)
    cm = np.asarray(channel_maps(op, [2, 3], absolute=True, normalize="minmax"))
    assert cm.shape == (2, 2, 7, 7) and cm.min() == 0 and np.allclose(cm.max(axis=(2, 3)), 1)


def test_minmax_hand_case_and_constant():
    m = jnp.array([[1.0, 9.0], [3.0, 5.0]])
    np.testing.assert_allclose(minmax_normalize(m), [[0.0, 0.0], [0.5, 1.0]])
    np.testing.assert_allclose(minmax_normalize(jnp.ones((2, 2))), np.zeros((2, 2)))


def test_model_maps_layers_and_variants(mm, mm_dense):
    model, ids = mm
    full = np.asarray(model_maps(model, ids, layers=[1, 0], how="mean"))
    s6 = np.asarray(model_maps(model, ids, layers=[1, 0], how="mean", variant="s6_only"))
    ref_full = [mm_dense[1].mean(1), mm_dense[0].mean(1)]
    ref_s6 = [np.asarray(dense(o), np.float64).mean(1)
              for o in model.operators(ids, [1, 0], variant="s6_only")]
    np.testing.assert_allclose(full, ref_full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s6, ref_s6, rtol=1e-5, atol=1e-6)
    assert np.abs(full - s6).max() > 1e-3  # the variant matters


# ----------------------------------------------------------------------------- pure methods

def test_rollout_and_raw_hand_computed():
    A0 = np.array([[0.5, 0, 0], [0.2, 0.3, 0], [0.1, 0.4, 0.2]])
    A1 = np.array([[1.0, 0, 0], [0.0, 0.5, 0], [0.6, 0.0, 0.1]])
    maps = jnp.asarray(np.stack([A0, A1])[:, None], jnp.float32)  # (2, 1, 3, 3)
    I = np.eye(3)
    np.testing.assert_allclose(rollout(maps)[0], (I + A1) @ (I + A0), rtol=1e-6)
    nrm = lambda M: M / M.sum(1, keepdims=True)
    np.testing.assert_allclose(rollout(maps, normalize_rows=True)[0], nrm(I + A1) @ nrm(I + A0), rtol=1e-6)
    np.testing.assert_allclose(rollout(maps, start_layer=1)[0], I + A1, rtol=1e-6)
    np.testing.assert_allclose(rollout(maps, add_identity=False)[0], A1 @ A0, rtol=1e-6)
    keep = np.array([0.0, 1, 1])  # exclude position 0 (a sink): its key column is zeroed
    np.testing.assert_allclose(rollout(maps, exclude=(0,))[0], (I + A1 * keep) @ (I + A0 * keep), rtol=1e-6)
    np.testing.assert_allclose(raw_attention(maps)[0], (A0 + A1) / 2, rtol=1e-6)
    np.testing.assert_allclose(raw_attention(maps, exclude=(-3,))[0], (A0 + A1) / 2 * keep, rtol=1e-6)
    # jit-able with the options static
    f = jax.jit(rollout, static_argnames=("start_layer", "add_identity", "normalize_rows", "exclude"))
    np.testing.assert_allclose(f(maps, normalize_rows=True)[0], nrm(I + A1) @ nrm(I + A0), rtol=1e-6)
    g = np.array([[1.0, -2.0, 0.5]])
    np.testing.assert_allclose(attribution_maps(maps[:1], g[None])[0, 0], np.maximum(g.T * A0, 0), rtol=1e-6)


def test_rollout_of_identity_operators_is_identity():
    L = 5
    model = ToyLM([np.eye(L), np.eye(L), np.eye(L)])
    ids = np.array([[1, 2, 3, 4, 5]])
    ex = explain(model, ids, "rollout", normalize_rows=True, how="mean")
    np.testing.assert_allclose(ex.matrix[0], np.eye(L), atol=1e-6)
    np.testing.assert_allclose(ex.relevance[0], np.eye(L)[-1], atol=1e-6)
    ex = explain(model, ids, "rollout", query=2, how="mean")  # unnormalised: (2I)^3
    np.testing.assert_allclose(ex.matrix[0], 8 * np.eye(L), atol=1e-5)
    assert ex.query == 2 and np.all(ex.relevance[0, 3:] == 0)


# ----------------------------------------------------------------------------- toy model: known relevance

def test_toy_rollout_is_the_exact_influence(toy):
    model, ids, rho, _ = toy
    ex = explain(model, ids, "rollout", how="mean")
    np.testing.assert_allclose(ex.matrix[0], rho, rtol=1e-5, atol=1e-6)
    # independent check through the model: d target / d (scale of position j's embedding)
    t = int(ex.target[0])
    assert t == 2

    def target(scale):
        h = model.E[ids] * scale[None, :, None]
        x = jnp.swapaxes(h, 1, 2)
        for H in model.Hs:
            x = x + jnp.einsum("ij,bcj->bci", H, x)
        return jnp.einsum("bc,c->b", x[:, :, -1], model.W[t])[0]

    grad = np.asarray(jax.grad(target)(jnp.ones(L_TOY)))
    we = float(model.W[t] @ model.E[1])
    np.testing.assert_allclose(ex.relevance[0] * we, grad, rtol=1e-5, atol=1e-6)


def test_toy_attribution_closed_form(toy):
    model, ids, rho, (H0, H1) = toy
    ex = explain(model, ids, "attribution", how="mean")
    t = int(ex.target[0])
    w = np.asarray(model.W[t], np.float64)
    q = L_TOY - 1
    # d target / d y_l[c, i] = w_c * P_l[q, i] with P_1 = I, P_0 = I + H1
    g1 = w.mean() * np.eye(L_TOY)[q]
    g0 = w.mean() * (np.eye(L_TOY) + H1)[q]
    b0 = np.eye(L_TOY) + np.maximum(g0[:, None] * H0, 0)
    b1 = np.eye(L_TOY) + np.maximum(g1[:, None] * H1, 0)
    np.testing.assert_allclose(ex.matrix[0], b1 @ b0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_toy_each_method_ranks_the_relevant_token_first(toy, method):
    model, ids, rho, _ = toy
    ex = explain(model, ids, method, how="mean")
    assert ex.relevance.shape == (1, L_TOY)
    assert int(np.argmax(ex.relevance[0])) == P_STAR, (method, ex.relevance)


def test_toy_metrics_order_oracle_random_anti(toy):
    model, ids, rho, _ = toy
    oracle = rho[-1][None]
    anti = -oracle
    rand = [random_relevance((1, L_TOY), seed=s) for s in range(8)]
    kw = dict(baseline_id=0)
    metrics = {"auac": (activation, +1), "au_mse": (pruning, -1), "pos": (positive_perturbation, -1),
               "neg": (negative_perturbation, +1), "comp": (comprehensiveness, +1), "suff": (sufficiency, -1)}
    for name, (fn, better) in metrics.items():
        o = fn(model, ids, oracle, **kw).mean_area
        a = fn(model, ids, anti, **kw).mean_area
        r = np.mean([fn(model, ids, x, **kw).mean_area for x in rand])
        assert better * (o - r) > 0 and better * (r - a) > 0, (name, o, r, a)
    # rollout is exact on this model, so it scores like the oracle
    ex = explain(model, ids, "rollout", how="mean")
    np.testing.assert_allclose(activation(model, ids, ex.relevance).area, activation(model, ids, oracle).area)


def test_logit_gradients_match_grad_through_tapped_logits(mm):
    """``LanguageModel.logit_gradients`` (forward and backward in one compiled program, the
    argmax targets found in that same pass) equals ``jax.grad`` through ``tapped_logits``
    with the targets taken from a separate plain forward; given targets are used as given."""
    model, ids = mm
    B, L = ids.shape
    q = np.array([L - 1, 3])
    rows = np.arange(B)
    taps = {l: np.zeros(model.tap_shape(l, B, L)[0], np.float32) for l in range(len(model.layers))}
    for given in (None, np.array([0, 5])):
        t_ref = np.asarray(model(ids))[rows, q].argmax(-1) if given is None else given
        ref = jax.grad(lambda tp: jnp.sum(model.tapped_logits(ids, tp)[rows, q, t_ref]))(taps)
        g, t = model.logit_gradients(ids, taps, q, given)
        assert np.asarray(t).tolist() == t_ref.tolist()
        for l in taps:
            assert np.abs(np.asarray(ref[l])).max() > 0
            np.testing.assert_allclose(np.asarray(g[l]), np.asarray(ref[l]), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="shape"):
        model.logit_gradients(ids, {0: np.zeros((1, 1, 1), np.float32)}, q)


def test_logit_gradients_return_the_mixer_inputs_of_their_forward_pass(mm):
    """``logit_gradients(..., mixer_inputs=layers)`` also returns those layers' mixer inputs
    from its own forward pass (``explain`` builds its operators from them): they equal
    ``model.mixer_inputs``, and the gradients and targets are those without them.
    ``iter_operators`` refuses given inputs that miss a selected layer."""
    model, ids = mm
    B, L = ids.shape
    q = np.array([L - 1, 3])
    n = len(model.layers)
    taps = {l: np.zeros(model.tap_shape(l, B, L)[0], np.float32) for l in range(n)}
    g, t = model.logit_gradients(ids, taps, q)
    layers = list(range(n))[::-1]
    g2, t2, xs = model.logit_gradients(ids, taps, q, mixer_inputs=layers)
    ref = model.mixer_inputs(ids)
    assert sorted(xs) == sorted(ref) == list(range(n))
    for l in range(n):
        np.testing.assert_allclose(np.asarray(xs[l]), np.asarray(ref[l]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g2[l]), np.asarray(g[l]), rtol=1e-6, atol=1e-8)
    assert np.asarray(t2).tolist() == np.asarray(t).tolist()
    with pytest.raises(ValueError, match="layer"):
        model.logit_gradients(ids, taps, q, mixer_inputs=[n])
    with pytest.raises(ValueError, match=r"no input for layer\(s\) \[0\]"):
        list(iter_operators(model, ids, [0], mixer_inputs={}))


# ----------------------------------------------------------------------------- contributions vs jvp

def test_contributions_reproduce_first_order_change(mm, mm_ops, mm_dense, mm_grads):
    model, ids = mm
    B, L = ids.shape
    grads, q, t = mm_grads
    assert q == L - 2
    taps0 = {l: jnp.zeros_like(o.output) for l, o in enumerate(mm_ops)}
    rows = jnp.arange(B)

    def target(taps):
        return model.tapped_logits(ids, taps)[rows, q, jnp.asarray(t)]  # (B,) per example

    for l, op in enumerate(mm_ops):
        R = np.asarray(contribution_map(op, grads[l]), np.float64)
        H = mm_dense[l]
        v = np.asarray(op.values, np.float64)
        g = np.asarray(grads[l], np.float64)
        np.testing.assert_allclose(R, np.einsum("bci,bcij,bcj->bij", g, H, v), rtol=1e-4, atol=1e-6)
        y = np.asarray(op.output - op.offset, np.float64)

        def jvp(d):  # forward-mode derivative of the target along a tap direction
            return np.asarray(jax.jvp(target, (taps0,), ({**taps0, l: jnp.asarray(d, jnp.float32)},))[1])

        for i in (0, 3, q):  # row sums: scaling layer l's mixing output at position i
            d = np.zeros_like(y)
            d[:, :, i] = y[:, :, i]
            np.testing.assert_allclose(R[:, i].sum(-1), jvp(d), rtol=1e-4, atol=1e-6)
        for j in (0, 2, q):  # column sums: token j's value, through every position i
            d = H[:, :, :, j] * v[:, :, None, j]
            np.testing.assert_allclose(R[:, :, j].sum(-1), jvp(d), rtol=1e-4, atol=1e-6)
        assert np.abs(R[:, q + 1:]).max() == 0  # nothing after the query reaches the target
    ex = explain(model, ids, "contributions", query=-2, how="mean")
    R0 = np.asarray(contribution_map(mm_ops[0], grads[0]))
    np.testing.assert_allclose(ex.layer_relevance[0], R0.sum(1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ex.relevance, ex.layer_relevance.mean(0), rtol=1e-6)


def test_methods_on_mamba_shapes_variants_and_channels(mm, mm_ops, mm_dense, mm_grads):
    model, ids = mm
    for m in METHODS:
        ex = explain(model, ids, m, query=4, how="mean")
        assert ex.relevance.shape == (2, 7) and np.all(ex.relevance[:, 5:] == 0)
        assert np.isfinite(ex.relevance).all() and ex.layer_maps.shape == (2, 2, 7, 7)
    ex_nc = explain(model, ids, "rollout", variant="no_conv", query=4, how="mean")
    assert np.abs(ex_nc.relevance - explain(model, ids, "rollout", query=4, how="mean").relevance).max() > 1e-4
    # attribution uses the channel-mean gradient and map (Eq. 23)
    grads, q, t = mm_grads
    ops = mm_ops
    manual = []
    for l in range(2):
        gm = np.asarray(grads[l], np.float64).mean(1)
        manual.append(np.eye(7) + np.maximum(gm[:, :, None] * mm_dense[l].mean(1), 0))
    ex = explain(model, ids, "attribution", query=-2, how="mean")
    np.testing.assert_allclose(ex.matrix, np.einsum("bij,bjk->bik", manual[1], manual[0]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(position_mean(grads[0]), np.asarray(grads[0]).mean(1), rtol=1e-6)
    # channel selection in contributions = the sum over those channels only
    sel = [1, 4, 9]
    R = np.asarray(contribution_map(ops[0], grads[0], channels=sel), np.float64)
    H = mm_dense[0][:, sel]
    ref = np.einsum("bci,bcij,bcj->bij", np.asarray(grads[0])[:, sel], H, np.asarray(ops[0].values)[:, sel])
    np.testing.assert_allclose(R, ref, rtol=1e-4, atol=1e-7)
    # explicit target and BOS exclusion
    ex = explain(model, ids, "rollout", target=[3, 4], exclude=(0,), how="mean")
    assert ex.target.tolist() == [3, 4] and np.all(ex.relevance[:, 0] == 0)


def test_attention_operator_contributions_and_maps():
    import implicit_attn.operator as attn
    rng = np.random.default_rng(0)
    B, Hh, KV, L, d = 2, 4, 2, 6, 3
    q = jnp.asarray(rng.normal(size=(B, Hh, L, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, KV, L, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, Hh, L, d)), jnp.float32)
    core = attn.AttentionCore(q=q, k=k, seg=jnp.zeros((B, L), jnp.int32), window=4)
    P = np.asarray(core.dense(jnp.arange(Hh)), np.float64)
    out = jnp.asarray(np.einsum("bhij,bhjd->bhid", P, v), jnp.float32)
    op = attn.AttentionOperator(values=v, offset=jnp.zeros_like(v), output=out, core=core)
    g = rng.normal(size=(B, Hh, L, d)).astype(np.float32)
    ref = np.einsum("bhid,bhij,bhjd->bij", g, P, np.asarray(v, np.float64))
    np.testing.assert_allclose(contribution_map(op, jnp.asarray(g)), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(contribution_map(op, jnp.asarray(g), channels=[1]),
                               np.einsum("bid,bij,bjd->bij", g[:, 1], P[:, 1], np.asarray(v[:, 1])),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(operator_map(op, "mean"), P.mean(1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(position_mean(g), g.mean(axis=(1, 3)), rtol=1e-5, atol=1e-7)
    cv = to_circuitsvis(op, batch=1)
    assert cv.shape == (Hh, L, L) and np.allclose(cv, P[1], atol=1e-6)
    bv = to_bertviz([op, op], channels=[0, 2])
    assert len(bv) == 2 and bv[0].shape == (1, 2, L, L) and np.allclose(bv[1][0], P[0][[0, 2]], atol=1e-6)


# ----------------------------------------------------------------------------- metrics details

def test_ordering_counts_and_perturbation_by_hand():
    rel = np.array([[0.1, 0.9, 0.5, -1.0]])
    cand = np.ones((1, 4), bool)
    assert ordering(rel, cand).tolist() == [[1, 2, 0, 3]]
    assert ordering(rel, cand, "abs").tolist() == [[3, 1, 2, 0]]
    assert ordering(rel, cand, descending=False).tolist() == [[3, 0, 2, 1]]
    assert ordering(np.zeros((1, 4)), np.array([[True, False, True, True]])).tolist() == [[0, 2, 3, 1]]
    assert token_counts([0, 0.1, 0.5, 0.51, 1], [4]).tolist() == [[0, 1, 2, 3, 4]]
    ids = np.array([[5, 6, 7, 8]])
    order = ordering(rel, cand)
    assert perturbed_ids(ids, order, [2], [4], 0, keep=False).tolist() == [[5, 0, 0, 8]]
    assert perturbed_ids(ids, order, [2], [4], 0, keep=True).tolist() == [[0, 6, 7, 0]]
    lg = np.log(np.array([[1.0, 2.0, 7.0]]))
    np.testing.assert_allclose(score_of(lg, [2], "prob"), [0.7])
    assert score_of(lg, [1], "top1").tolist() == [0.0] and score_of(lg, [2], "top1").tolist() == [1.0]


def test_curves_endpoints_and_areas(toy):
    model, ids, rho, _ = toy
    rel = rho[-1][None]
    base = np.zeros_like(ids)
    lg = lambda x: np.asarray(model(x)[:, -1], np.float64)
    s = lambda x, sc="prob": score_of(lg(x), [2], sc)
    c = activation(model, ids, rel)
    np.testing.assert_allclose(c.values[0, 0], s(base)[0], rtol=1e-6)
    np.testing.assert_allclose(c.values[0, -1], s(ids)[0], rtol=1e-6)
    np.testing.assert_allclose(c.area, [np.sum((c.values[0, 1:] + c.values[0, :-1]) / 2 * 0.1)], rtol=1e-6)
    p = pruning(model, ids, rel)
    assert p.values[0, 0] == 0
    np.testing.assert_allclose(p.values[0, -1], np.mean((lg(base) - lg(ids)) ** 2), rtol=1e-6)
    # query inside the sequence: later positions are never perturbed
    c = positive_perturbation(model, ids, rel, query=4, score="logit", fractions=[0.2])
    # 5 candidates (positions 0..4): ceil(0.2 * 5) = 1 token, the most relevant of them
    top = int(np.argmax(rel[0, :5]))
    x = ids.copy()
    x[0, top] = 0
    np.testing.assert_allclose(c.values[0, 0], np.asarray(model(x)[0, 4, 2]), rtol=1e-6)
    cand = np.ones(L_TOY, bool)
    cand[top] = False  # a protected position is never perturbed: the next most relevant goes
    c = positive_perturbation(model, ids, rel, query=4, score="logit", fractions=[0.2], candidates=cand)
    nxt = [j for j in np.argsort(-rel[0, :5], kind="stable") if j != top][0]
    x = ids.copy()
    x[0, nxt] = 0
    np.testing.assert_allclose(c.values[0, 0], np.asarray(model(x)[0, 4, 2]), rtol=1e-6)
    comp = comprehensiveness(model, ids, rel, bins=(0.5,), score="logit")
    x = ids.copy()
    x[0, np.argsort(-rel[0], kind="stable")[:4]] = 0
    np.testing.assert_allclose(comp.area, lg(ids)[:, 2] - lg(x)[:, 2], rtol=1e-6)
    allm = faithfulness(model, ids, rel)
    assert set(allm) == {"auac", "au_mse", "positive_auc", "negative_auc", "comprehensiveness", "sufficiency"}


# ----------------------------------------------------------------------------- figures, report, adapters

def test_pngs(tmp_path, mm_ops):
    m = np.asarray(mm_ops[0].reduce("abs_mean"))
    p = heatmap_grid(np.stack([m[0], m[1], m[0]]), tmp_path / "g.png", ["a", "b", "c"], list("abcdefg"))
    assert p.read_bytes()[:8] == PNG
    p = relevance_strip(np.random.default_rng(0).normal(size=(2, 7)), tmp_path / "s.png", list("abcdefg"),
                        ["m1", "m2"])
    assert p.read_bytes()[:8] == PNG
    p = operator_grid(mm_ops[1], tmp_path / "o.png", channels=[0, 1, 2])
    assert p.read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="titles"):
        heatmap_grid(np.stack([m[0], m[1]]), tmp_path / "x.png", ["a"])


def test_html_report_escapes_and_is_self_contained(tmp_path):
    p = relevance_strip(np.array([0.5, -1.0, 0.2]), tmp_path / "s.png")
    tokens = ["<script>alert(1)</script>", "a&b", '"q"']
    html = render_html(tokens, {"<b>m</b>": np.array([0.5, -1.0, 0.2])}, title="t<i>", query=2,
                       images={"strip <x>": p}, metrics={"rollout": {"auac": 0.5}},
                       meta={"target": "<t>"})
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "a&amp;b" in html and "&quot;q&quot;" in html and "&lt;b&gt;m&lt;/b&gt;" in html
    assert "&lt;t&gt;" in html and "strip &lt;x&gt;" in html
    assert "data:image/png;base64," in html and "http://" not in html and "https://" not in html
    assert "class=\"legend\"" in html and "rgba(37,99,235,1.000)" in html  # -1 is full blue
    with pytest.raises(ValueError, match="shape"):
        render_html(tokens, {"m": np.zeros(2)})


def test_adapters_recurrent(mm_ops, mm_dense):
    op = mm_ops[0]
    H = mm_dense[0].astype(np.float32)
    cv = to_circuitsvis(op, channels=[3, 1])
    np.testing.assert_allclose(cv, H[0, [3, 1]], rtol=1e-5, atol=1e-7)
    bv = to_bertviz(mm_ops, batch=1, normalize="minmax")
    assert [b.shape for b in bv] == [(1, 16, 7, 7)] * 2
    assert bv[0].min() >= 0 and np.allclose(bv[0].max(axis=(2, 3)), 1)
    np.testing.assert_allclose(to_circuitsvis(H), H[0])


def test_bad_inputs(mm, mm_ops, toy):
    model, ids = mm
    with pytest.raises(ValueError, match="method"):
        explain(model, ids, "lrp", how="mean")
    with pytest.raises(ValueError, match="query position"):
        explain(model, ids, query=7, how="mean")
    with pytest.raises(ValueError, match="vocabulary"):
        explain(model, ids, target=32, how="mean")
    with pytest.raises(ValueError, match="one per example"):
        explain(model, ids, target=[1, 2, 3], how="mean")
    with pytest.raises(ValueError, match="one per example"):
        explain(model, ids, target=2.5, how="mean")
    with pytest.raises(ValueError, match="start_layer"):
        explain(model, ids, start_layer=2, how="mean")
    with pytest.raises(ValueError, match="exclude position"):
        explain(model, ids, exclude=(9,), how="mean")
    with pytest.raises(ValueError, match="how"):
        explain(model, ids, how="max")
    with pytest.raises(ValueError, match="variant"):
        explain(model, ids, variant="nope", how="mean")
    with pytest.raises(ValueError, match="channels out of range"):
        operator_map(mm_ops[0], channels=[16])
    with pytest.raises(ValueError, match="gradient shape"):
        contribution_map(mm_ops[0], jnp.zeros((2, 3, 7)))
    with pytest.raises(ValueError, match="maps must have shape"):
        rollout(jnp.zeros((2, 3, 3)))
    tm, tids, rho, _ = toy
    with pytest.raises(ValueError, match="relevance must have shape"):
        activation(tm, tids, np.zeros(3))
    with pytest.raises(ValueError, match="baseline_id"):
        pruning(tm, tids, rho[-1], baseline_id=6)
    with pytest.raises(ValueError, match=r"fractions must lie in \[0, 1\]"):
        activation(tm, tids, rho[-1], fractions=[0.5, 1.5])
    # the areas are trapezoids over the grid: an unsorted grid would give a wrong area
    with pytest.raises(ValueError, match=r"strictly increasing.*fractions\[2\] = 0.2 follows 0.5"):
        activation(tm, tids, rho[-1], fractions=[0.0, 0.5, 0.2, 1.0])
    with pytest.raises(ValueError, match="strictly increasing"):
        pruning(tm, tids, rho[-1], fractions=[0.1, 0.1, 0.9])
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        positive_perturbation(tm, tids, rho[-1], fractions=[0.1, float("nan")])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        negative_perturbation(tm, tids, rho[-1], fractions=[])
    with pytest.raises(ValueError, match="bins must be strictly increasing"):
        comprehensiveness(tm, tids, rho[-1], bins=(0.5, 0.1))
    with pytest.raises(ValueError, match=r"bins must lie in \[0, 1\]"):
        sufficiency(tm, tids, rho[-1], bins=(-0.1, 0.5))
    with pytest.raises(ValueError, match="candidates"):
        activation(tm, tids, rho[-1], candidates=[1, 0])
    with pytest.raises(ValueError, match="order_by"):
        activation(tm, tids, rho[-1], order_by="rank")
