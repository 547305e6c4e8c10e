"""Mamba-2: logits and per-layer parity with HF torch, exactness of every operator, variants,
per-head matrices, long inputs and the chunked SSD against float64, the converter's checks."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import mamba2
from implicit_attn.ops import conv_matrix
from hf_build import mamba2_hf
from weights_convert import CheckpointError, read_hf_dir, write_hf_dir

CONFIGS = {
    "g1": dict(),
    "g2_limit_bias_k3": dict(n_groups=2, time_step_limit=(0.0, 0.05), use_bias=True, conv_kernel=3),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    tm = mamba2_hf(path, **CONFIGS[request.param])
    return tm, ia.load(path), path


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One configuration (2 groups), for tests whose cost is mostly compilation; same
    shapes as a ``pair`` configuration, so compiled functions are shared."""
    path = tmp_path_factory.mktemp("one")
    tm = mamba2_hf(path, seed=3, **CONFIGS["g2_limit_bias_k3"])
    return tm, ia.load(path), path


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


# ----------------------------------------------------------------------------- float64 references

def silu64(x):
    return x / (1 + np.exp(-x))


def np_parts(p, h, cfg):
    """The mixer's intermediates in float64 numpy, written from the HF / mamba_ssm definitions."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    h = np.asarray(h, np.float64)
    m, C, G, N, K = cfg.d_mlp, cfg.d_ssm, cfg.n_groups, cfg.state_size, cfg.conv_kernel
    proj = h @ p["in_proj.weight"].T + p.get("in_proj.bias", 0.0)
    z0, x0, z = proj[..., :m], proj[..., m:2 * m], proj[..., 2 * m:2 * m + C]
    xbc = proj[..., 2 * m + C:2 * m + C + cfg.conv_dim]
    dt_in = proj[..., 2 * m + C + cfg.conv_dim:]
    w = p["conv1d.weight"][:, 0, :]
    L = h.shape[1]
    xp = np.pad(xbc, ((0, 0), (K - 1, 0), (0, 0)))
    pre = sum(xp[:, k:k + L] * w[:, k] for k in range(K)) + p.get("conv1d.bias", 0.0)
    act = silu64(pre)
    Bsz = h.shape[0]
    dt = np.clip(np.log1p(np.exp(dt_in + p["dt_bias"])), *cfg.time_step_limit)
    return dict(z0=z0, x0=x0, z=z, x=xbc[..., :C], pre=pre[..., :C], u=act[..., :C],
                Bm=act[..., C:C + G * N].reshape(Bsz, L, G, N), Cm=act[..., C + G * N:].reshape(Bsz, L, G, N),
                dt=dt, A=-np.exp(p["A_log"]), D=p["D"], w=w[:C], b=p.get("conv1d.bias", np.zeros(cfg.conv_dim))[:C],
                nw=p["norm.weight"], p=p)


def np_scan(q, cfg, v):
    """SSD by the sequential recurrence, float64: ``(B, L, C)``."""
    Bsz, L, C = v.shape
    H, P, hg = cfg.num_heads, cfg.head_dim, cfg.num_heads // cfg.n_groups
    vh = v.reshape(Bsz, L, H, P)
    g = np.arange(H) // hg
    s = np.zeros((Bsz, H, P, cfg.state_size))
    y = np.zeros_like(vh)
    for t in range(L):
        a = np.exp(q["dt"][:, t] * q["A"])  # (B, H)
        s = a[..., None, None] * s + (q["dt"][:, t][..., None] * vh[:, t])[..., None] * q["Bm"][:, t, g][:, :, None]
        y[:, t] = np.einsum("bhpn,bhn->bhp", s, q["Cm"][:, t, g]) + q["D"][:, None] * vh[:, t]
    return y.reshape(Bsz, L, C)


def np_mixer(p, h, cfg, q=None, y=None):
    """Whole mixer in float64 (incl. the optional gated-MLP part of mamba_ssm)."""
    q = np_parts(p, h, cfg) if q is None else q
    y = np_scan(q, cfg, q["u"]) if y is None else y
    gq = y * silu64(q["z"])
    B, L, C = gq.shape
    gg = gq.reshape(B, L, cfg.n_groups, -1)
    normed = (gg / np.sqrt((gg ** 2).mean(-1, keepdims=True) + cfg.layer_norm_epsilon)).reshape(B, L, C) * q["nw"]
    if cfg.d_mlp:
        normed = np.concatenate([silu64(q["z0"]) * q["x0"], normed], -1)
    return normed @ q["p"]["out_proj.weight"].T + q["p"].get("out_proj.bias", 0.0), normed[..., cfg.d_mlp:]


def np_alpha(q, cfg, b, h, with_D=True):
    """``alpha_h`` of head h in float64 ``(L, L)``."""
    g = h // (cfg.num_heads // cfg.n_groups)
    dt = q["dt"][b, :, h]
    S = np.cumsum(dt)
    L = len(dt)
    low = np.tril(np.ones((L, L), bool))
    E = np.where(low, np.exp(q["A"][h] * np.where(low, S[:, None] - S[None, :], 0)), 0)
    al = (q["Cm"][b, :, g] @ q["Bm"][b, :, g].T) * E * dt[None, :]
    return al + (q["D"][h] * np.eye(L) if with_D else 0)


def np_norm_scale(q, cfg, b, y=None):
    """``w / rms`` of the gated norm, float64 ``(L, C)`` (``y``: the SSD output if known)."""
    y = (np_scan(q, cfg, q["u"]) if y is None else y)[b]
    gq = y * silu64(q["z"][b])
    gg = gq.reshape(len(gq), cfg.n_groups, -1)
    inv = 1 / np.sqrt((gg ** 2).mean(-1, keepdims=True) + cfg.layer_norm_epsilon)
    return np.broadcast_to(inv, gg.shape).reshape(gq.shape) * q["nw"]


# ----------------------------------------------------------------------------- parity with torch

@pytest.mark.parametrize("L", [1, 19])
def test_logits_mixers_and_exact_operators(pair, rng, L):
    """Logits and every mixer match torch; every layer's operator reproduces its output
    exactly, and that output through out_proj is the torch mixer's output."""
    tm, model, _ = pair
    cfg = model.config
    ids = rng.integers(0, cfg.vocab_size, (2, L))
    ref, io = torch_run(tm, ids)
    logits = np.asarray(model(ids))
    assert logits.shape == ref.shape and logits.dtype == np.float32
    assert np.abs(logits - ref).max() <= 1e-4
    xs = model.mixer_inputs(ids)
    ops = model.operators(ids)
    for i, layer in enumerate(model.layers):
        tin, tout = io[i]
        np.testing.assert_allclose(np.asarray(xs[i]), tin, atol=1e-5)
        np.testing.assert_allclose(np.asarray(layer.mixer(tin)), tout, atol=1e-5)
        op = ops[i]
        assert op.shape == (2, cfg.num_heads * cfg.head_dim, L, L)
        H = np.asarray(op.materialize())
        assert np.all(np.triu(H, 1) == 0)
        y = np.einsum("bcij,bcj->bci", H, np.asarray(op.values)) + np.asarray(op.offset)
        out = np.asarray(op.output)
        assert np.abs(y - out).max() <= 1e-5 * np.abs(out).max(), f"layer {i}"
        assert np.abs(op.offset).max() > 1e-3  # the conv bias matters
        p = layer.mixer.arrays()
        yt = np.einsum("bcl,dc->bld", out, np.asarray(p["out_proj.weight"])) + np.asarray(p.get("out_proj.bias", 0.0))
        np.testing.assert_allclose(yt, tout, atol=2e-5)


