"""``nn.moe.experts_forward``'s CPU path (chunks of at most ``block`` rows, row counts rounded
up to ``granule``) against float64 loops over the chosen experts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.nn.moe import experts_forward, gated_act

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
    np.testing.assert_allclose(run(*a, block=block, granule=granule), reference(*a), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block,granule", [(256, 32), (8, 3)])
def test_nan_token_stays_in_its_row(block, granule):
    """Chunks run rows past their group (with the wrong expert's weights, later overwritten):
    a NaN token must still reach only its own output row."""
    x, w, e, wi, wo = case(1, "uniform")
    for bad in (0, 7, T - 1):
        xb = x.copy()
        xb[bad, 1] = np.nan
        nan_rows = np.isnan(run(xb, w, e, wi, wo, block=block, granule=granule)).any(-1)
        assert nan_rows[bad] and nan_rows.sum() == 1


def test_gradients_match_a_dense_float64_formula():
    """Reverse mode through the chunk loop: d(sum out * c)/d(x, w_in, w_out) equal to the
    gradient of a dense float64 formula (every expert on every token, masked)."""
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
                                       gated_act(jax.nn.silu), block=8, granule=3) * c)

    with jax.enable_x64():
        want = jax.grad(dense, argnums=(0, 1, 2))(x, wi, wo)
    got = jax.grad(ours, argnums=(0, 1, 2))(*(jnp.asarray(a, jnp.float32) for a in (x, wi, wo)))
    for g_, w_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(g_), np.asarray(w_), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [dict(block=0), dict(granule=0)])
def test_bad_chunk_sizes_are_named(bad):
    with pytest.raises(ValueError, match="block and granule"):
        run(*case(0, "uniform"), **bad)
