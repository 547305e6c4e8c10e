"""Keeping NaN causal in chunked and matrix-form computations.

A chunked scan or a masked matmul multiplies later positions by exact zeros; when a later
position holds NaN, ``0 * NaN`` puts NaN into earlier outputs, which a sequential recurrence
never does. The fix used here: replace NaN inputs by 0 for the computation (so earlier
outputs are computed from exactly the numbers a sequential pass would use), then mark as
NaN every output a sequential pass would make NaN: from the first NaN that reaches the
carried state onwards, plus the positions whose own read-out input is NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def zero_nan(x, also=None):
    """``x`` with NaN entries, and those where ``also`` (a bool array broadcast against ``x``)
    is True, replaced by 0 (for a computation whose NaN outputs are restored by ``mark_nan``)."""
    drop = jnp.isnan(x) if also is None else jnp.isnan(x) | also
    return jnp.where(drop, jnp.zeros((), x.dtype), x)


def from_first(bad, axis: int = 1):
    """Boolean: True at and after the first True along ``axis`` (a state that took in a NaN
    stays NaN)."""
    # The first True's index, not a cumsum: XLA's CPU cumsum costs O(length) per element.
    n = bad.shape[axis]
    if n == 0:
        return bad.astype(bool)
    first = jnp.where(jnp.any(bad, axis=axis, keepdims=True), jnp.argmax(bad, axis=axis, keepdims=True), n)
    return jax.lax.broadcasted_iota(first.dtype, bad.shape, axis % bad.ndim) >= first


def mark_nan(y, bad):
    """``y`` with NaN where ``bad`` (broadcast against ``y``) is True."""
    return jnp.where(bad, jnp.asarray(jnp.nan, y.dtype), y)


def nan_rows(left, output):
    """An operator's row factor ``left (B, C, L)`` for cores built from ``zero_nan``-ed inputs:
    NaN where the block's own ``output (B, C, L)`` is NaN (so ``H``'s row is NaN exactly where
    the block's output is, as for the cores that keep NaN), its NaN-free values elsewhere."""
    return mark_nan(zero_nan(left), jnp.isnan(output))


__all__ = ["zero_nan", "from_first", "mark_nan", "nan_rows"]
