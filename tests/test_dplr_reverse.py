"""The DPLR recurrence's reverse-mode kernel (``kernels.cpu.with_kernel_reverse_mode``): the
gradients of ``dplr_scan`` (RWKV-5/6/7) and ``delta_scan`` (the gated delta rule) come from the
library's own backward pass, not from XLA's transpose of the chunked reference. Checked against
torch's float64 autograd of the recurrence written step by step (an independent reference), with
the compositions a model's gradients meet: ``vmap`` either side of ``grad``, forward mode,
threads, causality, and exports for accelerators (no kernel in them).
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from implicit_attn.kernels import cpu
from implicit_attn.ops import dplr_rule
from reverse_checks import assert_nan_pattern, assert_vmap_either_side, torch_grads

VJP = "implicit_attn_dplr_scan_vjp"
rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / np.abs(b).max())


def inputs(B, H, L, dk, dv, seed):
    """float32 ``q, k, v, log_w, a, b, bonus, cotangent``: RWKV-7's low-rank shape (``a = -kk``,
    ``b = kk * iclr``), log decays from weak to strong (``e^-0.01`` to ``e^-6``) and one reset
    (``-inf``) at ``t = 3``."""
    g = np.random.default_rng(seed)
    kk = g.standard_normal((B, H, L, dk))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    log_w = -np.exp(g.uniform(np.log(0.01), np.log(6.0), (B, H, L, dk)))
    log_w[:, :, 3, 0] = -np.inf
    xs = (g.standard_normal((B, H, L, dk)), g.standard_normal((B, H, L, dk)), g.standard_normal((B, H, L, dv)),
          log_w, -kk, kk * g.uniform(0.0, 1.0, (B, H, L, dk)), g.standard_normal((B, H, L)),
          g.standard_normal((B, H, L, dv)))
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def torch_dplr(q, k, v, log_w, a, b, bonus, after):
    """The recurrence one step at a time in torch: ``S_t = S_{t-1} (Diag(w_t) + a_t b_t^T) + v_t k_t^T``,
    ``o_t = S_t q_t`` (``after``) or ``S_{t-1} q_t``, plus ``bonus_t v_t``."""
    B, H, L, dk = q.shape
    S = torch.zeros(B, H, v.shape[-1], dk, dtype=q.dtype)
    out = []
    for t in range(L):
        prev = S
        S = prev * torch.exp(log_w[:, :, t])[:, :, None, :] + v[:, :, t, :, None] * k[:, :, t, None, :]
        if a is not None:
            S = S + (prev @ a[:, :, t, :, None]) * b[:, :, t, None, :]
        o = ((S if after else prev) @ q[:, :, t, :, None])[..., 0]
        out.append(o if bonus is None else o + bonus[:, :, t, None] * v[:, :, t])
    return torch.stack(out, 2)


@pytest.mark.parametrize("low_rank, bonus, after", list(itertools.product((False, True), repeat=3)))
def test_dplr_gradients_are_the_kernels_and_match_float64(low_rank, bonus, after):
    """Every combination of the optional terms; ``L = 70`` (the backward's stored states every 32
    positions: a ragged last chunk), ``d_k = 20`` and ``d_v = 17`` (no whole vectors)."""
    q, k, v, log_w, a, b, bo, ct = inputs(2, 2, 70, 20, 17, seed=int(low_rank) + 2 * bonus + 4 * after)
    extra = dict(a=a, b=b) if low_rank else {}
    if bonus:
        extra["bonus"] = bo
    args = (q, k, v, log_w, *extra.values())
    loss = lambda *xs: jnp.sum(ct * cpu.dplr_scan(*xs[:4], **dict(zip(extra, xs[4:])), after=after))
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    text = grad.lower(*args).as_text()
    assert VJP in text and "stablehlo.while" not in text  # the kernel, no XLA recurrence
    got = grad(*args)
    want = torch_grads(lambda q, k, v, w, a, b, bo: torch_dplr(q, k, v, w, a, b, bo, after),
                       (q, k, v, log_w, extra.get("a"), extra.get("b"), extra.get("bonus")), ct)
    for name, g, w in zip(("q", "k", "v", "log_w", *extra), got, want):
        assert np.isfinite(np.asarray(g)).all(), name
        assert rel(g, w) <= 2e-5, (name, rel(g, w))


def torch_delta(q, k, v, log_a, beta, erase):
    """The gated delta rule one step at a time: ``S_t = S_{t-1} Diag(a_t) (I - b_t k_t k_t^T) + b_t
    v_t k_t^T`` (without the erase term ``S_{t-1} Diag(a_t) + ...``), ``o_t = S_t q_t``."""
    B, H, L, dk = q.shape
    S = torch.zeros(B, H, v.shape[-1], dk, dtype=q.dtype)
    out = []
    for t in range(L):
        w = torch.exp(log_a[:, :, t])
        decayed = S * (w[..., None, None] if w.ndim == 2 else w[:, :, None, :])
        bt, kt = beta[:, :, t, None, None], k[:, :, t, None, :]
        S = decayed + bt * v[:, :, t, :, None] * kt
        if erase:
            S = S - bt * (decayed @ k[:, :, t, :, None]) * kt
        out.append((S @ q[:, :, t, :, None])[..., 0])
    return torch.stack(out, 2)


@pytest.mark.parametrize("erase, per_dim", [(True, False), (True, True), (False, False)])
def test_delta_gradients_are_the_kernels_and_match_float64(erase, per_dim):
    """``delta_scan``: the rule written as a DPLR recurrence, its cotangents pulled back to ``(q, k,
    v, log_a, beta)``; one decay per head or per key dimension (Kimi's)."""
    q, k, v, log_w, _, _, bo, ct = inputs(1, 3, 45, 6, 9, seed=11 + erase + 2 * per_dim)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    log_a = jnp.maximum(log_w, -8.0) if per_dim else jnp.maximum(log_w[..., 0], -8.0)
    beta = jax.nn.sigmoid(bo)
    args = (q, k, v, log_a, beta)
    grad = jax.jit(jax.grad(lambda *xs: jnp.sum(ct * cpu.delta_scan(*xs, erase=erase)), argnums=(0, 1, 2, 3, 4)))
    assert VJP in grad.lower(*args).as_text()
    want = torch_grads(lambda *xs: torch_delta(*xs, erase), args, ct)
    for name, g, w in zip(("q", "k", "v", "log_a", "beta"), grad(*args), want):
        assert rel(g, w) <= 2e-5, (name, rel(g, w))


@pytest.mark.parametrize("where", ["q", "v", "log_w", "a"])
def test_dplr_gradients_with_a_nan_input_have_torchs_nan_pattern(where):
    """One NaN input entry (head 1, ``t = 40``): the kernel's gradients are NaN exactly where
    torch's float64 autograd's are (the adjoint carries it to earlier positions and other
    operands, never to the other head), and equal elsewhere."""
    args = list(inputs(1, 2, 70, 8, 5, seed=5))
    ct = args.pop()
    i = ("q", "k", "v", "log_w", "a").index(where)
    args[i] = args[i].at[0, 1, 40, 3].set(jnp.nan)
    got = jax.jit(jax.grad(lambda *xs: jnp.sum(ct * cpu.dplr_scan(*xs, after=True)), argnums=tuple(range(7))))(*args)
    want = torch_grads(lambda *xs: torch_dplr(*xs, True), args, ct)
    names = ("q", "k", "v", "log_w", "a", "b", "bonus")
    assert assert_nan_pattern(names, got, want, lambda name, g: g[0, 0]) > 200  # the NaN did reach them


def test_reverse_kernel_composes_with_vmap_threads_and_export(monkeypatch):
    """``vmap`` of the gradient and the gradient of a ``vmap`` give each example's gradient alone
    (the same bits); one thread and three the same bits; cotangents only up to ``t = p`` give
    gradients exactly 0 after ``p``; forward mode goes through the reference's derivatives (equal to
    the reference's own); ``$IMPLICIT_ATTN_KERNEL_REVERSE=0`` transposes the
    reference instead; RWKV's recurrence exported for CUDA or TPU holds neither kernel."""
    from implicit_attn.families.rwkv6.block import dplr_outputs

    q, k, v, log_w, a, b, bo, ct = inputs(1, 2, 40, 8, 5, seed=3)
    run = lambda q, k: cpu.dplr_scan(q, k, v, log_w, a, b, bo, after=True)
    grad, one, _ = assert_vmap_either_side(run, q, k, ct)
    monkeypatch.setattr(cpu, "num_threads", lambda: 1)
    single = jax.jit(jax.grad(lambda q, k, c: jnp.sum(c * run(q, k)), argnums=(0, 1)))(q, k, ct)  # traced anew
    for x, y in zip(single, one):
        np.testing.assert_array_equal(x, y)
    monkeypatch.undo()

    early = grad(q, k, ct.at[:, :, 21:].set(0.0))
    assert np.all(np.asarray(early[0])[:, :, 21:] == 0) and np.all(np.asarray(early[1])[:, :, 21:] == 0)
    assert np.abs(np.asarray(early[0])[:, :, :21]).min(axis=-1).max() > 0

    ref = lambda q, k: dplr_rule(q, k, v, log_w, a, b, bo, after=True)
    tq = jnp.ones_like(q) * 0.1
    fwd, want = (jax.jit(lambda q, f=f: jax.jvp(lambda x: f(x, k), (q,), (tq,)))(q) for f in (run, ref))
    assert rel(fwd[1], np.asarray(want[1], np.float64)) <= 1e-5

    monkeypatch.setenv(cpu.KERNEL_REVERSE_ENV, "0")
    off = jax.jit(jax.grad(lambda q, k, c: jnp.sum(c * run(q, k)), argnums=(0, 1)))
    assert VJP not in off.lower(q, k, ct).as_text()
    assert rel(off(q, k, ct)[0], np.asarray(one[0], np.float64)) <= 1e-5
    monkeypatch.delenv(cpu.KERNEL_REVERSE_ENV)

    monkeypatch.setattr(cpu, "SCAN_AUTO_MIN_FACTOR", 1)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 1)
    model = lambda q: jnp.sum(ct * dplr_outputs(q, k, v, log_w, a, b, bo, after=True, chunk=8))
    assert VJP in jax.jit(jax.grad(model)).lower(q).as_text()
    for platform in ("cuda", "tpu"):
        module = jax.export.export(jax.jit(jax.grad(model)), platforms=[platform])(q).mlir_module()
        assert VJP not in module and "implicit_attn_dplr_scan" not in module, platform
