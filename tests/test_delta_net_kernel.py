"""The CPU kernel of the Gated DeltaNet mixer between its projections
(``kernels.cpu.gated_delta_net``) against a float64 loop of the same math, and the families'
``delta_forward``, which takes it on CPU: column maps, conv widths and biases, head sizes off whole
vectors, grouped heads, NaN inputs, threads, vmap, derivatives, exports, bad operands."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.families.qwen3_next import block as qb
from implicit_attn.kernels import cpu
from implicit_attn.registry import family


def mixer64(x, xcols, conv_w, conv_b, z, zcols, log_a, beta, norm_w, Hk, eps):
    """The mixer in float64, one step at a time, with the XLA path's NaN rules: a NaN in the
    conv's k or v outputs, beta or log_a makes the head's outputs NaN from that step on, one in q
    that step's; the recurrence runs on them replaced by 0."""
    x, z = np.asarray(x, np.float64)[..., xcols], np.asarray(z, np.float64)[..., zcols]
    B, L, Cx = x.shape
    K, Hv = conv_w.shape[1], log_a.shape[-1]
    dv = len(zcols) // Hv
    dk = (Cx - Hv * dv) // (2 * Hk)
    xp = np.concatenate([np.zeros((B, K - 1, Cx)), x], axis=1)
    xc = sum(xp[:, s:s + L] * conv_w[:, s] for s in range(K)) + (0.0 if conv_b is None else conv_b)
    u = xc / (1.0 + np.exp(-xc))
    q = u[..., :Hk * dk].reshape(B, L, Hk, dk)
    k = u[..., Hk * dk:2 * Hk * dk].reshape(B, L, Hk, dk)
    v = u[..., 2 * Hk * dk:].reshape(B, L, Hv, dv)
    gate = z / (1.0 + np.exp(-z))
    y = np.zeros((B, L, Hv, dv))
    for b in range(B):
        for h in range(Hv):
            g = h // (Hv // Hk)
            S, bad_state = np.zeros((dv, dk)), False
            for t in range(L):
                qt, kt, vt = q[b, t, g], k[b, t, g], v[b, t, h]
                la, be = float(log_a[b, t, h]), float(beta[b, t, h])
                bad_state |= np.isnan(kt).any() or np.isnan(vt).any() or np.isnan(la) or np.isnan(be)
                qn = np.nan_to_num(qt / np.sqrt(qt @ qt + 1e-6), nan=0.0) / np.sqrt(dk)
                kn = np.nan_to_num(kt / np.sqrt(kt @ kt + 1e-6), nan=0.0)
                vt = np.nan_to_num(vt, nan=0.0)
                a, be = np.exp(0.0 if np.isnan(la) else la), (0.0 if np.isnan(be) else be)
                S = a * S
                S = S + be * np.outer(vt - S @ kn, kn)
                o = S @ qn
                if bad_state or np.isnan(qt).any():
                    y[b, t, h] = np.nan
                    continue
                y[b, t, h] = norm_w * o / np.sqrt(np.mean(o * o) + eps) * gate[b, t, h * dv:(h + 1) * dv]
    return y.reshape(B, L, Hv * dv)


def operands(B, L, Hk, Hv, dk, dv, K, bias, shuffle, seed=0):
    """Random operands: x with the conv channels among extra columns (in a shuffled order if
    ``shuffle``), z the same, log_a <= 0, beta in (0, 2)."""
    g = np.random.default_rng(seed)
    Cx, Cz = 2 * Hk * dk + Hv * dv, Hv * dv
    px, pz = Cx + 5, Cz + 3
    xcols = (g.permutation(px)[:Cx] if shuffle else np.arange(Cx) + 2).astype(np.int32)
    zcols = (g.permutation(pz)[:Cz] if shuffle else np.arange(Cz)).astype(np.int32)
    x = g.standard_normal((B, L, px)).astype(np.float32)
    z = g.standard_normal((B, L, pz)).astype(np.float32)
    conv_w = (0.6 * g.standard_normal((Cx, K))).astype(np.float32)
    conv_b = (0.3 * g.standard_normal(Cx)).astype(np.float32) if bias else None
    log_a = (-np.log1p(np.exp(g.standard_normal((B, L, Hv)))) * 0.3).astype(np.float32)
    beta = (2.0 / (1.0 + np.exp(-g.standard_normal((B, L, Hv))))).astype(np.float32)
    norm_w = (1.0 + 0.2 * g.standard_normal(dv)).astype(np.float32)
    return x, xcols, conv_w, conv_b, z, zcols, log_a, beta, norm_w, Hk, 1e-6


