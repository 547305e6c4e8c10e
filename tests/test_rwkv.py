"""RWKV-4: logits and per-block parity with HF torch in eval mode (rescale_every active),
exactness of the time-mix operator, float64 references, stability at L = 8192 with
large keys, converter checks and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import rwkv
from weights_convert import CheckpointError, read_hf_dir, write_hf_dir
from hf_build import rwkv_hf

CONFIGS = {
    # 5 layers, R = 2: blocks 2-4 run with rescaled weights, hidden halved twice;
    # a large LayerNorm eps makes the logits depend on the rescaling too.
    "untied_R2": dict(num_hidden_layers=5, rescale_every=2, layer_norm_epsilon=0.3),
    "tied_R3_square": dict(num_hidden_layers=4, rescale_every=3, attention_hidden_size=None,
                           intermediate_size=None, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    tm = rwkv_hf(path, **CONFIGS[request.param])
    return tm, ia.load(path), path, request.param


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    path = tmp_path_factory.mktemp("one")
    tm = rwkv_hf(path, num_hidden_layers=2, rescale_every=1)
    return tm, ia.load(path), path


def torch_run(tm, ids):
    """Logits and, per block, (attention in, attention out, ffn in, ffn out, value proj out)."""
    import torch

    io = {}
    hooks = []
    for i, b in enumerate(tm.rwkv.blocks):
        hooks.append(b.attention.register_forward_hook(
            lambda mod, inp, out, i=i: io.setdefault(i, {}).update(att=(inp[0].numpy(), out[0].numpy()))))
        hooks.append(b.feed_forward.register_forward_hook(
            lambda mod, inp, out, i=i: io.setdefault(i, {}).update(ffn=(inp[0].numpy(), out[0].numpy()))))
        hooks.append(b.attention.value.register_forward_hook(
            lambda mod, inp, out, i=i: io.setdefault(i, {}).update(v=out.numpy())))
    with torch.no_grad():
        logits = tm(torch.tensor(ids), use_cache=False).logits.numpy()
    for h in hooks:
        h.remove()
    return logits, io


def test_logits_and_blocks_match_torch(pair, rng):
    tm, model, _, name = pair
    # L = 1 on one configuration only (each length is a new compilation)
    for L in ([1, 13] if name == "untied_R2" else [13]):
        ids = rng.integers(0, model.config.vocab_size, (2, L))
        ref, io = torch_run(tm, ids)
        logits = np.asarray(model(ids))
        assert logits.shape == ref.shape and logits.dtype == np.float32
        assert np.abs(logits - ref).max() <= 1e-4, (L, np.abs(logits - ref).max())
    xs = model.mixer_inputs(ids)
    for i, layer in enumerate(model.layers):
        ain, aout = io[i]["att"]
        fin, fout = io[i]["ffn"]
        np.testing.assert_allclose(np.asarray(xs[i]), ain, atol=2e-5, err_msg=f"layer {i} input")
        np.testing.assert_allclose(np.asarray(layer.attention(ain)), aout, atol=2e-5, err_msg=f"att {i}")
        np.testing.assert_allclose(np.asarray(layer.feed_forward(fin)), fout, atol=2e-5, err_msg=f"ffn {i}")


def test_rescaling_is_what_torch_does(pair, rng):
    """Ignoring HF's eval-mode rescaling changes the blocks' outputs (by 2**(i // R)); with a
    large LayerNorm eps it changes the logits too: the parity test above can fail."""
    import dataclasses

    tm, model, _, _ = pair
    cfg = model.config
    ids = rng.integers(0, cfg.vocab_size, (1, 13))
    ref, io = torch_run(tm, ids)
    off = rwkv.LM(dataclasses.replace(cfg, rescale_every=0), model.params())
    last = cfg.num_hidden_layers - 1
    assert last // cfg.rescale_every >= 1
    ain, aout = io[last]["att"]
    np.testing.assert_allclose(np.asarray(off.layers[last].attention(ain)) / cfg.rescale(last), aout,
                               atol=2e-5)
    assert np.abs(np.asarray(off.layers[last].attention(ain)) - aout).max() > 1e-2
    if cfg.layer_norm_epsilon > 0.1:
        assert np.abs(np.asarray(off(ids)) - ref).max() > 1e-2


def test_operator_is_exact(pair, rng):
    tm, model, _, _ = pair
    cfg = model.config
    L = 13
    ids = rng.integers(0, cfg.vocab_size, (2, L))
    _, io = torch_run(tm, ids)
    ops = model.operators(ids)
    nog = model.operators(ids, variant="no_gate")
    for i, (op, og) in enumerate(zip(ops, nog)):
        assert op.shape == (2, cfg.attention_hidden_size, L, L)
        H = np.asarray(op.materialize())
        assert np.isfinite(H).all() and np.all(np.triu(H, 1) == 0)
        y = np.einsum("bcij,bcj->bci", H, np.asarray(op.values)) + np.asarray(op.offset)
        out = np.asarray(op.output)
        assert np.abs(y - out).max() <= 1e-5 * np.abs(out).max(), f"layer {i}"
        assert op.relative_error() <= 1e-5
        assert np.all(np.asarray(op.offset) == 0)
        # values are the value projection of torch's block; rows before the gate sum to 1
        np.testing.assert_allclose(np.asarray(op.values), np.swapaxes(io[i]["v"], 1, 2), atol=2e-5)
        P = np.asarray(og.materialize())
        np.testing.assert_allclose(P.sum(-1), 1.0, atol=1e-6)
        assert P.min() >= 0
        gate = H.sum(-1)  # = sigmoid(r): full = diag(gate) no_gate
        assert np.all((gate > 0) & (gate < 1))
        np.testing.assert_allclose(H, gate[..., None] * P, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(og.output), out)  # output is always the block's own
        # the operator's output through the (rescaled) output projection is torch's block output
        wo = np.asarray(model.layers[i].attention.arrays()["output.weight"]) / cfg.rescale(i)
        np.testing.assert_allclose(np.einsum("bcl,dc->bld", out, wo), io[i]["att"][1], atol=2e-5)


def test_operator_single_token(one, rng):
    """L = 1, batch 2: H = sigmoid(r_0) (the softmax of one entry is 1), values = v."""
    _, model, _ = one
    att = model.layers[0].attention
    x = jnp.asarray(rng.normal(size=(2, 1, model.config.hidden_size)), jnp.float32)
    q = rwkv.time_mix_parts(att.arrays(), x, model.config)
    for variant, want in [("full", jax.nn.sigmoid(q["r"])), ("no_gate", jnp.ones_like(q["r"]))]:
        op = att.as_operator(x, variant)
        H = np.asarray(op.materialize())
        assert H.shape == (2, model.config.attention_hidden_size, 1, 1)
        np.testing.assert_allclose(H[..., 0, 0], np.swapaxes(np.asarray(want), 1, 2)[..., 0], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(op.values), np.swapaxes(np.asarray(q["v"]), 1, 2), rtol=1e-6)
        if variant == "full":
            assert op.relative_error() <= 1e-6


def float64_rows(k, w, u):
    """``softmax_rows(l)`` of one channel in float64, directly from the definition."""
    L = len(k)
    i, j = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    l = np.where(j < i, (i - 1 - j) * w + k[None, :], u + k[None, :])
    l = np.where(j <= i, l, -np.inf)
    l = l - l.max(1, keepdims=True)
    e = np.exp(l)
    return e / e.sum(1, keepdims=True)


def float64_wkv(w, u, k, v):
    """The WKV recurrence as written in the RWKV-4 paper (sum over j), float64, one channel."""
    L = len(k)
    out = np.zeros(L)
    for t in range(L):
        l = np.array([(t - 1 - j) * w + k[j] if j < t else u + k[t] for j in range(t + 1)])
        e = np.exp(l - l.max())
        out[t] = (e * v[:t + 1]).sum() / e.sum()
    return out


def test_operator_and_forward_match_float64(one, rng):
    _, model, _ = one
    cfg = model.config
    L = 13
    ids = rng.integers(0, cfg.vocab_size, (1, L))
    x = model.mixer_inputs(ids, [1])[1]
    p = model.layers[1].attention.arrays()
    q = rwkv.time_mix_parts(p, x, cfg)
    k, v, r = (np.asarray(q[n], np.float64)[0] for n in ("k", "v", "r"))
    w, u = np.asarray(q["w"], np.float64), np.asarray(q["u"], np.float64)
    op = model.layers[1].attention.as_operator(x)
    og = model.layers[1].attention.as_operator(x, variant="no_gate")
    H, P = np.asarray(op.materialize())[0], np.asarray(og.materialize())[0]
    for c in range(cfg.attention_hidden_size):
        ref = float64_rows(k[:, c], w[c], u[c])
        np.testing.assert_allclose(P[c], ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(H[c], ref / (1 + np.exp(-r[:, c]))[:, None], rtol=1e-5, atol=1e-7)
        y = float64_wkv(w[c], u[c], k[:, c], v[:, c]) / (1 + np.exp(-r[:, c]))
        np.testing.assert_allclose(np.asarray(op.output)[0, c], y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_wkv_chunks_carry_the_state(rng, chunk):
    """Cross-chunk state (the path long inputs take) against float64, with large keys."""
    A, L = 3, 13
    w = -np.exp(np.array([-6.0, 0.0, 1.5]))
    u = rng.normal(size=A)
    k = rng.uniform(-60, 60, size=(1, L, A))
    v = rng.normal(size=(1, L, A))
    f = jax.jit(rwkv.wkv, static_argnames="chunk")
    got = np.asarray(f(*(jnp.asarray(a, jnp.float32) for a in (w, u, k, v)), chunk=chunk))[0]
    for c in range(A):
        ref = float64_wkv(w[c], u[c], k[0, :, c].astype(np.float32), v[0, :, c].astype(np.float32))
        np.testing.assert_allclose(got[:, c], ref, rtol=1e-5, atol=1e-6)


def test_long_input_with_large_keys_matches_float64():
    """|k| up to 60, L = 8192: finite, and rows of H and the scan's wkv agree with float64."""
    cfg = rwkv.Config(vocab_size=32, hidden_size=8, attention_hidden_size=4, intermediate_size=8,
                      num_hidden_layers=1)
    params = rwkv.init_params(cfg, jax.random.PRNGKey(1))
    att = params["layers"][0]["attention"]
    att["time_decay"] = jnp.array([-7.0, -2.0, 0.0, 1.6])  # w from -1e-3 (slow) to -5 (fast)
    L = 8192
    x = jax.random.normal(jax.random.PRNGKey(2), (1, L, 8))
    k0 = rwkv.time_mix_parts(att, x, cfg)["k"]
    att["key.weight"] = att["key.weight"] * (59.9 / jnp.abs(k0).max())
    q = rwkv.time_mix_parts(att, x, cfg)
    assert 59.0 <= float(jnp.abs(q["k"]).max()) <= 60.0
    op = rwkv.block.time_mix_operator_jit(att, x, cfg=cfg)
    k, v, r = (np.asarray(q[n], np.float64)[0] for n in ("k", "v", "r"))
    w, u = np.asarray(q["w"], np.float64), np.asarray(q["u"], np.float64)
    out = np.asarray(op.output)[0]
    assert np.isfinite(out).all()
    Hs = jax.jit(lambda o: o.materialize(channels=[0, 3], block_channels=1))(op)
    for ci, c in enumerate((0, 3)):
        H = np.asarray(Hs[0, ci])
        assert np.isfinite(H).all()
        g = 1 / (1 + np.exp(-r[:, c]))
        for i in (0, 5, 4097, L - 1):
            li = np.where(np.arange(i + 1) < i, (i - 1 - np.arange(i + 1)) * w[c] + k[:i + 1, c], u[c] + k[i, c])
            e = np.exp(li - li.max())
            ref = np.zeros(L)
            ref[:i + 1] = g[i] * e / e.sum()
            rel = np.linalg.norm(H[i] - ref) / np.linalg.norm(ref)
            assert rel <= 1e-4, (c, i, rel)
            y = ref @ v[:, c]
            assert abs(out[c, i] - y) <= 1e-4 * max(abs(y), np.abs(v[:, c]).max() * 1e-2), (c, i)
            assert abs(H[i] @ v[:, c] - y) <= 1e-4 * max(abs(y), np.abs(v[:, c]).max() * 1e-2)


def _damaged(src, dst, edit=None, config_edit=None):
    config, tensors = read_hf_dir(src)
    if edit:
        edit(tensors)
    if config_edit:
        config_edit(config)
    write_hf_dir(dst, config, tensors)
    return dst


@pytest.mark.parametrize("case, message", [
    (lambda t: t.pop("rwkv.blocks.1.attention.time_first"), "missing tensors: rwkv.blocks.1.attention.time_first"),
    (lambda t: t.pop("rwkv.blocks.0.pre_ln.weight"), "missing tensors: rwkv.blocks.0.pre_ln.weight"),
    (lambda t: t.pop("head.weight"), "missing tensors: head.weight"),
    (lambda t: t.__setitem__("rwkv.blocks.1.pre_ln.weight", t["rwkv.blocks.0.pre_ln.weight"]),
     "unexpected tensors: rwkv.blocks.1.pre_ln.weight"),
    (lambda t: t.__setitem__("rwkv.blocks.0.attention.time_mix_key",
                             t["rwkv.blocks.0.attention.time_mix_key"][0]),
     "tensor rwkv.blocks.0.attention.time_mix_key has shape (1, 16), expected (1, 1, 16)"),
    (lambda t: t.__setitem__("rwkv.blocks.1.feed_forward.value.weight",
                             t["rwkv.blocks.1.feed_forward.value.weight"].T),
     "tensor rwkv.blocks.1.feed_forward.value.weight has shape (24, 16), expected (16, 24)"),
])
def test_converter_rejects_bad_checkpoints(one, tmp_path, case, message):
    _, _, path = one
    bad = _damaged(path, tmp_path / "bad", edit=case)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ia.load(bad)


def test_converter_rejects_bad_configs(one, tmp_path):
    _, _, path = one
    bad = _damaged(path, tmp_path / "a", config_edit=lambda c: c.pop("hidden_size"))
    with pytest.raises(ValueError, match="hidden_size"):
        ia.load(bad)
    bad = _damaged(path, tmp_path / "b", config_edit=lambda c: c.update(num_hidden_layers=3))
    with pytest.raises(CheckpointError, match="missing tensors: rwkv.blocks.2"):
        ia.load(bad)
    bad = _damaged(path, tmp_path / "c", config_edit=lambda c: c.update(rescale_every=1.5))
    with pytest.raises(ValueError, match="rescale_every must be an integer"):
        ia.load(bad)


def test_bad_inputs(one):
    _, model, _ = one
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(np.array([[1, model.config.vocab_size]]))
    with pytest.raises(ValueError, match="add a batch axis"):
        model(np.array([1, 2, 3]))
    with pytest.raises(TypeError, match="integers"):
        model(np.array([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="variant must be one of"):
        model.operators(np.array([[1, 2]]), variant="no_conv")
    with pytest.raises(ValueError, match="block input must have shape"):
        model.layers[0].attention.as_operator(np.zeros((1, 4, 3), np.float32))
    with pytest.raises(ValueError, match="out of range"):
        model.operators(np.array([[1, 2]]), layers=[2])
    with pytest.raises(ValueError, match="positive integer"):
        rwkv.Config(vocab_size=0, hidden_size=4)


# ----------------------------------------------------------------------------- residual block, input checks

def test_block_call_is_the_lm_forward_step(one, rng):
    """Chaining ``RwkvBlock.__call__`` from the embeddings (block 0 applies ``pre_ln``; rescaling
    after every block) reproduces every captured time-mix input and the tapped logits."""
    _, model, _ = one
    cfg = model.config
    ids = rng.integers(0, cfg.vocab_size, (2, 7))
    xs = model.mixer_inputs(ids)
    n = len(model.layers)
    tap = jnp.asarray(rng.normal(size=(2, cfg.attention_hidden_size, 7)), jnp.float32)
    ln = lambda x, w: rwkv.layer_norm(x, w["weight"], w["bias"], cfg.layer_norm_epsilon)
    h = model.embeddings[...][ids]
    for i, block in enumerate(model.layers):
        x = ln(h if block.pre_ln is None else ln(h, block.pre_ln.arrays()), block.ln1.arrays())
        np.testing.assert_allclose(np.asarray(x), np.asarray(xs[i]), rtol=1e-5, atol=1e-5)
        h = block(h, tap=tap if i == n - 1 else None)
        assert h.shape == (2, 7, cfg.hidden_size)
    lo = model.ln_out.arrays()
    logits = rwkv.layer_norm(h, lo["weight"], lo["bias"], rwkv.block.FINAL_LN_EPS) @ model.head[...].T
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model.tapped_logits(ids, {n - 1: tap})),
                               rtol=1e-5, atol=1e-5)


def test_bad_block_tap(one):
    _, model, _ = one
    h = np.zeros((2, 5, model.config.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"tap must have the shape of the block's operator output .* = \(2, 12, 5\)"):
        model.layers[0](h, tap=jnp.zeros((1, 12, 5)))