def test_variants_against_float64_formulas(one, rng):
    _, model, _ = one
    cfg = model.config
    L = 19
    ids = rng.integers(0, cfg.vocab_size, (2, L))
    x = model.mixer_inputs(ids, [1])[1]
    p = model.layers[1].mixer.arrays()
    q = np_parts(p, x, cfg)
    b, c = 1, cfg.head_dim + 3  # a channel of head 1
    h = c // cfg.head_dim

    @jax.jit
    def run(p, x):  # all variants in one compilation
        out = {}
        for v in mamba2.VARIANTS:
            op = mamba2.mixer_operator(p, x, cfg, v)
            out[v] = dict(H=op.materialize(channels=[c])[b, 0], values=op.values[b, c], offset=op.offset[b, c],
                          err=jnp.abs(op.apply() - op.output).max() / jnp.abs(op.output).max())
        return out

    got = jax.tree_util.tree_map(np.asarray, run(p, x))
    M = np.asarray(conv_matrix(jnp.asarray(q["w"][c:c + 1]), L), np.float64)[0]
    al, al0 = np_alpha(q, cfg, b, h), np_alpha(q, cfg, b, h, with_D=False)
    gate = silu64(q["z"][b, :, c])
    norm = np_norm_scale(q, cfg, b)[:, c]
    sig = 1 / (1 + np.exp(-q["pre"][b, :, c]))
    want = {
        "full": ((norm * gate)[:, None] * al * sig[None, :]) @ M,
        "s6_only": al0,
        "no_conv": (norm * gate)[:, None] * al * sig[None, :],
        "no_gate": (norm[:, None] * al * sig[None, :]) @ M,
        "no_norm": (gate[:, None] * al * sig[None, :]) @ M,
        "no_act": ((norm * gate)[:, None] * al) @ M,
    }
    values = {"s6_only": q["u"], "no_conv": q["pre"]}
    bvec = np.full(L, q["b"][c])
    offsets = {"no_act": (norm * gate) * (al @ bvec), "full": (norm * gate) * (al @ (sig * bvec)),
               "no_gate": norm * (al @ (sig * bvec)), "no_norm": gate * (al @ (sig * bvec))}
    assert set(want) == set(mamba2.VARIANTS)
    for v, ref in want.items():
        g = got[v]
        np.testing.assert_allclose(g["H"], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=v)
        np.testing.assert_allclose(g["values"], values.get(v, q["x"])[b, :, c], rtol=1e-5, atol=1e-5, err_msg=v)
        # offsets: the same factors applied to the conv bias (none without a conv)
        np.testing.assert_allclose(g["offset"], offsets.get(v, np.zeros(L)), rtol=1e-4, atol=1e-6, err_msg=v)
        # only "full" and "no_conv" reproduce the block's output
        assert (g["err"] <= 1e-5) == (v in ("full", "no_conv")), (v, g["err"])