@pytest.mark.parametrize("B,L,Hk,Hv,dk,dv,K,bias,shuffle", [
    (2, 37, 2, 4, 8, 12, 4, True, True), (1, 130, 1, 1, 32, 32, 4, False, False),
    (1, 20, 2, 2, 5, 40, 3, True, True), (2, 9, 3, 6, 16, 17, 2, False, True),
    (1, 200, 4, 8, 32, 32, 4, False, False), (1, 3, 1, 2, 1, 1, 1, True, True),
    (1, 33, 1, 2, 7, 80, 4, True, False)])  # d_v over 64: the value channels in two blocks
def test_kernel_matches_a_float64_loop(B, L, Hk, Hv, dk, dv, K, bias, shuffle):
    args = operands(B, L, Hk, Hv, dk, dv, K, bias, shuffle)
    got = np.asarray(cpu.gated_delta_net(*args))
    assert got.shape == (B, L, Hv * dv) and got.dtype == np.float32
    np.testing.assert_allclose(got, mixer64(*args), rtol=2e-4, atol=2e-5)


def test_nan_inputs_reach_what_the_xla_path_says():
    """A NaN in a key channel's input reaches its value heads' outputs from that step on (and the
    conv carries it K - 1 steps further), one in a query channel only the steps whose conv reads
    it, one in z only that element, in beta or log_a one head from its step on; the rest stays
    finite and equal to the float64 loop's."""
    B, L, Hk, Hv, dk, dv, K = 1, 24, 2, 4, 8, 8, 3
    x, xcols, conv_w, conv_b, z, zcols, log_a, beta, norm_w, _, eps = operands(B, L, Hk, Hv, dk, dv, K, True, True)
    x, z, log_a, beta = x.copy(), z.copy(), log_a.copy(), beta.copy()
    x[0, 10, xcols[Hk * dk + 3]] = np.nan   # key head 0's k at step 10: value heads 0, 1 from 10 on
    x[0, 5, xcols[dk + 1]] = np.nan         # key head 1's q at step 5: value heads 2, 3 at 5 .. 5 + K - 1
    z[0, 2, zcols[3 * dv + 4]] = np.nan     # one gate element
    beta[0, 15, 2] = np.nan                 # value head 2 from 15 on
    log_a[0, 20, 3] = np.nan                # value head 3 from 20 on
    args = (x, xcols, conv_w, conv_b, z, zcols, log_a, beta, norm_w, Hk, eps)
    got, want = np.asarray(cpu.gated_delta_net(*args)).reshape(L, Hv, dv), mixer64(*args).reshape(L, Hv, dv)
    nan = np.zeros((L, Hv, dv), bool)
    nan[10:, :2] = True
    nan[5:5 + K, 2:] = True
    nan[2, 3, 4] = True
    nan[15:, 2] = True
    nan[20:, 3] = True
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(np.isnan(want), nan)
    np.testing.assert_allclose(got[~nan], want[~nan], rtol=2e-4, atol=2e-5)


def test_threads_and_vmap():
    args = operands(2, 50, 2, 4, 16, 24, 4, True, True, seed=3)
    bits = {}
    for n in (1, 3):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu, "num_threads", lambda n=n: n)
            bits[n] = np.asarray(jax.jit(lambda x, z: cpu.gated_delta_net(x, args[1], *args[2:4], z, *args[5:]))(
                args[0], args[4]))
    assert np.array_equal(bits[1], bits[3])
    xs = jnp.stack([args[0], -args[0]])
    stacked = jax.vmap(lambda x: cpu.gated_delta_net(x, *args[1:]))(xs)
    for n in range(2):
        assert np.array_equal(stacked[n], cpu.gated_delta_net(xs[n], *args[1:]))


