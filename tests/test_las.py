"""LaS attention (implicit_attn.ops.las, operator.LaSCore, models.las): the block against a
float64 numpy implementation written from the paper's Eq. 4 for every variant, exactness of
its operator, causality, alpha_c from B, ALiBi slopes, row sums after pooling, bad
hyper-parameters, save / load, and the explain machinery on the LM and the classifier."""
from __future__ import annotations

import dataclasses

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.explain import explain, head_maps, model_maps
from implicit_attn.kernels import cpu, pallas, pallas_dense, pallas_reduce
from implicit_attn.kernels.pallas import plans
from implicit_attn.models import las
from implicit_attn.nn import CheckpointError
from implicit_attn.operator import AttentionCore, LaSCore, resolve_impl
from implicit_attn.operator.dispatch import blocked_reduce
from implicit_attn.ops import alibi_slopes, las_alphas, las_probs, las_softmax

V, D, H, L = 13, 16, 4, 11
# Every paper model, the centered pooling, ALiBi with smoothing (Tab. 4's cT+SMOOTH+ALIBI),
# LaS-chunk with a block length that does not divide L, and P = 5.
CASES = {
    "las": dict(eld=True, pool=3),
    "l_attention": dict(eld=True, pool=1),
    "s_attention": dict(eld=False, pool=3),
    "vanilla": dict(eld=False, pool=1),
    "alibi": dict(eld=False, alibi=True, pool=1),
    "las_chunk": dict(eld=True, pool=3, chunk=4),
    "las_centered": dict(eld=True, pool=3, pool_align="centered"),
    "centered_chunk_p5": dict(eld=True, pool=5, pool_align="centered", chunk=5),
    "smooth_alibi_p5": dict(eld=False, alibi=True, pool=5),
}


def config(case: str, **kw) -> las.Config:
    # B = 0.9: decays strong enough to change every row at L = 11 (the paper's 1e-3 would not)
    return las.Config(vocab_size=V, hidden_size=D, num_attention_heads=H, num_hidden_layers=1, B=0.9,
                      **{**CASES[case], **kw})


# ----------------------------------------------------------------------------- float64 reference

def ref_alphas(n, B):
    """The paper: alpha_0 = 0, alpha_c in [0, B], exp(-alpha_c) evenly spaced."""
    return -np.log(np.linspace(1.0, np.exp(-B), n)) if n > 1 else np.zeros(1)


def ref_slopes(n):
    """ALiBi: 2^(-8k/n) for a power of two n; else the power below plus every other of twice it."""
    p = 2 ** int(np.floor(np.log2(n)))
    base = [2.0 ** (-8.0 * k / p) for k in range(1, p + 1)]
    extra = [2.0 ** (-8.0 * k / (2 * p)) for k in range(1, 2 * p + 1)][0::2]
    return np.array(base + extra[:n - p])


def ref_head(Q, K, Vv, alpha, slope, P, align):
    """One head, one sequence, full causal attention: Eq. 4 read literally, float64.
    Returns (A after pooling and masking, A @ V)."""
    n, d = Q.shape
    S = Q @ K.T / np.sqrt(d)
    Dl = np.array([[i - j if i >= j else 0 for j in range(n)] for i in range(n)], float)
    if alpha is not None:
        S = np.exp(-alpha * Dl) * S                 # ELD: elementwise product with the scores
    if slope is not None:
        S = S - slope * Dl                          # ALiBi: additive bias
    causal = np.tril(np.ones((n, n), bool))
    S = np.where(causal, S, -np.inf)
    S = np.exp(S - S.max(axis=1, keepdims=True))
    S = S / S.sum(axis=1, keepdims=True)
    if P > 1:
        r = P // 2
        pad = ((0, 0), (0, P - 1)) if align == "causal" else ((0, 0), (r, r))
        windows = np.lib.stride_tricks.sliding_window_view(np.pad(S, pad), P, axis=1)  # (n, n, P)
        S = windows.sum(axis=-1) / P                # AvgPool1d, zero padding counted
    A = np.where(causal, S, 0.0)
    return A, A @ Vv


