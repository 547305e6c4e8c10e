"""Griffin / RecurrentGemma: logits and per-block parity with HF torch, exactness of the
recurrent and attention operators (against float64 numpy formulas), packed documents,
long inputs, converter round trip and bad input."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.operator import AttentionOperator
from implicit_attn.families import griffin
from implicit_attn.operator import ImplicitOperator
from weights_convert import CheckpointError, read_hf_dir, write_hf_dir
from hf_build import griffin_hf

CONFIGS = {
    # multi-query, tied, window 5 < L
    "mqa_tied": dict(),
    # grouped kv heads, untied head, q/k/v biases, attention first, conv width 3, full rotary
    "gqa_untied": dict(num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True,
                       block_types=["attention", "recurrent"], num_hidden_layers=3, conv1d_width=3,
                       partial_rotary_factor=1.0, attention_window_size=4),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    tm = griffin_hf(path, **CONFIGS[request.param])
    return tm, ia.load(path), path


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    path = tmp_path_factory.mktemp("one")
    tm = griffin_hf(path)
    return tm, ia.load(path), path


_dense_all = jax.jit(lambda op: op.materialize())
_dense_some = jax.jit(lambda op, idx: op.materialize(idx))


_reduce = jax.jit(lambda op, how, bc, w=None, kw=None: op.reduce(how, w, kw, block_channels=bc),
                  static_argnums=(1, 2))


_apply = jax.jit(lambda op: op.apply())


def rel_error(op):
    """``op.relative_error()`` computed under jit."""
    return float(jnp.abs(_apply(op) - op.output).max() / jnp.abs(op.output).max())


def dense(op, channels=None):
    """``op.materialize`` under jit (one compilation instead of many eager ones)."""
    if channels is None:
        return np.asarray(_dense_all(op))
    return np.asarray(_dense_some(op, jnp.asarray(channels)))


def torch_run(tm, ids, pos=None):
    """Logits and (input, output) of every temporal block of the torch model."""
    import torch

    io = {}
    hooks = [layer.temporal_block.register_forward_hook(
        lambda mod, inp, out, i=i: io.__setitem__(i, (inp[0].numpy().copy(), out[0].numpy().copy())))
        for i, layer in enumerate(tm.model.layers)]
    kw = {} if pos is None else {"position_ids": torch.tensor(pos)}
    with torch.no_grad():
        logits = tm(torch.tensor(ids), use_cache=False, **kw).logits.numpy()
    for h in hooks:
        h.remove()
    return logits, io


# ----------------------------------------------------------------------------- float64 references

def np_recurrent(p, h, pos, cfg):
    """Float64 numpy RG-LRU block pieces from the raw parameters (independent of the library)."""
    P = {k: np.asarray(v, np.float64) for k, v in p.items()}
    h = np.asarray(h, np.float64)
    B, L, _ = h.shape
    x = h @ P["linear_x.weight"].T + P["linear_x.bias"]
    yp = h @ P["linear_y.weight"].T + P["linear_y.bias"]
    y = 0.5 * yp * (1 + np.tanh(np.sqrt(2 / np.pi) * (yp + 0.044715 * yp ** 3)))
    w = P["conv_1d.weight"][:, 0, :]
    K = w.shape[1]
    seg = np.cumsum(pos == 0, axis=1)
    xc = np.broadcast_to(P["conv_1d.bias"], x.shape).copy()
    for s in range(K):  # tap s looks back s steps
        ok = np.zeros((B, L), bool)
        ok[:, s:] = seg[:, s:] == seg[:, :L - s]
        xs = np.zeros_like(x)
        xs[:, s:] = x[:, :L - s]
        xc += np.where(ok[..., None], xs, 0) * w[:, K - 1 - s]
    H = cfg.num_attention_heads
    xh = xc.reshape(B, L, H, -1)
    gate = lambda wn, bn: 1 / (1 + np.exp(-(np.einsum("blhi,hij->blhj", xh, P[wn]) + P[bn]).reshape(B, L, -1)))
    gi = gate("rg_lru.input_gate_weight", "rg_lru.input_gate_bias")
    gr = gate("rg_lru.recurrent_gate_weight", "rg_lru.recurrent_gate_bias")
    log_a = -8.0 * gr * np.log1p(np.exp(P["rg_lru.recurrent_param"]))
    reset = (pos == 0)[..., None]
    a = np.where(reset, 0.0, np.exp(log_a))
    mult = np.where(reset, 1.0, np.sqrt(1 - np.exp(2 * log_a)))
    return dict(x=x, y=y, xc=xc, a=a, mult=mult, gi=gi, w=w, seg=seg)


def np_decay_row(a, i):
    """``r[j] = prod_{k=j+1..i} a[k]`` for j <= i (float64), length i + 1."""
    r = np.ones(i + 1)
    if i > 0:
        r[:i] = np.cumprod(a[i:0:-1])[::-1]
    return r


def np_conv_right(row, w, seg, i):
    """``(row M)[j]`` with the document-masked conv matrix: ``M[j', j] = w[K-1-(j'-j)]``."""
    L, K = len(seg), len(w)
    full = np.zeros(L + K)
    full[:len(row)] = row
    out = sum(full[s:s + L] * w[K - 1 - s] * (np.roll(seg, -s)[:L] == seg) for s in range(K))
    return np.where(seg == seg[i], out, 0.0) if len(row) else out


def np_operator_rows(r, b, c, rows, variant="full"):
    """Rows ``rows`` of the float64 operator of channel c, batch b."""
    L = r["x"].shape[1]
    out = []
    for i in rows:
        A = np_decay_row(r["a"][b, :, c], i) * (r["mult"] * r["gi"])[b, :i + 1, c]
        if variant != "no_gate":
            A = A * r["y"][b, i, c]
        if variant == "no_conv":
            full = np.zeros(L)
            full[:i + 1] = A
            out.append(full)
        else:
            out.append(np_conv_right(A, r["w"][c], r["seg"][b], i))
    return np.stack(out)


# ----------------------------------------------------------------------------- parity with torch

# One length shorter than every window and one longer; the same shapes are reused below
# so that compiled functions are shared between tests.
LENGTHS = [1, 13]


@pytest.mark.parametrize("L", LENGTHS)
def test_logits_and_blocks_match_torch(pair, rng, L):
    tm, model, _ = pair
    ids = rng.integers(0, model.config.vocab_size, (2, L))
    ref, io = torch_run(tm, ids)
    logits = np.asarray(model(ids))
    assert logits.shape == ref.shape and logits.dtype == np.float32
    assert np.abs(logits - ref).max() <= 1e-4
    xs = model.mixer_inputs(ids)
    for i, layer in enumerate(model.layers):
        tin, tout = io[i]
        np.testing.assert_allclose(np.asarray(xs[i]), tin, atol=1e-5)
        np.testing.assert_allclose(np.asarray(layer.temporal_block(tin)), tout, atol=1e-5)
    assert np.abs(ref).max() > 1.0  # the soft cap acts on non-trivial logits


def test_layer_types_follow_block_types(pair):
    tm, model, _ = pair
    kinds = [type(l.temporal_block).__name__ for l in tm.model.layers]
    ours = [l.temporal_block.kind for l in model.layers]
    assert ours == ["recurrent" if k.endswith("RecurrentBlock") else "attention" for k in kinds]
    assert set(ours) == {"recurrent", "attention"}
    # the embedding scale is sqrt(hidden_size) rounded to bfloat16, as torch's buffer
    assert float(griffin.block.embed_scale(model.config, jnp.float32)) == float(tm.model.normalizer.float())
    big = griffin.Config(vocab_size=8, hidden_size=2560, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=10)
    assert float(griffin.block.embed_scale(big, jnp.float32)) == 50.5  # sqrt(2560) = 50.596...


# ----------------------------------------------------------------------------- operators

@pytest.mark.parametrize("L", LENGTHS)
def test_every_operator_is_exact_and_is_the_real_block(pair, rng, L):
    tm, model, _ = pair
    cfg = model.config
    ids = rng.integers(0, cfg.vocab_size, (2, L))
    _, io = torch_run(tm, ids)
    ops = model.operators(ids)
    assert len(ops) == cfg.num_hidden_layers
    for i, (op, layer) in enumerate(zip(ops, model.layers)):
        p = layer.temporal_block.arrays()
        H = dense(op)
        assert np.all(np.triu(H, 1) == 0), f"layer {i}"
        if layer.temporal_block.kind == "recurrent":
            assert isinstance(op, ImplicitOperator) and op.shape == (2, cfg.lru_width, L, L)
            y = np.einsum("bcij,bcj->bci", H, np.asarray(op.values)) + np.asarray(op.offset)
            out = np.asarray(op.output)
            assert np.abs(y - out).max() <= 1e-5 * np.abs(out).max(), f"layer {i}"
            assert np.abs(op.offset).max() > 1e-2  # the conv bias counts
            block = np.einsum("bcl,dc->bld", out, np.asarray(p["linear_out.weight"])) + np.asarray(p["linear_out.bias"])
        else:
            assert isinstance(op, AttentionOperator)
            assert op.shape == (2, cfg.num_attention_heads, L, L)
            assert op.values.shape == (2, cfg.num_attention_heads, L, cfg.head_dim)
            np.testing.assert_allclose(H.sum(-1), 1.0, atol=1e-6)
            far = np.tril(np.ones((L, L), bool), -cfg.attention_window_size)
            assert np.all(H[..., far] == 0)  # outside the window
            y = np.einsum("bhij,bhjd->bhid", H, np.asarray(op.values))
            out = np.asarray(op.output)
            assert np.abs(y - out).max() <= 1e-5 * np.abs(out).max()
            o = np.swapaxes(out, 1, 2).reshape(2, L, -1)
            block = o @ np.asarray(p["o_proj.weight"]).T + np.asarray(p["o_proj.bias"])
        # the operator's output, through the block's output projection, is the torch block output
        np.testing.assert_allclose(block, io[i][1], atol=2e-5, err_msg=f"layer {i}")


def test_recurrent_variants_against_float64(one, rng):
    _, model, _ = one
    cfg = model.config
    L = 13
    ids = rng.integers(0, cfg.vocab_size, (2, L))
    x = model.mixer_inputs(ids)[0]
    blk = model.layers[0].temporal_block
    r = np_recurrent(blk.arrays(), x, np.broadcast_to(np.arange(L), (2, L)), cfg)
    for variant in griffin.VARIANTS:
        op = blk.as_operator(x, variant=variant)
        H = dense(op, [3, 17])
        for b, k, c in [(0, 0, 3), (1, 1, 17)]:
            ref = np_operator_rows(r, b, c, range(L), variant)
            np.testing.assert_allclose(H[b, k], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=variant)
        if variant == "full":
            np.testing.assert_allclose(np.asarray(op.values), np.swapaxes(r["x"], 1, 2), rtol=1e-5, atol=1e-5)
        if variant == "no_conv":  # acts on the conv output, and is exact too (the bias is inside xc)
            np.testing.assert_allclose(np.asarray(op.values), np.swapaxes(r["xc"], 1, 2), rtol=1e-5, atol=1e-5)
        rel = rel_error(op)
        assert (rel <= 1e-5) if variant != "no_gate" else (rel > 1e-2), (variant, rel)


def _packed(rng, V):
    """Two rows of L = 13 with a document boundary inside each (5 + 8 and 8 + 5 tokens)."""
    pos = np.array([list(range(5)) + list(range(8)), list(range(8)) + list(range(5))])
    return rng.integers(0, V, pos.shape), pos


# ----------------------------------------------------------------------------- documents

def test_packed_documents_are_isolated(one, rng):
    """Every entry across a boundary is exactly 0, and each document's logits, operator
    blocks and operator outputs equal running it alone. By causality the first n outputs
    of a document followed by filler tokens are the document run alone, so every run has
    the same shape (2, 13) as the unpacked tests and reuses their compilations."""
    _, model, _ = one
    V = model.config.vocab_size
    ids, pos = _packed(rng, V)
    seg = np.cumsum(pos == 0, axis=1) - 1
    logits = np.asarray(model(ids, segment_pos=pos))
    ops = model.operators(ids, segment_pos=pos)
    Hs = [dense(op) for op in ops]
    cross = seg[:, :, None] != seg[:, None, :]
    for op, H in zip(ops, Hs):
        assert np.all(H[np.broadcast_to(cross[:, None], H.shape)] == 0)
        assert rel_error(op) <= 1e-5
    for s in (0, 1):  # first documents of both rows, then second documents
        alone = rng.integers(0, V, ids.shape)
        spans = [np.flatnonzero(seg[b] == s) for b in range(2)]
        for b, t in enumerate(spans):
            alone[b, :len(t)] = ids[b, t]
        ref = np.asarray(model(alone))
        ref_ops = model.operators(alone)
        for b, t in enumerate(spans):
            n = len(t)
            np.testing.assert_allclose(logits[b, t], ref[b, :n], atol=1e-5)
            for op, H, op1 in zip(ops, Hs, ref_ops):
                H1 = dense(op1)[b, :, :n, :n]
                np.testing.assert_allclose(H[b][:, t][:, :, t], H1, atol=1e-6)
                np.testing.assert_allclose(np.asarray(op.output)[b][:, t], np.asarray(op1.output)[b][:, :n], atol=1e-5)


def test_packed_positions_match_torch_where_its_conv_cannot_leak(tmp_path, rng):
    """HF's conv mixes the last K-1 tokens of the previous document in (DeepMind's Griffin
    and this library do not); with a width-1 conv there is nothing to leak, and then torch's
    packed handling (recurrence reset, attention document mask, restarted rotary
    positions) must agree with ours."""
    tm = griffin_hf(tmp_path, conv1d_width=1)
    model = ia.load(tmp_path)
    ids, pos = _packed(rng, model.config.vocab_size)
    ref, _ = torch_run(tm, ids, pos)
    assert np.abs(np.asarray(model(ids, segment_pos=pos)) - ref).max() <= 1e-4
    # and without position ids torch does not isolate the documents: the test can fail
    ref_flat, _ = torch_run(tm, ids)
    assert np.abs(ref_flat[0, 5:] - ref[0, 5:]).max() > 1e-2


def test_head_dim_given_apart_from_the_width_matches_torch(tmp_path, rng):
    """HF derives ``head_dim`` as ``hidden_size // num_attention_heads`` and then sets the value
    config.json gives: heads of 12 at width 32 (before 2026-12-02 the load failed on tensor
    shapes). The local attention's operator stays exact."""
    tm = griffin_hf(tmp_path, head_dim=12)
    model = ia.load(tmp_path)
    assert model.config.head_dim == 12 and tm.config.head_dim == 12
    ids = rng.integers(0, model.config.vocab_size, (2, 13))
    ref, _ = torch_run(tm, ids)
    assert np.abs(np.asarray(model(ids)) - ref).max() <= 1e-4
    assert max(op.relative_error() for op in model.operators(ids)) <= 1e-5


