"""Full float32 matrix products everywhere the library computes.

On GPUs JAX's default float32 matmul may run in TF32 (10-bit mantissa): measured on an
H100, operators then reproduce their block's output only to ~1e-4 and logits differ from
torch by ~7e-4. The library's entry points trace under ``full_precision``, so every
product inside them is a true float32 one; the caller's own JAX settings are untouched.
"""
from __future__ import annotations

import functools

import jax


def full_precision(fn):
    """``fn`` traced with ``jax.default_matmul_precision("highest")`` (float32 products stay
    float32 on every backend; a no-op on CPU)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return wrapped


__all__ = ["full_precision"]