def ref_block(p, x, cfg):
    """The block from its parameters: per-head Eq. 4; LaS-chunk runs each block of ``chunk``
    positions on its own (the paper's reshape into blocks). Returns (A (B,H,L,L), per-head
    output (B,H,L,d), block output (B,L,D))."""
    P64 = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    Bn, n, _ = x.shape
    d = cfg.head_dim
    split = lambda t: t.reshape(Bn, n, H, d).transpose(0, 2, 1, 3)
    q, k, v = (split(x @ P64[f"{w}_proj.weight"].T) for w in "qkv")
    alphas = ref_alphas(H, cfg.B) if cfg.eld else [None] * H
    slopes = ref_slopes(H) if cfg.alibi else [None] * H
    c = cfg.chunk or n
    A = np.zeros((Bn, H, n, n))
    O = np.zeros((Bn, H, n, d))
    for b in range(Bn):
        for h in range(H):
            for s in range(0, n, c):
                e = min(s + c, n)
                a, o = ref_head(q[b, h, s:e], k[b, h, s:e], v[b, h, s:e], alphas[h], slopes[h], cfg.pool,
                                cfg.pool_align)
                A[b, h, s:e, s:e] = a
                O[b, h, s:e] = o
    y = O.transpose(0, 2, 1, 3).reshape(Bn, n, H * d) @ P64["o_proj.weight"].T
    return A, O, y


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(1).standard_normal((2, L, D)).astype(np.float32)


@pytest.fixture(scope="module")
def blocks():
    """One mixer per case (same weights)."""
    out = {}
    for case in CASES:
        cfg = config(case)
        out[case] = las.LaSMixer(cfg, las.init_params(cfg, 3)["layers"][0]["mixer"])
    return out


# ----------------------------------------------------------------------------- hyper-parameters

def test_alphas_from_B_follow_the_paper():
    for n, B in ((8, 1e-3), (8, 1e-4), (5, 0.5), (2, 0.9)):
        a = las_alphas(n, B)
        np.testing.assert_allclose(a, ref_alphas(n, B), rtol=1e-12, atol=1e-15)
        assert a[0] == 0.0 and abs(a[-1] - B) < 1e-12 * B + 1e-15       # alpha_0 = 0 (vanilla head), alpha_max = B
        np.testing.assert_allclose(np.diff(np.exp(-a)), np.diff(np.exp(-a))[0], rtol=1e-9)  # evenly spaced
    np.testing.assert_array_equal(las_alphas(1, 0.5), [0.0])
    cfg = las.Config(vocab_size=V, hidden_size=D, num_attention_heads=H, B=1e-3)
    np.testing.assert_allclose(np.asarray(cfg.head_alphas()), ref_alphas(H, 1e-3), rtol=1e-6)
    assert las.Config.variant("s_attention", vocab_size=V, hidden_size=D).head_alphas() is None