def delta_layer(model_type):
    """A Gated DeltaNet layer's params, its config and an input, from the family's quick benchmark
    sizes (Qwen3-Next: ``in_proj_qkvz``; Qwen3.5: ``in_proj_qkv``; OLMo-Hybrid: one projection each)."""
    spec = family(model_type)
    cfg = spec.config.from_hf(dict(spec.bench["quick"]))
    params = spec.init_params(cfg, jax.random.PRNGKey(1))
    p = next(layer["mixer"] for layer in params["layers"] if "conv1d.weight" in layer["mixer"])
    h = jnp.asarray(np.random.default_rng(4).standard_normal((2, 33, cfg.hidden_size)), jnp.float32)
    return p, cfg, h


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "olmo_hybrid", "lara_mini"])
def test_delta_forward_takes_the_kernel_on_cpu_and_differentiates_through_xla(model_type):
    """Under jit on CPU the lowering holds the kernel's call (the tests' size threshold is 0) and
    exports for cuda and tpu hold none; the output equals the XLA path's (``delta_output``), and
    so do forward- and reverse-mode derivatives in the parameters and the input."""
    from jax import export

    p, cfg, h = delta_layer(model_type)
    f = jax.jit(lambda p, h: qb.delta_forward(p, h, cfg))
    assert "implicit_attn_gated_delta_net" in f.lower(p, h).as_text()
    for platform in ("cuda", "tpu"):
        assert "implicit_attn_gated_delta_net" not in export.export(f, platforms=[platform])(p, h).mlir_module()
    g = np.random.default_rng(5)
    tp = jax.tree.map(lambda a: jnp.asarray(g.standard_normal(a.shape), a.dtype), p)
    th = jnp.asarray(g.standard_normal(h.shape), jnp.float32)
    # A loss linear in the output: its gradient is the reference's transposed tangent map alone, not
    # also the kernel's float32 rounding of the output (a sin loss's cos(y) carried that into
    # gradients of magnitude 10 at the 1e-4 level)
    c = jnp.asarray(g.standard_normal(h.shape[:2] + (cfg.linear_num_value_heads * cfg.linear_value_head_dim,)),
                    jnp.float32)

    def derivatives(p, h, kernel: bool):  # one program per path: output, tangent, gradients
        fn = lambda p, h: (qb.delta_output_kernel if kernel else qb.delta_output)(p, h, cfg)
        return fn(p, h), jax.jvp(fn, (p, h), (tp, th))[1], jax.grad(lambda p, h: jnp.sum(c * fn(p, h)), (0, 1))(p, h)

    kern, xla = (jax.jit(derivatives, static_argnums=2)(p, h, k) for k in (True, False))
    np.testing.assert_allclose(np.asarray(kern[0]), np.asarray(xla[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(kern[1]), np.asarray(xla[1]), rtol=1e-4, atol=1e-4)
    for g1, g2 in zip(jax.tree.leaves(kern[2]), jax.tree.leaves(xla[2])):
        np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-5, atol=1e-6)


def test_delta_forward_keeps_other_dtypes_and_kimi_on_xla():
    p, cfg, h = delta_layer("qwen3_next")
    pb = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    f = jax.jit(lambda p, h: qb.delta_forward(p, h, cfg))
    assert "implicit_attn_gated_delta_net" not in f.lower(pb, h.astype(jnp.bfloat16)).as_text()
    kimi = jax.jit(lambda p, h: qb.delta_forward(p, h, cfg, parts_fn=lambda *a: qb.delta_parts(*a)))
    assert "implicit_attn_gated_delta_net" not in kimi.lower(p, h).as_text()  # another parts_fn: XLA


def test_kernel_refuses_bad_operands():
    x, xcols, conv_w, conv_b, z, zcols, log_a, beta, norm_w, Hk, eps = operands(1, 6, 2, 4, 4, 4, 3, True, True)
    with pytest.raises(ValueError, match="gated_delta_net: want"):
        cpu.gated_delta_net(x, xcols[:-1], conv_w, conv_b, z, zcols, log_a, beta, norm_w, Hk, eps)
    with pytest.raises(ValueError, match="gated_delta_net: want"):
        cpu.gated_delta_net(x, xcols, conv_w, conv_b, z, zcols, log_a, beta, norm_w, 3, eps)  # 4 heads over 3
    with pytest.raises(ValueError, match="gated_delta_net: want"):
        cpu.gated_delta_net(x, xcols, conv_w, conv_b, z, zcols, log_a, beta[:, :5], norm_w, Hk, eps)
    with pytest.raises(ValueError, match="gated_delta_net: want"):
        cpu.gated_delta_net(x, xcols.astype(np.float32), conv_w, conv_b, z, zcols, log_a, beta, norm_w, Hk, eps)
    with pytest.raises(ValueError, match="gated_delta_net: want"):
        cpu.gated_delta_net(x, xcols, conv_w, conv_b[:-1], z, zcols, log_a, beta, norm_w, Hk, eps)
    out_of_x = xcols.copy()
    out_of_x[3] = x.shape[-1]
    with pytest.raises(Exception, match="xcols holds a column outside x"):
        np.asarray(cpu.gated_delta_net(x, out_of_x, conv_w, conv_b, z, zcols, log_a, beta, norm_w, Hk, eps))
    out_of_z = zcols.copy()
    out_of_z[0] = -1
    with pytest.raises(Exception, match="zcols holds a column outside z"):
        np.asarray(cpu.gated_delta_net(x, xcols, conv_w, conv_b, z, out_of_z, log_a, beta, norm_w, Hk, eps))