# ----------------------------------------------------------------------------- per-head matrices

def test_head_matrices(one, rng):
    _, model, _ = one
    cfg = model.config
    L = 19
    ids = rng.integers(0, cfg.vocab_size, (2, L))
    x = model.mixer_inputs(ids, [1])[1]
    p = model.layers[1].mixer.arrays()
    q = np_parts(p, x, cfg)
    variants = ("full", "no_act", "s6_only", "no_conv")

    @jax.jit
    def run(p, x):
        out = {}
        for v in variants:
            op = mamba2.mixer_operator(p, x, cfg, v)
            out[v] = (op.head_matrices("alpha"), op.head_matrices("mean"), op.materialize(),
                      op.head_matrices("mean", heads=[3, 0]))
        return out

    got = jax.tree_util.tree_map(np.asarray, run(p, x))
    for v in variants:
        A, mean, H, sub = got[v]
        assert A.shape == (2, cfg.num_heads, L, L)
        for b in range(2):
            for h in range(cfg.num_heads):
                ref = np_alpha(q, cfg, b, h, with_D=v != "s6_only")
                np.testing.assert_allclose(A[b, h], ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())
        Hd = H.reshape(2, cfg.num_heads, cfg.head_dim, L, L)
        np.testing.assert_allclose(mean, Hd.mean(2), rtol=1e-4, atol=1e-6 * np.abs(Hd).max(), err_msg=v)
        np.testing.assert_allclose(sub, mean[:, [3, 0]], rtol=1e-5, atol=1e-7)
    op = model.layers[1].mixer.as_operator(x)
    np.testing.assert_allclose(np.asarray(mamba2.head_matrices(op, "alpha", heads=-1)), got["full"][0][:, -1:],
                               rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="how must be"):
        op.head_matrices("max")
    with pytest.raises(ValueError, match="heads must be"):
        op.head_matrices(heads=[cfg.num_heads])


# ----------------------------------------------------------------------------- SSD, long inputs, d_mlp