def test_alibi_slopes():
    np.testing.assert_allclose(alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_allclose(alibi_slopes(16), 2.0 ** (-0.5 * np.arange(1, 17)))
    np.testing.assert_allclose(alibi_slopes(6), 2.0 ** -np.array([2, 4, 6, 8, 1, 3]))
    for n in (1, 3, 5, 12):
        np.testing.assert_allclose(alibi_slopes(n), ref_slopes(n))


@pytest.mark.parametrize("kw, match", [
    (dict(pool=2), "odd"), (dict(pool=0), "odd"), (dict(pool=-3), "odd"), (dict(pool=3.0), "odd"),
    (dict(B=0.0), r"\(0, 1\)"), (dict(B=-1e-3), r"\(0, 1\)"), (dict(B=1.0), r"\(0, 1\)"), (dict(B=float("nan")), r"\(0, 1\)"),
    (dict(chunk=0), "chunk"), (dict(chunk=-4), "chunk"), (dict(chunk=2.5), "chunk"),
    (dict(num_attention_heads=3), "multiple of num_attention_heads"),
    (dict(alphas=(0.0, 0.1)), "one finite alpha_c >= 0 per head"),
    (dict(alphas=(0.0, 0.1, -0.2, 0.3)), "one finite alpha_c >= 0 per head"),
    (dict(alphas=(0.0, 0.1, 0.2, 0.3), eld=False), "eld is false"),
    (dict(pool_align="left"), "pool_align"),
    (dict(classifier_pooling="max"), "classifier_pooling"),
])
def test_bad_hyper_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        las.Config(vocab_size=V, hidden_size=D, **{"num_attention_heads": H, **kw})


def test_bad_arguments_of_the_pure_functions():
    q = jnp.zeros((1, 2, 5, 4))
    with pytest.raises(ValueError, match="one value per head"):
        las_probs(q, q, alpha=jnp.zeros(3))
    with pytest.raises(ValueError, match="one value per head"):
        las_softmax(q, q, slope=jnp.zeros(1))
    with pytest.raises(ValueError, match="odd"):
        las_probs(q, q, pool=4)
    with pytest.raises(ValueError, match="chunk"):
        las_probs(q, q, chunk=0)
    with pytest.raises(ValueError, match="same shape"):
        las_probs(q, q[:, :1])
    with pytest.raises(ValueError, match="num_heads"):
        las_alphas(0, 0.1)
    with pytest.raises(ValueError, match="variant"):
        las.Config.variant("lsa", vocab_size=V, hidden_size=D)


def test_variants_set_the_flags():
    kinds = {name: las.Config.variant(name, vocab_size=V, hidden_size=D, pool=5, chunk=8) for name in las.VARIANTS}
    assert {n: c.kind for n, c in kinds.items()} == {n: n for n in las.VARIANTS}
    assert kinds["las"].pool == 5 and kinds["l_attention"].pool == 1 and kinds["las_chunk"].chunk == 8
    assert kinds["alibi"].alibi and not kinds["alibi"].eld and kinds["vanilla"].head_slopes() is None


# ----------------------------------------------------------------------------- the block

@pytest.mark.parametrize("case", list(CASES))
def test_block_matches_float64_reference_and_operator_is_exact(case, blocks, x):
    mixer = blocks[case]
    cfg = mixer.cfg
    A, O, y = ref_block(mixer.arrays(), x, cfg)
    np.testing.assert_allclose(np.asarray(mixer(x)), y, rtol=1e-5, atol=2e-5)
    op = mixer.as_operator(x)
    H_ = np.asarray(op.materialize())
    assert H_.shape == (2, H, L, L) and H_.dtype == np.float32
    np.testing.assert_allclose(H_, A, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(op.output), O, rtol=1e-5, atol=2e-5)
    assert op.relative_error() < 1e-6
    assert not np.any(np.triu(H_, 1)), "entries above the diagonal"
    if cfg.chunk:
        blk = np.arange(L) // cfg.chunk
        assert not np.any(H_[..., blk[:, None] != blk[None, :]]), "entries across LaS-chunk blocks"
    if case in ("las", "las_chunk"):   # the blocked reduce, its blocks by the CPU kernel
        np.testing.assert_allclose(np.asarray(op.reduce("abs_mean")), np.abs(A).mean(1), rtol=1e-5, atol=1e-6)


def test_eld_multiplies_the_scores():
    """exp(-alpha D) scales the logits: a head with scores s has softmax(exp(-alpha D) s), not
    softmax(s - alpha D) (which is ALiBi with slope alpha)."""
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 1, 6, 4)), jnp.float32) for _ in range(2))
    a = jnp.asarray([0.7])
    s = np.asarray(jnp.einsum("bhid,bhjd->bhij", q, k))[0, 0]
    Dl = np.maximum(np.arange(6)[:, None] - np.arange(6)[None, :], 0)
    mult = np.where(np.tril(np.ones((6, 6), bool)), np.exp(-0.7 * Dl) * s, -np.inf)
    mult = np.exp(mult - mult.max(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(las_softmax(q, k, alpha=a))[0, 0], mult / mult.sum(1, keepdims=True),
                               rtol=1e-5, atol=1e-7)
    assert not np.allclose(np.asarray(las_softmax(q, k, alpha=a)), np.asarray(las_softmax(q, k, slope=a)), atol=1e-3)


@pytest.mark.parametrize("align", ["causal", "centered"])
def test_row_sums_after_pooling(align):
    rng = np.random.default_rng(2)
    n, P, c = 12, 5, 7
    q, k = (jnp.asarray(rng.standard_normal((1, 2, n, 4)), jnp.float32) for _ in range(2))
    for chunk in (None, c):
        S = np.asarray(las_softmax(q, k, chunk=chunk), np.float64)[0]
        A = np.asarray(las_probs(q, k, pool=P, chunk=chunk, align=align), np.float64)[0]
        start = np.arange(n) // (chunk or n) * (chunk or n)
        r = P // 2
        kept = np.zeros((n, n))                   # fraction of key j's mass row i keeps
        for i in range(n):
            for j in range(start[i], i + 1):
                if align == "causal":
                    kept[i, j] = min(j - start[i] + 1, P) / P
                else:
                    kept[i, j] = (min(j + r, i) - max(j - r, start[i]) + 1) / P
        np.testing.assert_allclose(A.sum(-1), (S * kept).sum(-1), rtol=1e-5, atol=1e-6)
        assert np.all(A.sum(-1) <= 1 + 1e-6)
        if align == "causal":   # only the first P - 1 keys of the query's block lose mass
            for i in range(n):
                assert np.all(kept[i, start[i] + P - 1:i + 1] == 1.0)
    np.testing.assert_allclose(np.asarray(las_softmax(q, k)).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("case", ["las", "alibi", "las_chunk", "centered_chunk_p5"])
def test_block_is_causal(case, blocks, x):
    mixer = blocks[case]
    base = np.asarray(mixer(x))
    for t in (0, 5, L - 1):
        moved = x.copy()
        moved[:, t] += 3.0
        y = np.asarray(mixer(moved))
        np.testing.assert_array_equal(y[:, :t], base[:, :t])
        assert not np.allclose(y[:, t], base[:, t])
        nan = x.copy()
        nan[:, t, 3] = np.nan
        y = np.asarray(mixer(nan))
        np.testing.assert_array_equal(y[:, :t], base[:, :t])
        end = L if not mixer.cfg.chunk else (t // mixer.cfg.chunk + 1) * mixer.cfg.chunk
        assert np.isnan(y[:, t:end]).all()
        assert not np.isnan(y[:, end:]).any()        # LaS-chunk: later blocks never read position t
        out = np.asarray(mixer.as_operator(nan).output)
        np.testing.assert_array_equal(np.isnan(out[:, :, :t]), False)


def test_length_one_and_jit_vmap_grad(blocks):
    mixer = blocks["las_chunk"]
    x1 = np.random.default_rng(5).standard_normal((3, 1, D)).astype(np.float32)
    op = mixer.as_operator(x1)
    assert op.relative_error() < 1e-6
    # pooling with zero padding: the first key keeps 1/P of its mass
    np.testing.assert_allclose(np.asarray(op.materialize()), 1.0 / mixer.cfg.pool, rtol=1e-6)
    p, cfg = mixer.arrays(), mixer.cfg
    f = lambda p, x: jnp.sum(las.mixer_forward(p, x, cfg) ** 2)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 7, D)), jnp.float32)
    g = jax.jit(jax.grad(f))(p, x)
    assert all(np.isfinite(np.asarray(v)).all() for v in g.values())
    yv = jax.vmap(lambda xi: las.mixer_forward(p, xi[None], cfg)[0])(x)
    np.testing.assert_allclose(np.asarray(yv), np.asarray(las.mixer_forward(p, x, cfg)), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the kernels

def random_core(L, eld=True, alibi=False, pool=3, chunk=None, align="causal", heads=3, d=5, seed=0):
    g = np.random.default_rng(seed)
    q = jnp.asarray(g.standard_normal((2, heads, L, d)) * d ** -0.5, jnp.float32)
    k = jnp.asarray(g.standard_normal((2, heads, L, d)), jnp.float32)
    return LaSCore(q=q, k=k, alpha=jnp.asarray(las_alphas(heads, 0.9), jnp.float32) if eld else None,
                   slope=jnp.asarray(alibi_slopes(heads), jnp.float32) if alibi else None, pool=pool, chunk=chunk,
                   align=align)


def ref_core(core):
    """Every head's LaS matrix of ``core`` in float64 (``ref_head`` per LaS-chunk block): (B, H, L, L)."""
    q, k = (np.asarray(a, np.float64) for a in (core.q, core.k))
    Bn, Hn, n, d = q.shape
    alpha = [None] * Hn if core.alpha is None else np.asarray(core.alpha, np.float64)
    slope = [None] * Hn if core.slope is None else np.asarray(core.slope, np.float64)
    c = core.chunk or n
    A = np.zeros((Bn, Hn, n, n))
    for b in range(Bn):
        for h in range(Hn):
            for s in range(0, n, c):
                e = min(s + c, n)
                A[b, h, s:e, s:e] = ref_head(q[b, h, s:e] * np.sqrt(d), k[b, h, s:e], np.zeros((e - s, 1)),
                                             alpha[h], slope[h], core.pool, core.align)[0]
    return A


# The CPU kernel and the Pallas kernel (interpret mode, tiles of 8: the pooling windows cross tiles)
DENSE = {"cpu": cpu.cpu_dense, "pallas": lambda core, idx: pallas_dense(core, idx, tile=8)}
KERNEL_CASES = {  # (L, core options): lengths around the kernels' 16-row chunks and 8-wide tiles
    "las_L37": (37, dict()),
    "eld_and_alibi_centered_p5_chunk7": (37, dict(alibi=True, pool=5, chunk=7, align="centered")),
    "alibi_no_pool_L300": (300, dict(eld=False, alibi=True, pool=1)),
    "las_chunk64_L300": (300, dict(chunk=64)),
    "vanilla_L16": (16, dict(eld=False, pool=1)),
    "centered_L1": (1, dict(align="centered")),
}
CASES_BY_IMPL = [(impl, case) for impl in DENSE for case in KERNEL_CASES
                 if impl == "cpu" or KERNEL_CASES[case][0] < 100]  # interpret mode is slow


@pytest.mark.parametrize("impl, case", CASES_BY_IMPL)
def test_kernel_matches_float64_and_xla(impl, case):
    """Each kernel (CPU: the attention kernel's logits with the distance terms, then the pooled rows;
    Pallas: the attention tiles with the distance terms, the pooled entry a sum over shifted keys)
    against the float64 definition and XLA, heads out of order and repeated; exact zeros where XLA
    has them (above the diagonal, across blocks)."""
    if impl == "cpu" and jax.default_backend() != "cpu":
        pytest.skip("the C++ kernels run on JAX's CPU backend")
    L, kw = KERNEL_CASES[case]
    core = random_core(L, **kw)
    idx = np.array([2, 0, 0, 1])
    got = np.asarray(DENSE[impl](core, idx))
    want = ref_core(core)[:, idx]
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    with jax.default_matmul_precision("highest"):  # as the entry points trace (a GPU's default is TF32)
        xla = np.asarray(core.dense(jnp.asarray(idx)))
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(got == 0, xla == 0)


def test_cpu_kernel_streams_large_outputs_to_the_same_numbers(monkeypatch):
    """Streaming stores (forced at these sizes: ``STREAM_BYTES`` 0) write the same bits as plain
    stores, for every kernel case (odd lengths: rows not 64-byte aligned) and a NaN row."""
    idx = np.array([2, 0, 0, 1])
    cores = [random_core(L, **kw) for L, kw in KERNEL_CASES.values()]
    q = np.array(cores[0].q)
    q[1, 2, 20, 0] = np.nan
    cores.append(dataclasses.replace(cores[0], q=jnp.asarray(q)))
    plain = [np.asarray(cpu.cpu_dense(c, idx)) for c in cores]
    assert np.isnan(plain[-1]).any()
    monkeypatch.setattr(cpu, "STREAM_BYTES", 0)
    for c, want in zip(cores, plain):
        np.testing.assert_array_equal(np.asarray(cpu.cpu_dense(c, idx)), want)


@pytest.mark.parametrize("impl", list(DENSE))
def test_kernel_keeps_xlas_nan_pattern(impl):
    """NaN queries and keys, and logits that overflow to inf: NaN exactly where XLA's softmax and
    pooling put it (the visible keys of the rows that read them), zeros kept elsewhere."""
    for align in ("causal", "centered"):
        for chunk in (None, 16):
            core = random_core(40, alibi=True, chunk=chunk, align=align, heads=2, d=4, seed=1)
            q, k = np.array(core.q), np.array(core.k)
            q[0, 0, 20, 1] = np.nan
            k[0, 1, 25, 0] = np.nan
            q[1, 1, 5] = 1e30
            k[1, 0, 3] = 1e30
            core = LaSCore(q=jnp.asarray(q), k=jnp.asarray(k), alpha=core.alpha, slope=core.slope, pool=3, chunk=chunk,
                           align=align)
            got = np.asarray(DENSE[impl](core, np.arange(2)))
            want = np.asarray(core.dense(jnp.arange(2)))
            assert np.isnan(want).any()
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(got == 0, want == 0)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)  # NaNs compare equal here


