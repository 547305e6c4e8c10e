"""The shared pure functions against float64 brute force and torch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.operator.base import sparse_product
from implicit_attn.ops import (any_in_batch, attention_output, causal_conv, conv_matrix, conv_right, decay_matrix,
                               decayed_scores, linear_scan, most_in_batch, query_blocks, scalar_decay_kernel,
                               segment_sum, state_decay_kernel, zero_mapped_with)


def brute_segsum(t):
    L = t.shape[-1]
    out = np.full(t.shape + (L,), -np.inf)
    for i in range(L):
        for j in range(i + 1):
            out[..., i, j] = t[..., j + 1:i + 1].sum(-1)
    return out


def test_segment_sum_matches_brute_force(rng):
    t = rng.normal(size=(2, 3, 11))
    got = np.asarray(segment_sum(jnp.asarray(t, jnp.float32)))
    ref = brute_segsum(t)
    assert np.array_equal(np.isinf(got), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_decay_matrix_is_exactly_causal_and_handles_reset():
    log_a = jnp.array([-0.1, -0.2, -jnp.inf, -0.3, -0.4])
    d = np.asarray(decay_matrix(log_a))
    assert np.all(np.triu(d, 1) == 0)
    assert np.allclose(np.diag(d), 1.0)
    # The reset at position 2 cuts every path that crosses it, exactly.
    assert np.all(d[2:, :2] == 0)
    assert np.isclose(d[4, 2], np.exp(-0.7), rtol=1e-6)
    assert not np.any(np.isnan(d))


def test_decay_matrix_over_chunks_matches_float64_with_reset_and_nan(rng):
    """Longer than a chunk (left of the diagonal blocks a product of three exponentials): against
    the float64 exponential of the brute-force sums, a reset (-inf) and a NaN included (NaN exactly
    on the entries whose segment holds it), exact zeros above the diagonal."""
    L = 150
    t = -np.abs(rng.normal(size=(2, L))) * 0.2
    t[0, 40] = -np.inf
    t[1, 90] = np.nan
    got = np.asarray(decay_matrix(jnp.asarray(t, jnp.float32), chunk=32), np.float64)
    with np.errstate(invalid="ignore"):
        ref = np.exp(brute_segsum(t))
    nan = np.isnan(ref)
    assert nan[1].any() and not nan[0].any()
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert np.all(np.triu(got, 1) == 0) and np.all(got[0, 40:, :40] == 0)
    np.testing.assert_allclose(got[~nan], ref[~nan], rtol=1e-5, atol=1e-7)


def test_decay_matrix_with_growth_takes_the_sum():
    """32 increments of +4 after 32 of -4: the segment across both decays by exp(0) = 1, while the
    chunk factors alone would be exp(+128) (inf in float32) and exp(-128) (0)."""
    t = np.zeros(96)
    t[32:64], t[64:] = -4.0, 4.0
    got = np.asarray(decay_matrix(jnp.asarray(t, jnp.float32), chunk=32))
    with np.errstate(over="ignore"):
        ref = np.exp(brute_segsum(t)).astype(np.float32)  # inf where float32 overflows
    fin = np.isfinite(ref)
    assert got[95, 31] == 1.0 and not fin.all()
    np.testing.assert_array_equal(np.isfinite(got), fin)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-37)  # XLA flushes subnormals


def test_segment_sum_precise_at_long_length():
    # A global cumsum difference loses ~eps*|S| here; the masked cumsum does not.
    L = 4096
    t = np.full(L, 0.37)
    got = np.asarray(segment_sum(jnp.asarray(t, jnp.float32))[-1, -2])
    assert abs(got - 0.37) < 1e-6


@pytest.mark.parametrize("L, chunk", [(37, 8), (130, 64)])
def test_decayed_scores_match_float64(L, chunk):
    """``exp(F[i, j] + row_i + col_j) (q_i . k_j)`` by block factors equals the float64 entries of the
    same float32 inputs (each to the float32 rounding of its exponent and of its dot product, plus
    1e-5 of itself and of its row's largest): strong decays, resets
    (``-inf``), column weights from -60 to 60 with rows stabilised by their maxima (the mLSTM's
    ``-m``), and without row and column weights."""
    rng = np.random.default_rng(L)  # its own draws: the session generator's depend on test order
    f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)
    q, k = f32(rng.normal(size=(2, 3, L, 5))), f32(rng.normal(size=(2, 3, L, 5)))
    log_a = f32(-np.abs(rng.normal(size=(2, 3, L))) * rng.choice([0.01, 1.0, 30.0], size=(2, 3, L)))
    log_a[0, 0, L // 2] = -np.inf
    col = f32(rng.uniform(-60, 60, size=(2, 3, L)))
    seg = brute_segsum(log_a)
    row = f32(-np.max(seg + col[..., None, :], axis=-1))
    for r, c in ((row, col), (None, None)):
        expo = seg + (0 if r is None else r[..., :, None]) + (0 if c is None else c[..., None, :])
        want = np.exp(expo) * np.einsum("...id,...jd->...ij", q, k)
        arg = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
        got = np.asarray(decayed_scores(arg(q), arg(k), arg(log_a), arg(r), arg(c), chunk), np.float64)
        assert np.all(np.triu(got, 1) == 0)
        # float32 rounding of the exponent's terms: a relative error of ~ulp * (|F| + |row| + |col|)
        terms = (np.where(np.isfinite(seg), np.abs(seg), 0) + (0 if r is None else np.abs(r)[..., :, None])
                 + (0 if c is None else np.abs(c)[..., None, :]))
        scale = np.abs(want).max(-1, keepdims=True)
        # and of the float32 dot product, ~ulp * sum_d |q_d k_d| (q . k may cancel to far below that)
        dot = 8 * 2.0 ** -24 * np.exp(expo) * np.einsum("...id,...jd->...ij", np.abs(q), np.abs(k))
        tol = (1e-5 + 8 * 2.0 ** -24 * terms) * np.abs(want) + 1e-5 * scale + dot
        assert np.all(np.abs(got - want) <= tol)


@pytest.mark.parametrize("K, L", [(1, 9), (2, 9), (4, 9), (4, 2), (4, 1)])
def test_causal_conv_matches_torch_and_matrix(rng, K, L):
    """Also shorter than the filter (L < K - 1: some taps see only the zeros before the start)."""
    torch = pytest.importorskip("torch")
    B, C = 2, 5
    x = rng.normal(size=(B, L, C)).astype(np.float32)
    w = rng.normal(size=(C, K)).astype(np.float32)
    b = rng.normal(size=(C,)).astype(np.float32)
    conv = torch.nn.Conv1d(C, C, K, groups=C, padding=K - 1)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor(w[:, None, :]))
        conv.bias.copy_(torch.tensor(b))
        ref = conv(torch.tensor(x).transpose(1, 2))[..., :L].transpose(1, 2).numpy()
    np.testing.assert_allclose(np.asarray(causal_conv(x, w, b)), ref, rtol=1e-5, atol=1e-5)
    M = np.asarray(conv_matrix(w, L))
    np.testing.assert_allclose(np.einsum("cij,bjc->bic", M, x) + b, ref, rtol=1e-5, atol=1e-5)
    H = rng.normal(size=(B, C, L, L)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(conv_right(H, w)), H @ M[None], rtol=1e-5, atol=1e-5)


def attention64(q, k, v, seg, window):
    """Float64 masked softmax attention from the definition, query head h reading key/value
    head h // (H / KV): key j visible to query i iff j <= i, i - j < window, same document."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    B, H, L, _ = q.shape
    rep = H // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    mask = ((j <= i) & (i - j < window))[None, None] & (seg[:, None, :, None] == seg[:, None, None, :])
    s = np.where(mask, q @ np.swapaxes(k, -1, -2), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("L, window, H, KV", [(300, 2 ** 31 - 1, 4, 2), (300, 50, 2, 2), (129, 7, 3, 1),
                                              (5, 3, 2, 1)])
def test_attention_output_matches_float64_softmax(rng, L, window, H, KV):
    """Blocks of queries (several of them for L > 128, a last short one), windows shorter than
    a block, grouped keys, two documents in one row, values wider than keys."""
    B, d, e = 2, 8, 12
    q = rng.normal(size=(B, H, L, d)).astype(np.float32)
    k = rng.normal(size=(B, KV, L, d)).astype(np.float32)
    v = rng.normal(size=(B, KV, L, e)).astype(np.float32)
    seg = np.zeros((B, L), np.int32)
    seg[1, L // 3:] = 1
    got = np.asarray(attention_output(q, k, v, seg, window))
    assert got.shape == (B, H, L, e) and got.dtype == np.float32
    np.testing.assert_allclose(got, attention64(q, k, v, seg, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L, window", [(1, 4), (128, 2 ** 31 - 1), (300, 2 ** 31 - 1), (300, 50), (5000, 1000)])
def test_query_blocks_cover_every_query_and_visible_key(L, window):
    blocks = query_blocks(L, window)
    assert [s for s, _, _ in blocks] == [0] + [e for _, e, _ in blocks[:-1]] and blocks[-1][1] == L
    assert len(blocks) <= 8
    for s, e, lo in blocks:
        assert s < e and lo == max(0, s - window + 1)  # the block's first query's earliest visible key


def test_attention_output_rejects_mismatched_heads(rng):
    q = rng.normal(size=(1, 3, 4, 2)).astype(np.float32)
    k = rng.normal(size=(1, 2, 4, 2)).astype(np.float32)
    with pytest.raises(ValueError, match="do not match"):
        attention_output(q, k, k, np.zeros((1, 4), np.int32), 8)


def test_linear_scan_matches_loop(rng):
    a = rng.uniform(0, 1, size=(2, 17, 3)).astype(np.float32)
    b = rng.normal(size=(2, 17, 3)).astype(np.float32)
    h0 = rng.normal(size=(2, 3)).astype(np.float32)
    got = np.asarray(linear_scan(a, b, axis=1, h0=h0))
    h, ref = h0.astype(np.float64), []
    for t in range(17):
        h = a[:, t] * h + b[:, t]
        ref.append(h)
    np.testing.assert_allclose(got, np.stack(ref, 1), rtol=1e-5, atol=1e-5)


def brute_state_kernel(q, k, A, dt):
    S = np.cumsum(dt.astype(np.float64), -1)
    B, c, L = dt.shape
    out = np.zeros((B, c, L, L))
    for i in range(L):
        for j in range(i + 1):
            T = S[:, :, i] - S[:, :, j]
            out[:, :, i, j] = np.einsum("bn,bn,bcn->bc", q[:, i], k[:, j], np.exp(A[None] * T[..., None]))
    return out


@pytest.mark.parametrize("L,chunk", [(1, 16), (7, 16), (37, 8), (48, 16)])
def test_state_decay_kernel_matches_brute_force(rng, L, chunk):
    B, N, c = 2, 4, 3
    q = rng.normal(size=(B, L, N)).astype(np.float32)
    k = rng.normal(size=(B, L, N)).astype(np.float32)
    A = -np.exp(rng.normal(size=(c, N))).astype(np.float32)
    dt = np.log1p(np.exp(rng.normal(size=(B, c, L)))).astype(np.float32)
    got = np.asarray(state_decay_kernel(q, k, A, dt, chunk=chunk))
    ref = brute_state_kernel(q, k, A, dt)
    assert np.all(np.triu(got, 1) == 0)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6 * np.abs(ref).max())


def test_scalar_decay_kernel_matches_brute_force(rng):
    B, G, L, N = 2, 3, 13, 5
    log_a = -rng.uniform(0, 1, size=(B, G, L))
    q = rng.normal(size=(B, G, L, N))
    k = rng.normal(size=(B, G, L, N))
    got = np.asarray(scalar_decay_kernel(jnp.asarray(log_a, jnp.float32), q.astype(np.float32),
                                         k.astype(np.float32)))
    ref = np.exp(brute_segsum(log_a)) * np.einsum("bgin,bgjn->bgij", q, k)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    rank1 = np.asarray(scalar_decay_kernel(jnp.asarray(log_a, jnp.float32)))
    np.testing.assert_allclose(rank1, np.exp(brute_segsum(log_a)), rtol=1e-5, atol=1e-6)


def test_state_decay_kernel_differentiable(rng):
    B, L, N, c = 1, 10, 3, 2
    q = jnp.asarray(rng.normal(size=(B, L, N)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, L, N)), jnp.float32)
    A = -jnp.exp(jnp.asarray(rng.normal(size=(c, N)), jnp.float32))
    dt = jnp.asarray(rng.uniform(0.1, 1.0, size=(B, c, L)), jnp.float32)
    W = jnp.asarray(rng.normal(size=(B, c, L, L)), jnp.float32)
    f = jax.jit(lambda d: jnp.sum(W * state_decay_kernel(q, k, A, d, chunk=4)))
    g = jax.jit(jax.grad(f))(dt)
    v = jnp.asarray(rng.normal(size=dt.shape), jnp.float32)
    eps = 1e-2
    fd = (f(dt + eps * v) - f(dt - eps * v)) / (2 * eps)
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(float(jnp.sum(g * v)), float(fd), rtol=2e-2)


def test_nan_reach_pass_stays_one_branch_under_vmap():
    """``operator.sparse_product`` runs its NaN-reach pass only where a value holds a NaN; under
    ``jax.vmap`` the predicate is one for the batch (``ops.any_in_batch``), so the program keeps
    its branch (a batched predicate made it a select that ran the pass always), and with a NaN in
    one example each example's result is its own unmapped one, bit for bit."""
    g = np.random.default_rng(0)
    H = jnp.asarray(np.tril(g.standard_normal((2, 1, 3, 6, 6))).astype(np.float32))  # (mapped, B, C, L, L)
    v = g.standard_normal((2, 1, 3, 6)).astype(np.float32)
    v[1, 0, 0, 4] = np.nan  # example 1, channel 0, position 4
    f = lambda H, v: sparse_product("bcij,bcj->bci", H, v)
    mapped = jax.jit(jax.vmap(f))
    assert "stablehlo.case" in mapped.lower(H, v).as_text()
    out = np.asarray(mapped(H, v))
    for k in range(2):
        np.testing.assert_array_equal(out[k], np.asarray(f(H[k], jnp.asarray(v[k]))))
    assert np.isnan(out[1, 0, 0, 4:]).all() and not np.isnan(out[1, 0, 0, :4]).any() and not np.isnan(out[0]).any()
    # the predicate itself: unchanged alone, the OR over the mapped axis (unbatched) under vmap
    assert bool(any_in_batch(jnp.array(False))) is False
    np.testing.assert_array_equal(jax.vmap(lambda b: any_in_batch(b) & True)(jnp.array([False, True])), [True, True])


def test_most_in_batch_keeps_a_switch_under_vmap():
    """``ops.most_in_batch``: an int as it is alone; under ``jax.vmap`` the maximum over the mapped
    axis, unbatched, so a ``lax.switch`` on it stays one switch (``stablehlo.case``), not a select
    over every branch, and reverse mode through the batched switch works."""
    assert int(most_in_batch(jnp.array(3))) == 3
    np.testing.assert_array_equal(jax.vmap(lambda i: most_in_batch(i) + 0)(jnp.array([1, 4, 2])), [4, 4, 4])
    branches = [lambda x: x, lambda x: 2 * x, lambda x: 3 * x]
    f = lambda i, x: jax.lax.switch(most_in_batch(i), branches, x)
    text = jax.jit(jax.vmap(f)).lower(jnp.array([0, 1]), jnp.ones(2)).as_text()
    assert "stablehlo.case" in text and "select" not in text
    np.testing.assert_array_equal(jax.vmap(f)(jnp.array([0, 1]), jnp.ones(2)), [2.0, 2.0])
    g = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(jax.jvp, (None, 0, 0))(
        lambda x: f(jnp.array(2), x), (x,), (x,))[1])))(jnp.ones(2))
    np.testing.assert_array_equal(g, [3.0, 3.0])


