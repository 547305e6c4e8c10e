"""Mamba: logits and per-layer parity with HF torch, exactness of every operator, variants,
gradients, long inputs against float64."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import mamba
from hf_build import mamba_hf

CONFIGS = {
    "tied_k4": dict(),
    "untied_k3_bias": dict(conv_kernel=3, tie_word_embeddings=False, use_bias=True),
    "k2_wide_state": dict(conv_kernel=2, state_size=8, num_hidden_layers=3),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    tm = mamba_hf(path, **CONFIGS[request.param])
    return tm, ia.load(path)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """A single configuration, for tests whose cost is mostly compilation."""
    path = tmp_path_factory.mktemp("one")
    tm = mamba_hf(path, conv_kernel=3, use_bias=True)
    return tm, ia.load(path)


def torch_run(tm, ids):
    import torch

    io = {}
    hooks = [layer.mixer.register_forward_hook(
        lambda mod, inp, out, i=i: io.__setitem__(i, (inp[0].numpy(), out.numpy())))
        for i, layer in enumerate(tm.backbone.layers)]
    with torch.no_grad():
        logits = tm(torch.tensor(ids)).logits.numpy()
    for h in hooks:
        h.remove()
    return logits, io


@pytest.mark.parametrize("L", [1, 23])
def test_logits_and_mixers_match_torch(pair, rng, L):
    tm, model = pair
    ids = rng.integers(0, model.config.vocab_size, (2, L))
    ref, io = torch_run(tm, ids)
    logits = np.asarray(model(ids))
    assert logits.shape == ref.shape and logits.dtype == np.float32
    assert np.abs(logits - ref).max() <= 1e-4
    xs = model.mixer_inputs(ids)
    for i, layer in enumerate(model.layers):
        tin, tout = io[i]
        np.testing.assert_allclose(np.asarray(xs[i]), tin, atol=1e-5)
        np.testing.assert_allclose(np.asarray(layer.mixer(tin)), tout, atol=1e-5)


@pytest.mark.parametrize("L", [1, 17])
def test_every_operator_is_exact(pair, rng, L):
    _, model = pair
    ids = rng.integers(0, model.config.vocab_size, (2, L))
    for i, op in enumerate(model.operators(ids)):
        assert op.shape == (2, model.config.intermediate_size, L, L)
        H = np.asarray(op.materialize())
        assert np.all(np.triu(H, 1) == 0)
        y = np.einsum("bcij,bcj->bci", H, np.asarray(op.values)) + np.asarray(op.offset)
        out = np.asarray(op.output)
        assert np.abs(y - out).max() <= 1e-5 * np.abs(out).max(), f"layer {i}"
        # The conv bias and D matter: dropping them breaks exactness.
        assert np.abs(op.offset).max() > 1e-3


def test_operator_output_is_the_mixer_inner_output(pair, rng):
    """op.output times out_proj is the torch mixer output: the operator describes the real block."""
    tm, model = pair
    ids = rng.integers(0, model.config.vocab_size, (1, 9))
    _, io = torch_run(tm, ids)
    op = model.operators(ids, layers=[0])[0]
    w = np.asarray(model.layers[0].mixer.arrays()["out_proj.weight"])
    y = np.einsum("bcl,dc->bld", np.asarray(op.output), w)
    b = model.layers[0].mixer.arrays().get("out_proj.bias")
    y = y if b is None else y + np.asarray(b)
    np.testing.assert_allclose(y, io[0][1], atol=2e-5)


def float64_alpha(parts, c, D):
    """S6 matrix of channel c in float64: sum_n C_i exp(A T) dt_j B_j + D delta."""
    dt = np.asarray(parts["dt"], np.float64)[0, :, c]
    A = np.asarray(parts["A"], np.float64)[c]
    Bm = np.asarray(parts["Bm"], np.float64)[0]
    Cm = np.asarray(parts["Cm"], np.float64)[0]
    S = np.cumsum(dt)
    T = S[:, None] - S[None, :]
    L = len(dt)
    low = np.tril(np.ones((L, L), bool))
    E = np.exp(A[None, None, :] * np.where(low, T, 0)[..., None])
    al = np.einsum("in,ijn,jn->ij", Cm, E, Bm) * dt[None, :] * low
    return al + D * np.eye(L)


def test_variants_against_float64_formulas(pair, rng):
    _, model = pair
    cfg = model.config
    ids = rng.integers(0, cfg.vocab_size, (1, 12))
    x = model.mixer_inputs(ids, [0])[0]
    p = model.layers[0].mixer.arrays()
    parts = mamba.mixer_parts(p, x, cfg)
    c = 3
    D = float(p["D"][c])
    sig = 1 / (1 + np.exp(-np.asarray(parts["xc"], np.float64)[0, :, c]))
    z = np.asarray(parts["z"], np.float64)[0, :, c]
    gate = z / (1 + np.exp(-z))
    L = 12
    M = np.asarray(jnp.asarray(np.asarray(p["conv1d.weight"])[:, 0, :])[c:c + 1])
    from implicit_attn.ops import conv_matrix
    M = np.asarray(conv_matrix(M, L))[0].astype(np.float64)
    al_full = float64_alpha(parts, c, D)
    al_s6 = float64_alpha(parts, c, 0.0)
    want = {
        "full": gate[:, None] * al_full * sig[None, :] @ M,
        "s6_only": al_s6,
        "no_conv": gate[:, None] * al_full * sig[None, :],
        "no_gate": (al_full * sig[None, :]) @ M,
        "no_act": (gate[:, None] * al_full) @ M,
    }
    for v, ref in want.items():
        op = model.layers[0].mixer.as_operator(x, variant=v)
        got = np.asarray(op.materialize(channels=[c]))[0, 0]
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=v)
    # values each variant acts on
    np.testing.assert_allclose(model.layers[0].mixer.as_operator(x, "s6_only").values[0, c],
                               np.asarray(parts["u"])[0, :, c], atol=1e-6)
    np.testing.assert_allclose(model.layers[0].mixer.as_operator(x, "no_conv").values[0, c],
                               np.asarray(parts["xc"])[0, :, c], atol=1e-6)


def test_long_input_rows_match_float64():
    """L = 8192: no NaN/Inf and rows of a few channels match a float64 reference."""
    cfg = mamba.Config(vocab_size=32, hidden_size=8, state_size=8, num_hidden_layers=1, conv_kernel=4)
    params = mamba.init_params(cfg, jax.random.PRNGKey(1))
    # Larger steps than the default init: strong decays stress under/overflow.
    params["layers"][0]["mixer"]["dt_proj.bias"] = params["layers"][0]["mixer"]["dt_proj.bias"] + 2.0
    model = mamba.LM(cfg, params)
    L = 8192
    ids = np.random.default_rng(3).integers(0, 32, (1, L))
    x = model.mixer_inputs(ids, [0])[0]
    p = model.layers[0].mixer.arrays()
    op = model.layers[0].mixer.as_operator(x)
    chans = [0, 7]
    H = np.asarray(op.materialize(channels=chans))
    assert np.isfinite(H).all()
    parts = mamba.mixer_parts(p, x, cfg)
    dt = np.asarray(parts["dt"], np.float64)[0]
    A = np.asarray(parts["A"], np.float64)
    Bm = np.asarray(parts["Bm"], np.float64)[0]
    Cm = np.asarray(parts["Cm"], np.float64)[0]
    xc = np.asarray(parts["xc"], np.float64)[0]
    z = np.asarray(parts["z"], np.float64)[0]
    w = np.asarray(p["conv1d.weight"], np.float64)[:, 0, :]
    K = w.shape[1]
    for ci, c in enumerate(chans):
        S = np.cumsum(dt[:, c])
        for i in (5, 4097, L - 1):
            T = S[i] - S[:i + 1]
            row = np.einsum("n,jn,jn->j", Cm[i], np.exp(A[c][None, :] * T[:, None]), Bm[:i + 1]) * dt[:i + 1, c]
            row[i] += float(p["D"][c])
            row *= (z[i, c] / (1 + np.exp(-z[i, c]))) / (1 + np.exp(-xc[:i + 1, c]))
            full = np.zeros(L)
            full[:i + 1] = row
            # right-multiply by the conv matrix: (r M)[j] = sum_s r[j+s] w[K-1-s]
            ref = sum(np.pad(full, (0, K))[s:s + L] * w[c, K - 1 - s] for s in range(K))
            got = H[0, ci, i]
            rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert rel <= 1e-4, (c, i, rel)


def test_parallel_and_sequential_scans_agree(rng):
    B, L, C, N = 2, 33, 6, 4
    u = jnp.asarray(rng.normal(size=(B, L, C)), jnp.float32)
    dt = jnp.asarray(rng.uniform(0.01, 2.0, size=(B, L, C)), jnp.float32)
    A = -jnp.asarray(rng.uniform(0.5, 8, size=(C, N)), jnp.float32)
    Bm = jnp.asarray(rng.normal(size=(B, L, N)), jnp.float32)
    Cm = jnp.asarray(rng.normal(size=(B, L, N)), jnp.float32)
    D = jnp.asarray(rng.normal(size=(C,)), jnp.float32)
    par = mamba.selective_scan(u, dt, A, Bm, Cm, D, method="parallel")
    seq = mamba.selective_scan(u, dt, A, Bm, Cm, D, method="sequential")
    np.testing.assert_allclose(np.asarray(par), np.asarray(seq), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="scan method"):
        mamba.selective_scan(u, dt, A, Bm, Cm, D, method="fast")


# ----------------------------------------------------------------------------- residual block, input checks

def test_block_call_is_the_lm_forward_step(one, rng):
    """Chaining ``MambaBlock.__call__`` from the embeddings reproduces every captured mixer
    input and the (tapped) logits of the full forward."""
    _, model = one
    cfg = model.config
    ids = rng.integers(0, cfg.vocab_size, (2, 7))
    xs = model.mixer_inputs(ids)
    tap = jnp.asarray(rng.normal(size=(2, cfg.intermediate_size, 7)), jnp.float32)
    h = model.embeddings[...][ids]
    n = len(model.layers)
    for i, block in enumerate(model.layers):
        hn = mamba.rms_norm(h, block.norm[...], cfg.layer_norm_epsilon)
        np.testing.assert_allclose(np.asarray(hn), np.asarray(xs[i]), rtol=1e-5, atol=1e-6)
        h = block(h, tap=tap if i == n - 1 else None)
        assert h.shape == (2, 7, cfg.hidden_size)
    head = model.embeddings[...] if model.lm_head is None else model.lm_head[...]
    logits = mamba.rms_norm(h, model.norm_f[...], cfg.layer_norm_epsilon) @ head.T
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model.tapped_logits(ids, {n - 1: tap})),
                               rtol=1e-5, atol=1e-5)


def test_bad_block_tap(one):
    _, model = one
    h = np.zeros((2, 5, model.config.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"tap must have the shape of the block's operator output .* = \(2, 32, 5\)"):
        model.layers[0](h, tap=jnp.zeros((1, 32, 5)))