@pytest.mark.parametrize("how", ["mean", "abs_mean"])
def test_cpu_reduce_forms_its_blocks_by_the_kernel(how):
    """The library's reduce runs the dense kernel for its channel blocks (its call in the program),
    against the float64 sum over heads of ``qw H kw``; gradients (of materialize and of the blocked
    reduce) equal XLA's."""
    core = random_core(23, chunk=9, align="centered", heads=3)
    g = np.random.default_rng(3)
    qw, kw = (jnp.asarray(g.standard_normal((2, 3, 23)), jnp.float32) for _ in range(2))
    library = jax.jit(lambda c, a, b: cpu.cpu_reduce(c, np.arange(3), how, a, b))
    assert "implicit_attn_las_dense" in library.lower(core, qw, kw).as_text()
    A = ref_core(core)  # >= 0: abs is the identity on it
    want = np.einsum("bhi,bhij,bhj->bij", np.asarray(qw, np.float64), A, np.asarray(kw, np.float64))
    got = np.asarray(library(core, qw, kw))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    R = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 23, 23))
    dense = lambda c, impl: cpu.cpu_dense(c, np.arange(3)) if impl == "cpu" else c.dense(jnp.arange(3))
    grads = [jax.jit(jax.grad(lambda c: jnp.sum(dense(c, impl) * R), allow_int=True))(core) for impl in ("cpu", "xla")]
    np.testing.assert_allclose(grads[0].q, grads[1].q, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[0].k, grads[1].k, rtol=1e-5, atol=1e-6)
    loss = lambda d: (lambda c: jnp.sum(blocked_reduce(c, jnp.arange(3), qw, kw, how, 2, dense=d) ** 2))
    grads = [jax.jit(jax.grad(loss(d), allow_int=True))(core) for d in (cpu.cpu_dense, None)]
    np.testing.assert_allclose(grads[0].q, grads[1].q, rtol=1e-5, atol=1e-6)