def test_zero_mapped_with_maps_an_operand_and_is_dropped_alone():
    """``ops.zero_mapped_with``: ``0.0`` alone, which XLA drops from ``w * (1 + zero)`` (no
    multiply left in the compiled program); under ``jax.vmap`` one zero per example where any
    value is mapped, unmapped where none is."""
    x, w = jnp.ones((2, 3)), jnp.full((3,), 2.0)
    assert float(zero_mapped_with(x)) == 0.0
    scaled = lambda x, w: w * (1 + zero_mapped_with(jax.lax.stop_gradient(x)))
    hlo = jax.jit(scaled).lower(x[0], w).compile().as_text()
    assert "multiply" not in hlo, hlo
    out = jax.vmap(scaled, (0, None))(x, w)
    assert out.shape == (2, 3) and np.asarray(out).tolist() == [[2.0] * 3] * 2
    assert jax.vmap(lambda x: zero_mapped_with(x, jnp.int32(1)))(x).shape == (2,)
    # mapped or not, seen from a branch on it: unmapped it stays a branch, mapped it becomes a select
    branch = lambda x, y: jax.lax.cond(zero_mapped_with(y) == 0, lambda: x, lambda: 2 * x)
    lowered = lambda in_axes, y: jax.jit(jax.vmap(branch, in_axes)).lower(x, y).as_text()
    assert "stablehlo.case" in lowered((0, None), jnp.ones(3))
    assert "stablehlo.case" not in lowered((0, 0), jnp.ones((2, 3)))


