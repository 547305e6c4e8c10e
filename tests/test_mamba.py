"""Mamba: logits and per-layer parity with HF torch, exactness of every operator, variants,
gradients, long inputs against float64."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import mamba
from hf_models import mamba_hf
from bad_inputs import BAD_BLOCK_INPUTS

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


@pytest.mark.parametrize("L", [1, 6, 23])
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


@pytest.mark.parametrize("L", [1, 2, 17])
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


def test_reduce_matches_materialize(one, rng):
    _, model = one
    ids = rng.integers(0, model.config.vocab_size, (2, 10))
    op = model.operators(ids, layers=[-1])[0]
    H = np.asarray(op.materialize())
    for how, f in [("mean", lambda h: h), ("abs_mean", np.abs), ("pos_mean", lambda h: np.maximum(h, 0))]:
        for bc in (None, 3):
            got = np.asarray(op.reduce(how, block_channels=bc))
            np.testing.assert_allclose(got, f(H).mean(1), rtol=1e-5, atol=1e-7)
    C = H.shape[1]
    w = rng.normal(size=(2, C, 10)).astype(np.float32)
    kw = rng.normal(size=(2, C, 10)).astype(np.float32)
    got = np.asarray(op.reduce("weighted", weights=w, key_weights=kw, block_channels=5))
    np.testing.assert_allclose(got, np.einsum("bcij,bci,bcj->bij", H, w, kw), rtol=1e-4, atol=1e-5)
    got = np.asarray(op.reduce("weighted", weights=np.arange(C, dtype=np.float32)))
    np.testing.assert_allclose(got, np.einsum("bcij,c->bij", H, np.arange(C)), rtol=1e-4, atol=1e-4)
    sub = np.asarray(op.materialize(channels=[5, 1]))
    np.testing.assert_allclose(sub, H[:, [5, 1]], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(op.reduce("mean", channels=[5, 1])), H[:, [5, 1]].mean(1),
                               rtol=1e-5, atol=1e-7)


def test_jit_vmap_grad(one, rng):
    _, model = one
    cfg = model.config
    p = model.layers[0].mixer.arrays()
    x = jnp.asarray(rng.normal(size=(1, 8, cfg.hidden_size)), jnp.float32)
    W = jnp.asarray(rng.normal(size=(1, 8, 8)), jnp.float32)

    def f(x):
        op = mamba.mixer_operator(p, x, cfg)
        return jnp.sum(op.reduce("abs_mean") * W) + jnp.sum(op.materialize(channels=[0, 2]) ** 2)

    g = jax.jit(jax.grad(f))(x)
    v = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    eps = 1e-3
    fd = (f(x + eps * v) - f(x - eps * v)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.sum(g * v)), float(fd), rtol=2e-2)
    # vmap over a batch of inputs gives the per-example operators
    xs = jnp.asarray(rng.normal(size=(3, 1, 5, cfg.hidden_size)), jnp.float32)
    red = jax.vmap(lambda x: mamba.mixer_operator(p, x, cfg).reduce("mean"))(xs)
    for k in range(3):
        np.testing.assert_allclose(red[k], mamba.mixer_operator(p, xs[k], cfg).reduce("mean"),
                                   rtol=1e-5, atol=1e-7)


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


def test_tapped_logits_give_gradients(one, rng):
    _, model = one
    ids = rng.integers(0, model.config.vocab_size, (1, 7))
    C = model.config.intermediate_size
    taps = {0: jnp.zeros((1, C, 7))}
    np.testing.assert_allclose(model.tapped_logits(ids, taps), model(ids), atol=1e-6)
    g = jax.grad(lambda t: model.tapped_logits(ids, t)[0, -1, 0])(taps)[0]
    assert g.shape == (1, C, 7) and float(jnp.abs(g).max()) > 0
    # causal: the last logit cannot depend on nothing after it, and does depend on the last position
    assert float(jnp.abs(g[:, :, -1]).max()) > 0


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


@pytest.mark.parametrize("case", list(BAD_BLOCK_INPUTS))
def test_bad_block_input(one, case):
    _, model = one
    shape, dtype, msg = BAD_BLOCK_INPUTS[case]
    x = np.zeros(shape(model.config.hidden_size), dtype)
    block = model.layers[0]
    for fn in (block.mixer.as_operator, block.mixer, block):
        with pytest.raises(ValueError, match=msg):
            fn(x)


BAD_TAPS = {  # (taps built from (B, C, L) = (2, C, 5), message); C = 32, 2 layers
    "batch_broadcast": (lambda C: {0: jnp.zeros((1, C, 5))}, "taps[0] must have the shape of layer 0's operator"),
    "channels": (lambda C: {1: jnp.zeros((2, C + 1, 5))}, "got (2, 33, 5)"),
    "length": (lambda C: {0: jnp.zeros((2, C, 4))}, "(batch, channels, length) = (2, 32, 5)"),
    "layer_range": (lambda C: {-3: jnp.zeros((2, C, 5))}, "layer -3 out of range"),
    "layer_twice": (lambda C: {0: jnp.zeros((2, C, 5)), -2: jnp.zeros((2, C, 5))}, "layer 0 given twice"),
    "integer": (lambda C: {0: jnp.zeros((2, C, 5), jnp.int32)}, "must be floating point"),
    "not_a_dict": (lambda C: [jnp.zeros((2, C, 5))], "taps must be a dict"),
}


@pytest.mark.parametrize("case", list(BAD_TAPS))
def test_bad_taps(one, case):
    _, model = one
    make, msg = BAD_TAPS[case]
    with pytest.raises(ValueError) as e:
        model.tapped_logits(np.zeros((2, 5), np.int64), make(model.config.intermediate_size))
    assert msg in str(e.value), str(e.value)


def test_negative_tap_layer_counts_from_the_end(one, rng):
    _, model = one
    ids = rng.integers(0, model.config.vocab_size, (1, 5))
    tap = jnp.asarray(rng.normal(size=(1, model.config.intermediate_size, 5)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(model.tapped_logits(ids, {-1: tap})),
                                  np.asarray(model.tapped_logits(ids, {len(model.layers) - 1: tap})))


def test_bad_block_tap(one):
    _, model = one
    h = np.zeros((2, 5, model.config.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"tap must have the shape of the block's operator output .* = \(2, 32, 5\)"):
        model.layers[0](h, tap=jnp.zeros((1, 32, 5)))