def test_pallas_reduce_against_float64():
    """The Pallas kernel's fused reduce (interpret mode, tiles of 8) against the float64 sum over
    heads of ``qw H kw``, every mode."""
    core = random_core(21, alibi=True, chunk=9, align="centered", heads=3)
    g = np.random.default_rng(5)
    qw, kw = (jnp.asarray(g.standard_normal((2, 3, 21)), jnp.float32) for _ in range(2))
    A = ref_core(core)
    want = np.einsum("bhi,bhij,bhj->bij", np.asarray(qw, np.float64), A, np.asarray(kw, np.float64))
    for how in ("mean", "abs_mean", "pos_mean"):  # H >= 0: every mode is the identity on it
        got = np.asarray(pallas_reduce(core, np.arange(3), how, qw, kw, tile=8))
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), how


@pytest.mark.parametrize("T", [8, 16])
def test_pallas_kernel_skips_exactly_the_column_tiles_no_row_sees(T):
    """``Plan.first_key_tile``, from which the Pallas kernels start their rows' statistics and
    below which they write zero tiles without forming them: for every row tile, the tile of the
    first nonzero column of XLA's matrices in any of its rows (LaS-chunk blocks; local attention's
    window), no later (that would drop entries) and no earlier (tiles of zeros formed)."""
    L = 61

    def check(core, plan):
        nonzero = np.asarray(core.dense(jnp.arange(core.num_channels))) != 0  # (B, n, L, L)
        assert nonzero[..., np.arange(L), np.arange(L)].all()
        first_key = nonzero.argmax(axis=-1).min(axis=(0, 1))
        for I in range(-(-L // T)):  # the plan's vec is empty until the row statistics
            rows = slice(I * T, min(I * T + T, L))
            assert int(plan.first_key_tile(jnp.int32(I))) == first_key[rows].min() // T, I

    for chunk in (None, 5, 7, 8, 16, 40, 64):
        core = random_core(L, alibi=True, chunk=chunk, align="centered")
        check(core, plans.plan_las(core, np.arange(3), T))
    g = np.random.default_rng(0)
    q = jnp.asarray(g.standard_normal((1, 2, L, 4)), jnp.float32)
    for window in (1, 11, 16, 17, 61, 200):
        core = AttentionCore(q=q, k=q[:, :1], seg=jnp.zeros((1, L), jnp.int32), window=window)
        check(core, plans.plan_attention(core, np.arange(2), T))


def test_auto_takes_the_cpu_kernel(blocks, x, monkeypatch):
    """On CPU ``auto`` takes the CPU kernel; the Pallas kernel is verified on no accelerator, so
    ``auto`` keeps XLA there (``tests/test_dispatch.py``)."""
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 0)
    core = blocks["las"].as_operator(x).core
    assert pallas.has_kernel(core) and not pallas.trusted(core)
    assert resolve_impl("auto", core) == ("cpu" if jax.default_backend() == "cpu" else "xla")


# ----------------------------------------------------------------------------- the LM and explain

@pytest.fixture(scope="module")
def lm():
    cfg = las.Config.variant("las", vocab_size=V, hidden_size=D, num_attention_heads=H, num_hidden_layers=2, B=0.5)
    return las.init(cfg, 0)


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(4).integers(0, V, (2, 9))


def test_lm_operators_hooks_and_causality(lm, ids):
    logits = np.asarray(lm(ids))
    assert logits.shape == (2, 9, V) and np.isfinite(logits).all()
    ops = lm.operators(ids)
    assert len(ops) == 2 and all(op.relative_error() < 1e-6 for op in ops)
    assert ops[0].materialize().shape == (2, H, 9, 9)
    names = ["blocks.1.mixer.hook_out", "blocks.1.mixer.hook_pattern", "blocks.0.hook_resid_mid"]
    lg, cache = lm.run_with_cache(ids, names=names)
    np.testing.assert_allclose(np.asarray(lg), logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cache["blocks.1.mixer.hook_out"]), np.asarray(ops[1].output), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache["blocks.1.mixer.hook_pattern"]), np.asarray(ops[1].materialize()))
    moved = ids.copy()
    moved[:, 6] = (moved[:, 6] + 1) % V
    np.testing.assert_array_equal(np.asarray(lm(moved))[:, :6], logits[:, :6])
    ko = np.asarray(lm.knockout(ids, layer=1, keys=[2], channels=[0, 1]))
    assert ko.shape == logits.shape and not np.allclose(ko[:, 3:], logits[:, 3:])
    np.testing.assert_allclose(ko[:, :2], logits[:, :2], atol=1e-5)