def test_packed_recurrent_operator_against_float64(one, rng):
    _, model, _ = one
    ids, pos = _packed(rng, model.config.vocab_size)
    x = model.mixer_inputs(ids, segment_pos=pos)[1]
    blk = model.layers[1].temporal_block
    r = np_recurrent(blk.arrays(), x, pos, model.config)
    H = dense(blk.as_operator(x, segment_pos=pos), [2, 20])
    for b, k, c in [(0, 0, 2), (1, 1, 20)]:
        ref = np_operator_rows(r, b, c, range(pos.shape[1]))
        np.testing.assert_allclose(H[b, k], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


# ----------------------------------------------------------------------------- long inputs

def np_attention_row(p, h, pos, cfg, head, i):
    """Float64 softmax row ``i`` of ``head`` (rotary, window, documents) from raw parameters."""
    P = {k: np.asarray(v, np.float64) for k, v in p.items()}
    h = np.asarray(h, np.float64)[0]
    d, R = cfg.head_dim, cfg.rotary_dim
    kvh = head // (cfg.num_attention_heads // cfg.num_key_value_heads)
    q = (h[i] @ P["q_proj.weight"].T).reshape(-1, d)[head]
    k = (h @ P["k_proj.weight"].T).reshape(h.shape[0], -1, d)[:, kvh]
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, R, 2) / R)

    def rope(v, p_):
        ang = np.concatenate([p_[..., None] * inv] * 2, -1)
        vr = v[..., :R]
        rot = np.concatenate([-vr[..., R // 2:], vr[..., :R // 2]], -1)
        return np.concatenate([vr * np.cos(ang) + rot * np.sin(ang), v[..., R:]], -1)

    pos = pos[0].astype(np.float64)
    q, k = rope(q, pos[i]), rope(k, pos)
    seg = np.cumsum(pos == 0)
    j = np.arange(len(pos))
    ok = (j <= i) & (i - j < cfg.attention_window_size) & (seg == seg[i])
    s = np.where(ok, k @ q * d ** -0.5, -np.inf)
    e = np.exp(s - s.max())
    return e / e.sum()


def test_long_input_rows_match_float64():
    """L = 8192 with strong decays and a document start inside: no NaN/Inf, rows of the
    recurrent operator and of the attention probabilities match float64."""
    cfg = griffin.Config(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, lru_width=8,
                         attention_window_size=2048, block_types=("recurrent", "attention"))
    params = griffin.init_params(cfg, jax.random.PRNGKey(1))
    # softplus(Lambda) ~ 2 for half the channels: decays down to exp(-16) per step
    lam = np.asarray(params["layers"][0]["temporal_block"]["rg_lru.recurrent_param"]).copy()
    lam[::2] = 2.0
    params["layers"][0]["temporal_block"]["rg_lru.recurrent_param"] = jnp.asarray(lam)
    model = griffin.LM(cfg, params)
    L, cut = 8192, 5000
    ids = np.random.default_rng(3).integers(0, 32, (1, L))
    pos = np.concatenate([np.arange(cut), np.arange(L - cut)])[None]
    xs = model.mixer_inputs(ids, segment_pos=pos)
    blk = model.layers[0].temporal_block
    op = blk.as_operator(xs[0], segment_pos=pos)
    r = np_recurrent(blk.arrays(), xs[0], pos, cfg)
    rows = (5, 4097, cut + 2, L - 1)
    H = dense(op, [0, 5])[0]  # channel 0: strong decay; channel 5: the init's slow decay
    assert np.isfinite(H).all()
    assert np.all(H[:, cut:, :cut] == 0)
    for k, c in enumerate((0, 5)):
        ref = np_operator_rows(r, 0, c, rows)
        for got, want, i in zip(H[k][list(rows)], ref, rows):
            rel = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert rel <= 1e-4, (c, i, rel)
        y = H[k] @ np.asarray(op.values)[0, c] + np.asarray(op.offset)[0, c]
        out = np.asarray(op.output)[0, c]
        assert np.abs(y - out).max() <= 1e-4 * np.abs(out).max()
    del H
    att = model.layers[1].temporal_block.as_operator(xs[1], segment_pos=pos)
    P = dense(att, [1])[0, 0]
    assert np.isfinite(P).all()
    for i in (0, 3000, cut + 1, L - 1):
        want = np_attention_row(model.layers[1].temporal_block.arrays(), xs[1], pos, cfg, 1, i)
        assert np.linalg.norm(P[i] - want) / np.linalg.norm(want) <= 1e-4, i


# ----------------------------------------------------------------------------- gradients, jit

def test_jit_grad_and_taps(one):
    rng = np.random.default_rng(7)  # own stream: the session rng's state depends on test order
    _, model, _ = one
    cfg = model.config
    p = model.layers[0].temporal_block.arrays()
    L = 8
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4]])
    x = jnp.asarray(rng.normal(size=(1, L, cfg.hidden_size)), jnp.float32)
    W = jnp.asarray(rng.normal(size=(1, L, L)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=1)
    def f(x, how="mean"):
        op = griffin.recurrent_operator(p, x, pos, cfg)
        return jnp.sum(op.reduce(how, block_channels=5) * W)

    # -inf log decays at the reset do not poison gradients
    assert np.isfinite(np.asarray(jax.jit(jax.grad(f), static_argnums=1)(x, "abs_mean"))).all()
    g = jax.jit(jax.grad(f))(x)  # the finite-difference check on the smooth reduction (|H| has kinks)
    v = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    eps = 1e-3
    fd = (f(x + eps * v) - f(x - eps * v)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.sum(g * v)), float(fd), rtol=2e-2)
    # taps: zeros change nothing; gradients reach both kinds of layer
    ids = rng.integers(0, cfg.vocab_size, (2, 13))
    taps = {0: jnp.zeros((2, cfg.lru_width, 13)), 2: jnp.zeros((2, cfg.num_attention_heads, 13, cfg.head_dim))}
    logits, vjp = jax.vjp(lambda t: model.tapped_logits(ids, t), taps)
    np.testing.assert_allclose(logits, model(ids), atol=1e-6)
    (gt,) = vjp(jnp.zeros(logits.shape).at[0, -1, 0].set(1.0))
    assert float(jnp.abs(gt[0][0, :, -1]).max()) > 0 and float(jnp.abs(gt[2][0, :, -1]).max()) > 0
    assert float(jnp.abs(gt[0][1]).max()) == 0  # batch rows do not mix
    # the attention operator under jit and grad
    pa = model.layers[2].temporal_block.arrays()
    ga = jax.jit(jax.grad(lambda x: jnp.sum(griffin.attention_operator(pa, x, pos, cfg).reduce("mean") * W)))(x)
    assert np.isfinite(np.asarray(ga)).all() and float(jnp.abs(ga).max()) > 0


