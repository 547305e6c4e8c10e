"""The reverse-mode kernels of Mamba-1's selective scan (``kernels.cpu.selective_scan``, its backward
pass ``implicit_attn_selective_scan_vjp``) and Mamba-2's SSD (``kernels.cpu.ssd_scan``,
``implicit_attn_ssd_scan_vjp``): the gradients of every operand against torch's float64 autograd of
the recurrence written step by step (an independent reference), a NaN's reach, ``vmap`` either side
of ``grad``, threads, causality, the switch back to XLA's transpose, and exports for accelerators (no
kernel in them).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from implicit_attn.families import mamba, mamba2
from implicit_attn.kernels import cpu
from implicit_attn.ops import selective_scan_sequential, ssd_chunked
from reverse_checks import assert_nan_pattern, assert_vmap_either_side, torch_grads

rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / np.abs(b).max())


def softplus_steps(g, shape):
    return np.log1p(np.exp(g.standard_normal(shape) - 1.5))


def scan_inputs(B, L, C, N, seed):
    """float32 ``u, dt, A, Bm, Cm`` as a Mamba layer makes them (``dt`` a softplus, ``A < 0`` over
    three orders of magnitude) and an output cotangent."""
    g = np.random.default_rng(seed)
    A = -np.exp(g.uniform(np.log(0.05), np.log(20.0), (C, N)))
    xs = (g.standard_normal((B, L, C)), softplus_steps(g, (B, L, C)), A, g.standard_normal((B, L, N)),
          g.standard_normal((B, L, N)), g.standard_normal((B, L, C)))
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def ssd_inputs(B, L, H, P, G, N, seed):
    """float32 ``x, dt, A, Bm, Cm`` of a Mamba-2 layer (``H`` heads of ``P`` channels, ``G`` groups of
    ``N`` states) and an output cotangent."""
    g = np.random.default_rng(seed)
    A = -np.exp(g.uniform(np.log(0.05), np.log(8.0), (H,)))
    xs = (g.standard_normal((B, L, H, P)), softplus_steps(g, (B, L, H)), A, g.standard_normal((B, L, G, N)),
          g.standard_normal((B, L, G, N)), g.standard_normal((B, L, H, P)))
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def torch_scan(u, dt, A, Bm, Cm):
    """``h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t``, ``y_t = h_t C_t``, one step at a time."""
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1], dtype=u.dtype)
    out = []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * Bm[:, t, None, :]
        out.append(torch.einsum("bcn,bn->bc", h, Cm[:, t]))
    return torch.stack(out, 1)


def torch_ssd(x, dt, A, Bm, Cm):
    """Per head ``S_t = exp(dt_t A_h) S_{t-1} + (dt_t x_t) B_t^T``, ``y_t = S_t C_t`` (head ``h`` reads
    group ``h // (H / G)``), one step at a time."""
    B, L, H, P = x.shape
    hg = H // Bm.shape[2]
    Bh, Ch = Bm.repeat_interleave(hg, dim=2), Cm.repeat_interleave(hg, dim=2)
    S = torch.zeros(B, H, P, Bm.shape[3], dtype=x.dtype)
    out = []
    for t in range(L):
        S = (torch.exp(dt[:, t] * A)[..., None, None] * S
             + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :])
        out.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
    return torch.stack(out, 1)


@dataclasses.dataclass(frozen=True)
class Scan:
    kernel: Callable  # the fused CPU kernel (x, dt, A, Bm, Cm)
    reference: Callable  # XLA's form of the same numbers
    model: Callable  # the family's dispatch (the kernel where it pays off)
    torch: Callable
    inputs: Callable
    names: tuple
    vjp: str
    shapes: tuple  # for the float64 comparison
    nan_shape: tuple  # every axis at least 2


SCANS = {
    # L = 70: a ragged last chunk of the stored states (every 32 positions); 37 channels: a last vector
    # of 5 lanes (16 or 8 to a vector); N = 1, 16 (Mamba's) and 64 (the most); two batch rows.
    "selective_scan": Scan(cpu.selective_scan, selective_scan_sequential, mamba.block.selective_scan, torch_scan,
                           scan_inputs, ("u", "dt", "A", "Bm", "Cm"), "implicit_attn_selective_scan_vjp",
                           ((2, 70, 37, 16), (1, 33, 21, 1), (1, 40, 16, 64)), (2, 70, 19, 4)),
    # L = 70, 33: ragged chunks (every 16 positions); P = 37: a ragged block of rows (16 to a block);
    # N = 3, 16 and 130: vectors padded; groups of 1, 2 and 3 heads.
    "ssd_scan": Scan(cpu.ssd_scan, ssd_chunked, lambda *a: mamba2.block.ssd(*a, chunk=16), torch_ssd, ssd_inputs,
                     ("x", "dt", "A", "Bm", "Cm"), "implicit_attn_ssd_scan_vjp",
                     ((2, 70, 4, 37, 2, 16), (1, 33, 6, 5, 3, 3), (1, 40, 2, 16, 1, 130)), (2, 70, 4, 6, 2, 5)),
}


def kernel_grad(scan):
    return jax.jit(jax.grad(lambda ct, *xs: jnp.sum(ct * scan.kernel(*xs)), argnums=(1, 2, 3, 4, 5)))