def test_explain_runs_on_the_lm(lm, ids):
    maps = model_maps(lm, ids, how="abs_mean")
    assert maps.shape == (2, 2, 9, 9) and np.isfinite(np.asarray(maps)).all()
    assert head_maps(lm.operators(ids, layers=[0])[0]).shape == (2, H, 9, 9)
    for method in ("rollout", "attribution"):
        ex = explain(lm, ids, method=method)
        assert ex.relevance.shape == (2, 9) and np.isfinite(np.asarray(ex.relevance)).all()
        assert ex.layer_maps.shape == (2, 2, 9, 9)
    ex = explain(lm, ids, method="rollout", query=4)
    assert not np.any(np.asarray(ex.relevance)[:, 5:])            # nothing after the query


def test_classifier_save_load_and_explain(tmp_path, ids):
    cfg = las.Config.variant("las_chunk", vocab_size=V, hidden_size=D, num_attention_heads=H, num_hidden_layers=1,
                             num_labels=3, chunk=4, alphas=(0.0, 0.1, 0.2, 0.4))
    model = las.init(cfg, 1)
    logits = np.asarray(model(ids))
    assert logits.shape == (2, 9, 3)
    np.testing.assert_array_equal(np.asarray(model.classify(ids)), logits[:, -1])
    moved = ids.copy()
    moved[:, 5] = (moved[:, 5] + 1) % V
    np.testing.assert_array_equal(np.asarray(model(moved))[:, :5], logits[:, :5])   # causal mean pooling
    las.save(tmp_path / "m", model)
    back = las.load(tmp_path / "m")
    assert back.config == cfg
    np.testing.assert_array_equal(np.asarray(back(ids)), logits)
    ex = explain(back, ids, method="attribution", target=np.array([0, 2]))
    assert ex.relevance.shape == (2, 9)
    last = las.init(las.Config(**{**cfg.__dict__, "classifier_pooling": "last"}), 1)
    assert last(ids).shape == (2, 9, 3)
    with pytest.raises(ValueError, match="classifier"):
        las.init(las.Config(vocab_size=V, hidden_size=D, num_hidden_layers=1), 0).classify(ids)
    cpath = tmp_path / "m" / "config.json"
    d = json.loads(cpath.read_text())
    cpath.write_text(json.dumps({**d, "hidden_size": 8}))
    with pytest.raises(CheckpointError, match="shape"):
        las.load(tmp_path / "m")
    cpath.write_text(json.dumps({**d, "model_type": "mamba"}))
    with pytest.raises(CheckpointError, match="model_type"):
        las.load(tmp_path / "m")
    cpath.write_text(json.dumps({**d, "pool": 4}))
    with pytest.raises(CheckpointError, match="odd"):
        las.load(tmp_path / "m")


def test_exports_for_accelerators(lm, ids):
    """The forward and the operator (materialize, reduce with impl="auto") lower for CUDA and
    TPU from this machine as plain XLA: no custom call (no CPU kernel), no host callback."""
    cfg, params = lm.config, lm.params()

    def operator_maps(i):
        x = las.lm_forward(params, i, cfg, capture=("blocks.1.mixer.hook_in",))[1]["blocks.1.mixer.hook_in"]
        op = las.mixer_operator(params["layers"][1]["mixer"], x, cfg)
        return op.materialize(), op.reduce("abs_mean", impl="auto"), op.output

    arg = jax.ShapeDtypeStruct(ids.shape, jnp.int32)
    for f in (lambda i: las.lm_forward(params, i, cfg)[0], operator_maps):
        for platform in ("cuda", "tpu"):
            text = jax.export.export(jax.jit(f), platforms=[platform])(arg).mlir_module()
            assert "custom_call" not in text and "callback" not in text, platform
