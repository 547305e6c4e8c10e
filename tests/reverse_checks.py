"""Shared checks of the reverse-mode kernels' gradients against torch's float64 autograd."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch


def torch_grads(fn, args, ct):
    """float64 gradients of ``sum(ct * fn(*args))`` (``None`` arguments passed through, no gradient)."""
    ts = [None if x is None else torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in args]
    (torch.tensor(np.asarray(ct, np.float64)) * fn(*ts)).sum().backward()
    return [t.grad.numpy() for t in ts if t is not None]


def assert_nan_pattern(names, got, want, untouched, tol: float = 2e-5) -> int:
    """Each gradient in ``got`` is NaN exactly where ``want``'s (float64) is, ``untouched(name, g)``
    (the part a NaN input must not reach, or None) holds none, and the rest equals ``want`` to
    ``tol`` of its largest entry. Returns how many entries of ``want`` are NaN."""
    reached = 0
    for name, g, w in zip(names, got, want):
        g = np.asarray(g, np.float64)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
        part = untouched(name, g)
        assert part is None or not np.isnan(part).any(), name
        ok = ~np.isnan(w)
        assert np.abs(g[ok] - w[ok]).max() <= tol * np.abs(w[ok]).max(), name
        reached += int(np.isnan(w).sum())
    return reached


def assert_vmap_either_side(run, x, y, ct):
    """``run(x, y)``'s gradients in both arguments: ``vmap`` of the gradient over ``x`` and ``2 x``,
    and the gradient of a ``vmap``, give each example's gradient alone (the same bits). Returns the
    jitted gradient ``(x, y, ct) -> (dx, dy)`` and its values at ``x`` and at ``2 x``."""
    grad = jax.jit(jax.grad(lambda x, y, c: jnp.sum(c * run(x, y)), argnums=(0, 1)))
    one, doubled = grad(x, y, ct), grad(2 * x, y, ct)
    twice = jax.vmap(grad, in_axes=(0, None, None))(jnp.stack([x, 2 * x]), y, ct)
    for i in range(2):
        np.testing.assert_array_equal(twice[i][0], one[i])
        np.testing.assert_array_equal(twice[i][1], doubled[i])
    outer = jax.grad(lambda xs: jnp.sum(ct * jax.vmap(run, in_axes=(0, None))(xs, y)))(jnp.stack([x, 2 * x]))
    np.testing.assert_array_equal(outer[0], one[0])
    np.testing.assert_array_equal(outer[1], doubled[0])
    return grad, one, doubled
