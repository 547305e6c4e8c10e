"""``nn.moe.experts_forward``'s CPU paths against float64 loops over the chosen experts: the XLA
loop (chunks of at most ``block`` rows, row counts rounded up to ``granule``) and the grouped-product
kernels (``kernels.cpu.grouped_matmul_from_tokens`` and ``grouped_matmul_to_tokens`` on
``ops.expert_columns``' layout); the layout (``ops.expert_order``, ``expert_packs``, ``expert_columns``)
and both kernels against float64."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.kernels import cpu
from implicit_attn.nn.moe import experts_forward, gated_act
from implicit_attn.ops import (expert_columns, expert_order, expert_packs, grouped, grouped_matmul_from_tokens,
                               grouped_matmul_to_tokens)

T, D, F, E, k = 23, 5, 3, 4, 2


def silu_glu64(u):
    g, up = u[:F], u[F:]
    return g / (1 + np.exp(-g)) * up


def reference(x, weights, experts, w_in, w_out):
    """The float64 loop ``sum_j weights[t, j] * w_out[e] @ act(w_in[e] @ x[t])``."""
    out = np.zeros((len(x), w_out.shape[1]))
    for t in range(len(x)):
        for e, w in zip(experts[t], weights[t]):
            out[t] += w * (w_out[e] @ silu_glu64(w_in[e] @ x[t]))
    return out


def case(seed: int, route: str):
    g = np.random.default_rng(seed)
    x = g.standard_normal((T, D))
    w_in, w_out = g.standard_normal((E, 2 * F, D)), g.standard_normal((E, D, F))
    experts = {"uniform": g.integers(0, E, (T, k)), "one_expert": np.full((T, k), 2),
               "skewed": np.stack([np.zeros(T, int), g.integers(1, 3, T)], 1),
               "last_empty": g.integers(0, E - 1, (T, k))}[route]
    return x, g.random((T, k)), experts, w_in, w_out


def run(x, weights, experts, w_in, w_out, **kw):
    f32 = [np.asarray(a, np.float32) for a in (x, weights, w_in, w_out)]
    return np.asarray(experts_forward(f32[0], f32[1], experts.astype(np.int32), f32[2], f32[3],
                                      gated_act(jax.nn.silu), **kw))


@pytest.mark.parametrize("route", ["uniform", "one_expert", "skewed", "last_empty"])
@pytest.mark.parametrize("block,granule", [(256, 32), (8, 3), (1, 32)])
def test_chunks_of_any_size_match_the_float64_loop(route, block, granule):
    """Groups shorter and longer than a chunk, chunks whose row count is not a multiple of
    the granule, a granule larger than the chunk, empty experts (also the last)."""
    a = case(0, route)
    np.testing.assert_allclose(run(*a, block=block, granule=granule, impl="xla"), reference(*a), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("block,granule", [(256, 32), (8, 3)])
def test_nan_token_stays_in_its_row(block, granule):
    """Chunks run rows past their group (with the wrong expert's weights, later overwritten):
    a NaN token must still reach only its own output row."""
    x, w, e, wi, wo = case(1, "uniform")
    for bad in (0, 7, T - 1):
        xb = x.copy()
        xb[bad, 1] = np.nan
        nan_rows = np.isnan(run(xb, w, e, wi, wo, block=block, granule=granule, impl="xla")).any(-1)
        assert nan_rows[bad] and nan_rows.sum() == 1


# (16, 2): the derivatives' row counts (2, 4, 8, 16) are not the forward's (2, 4, ..., 16), and
# chunks run up to 4 rows past their group
@pytest.mark.parametrize("block,granule", [(8, 3), (16, 2)])
@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_gradients_match_a_dense_float64_formula(impl, block, granule):
    """Reverse mode through the chunk loop with the row counts doubled (the derivatives of both
    paths): d(sum out * c)/d(x, w_in, w_out) equal to the gradient of a dense float64 formula
    (every expert on every token, masked)."""
    x, w, e, wi, wo = case(2, "skewed")
    c = np.random.default_rng(3).standard_normal((T, D))
    mask = np.zeros((T, E))
    for t in range(T):
        for j in range(k):
            mask[t, e[t, j]] += w[t, j]

    def dense(x, wi, wo):
        u = jnp.einsum("efd,td->tef", wi, x)
        h = jax.nn.silu(u[..., :F]) * u[..., F:]
        return jnp.sum(jnp.einsum("edf,tef,te->td", wo, h, mask) * c)

    def ours(x, wi, wo):
        return jnp.sum(experts_forward(x, jnp.asarray(w, jnp.float32), jnp.asarray(e, jnp.int32), wi, wo,
                                       gated_act(jax.nn.silu), block=block, granule=granule, impl=impl) * c)

    with jax.enable_x64():
        want = jax.jit(jax.grad(dense, argnums=(0, 1, 2)))(x, wi, wo)
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(*(jnp.asarray(a, jnp.float32) for a in (x, wi, wo)))
    for g_, w_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(g_), np.asarray(w_), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [dict(block=0), dict(granule=0)])
def test_bad_chunk_sizes_are_named(bad):
    with pytest.raises(ValueError, match="block and granule"):
        run(*case(0, "uniform"), **bad)


@pytest.mark.parametrize("bad", [dict(impl="pallas"), dict(impl="gpu")])
def test_bad_impl_is_named(bad):
    with pytest.raises(ValueError, match="impl must be"):
        run(*case(0, "uniform"), **bad)


def test_kernel_path_needs_float32():
    x, w, e, wi, wo = case(0, "uniform")
    with pytest.raises(ValueError, match="float32"):
        experts_forward(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.float32), jnp.asarray(e, jnp.int32),
                        jnp.asarray(wi, jnp.bfloat16), jnp.asarray(wo, jnp.bfloat16), gated_act(jax.nn.silu),
                        impl="cpu")


@pytest.mark.parametrize("route", ["uniform", "one_expert", "skewed", "last_empty"])
def test_kernel_path_matches_the_float64_loop(route):
    """The packed layout and both grouped products: groups shorter than a pack and spanning
    several, empty experts (also the last), one expert holding every copy."""
    a = case(4, route)
    np.testing.assert_allclose(run(*a, impl="cpu"), reference(*a), rtol=1e-5, atol=1e-5)
    big = (np.repeat(a[0], 5, 0), np.repeat(a[1], 5, 0), np.repeat(a[2], 5, 0), *a[3:])  # 115 tokens
    np.testing.assert_allclose(run(*big, impl="cpu"), reference(*big), rtol=1e-5, atol=1e-5)


def test_kernel_path_keeps_a_nan_token_in_its_row():
    x, w, e, wi, wo = case(1, "uniform")
    for bad in (0, 7, T - 1):
        xb = x.copy()
        xb[bad, 1] = np.nan
        nan_rows = np.isnan(run(xb, w, e, wi, wo, impl="cpu")).any(-1)
        assert nan_rows[bad] and nan_rows.sum() == 1


def test_kernel_path_forward_mode_matches_the_loop():
    """``jax.jvp`` through the kernel path: its tangents are the loop's."""
    x, w, e, wi, wo = (jnp.asarray(a, jnp.float32) if a.dtype.kind == "f" else jnp.asarray(a, jnp.int32)
                       for a in case(5, "uniform"))
    t = tuple(jnp.asarray(np.random.default_rng(6).standard_normal(a.shape), jnp.float32) for a in (x, wi, wo))
    f = lambda impl: (lambda x, wi, wo: experts_forward(x, w, e, wi, wo, gated_act(jax.nn.silu), impl=impl))
    (y1, d1), (y2, d2) = jax.jvp(f("cpu"), (x, wi, wo), t), jax.jvp(f("xla"), (x, wi, wo), t)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d1), np.asarray(d2), rtol=1e-5, atol=1e-5)


