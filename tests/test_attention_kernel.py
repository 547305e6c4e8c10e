"""The CPU kernel of softmax attention applied to the values (``kernels.cpu.attention_forward``)
against float64 softmax attention, and ``nn.attention.attention_values``, which takes it on CPU:
windows, grouped heads, documents, chunks of 16 queries with a short last one, value widths off
whole vectors, large logits, threads, vmap, derivatives, exports, bad operands."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ops import attention64

from implicit_attn.kernels import cpu
from implicit_attn.nn.attention import FULL_WINDOW, attention_values
from implicit_attn.ops import attention_output


def case(B, H, KV, L, d, e, seed=0, docs=True):
    g = np.random.default_rng(seed)
    q = g.standard_normal((B, H, L, d)).astype(np.float32)
    k = g.standard_normal((B, KV, L, d)).astype(np.float32)
    v = g.standard_normal((B, KV, L, e)).astype(np.float32)
    seg = np.zeros((B, L), np.int32)
    if docs and B > 1:
        seg[1, L // 3:] = 1  # two documents in the second row
    return q, k, v, seg


@pytest.mark.parametrize("B,H,KV,L,d,e,window", [
    (2, 4, 2, 37, 8, 12, FULL_WINDOW), (2, 2, 2, 130, 16, 64, 50), (1, 3, 1, 129, 48, 40, 7),
    (2, 2, 1, 5, 1, 33, 3), (1, 2, 2, 16, 64, 32, 1), (1, 8, 2, 300, 64, 64, FULL_WINDOW)])
def test_kernel_matches_float64_softmax(B, H, KV, L, d, e, window):
    q, k, v, seg = case(B, H, KV, L, d, e)
    got = np.asarray(cpu.attention_forward(q, k, v, seg, window))
    assert got.shape == (B, H, L, e) and got.dtype == np.float32
    np.testing.assert_allclose(got, attention64(q, k, v, seg, window), rtol=1e-5, atol=1e-5)


def test_threads_vmap_and_large_logits():
    """One thread and three give the same bits; vmap equals calls one by one; logits in the
    thousands stay finite. (NaN never reaches the kernel: ``nn.attention.attend`` zeroes NaN
    inputs and marks the rows they reach; ``tests/test_nan.py``.)"""
    q, k, v, seg = case(2, 4, 2, 70, 16, 20, seed=1)
    bits = {}
    for n in (1, 3):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu, "num_threads", lambda n=n: n)
            bits[n] = np.asarray(jax.jit(lambda *a: cpu.attention_forward(*a, 30))(q, k, v, seg))
    assert np.array_equal(bits[1], bits[3])
    qs = jnp.stack([q, -q])
    stacked = jax.vmap(lambda a: cpu.attention_forward(a, k, v, seg, 30))(qs)
    for n in range(2):
        assert np.array_equal(stacked[n], cpu.attention_forward(qs[n], k, v, seg, 30))
    big = 40 * q  # logits in the thousands: each row's maximum comes off before the exponentials
    got = np.asarray(cpu.attention_forward(big, k, v, seg, 30))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, attention64(big, k, v, seg, 30), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [FULL_WINDOW, 9])
def test_attention_values_takes_the_kernel_on_cpu_and_differentiates_through_xla(window):
    """Under jit on CPU the lowering holds the kernel's call (the tests' size threshold is 0);
    exports for cuda and tpu hold none; forward and reverse mode equal ``ops.attention_output``'s."""
    from jax import export

    q, k, v, seg = (jnp.asarray(a) for a in case(2, 4, 2, 40, 8, 12, seed=2))
    f = jax.jit(lambda q, k, v: attention_values(q, k, v, seg, window))
    assert "implicit_attn_attention_forward" in f.lower(q, k, v).as_text()
    for platform in ("cuda", "tpu"):
        assert "implicit_attn_" not in export.export(f, platforms=[platform])(q, k, v).mlir_module(), platform
    ref = lambda q, k, v: attention_output(q, k, v, seg, window)
    np.testing.assert_allclose(np.asarray(f(q, k, v)), np.asarray(ref(q, k, v)), rtol=1e-5, atol=1e-5)
    t = tuple(jnp.asarray(np.random.default_rng(3).standard_normal(a.shape), jnp.float32) for a in (q, k, v))
    (_, d1), (_, d2) = (jax.jit(functools.partial(jax.jvp, fn))((q, k, v), t) for fn in (f, ref))
    np.testing.assert_allclose(np.asarray(d1), np.asarray(d2), rtol=1e-5, atol=1e-5)
    loss = lambda fn: (lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))))
    grad = lambda fn: jax.jit(jax.grad(loss(fn), (0, 1, 2)))(q, k, v)
    for g1, g2 in zip(grad(f), grad(ref)):
        np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-4, atol=1e-5)


def test_attention_values_keeps_other_dtypes_on_xla():
    q, k, v, seg = (jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else a for a in case(1, 2, 1, 20, 8, 8))
    f = jax.jit(lambda q, k, v: attention_values(q, k, v, seg, FULL_WINDOW))
    assert "implicit_attn_" not in f.lower(q, k, v).as_text() and f(q, k, v).dtype == jnp.bfloat16


def test_kernel_refuses_bad_operands():
    q, k, v, seg = case(1, 4, 2, 10, 8, 8)
    with pytest.raises(ValueError, match="attention_forward: expected"):
        cpu.attention_forward(q[:, :3], k, v, seg, 5)  # 3 query heads over 2 key heads
    with pytest.raises(ValueError, match="attention_forward: expected"):
        cpu.attention_forward(q, k, v[:, :, :9], seg, 5)
    with pytest.raises(ValueError, match="attention_forward: expected"):
        cpu.attention_forward(q, k, v, seg[:, :9], 5)
    with pytest.raises(ValueError, match="must be float32"):
        cpu.attention_forward(q.astype(np.float16), k, v, seg, 5)
    with pytest.raises(ValueError, match="window must be >= 1"):
        cpu.attention_forward(q, k, v, seg, 0)