def test_decay_matrix_stays_one_branch_under_vmap():
    """``decay_matrix`` longer than a chunk takes the product form unless an increment is positive;
    under ``jax.vmap`` that predicate is one for the batch (``ops.any_in_batch``), so the program
    keeps its branch (a batched predicate made it a select computing both forms for every
    example). Every example's matrix is float64's, whichever form the batch took."""
    g = np.random.default_rng(1)
    log_a = -np.abs(g.standard_normal((2, 3, 80))).astype(np.float32) * 0.1  # (mapped, H, L)
    mapped = jax.jit(jax.vmap(lambda t: decay_matrix(t, chunk=16)))
    assert "stablehlo.case" in mapped.lower(jnp.asarray(log_a)).as_text()
    cum = lambda t: np.cumsum(t.astype(np.float64), -1)
    for positive in (False, True):
        t = log_a.copy()
        if positive:
            t[1, 0, 10] = 0.5  # example 1 grows once: the whole batch takes exp of each entry's sum
        c = cum(t)
        want = np.tril(np.exp(np.tril(c[..., :, None] - c[..., None, :])))
        got = np.asarray(mapped(jnp.asarray(t)))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
        assert not np.triu(got, 1).any()
        for k in range(2):
            np.testing.assert_allclose(got[k], np.asarray(decay_matrix(jnp.asarray(t[k]), chunk=16)), rtol=2e-5, atol=1e-7)