# ----------------------------------------------------------------------------- converter

def test_save_load_round_trip_and_torch_reads_ours(pair, rng, tmp_path):
    import transformers

    _, model, _ = pair
    ia.save(model, tmp_path / "rt")
    back = ia.load(tmp_path / "rt")
    ids = rng.integers(0, model.config.vocab_size, (1, 9))
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(model(ids)))
    assert back.config == model.config
    tm = transformers.RecurrentGemmaForCausalLM.from_pretrained(tmp_path / "rt").eval()
    import torch

    with torch.no_grad():
        ref = tm(torch.tensor(ids), use_cache=False).logits.numpy()
    assert np.abs(np.asarray(model(ids)) - ref).max() <= 1e-4


def _broken(src, dst, edit_tensors=None, edit_config=None):
    config, tensors = read_hf_dir(src)
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    write_hf_dir(dst, config, tensors)
    return dst


def test_converter_errors(one, tmp_path):
    _, _, path = one
    cases = [
        (lambda t: t.pop("model.layers.0.temporal_block.rg_lru.recurrent_param"), None,
         "missing tensors: model.layers.0.temporal_block.rg_lru.recurrent_param"),
        (lambda t: t.__setitem__("model.layers.2.temporal_block.linear_x.weight", np.zeros((24, 32), np.float32)),
         None, "unexpected tensors: model.layers.2.temporal_block.linear_x.weight"),
        (lambda t: t.__setitem__("model.layers.1.temporal_block.conv_1d.weight", np.zeros((24, 4), np.float32)),
         None, "conv_1d.weight has shape (24, 4), expected (24, 1, 4)"),
        (None, lambda c: c.__setitem__("tie_word_embeddings", False), "missing tensors: lm_head.weight"),
        (None, lambda c: c.__setitem__("block_types", ["recurrent", "mlp"]), "block_types"),
        (None, lambda c: c.__setitem__("hidden_activation", "relu"), "hidden_activation"),
        (None, lambda c: c.__setitem__("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4}), "rope_type"),
        (None, lambda c: c.pop("num_attention_heads"), "num_attention_heads"),
    ]
    for k, (et, ec, msg) in enumerate(cases):
        dst = _broken(path, tmp_path / f"b{k}", et, ec)
        with pytest.raises((CheckpointError, ValueError)) as e:
            ia.load(dst)
        assert msg in str(e.value), (msg, str(e.value))
    # tied checkpoints may carry a duplicate lm_head: accepted and ignored
    dst = _broken(path, tmp_path / "dup", lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"]))
    ia.load(dst)


# ----------------------------------------------------------------------------- bad input

def test_bad_input(one):
    _, model, _ = one
    ids = np.zeros((2, 13), np.int64)
    ok = np.arange(13)
    bad_pos = [
        (np.stack([ok + 1, ok]), "row 0 starts at 1"),
        (np.stack([ok, np.r_[0, 1, 3:14]]), "segment_pos[1, 2] = 3 after 1"),
        (ok, "shape of input_ids (2, 13)"),
        (np.zeros((2, 12), np.int64), "shape of input_ids (2, 13)"),
        (np.zeros((2, 13), np.float32), "integer"),
    ]
    for pos, msg in bad_pos:
        for fn in (lambda: model(ids, segment_pos=pos), lambda: model.operators(ids, segment_pos=pos)):
            with pytest.raises((ValueError, TypeError)) as e:
                fn()
            assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(np.array([[0, 64]]))
    with pytest.raises(ValueError, match="variant"):
        model.operators(ids, variant="no_act")
    with pytest.raises(ValueError, match="temporal block input"):
        model.layers[0].temporal_block.as_operator(np.zeros((2, 13, 7), np.float32))
    with pytest.raises(ValueError, match="segment_pos must start at 0"):
        model.layers[0].temporal_block(np.zeros((2, 13, 32), np.float32), segment_pos=np.stack([ok + 1, ok]))
    with pytest.raises(ValueError, match="out of range"):
        model.operators(ids, layers=[3])
    with pytest.raises(ValueError, match="channels out of range"):
        model.operators(ids, layers=[2])[0].materialize(channels=[4])


# ----------------------------------------------------------------------------- RG-LRU scan methods

def test_rglru_parallel_and_sequential_scans_agree(rng):
    """Both scan methods give the float64 recurrence, and a reset (a = 0) cuts the state
    exactly: outputs from the reset on do not depend on any input before it."""
    B, L, C = 2, 37, 5
    a = rng.uniform(0.5, 0.999, (B, L, C))
    a[:, 0] = 0.0
    a[0, 11] = 0.0  # document starts
    a[1, 20:22] = 0.0
    u = rng.normal(size=(B, L, C))
    ref = np.zeros((B, L, C))
    h = np.zeros((B, C))
    for t in range(L):
        h = a[:, t] * h + u[:, t]
        ref[:, t] = h
    u2 = u.copy()
    u2[0, :11] += 5.0  # changes before the reset in row 0
    u2[1, :21] -= 3.0
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    for method in ("sequential", "parallel", "auto"):
        got = np.asarray(griffin.rglru_scan(f32(a), f32(u), method=method))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=method)
        moved = np.asarray(griffin.rglru_scan(f32(a), f32(u2), method=method))
        np.testing.assert_array_equal(moved[0, 11:], got[0, 11:])
        np.testing.assert_array_equal(moved[1, 21:], got[1, 21:])
        assert np.abs(moved[0, :11] - got[0, :11]).min() > 0
    par = griffin.rglru_scan(f32(a), f32(u), method="parallel")
    seq = griffin.rglru_scan(f32(a), f32(u), method="sequential")
    np.testing.assert_allclose(np.asarray(par), np.asarray(seq), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scan method"):
        griffin.rglru_scan(f32(a), f32(u), method="fast")


# ----------------------------------------------------------------------------- residual layer, input checks

def test_layer_call_is_the_lm_forward_step(one, rng):
    """Chaining ``GriffinLayer.__call__`` (recurrent and attention layers, packed documents,
    taps of both kinds) from the scaled embeddings reproduces the captured temporal-block
    inputs and the tapped, soft-capped logits of the full forward."""
    _, model, _ = one
    cfg = model.config
    ids, pos = _packed(rng, cfg.vocab_size)
    B, L = ids.shape
    xs = model.mixer_inputs(ids, segment_pos=pos)
    taps = {1: jnp.asarray(rng.normal(size=(B, cfg.lru_width, L)), jnp.float32),
            2: jnp.asarray(rng.normal(size=(B, cfg.num_attention_heads, L, cfg.head_dim)), jnp.float32)}
    assert cfg.layer_types[1:] == ("recurrent", "attention")
    emb = model.embed_tokens[...]
    h = emb[ids] * griffin.block.embed_scale(cfg, emb.dtype)
    for i, layer in enumerate(model.layers):
        if i <= min(taps):  # the captured inputs are untapped
            hn = griffin.rms_norm(h, layer.temporal_pre_norm[...], cfg.rms_norm_eps)
            np.testing.assert_allclose(np.asarray(hn), np.asarray(xs[i]), rtol=1e-5, atol=1e-6)
        h = layer(h, segment_pos=pos, tap=taps.get(i))
        assert h.shape == (B, L, cfg.hidden_size)
    head = emb if model.lm_head is None else model.lm_head[...]
    logits = griffin.rms_norm(h, model.final_norm[...], cfg.rms_norm_eps) @ head.T
    logits = jnp.tanh(logits / cfg.logits_soft_cap) * cfg.logits_soft_cap
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model.tapped_logits(ids, taps, segment_pos=pos)),
                               rtol=1e-5, atol=1e-5)


def test_bad_layer_tap(one):
    _, model, _ = one
    h = np.zeros((2, 5, model.config.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"\(batch, lru_width, length\) = \(2, 24, 5\), got \(1, 24, 5\)"):
        model.layers[0](h, tap=jnp.zeros((1, 24, 5)))
    with pytest.raises(ValueError, match=r"\(batch, heads, length, head_dim\) = \(2, 4, 5, 8\), got \(2, 24, 5\)"):
        model.layers[2](h, tap=jnp.zeros((2, 24, 5)))