@pytest.mark.parametrize("name, shape", [(n, s) for n, scan in SCANS.items() for s in scan.shapes])
def test_gradients_are_the_kernels_and_match_float64(name, shape):
    scan = SCANS[name]
    *args, ct = scan.inputs(*shape, seed=shape[-1])
    grad = kernel_grad(scan)
    text = grad.lower(ct, *args).as_text()
    assert scan.vjp in text and "stablehlo.while" not in text  # the kernel, no XLA recurrence
    got = grad(ct, *args)
    want = torch_grads(scan.torch, args, ct)
    for op, g, w in zip(scan.names, got, want):
        assert g.shape == w.shape and np.isfinite(np.asarray(g)).all(), op
        assert rel(g, w) <= 2e-5, (op, rel(g, w))


@pytest.mark.parametrize("name, where", [(n, w) for n in SCANS for w in (0, 1, 3)])
def test_gradients_with_a_nan_input_have_torchs_nan_pattern(name, where):
    """One NaN input entry (batch row 1, ``t = 40``) in the input, the step sizes or ``Bm``: the
    kernel's gradients are NaN exactly where torch's float64 autograd's are (earlier positions
    through the state's cotangent, ``A`` and the shared ``Bm``, ``Cm`` of that row; never the other
    row), and equal elsewhere."""
    scan = SCANS[name]
    *args, ct = scan.inputs(*scan.nan_shape, seed=5)
    args[where] = args[where].at[(1, 40) + (1,) * (args[where].ndim - 2)].set(jnp.nan)
    got = kernel_grad(scan)(ct, *args)
    want = torch_grads(scan.torch, args, ct)
    untouched = lambda op, g: None if op == "A" else g[0]  # A is shared by the rows
    assert assert_nan_pattern(scan.names, got, want, untouched) > 100  # the NaN did reach the gradients


@pytest.mark.parametrize("name, shape", [("selective_scan", (1, 45, 24, 16)), ("ssd_scan", (1, 45, 3, 20, 1, 16))])
def test_reverse_kernel_composes_with_vmap_threads_and_export(name, shape, monkeypatch):
    """``vmap`` of the gradient and the gradient of a ``vmap`` give each example's gradient alone
    (the same bits; ``A``'s the sum of the two); the same bits on every run, and 1 or 3 threads the
    same gradients to float32 rounding (sums over channels are split by thread); cotangents only up
    to ``t = p`` give gradients exactly 0 after ``p``; ``$IMPLICIT_ATTN_KERNEL_REVERSE=0`` transposes
    the reference instead (the same gradients to float32 rounding); the family's scan exported for
    CUDA or TPU holds neither kernel."""
    scan = SCANS[name]
    u, dt, A, Bm, Cm, ct = scan.inputs(*shape, seed=3)
    run = lambda u, A: scan.kernel(u, dt, A, Bm, Cm)
    grad, one, doubled = assert_vmap_either_side(run, u, A, ct)
    shared = jax.grad(lambda A: jnp.sum(ct * jax.vmap(run, in_axes=(0, None))(jnp.stack([u, 2 * u]), A)))(A)
    assert rel(shared, np.asarray(one[1], np.float64) + np.asarray(doubled[1], np.float64)) <= 1e-6
    every = jax.jit(jax.grad(lambda *xs: jnp.sum(ct * scan.kernel(*xs)), argnums=(0, 1, 2, 3, 4)))
    first = every(u, dt, A, Bm, Cm)
    for x, y in zip(first, every(u, dt, A, Bm, Cm)):
        np.testing.assert_array_equal(x, y)
    for threads in (1, 3):
        monkeypatch.setattr(cpu, "num_threads", lambda n=threads: n)
        retraced = jax.jit(jax.grad(lambda *xs: jnp.sum(ct * scan.kernel(*xs)), argnums=(0, 1, 2, 3, 4)))
        for x, y in zip(retraced(u, dt, A, Bm, Cm), first):
            assert rel(x, np.asarray(y, np.float64)) <= 1e-6
    monkeypatch.undo()

    early = grad(u, A, ct.at[:, 21:].set(0.0))
    assert np.all(np.asarray(early[0])[:, 21:] == 0)
    assert np.abs(np.asarray(early[0])[:, :21]).max() > 0

    monkeypatch.setenv(cpu.KERNEL_REVERSE_ENV, "0")
    off = jax.jit(jax.grad(lambda u, A, c: jnp.sum(c * run(u, A)), argnums=(0, 1)))
    assert scan.vjp not in off.lower(u, A, ct).as_text()
    for x, y in zip(off(u, A, ct), one):
        assert rel(x, np.asarray(y, np.float64)) <= 1e-5
    monkeypatch.delenv(cpu.KERNEL_REVERSE_ENV)

    monkeypatch.setattr(cpu, "SCAN_AUTO_MIN_FACTOR", 1)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 1)
    model = lambda u: jnp.sum(ct * scan.model(u, dt, A, Bm, Cm))
    assert scan.vjp in jax.jit(jax.grad(model)).lower(u).as_text()
    want = jax.grad(lambda u: jnp.sum(ct * scan.reference(u, dt, A, Bm, Cm)))(u)
    assert rel(jax.grad(model)(u), np.asarray(want, np.float64)) <= 2e-5
    forward = scan.vjp.removesuffix("_vjp")
    for platform in ("cuda", "tpu"):
        module = jax.export.export(jax.jit(jax.grad(model)), platforms=[platform])(u).mlir_module()
        assert scan.vjp not in module and forward not in module, platform
