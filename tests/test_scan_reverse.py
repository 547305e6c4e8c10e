"""Mamba-1's selective scan's reverse-mode kernel (``kernels.cpu.selective_scan``, its backward pass
``implicit_attn_selective_scan_vjp``): the gradients of every operand against torch's float64 autograd
of the recurrence written step by step (an independent reference), a NaN's reach, ``vmap`` either
side of ``grad``, threads, causality, the switch back to XLA's transpose, and exports for
accelerators (no kernel in them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from implicit_attn.families import mamba
from implicit_attn.kernels import cpu
from implicit_attn.ops import selective_scan_sequential
from reverse_checks import assert_nan_pattern, assert_vmap_either_side, torch_grads

VJP = "implicit_attn_selective_scan_vjp"
NAMES = ("u", "dt", "A", "Bm", "Cm")
rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / np.abs(b).max())


def inputs(B, L, C, N, seed):
    """float32 ``u, dt, A, Bm, Cm`` as a Mamba layer makes them (``dt`` a softplus, ``A < 0`` over
    three orders of magnitude) and an output cotangent."""
    g = np.random.default_rng(seed)
    dt = np.log1p(np.exp(g.standard_normal((B, L, C)) - 1.5))
    A = -np.exp(g.uniform(np.log(0.05), np.log(20.0), (C, N)))
    xs = (g.standard_normal((B, L, C)), dt, A, g.standard_normal((B, L, N)), g.standard_normal((B, L, N)),
          g.standard_normal((B, L, C)))
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def torch_scan(u, dt, A, Bm, Cm):
    """``h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t``, ``y_t = h_t C_t``, one step at a time."""
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1], dtype=u.dtype)
    out = []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * Bm[:, t, None, :]
        out.append(torch.einsum("bcn,bn->bc", h, Cm[:, t]))
    return torch.stack(out, 1)


def kernel_grad():
    return jax.jit(jax.grad(lambda ct, *xs: jnp.sum(ct * cpu.selective_scan(*xs)), argnums=(1, 2, 3, 4, 5)))


# L = 70: a ragged last chunk of the stored states (every 32 positions); 37 channels: a last vector
# of 5 lanes (16 or 8 to a vector); N = 1, 16 (Mamba's) and 64 (the most); two batch rows.
@pytest.mark.parametrize("shape", [(2, 70, 37, 16), (1, 33, 21, 1), (1, 40, 16, 64)])
def test_scan_gradients_are_the_kernels_and_match_float64(shape):
    u, dt, A, Bm, Cm, ct = inputs(*shape, seed=shape[-1])
    grad = kernel_grad()
    text = grad.lower(ct, u, dt, A, Bm, Cm).as_text()
    assert VJP in text and "stablehlo.while" not in text  # the kernel, no XLA recurrence
    got = grad(ct, u, dt, A, Bm, Cm)
    want = torch_grads(torch_scan, (u, dt, A, Bm, Cm), ct)
    for name, g, w in zip(NAMES, got, want):
        assert g.shape == w.shape and np.isfinite(np.asarray(g)).all(), name
        assert rel(g, w) <= 2e-5, (name, rel(g, w))


@pytest.mark.parametrize("where", ["u", "dt", "Bm"])
def test_scan_gradients_with_a_nan_input_have_torchs_nan_pattern(where):
    """One NaN input entry (batch row 1, ``t = 40``): the kernel's gradients are NaN exactly where
    torch's float64 autograd's are (earlier positions through the state's cotangent, ``A`` and the
    shared ``Bm``, ``Cm`` of that row; never the other row), and equal elsewhere."""
    *args, ct = inputs(2, 70, 19, 4, seed=5)
    i = NAMES.index(where)
    args[i] = args[i].at[(1, 40, 3)].set(jnp.nan)
    got = kernel_grad()(ct, *args)
    want = torch_grads(torch_scan, args, ct)
    untouched = lambda name, g: None if name == "A" else g[0]  # A is shared by the rows
    assert assert_nan_pattern(NAMES, got, want, untouched) > 100  # the NaN did reach the gradients


def test_scan_reverse_kernel_composes_with_vmap_threads_and_export(monkeypatch):
    """``vmap`` of the gradient and the gradient of a ``vmap`` give each example's gradient alone
    (the same bits); one thread and three the same bits; cotangents only up to ``t = p`` give
    gradients exactly 0 after ``p``; ``$IMPLICIT_ATTN_KERNEL_REVERSE=0`` transposes the reference
    instead (the same gradients to float32 rounding); Mamba's scan exported for CUDA or TPU holds
    neither kernel."""
    u, dt, A, Bm, Cm, ct = inputs(1, 45, 24, 16, seed=3)
    run = lambda u, A: cpu.selective_scan(u, dt, A, Bm, Cm)
    grad, one, doubled = assert_vmap_either_side(run, u, A, ct)
    shared = jax.grad(lambda A: jnp.sum(ct * jax.vmap(run, in_axes=(0, None))(jnp.stack([u, 2 * u]), A)))(A)
    assert rel(shared, np.asarray(one[1], np.float64) + np.asarray(doubled[1], np.float64)) <= 1e-6
    monkeypatch.setattr(cpu, "num_threads", lambda: 1)
    single = jax.jit(jax.grad(lambda u, A, c: jnp.sum(c * run(u, A)), argnums=(0, 1)))(u, A, ct)  # traced anew
    monkeypatch.setattr(cpu, "num_threads", lambda: 3)
    three = jax.jit(jax.grad(lambda u, A, c: jnp.sum(c * run(u, A)), argnums=(0, 1)))(u, A, ct)
    for x, y, z in zip(single, three, one):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)
    monkeypatch.undo()

    early = grad(u, A, ct.at[:, 21:].set(0.0))
    assert np.all(np.asarray(early[0])[:, 21:] == 0)
    assert np.abs(np.asarray(early[0])[:, :21]).min(axis=-1).max() > 0

    monkeypatch.setenv(cpu.KERNEL_REVERSE_ENV, "0")
    off = jax.jit(jax.grad(lambda u, A, c: jnp.sum(c * run(u, A)), argnums=(0, 1)))
    assert VJP not in off.lower(u, A, ct).as_text()
    for x, y in zip(off(u, A, ct), one):
        assert rel(x, np.asarray(y, np.float64)) <= 1e-5
    monkeypatch.delenv(cpu.KERNEL_REVERSE_ENV)

    monkeypatch.setattr(cpu, "SCAN_AUTO_MIN_FACTOR", 1)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 1)
    model = lambda u: jnp.sum(ct * mamba.block.selective_scan(u, dt, A, Bm, Cm))
    assert VJP in jax.jit(jax.grad(model)).lower(u).as_text()
    np.testing.assert_allclose(jax.grad(model)(u), jax.grad(
        lambda u: jnp.sum(ct * selective_scan_sequential(u, dt, A, Bm, Cm)))(u), rtol=0, atol=2e-5 * float(
            jnp.abs(one[0]).max()))
    for platform in ("cuda", "tpu"):
        module = jax.export.export(jax.jit(jax.grad(model)), platforms=[platform])(u).mlir_module()
        assert VJP not in module and "implicit_attn_selective_scan" not in module, platform