def test_kernel_path_lowers_the_kernel_on_cpu_only():
    """``auto`` takes the kernel here (the tests' size threshold is 0); an export for cuda or tpu
    runs ``ragged_dot`` and holds no library call."""
    from jax import export

    x, w, e, wi, wo = (jnp.asarray(a, jnp.float32) if a.dtype.kind == "f" else jnp.asarray(a, jnp.int32)
                       for a in case(0, "uniform"))
    f = jax.jit(lambda x: experts_forward(x, w, e, wi, wo, gated_act(jax.nn.silu)))
    text = f.lower(x).as_text()
    assert text.count("implicit_attn_grouped_from_tokens") == 1 and text.count("implicit_attn_grouped_to_tokens") == 1
    for platform in ("cuda", "tpu"):
        text = export.export(f, platforms=[platform])(x).mlir_module()
        assert "implicit_attn_" not in text and "ragged_dot" in text, platform


@pytest.mark.parametrize("route", ["uniform", "skewed", "last_empty"])
def test_expert_packs_put_each_copy_in_its_experts_pack(route):
    """Slots are distinct, each in a pack of its copy's expert, an expert's copies in order from the
    start of its first pack; the packs after the copies belong to no expert."""
    e = np.sort(case(7, route)[2].reshape(-1))
    E_ = 4
    sizes = np.bincount(e, minlength=E_)
    for tile in (1, 3, 32):
        slot, owner = (np.asarray(a) for a in expert_packs(jnp.asarray(sizes), e.size, tile))
        assert owner.shape == (-(-(e.size + E_ * (tile - 1)) // tile),)
        assert len(set(slot)) == e.size and np.array_equal(owner[slot // tile], e)
        firsts = np.searchsorted(e, np.arange(E_))
        assert np.array_equal(slot % tile, (np.arange(e.size) - firsts[e]) % tile)
        used = -(-sizes // tile)
        assert np.array_equal(owner, np.concatenate([np.repeat(np.arange(E_), used),
                                                     np.full(owner.size - used.sum(), -1)]))


@pytest.mark.parametrize("limit", [2 ** 31, 0])
def test_expert_order_is_the_stable_argsort(monkeypatch, limit):
    """The sort of integer keys (and the stable argsort where keys would not fit: ``limit`` 0)
    gives numpy's stable order; ``rank`` is its inverse, ``sizes`` the counts; under jit too."""
    monkeypatch.setattr(grouped, "SORT_KEY_LIMIT", limit)
    g = np.random.default_rng(13)
    for n, E_ in ((1, 1), (40, 3), (257, 16), (64, 64)):
        e = g.integers(0, E_, n).astype(np.int32)
        for f in (lambda e: expert_order(e, E_), jax.jit(lambda e: expert_order(e, E_))):
            order, rank, sizes = (np.asarray(a) for a in f(jnp.asarray(e)))
            assert np.array_equal(order, np.argsort(e, kind="stable"))
            assert np.array_equal(rank[order], np.arange(n))
            assert np.array_equal(sizes, np.bincount(e, minlength=E_)) and sizes.dtype == np.int32


@pytest.mark.parametrize("route", ["uniform", "skewed", "last_empty"])
def test_expert_columns_put_each_copy_in_its_experts_pack_in_copy_order(route):
    e = case(8, route)[2].reshape(-1)
    _, rank, sizes = expert_order(jnp.asarray(e, jnp.int32), 4)
    for tile in (1, 5, 32):
        col, owner = (np.asarray(a) for a in expert_columns(jnp.asarray(e), rank, sizes, tile))
        assert len(set(col)) == e.size and np.array_equal(owner[col // tile], e)
        slot, owner_sorted = (np.asarray(a) for a in expert_packs(sizes, e.size, tile))
        assert np.array_equal(col, slot[np.asarray(rank)]) and np.array_equal(owner, owner_sorted)
        for x in range(4):  # an expert's copies fill its packs from the start, in copy order
            c = col[e == x]
            assert np.array_equal(c, np.sort(c)) and (c.size == 0 or c[-1] - c[0] == c.size - 1)


def grouped_case(K, R, seed):
    """Packs owned by runs of one expert interleaved with other experts' and unowned packs; 29
    tokens with 3 copies each in random distinct columns (some in unowned packs, some columns
    empty)."""
    g = np.random.default_rng(seed)
    owner = jnp.asarray([2, 2, 0, -1, 2, 1, 1, 1, -1, -1], jnp.int32)
    Tn, kn = 29, 3
    col = g.permutation(owner.size * cpu.GROUP_TILE)[:Tn * kn].reshape(Tn, kn).astype(np.int32)
    x = g.standard_normal((Tn, K)).astype(np.float32)
    h = g.standard_normal((owner.size, K, cpu.GROUP_TILE)).astype(np.float32)
    w = g.standard_normal((3, R, K)).astype(np.float32)
    return x, h, jnp.asarray(col), g.random((Tn, kn)).astype(np.float32), owner, w


def from_tokens64(x, col, owner, w):
    out = np.zeros((owner.size, w.shape[1], cpu.GROUP_TILE))
    for t, c in np.ndindex(*col.shape):
        p, j = divmod(int(col[t, c]), cpu.GROUP_TILE)
        if owner[p] >= 0:
            out[p, :, j] = np.asarray(w[owner[p]], np.float64) @ np.asarray(x[t], np.float64)
    return out


def to_tokens64(h, col, weights, owner, w):
    out = np.zeros((col.shape[0], w.shape[1]))
    for t, c in np.ndindex(*col.shape):
        p, j = divmod(int(col[t, c]), cpu.GROUP_TILE)
        if owner[p] >= 0:
            out[t] += weights[t, c] * (np.asarray(w[owner[p]], np.float64) @ np.asarray(h[p, :, j], np.float64))
    return out


@pytest.mark.parametrize("K,R", [(70, 19), (1, 8), (128, 16), (33, 5), (16, 40), (48, 12), (4096, 40)])
def test_grouped_products_match_float64(K, R):
    """Both kernels and their XLA forms: row counts not a multiple of the kernels' 8, 12 or 16-row
    blocks, inner sizes below, at and past whole vectors of 16, copies in unowned packs. At K = 4096
    an expert's run of three packs is gathered two and one (1 MB of packs at a time), and each
    16-row block of weights (256 KB) is a pass of its own over the expert's packs."""
    x, h, col, weights, owner, w = grouped_case(K, R, K + R)
    grow = max(1.0, np.sqrt(K / 256))  # a float32 sum's rounding grows like the square root of its terms
    want = from_tokens64(x, np.asarray(col), np.asarray(owner), w)
    tol = 2e-6 * grow * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(cpu.grouped_matmul_from_tokens(x, col, owner, w)), want, atol=tol)
    xla_from = jax.jit(grouped_matmul_from_tokens, static_argnums=4)
    np.testing.assert_allclose(np.asarray(xla_from(x, col, owner, w, cpu.GROUP_TILE)), want, atol=tol)
    want = to_tokens64(h, np.asarray(col), weights, np.asarray(owner), w)
    tol = 4e-6 * grow * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(cpu.grouped_matmul_to_tokens(h, col, weights, owner, w)), want, atol=tol)
    np.testing.assert_allclose(np.asarray(jax.jit(grouped_matmul_to_tokens)(h, col, weights, owner, w)), want,
                               atol=tol)


def half_pack_case(K, R, seed):
    """Packs filled as ``ops.expert_columns`` fills them, from the first column: 10 copies (a half
    pack: the kernels multiply only its first 16 columns), 32, 17 (column 16 taken: a whole
    pack), exactly 16, and 3 in an unowned pack; 26 tokens with 3 copies each."""
    g = np.random.default_rng(seed)
    owner = jnp.asarray([1, 0, 0, 2, -1], jnp.int32)
    cols = np.concatenate([p * cpu.GROUP_TILE + np.arange(n) for p, n in enumerate([10, 32, 17, 16, 3])])
    col = g.permutation(cols).reshape(26, 3).astype(np.int32)
    x = g.standard_normal((26, K)).astype(np.float32)
    h = g.standard_normal((owner.size, K, cpu.GROUP_TILE)).astype(np.float32)
    w = g.standard_normal((3, R, K)).astype(np.float32)
    return x, h, jnp.asarray(col), g.random((26, 3)).astype(np.float32), owner, w


@pytest.mark.parametrize("K,R", [(70, 19), (128, 16), (16, 40)])
def test_grouped_products_of_half_packs_match_float64(K, R):
    """Packs whose copies all sit in the first 16 columns take half the work; their other columns
    are still written (zeros), also where the output's buffer held NaN before (jit reuses the
    freed buffer of an array of the same size); a pack with column 16 taken is a whole one."""
    x, h, col, weights, owner, w = half_pack_case(K, R, K + 2 * R)
    want = from_tokens64(x, np.asarray(col), np.asarray(owner), w)

    def after_nan(x, col, owner, w):
        junk = jnp.full(want.shape, jnp.nan, jnp.float32) * x[0, 0]
        return jnp.sum(junk), cpu.grouped_matmul_from_tokens(x, col, owner, w)

    for got in (cpu.grouped_matmul_from_tokens(x, col, owner, w), jax.jit(after_nan)(x, col, owner, w)[1]):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-6 * np.abs(want).max())
    want = to_tokens64(h, np.asarray(col), weights, np.asarray(owner), w)
    np.testing.assert_allclose(np.asarray(cpu.grouped_matmul_to_tokens(h, col, weights, owner, w)), want,
                               atol=4e-6 * np.abs(want).max())


@pytest.mark.parametrize("K,R", [(40, 37), (4096, 40)])
def test_grouped_products_threads_vmap_and_nan(monkeypatch, K, R):
    """One thread and three give the same bits (three threads split the packs inside an expert's
    run); under vmap each example equals its call alone; a NaN token reaches only its copies'
    columns, a NaN pack column only its copy's token."""
    x, h, col, weights, owner, w = grouped_case(K, R, 9)
    calls = {"from": (cpu.grouped_matmul_from_tokens, (x, col, owner, w)),
             "to": (cpu.grouped_matmul_to_tokens, (h, col, weights, owner, w))}
    for f, args in calls.values():
        bits = {}
        for n in (1, 3):
            monkeypatch.setattr(cpu, "num_threads", lambda n=n: n)
            bits[n] = np.asarray(jax.jit(f)(*args))
        assert np.array_equal(bits[1], bits[3])
        xs = jnp.stack([args[0], -2 * args[0]])
        stacked = jax.vmap(lambda a: f(a, *args[1:]))(xs)
        for n in range(2):
            assert np.array_equal(stacked[n], f(xs[n], *args[1:]))
    c = np.asarray(col)
    live = np.asarray(owner)[c // cpu.GROUP_TILE] >= 0  # copies in owned packs
    t = int(np.flatnonzero(live.all(1))[0])
    y = np.asarray(cpu.grouped_matmul_from_tokens(jnp.asarray(x).at[t, 3].set(jnp.nan), col, owner, w))
    nan_cols = np.flatnonzero(np.isnan(y).any(1).reshape(-1))
    assert np.isnan(y).sum() == 3 * w.shape[1] and set(nan_cols) == set(c[t])
    p, j = divmod(int(c[t, 1]), cpu.GROUP_TILE)
    y = np.asarray(cpu.grouped_matmul_to_tokens(jnp.asarray(h).at[p, 5, j].set(jnp.nan), col, weights, owner, w))
    assert np.array_equal(np.flatnonzero(np.isnan(y).any(1)), [t]) and np.isnan(y[t]).all()


def test_grouped_products_refuse_bad_operands():
    x, h, col, weights, owner, w = grouped_case(4, 5, 0)
    with pytest.raises(ValueError, match="grouped_matmul_from_tokens: x must be"):
        cpu.grouped_matmul_from_tokens(x[:, :3], col, owner, w)
    with pytest.raises(ValueError, match="grouped_matmul_from_tokens: col must be"):
        cpu.grouped_matmul_from_tokens(x, col.reshape(-1), owner, w)
    with pytest.raises(ValueError, match="grouped_matmul_to_tokens: h must be"):
        cpu.grouped_matmul_to_tokens(h[..., :16], col, weights, owner, w)
    with pytest.raises(ValueError, match="grouped_matmul_to_tokens: h must be"):
        cpu.grouped_matmul_to_tokens(h, col, weights[:, :2], owner, w)
    with pytest.raises(ValueError, match="must be integers"):
        cpu.grouped_matmul_from_tokens(x, col.astype(jnp.float32), owner, w)
    with pytest.raises(ValueError, match="x must be float32"):
        cpu.grouped_matmul_from_tokens(x.astype(jnp.bfloat16), col, owner, w)
    with pytest.raises(ValueError, match="weights must be float32"):
        cpu.grouped_matmul_to_tokens(h, col, weights.astype(jnp.float16), owner, w)
    # the handlers check what they are given
    for bad_col in (col.at[0, 0].set(owner.size * cpu.GROUP_TILE), col.at[0, 0].set(col[1, 1])):
        with pytest.raises(Exception, match="outside the packs or taken twice"):
            np.asarray(cpu.grouped_matmul_from_tokens(x, bad_col, owner, w))
        with pytest.raises(Exception, match="outside the packs or taken twice"):
            np.asarray(cpu.grouped_matmul_to_tokens(h, bad_col, weights, owner, w))
    with pytest.raises(Exception, match="outside"):
        np.asarray(cpu.grouped_matmul_from_tokens(x, col, owner.at[0].set(3), w))


@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_gradients_through_a_traced_router(impl):
    """The routing computed inside the differentiated function (as a model's router does): the
    kernel path's derivative rule takes it as operands, and its gradient is the loop's."""
    g = np.random.default_rng(11)
    x = jnp.asarray(g.standard_normal((T, D)), jnp.float32)
    router = jnp.asarray(g.standard_normal((D, E)), jnp.float32)
    _, _, _, wi, wo = case(12, "uniform")
    wi, wo = jnp.asarray(wi, jnp.float32), jnp.asarray(wo, jnp.float32)

    def loss(x, impl_):
        weights, experts = jax.lax.top_k(jax.nn.softmax(x @ router), k)
        return jnp.sum(jnp.sin(experts_forward(x, weights, experts, wi, wo, gated_act(jax.nn.silu), impl=impl_)))

    got = jax.jit(jax.grad(loss), static_argnums=1)(x, impl)
    want = jax.jit(jax.grad(loss), static_argnums=1)(x, "xla")
    # the kernel's primal rounds differently from the loop's, and sin' carries it into the gradient
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(got)).max() > 0


def examples(B: int, seed: int):
    """``B`` examples of ``case``'s tokens and routing, ``(B, T, ...)``, sharing one set of experts' weights."""
    parts = [case(seed + b, "uniform") for b in range(B)]
    x, w, e = (np.stack([p[i] for p in parts]) for i in range(3))
    return x, w, e, parts[0][3], parts[0][4]


def as_jax(*arrays):
    return tuple(jnp.asarray(a, jnp.int32) if a.dtype.kind == "i" else jnp.asarray(a, jnp.float32) for a in arrays)


@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_vmap_over_examples_runs_them_as_more_tokens(impl):
    """``jax.vmap`` over examples: each example's rows are the float64 loop's, and the examples run
    as one call on ``B T`` tokens (the same numbers as that call; one pair of kernel calls; an
    export for cuda holds ``ragged_dot``, which jax cannot batch with the weights unmapped)."""
    from jax import export

    x, w, e, wi, wo = examples(3, 20)
    xj, wj, ej, wij, woj = as_jax(x, w, e, wi, wo)
    f = lambda x, w, e: experts_forward(x, w, e, wij, woj, gated_act(jax.nn.silu), impl=impl)
    got = np.asarray(jax.vmap(f)(xj, wj, ej))
    for b in range(3):
        np.testing.assert_allclose(got[b], reference(x[b], w[b], e[b], wi, wo), rtol=1e-4, atol=1e-4)
    flat = f(xj.reshape(3 * T, D), wj.reshape(3 * T, k), ej.reshape(3 * T, k))
    np.testing.assert_array_equal(got.reshape(3 * T, D), np.asarray(flat))
    vf = jax.jit(jax.vmap(f))
    if impl == "cpu":
        text = vf.lower(xj, wj, ej).as_text()
        assert text.count("implicit_attn_grouped_from_tokens") == 1
        assert text.count("implicit_attn_grouped_to_tokens") == 1
    assert "ragged_dot" in export.export(vf, platforms=["cuda"])(xj, wj, ej).mlir_module()


def test_vmap_with_unmapped_tokens_or_mapped_weights():
    """Tokens shared by the examples (broadcast, then folded), and experts' weights mapped (one
    model per example: the examples run one after another), each against the float64 loop; with
    the weights mapped, derivatives under ``vmap`` (the accelerator path maps the tokens too)
    against each model's, and in an export for cuda."""
    from jax import export

    x, w, e, wi, wo = examples(2, 30)
    xj, wj, ej, wij, woj = as_jax(x, w, e, wi, wo)
    act = gated_act(jax.nn.silu)
    got = np.asarray(jax.vmap(lambda w, e: experts_forward(xj[0], w, e, wij, woj, act))(wj, ej))
    for b in range(2):
        np.testing.assert_allclose(got[b], reference(x[0], w[b], e[b], wi, wo), rtol=1e-4, atol=1e-4)
    wis = jnp.stack([wij, 2 * wij])
    got = np.asarray(jax.vmap(lambda x, wi: experts_forward(x, wj[0], ej[0], wi, woj, act))(xj, wis))
    for b in range(2):
        np.testing.assert_allclose(got[b], reference(x[b], w[0], e[0], (1 + b) * wi, wo), rtol=1e-4, atol=1e-4)
    loss = lambda x, wi: jnp.sum(jnp.sin(experts_forward(x, wj[0], ej[0], wi, woj, act)))
    per_model = jax.jit(jax.vmap(jax.grad(loss, (0, 1)), (None, 0)))
    got = per_model(xj[0], wis)
    for b in range(2):
        want = jax.grad(loss, (0, 1))(xj[0], wis[b])
        for i in range(2):
            np.testing.assert_allclose(np.asarray(got[i][b]), np.asarray(want[i]), rtol=1e-5, atol=1e-5)
    assert "ragged_dot" in export.export(per_model, platforms=["cuda"])(xj[0], wis).mlir_module()


@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_derivatives_under_vmap_are_each_examples(impl):
    """Reverse mode under ``jax.vmap`` in both orders (tokens, routing weights and the experts'
    weights: per example, and summed), and forward mode, all under ``jit``, against each
    example's derivatives unmapped. Derivatives batch the layer with jax's rules (a custom
    batching rule cannot be transposed): the loop's switch stays one switch for the batch
    (``ops.most_in_batch``), and the accelerator path maps the experts' weights with the tokens
    (``ops.zero_mapped_with``: jax batches ``ragged_dot`` only with every operand mapped), which
    exports for cuda and tpu show."""
    from jax import export

    xj, wj, ej, wij, woj = as_jax(*examples(2, 40))
    loss = lambda x, w, e, wi: jnp.sum(jnp.sin(experts_forward(x, w, e, wi, woj, gated_act(jax.nn.silu), impl=impl)))
    each = [jax.jit(jax.grad(loss, (0, 1, 3)))(xj[b], wj[b], ej[b], wij) for b in range(2)]
    per_example = jax.jit(jax.vmap(jax.grad(loss, (0, 1, 3)), (0, 0, 0, None)))
    summed = jax.jit(jax.grad(lambda x, w, wi: jnp.sum(jax.vmap(loss, (0, 0, 0, None))(x, w, ej, wi)), (0, 1, 2)))
    mapped, of_mapped = per_example(xj, wj, ej, wij), summed(xj, wj, wij)
    for i in range(3):
        want = [np.asarray(each[b][i]) for b in range(2)]
        assert np.abs(want[0]).max() > 0
        for b in range(2):
            np.testing.assert_allclose(np.asarray(mapped[i][b]), want[b], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(of_mapped[i]), np.stack(want) if i < 2 else want[0] + want[1],
                                   rtol=1e-5, atol=1e-5)
    t = jnp.cos(xj)
    f = lambda x, w, e: experts_forward(x, w, e, wij, woj, gated_act(jax.nn.silu), impl=impl)
    tangents = jax.jit(lambda x, t: jax.jvp(lambda x: jax.vmap(f)(x, wj, ej), (x,), (t,))[1])(xj, t)
    for b in range(2):
        want = jax.jvp(lambda x: f(x, wj[b], ej[b]), (xj[b],), (t[b],))[1]
        np.testing.assert_allclose(np.asarray(tangents[b]), np.asarray(want), rtol=1e-5, atol=1e-5)
    for platform in ("cuda", "tpu"):
        for fn, args in ((per_example, (xj, wj, ej, wij)), (summed, (xj, wj, wij))):
            text = export.export(fn, platforms=[platform])(*args).mlir_module()
            assert "ragged_dot" in text and "implicit_attn_" not in text, platform