def test_ssd_any_chunk_matches_float64_recurrence(rng):
    Bsz, H, P, G, N = 2, 4, 3, 2, 5
    run = jax.jit(mamba2.ssd, static_argnums=5)
    for L, chunk in [(1, 4), (16, 4), (23, 8)]:
        x = rng.normal(size=(Bsz, L, H, P)).astype(np.float32)
        dt = rng.uniform(0.01, 1.0, (Bsz, L, H)).astype(np.float32)
        A = -rng.uniform(0.5, 4.0, H).astype(np.float32)
        Bm, Cm = (rng.normal(size=(Bsz, L, G, N)).astype(np.float32) for _ in range(2))
        D = rng.normal(size=H).astype(np.float32)
        got = np.asarray(run(x, dt, A, Bm, Cm, chunk, D))
        cfg = mamba2.Config(vocab_size=2, hidden_size=H * P, num_heads=H, head_dim=P, state_size=N,
                            n_groups=G, expand=1)
        q = dict(dt=dt.astype(np.float64), A=A.astype(np.float64), Bm=Bm.astype(np.float64),
                 Cm=Cm.astype(np.float64), D=D.astype(np.float64))
        ref = np_scan(q, cfg, x.reshape(Bsz, L, H * P).astype(np.float64)).reshape(got.shape)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=f"L={L}")


def test_long_input_rows_match_float64():
    """L = 8192: operator and output finite; operator rows and the block output match float64."""
    cfg = mamba2.Config(vocab_size=32, hidden_size=8, num_heads=2, head_dim=8, state_size=8, n_groups=1,
                        expand=2, chunk_size=256)
    params = mamba2.init_params(cfg, jax.random.PRNGKey(1))
    # Larger steps than the default init: strong decays stress under/overflow.
    params["layers"][0]["mixer"]["dt_bias"] = params["layers"][0]["mixer"]["dt_bias"] + 2.0
    mixer = mamba2.Mamba2Mixer(cfg, params["layers"][0]["mixer"])
    L = 8192
    x = np.random.default_rng(3).normal(size=(1, L, cfg.hidden_size)).astype(np.float32)  # unit RMS, as after the pre-norm
    p = mixer.arrays()
    op = mixer.as_operator(x)
    chans = [0, 13]
    H = np.asarray(op.materialize(channels=chans))
    assert np.isfinite(H).all() and np.isfinite(np.asarray(op.output)).all()
    q = np_parts(p, x, cfg)
    y = np_scan(q, cfg, q["u"])
    _, normed = np_mixer(p, x, cfg, q, y)
    np.testing.assert_allclose(np.asarray(op.output)[0].T, normed[0], rtol=1e-4, atol=1e-4 * np.abs(normed).max())
    norm = np_norm_scale(q, cfg, 0, y)
    dt = q["dt"][0]
    Kc = cfg.conv_kernel
    for ci, c in enumerate(chans):
        h = c // cfg.head_dim
        S = np.cumsum(dt[:, h])
        for i in (5, 4097, L - 1):
            row = q["Bm"][0, :i + 1, 0] @ q["Cm"][0, i, 0]
            row = row * np.exp(q["A"][h] * (S[i] - S[:i + 1])) * dt[:i + 1, h]
            row[i] += q["D"][h]
            row *= norm[i, c] * silu64(q["z"][0, i, c]) / (1 + np.exp(-q["pre"][0, :i + 1, c]))
            full = np.zeros(L)
            full[:i + 1] = row
            ref = sum(np.pad(full, (0, Kc))[s:s + L] * q["w"][c, Kc - 1 - s] for s in range(Kc))
            rel = np.linalg.norm(H[0, ci, i] - ref) / np.linalg.norm(ref)
            assert rel <= 1e-4, (c, i, rel)


def test_mlp_part_and_float64_mixer(rng):
    """num_heads * head_dim < expand * hidden_size: mamba_ssm's extra gated MLP in in_proj."""
    cfg = mamba2.Config(vocab_size=16, hidden_size=12, num_heads=2, head_dim=8, state_size=4, n_groups=2,
                        expand=2, chunk_size=4, use_bias=True)
    assert cfg.d_mlp == 8 and cfg.proj_size == 2 * 8 + 16 + (16 + 16) + 2
    params = mamba2.init_params(cfg, jax.random.PRNGKey(0))
    model = mamba2.LM(cfg, params)
    x = rng.normal(size=(2, 9, 12)).astype(np.float32)
    p = model.layers[0].mixer.arrays()
    ref, normed = np_mixer(p, x, cfg)
    np.testing.assert_allclose(np.asarray(model.layers[0].mixer(x)), ref, rtol=1e-4, atol=1e-5)
    op = model.layers[0].mixer.as_operator(x)
    assert op.shape == (2, 16, 9, 9)
    np.testing.assert_allclose(np.asarray(op.output), normed.transpose(0, 2, 1), rtol=1e-4, atol=1e-5)
    assert op.relative_error() <= 1e-5


# ----------------------------------------------------------------------------- jit, grad, taps

# ----------------------------------------------------------------------------- converter, bad input

def _broken(src, dst, config=None, drop=(), add=None, reshape=None):
    config_, tensors = read_hf_dir(src)
    config_.update(config or {})
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    tensors.update(add or {})
    for k, shape in (reshape or {}).items():
        tensors[k] = np.zeros(shape, tensors[k].dtype)
    write_hf_dir(dst, config_, tensors)
    return dst


def test_converter_errors(one, tmp_path):
    _, _, src = one
    m = "backbone.layers.1.mixer."
    cases = [
        (dict(drop=[m + "D"]), "missing tensors: " + m + "D"),
        (dict(add={m + "extra": np.zeros(3, np.float32)}), "unexpected tensors: " + m + "extra"),
        (dict(reshape={m + "conv1d.weight": (5, 1, 4)}), "conv1d.weight has shape"),
        # same num_heads * head_dim (32) as the tensors but 8 heads: A_log/D/dt_bias/in_proj disagree
        (dict(config=dict(num_heads=8, head_dim=4)), "A_log has shape (4,), expected (8,)"),
        (dict(config=dict(num_heads=8, head_dim=8)), "exceeds expand * hidden_size"),
        (dict(config=dict(n_groups=3)), "multiple of n_groups"),
        (dict(config=dict(hidden_act="gelu")), "hidden_act"),
        (dict(drop=["lm_head.weight"]), "missing tensors: lm_head.weight"),
    ]
    for k, (kw, msg) in enumerate(cases):
        path = _broken(src, tmp_path / f"b{k}", **kw)
        with pytest.raises(CheckpointError) as e:
            ia.load(path)
        assert msg in str(e.value), (kw, str(e.value))
    # tied config with a different stored head: transformers 5.23 uses the stored head, so do
    # we, with a warning (checked against HF in test_convert.py)
    with pytest.warns(UserWarning):
        tied = ia.load(_broken(src, tmp_path / "tied", config=dict(tie_word_embeddings=True)))
    assert tied.lm_head is not None
    assert json.loads((tmp_path / "tied" / "config.json").read_text())["tie_word_embeddings"] is True


def test_bad_inputs(one):
    _, model, _ = one
    cfg = model.config
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(np.array([[0, cfg.vocab_size]]))
    with pytest.raises(ValueError, match="batch, length"):
        model(np.array([1, 2]))
    with pytest.raises(ValueError, match="mixer input must have shape"):
        model.layers[0].mixer.as_operator(np.zeros((1, 4, cfg.hidden_size + 1), np.float32))
    with pytest.raises(ValueError, match="variant must be one of"):
        model.layers[0].mixer.as_operator(np.zeros((1, 4, cfg.hidden_size), np.float32), "no_softmax")
    with pytest.raises(ValueError, match="variant must be one of"):
        model.operators(np.array([[1, 2]]), variant="bogus")
    with pytest.raises(ValueError, match="out of range"):
        model.operators(np.array([[1, 2]]), layers=[5])
    with pytest.raises(ValueError, match="time_step_limit"):
        mamba2.Config(vocab_size=4, hidden_size=4, num_heads=1, head_dim=8, time_step_limit=(1.0, 0.5))


# ----------------------------------------------------------------------------- per-head reuse in dense

@jax.jit
def _dense_per_channel(core, idx):
    """Reference: ``alpha`` recomputed for every channel (the formula, no reuse)."""
    from implicit_attn.ops import conv_right

    H = core.alpha(core.head[idx])
    H = jnp.take(core.left, idx, axis=1)[..., :, None] * H * jnp.take(core.right, idx, axis=1)[..., None, :]
    return conv_right(H, jnp.take(core.conv_w, idx, axis=0))


DENSE_LISTS = [list(range(5, 13)),           # contiguous over heads 0, 1 (traced: fast path)
               [12, 11, 3, 9, 8, 7, 4, 10],  # the same heads, out of order
               [0, 9, 25, 31, 16, 1, 2, 3],  # 4 heads in 8 channels: traced fallback
               [31, 0, 31, 16, 1, 2, 2, 9]]  # duplicates, 3 heads: traced fallback


def _core(model, rng, L=19):
    ids = rng.integers(0, model.config.vocab_size, (2, L))
    return model.operators(ids, layers=[-1])[0].core  # 4 heads of 8 channels


def test_dense_reuses_alpha_per_head_traced_with_grad(one, rng):
    """``dense`` computes alpha once per distinct head and gathers it: for traced channel lists
    (contiguous, out of order, scattered over more heads than the fast path holds,
    duplicated) the same numbers and gradients as one alpha per channel."""
    _, model, _ = one
    core = _core(model, rng)

    def fwd_bwd(fn):  # dense of a traced channel list and its vjp w.r.t. log_a, one compilation
        def run(lg, idx, W):
            out, vjp = jax.vjp(lambda lg: fn(dataclasses.replace(core, log_a=lg), idx), lg)
            return out, vjp(W)[0]
        return jax.jit(run)

    ours, refs = fwd_bwd(lambda c, i: c.dense(i)), fwd_bwd(_dense_per_channel)
    for idx in jnp.asarray(DENSE_LISTS):
        W = jnp.asarray(rng.normal(size=(2, 8, 19, 19)), jnp.float32)
        (H, g), (H_ref, g_ref) = ours(core.log_a, idx, W), refs(core.log_a, idx, W)
        H_ref, g_ref = np.asarray(H_ref), np.asarray(g_ref)
        np.testing.assert_allclose(np.asarray(H), H_ref, rtol=1e-6, atol=1e-7, err_msg=str(idx))
        np.testing.assert_allclose(np.asarray(g), g_ref, rtol=1e-5, atol=1e-6 * np.abs(g_ref).max())
        assert np.abs(g_ref).max() > 0


def test_dense_reuses_alpha_per_head_concrete_and_vmapped(one, rng):
    """The same for a concrete channel list (distinct heads found exactly) and vmapped over
    channel lists (the fallback's cond becomes a select)."""
    _, model, _ = one
    core = _core(model, rng)
    ref = np.asarray(_dense_per_channel(core, jnp.arange(32)))
    lists = jnp.asarray(DENSE_LISTS)
    np.testing.assert_allclose(np.asarray(core.dense(lists[3])), ref[:, lists[3]], rtol=1e-6, atol=1e-7)
    got = np.asarray(jax.jit(jax.vmap(core.dense))(lists))
    for k in range(lists.shape[0]):
        np.testing.assert_allclose(got[k], ref[:, lists[k]], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- residual block, input checks

def test_block_call_is_the_lm_forward_step(one, rng):
    """Chaining ``Mamba2Block.__call__`` from the embeddings reproduces every captured mixer
    input and the (tapped) logits of the full forward."""
    _, model, _ = one
    cfg = model.config
    ids = rng.integers(0, cfg.vocab_size, (2, 7))
    xs = model.mixer_inputs(ids)
    tap = jnp.asarray(rng.normal(size=(2, cfg.d_ssm, 7)), jnp.float32)
    h = model.embeddings[...][ids]
    n = len(model.layers)
    for i, block in enumerate(model.layers):
        hn = mamba2.block.rms_norm(h, block.norm[...], cfg.layer_norm_epsilon)
        np.testing.assert_allclose(np.asarray(hn), np.asarray(xs[i]), rtol=1e-5, atol=1e-6)
        h = block(h, tap=tap if i == n - 1 else None)
        assert h.shape == (2, 7, cfg.hidden_size)
    logits = mamba2.block.rms_norm(h, model.norm_f[...], cfg.layer_norm_epsilon) @ model.lm_head[...].T
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model.tapped_logits(ids, {n - 1: tap})),
                               rtol=1e-5, atol=1e-5)


def test_bad_block_tap(one):
    _, model, _ = one
    h = np.zeros((2, 5, model.config.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"tap must have the shape of the block's operator output .* = \(2, 32, 5\)"):
        model.layers[0](h, tap=jnp.zeros((1, 32, 5)))
